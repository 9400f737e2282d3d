"""Gemma, Gemma 2, Gemma 3, VaultGemma, OLMo, OLMo 2, OLMo 3, Phi-3, Ministral, CWM, Granite, Starcoder2,
StableLM, Seed-OSS, SmolLM3, Cohere, Cohere 2, GLM-4, GLM, Arcee, Nemotron, Helium, EXAONE 4 and ERNIE 4.5,
brought up as declarations of the shared layers: token-identical greedy generation through the runtime, every
``zoo diff`` row within tolerance, and each forward path computing its logits once."""

import json

import pytest
import torch

from layers import AttentionMetadata, LayerNorm
from models import AutoModelForCausalLM
from models.base import NormSlots
from runtime import LLM, SamplingParams
from runtime.diff import diff_checkpoint
from tests.conftest import hf_model, relative_error, save_checkpoint
from tests.models.test_parity import TOLERANCE, VARIANTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])
BLOCK_NORMS = {
    "gemma": ["input_layernorm", "post_attention_layernorm"],
    "gemma2": ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
    "gemma3": ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
    "vaultgemma": ["input_layernorm", "pre_feedforward_layernorm"],
    "olmo": ["input_layernorm", "post_attention_layernorm"],
    "olmo2": ["post_attention_layernorm", "post_feedforward_layernorm"],
    "olmo3": ["post_attention_layernorm", "post_feedforward_layernorm"],
    "phi3": ["input_layernorm", "post_attention_layernorm"],
    "ministral": ["input_layernorm", "post_attention_layernorm"],
    "cwm": ["input_layernorm", "post_attention_layernorm"],
    "granite": ["input_layernorm", "post_attention_layernorm"],
    "starcoder2": ["input_layernorm", "post_attention_layernorm"],
    "stablelm": ["input_layernorm", "post_attention_layernorm"],
    "seed_oss": ["input_layernorm", "post_attention_layernorm"],
    "smollm3-windows-mqa": ["input_layernorm", "post_attention_layernorm"],
    "stablelm-parallel": ["input_layernorm"],  # attention and the MLP on the one norm
    "stablelm-qk_layernorm-qkv_bias": ["input_layernorm", "post_attention_layernorm"],  # q/k LayerNorms per head
    "stablelm-qk_layernorm-parallel": ["input_layernorm"],  # StableLM 2 12B's layout
    "cohere": ["input_layernorm"],
    "cohere-qk_norm-bias-mha-tied": ["input_layernorm"],
    "cohere2": ["input_layernorm"],
    "glm4": ["input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"],
    "glm": ["input_layernorm", "post_attention_layernorm"],
    "arcee": ["input_layernorm", "post_attention_layernorm"],
    "nemotron": ["input_layernorm", "post_attention_layernorm"],
    "helium": ["input_layernorm", "post_attention_layernorm"],
    "exaone4": ["post_attention_layernorm", "post_feedforward_layernorm"],
    "ernie4_5": ["input_layernorm", "post_attention_layernorm"],
}
# LayerNorm's (Cohere's without bias; Nemotron's LayerNorm1P; OLMo's neither); RMSNorm: a weight
NORM_PARAMETERS = {name: ["weight", "bias"] for name in BLOCK_NORMS
                   if name.startswith(("starcoder2", "stablelm", "nemotron"))} | {"olmo": []}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name in BLOCK_NORMS:
        model = hf_model(VARIANTS[name])
        made[name] = (save_checkpoint(model, tmp_path_factory.mktemp(name)), model)
    return made


@pytest.mark.parametrize("name", ["gemma2", "vaultgemma"])
def test_soft_capped_references_attend_eagerly(name, checkpoints):
    """HF runs Gemma 2 and VaultGemma in their eager attention, the one of their paths that soft-caps the scores."""
    assert checkpoints[name][1].config._attn_implementation == "eager"


@pytest.mark.parametrize("name", BLOCK_NORMS)
def test_blocks_hold_the_declared_norms_under_hf_names(name, checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[name][0])
    layer = model.model.layers[0]
    assert sorted(child for child, _ in layer.named_children()) == sorted(["self_attn", "mlp", *BLOCK_NORMS[name]])
    assert [n for n, _ in layer.named_parameters() if "norm" in n and not n.startswith("self_attn.")] == [
        f"{norm}.{parameter}" for norm in BLOCK_NORMS[name] for parameter in NORM_PARAMETERS.get(name, ["weight"])
    ]


