"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, GraniteMoe, GraniteMoeShared, OLMoE) against
HuggingFace, float32 on CPU: logits, greedy generation and the layer-by-layer diff, from checkpoints in both
layouts (as hub repos ship them: one tensor per expert, or GraniteMoe's experts stacked under names of their
own; and transformers 5's stacked experts); the router, the experts op (and GPT-OSS's experts: biases and the
clamped SwiGLU, against HF's GptOssExperts), strict loading."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss
from transformers.models.granitemoe import modeling_granitemoe as hf_granitemoe
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3_moe

from layers import Experts, TopKRouter
from loaders import CheckpointError
from loaders.hf_dir import safetensors_tensors
from loaders.load import load_weights
from models import AutoModelForCausalLM
from models.modeling_qwen3_moe import Qwen3MoeForCausalLM
from ops_cuda import moe_experts
from ops_cuda.moe import moe_experts_dense_reference
from runtime import LLM, SamplingParams
from runtime.diff import diff_checkpoint
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_deepseek_v3 import deepseek_hf_model
from tests.loaders.test_errors import rewrite_tensors
from tests.models.test_parity import TOLERANCE, assert_matches

QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
QWEN2_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
# granite-3.0-1b-a400m's multipliers (its attention's as 1 / head_dim), each moving the logits
# (test_a_setting_read_wrongly_is_caught)
GRANITEMOE = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=12.0,
                  attention_multiplier=1 / 16, residual_multiplier=0.22, logits_scaling=6.0)
MINIMAX_M2 = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, rotary_dim=8,
                  eos_token_id=2)  # its 200020 is no id here
OLMOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, eos_token_id=2)  # its 50279 is no id here

VARIANTS = {
    "qwen3_moe-norm_topk": tiny_config("qwen3_moe", **QWEN3_MOE, norm_topk_prob=True),
    "qwen3_moe-no_norm_topk": tiny_config("qwen3_moe", **QWEN3_MOE, norm_topk_prob=False),
    "qwen3_moe-sparse_step2": tiny_config("qwen3_moe", **QWEN3_MOE, decoder_sparse_step=2, num_hidden_layers=3),
    "qwen3_moe-mlp_only_top3": tiny_config(
        "qwen3_moe", **{**QWEN3_MOE, "num_experts_per_tok": 3}, mlp_only_layers=[1], num_hidden_layers=3,
        norm_topk_prob=True,
    ),
    "qwen3_moe-window": tiny_config("qwen3_moe", **QWEN3_MOE, use_sliding_window=True, sliding_window=6),
    "mixtral-window": tiny_config("mixtral", **MIXTRAL, sliding_window=7),
    # HF's Mixtral and Qwen3-MoE put the window on every layer: layer_types unread
    "mixtral-window-layer_types-unread": tiny_config("mixtral", **MIXTRAL, sliding_window=5,
                                                     layer_types=["full_attention", "sliding_attention"]),
    "qwen3_moe-window-layer_types-unread": tiny_config("qwen3_moe", **QWEN3_MOE, use_sliding_window=True,
                                                       sliding_window=5,
                                                       layer_types=["full_attention", "sliding_attention"]),
    "mixtral-tied": tiny_config("mixtral", **MIXTRAL, tie_word_embeddings=True),
    "qwen2_moe": tiny_config("qwen2_moe", **QWEN2_MOE),
    "qwen2_moe-window-mlp_only": tiny_config(
        "qwen2_moe", **QWEN2_MOE, norm_topk_prob=True, use_sliding_window=True, sliding_window=5, max_window_layers=2,
        mlp_only_layers=[2], num_hidden_layers=3,
    ),
    "granitemoe": tiny_config("granitemoe", **GRANITEMOE),
    "granitemoe-bias-tied-top3": tiny_config("granitemoe", **{**GRANITEMOE, "num_experts_per_tok": 3},
                                             attention_bias=True, tie_word_embeddings=True),
    "granitemoeshared": tiny_config("granitemoeshared", **GRANITEMOE, shared_intermediate_size=48),
    "granitemoeshared-no_shared": tiny_config("granitemoeshared", **GRANITEMOE, shared_intermediate_size=0),
    # OLMoE: q/k norms over all heads; OLMoE-1B-7B's MHA and router (no renormalising), or q, k and v
    # clamped after the norms, GQA, renormalised, biased and tied. HF's OLMoE reads no window.
    "olmoe": tiny_config("olmoe", **OLMOE, num_key_value_heads=4),
    "olmoe-clip-norm_topk-bias-tied": tiny_config("olmoe", **OLMOE, clip_qkv=1.0, norm_topk_prob=True,
                                                  attention_bias=True, tie_word_embeddings=True),
    "olmoe-window-unread": tiny_config("olmoe", **OLMOE, sliding_window=5),
    # MiniMax-M2: a sigmoid router with a score correction bias (HF starts it at zero: see
    # test_minimax_m2_chooses_by_the_corrected_scores), q/k norms over all heads, rotary on half of each head
    "minimax_m2": tiny_config("minimax_m2", **MINIMAX_M2),
    "minimax_m2-top3-tied": tiny_config("minimax_m2", **{**MINIMAX_M2, "num_experts_per_tok": 3},
                                        tie_word_embeddings=True),
}
LAYOUTS = ["per_expert", "stacked"]
GRANITE_LAYOUTS = ["hub", "stacked"]


