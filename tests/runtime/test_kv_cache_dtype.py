"""``LLM(..., kv_cache_dtype="fp8")``: float8_e4m3fn pools, a budget counted at a byte a value, and
greedy generation through them end to end on Llama and DeepSeek-V3 (MLA's latent pool)."""

import importlib
import types

import pytest
import torch

from layers import TorchAttentionBackend
from models import AutoModelForCausalLM
from runtime import LLM, EngineConfig, SamplingParams
from runtime.cli import KV_CACHE_DTYPES as CLI_KV_CACHE_DTYPES
from runtime.config import KV_CACHE_DTYPES
from runtime.kv_cache import cache_dtype
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_deepseek_v3 import VARIANTS as DEEPSEEK_VARIANTS, deepseek_hf_model
from tests.runtime.test_runtime import prompts, token_ids

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "llama": save_checkpoint(hf_model(tiny_config("llama")), tmp_path_factory.mktemp("llama")),
        "deepseek_v3": save_checkpoint(deepseek_hf_model(DEEPSEEK_VARIANTS["q_lora-interleaved-groups"]),
                                       tmp_path_factory.mktemp("deepseek_v3")),
    }


def llm(path, **options):
    return LLM(str(path), device="cpu", block_size=4, **options)


def test_an_unknown_kv_cache_dtype_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'fp16'; choose one of auto, fp8"):
        EngineConfig(kv_cache_dtype="fp16")
    assert CLI_KV_CACHE_DTYPES == KV_CACHE_DTYPES


def test_fp8_on_a_cuda_device_without_fp8_conversions_says_so(monkeypatch):
    parameter = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    model = types.SimpleNamespace(parameters=lambda: iter([parameter]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a CUDA device of compute capability 8.9 or "
                                         r"later; NVIDIA A100 is 8.0"):
        cache_dtype("fp8", model)
    assert cache_dtype("auto", model) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cache_dtype("fp8", model) == torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_fp8_pools_hold_twice_the_blocks_of_bfloat16_ones(checkpoints, name):
    budget = dict(dtype="bfloat16", kv_cache_gib=2**-14)  # 64 KiB: fewer blocks than the sequences could use
    auto, fp8 = llm(checkpoints[name], **budget).engine, llm(checkpoints[name], kv_cache_dtype="fp8", **budget).engine
    assert {pool.dtype for pools in auto.kv_cache.pools for pool in pools} == {torch.bfloat16}
    assert {pool.dtype for pools in fp8.kv_cache.pools for pool in pools} == {torch.float8_e4m3fn}
    assert fp8.kv_cache.num_blocks in (2 * auto.kv_cache.num_blocks, 2 * auto.kv_cache.num_blocks + 1)  # floors
    assert fp8.block_manager.num_blocks == fp8.kv_cache.num_blocks


def test_an_fp8_cache_stores_v_key_minor_and_a_bfloat16_one_does_not(checkpoints):
    # Each pool is the [blocks, block_size, kv_heads, head_dim] view the ops take; behind it an FP8
    # V pool holds each block's keys side by side for every dim, MLA's latent pool its rows.
    budget = dict(dtype="bfloat16", kv_cache_gib=2**-14)
    for kv_cache_dtype in ("auto", "fp8"):
        for k_pool, v_pool in llm(checkpoints["llama"], kv_cache_dtype=kv_cache_dtype, **budget).engine.kv_cache.pools:
            blocks, block_size, heads, dim = v_pool.shape
            assert k_pool.shape == v_pool.shape and block_size == 4 and k_pool.is_contiguous()
            if kv_cache_dtype == "fp8":
                assert v_pool.stride() == (heads * dim * block_size, 1, dim * block_size, block_size)
            else:
                assert v_pool.is_contiguous()
    for (latent,) in llm(checkpoints["deepseek_v3"], kv_cache_dtype="fp8", **budget).engine.kv_cache.pools:
        assert latent.is_contiguous()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_greedy_generation_through_an_fp8_cache_runs_on_both_backends(checkpoints, name):
    # On the CPU both backends run the references (the triton backend through its own prompt path
    # for MLA): the same tokens; every prompt gets all its tokens.
    batch = prompts(5)
    outputs = {backend: token_ids(llm(checkpoints[name], kv_cache_dtype="fp8", attention_backend=backend)
                                  .generate(batch, GREEDY, use_tqdm=False))
               for backend in ("torch", "triton")}
    assert outputs["torch"] == outputs["triton"]
    assert [len(tokens) for tokens in outputs["torch"]] == [12] * len(batch)
    # The first token comes from the prompt's logits, read over e4m3 keys and values: the same as
    # the model's dtype gives for most prompts of these nearly flat random models.
    auto = token_ids(llm(checkpoints[name]).generate(batch, GREEDY, use_tqdm=False))
    assert sum(a[0] == b[0] for a, b in zip(auto, outputs["torch"])) >= 4


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_agreement_benchmark_decode_steps_give_one_prefills_logits(checkpoints, name, monkeypatch):
    # benchmarks/bf16_agreement.py --kv-cache-dtype fp8 --decode: its positions after the prompt go
    # through the backend's decode attention, one step each, and give the logits one prefill gives
    # there, so that its figures measure decode attention over the prompt's positions.
    agreement = importlib.import_module("benchmarks.bf16_agreement")
    model = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    input_ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    prompt = agreement.paged_logits(model, input_ids, "auto")
    decode_rows = []
    for method in ("attend_decodes", "decode_latent"):
        def spy(self, q, *args, original=getattr(TorchAttentionBackend, method)):
            decode_rows.append(q.shape[0])
            return original(self, q, *args)
        monkeypatch.setattr(TorchAttentionBackend, method, spy)
    steps = agreement.paged_logits(model, input_ids, "auto", decode=True)
    assert decode_rows == [2] * (24 - agreement.DECODE_PROMPT) * model.config.num_hidden_layers
    assert steps.shape == (2, 24 - agreement.DECODE_PROMPT, 97)
    assert relative_error(steps, prompt[:, agreement.DECODE_PROMPT:]) <= 1e-5  # measured 1.5e-6
    assert not torch.equal(agreement.paged_logits(model, input_ids, "fp8", decode=True), steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_steps_give_logits_an_e4m3_rounding_from_the_model_dtypes(checkpoints, dtype):
    # Each decode step's logits read over the e4m3 cache's keys and values stay within two e4m3
    # roundings (2**-4 relative each) of those over the model's dtype: 0.09-0.10 on this model,
    # where entries written 10% too large put them at 0.23 and values read back as zeros past 1.
    agreement = importlib.import_module("benchmarks.bf16_agreement")
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=dtype)
    input_ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    auto = agreement.paged_logits(model, input_ids, "auto", decode=True).float()
    fp8 = agreement.paged_logits(model, input_ids, "fp8", decode=True).float()
    assert auto.shape[1] == 24 - agreement.DECODE_PROMPT == 8
    for step in range(auto.shape[1]):
        assert relative_error(fp8[:, step], auto[:, step]) < 2 * 2**-4, step


def test_agreement_benchmark_counts_a_pick_that_ties_the_best_logit_when_asked():
    agreement = importlib.import_module("benchmarks.bf16_agreement")
    reference = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 0.0, 0.0]])  # the first row's best two tie
    other = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 5.0, 0.0, 0.0]])  # picks the other tied one, then a loser
    assert agreement.top_tied(reference) == 0.5
    assert agreement.compare(other, reference)[0] == 0.0
    assert agreement.agreement_ties_counted(other, reference) == 0.5
    assert agreement.agreement_ties_counted(reference, reference) == 1.0


