"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM) against HuggingFace, float32 on CPU: logits from checkpoints as
transformers' ``save_pretrained`` writes them (the hub's layout: one tensor per expert, the correction bias in
the block's ``moe_statics``) and in transformers 5's own layout (experts stacked, the bias in the router), with
every bias and the correction bias drawn away from zero; the router against HF's (its floor on the
renormalising sum, its float32 weight in a bfloat16 model); what each declaration does to the logits; the
prediction tensors skipped; greedy generation through the runtime and the layer-by-layer diff."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as hf_ernie4_5_moe

from models import AutoModelForCausalLM
from models.modeling_ernie4_5_moe import Ernie4_5_MoeForCausalLM, Ernie4_5_MoeTopKRouter
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_glm4_moe import assert_greedy_and_diff_match_hf
from tests.models.test_parity import TOLERANCE, assert_matches

ERNIE4_5_MOE = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2, head_dim=16,
                    moe_layer_start_index=1, num_hidden_layers=3)


def ernie4_5_moe_config(**overrides):
    return tiny_config("ernie4_5_moe", **{**ERNIE4_5_MOE, **overrides})


VARIANTS = {
    # ERNIE-4.5-21B-A3B's layout: layer 0 dense, then experts beside two shared ones, tied embeddings, no bias
    "ernie4_5_moe": ernie4_5_moe_config(tie_word_embeddings=True),
    # experts on every second layer from 0 to 2 of 4 (layer 1 alone), top 3, one shared expert; a bias on every
    # projection, the LM head's included
    "ernie4_5_moe-bias-interval2-end2-top3": ernie4_5_moe_config(
        use_bias=True, moe_layer_start_index=0, moe_layer_interval=2, moe_layer_end_index=2, num_hidden_layers=4,
        moe_k=3, moe_num_shared_experts=1),
    # a floor of 0.5 under the renormalising sum, which 2 of 8 experts' probabilities often sum below; no
    # shared expert; the LM head's bias beside its tied weight
    "ernie4_5_moe-norm_min-no_shared-bias-tied": ernie4_5_moe_config(
        moe_norm_min=0.5, moe_num_shared_experts=0, moe_layer_start_index=0, num_hidden_layers=2, use_bias=True,
        tie_word_embeddings=True),
}
# transformers' save_pretrained writes the hub's layout by default, its own module tree when asked
SAVE_LAYOUTS = {"hub": {}, "stacked": {"save_original_format": False}}


def biased_hf_model(config):
    """HF's model with every bias drawn away from zero (HF starts them there), the score correction bias
    too, large enough to change which experts are chosen."""
    model = hf_model(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return model


@pytest.fixture
def make_saved_moe(tmp_path):
    """make_saved_moe(config, layout="hub", make_reference=biased_hf_model) -> (directory, HF model)."""

    def make(config, layout="hub", make_reference=biased_hf_model):
        model = make_reference(config)
        return save_checkpoint(model, tmp_path / layout, **SAVE_LAYOUTS[layout]), model

    return make


@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, layout, make_saved_moe, input_ids):
    path, reference = make_saved_moe(VARIANTS[variant], layout)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_save_pretrained_writes_the_hub_layout(make_saved_moe):
    """One tensor per expert and the correction bias [1, experts] in the block, as ERNIE-4.5's hub repos
    hold them; transformers 5's own layout stacks the experts and keeps the bias in the router."""
    hub, _ = make_saved_moe(VARIANTS["ernie4_5_moe"], "hub")
    stacked, _ = make_saved_moe(VARIANTS["ernie4_5_moe"], "stacked")
    hub, stacked = load_file(hub / "model.safetensors"), load_file(stacked / "model.safetensors")
    assert hub["model.layers.1.mlp.moe_statics.e_score_correction_bias"].shape == (1, 8)
    assert hub["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert stacked["model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"].shape == (1, 8)
    assert stacked["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert not any(".experts." in name for name in hub if "layers.0." in name)  # layer 0 is dense


def test_layers_follow_the_config():
    with torch.device("meta"):
        layers = Ernie4_5_MoeForCausalLM(VARIANTS["ernie4_5_moe-bias-interval2-end2-top3"]).model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True, False, False]
    moe = layers[1].mlp
    assert moe.gate.top_k == 3 and moe.shared_experts.down_proj.bias is not None
    assert "renormalize_min=1e-12" in repr(moe.gate)


def set_config_field(path, field, value):
    fields = json.loads((path / "config.json").read_text())
    fields[field] = value
    (path / "config.json").write_text(json.dumps(fields))


@pytest.mark.parametrize("dropped", ["e_score_correction_bias", "moe_norm_min"])
def test_declarations_are_visible_in_the_logits(dropped, make_saved_moe, input_ids):
    """The correction bias (zeroed in zoo's model) and the floor of the renormalising sum (read as HF's
    default, 1e-12) each move the logits far past the tolerance."""
    path, reference = make_saved_moe(VARIANTS["ernie4_5_moe-norm_min-no_shared-bias-tied"])
    if dropped == "moe_norm_min":
        set_config_field(path, "moe_norm_min", 1e-12)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        if dropped == "e_score_correction_bias":
            for layer in model.model.layers:
                layer.mlp.gate.e_score_correction_bias.zero_()
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_the_prediction_tensors_in_the_checkpoint_are_skipped(make_saved_moe, input_ids):
    """ERNIE-4.5's hub checkpoints carry a multi-token-prediction block beside the model's layers."""
    path, reference = make_saved_moe(VARIANTS["ernie4_5_moe"])
    tensors = load_file(path / "model.safetensors")
    tensors.update({"model.mtp_block.0.self_attn.q_proj.weight": torch.ones(64, 64),
                    "model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_hidden_norm.0.weight": torch.ones(64),
                    "model.mtp_linear_proj.0.weight": torch.ones(64, 128)})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def routers(config):
    """HF's router with random weights and correction bias, and zoo's with the same values."""
    torch.manual_seed(0)
    theirs = hf_ernie4_5_moe.Ernie4_5_MoeTopKRouter(config)
    with torch.no_grad():
        theirs.weight.normal_(std=0.5)
        theirs.moe_statics.e_score_correction_bias.normal_(std=0.2)
    ours = Ernie4_5_MoeTopKRouter(64, 8, config.moe_k, renormalize=True, score_correction_bias=True,
                                  renormalize_min=config.moe_norm_min)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.moe_statics.e_score_correction_bias[0])
    return theirs, ours