def layouts(variant: str) -> list[str]:
    """The layouts of a variant's checkpoints: as hub repos ship them (one tensor per expert; GraniteMoe's
    ``hub`` layout, stacked under names of its own), and transformers 5's stacked experts."""
    return GRANITE_LAYOUTS if variant.startswith("granitemoe") else LAYOUTS


VARIANT_LAYOUTS = [(variant, layout) for variant in VARIANTS for layout in layouts(variant)]


def per_expert_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors as hub repos ship them: ``mlp.experts.{e}.{gate,up,down}_proj.weight``, or for
    Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and ``block_sparse_moe.gate.weight``."""
    mixtral = model.config.model_type in ("mixtral", "minimax_m2")  # MiniMax-M2's hub spelling is Mixtral's
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    tensors = {}
    for name, tensor in model.state_dict().items():
        experts = name.rpartition(".")[0]
        if name.endswith(".experts.gate_up_proj"):
            for e, stacked in enumerate(tensor):
                tensors[f"{experts}.{e}.{gate}.weight"], tensors[f"{experts}.{e}.{up}.weight"] = stacked.chunk(2)
        elif name.endswith(".experts.down_proj"):
            for e, weight in enumerate(tensor):
                tensors[f"{experts}.{e}.{down}.weight"] = weight
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = tensor
    if mixtral:
        tensors = {name.replace(".mlp.", ".block_sparse_moe."): t for name, t in tensors.items()}
    return {name: t.contiguous().clone() for name, t in tensors.items()}


# transformers 5's module tree -> GraniteMoe's hub names (the experts as stacked, each expert's gate rows first)
GRANITE_HUB_NAMES = {".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight",
                     ".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
                     ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight"}


def granite_hub_state_dict(model) -> dict[str, torch.Tensor]:
    """GraniteMoe's tensors as hub repos ship them: ``block_sparse_moe.{router.layer, input_linear,
    output_linear}.weight``; the shared MLP as its module holds it, ``shared_mlp.{input,output}_linear``."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for suffix, hub in GRANITE_HUB_NAMES.items():
            if name.endswith(suffix):
                name = name.removesuffix(suffix) + hub
        tensors[name] = tensor.contiguous().clone()
    return tensors


def write_checkpoint(model, path, layout: str):
    if layout == "stacked":  # transformers 5 keeps its own module layout only when asked to
        return save_checkpoint(model, path, save_original_format=False)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tensors = granite_hub_state_dict(model) if layout == "hub" else per_expert_state_dict(model)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture
def make_moe_checkpoint(tmp_path):
    """make_moe_checkpoint(config, layout, make_reference=hf_model) -> (directory, HF model in float32)."""

    def make(config, layout="per_expert", make_reference=hf_model):
        model = make_reference(config)
        return write_checkpoint(model, tmp_path / layout, layout), model

    return make


