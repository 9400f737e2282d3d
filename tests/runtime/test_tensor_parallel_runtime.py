"""``LLM(path, tensor_parallel_size=2)`` on the CPU: rank 0 and one worker process (gloo) give
HuggingFace's greedy tokens through batching, chunked prefill and prefix-cache hits (with one KV
head, replicated on both ranks); ``zoo generate --tp 2`` runs (two KV heads, one per rank); a
worker that dies or fails to load takes the group down with a RuntimeError naming it, within
seconds and leaving no process behind; sizes the ranks cannot split fail before loading; a model
they cannot split raises its own NotImplementedError; Ctrl-C
waits for the step; interpreter exit stops the workers. On two GPUs (marked ``gpu``): NCCL, each
rank's CUDA graphs, the one-GPU tokens, and a killed worker.

A process runs one tensor-parallel group at a time: each test that starts its own shuts it down
before the next, and the tests on the module's LLM come last, the one killing its worker last of all."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime import LLM, EngineConfig, SamplingParams
from runtime.cli import main
from runtime.parallel import Ranks
from tests.conftest import hf_model, save_checkpoint, tiny_config
from tests.models.test_gpt_oss import gpt_oss_config, gpt_oss_hf_model, save_mxfp4_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = [[5, 9, 13, 2], [40, 41], list(range(3, 33)), [7] * 11]  # the third runs as two chunks below
ROOT = Path(__file__).resolve().parents[2]
OPTIONS = dict(device="cpu", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name, config in {"gqa": tiny_config("llama"),  # 2 KV heads: one per rank
                         "kv1": tiny_config("llama", num_key_value_heads=1)}.items():  # replicated on both
        model = hf_model(config)
        made[name] = (str(save_checkpoint(model, tmp_path_factory.mktemp(name))), model)
    return made


def hf_greedy(model, prompts, max_tokens=GREEDY.max_tokens) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


def assert_gone(processes) -> None:
    for process in processes:
        assert not process.is_alive()
        assert not alive(process.pid)  # reaped, not left a zombie


def test_sizes_the_ranks_cannot_split_fail_before_loading(tmp_path):
    path = save_checkpoint(hf_model(tiny_config("llama", num_attention_heads=3, num_key_value_heads=3,
                                                hidden_size=48)), tmp_path)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"attention heads \(3\) is not a multiple of 2"):
        LLM(str(path), **OPTIONS)
    assert time.monotonic() - start < 30
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(str(path), device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="compile_decode compiles a model that runs in one process"):
        LLM(str(path), device="cpu", tensor_parallel_size=2, compile_decode=True)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {10**20} on the CPU: .* {os.cpu_count()} cores"):
        LLM(str(path), device="cpu", tensor_parallel_size=10**20)


def test_a_model_tensor_parallelism_does_not_run_is_refused_with_its_own_error(tmp_path, capsys):
    # Every rank meets it; rank 0's NotImplementedError is raised as it is, not as the dead worker's RuntimeError.
    path = save_checkpoint(hf_model(tiny_config("olmo2")), tmp_path)
    start = time.monotonic()
    with pytest.raises(NotImplementedError, match="q/k norm spans all heads"):
        LLM(str(path), **OPTIONS)
    assert time.monotonic() - start < 30
    # On the command line: one error line, not a traceback.
    assert main(["generate", "--model", str(path), "--device", "cpu", "--tp", "2", "--token-ids", "5,9"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zoo generate: error: tensor parallelism cannot split model.layers.0.self_attn: its q/k norm spans all heads")


def test_a_worker_that_fails_to_load_reports_its_error(tmp_path):
    # Rank 0 loads nothing yet: the worker alone meets the missing checkpoint.
    ranks = Ranks.start(2, str(tmp_path / "missing"), torch.float32, torch.device("cpu"), EngineConfig())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)tensor-parallel rank 1 exited with code 1; it reported:\n"
                                           r"Traceback.*missing"):
        with ranks.together():
            ranks.fewest(1)
    assert time.monotonic() - start < 10
    assert_gone(ranks.workers)
    with pytest.raises(RuntimeError, match="the tensor-parallel group is down: tensor-parallel rank 1 exited"):
        ranks.check()


def test_the_ranks_share_the_cores_and_the_kv_cache_budget_and_give_them_back(checkpoints):
    path, _ = checkpoints["gqa"]  # one of the 2 KV heads on each rank: a rank's block is half the size
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one_rank = LLM(path, device="cpu", block_size=4, kv_cache_gib=2**-14).engine.block_manager.num_blocks
        llm = LLM(path, **OPTIONS, kv_cache_gib=2**-14)
        assert torch.get_num_threads() == 1
        assert llm.engine.block_manager.num_blocks == one_rank  # each rank's half of the budget, half a block each
        llm.shutdown()
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="does not fit the KV cache"):  # refused once the worker runs
            LLM(path, **OPTIONS, num_blocks=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_zoo_generate_runs_over_two_ranks_and_the_worker_ends_quietly(checkpoints, capfd):
    path, reference = checkpoints["gqa"]  # one of the 2 KV heads on each rank
    assert main(["generate", "--model", path, "--device", "cpu", "--tp", "2", "--token-ids", "5,9,13,2",
                 "--max-tokens", "6"]) == 0
    expected = hf_greedy(reference, [[5, 9, 13, 2]], max_tokens=6)[0]
    captured = capfd.readouterr()  # the worker's output too
    assert captured.out.splitlines()[0] == "5,9,13,2 ->" + "".join(f" {t}" for t in expected)
    # Its start-up objects thawed before it exits: triton's nanobind named those never freed (~600 lines).
    assert "leaked" not in captured.err


def test_zoo_generate_keeps_mxfp4_experts_over_two_ranks(tmp_path, capfd):
    """gpt-oss's MXFP4 experts kept in MXFP4 (--keep-mxfp4), 2 of 4 on each rank: HF's greedy tokens over
    the values transformers dequantises them to."""
    reference = gpt_oss_hf_model(gpt_oss_config(num_local_experts=4))
    path = save_mxfp4_checkpoint(reference, tmp_path / "ckpt")
    assert main(["generate", "--model", str(path), "--device", "cpu", "--tp", "2", "--keep-mxfp4", "--token-ids",
                 "5,9,13,2", "--max-tokens", "6"]) == 0
    expected = hf_greedy(reference, [[5, 9, 13, 2]], max_tokens=6)[0]
    assert capfd.readouterr().out.splitlines()[0] == "5,9,13,2 ->" + "".join(f" {t}" for t in expected)


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_gpus_give_the_one_gpu_tokens(checkpoints, enforce_eager):
    # Each rank captures and replays its own decode graphs, NCCL collectives inside them.
    path, _ = checkpoints["gqa"]
    options = dict(dtype="float32", max_num_seqs=8, block_size=4, max_num_batched_tokens=24, kv_cache_gib=0.25,
                   enforce_eager=enforce_eager)
    expected = token_ids(LLM(path, device="cuda", **options).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(path, device="cuda", tensor_parallel_size=2, **options)
    try:
        assert (llm.engine.runner.graphs is None) == enforce_eager
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected  # the graphs replayed again
    finally:
        llm.shutdown()
    assert_gone(llm.ranks.workers)


@pytest.mark.gpu
@needs_two_gpus
def test_a_killed_gpu_worker_takes_the_group_down_without_waiting_for_nccl(checkpoints):
    llm = LLM(checkpoints["gqa"][0], device="cuda", dtype="float32", tensor_parallel_size=2, max_num_seqs=8,
              kv_cache_gib=0.25)
    worker = llm.ranks.workers[0]
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 was killed by signal 9"):
        while time.monotonic() - start < 60:  # generating when the worker is killed
            llm.generate([[5, 9, 13, 2]] * 4, long, use_tqdm=False)
    assert time.monotonic() - start < 15
    llm.shutdown()
    assert_gone(llm.ranks.workers)


EXIT_WITHOUT_SHUTDOWN = """
import sys
from runtime import LLM
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
print(*[worker.pid for worker in llm.ranks.workers], flush=True)
"""


def test_interpreter_exit_stops_the_workers(checkpoints):
    path, _ = checkpoints["gqa"]
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, path], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def tp_llm(checkpoints):
    llm = LLM(checkpoints["kv1"][0], **OPTIONS)
    llm.engine.run_ahead.runs_ahead = True  # as on CUDA: the other ranks read pending ids from their own copy
    yield llm
    llm.shutdown()
    assert_gone(llm.ranks.workers)


def test_greedy_tokens_equal_hf_through_batching_chunked_prefill_and_prefix_hits(tp_llm, checkpoints):
    _, reference = checkpoints["kv1"]
    model = tp_llm.model  # the one KV head on both ranks, each with its 2 query heads
    assert model.model.layers[0].self_attn.num_heads == 2 and model.model.layers[0].self_attn.num_kv_heads == 1
    assert model.lm_head.vocab == slice(0, 49)
    expected = hf_greedy(reference, PROMPTS)
    first = tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(first) == expected
    again = tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the prompts' full blocks come from the cache
    assert token_ids(again) == expected
    assert [o.num_cached_tokens for o in again] == [0, 0, 28, 8]
    alone = [token_ids(tp_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert alone == expected


def generating(llm, steps: int) -> None:
    """Returns once ``llm`` has run ``steps`` steps ahead, in the generate of another thread."""
    while llm.engine.run_ahead.num_steps_run_ahead < steps:
        time.sleep(0.01)


def test_ctrl_c_stops_generate_between_steps_and_the_group_goes_on(tp_llm, checkpoints):
    ahead = tp_llm.engine.run_ahead.num_steps_run_ahead
    threading.Thread(target=lambda: (generating(tp_llm, ahead + 3), os.kill(os.getpid(), signal.SIGINT)),
                     daemon=True).start()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        tp_llm.generate([[5, 9, 13, 2]] * 3, long, use_tqdm=False)
    assert not tp_llm.engine.scheduler.has_unfinished()
    assert token_ids(tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == hf_greedy(checkpoints["kv1"][1], PROMPTS)


def test_a_killed_worker_takes_the_group_down_with_a_clear_error(tp_llm):
    worker = tp_llm.ranks.workers[0]
    killed = []

    def kill_once_generating():
        generating(tp_llm, tp_llm.engine.run_ahead.num_steps_run_ahead + 3)
        killed.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    threading.Thread(target=kill_once_generating, daemon=True).start()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 was killed by signal 9"):
        tp_llm.generate([[5, 9, 13, 2]] * 3, long, use_tqdm=False)
    assert killed and time.monotonic() - killed[0] < 10
    assert_gone(tp_llm.ranks.workers)
    with pytest.raises(RuntimeError, match="the tensor-parallel group is down: tensor-parallel rank 1 was killed"):
        tp_llm.generate([[5, 9]], GREEDY, use_tqdm=False)