def sorted_by_id(weights, ids):
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def test_router_matches_hf_where_the_floor_of_the_sum_bites():
    """Tokens whose chosen experts' probabilities sum below moe_norm_min (1e-12): one expert's logit far
    above the others', a correction bias that passes it over; HF divides by the floor, not the sum. With
    the other tokens: the same experts, weights equal in float32."""
    theirs, ours = routers(ernie4_5_moe_config())
    x = torch.randn(50, 64)
    x[:10, 0] = 60.0
    with torch.no_grad():
        theirs.weight[0] = torch.eye(64)[0]  # expert 0's logit x[:, 0]: ~60 ahead for tokens 0-9, the others ~1e-26
        theirs.moe_statics.e_score_correction_bias[0, 0] = -2.0  # never chosen
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.moe_statics.e_score_correction_bias[0])
        weights, ids = sorted_by_id(*ours(x))
        _, expected_weights, expected_ids = theirs(x)
    expected_weights, expected_ids = sorted_by_id(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    assert (weights[:10] > 0).all() and (weights[:10].sum(-1) < 1e-3).all()  # the floor bit: far below one


def test_router_weight_stays_float32_in_a_bfloat16_model(make_saved_moe, input_ids):
    """As in HF, the router's weight keeps the checkpoint's float32 values in a bfloat16 model, and bfloat16
    activations route as HF's router routes them: the same experts, the weights HF's once rounded as HF
    rounds them. A weight rounded to bfloat16 gives other weights for most tokens."""
    path, reference = make_saved_moe(VARIANTS["ernie4_5_moe"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.weight, reference.model.layers[1].mlp.gate.weight)
    theirs, ours = routers(ernie4_5_moe_config())
    x = torch.randn(500, 64).bfloat16()
    with torch.no_grad():
        weights, ids = sorted_by_id(*ours(x))
        _, expected_weights, expected_ids = theirs(x)
        ours.weight.copy_(ours.weight.bfloat16())
        rounded_weights, _ = sorted_by_id(*ours(x))
    expected_weights, expected_ids = sorted_by_id(expected_weights, expected_ids)
    assert expected_weights.dtype == torch.bfloat16  # HF rounds the weights; zoo weighs the experts by them unrounded
    assert torch.equal(ids, expected_ids) and torch.equal(weights.bfloat16(), expected_weights)
    assert (rounded_weights.bfloat16() != expected_weights).any(-1).float().mean() > 0.5


@pytest.mark.parametrize("variant, layout", [("ernie4_5_moe-bias-interval2-end2-top3", "hub"),
                                             ("ernie4_5_moe-norm_min-no_shared-bias-tied", "stacked")])
def test_greedy_matches_hf_generate_and_diff_rows_agree(variant, layout, make_saved_moe, input_ids):
    assert_greedy_and_diff_match_hf(*make_saved_moe(VARIANTS[variant], layout), input_ids)