@pytest.mark.parametrize("name, decode", [("llama", False), ("llama", True), ("deepseek_v3", True)],
                         ids=["llama-prompt", "llama-decode", "deepseek_v3-decode"])
def test_agreement_benchmark_floor_rounds_the_bf16_caches_entries_once_more(checkpoints, name, decode):
    # bf16_agreement.py --kv-cache-dtype's floor: the bf16 cache with every layer's scales at
    # ROUNDING_SCALE. A power of two divides and multiplies back exactly: the same logits. The
    # benchmark's scale rounds every entry once more: other logits, a bf16 rounding apart (a prompt's
    # attention too, which then reads its new tokens back from the cache).
    agreement = importlib.import_module("benchmarks.bf16_agreement")
    model = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.bfloat16)
    input_ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    bf16 = agreement.paged_logits(model, input_ids, "auto", decode)
    with agreement.kv_scales(model, 2.0):
        torch.testing.assert_close(agreement.paged_logits(model, input_ids, "auto", decode), bf16,
                                   rtol=0, atol=0)
    with agreement.kv_scales(model, agreement.ROUNDING_SCALE):
        rounded = agreement.paged_logits(model, input_ids, "auto", decode)
    assert not torch.equal(rounded, bf16)
    torch.testing.assert_close(rounded, bf16, rtol=0, atol=0.05 * bf16.abs().max().item())  # measured 0.02-0.03
    scales = {getattr(m, n) for m in model.modules() for n in ("k_scale", "v_scale", "kv_scale") if hasattr(m, n)}
    assert scales == {1.0}
    torch.testing.assert_close(agreement.paged_logits(model, input_ids, "auto", decode), bf16, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_cache_on_cuda_replays_graphs_to_the_eager_tokens(checkpoints, name, dtype):
    # The triton backend's kernels over e4m3 pools: captured decode steps give the eager steps' tokens,
    # and the torch backend's references over the same pools agree on most first tokens.
    batch = prompts(6)

    def generate(**options):
        engine_llm = LLM(str(checkpoints[name]), device="cuda", dtype=dtype, block_size=16, kv_cache_dtype="fp8",
                         **options)
        assert {p.dtype for pools in engine_llm.engine.kv_cache.pools for p in pools} == {torch.float8_e4m3fn}
        assert (engine_llm.engine.runner.graphs is not None) == (not options)  # eager: enforced, or the torch backend
        return token_ids(engine_llm.generate(batch, GREEDY, use_tqdm=False))

    graphs = generate()
    assert graphs == generate(enforce_eager=True)
    torch_backend = generate(attention_backend="torch")
    assert sum(a[0] == b[0] for a, b in zip(graphs, torch_backend)) >= 5