@pytest.mark.parametrize("variant, layout", VARIANT_LAYOUTS)
def test_logits_match_huggingface(variant, layout, make_moe_checkpoint, input_ids):
    path, reference = make_moe_checkpoint(VARIANTS[variant], layout)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_minimax_m2_chooses_by_the_corrected_scores(layout, make_moe_checkpoint, input_ids):
    """With a non-zero score correction bias (as trained checkpoints hold), large enough to change which
    experts are chosen: HF's logits, in either layout; without the bias they move."""
    path, reference = make_moe_checkpoint(VARIANTS["minimax_m2"], layout, make_reference=deepseek_hf_model)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


@pytest.mark.parametrize("variant, field, value", [
    ("qwen3_moe-norm_topk", "norm_topk_prob", False),
    ("olmoe-clip-norm_topk-bias-tied", "norm_topk_prob", False),
    ("olmoe-clip-norm_topk-bias-tied", "clip_qkv", None),
    # each of GraniteMoe's multipliers at its neutral value (attention's at 1 / sqrt(head_dim))
    ("granitemoeshared", "embedding_multiplier", 1.0), ("granitemoeshared", "attention_multiplier", 0.25),
    ("granitemoeshared", "residual_multiplier", 1.0), ("granitemoeshared", "logits_scaling", 1.0),
])
def test_a_setting_read_wrongly_is_caught(variant, field, value, make_moe_checkpoint, input_ids):
    """The tolerance sees a router, attention or multiplier mistake: a checkpoint run with one setting
    dropped (a norm_topk_prob checkpoint without renormalising, OLMoE's q, k and v unclamped, one of
    GraniteMoe's multipliers)."""
    path, reference = make_moe_checkpoint(VARIANTS[variant], layouts(variant)[0])
    fields = json.loads((path / "config.json").read_text())
    fields[field] = value
    (path / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


@pytest.mark.parametrize("variant", ["qwen3_moe-sparse_step2", "mixtral-window", "qwen2_moe",
                                     "granitemoe-bias-tied-top3", "granitemoeshared", "olmoe", "minimax_m2"])
def test_save_pretrained_writes_the_hub_layout(variant, tmp_path):
    """transformers 5.23's default ``save_pretrained`` converts back to the hub layout: the same tensors
    as ``per_expert_state_dict`` or ``granite_hub_state_dict`` (so both layouts the tests use are ones
    real checkpoints have)."""
    from safetensors.torch import load_file

    model = hf_model(VARIANTS[variant])
    save_checkpoint(model, tmp_path)
    hub = granite_hub_state_dict(model) if "hub" in layouts(variant) else per_expert_state_dict(model)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(hub)
    assert all(torch.equal(saved[name], tensor) for name, tensor in hub.items())


def test_layers_follow_the_config():
    with torch.device("meta"):
        layers = Qwen3MoeForCausalLM(VARIANTS["qwen3_moe-sparse_step2"]).model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True, False]
    with torch.device("meta"):
        layers = Qwen3MoeForCausalLM(VARIANTS["qwen3_moe-mlp_only_top3"]).model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [True, False, True]
    assert layers[0].mlp.gate.top_k == 3 and layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


# The router and the experts op on their own.

@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_hf_qwen3_moe(norm_topk_prob):
    config = tiny_config("qwen3_moe", **QWEN3_MOE, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    theirs = hf_qwen3_moe.Qwen3MoeTopKRouter(config)
    theirs.weight.data.normal_(std=0.5)
    ours = TopKRouter(64, 8, 2, renormalize=norm_topk_prob)
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(50, 64)
    weights, ids = ours(x)
    _, expected_weights, expected_ids = theirs(x)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(50)) if norm_topk_prob else bool((sums < 1).all())


