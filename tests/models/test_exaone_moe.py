"""EXAONE MoE (ExaoneMoeForCausalLM) against HuggingFace, float32 on CPU: logits from checkpoints as
transformers' ``save_pretrained`` writes them (the hub's layout: one tensor per expert, the correction bias in
the block) and in transformers 5's own layout (experts stacked, the bias in the router), with a non-zero
correction bias; what each declaration does to the logits; the prediction tensors skipped; greedy generation
through the runtime and the layer-by-layer diff."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import AutoModelForCausalLM
from models.modeling_exaone_moe import ExaoneMoeForCausalLM
from tests.conftest import relative_error, tiny_config
from tests.models.test_ernie4_5_moe import SAVE_LAYOUTS, make_saved_moe, set_config_field  # noqa: F401 (a fixture)
from tests.models.test_glm4_moe import assert_greedy_and_diff_match_hf
from tests.models.test_parity import TOLERANCE, assert_matches

EXAONE_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, head_dim=16,
                  num_hidden_layers=4, sliding_window=5, eos_token_id=2)


def exaone_moe_config(**overrides):
    return tiny_config("exaone_moe", **{**EXAONE_MOE, **overrides})


VARIANTS = {
    # K-EXAONE's layout: three windowed layers with rotary, then a full one without position embedding; layer 0
    # dense, then experts in 4 groups, chosen from the best 2, beside a shared expert
    "exaone_moe-window-groups": exaone_moe_config(n_group=4, topk_group=2),
    # windows on every other layer; one group, top 3, weights not renormalised, scaled by 1.5, two shared
    # experts, each layer's MLP kind from mlp_layer_types, tied embeddings, MHA
    "exaone_moe-mlp_layer_types-no_norm_topk-tied": exaone_moe_config(
        sliding_window_pattern=2, num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5,
        num_shared_experts=2, mlp_layer_types=["sparse", "dense", "sparse", "dense"], tie_word_embeddings=True,
        num_key_value_heads=4),
}


@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, layout, make_saved_moe, input_ids):
    path, reference = make_saved_moe(VARIANTS[variant], layout)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_save_pretrained_writes_the_hub_layout(make_saved_moe):
    hub, _ = make_saved_moe(VARIANTS["exaone_moe-window-groups"], "hub")
    stacked, _ = make_saved_moe(VARIANTS["exaone_moe-window-groups"], "stacked")
    hub, stacked = load_file(hub / "model.safetensors"), load_file(stacked / "model.safetensors")
    assert hub["model.layers.1.mlp.e_score_correction_bias"].shape == (8,)
    assert hub["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert stacked["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert stacked["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)


def test_layers_follow_the_config():
    """Llama's pre-norm block (not EXAONE 4's post-norms), rotary on the windowed layers only."""
    with torch.device("meta"):
        layers = ExaoneMoeForCausalLM(VARIANTS["exaone_moe-mlp_layer_types-no_norm_topk-tied"]).model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [True, False, True, False]
    assert {name for name, _ in layers[0].named_children()} == {
        "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    assert [layer.self_attn.sliding_window for layer in layers] == [5, None, 5, None]
    assert [layer.self_attn.rotary for layer in layers] == [True, False, True, False]


@pytest.mark.parametrize("field, value", [
    ("routed_scaling_factor", 1.0),
    ("topk_group", 4),  # every group open: the top-k of all experts
    ("sliding_window", 64),  # past the 40 positions: no window
])
def test_declarations_are_visible_in_the_logits(field, value, make_saved_moe, input_ids):
    """Each setting, and the correction bias (zeroed in zoo's model), moves the logits far past the tolerance."""
    path, reference = make_saved_moe(VARIANTS["exaone_moe-window-groups"])
    set_config_field(path, field, value)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_the_correction_bias_is_visible_in_the_logits(make_saved_moe, input_ids):
    path, reference = make_saved_moe(VARIANTS["exaone_moe-window-groups"])
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_the_prediction_tensors_in_the_checkpoint_are_skipped(make_saved_moe, input_ids):
    """K-EXAONE's checkpoints carry a multi-token-prediction layer under ``mtp.``."""
    path, reference = make_saved_moe(VARIANTS["exaone_moe-window-groups"])
    tensors = load_file(path / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64),
                    "mtp.pre_fc_norm_embedding.weight": torch.ones(64), "mtp.pre_fc_norm_hidden.weight": torch.ones(64),
                    "mtp.layers.0.self_attn.q_proj.weight": torch.ones(64, 64)})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


@pytest.mark.parametrize("variant, layout", [("exaone_moe-window-groups", "hub"),
                                             ("exaone_moe-mlp_layer_types-no_norm_topk-tied", "stacked")])
def test_greedy_matches_hf_generate_and_diff_rows_agree(variant, layout, make_saved_moe, input_ids):
    assert_greedy_and_diff_match_hf(*make_saved_moe(VARIANTS[variant], layout), input_ids)
