"""The benchmarks' helpers that run without a GPU: bench_gpu.py's clock sampler (gpu_clocks), read
from a stand-in nvidia-smi, its first-call prompts and its HF continuous-batching peer,
bench_serve.py's counts of one rate, bench_decode_ab.py's kernel swap and its rounds, and the models
bench_decode_without.py and profile_decode.py build."""

import importlib
import os
import time
import types
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import tiny_config

SAMPLES = """1980, 1980, 130.50, 700.00, Not Active
No sample on this line
1635, 1980, 694.00, 700.00, Active
[N/A], 1980, 80.00, 700.00, Not Active
1560, 1980, 695.50, 700.00, Active
"""


def test_gpu_clocks_reads_the_sm_clock_power_and_power_cap_from_nvidia_smi(tmp_path, monkeypatch):
    bench_gpu = importlib.import_module("benchmarks.bench_gpu")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{SAMPLES}'\necho \"$@\" > {tmp_path}/args\nexec sleep 60\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="1234-abcd"))
    readings = {}
    start = time.perf_counter()
    with bench_gpu.gpu_clocks(readings):
        while not (tmp_path / "args").exists() and time.perf_counter() - start < 20:
            time.sleep(0.05)
    assert time.perf_counter() - start < 30  # the sampler is stopped, not waited for
    args = (tmp_path / "args").read_text().split()
    assert args[:2] == ["-i", "GPU-1234-abcd"] and args[-2:] == ["-lms", "500"]
    assert readings == dict(samples=3, sm_clock_mhz=1635.0, max_sm_clock_mhz=1980.0, power_w=694.0,
                            power_limit_w=700.0, power_capped=2 / 3)
    assert bench_gpu.clocks_text(readings) == ("SM clock median 1635 MHz (highest 1980), power median 694 W "
                                               "(limit 700 W), held back by the power cap in 67% of 3 samples")


def test_gpu_clocks_reads_nothing_without_nvidia_smi(tmp_path, monkeypatch):
    bench_gpu = importlib.import_module("benchmarks.bench_gpu")
    monkeypatch.setenv("PATH", str(tmp_path))
    readings = {}
    with bench_gpu.gpu_clocks(readings):
        pass
    assert readings == {} and bench_gpu.clocks_text(readings) == "no clock readings (nvidia-smi missing)"


def test_first_call_prompts_span_two_steps_when_given_the_step_size():
    bench_gpu = importlib.import_module("benchmarks.bench_gpu")
    prompts = [list(range(i, i + 1000)) for i in range(20)]
    assert bench_gpu.first_call_prompts(prompts, 4) == [p[::-1] for p in prompts[:4]]
    assert len(bench_gpu.first_call_prompts(prompts, 4, 8192)) == 9  # 9,000 tokens: the ninth spills over
    assert len(bench_gpu.first_call_prompts(prompts, 12, 8192)) == 12
    assert len(bench_gpu.first_call_prompts(prompts[:3], 2, 8192)) == 3  # all there are


def test_hf_continuous_batching_runs_every_request_to_its_length_with_the_kv_memory_share_given():
    """bench_gpu's HF peer on CPU: HF's real manager over a tiny Llama, each request its own length,
    the KV cache's share of the free memory handed to HF's manager."""
    bench_gpu = importlib.import_module("benchmarks.bench_gpu")
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    managers = []
    start_manager = model.init_continuous_batching

    def recorded(**kwargs):
        managers.append(start_manager(**kwargs))
        return managers[-1]

    model.init_continuous_batching = recorded
    startup = {}
    tokens, seconds = bench_gpu.hf_continuous_batching(model, [[1, 2, 3, 4, 5], [6, 7, 8]], [4, 6], startup, 0.05)
    assert tokens == 10 and seconds > 0
    assert managers[0].continuous_batching_config.max_memory_percent == 0.05
    assert set(startup) == {"HF manager", "HF warm-up (CUDA graphs)", "HF first call"}