def test_router_matches_hf_mixtral_and_topk_then_softmax():
    """Mixtral as HF runs it (softmax, top-k, renormalise) and as its reference code does (top-k of the
    logits, softmax over those k): the same experts, weights within float32 rounding."""
    config = tiny_config("mixtral", **MIXTRAL)
    torch.manual_seed(0)
    theirs = hf_mixtral.MixtralTopKRouter(config)
    theirs.weight.data.normal_(std=0.5)
    ours = TopKRouter(64, 8, 2, renormalize=True)
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(50, 64)
    weights, ids = ours(x)
    _, expected_weights, expected_ids = theirs(x)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    top_logits, top_ids = F.linear(x, ours.weight).topk(2, dim=-1)
    assert torch.equal(ids, top_ids)
    assert (weights - top_logits.softmax(-1, dtype=torch.float32)).abs().max() < 1e-6


@pytest.mark.parametrize("top_k", [2, 3])
def test_router_matches_hf_granitemoe(top_k):
    """GraniteMoe's router (a softmax over the top-k logits, in float32) is Mixtral's: the same experts in
    the same order, weights within float32 rounding; in bfloat16, HF rounds the weights to the model's
    dtype, zoo weighs the experts by them unrounded: rounded, they are HF's."""
    config = tiny_config("granitemoe", **{**GRANITEMOE, "num_experts_per_tok": top_k})
    torch.manual_seed(0)
    theirs = hf_granitemoe.GraniteMoeTopKRouter(config)
    theirs.weight.data.normal_(std=0.5)
    ours = TopKRouter(64, 8, top_k, renormalize=True)
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(500, 64)
    weights, ids = ours(x)
    _, expected_weights, expected_ids = theirs(x)
    assert torch.equal(ids, expected_ids)
    assert (weights - expected_weights).abs().max() < 1e-6
    weights, ids = ours.to(torch.bfloat16)(x.bfloat16())
    _, expected_weights, expected_ids = theirs.to(torch.bfloat16)(x.bfloat16())
    assert weights.dtype == torch.float32 and expected_weights.dtype == torch.bfloat16
    assert torch.equal(ids, expected_ids) and torch.equal(weights.bfloat16(), expected_weights)


def naive_moe(hidden, topk_weights, topk_ids, gate_up, down, activation):
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    act = ACT2FN[activation]
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = topk_ids[t, k]
            gate, up = (gate_up[e].double() @ hidden[t].double()).chunk(2)
            out[t] += topk_weights[t, k].double() * (down[e].double() @ (act(gate) * up))
    return out


def routed(num_tokens, top_k, allowed, seed):
    """topk ids drawn only from ``allowed`` experts (distinct per token), and softmax weights."""
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(allowed, top_k) for _ in range(num_tokens)], dtype=torch.int64)
    ids = ids.view(num_tokens, top_k)  # [0, k] when there are no tokens
    weights = torch.randn(num_tokens, top_k, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    return weights, ids


@pytest.mark.parametrize("case", [
    dict(tokens=37, top_k=2, allowed=[0, 2, 3, 6, 7]),  # experts 1, 4, 5 get no tokens, the others uneven
    dict(tokens=20, top_k=1, allowed=[5]),  # every token on one expert
    dict(tokens=1, top_k=3, allowed=list(range(8))),  # one token (a decode step)
    dict(tokens=0, top_k=2, allowed=list(range(8))),  # nothing routed at all
])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("form", ["op", "dense"])
def test_experts_op_matches_naive_reference(case, activation, form):
    """The op (grouped by expert) and its dense form (what runs under CUDA-graph capture)."""
    torch.manual_seed(0)
    num_experts, hidden_size, intermediate = 8, 64, 32
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden_size) * 0.15
    down = torch.randn(num_experts, hidden_size, intermediate) * 0.15
    hidden = torch.randn(case["tokens"], hidden_size)
    weights, ids = routed(case["tokens"], case["top_k"], case["allowed"], seed=1)
    op = moe_experts if form == "op" else moe_experts_dense_reference
    ours = op(hidden, weights, ids, gate_up, down, activation)
    expected = naive_moe(hidden, weights, ids, gate_up, down, activation)
    assert ours.shape == hidden.shape and ours.dtype == hidden.dtype
    if case["tokens"]:
        assert (ours.double() - expected).abs().max() / expected.abs().max() < 1e-6