def test_stablelm_qk_norms_hold_a_weight_per_head_under_hf_names(checkpoints):
    """HF's q_layernorm and k_layernorm, each a LayerNorm per head without bias (``norms.{h}``): zoo's
    modules of the same names hold the weights of the 4 query heads and the 2 KV heads stacked."""
    path, reference = checkpoints["stablelm-qk_layernorm-parallel"]
    attention = AutoModelForCausalLM.from_pretrained(path).model.layers[0].self_attn
    hf_attention = reference.model.layers[0].self_attn
    for name, heads in (("q_layernorm", 4), ("k_layernorm", 2)):
        assert name in dict(hf_attention.named_children()) and len(getattr(hf_attention, name).norms) == heads
        weights = [(n, tuple(p.shape)) for n, p in getattr(attention, name).named_parameters()]
        assert weights == [("weight", (heads, 16))]
    assert attention.qk_norms == (attention.q_layernorm, attention.k_layernorm)


@pytest.mark.parametrize("name", BLOCK_NORMS)
def test_greedy_matches_hf_generate(name, checkpoints):
    from tests.runtime.test_runtime import prompts

    path, reference = checkpoints[name]
    batch = prompts(4, seed=2, low=4, high=30)
    outputs = LLM(str(path), device="cpu", block_size=4).generate(batch, GREEDY, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert output.error is None
        assert output.token_ids == expected.tolist()


@pytest.mark.parametrize("runtime_steps", [None, 3], ids=["cache-free", "runtime"])
@pytest.mark.parametrize("name", BLOCK_NORMS)
def test_diff_rows_cover_every_norm_and_agree(name, runtime_steps, checkpoints):
    rows = diff_checkpoint(checkpoints[name][0], input_ids=TOKENS, runtime_steps=runtime_steps)
    paths = [r.path.rpartition("/")[2] for r in rows]
    for norm in BLOCK_NORMS[name]:
        assert f"model.layers.1.{norm}" in paths
    assert paths[-3:] == ["model.norm", "lm_head", "logits"]
    assert all(r.ok and r.relative < TOLERANCE for r in rows), [(r.path, r.relative) for r in rows if not r.ok]


@pytest.mark.parametrize("name, field, value", [
    ("gemma2", "attn_logit_softcapping", None), ("gemma2", "final_logit_softcapping", None),
    ("gemma2", "query_pre_attn_scalar", 16),  # its head_dim
    ("vaultgemma", "attn_logit_softcapping", None), ("vaultgemma", "final_logit_softcapping", None),
    ("vaultgemma", "query_pre_attn_scalar", 16), ("vaultgemma", "layer_types", ["full_attention"] * 2),
    ("phi3", "sliding_window", None), ("phi3", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
    ("ministral", "layer_types", ["sliding_attention"] * 2),  # the window on layer 1 too
    ("cwm", "layer_types", ["full_attention"] * 3),  # no window on layers 1 and 2
    ("cwm", "rope_parameters", {"rope_type": "default", "rope_theta": 1e6}),  # Llama 3's scaling
    ("granite", "embedding_multiplier", 1.0), ("granite", "attention_multiplier", 0.25),  # 1 / sqrt(head_dim)
    ("granite", "residual_multiplier", 1.0), ("granite", "logits_scaling", 1.0),
    ("starcoder2", "sliding_window", None), ("starcoder2", "norm_epsilon", 1.0),  # the field its norms read
    ("stablelm", "layer_norm_eps", 1.0),
    ("gemma3", "layer_types", ["sliding_attention", "sliding_attention"]),  # layer 1's rope and window
    ("olmo", "clip_qkv", None),
    ("olmo3", "layer_types", ["full_attention", "full_attention"]),  # layer 0's window and rope
    ("olmo3", "rope_parameters", {kind: {"rope_type": "default", "rope_theta": 500000.0}  # the full layer's YaRN
                                  for kind in ("sliding_attention", "full_attention")}),
    ("stablelm", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    ("smollm3-windows-mqa", "no_rope_layers", [1, 1, 1, 1]),  # rotary on the NoPE layers too
    ("smollm3-windows-mqa", "layer_types", ["full_attention"] * 4),
    ("cohere", "logit_scale", 1.0), ("cohere", "layer_norm_eps", 1.0),
    ("cohere-qk_norm-bias-mha-tied", "layer_norm_eps", 1.0),  # the q/k norms' too
    ("cohere2", "layer_types", ["sliding_attention"] * 4),  # rotary and the window on the full layer too
    ("glm4", "rms_norm_eps", 1.0),
    ("glm4", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    ("glm", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    ("arcee", "hidden_act", "relu"),  # relu, not its square
    ("arcee", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),  # the YaRN
    ("nemotron", "norm_eps", 1.0), ("nemotron", "hidden_act", "relu"),
    ("nemotron", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    ("helium", "rms_norm_eps", 1.0),
    ("exaone4", "layer_types", ["sliding_attention"] * 4),  # rotary and the window on the full layer too
    ("exaone4", "rms_norm_eps", 1.0),  # the q/k norms' too
    ("ernie4_5", "rms_norm_eps", 1.0),
    ("ernie4_5", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),  # ERNIE's base is 500,000
])
def test_declarations_are_visible_in_the_logits(name, field, value, checkpoints, tmp_path, input_ids):
    """Each setting moves the logits far past the tolerance: dropping one is caught."""
    path, reference = checkpoints[name]
    fields = json.loads((path / "config.json").read_text())
    fields[field] = value
    changed = save_checkpoint(hf_model(VARIANTS[name]), tmp_path / "changed")
    (changed / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(changed)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def rotate_half(model):
    for layer in model.model.layers:
        layer.self_attn.rope_interleaved = False


def rotary_on_every_layer(model):
    for layer in model.model.layers:
        layer.self_attn.rotary = True


def weights_not_offset_from_one(model):
    for module in model.modules():
        if isinstance(module, LayerNorm):
            module.weight_offset = 0.0


def one_branch_after_the_other(model):
    for layer in model.model.layers:
        norm = layer.input_layernorm
        layer.parallel, layer.slot_norms = False, (norm, None, norm, None)


def without_qk_norms(model):
    for layer in model.model.layers:
        for name in layer.self_attn.qk_norm_names:
            setattr(layer.self_attn, name, None)


def first_head_weight_for_all(model):
    for layer in model.model.layers:
        for norm in layer.self_attn.qk_norms:
            norm.weight[1:] = norm.weight[:1]


@pytest.mark.parametrize("name, undo", [
    ("cohere", rotate_half), ("cohere", one_branch_after_the_other),
    ("cohere-qk_norm-bias-mha-tied", rotate_half), ("stablelm-parallel", one_branch_after_the_other),
    ("glm4", rotate_half), ("glm", rotate_half), ("helium", rotate_half), ("ernie4_5", rotate_half),
    ("exaone4", rotary_on_every_layer), ("nemotron", weights_not_offset_from_one),
    ("stablelm-qk_layernorm-parallel", one_branch_after_the_other),
    ("stablelm-qk_layernorm-parallel", without_qk_norms), ("stablelm-qk_layernorm-parallel", first_head_weight_for_all),
])
def test_block_declarations_are_visible_in_the_logits(name, undo, checkpoints, input_ids):
    """Cohere's, GLM-4's, GLM's, Helium's and ERNIE 4.5's interleaved rotary, the parallel block, EXAONE 4's NoPE
    full layer, StableLM's q/k LayerNorms (or their weights of their own per head) and Nemotron's norm weights as
    offsets from one, each undone, move the logits far past the tolerance: none is a no-op on these checkpoints."""
    path, reference = checkpoints[name]
    model = AutoModelForCausalLM.from_pretrained(path)
    undo(model)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_every_forward_path_computes_logits_once(checkpoints, monkeypatch):
    path, _ = checkpoints["gemma2"]
    llm = LLM(str(path), device="cpu", block_size=4)
    model = llm.model
    calls = {"forward": 0, "compute_logits": 0}
    for name in calls:
        method = getattr(model, name)

        def counted(*args, name=name, method=method, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)

        monkeypatch.setattr(model, name, counted)
    with torch.no_grad():
        assert model(TOKENS).shape == (1, 11, 97)  # cache-free batch: forward runs again on the flat stream
        assert calls == {"forward": 2, "compute_logits": 1}
        positions = torch.arange(11)
        logits = model(TOKENS[0], positions, AttentionMetadata.causal_prefill(1, 11), logits_indices=torch.tensor([10]))
        assert logits.shape == (1, 97) and calls == {"forward": 3, "compute_logits": 2}
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert calls["compute_logits"] == calls["forward"] - 1 > 2


def test_final_logits_are_soft_capped(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gemma2"][0])
    cap = model.config.final_logit_softcapping
    torch.manual_seed(0)
    hidden = torch.randn(5, 64) * 10
    with torch.no_grad():
        uncapped, logits = model.lm_head(hidden), model.compute_logits(hidden)
    assert torch.equal(logits, torch.tanh(uncapped / cap) * cap)
    assert logits.abs().max() < cap < uncapped.abs().max()


def test_a_module_named_for_two_norm_slots_is_an_error():
    with pytest.raises(ValueError, match="NormSlots names a module twice"):
        NormSlots(post_attention="input_layernorm")
