"""CPU decode steps compiled with torch.compile (``LLM(..., compile_decode=True)``): the tokens of
HuggingFace's generate, as eager steps give them, from one compile for every batch size."""

import pytest
import torch
from torch._dynamo.utils import counters

import runtime.compiled_decode
from layers import LMHead, Linear
from ops_cuda.linear import PackedWeight
from runtime import LLM, SamplingParams
from tests.conftest import hf_model, save_checkpoint, tiny_config
from tests.models.test_moe import MIXTRAL
from tests.models.test_parity import VARIANTS

ARCHITECTURES = {
    "llama": tiny_config("llama"),
    "mistral-window": tiny_config("mistral", sliding_window=6),
    "qwen3": tiny_config("qwen3", head_dim=16),  # q/k norm
    "mixtral": tiny_config("mixtral", **MIXTRAL),  # the experts stay an opaque op in the graph
    "gemma2": VARIANTS["gemma2"],  # four norm slots, soft-capped attention and logits, scaled embeddings
}
# 18 prompts, at most 20 at once, each allowed a different number of tokens: the batch of decodes
# shrinks from 18 sequences to 1, every size through the one compiled graph.
PROMPTS = [[3 + (7 * i + 5 * j) % 90 for j in range(1 + (11 * i) % 23)] for i in range(18)]
MAX_TOKENS = [4 + (5 * i) % 19 for i in range(18)]


def compiles() -> int:
    return counters["stats"]["unique_graphs"]


def products_per_step(model) -> int:
    return sum(isinstance(m, (Linear, LMHead)) and m.packed is not None for m in model.modules())


def has_cpp_compiler() -> bool:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_compiled_decode_steps_give_hf_tokens_from_one_compile(name, tmp_path, monkeypatch):
    reference = hf_model(ARCHITECTURES[name])
    path = save_checkpoint(reference, tmp_path)
    before = compiles()
    llm = LLM(str(path), device="cpu", block_size=4, max_num_seqs=20, compile_decode=True)
    assert compiles() == before + 1  # at start, not at the first step

    steps = {"compiled": 0, "eager": 0, "eager decodes": 0, "compiled packed products": 0, "in compiled": False,
             "compiled batches": set()}
    compiled_run, eager_model = runtime.compiled_decode.CompiledDecode.run, llm.engine.runner.model
    packed_linear = PackedWeight.linear

    def count_compiled(self, step):
        steps["compiled"] += 1
        steps["compiled batches"].add(len(step.input_ids))
        steps["in compiled"] = True
        try:
            return compiled_run(self, step)
        finally:
            steps["in compiled"] = False

    def count_packed(self, x, bias):
        steps["compiled packed products"] += steps["in compiled"]
        return packed_linear(self, x, bias)

    def count_eager(input_ids, positions, metadata, **kwargs):
        steps["eager"] += 1
        steps["eager decodes"] += metadata.num_prefills == 0
        return eager_model.forward(input_ids, positions, metadata, **kwargs)

    monkeypatch.setattr(runtime.compiled_decode.CompiledDecode, "run", count_compiled)
    monkeypatch.setattr(llm.engine.runner, "model", count_eager)
    monkeypatch.setattr(PackedWeight, "linear", count_packed)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    assert compiles() == before + 1  # no batch size or table width compiled again
    # Sizes under MIN_ROWS ran padded, past 16 as well (a sequence that stops at EOS may skip one).
    assert {1, 2, 17, 18} <= steps["compiled batches"] and len(steps["compiled batches"]) >= 14
    assert steps["eager"] >= 1 and steps["eager decodes"] == 0  # only the prompts' steps run eagerly
    # Each compiled step's products read the runtime's oneDNN packs (zoo::packed_linear in the graph).
    assert steps["compiled packed products"] == steps["compiled"] * products_per_step(eager_model)
    for prompt, max_tokens, output in zip(PROMPTS, MAX_TOKENS, outputs):
        assert output.error is None
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        expected = expected[0, len(prompt):].tolist()
        assert output.token_ids == expected


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")
def test_each_engine_compiles_its_own_graph(tmp_path, monkeypatch):
    """Engines of one process, each on its own weights and KV cache entries ([KV heads, head_dim]),
    past dynamo's recompile limit (lowered to 1 here from 8): each compiles its own graph and decodes
    with its own weights."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    prompt = PROMPTS[5]
    configs = [tiny_config("llama", head_dim=24), tiny_config("llama", num_key_value_heads=4)]
    for seed, config in enumerate(configs):
        reference = hf_model(config)
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)) * seed)
        llm = LLM(str(save_checkpoint(reference, tmp_path / str(seed))), device="cpu", block_size=4,
                  compile_decode=True)
        output = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0]
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert output.token_ids == expected[0, len(prompt):].tolist()


def test_compile_decode_needs_a_cpp_compiler(tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config
    from torch._inductor.cpp_builder import cpp_compiler_search

    path = save_checkpoint(hf_model(tiny_config("llama")), tmp_path)
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-compiler++",))
    cpp_compiler_search.cache_clear()
    try:
        with pytest.raises(ValueError, match="compile_decode needs a C\\+\\+ compiler"):
            LLM(str(path), device="cpu", compile_decode=True)
    finally:
        cpp_compiler_search.cache_clear()


def test_compile_decode_refuses_rope_that_reads_the_host(tmp_path):
    config = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    path = save_checkpoint(hf_model(config), tmp_path)
    with pytest.raises(ValueError, match="dynamic rope scaling"):
        LLM(str(path), device="cpu", compile_decode=True)