def gpt_oss_experts(num_experts, hidden_size, intermediate, seed=0):
    """HF's GptOssExperts with random weights and biases (the config's swiglu_alpha and swiglu_limit), and
    the same experts in zoo's layout: (gate_up [E, 2I, H], gate_up_bias [E, 2I], down [E, H, I], down_bias
    [E, H]). HF stores gate_up [E, H, 2I] with gate and up interleaved (gate at even columns) and down [E, I, H]."""
    config = transformers.GptOssConfig(num_local_experts=num_experts, hidden_size=hidden_size,
                                       intermediate_size=intermediate)
    theirs = hf_gpt_oss.GptOssExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.3)

    def gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:  # [..., 2I] interleaved -> [..., 2I] halves
        return torch.cat((interleaved[..., 0::2], interleaved[..., 1::2]), dim=-1)

    ours = (gate_then_up(theirs.gate_up_proj.detach()).transpose(1, 2).contiguous(),
            gate_then_up(theirs.gate_up_proj_bias.detach()), theirs.down_proj.detach().transpose(1, 2).contiguous(),
            theirs.down_proj_bias.detach().clone())
    return theirs, ours


@pytest.mark.parametrize("form", ["op", "dense", "layer"])
def test_gpt_oss_experts_match_hf(form):
    """Biases and the clamped SwiGLU, float32: the op, its dense form and the Experts layer against HF's
    GptOssExperts (the same sums, in the same order of experts)."""
    num_experts, hidden_size, intermediate = 8, 64, 32
    theirs, (gate_up, gate_up_bias, down, down_bias) = gpt_oss_experts(num_experts, hidden_size, intermediate)
    hidden = torch.randn(37, hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = routed(37, 2, [0, 2, 3, 6, 7], seed=1)  # experts 1, 4, 5 get no tokens
    gate, up = F.linear(hidden, gate_up[0], gate_up_bias[0]).chunk(2, dim=-1)
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any()  # every clamp bites
    if form == "layer":
        layer = Experts(num_experts, hidden_size, intermediate, "clamped_swiglu", bias=True)
        for name, tensor in dict(gate_up_proj=gate_up, gate_up_proj_bias=gate_up_bias, down_proj=down,
                                 down_proj_bias=down_bias).items():
            getattr(layer, name).data.copy_(tensor)
        ours = layer(hidden, weights, ids)
    else:
        op = moe_experts if form == "op" else moe_experts_dense_reference
        ours = op(hidden, weights, ids, gate_up, down, "clamped_swiglu", gate_up_bias, down_bias)
    with torch.no_grad():
        expected = theirs(hidden, router_indices=ids, routing_weights=weights)
    assert relative_error(ours, expected) < 1e-6


def test_biased_experts_load_their_stacked_biases(tmp_path):
    tensors = {"experts.gate_up_proj": torch.randn(4, 16, 8), "experts.gate_up_proj_bias": torch.randn(4, 16),
               "experts.down_proj": torch.randn(4, 8, 8), "experts.down_proj_bias": torch.randn(4, 8)}
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = nn.ModuleDict({"experts": Experts(4, 8, 8, "clamped_swiglu", bias=True)})
    load_weights(model, safetensors_tensors(tmp_path), torch.float32, torch.device("cpu"))
    assert all(torch.equal(model.get_parameter(name), tensor) for name, tensor in tensors.items())
    assert "hidden_act=clamped_swiglu, bias=True" in repr(model.experts)


def test_fp8_experts_with_biases_are_refused():
    experts = Experts(4, 8, 8, "clamped_swiglu", bias=True)
    experts.fp8_block = (16, 32)  # as the loader marks experts it keeps in FP8
    weights, ids = routed(3, 2, list(range(4)), seed=0)
    with pytest.raises(ValueError, match="FP8 experts with biases are not supported"):
        experts(torch.randn(3, 8), weights, ids)


def test_experts_op_is_a_checked_custom_op():
    torch.manual_seed(0)
    weights, ids = routed(9, 2, [0, 1, 3], seed=2)
    args = (torch.randn(9, 16), weights, ids, torch.randn(4, 16, 16), torch.randn(4, 16, 8), "silu")
    torch.library.opcheck(torch.ops.zoo.moe_experts.default, args, test_utils=("test_schema", "test_faketensor"))
    biased = (*args[:5], "clamped_swiglu", torch.randn(4, 16), torch.randn(4, 16))
    torch.library.opcheck(torch.ops.zoo.moe_experts.default, biased, test_utils=("test_schema", "test_faketensor"))
    bf16 = moe_experts(args[0].bfloat16(), weights, ids, args[3].bfloat16(), args[4].bfloat16(), "silu")
    assert bf16.dtype == torch.bfloat16


# Runtime, diff, loading errors.

GENERATION = [("qwen3_moe-no_norm_topk", "stacked"), ("mixtral-window", "per_expert"), ("qwen2_moe", "per_expert"),
              ("granitemoe-bias-tied-top3", "hub"), ("granitemoeshared", "stacked"),
              ("olmoe-clip-norm_topk-bias-tied", "per_expert"), ("minimax_m2", "per_expert")]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.mark.parametrize("variant, layout", GENERATION)
def test_greedy_matches_hf_generate(variant, layout, make_moe_checkpoint):
    path, reference = make_moe_checkpoint(VARIANTS[variant], layout)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    outputs = LLM(str(path), device="cpu", block_size=4).generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert output.error is None and output.token_ids == expected.tolist()


TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])