def test_bench_serve_counts_the_usage_tokens_and_the_requests_that_made_their_drawn_length():
    bench_serve = importlib.import_module("benchmarks.bench_serve")
    Result = bench_serve.Result
    # Chunks at these times (s); the second request's usage says 3 tokens over 2 chunks (a special
    # token streams no text), one short of its drawn 4.
    results = [Result(0.1, 3, [0.3, 0.4, 0.6], tokens=3), Result(0.2, 4, [0.5, 0.9], tokens=3),
               Result(0.3, 2, error="boom")]
    clients = types.SimpleNamespace(send=lambda *args: (0.0, results))
    row = bench_serve.run_rate(clients, "http://server", "m", [None] * 3, {})
    assert (row["completed"], row["errors"], row["first_error"], row["drawn_lengths"]) == (2, 1, "boom", 1)
    # From the first request's send (0.1 s after the schedule's start) to the last chunk
    assert row["output_tokens"] == 6 and row["seconds"] == pytest.approx(0.8)
    assert row["output_tokens_per_s"] == pytest.approx(6 / 0.8) and row["requests_per_s"] == pytest.approx(2 / 0.8)
    assert row["ttft_p50_ms"] == pytest.approx(250.0) and row["itl_p50_ms"] == pytest.approx(200.0)
    assert [r["total_ms"] for r in row["per_request"]] == pytest.approx([500.0, 700.0])

    results.append(Result(0.4, 1, [0.5]))  # a response that ended with no usage
    with pytest.raises(RuntimeError, match="no usage"):
        bench_serve.run_rate(clients, "http://server", "m", [None] * 4, {})


def test_bench_decode_ab_swaps_in_the_other_trees_kernel_and_puts_this_trees_back(tmp_path):
    bench_decode_ab = importlib.import_module("benchmarks.bench_decode_ab")
    import ops_cuda.triton_kernels as kernels

    (tmp_path / "ops_cuda").mkdir()
    (tmp_path / "ops_cuda" / "triton_kernels.py").write_text(Path(kernels.__file__).read_text())
    swaps = bench_decode_ab.base_kernels(tmp_path, ["ops_cuda/triton_kernels.py:_rms_norm_kernel"])
    ours = kernels._rms_norm_kernel
    ((module, name, theirs),) = swaps
    assert module is kernels and name == "_rms_norm_kernel" and theirs is not ours
    assert Path(theirs.fn.__code__.co_filename) == tmp_path / "ops_cuda" / "triton_kernels.py"
    with bench_decode_ab.swapped(swaps):
        assert kernels._rms_norm_kernel is theirs
    assert kernels._rms_norm_kernel is ours


def test_bench_decode_ab_gives_the_other_trees_launcher_that_trees_helpers(tmp_path):
    """A launcher's file and a helper's file both named: the other tree's launcher module, which imported
    this tree's helper, runs the other tree's helper, and this tree's modules keep their own."""
    bench_decode_ab = importlib.import_module("benchmarks.bench_decode_ab")
    import ops_cuda.moe_decode as moe_decode
    import ops_cuda.mxfp4_triton as mxfp4_triton

    (tmp_path / "ops_cuda").mkdir()
    for module in (moe_decode, mxfp4_triton):
        (tmp_path / "ops_cuda" / Path(module.__file__).name).write_text(Path(module.__file__).read_text())
    swaps = bench_decode_ab.base_kernels(tmp_path, ["ops_cuda/moe_decode.py:moe_experts_mxfp4_token",
                                                    "ops_cuda/mxfp4_triton.py:mxfp4_rows_times_vector"])
    (_, _, launcher), (_, _, helper) = swaps
    base_moe_decode = launcher.__globals__  # the other tree's module, as its kernels look names up
    assert helper is not mxfp4_triton.mxfp4_rows_times_vector
    assert Path(helper.fn.__code__.co_filename) == tmp_path / "ops_cuda" / "mxfp4_triton.py"
    assert base_moe_decode["mxfp4_rows_times_vector"] is helper
    assert base_moe_decode["mxfp4_row_words"] is not mxfp4_triton.mxfp4_row_words  # every name from that file
    assert base_moe_decode["weighted_slot_sum"] is moe_decode.weighted_slot_sum  # triton_helpers.py was not named
    assert moe_decode.mxfp4_rows_times_vector is mxfp4_triton.mxfp4_rows_times_vector


