"""float32 logits of every supported variant against HuggingFace's, loaded from the same checkpoint."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from layers import LayerNorm, RMSNorm
from loaders import CheckpointError
from models import AutoModelForCausalLM
from tests.conftest import relative_error, tiny_config

TOLERANCE = 1e-5
PHI3_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
STARCODER2_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # its defaults (50256) lie outside this vocabulary
STABLELM_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # its defaults (0) are ids HF's init leaves no special role
SEED_OSS_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SMOLLM3_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # its defaults (128000...) exceed the vocabulary
# OLMo 3 7B's long-context rope on its full layers (a checkpoint's rope_scaling; the sliding ones keep
# the plain rope): YaRN by 8 of 8,192 positions, here by 4 of 16
OLMO3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.2,
              "beta_fast": 32, "beta_slow": 1}
COHERE_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # its default eos (255001) lies outside this vocabulary
GLM4_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # GLM's, GLM-4's defaults (151329...) lie outside
CWM_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # its defaults (128000, [128001, ...]) lie outside this vocabulary
# CWM's Llama 3 rope (a factor of 16 over 8,192 original positions), here over 16
CWM_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 1e6}
ARCEE_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # its defaults (128000, 128001) lie outside this vocabulary


def partial_rope(factor: float) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}


def longrope(rotary_dim: int, partial_rotary_factor: float = 0.75) -> dict:
    """Phi-3.5's and Phi-4-mini's rope: per rotated channel pair a short and a long factor, far
    enough apart that taking one set for the other moves the logits."""
    pairs = torch.linspace(0, 1, rotary_dim // 2)
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor,
            "short_factor": (1 + pairs).tolist(), "long_factor": (1 + 12 * pairs**2).tolist()}


VARIANTS = {
    "llama-gqa": tiny_config("llama"),
    "llama-mha": tiny_config("llama", num_key_value_heads=4),
    "llama-head_dim": tiny_config("llama", head_dim=24),
    "llama-tied": tiny_config("llama", tie_word_embeddings=True),
    "llama-bias": tiny_config("llama", attention_bias=True, mlp_bias=True),
    "llama-gelu": tiny_config("llama", hidden_act="gelu_pytorch_tanh"),
    "rope-linear": tiny_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "rope-dynamic": tiny_config(
        "llama", max_position_embeddings=24, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "rope-llama3": tiny_config("llama", rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0,
    }),
    "rope-yarn": tiny_config("llama", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
    }),
    "rope-yarn-mscale": tiny_config("llama", max_position_embeddings=640, rope_parameters={  # DeepSeek-style
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
    }),
    "mistral-window": tiny_config("mistral", sliding_window=7, head_dim=16),
    # Each architecture reads its window as HF's does: Mistral on every layer (layer_types unread),
    # Llama, Gemma and OLMo 2 none (a sliding_window field in their configs is unread).
    "mistral-window-layer_types-unread": tiny_config(
        "mistral", sliding_window=5, head_dim=16, layer_types=["full_attention", "sliding_attention"]
    ),
    "llama-window-unread": tiny_config("llama", sliding_window=5),
    # Ministral: Mistral's block with the window on the layers layer_types marks (HF's config marks every
    # layer where it is given none); HF's Ministral reads head_dim as given, none falling back
    "ministral": tiny_config("ministral", head_dim=16, sliding_window=5,
                             layer_types=["sliding_attention", "full_attention"]),
    "ministral-every_layer-mha-tied": tiny_config("ministral", head_dim=16, sliding_window=7, num_key_value_heads=4,
                                                  tie_word_embeddings=True),
    # CWM: Ministral's block with its configs' pattern (full attention on every 4th layer from the first, a
    # window on the others) and Llama 3's rope; or a bias on the MLP's projections
    "cwm": tiny_config("cwm", num_hidden_layers=3, head_dim=16, sliding_window=5, rope_parameters=CWM_ROPE,
                       **CWM_IDS),
    "cwm-mlp_bias-mha-tied": tiny_config("cwm", head_dim=16, sliding_window=7, mlp_bias=True, num_key_value_heads=4,
                                         tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"],
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **CWM_IDS),
    "qwen2": tiny_config("qwen2", tie_word_embeddings=True),
    "qwen2-window-layers": tiny_config(
        "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=3
    ),
    "qwen3": tiny_config("qwen3", head_dim=32),
    "qwen3-bias-tied": tiny_config("qwen3", head_dim=16, attention_bias=True, tie_word_embeddings=True),
    "gemma": tiny_config("gemma", head_dim=16, tie_word_embeddings=True),
    "gemma-window-unread": tiny_config("gemma", head_dim=16, sliding_window=5),
    "gemma2": tiny_config(  # soft-capping tight enough to bite at these scores; windowed layer 0
        "gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0, tie_word_embeddings=True,
    ),
    # VaultGemma: Gemma 2's attention, soft-capping and norms, a norm before each branch only; windowed layer 0
    # (its default pattern), tied as VaultGemma 1B; or the window on layer 1, with its default soft-caps
    "vaultgemma": tiny_config("vaultgemma", head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=True),
    "vaultgemma-bias-mqa": tiny_config("vaultgemma", head_dim=24, attention_bias=True, num_key_value_heads=1,
                                       layer_types=["full_attention", "sliding_attention"], sliding_window=5),
    # OLMo: LayerNorms without weight or bias, q, k and v clamped (OLMo 1.7's clip_qkv, at 2 where this
    # checkpoint's projections reach 4), rotary in float32; or no clamp, with biases, MHA, tied. Its default
    # eos_token_id, 50279, lies outside this vocabulary
    "olmo": tiny_config("olmo", clip_qkv=2.0, eos_token_id=2),
    "olmo-no_clip-bias-mha-tied": tiny_config("olmo", attention_bias=True, num_key_value_heads=4,
                                              tie_word_embeddings=True, eos_token_id=2),
    # OLMo 2's default eos_token_id, 50279, lies outside this vocabulary: the runtime refuses it
    "olmo2": tiny_config("olmo2", eos_token_id=2),
    "olmo2-mha-bias": tiny_config("olmo2", num_key_value_heads=4, attention_bias=True, eos_token_id=2),
    "olmo2-window-unread": tiny_config("olmo2", sliding_window=5, eos_token_id=2),
    # Phi-3's default special ids (32000) lie outside this vocabulary. Its window is on every layer;
    # partial rotary is Phi-4-mini's (0.75).
    "phi3": tiny_config("phi3", sliding_window=7, rope_parameters=partial_rope(0.5), **PHI3_IDS),
    "phi3-full-rotary": tiny_config("phi3", **PHI3_IDS),
    "phi3-mha-head_dim-tied": tiny_config("phi3", num_key_value_heads=4, head_dim=24, tie_word_embeddings=True,
                                          rope_parameters=partial_rope(0.75), **PHI3_IDS),
    # Granite 3's multipliers (8B's, attention's as 1 / head_dim), each moving the logits (test_declared_architectures)
    "granite": tiny_config("granite", embedding_multiplier=12.0, attention_multiplier=1 / 16, residual_multiplier=0.22,
                           logits_scaling=16.0),
    "granite-bias-tied": tiny_config("granite", attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                     embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.5,
                                     logits_scaling=8.0),
    # LayerNorm with bias, biases on every projection, an ungated gelu-tanh MLP; a window on every layer
    "starcoder2": tiny_config("starcoder2", sliding_window=7, **STARCODER2_IDS),
    "starcoder2-mha-no-bias-tied": tiny_config("starcoder2", num_key_value_heads=4, use_bias=False,
                                               tie_word_embeddings=True, **STARCODER2_IDS),
    # LayerNorm with bias, rotary on a quarter of each head (StableLM 2's default), q/k/v bias or none
    "stablelm": tiny_config("stablelm", **STABLELM_IDS),
    "stablelm-qkv_bias-mha-tied": tiny_config("stablelm", use_qkv_bias=True, num_key_value_heads=4,
                                              tie_word_embeddings=True, **STABLELM_IDS),
    # SmolLM3: no rotary on the layers no_rope_layers marks 0, by default the 4th; a window where
    # layer_types marks it (with use_sliding_window, HF's config marks the NoPE layers)
    "smollm3": tiny_config("smollm3", num_hidden_layers=4, **SMOLLM3_IDS),
    "smollm3-no_rope_layers-bias-tied": tiny_config("smollm3", num_hidden_layers=3, no_rope_layers=[0, 1, 0],
                                                    attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                    **SMOLLM3_IDS),
    "smollm3-window": tiny_config("smollm3", num_hidden_layers=4, use_sliding_window=True, sliding_window=5,
                                  **SMOLLM3_IDS),
    "smollm3-windows-mqa": tiny_config(  # NoPE every 2nd layer; windows on a rotary layer and a NoPE one
        "smollm3", num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=7,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        num_key_value_heads=1, **SMOLLM3_IDS),
    # StableLM 2 12B's parallel residual: attention and the MLP on the one input_layernorm
    "stablelm-parallel": tiny_config("stablelm", use_parallel_residual=True, use_qkv_bias=True, **STABLELM_IDS),
    # StableLM 2 12B's bias-free LayerNorm on each head of q (4 heads) and k (2 heads), a weight of its own
    # per head: in the block of one branch after the other with q/k/v bias, and in 12B's layout (with the
    # parallel residual, no q/k/v bias)
    "stablelm-qk_layernorm-qkv_bias": tiny_config("stablelm", qk_layernorm=True, use_qkv_bias=True, **STABLELM_IDS),
    "stablelm-qk_layernorm-parallel": tiny_config("stablelm", qk_layernorm=True, use_parallel_residual=True,
                                                  **STABLELM_IDS),
    # Cohere: the parallel block on one bias-free LayerNorm, interleaved rotary, logits times logit_scale
    # (Command R's 0.0625 leaves HF-initialised logits near zero; the variants take larger ones)
    "cohere": tiny_config("cohere", logit_scale=0.5, **COHERE_IDS),
    # Command R+'s q/k LayerNorm with a weight per head; attention bias, MHA, a head_dim of its own, tied
    "cohere-qk_norm-bias-mha-tied": tiny_config("cohere", use_qk_norm=True, attention_bias=True, num_key_value_heads=4,
                                                head_dim=24, tie_word_embeddings=True, logit_scale=2.0, **COHERE_IDS),
    # Cohere 2 (Command R7B): rotary and a window on the sliding layers, neither on the full one (every 4th)
    "cohere2": tiny_config("cohere2", num_hidden_layers=4, sliding_window=7, logit_scale=0.5, **COHERE_IDS),
    "cohere2-bias-mha": tiny_config("cohere2", num_hidden_layers=3, sliding_window=5, attention_bias=True,
                                    num_key_value_heads=4, logit_scale=2.0,
                                    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                    **COHERE_IDS),
    # GLM-4: a norm before and after each branch, q/k/v bias, rotary on the interleaved pairs of half of
    # each head, gate/up stored as one gate_up_proj
    "glm4": tiny_config("glm4", head_dim=16, **GLM4_IDS),
    "glm4-mqa-no_bias-tied": tiny_config("glm4", head_dim=24, num_key_value_heads=1, attention_bias=False,
                                         tie_word_embeddings=True, partial_rotary_factor=0.75, **GLM4_IDS),
    # GLM (GLM-4-9B-Chat): GLM-4's attention and MLP in Llama's block of two norms
    "glm": tiny_config("glm", head_dim=16, **GLM4_IDS),
    "glm-mqa-no_bias-tied": tiny_config("glm", head_dim=24, num_key_value_heads=1, attention_bias=False,
                                        tie_word_embeddings=True, partial_rotary_factor=0.75, **GLM4_IDS),
    # EXAONE 4: post-norms, per-head q/k norms; rotary and a window on the sliding layers, neither on the
    # full one (every 4th), as the 32B; with no window (the 1.2B) rotary on every layer
    "exaone4": tiny_config("exaone4", num_hidden_layers=4, sliding_window=7),
    "exaone4-no_window-llama3-tied": tiny_config(
        "exaone4", sliding_window=None, layer_types=["full_attention"] * 2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 1e6}),
    "exaone4-full_first-mha-head_dim": tiny_config(  # the 32B's pattern as a string, with layer_types given
        "exaone4", num_hidden_layers=3, sliding_window=5, sliding_window_pattern="LLLG",
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], num_key_value_heads=4, head_dim=24),
    # ERNIE 4.5: rotary on the interleaved pairs in float32 from float32 tables; tied (the 0.3B's), or a
    # bias on every projection
    "ernie4_5": tiny_config("ernie4_5", head_dim=16, tie_word_embeddings=True),
    "ernie4_5-bias-mha": tiny_config("ernie4_5", head_dim=24, use_bias=True, num_key_value_heads=4),
    # Gemma 3: a sliding layer and a full one, each with its own rope (the full one's linearly scaled, as
    # in the larger models), q/k norms per head
    "gemma3": tiny_config("gemma3_text", head_dim=16, layer_types=["sliding_attention", "full_attention"],
                          sliding_window=7),
    "gemma3-linear-mqa-tied-capped": tiny_config(
        "gemma3_text", head_dim=16, layer_types=["full_attention", "sliding_attention"], sliding_window=5,
        num_key_value_heads=1, tie_word_embeddings=True, query_pre_attn_scalar=24, final_logit_softcapping=4.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    ),
    # Seed-OSS: q/k/v bias by default, o_proj's and the MLP's biases settings of their own
    "seed_oss": tiny_config("seed_oss", head_dim=16, **SEED_OSS_IDS),
    "seed_oss-out_bias-mlp_bias-tied": tiny_config("seed_oss", attention_bias=False, attention_out_bias=True,
                                                   mlp_bias=True, tie_word_embeddings=True, **SEED_OSS_IDS),
    # OLMo 3: OLMo 2's block, a sliding layer and a full one, the full one's rope YaRN-scaled, or the
    # full layer first with plain rope on both
    "olmo3": tiny_config("olmo3", layer_types=["sliding_attention", "full_attention"], sliding_window=7,
                         rope_scaling=OLMO3_YARN, eos_token_id=2),
    "olmo3-mha-bias-tied": tiny_config("olmo3", layer_types=["full_attention", "sliding_attention"], sliding_window=5,
                                       num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True,
                                       eos_token_id=2),
    # Arcee: Llama's block with an ungated relu² MLP (up_proj, down_proj); AFM-4.5B's YaRN, here by 4 of 16
    # positions; or biases on q/k/v, o_proj and both MLP projections
    "arcee": tiny_config("arcee", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 16, "rope_theta": 10000.0},
                         **ARCEE_IDS),
    "arcee-bias-mha-tied": tiny_config("arcee", attention_bias=True, mlp_bias=True, num_key_value_heads=4,
                                       tie_word_embeddings=True, **ARCEE_IDS),
    # Nemotron: LayerNorm1P (a bias, the weight an offset from one), an ungated relu² MLP, rotary on the halves of
    # the first half of each head (its default); or on 18 of 24 channels, biases on every projection
    "nemotron": tiny_config("nemotron", head_dim=16),
    "nemotron-bias-mha-tied": tiny_config("nemotron", head_dim=24, partial_rotary_factor=0.75, attention_bias=True,
                                          mlp_bias=True, num_key_value_heads=4, tie_word_embeddings=True),
    # Helium: RMSNorms multiplying in float32, rotary on the interleaved pairs; heads as wide as hidden_size
    # in all, as HF's o_proj takes (its default head_dim, 128, is Helium-1 2B's)
    "helium": tiny_config("helium", head_dim=16),
    "helium-qkv_bias-mha-tied": tiny_config("helium", head_dim=16, attention_bias=True, num_key_value_heads=4,
                                            tie_word_embeddings=True),
    # LongRoPE: the 40 positions pass an original context of 32 (the long factors) or stay within 48 (the short)
    "phi3-longrope": tiny_config("phi3", rope_parameters=longrope(12), original_max_position_embeddings=32,
                                 **PHI3_IDS),
    "phi3-longrope-within": tiny_config("phi3", rope_parameters=longrope(12), original_max_position_embeddings=48,
                                        **PHI3_IDS),
}


def assert_matches(ours: torch.Tensor, reference: torch.Tensor):
    assert ours.shape == reference.shape
    assert relative_error(ours, reference) <= TOLERANCE
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, make_checkpoint, input_ids):
    path, reference = make_checkpoint(VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_fused_projections_load_stacked_or_apart(make_checkpoint, tmp_path, input_ids):
    """Phi-3's checkpoints hold q/k/v and gate/up stacked under the fused layers' own names; the
    same tensors apart, as Llama's hold them, fill the same layers."""
    path, reference = make_checkpoint(VARIANTS["phi3-mha-head_dim-tied"])
    stacked = load_file(path / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stacked and "model.layers.0.mlp.gate_up_proj.weight" in stacked
    apart = {}
    for name, tensor in stacked.items():
        parent, _, module = name.removesuffix(".weight").rpartition(".")
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(module, [])
        if not parts:
            apart[name] = tensor
            continue
        for part, rows in zip(parts, tensor.chunk(len(parts))):  # 4 KV heads: q, k and v of equal widths
            apart[f"{parent}.{part}.weight"] = rows.contiguous()
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(apart, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        expected = reference(input_ids).logits
        for checkpoint in (path, tmp_path):
            assert_matches(AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids), expected)


def test_sharded_checkpoint(make_checkpoint, input_ids):
    path, reference = make_checkpoint(tiny_config("llama"), max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    assert (path / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def bfloat16_pair(make_checkpoint, variant: str, input_ids):
    """A variant's checkpoint saved in bfloat16: its directory and HF's bfloat16 logits of ``input_ids``
    (on the CPU, where zoo's ops are PyTorch's, zoo can give them bit for bit)."""
    path, _ = make_checkpoint(VARIANTS[variant], dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return path, reference(input_ids).logits


def bfloat16_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["olmo", "olmo2", "olmo3"])
def test_olmo_rotates_in_float32_as_hf(variant, make_checkpoint, input_ids):
    """HF's OLMo, OLMo 2 and OLMo 3 rotate q and k by float32 cos and sin and round once (OLMo's
    LayerNorms without weight or bias normalise a float32 copy of their input and round once too,
    tests/layers/test_norm_embedding.py): in bfloat16 on the CPU, where zoo's ops are PyTorch's, their
    logits are HF's bit for bit, and rounding cos and sin to bfloat16 first (Llama's rotary) moves them."""
    path, expected = bfloat16_pair(make_checkpoint, variant, input_ids)
    model = bfloat16_model(path)
    with torch.no_grad():
        assert torch.equal(model(input_ids), expected)
        for layer in model.model.layers:
            layer.self_attn.rotary_precision = "activations"
        assert not torch.equal(model(input_ids), expected)


def test_helium_rounds_as_hf(make_checkpoint, input_ids):
    """HF's Helium rotates q and k in bfloat16 by cos and sin rounded to it, as Llama's rotary, and its
    RMSNorms multiply by their weight in float32 before rounding: in bfloat16 on the CPU its logits are
    HF's bit for bit, and rotating in float32 (Cohere's), or multiplying after the rounding (Llama's
    RMSNorm), moves them."""
    path, expected = bfloat16_pair(make_checkpoint, "helium", input_ids)
    with torch.no_grad():
        model = bfloat16_model(path)
        assert torch.equal(model(input_ids), expected)
        for layer in model.model.layers:
            layer.self_attn.rotary_precision = "float32"
        assert not torch.equal(model(input_ids), expected)
        model = bfloat16_model(path)
        for norm in (module for module in model.modules() if isinstance(module, RMSNorm)):
            norm.multiply_in_float32 = False
        assert not torch.equal(model(input_ids), expected)


def test_nemotron_adds_the_norms_one_in_the_weights_dtype_as_hf(make_checkpoint, input_ids):
    """HF's LayerNorm1P adds the one to its weight in the weight's dtype, then normalises in torch's kernel: in
    bfloat16 on the CPU zoo's logits are HF's bit for bit, and the one added in float32 moves them."""
    path, expected = bfloat16_pair(make_checkpoint, "nemotron", input_ids)
    model = bfloat16_model(path)
    with torch.no_grad():
        assert torch.equal(model(input_ids), expected)
        for norm in (module for module in model.modules() if isinstance(module, LayerNorm)):
            norm._norm = lambda x, norm=norm: F.layer_norm(x, x.shape[-1:], norm.weight.float() + 1, norm.bias.float(),
                                                           norm.eps)
        assert not torch.equal(model(input_ids), expected)


def test_helium_heads_wider_than_hidden_size_in_all_are_named(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("helium"))  # 4 heads of 128 channels, a hidden_size of 64
    with pytest.raises(CheckpointError, match=r"num_attention_heads \* head_dim \(4 \* 128\) differs from hidden_size "
                                              r"\(64\), the width HF's Helium o_proj takes"):
        AutoModelForCausalLM.from_pretrained(path)


def test_ernie_rotates_interleaved_pairs_in_float32_as_hf(make_checkpoint, input_ids):
    """HF's ERNIE 4.5 rotates the pairs (2i, 2i+1) by float32 cos and sin and rounds once: in bfloat16 on
    the CPU its logits are HF's bit for bit, and rounding cos and sin first, before the float32
    products (Cohere's) or with each product (Llama's), moves them. (zoo keeps the rotated pairs
    de-interleaved, a permutation of q's and k's channels; at head_dim 24 the CPU attention kernel sums
    their products in HF's order.)"""
    path, expected = bfloat16_pair(make_checkpoint, "ernie4_5-bias-mha", input_ids)
    model = bfloat16_model(path)
    with torch.no_grad():
        assert torch.equal(model(input_ids), expected)
        for precision in ("float32", "activations"):
            for layer in model.model.layers:
                layer.self_attn.rotary_precision = precision
            assert not torch.equal(model(input_ids), expected)


def test_bfloat16_checkpoint_loaded_as_float32(make_checkpoint, input_ids):
    path, _ = make_checkpoint(tiny_config("llama"), dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float32])
def test_dtype_auto_takes_the_checkpoint_dtype(make_checkpoint, input_ids, stored):
    path, _ = make_checkpoint(tiny_config("llama"), dtype=stored)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert reference.dtype == stored
    assert {p.dtype for p in model.parameters()} == {stored}
    assert next(AutoModelForCausalLM.from_pretrained(path, dtype="float32").parameters()).dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(input_ids), reference.model.embed_tokens(input_ids))


@pytest.mark.parametrize("recorded, loaded", [
    ({"torch_dtype": "bfloat16"}, torch.bfloat16),  # transformers 4's spelling
    ({}, torch.float32),
    ({"dtype": "int8"}, torch.float32),
])
def test_dtype_auto_without_a_floating_dtype_recorded_is_float32(make_checkpoint, recorded, loaded):
    path, _ = make_checkpoint(tiny_config("llama"), dtype=torch.bfloat16)
    fields = json.loads((path / "config.json").read_text())
    fields.pop("dtype")
    fields.update(recorded)
    (path / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {loaded}


def test_hub_style_config(make_checkpoint, input_ids):
    """Checkpoints as the hub ships them: rope_scaling + rope_theta + torch_dtype (transformers 4 names)."""
    config = tiny_config("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0})
    path, reference = make_checkpoint(config)
    fields = json.loads((path / "config.json").read_text())
    fields.pop("rope_parameters")
    fields.update(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=5000.0, torch_dtype=fields.pop("dtype"))
    (path / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_gemma_with_bidirectional_attention_is_refused(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("gemma", head_dim=16, use_bidirectional_attention=True))
    with pytest.raises(CheckpointError, match=r"ckpt: use_bidirectional_attention=True .* is not supported"):
        AutoModelForCausalLM.from_pretrained(path)


def test_wrong_rope_is_caught(make_checkpoint, input_ids):
    """The tolerance is tight enough to see a rope mistake: load a yarn checkpoint as plain rope."""
    path, reference = make_checkpoint(VARIANTS["rope-yarn"])
    fields = json.loads((path / "config.json").read_text())
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 100 * TOLERANCE


def test_flat_stream_equals_batched(make_checkpoint):
    """Sequences of different lengths in one flat stream give each sequence's own logits."""
    from layers import AttentionMetadata

    path, _ = make_checkpoint(tiny_config("mistral", sliding_window=5))
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(3)
    seqs = [torch.randint(0, 97, (n,)) for n in (9, 3, 14)]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    metadata = AttentionMetadata(query_lens=[len(s) for s in seqs])
    with torch.no_grad():
        flat = model(torch.cat(seqs), positions, metadata).split(metadata.query_lens)
        for seq, logits in zip(seqs, flat):
            assert torch.allclose(logits, model(seq[None])[0], rtol=0, atol=1e-5)


def test_tied_embeddings_share_one_parameter(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama", tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_partial_rotary_is_refused_where_hf_rotates_the_whole_head(make_checkpoint, model_type):
    # HF's Llama, Mistral and Qwen3 do not read the field: their default rope rotates every channel.
    path, _ = make_checkpoint(tiny_config(model_type, head_dim=16, partial_rotary_factor=0.5))
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor 0.5: this architecture rotates the whole head"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("variant, factor, words", [
    ("phi3", 1.5, r"partial_rotary_factor 1.5 of head_dim 16 rotates 24 channels"),
    ("phi3", 0.7, r"partial_rotary_factor 0.7 of head_dim 16 rotates 11 channels"),
    # Phi-3's own config class refuses NaN; Llama's keeps it, and zoo names it before building anything
    ("llama-gqa", float("nan"), r"'rope_parameters.partial_rotary_factor' must be a finite positive number, got nan"),
])
def test_a_partial_rotary_factor_zoo_cannot_take_is_named(make_checkpoint, variant, factor, words):
    path, _ = make_checkpoint(VARIANTS[variant])
    fields = json.loads((path / "config.json").read_text())
    fields["rope_parameters"]["partial_rotary_factor"] = factor
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match=words):
        AutoModelForCausalLM.from_pretrained(path)


def test_per_head_norms_load_apart_or_stacked(make_checkpoint, tmp_path, input_ids):
    """StableLM's checkpoints hold its q/k LayerNorms one per head (``q_layernorm.norms.{h}.weight``): the
    loader stacks them in head order into the layer's [heads, head_dim] weight. The same weights stacked
    under the layer's own name (Cohere's layout) fill it too; a head's tensor missing is named."""
    path, reference = make_checkpoint(VARIANTS["stablelm-qk_layernorm-parallel"])
    apart = load_file(path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(path)
    stacked = {name: tensor for name, tensor in apart.items() if ".norms." not in name}
    for layer in range(2):
        for norm, heads in (("q_layernorm", 4), ("k_layernorm", 2)):
            prefix = f"model.layers.{layer}.self_attn.{norm}"
            stacked[f"{prefix}.weight"] = torch.stack([apart[f"{prefix}.norms.{h}.weight"] for h in range(heads)])
            assert torch.equal(model.get_parameter(f"{prefix}.weight"), stacked[f"{prefix}.weight"])
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(stacked, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        expected = reference(input_ids).logits
        for checkpoint in (path, tmp_path):
            assert_matches(AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids), expected)
    del apart["model.layers.1.self_attn.k_layernorm.norms.1.weight"]
    save_file(apart, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors: model.layers.1.self_attn.k_layernorm.norms.1.weight"):
        AutoModelForCausalLM.from_pretrained(path)


def test_stablelm_qk_layernorm_in_bfloat16_is_hfs_bit_for_bit(make_checkpoint, input_ids):
    """In bfloat16 on the CPU, where zoo's ops are PyTorch's, StableLM 2 12B's layout gives HF's logits
    bit for bit: each head's LayerNorm multiplies by its weight in float32 and rounds once, as torch's
    LayerNorm kernel does in HF's. Rounding before the weight's product moves them."""
    path, expected = bfloat16_pair(make_checkpoint, "stablelm-qk_layernorm-parallel", input_ids)
    model = bfloat16_model(path)
    with torch.no_grad():
        assert torch.equal(model(input_ids), expected)
        for layer in model.model.layers:
            for norm in layer.self_attn.qk_norms:
                norm.forward = lambda x, norm=norm: F.layer_norm(x, x.shape[-1:], eps=norm.eps) * norm.weight
        assert not torch.equal(model(input_ids), expected)


@pytest.mark.parametrize("fields, words", [
    ({"use_sliding_window": False},
     r"layer_types marks layer 3 sliding_attention with use_sliding_window=False \(HF's eager and sdpa attention"),
    ({"no_rope_layers": [1, 1, 1]}, r"no_rope_layers has no entry for layer 3 \(num_hidden_layers=4\)"),
])
def test_smollm3_layouts_zoo_does_not_build_are_named(make_checkpoint, fields, words):
    path, _ = make_checkpoint(VARIANTS["smollm3-window"])
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **fields}))
    with pytest.raises(CheckpointError, match=words):
        AutoModelForCausalLM.from_pretrained(path)


def test_exaone4_sliding_layer_without_a_window_is_named(make_checkpoint):
    path, _ = make_checkpoint(VARIANTS["exaone4"])
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "sliding_window": None}))
    with pytest.raises(CheckpointError, match=r"layer_types marks layer 0 sliding_attention with sliding_window "
                                              r"null \(HF's EXAONE 4 cannot build its sliding-window mask\)"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("field, value, words", [
    ("short_factor", [1.0] * 5, r"short_factor field must have length 6, got 5"),  # transformers' own check
    ("long_factor", [1.0] * 5 + [float("nan")],
     r"rope_parameters.long_factor must be 6 finite positive numbers \(one per rotated channel pair of 12\)"),
])
def test_longrope_factors_zoo_cannot_take_are_named(make_checkpoint, field, value, words):
    path, _ = make_checkpoint(VARIANTS["phi3-longrope"])
    fields = json.loads((path / "config.json").read_text())
    fields["rope_parameters"][field] = value
    (path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match=words):
        AutoModelForCausalLM.from_pretrained(path)