@pytest.mark.parametrize("variant, layout", [(variant, layout) for layout in LAYOUTS for variant in (
    "qwen3_moe-sparse_step2", "mixtral-window", "olmoe-clip-norm_topk-bias-tied")])
def test_diff_rows_all_ok(variant, layout, make_moe_checkpoint):
    path, _ = make_moe_checkpoint(VARIANTS[variant], layout)
    rows = diff_checkpoint(path, input_ids=TOKENS)
    layers = VARIANTS[variant].num_hidden_layers
    assert [r.path for r in rows if r.path.endswith(".mlp")] == [f"model.layers.{i}.mlp" for i in range(layers)]
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


@pytest.mark.parametrize("runtime_steps", [None, 3], ids=["cache-free", "runtime"])
@pytest.mark.parametrize("variant, layout", [("granitemoe", "hub"), ("granitemoeshared", "hub"),
                                             ("granitemoeshared", "stacked")])
def test_granitemoe_diff_rows_cover_the_experts_and_the_shared_mlp(variant, layout, runtime_steps,
                                                                   make_moe_checkpoint):
    """The experts' and the shared MLP's rows apart, under HF's names, as HF's layer runs them."""
    path, _ = make_moe_checkpoint(VARIANTS[variant], layout)
    rows = diff_checkpoint(path, input_ids=TOKENS, runtime_steps=runtime_steps)
    paths = {r.path.rpartition("/")[2] for r in rows}
    branches = ["block_sparse_moe", "shared_mlp"] if variant == "granitemoeshared" else ["block_sparse_moe"]
    assert {f"model.layers.1.{branch}" for branch in branches} <= paths
    assert all(r.ok and r.relative < TOLERANCE for r in rows), [(r.path, r.relative) for r in rows if not r.ok]


@pytest.mark.parametrize("variant", ["granitemoe", "granitemoeshared", "granitemoeshared-no_shared"])
def test_granitemoe_layers_hold_hf_s_modules(variant, make_moe_checkpoint):
    path, reference = make_moe_checkpoint(VARIANTS[variant], "hub")
    layer = AutoModelForCausalLM.from_pretrained(path).model.layers[0]
    theirs = reference.model.layers[0]
    assert {name for name, _ in layer.named_children()} == {name for name, _ in theirs.named_children()}
    shared = variant == "granitemoeshared"
    assert (layer.shared_mlp is not None) == (getattr(theirs, "shared_mlp", None) is not None) == shared