def test_bench_decode_ab_times_each_configuration_with_its_trees_objects_in_every_round(tmp_path, monkeypatch):
    """--also trees add configurations: each round times this tree's kernel, then each other tree's in
    the order given, and puts this tree's back after each."""
    bench_decode_ab = importlib.import_module("benchmarks.bench_decode_ab")
    import ops_cuda.triton_kernels as kernels

    source = Path(kernels.__file__).read_text()
    configurations = {"this": []}
    for label in ("base", "variant"):
        (tmp_path / label / "ops_cuda").mkdir(parents=True)
        (tmp_path / label / "ops_cuda" / "triton_kernels.py").write_text(source)
        configurations[label] = bench_decode_ab.base_kernels(tmp_path / label,
                                                             ["ops_cuda/triton_kernels.py:_rms_norm_kernel"])
    ours = kernels._rms_norm_kernel
    monkeypatch.setattr(bench_decode_ab, "free_memory", lambda: None)

    def timed():
        kernel = kernels._rms_norm_kernel
        return ["this" if kernel is ours else Path(kernel.fn.__code__.co_filename).parents[1].name]

    assert list(bench_decode_ab.rounds(configurations, 2, timed)) == [
        (label, [label]) for label in ("this", "base", "variant") * 2]
    assert kernels._rms_norm_kernel is ours


@pytest.mark.parametrize("also", ["base=/tmp/other", "this=/tmp/other", "=/tmp/other", "variant"])
def test_bench_decode_ab_wants_a_label_of_its_own_and_a_tree_for_each_also(also, monkeypatch, capsys):
    bench_decode_ab = importlib.import_module("benchmarks.bench_decode_ab")
    monkeypatch.setattr("sys.argv", ["bench_decode_ab.py", "/tmp/base", "ops_cuda/norm.py:rms_norm", "--also", also])
    with pytest.raises(SystemExit):
        bench_decode_ab.main()
    assert f"--also {also!r}: give LABEL=TREE" in capsys.readouterr().err


def test_bench_decode_without_builds_each_shape_it_names(monkeypatch):
    """model_and_prompt builds the Qwen3-30B-A3B shape from bench_moe's random HF model of that shape, the
    gpt-oss-20b shape with MXFP4 experts (bench_decode_ab.py's), and a prompt within each vocabulary."""
    bench_decode_without = importlib.import_module("benchmarks.bench_decode_without")
    built = []
    monkeypatch.setattr(bench_decode_without, "zoo_from_random_hf",
                        lambda shape: built.append(("hf", shape)) or f"zoo {shape}")
    monkeypatch.setattr(bench_decode_without, "zoo_8b", lambda: "zoo 8b")
    monkeypatch.setattr(bench_decode_without, "random_mxfp4_zoo", lambda shape: f"zoo mxfp4 {shape}")
    monkeypatch.setattr(bench_decode_without, "free_memory", lambda: None)
    for shape, expected in (("qwen3-30b-a3b", "zoo qwen3-30b-a3b"), ("llama-3.1-8b", "zoo 8b"),
                            ("gpt-oss-20b", "zoo mxfp4 gpt-oss-20b")):
        model, prompt = bench_decode_without.model_and_prompt(shape)
        vocab = {**bench_decode_without.SHAPES, **bench_decode_without.MOE_SHAPES}[shape]["vocab_size"]
        assert model == expected and len(prompt) == bench_decode_without.PROMPT_LEN
        assert 0 <= min(prompt) and max(prompt) < vocab
    assert built == [("hf", "qwen3-30b-a3b")]


def test_bench_decode_ab_names_what_it_cannot_swap(tmp_path):
    bench_decode_ab = importlib.import_module("benchmarks.bench_decode_ab")
    (tmp_path / "ops_cuda").mkdir()
    (tmp_path / "ops_cuda" / "norm.py").write_text("")
    with pytest.raises(ValueError, match="FILE.py:NAME"):
        bench_decode_ab.base_kernels(tmp_path, ["ops_cuda/norm.py"])
    with pytest.raises(FileNotFoundError, match="no ops_cuda/gemv.py under"):
        bench_decode_ab.base_kernels(tmp_path, ["ops_cuda/gemv.py:gemv"])
    with pytest.raises(AttributeError, match="has no rms_norm"):
        bench_decode_ab.base_kernels(tmp_path, ["ops_cuda/norm.py:rms_norm"])