@pytest.mark.parametrize("variant, dropped", [
    ("qwen3_moe-norm_topk", "model.layers.1.mlp.experts.3.up_proj.weight"),
    ("mixtral-window", "model.layers.0.block_sparse_moe.experts.5.w2.weight"),
])
def test_missing_expert_tensor_is_named(variant, dropped, make_moe_checkpoint):
    path, _ = make_moe_checkpoint(VARIANTS[variant], "per_expert")
    rewrite_tensors(path, lambda t: t.pop(dropped))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {dropped.replace('.', '[.]')}$"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("variant, layout, dropped, spellings", [
    ("mixtral-window", "per_expert", "model.layers.1.block_sparse_moe.gate.weight",
     ["model.layers.1.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight"]),
    ("granitemoe", "hub", "model.layers.1.block_sparse_moe.router.layer.weight",
     [f"model.layers.1.block_sparse_moe.{name}.weight" for name in ("gate", "router", "router.layer")]),
    ("granitemoe", "hub", "model.layers.0.block_sparse_moe.input_linear.weight",
     ["model.layers.0.block_sparse_moe.experts.0.gate_proj.weight (+15 more)",
      "model.layers.0.block_sparse_moe.experts.gate_up_proj", "model.layers.0.block_sparse_moe.input_linear.weight"]),
    ("granitemoeshared", "hub", "model.layers.1.shared_mlp.input_linear.weight",
     ["model.layers.1.shared_mlp.gate_proj.weight (+1 more)", "model.layers.1.shared_mlp.gate_up_proj.weight",
      "model.layers.1.shared_mlp.input_linear.weight"]),
])
def test_tensor_missing_in_every_spelling_names_them_all(variant, layout, dropped, spellings, make_moe_checkpoint):
    path, _ = make_moe_checkpoint(VARIANTS[variant], layout)
    rewrite_tensors(path, lambda t: t.pop(dropped))
    with pytest.raises(CheckpointError) as error:
        AutoModelForCausalLM.from_pretrained(path)
    assert str(error.value).endswith("missing tensors: " + " or ".join(spellings))


def test_missing_stacked_tensor_is_named(make_moe_checkpoint):
    path, _ = make_moe_checkpoint(VARIANTS["mixtral-window"], "stacked")
    rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match=(
        r"missing tensors: model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight \(\+7 more\) or "
        r"model\.layers\.1\.mlp\.experts\.down_proj or "
        r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight \(\+7 more\)$"
    )):
        AutoModelForCausalLM.from_pretrained(path)


def test_both_layouts_at_once_is_an_error(make_moe_checkpoint):
    """A layer stored twice (per expert and stacked) fills from the preferred layout; the other is unexpected."""
    path, model = make_moe_checkpoint(VARIANTS["qwen3_moe-norm_topk"], "per_expert")
    stacked = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    rewrite_tensors(path, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": stacked}))
    unexpected = r"unexpected tensors.*: model\.layers\.0\.mlp\.experts\.down_proj \(model\.safetensors\)$"
    with pytest.raises(CheckpointError, match=unexpected):
        AutoModelForCausalLM.from_pretrained(path)


def test_a_complete_layout_is_taken_over_a_partial_one_with_more_tensors(make_moe_checkpoint):
    """Stacked experts (one tensor) beside two stray per-expert tensors: the complete layout fills the
    parameter and the strays are named, rather than the per-expert layout's 6 missing tensors."""
    path, model = make_moe_checkpoint(VARIANTS["qwen3_moe-norm_topk"], "stacked")
    down = model.model.layers[0].mlp.experts.down_proj.detach()
    strays = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": down[e].clone() for e in (0, 1)}
    rewrite_tensors(path, lambda t: t.update(strays))
    with pytest.raises(CheckpointError) as error:
        AutoModelForCausalLM.from_pretrained(path)
    assert "missing" not in str(error.value)
    assert all(name in str(error.value) for name in strays)


def test_wrong_expert_shape_is_named(make_moe_checkpoint):
    path, _ = make_moe_checkpoint(VARIANTS["qwen3_moe-norm_topk"], "stacked")
    rewrite_tensors(path, lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 32, 64)}))
    expected = r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*expected shape \(8, 64, 64\), got \(8, 32, 64\)"
    with pytest.raises(CheckpointError, match=expected):
        AutoModelForCausalLM.from_pretrained(path)