def test_bench_serve_shares_a_rate_among_client_processes_on_one_schedule(tmp_path):
    from runtime import LLM
    from tests.runtime.test_server import MODEL, save_chat_checkpoint, serving

    bench_serve = importlib.import_module("benchmarks.bench_serve")
    path = save_chat_checkpoint(tmp_path / "ckpt")
    requests = [bench_serve.Request(0.05 * i, f"request {i}", 4) for i in range(6)]
    with serving(LLM(str(path), device="cpu"), api_key=None) as base_url, bench_serve.Clients(2) as clients:
        row = bench_serve.run_rate(clients, base_url, MODEL, requests, {"ignore_eos": True})
    assert (row["completed"], row["errors"]) == (6, 0)
    # Each request sent once, none before its arrival on the schedule the two processes share.
    sent = sorted(r["sent_s"] for r in row["per_request"])
    assert all(s >= arrival for s, arrival in zip(sent, sorted(r.arrival for r in requests)))
    assert sent[-1] < requests[-1].arrival + 1.0


def test_bench_serve_dequantizes_a_gguf_file_into_a_checkpoint_the_peer_loads(tmp_path):
    """`transformers serve` loads no GGUF file: bench_serve gives both servers the file's model
    dequantized, the same weights and tokenizer as transformers reads from the file."""
    import transformers

    from loaders import load_tokenizer
    from tests.loaders.gguf_writer import T, write_llama_gguf

    bench_serve = importlib.import_module("benchmarks.bench_serve")
    gguf = tmp_path / "tiny.gguf"
    write_llama_gguf(gguf, T.Q4_1, tokenizer="gpt2")
    path = bench_serve.dequantized_checkpoint(gguf, tmp_path / "work")
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                dtype=torch.float32)
    assert getattr(saved.config, "quantization_config", None) is None and saved.dtype == torch.float32
    expected = theirs.state_dict()
    assert saved.state_dict().keys() == expected.keys()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    text = "a tiny tokenizer's text"
    assert load_tokenizer(str(path))(text)["input_ids"] == load_tokenizer(str(gguf))(text)["input_ids"]
    assert bench_serve.dequantized_checkpoint(gguf, tmp_path / "work") == path  # written once


def test_a_work_directory_written_once_is_reused_and_a_cut_off_write_is_not(tmp_path):
    written_once = importlib.import_module("benchmarks.workdir").written_once
    target = tmp_path / "work" / "checkpoint"

    def cut_off(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as a killed write

    with pytest.raises(KeyboardInterrupt):
        written_once(target, cut_off)
    assert list((tmp_path / "work").iterdir()) == []
    target.mkdir()
    (target / "config.json").write_text("{}")  # renamed into place but never marked complete
    writes = []

    def write(folder: Path) -> None:
        writes.append(folder)
        (folder / "model.safetensors").write_text("every weight")

    assert written_once(target, write) == target
    assert sorted(p.name for p in target.iterdir()) == [".complete", "model.safetensors"]
    assert written_once(target, write) == target and len(writes) == 1  # reused


def test_profile_decode_builds_the_qwen3_shape_as_bench_moe_does(monkeypatch):
    """profile_decode.py --shape qwen3-30b-a3b takes bench_moe's zoo model of that shape (through host
    memory on an 80 GB GPU) and charges it the weights one decode step reads."""
    profile_decode = importlib.import_module("benchmarks.profile_decode")
    bench_moe = importlib.import_module("bench_moe")
    monkeypatch.setattr(bench_moe, "zoo_from_random_hf", lambda shape: f"zoo {shape}")
    monkeypatch.setattr(bench_moe, "active_weight_bytes",
                        lambda model: (6.08e9 if model == "zoo qwen3-30b-a3b" else 0, 0))
    assert profile_decode.qwen3_30b_a3b() == ("zoo qwen3-30b-a3b", 6.08e9)


def test_profile_decode_builds_the_deepseek_v3_shape_as_bench_deepseek_does(monkeypatch):
    """profile_decode.py --shape deepseek-v3-3layer takes zoo's copy of bench_deepseek's random HF model
    through bench_moe.zoo_copy_of (host memory on an 80 GB GPU, where both copies do not fit)."""
    profile_decode = importlib.import_module("benchmarks.profile_decode")
    bench_moe, bench_deepseek = importlib.import_module("bench_moe"), importlib.import_module("bench_deepseek")
    monkeypatch.setattr(bench_deepseek, "random_hf", lambda layers: f"hf {layers} layers")
    monkeypatch.setattr(bench_moe, "zoo_copy_of", lambda reference: f"zoo of {reference}")
    monkeypatch.setattr(bench_deepseek, "active_weight_bytes",
                        lambda model: 7.4e9 if model == "zoo of hf 3 layers" else 0)
    assert profile_decode.deepseek_v3_3layer() == ("zoo of hf 3 layers", 7.4e9)
