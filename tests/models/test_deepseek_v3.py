"""DeepSeek-V3 against HuggingFace, float32 on CPU: logits across its attention and routing variants,
from checkpoints in both config layouts; multi-head latent attention's two forms; the MTP layers of
real checkpoints skipped on load; the layer-by-layer diff; the runtime over the latent paged cache,
token-identical to HF's greedy generate through prefix-cache hits, chunked prefill and preemption."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from layers import AttentionMetadata, TopKRouter
from models import AutoModelForCausalLM
from ops_cuda.paged_attention import attention_mask
from runtime import LLM, SamplingParams
from runtime.diff import diff_checkpoint, diff_models, format_rows
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_parity import assert_matches
from tests.runtime.test_runtime import GREEDY, token_ids
from tests.runtime.test_runtime import prompts as runtime_prompts

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
DEEPSEEK = dict(
    num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, moe_intermediate_size=16,
    n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5,
    rope_interleave=True, norm_topk_prob=True,
)


def deepseek_config(**overrides):
    return tiny_config("deepseek_v3", **{**DEEPSEEK, **overrides})


VARIANTS = {
    "q_lora-interleaved-groups": deepseek_config(),
    "no_q_lora": deepseek_config(q_lora_rank=None),
    "yarn": deepseek_config(max_position_embeddings=64, rope_parameters=YARN),
    "neox_rope-no_norm_topk": deepseek_config(rope_interleave=False, norm_topk_prob=False),
    "one_group-all_dense_but_last": deepseek_config(n_group=1, topk_group=1, first_k_dense_replace=2),
    "attention_bias": deepseek_config(attention_bias=True),
}


DEEPSEEK_V2 = {k: v for k, v in DEEPSEEK.items() if k not in ("rope_interleave", "norm_topk_prob")}
V2_VARIANTS = {
    "v2-greedy": tiny_config("deepseek_v2", **DEEPSEEK_V2, topk_method="greedy"),
    "v2-group_limited_greedy-no_q_lora": tiny_config(
        "deepseek_v2", **{**DEEPSEEK_V2, "q_lora_rank": None}, topk_method="group_limited_greedy"
    ),
    "v2-yarn": tiny_config("deepseek_v2", **DEEPSEEK_V2, topk_method="greedy", rope_parameters=YARN),
    "v2-mlp_bias": tiny_config("deepseek_v2", **DEEPSEEK_V2, topk_method="greedy", mlp_bias=True),
}


def deepseek_hf_model(config):
    """HF's model with a non-zero score correction bias (HF starts it at zero), large enough to change
    which experts are chosen."""
    model = hf_model(config)
    generator = torch.Generator().manual_seed(3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return model


@pytest.fixture
def make_deepseek(tmp_path):
    def make(config):
        model = deepseek_hf_model(config)
        return save_checkpoint(model, tmp_path / "ckpt"), model

    return make


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_huggingface(variant, make_deepseek, input_ids):
    path, reference = make_deepseek(VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_stacked_experts_layout(tmp_path, input_ids):
    """Checkpoints as transformers 5 writes its own module layout: experts stacked."""
    reference = deepseek_hf_model(VARIANTS["q_lora-interleaved-groups"])
    path = save_checkpoint(reference, tmp_path / "stacked", save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_bfloat16_model_keeps_the_correction_bias_in_float32(make_deepseek):
    path, reference = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, reference.model.layers[1].mlp.gate.e_score_correction_bias)


def test_router_chooses_by_the_biased_scores_within_the_best_groups_and_weighs_by_the_scores():
    router = TopKRouter(4, num_experts=8, top_k=2, renormalize=False, scoring="sigmoid", score_correction_bias=True,
                        num_groups=4, topk_groups=1, scaling_factor=2.5)
    router.weight.copy_(torch.eye(8, 4) * 4)  # token [1, 0, 0, 0]: expert 0 scores highest, then the rest equally
    router.e_score_correction_bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 5.0, 4.0]))
    weights, ids = router(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert sorted(ids[0].tolist()) == [6, 7]  # group 3 wins by its bias alone
    assert torch.allclose(weights[0], torch.full((2,), 0.5 * 2.5))  # sigmoid(0) each, unbiased, scaled
    router.num_groups, router.topk_groups = 1, 1
    router.e_score_correction_bias.zero_()
    weights, ids = router(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert 0 in ids[0].tolist()
    assert weights[ids == 0].item() == pytest.approx(2.5 * torch.sigmoid(torch.tensor(4.0)).item())


@pytest.mark.parametrize("options, message", [
    (dict(num_groups=3, topk_groups=1), "n_group=3 must divide the 8 experts"),
    (dict(num_groups=4, topk_groups=5), "topk_group=5 must be in"),
    (dict(num_groups=8, topk_groups=2), "fewer than 2 of the 8 experts in a group"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "num_experts_per_tok=3 must be in \\[1, the 2 experts"),
    (dict(top_k=9), "num_experts_per_tok=9 must be in \\[1, num_experts=8\\]"),
    (dict(scoring="tanh"), "unsupported router scoring 'tanh'"),
])
def test_router_options_that_cannot_work_are_named(options, message):
    options = {"top_k": 2, **options}
    with pytest.raises(ValueError, match=message):
        TopKRouter(4, num_experts=8, renormalize=True, **options)


@pytest.mark.parametrize("variant", V2_VARIANTS)
def test_deepseek_v2_logits_match_huggingface(variant, make_deepseek, input_ids):
    path, reference = make_deepseek(V2_VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_the_correction_bias_is_used(make_deepseek, input_ids):
    """The bias is used: zeroing it in zoo's model moves the logits off HuggingFace's."""
    path, reference = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    model = AutoModelForCausalLM.from_pretrained(path)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        assert relative_error(model(input_ids), reference(input_ids).logits) > 1e-3


@pytest.mark.parametrize("qk_head_dim", ["present", "absent"])
def test_hub_config_layout(make_deepseek, input_ids, qk_head_dim):
    """Configs as the hub ships them: ``rope_scaling`` with ``type`` + ``rope_theta``, with or without
    the derived ``qk_head_dim`` and ``head_dim``."""
    path, reference = make_deepseek(VARIANTS["yarn"])
    fields = json.loads((path / "config.json").read_text())
    rope = fields.pop("rope_parameters")
    fields["rope_theta"] = rope.pop("rope_theta")
    fields["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    if qk_head_dim == "absent":
        fields.pop("qk_head_dim", None)
        fields.pop("head_dim", None)
    else:
        fields["qk_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    (path / "config.json").write_text(json.dumps(fields))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_yarn_mscale_is_in_the_softmax_scale(make_deepseek, input_ids):
    path, reference = make_deepseek(VARIANTS["yarn"])
    model = AutoModelForCausalLM.from_pretrained(path)
    scale = model.model.layers[0].self_attn.scale
    assert scale == pytest.approx(reference.model.layers[0].self_attn.scaling, rel=1e-12)
    assert scale != pytest.approx(16**-0.5)


@pytest.mark.parametrize("variant", ["q_lora-interleaved-groups", "no_q_lora", "yarn"])
def test_absorbed_form_equals_plain_form(variant, make_deepseek):
    """W_UK folded into the query and W_UV applied after attending over the latents gives the plain
    form's output, for prompt rows (causal) and a decode row (the last position over every key)."""
    path, _ = make_deepseek(VARIANTS[variant])
    model = AutoModelForCausalLM.from_pretrained(path)
    attention = model.model.layers[1].self_attn
    torch.manual_seed(0)
    hidden = torch.randn(20, 64)
    positions = torch.arange(20)
    q_nope, q_rope, latent, k_rope = attention.project(hidden)
    for rows in (slice(0, 20), slice(19, 20)):
        mask = attention_mask(positions[rows], 20, None)
        plain = attention.plain_attention(q_nope[rows], q_rope[rows], latent, k_rope, mask)
        absorbed = attention.absorbed_attention(q_nope[rows], q_rope[rows], latent, k_rope, mask)
        assert plain.shape == (rows.stop - rows.start, 4, 12)
        assert relative_error(absorbed, plain) <= 1e-5


def test_flat_stream_of_unequal_sequences_equals_each_alone(make_deepseek):
    path, _ = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(2)
    first, second = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 5))
    flat = torch.cat((first[0], second[0]))
    positions = torch.cat((torch.arange(9), torch.arange(5)))
    with torch.no_grad():
        logits = model(flat, positions, AttentionMetadata(query_lens=[9, 5]))
        # MKL sums the products of 14, 9 and 5 rows in different orders
        assert relative_error(logits[:9], model(first)[0]) <= 1e-5
        assert relative_error(logits[9:], model(second)[0]) <= 1e-5


def test_kv_cache_entry_is_one_latent_per_token(make_deepseek):
    path, _ = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    model = AutoModelForCausalLM.from_pretrained(path)
    assert [layer.self_attn.kv_cache_shapes for layer in model.model.layers] == [((16 + 8,),)] * 3


def test_mtp_layers_in_the_checkpoint_are_skipped(make_deepseek, input_ids):
    """Real checkpoints carry ``num_nextn_predict_layers`` extra layers past ``num_hidden_layers``."""
    path, reference = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    tensors = load_file(path / "model.safetensors")
    mtp = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
           for name, t in tensors.items() if name.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.eh_proj.weight": torch.ones(64, 128)})
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert_matches(model(input_ids), reference(input_ids).logits)


def test_diff_rows_within_tolerance(make_deepseek, input_ids):
    """``zoo diff``: cache-free, and in the runtime mode (the prefill through the latent paged cache,
    then decode steps in the absorbed form, against HF with its cache)."""
    path, reference = make_deepseek(VARIANTS["q_lora-interleaved-groups"])
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = diff_models(model, reference, input_ids)
    assert len(rows) >= 3 + 2
    assert all(row.ok for row in rows), format_rows(rows)
    rows = diff_checkpoint(path, input_ids=input_ids[:1, :11], runtime_steps=3)
    assert {row.path.partition("/")[0] for row in rows} == {"prefill", "decode 1", "decode 2", "decode 3"}
    assert all(row.ok for row in rows), format_rows(rows)


@pytest.fixture(scope="module")
def runtime_checkpoint(tmp_path_factory):
    reference = deepseek_hf_model(VARIANTS["q_lora-interleaved-groups"])
    return save_checkpoint(reference, tmp_path_factory.mktemp("deepseek")), reference


def deepseek_llm(path, **options):
    return LLM(str(path), device="cpu", block_size=4, **options)


def test_the_kv_cache_holds_one_latent_pool_per_layer(runtime_checkpoint):
    path, _ = runtime_checkpoint
    engine = deepseek_llm(path).engine
    assert [tuple(pool.shape[1:]) for (pool,) in engine.kv_cache.pools] == [(4, 16 + 8)] * 3
    assert not engine.runner.model.capturable


def test_greedy_matches_hf_generate(runtime_checkpoint):
    path, reference = runtime_checkpoint
    batch = runtime_prompts(5, seed=0, low=1, high=40)
    outputs = deepseek_llm(path).generate(batch, GREEDY, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert output.token_ids == expected.tolist()


def test_chunked_prefill_prefix_cache_hits_and_preemption_change_nothing(runtime_checkpoint):
    path, _ = runtime_checkpoint
    shared = runtime_prompts(1, seed=2, low=20, high=20)[0]
    batch = [shared + tail for tail in runtime_prompts(4, seed=3, low=1, high=9)] + runtime_prompts(2, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = [token_ids(deepseek_llm(path, enable_prefix_caching=False).generate([p], params, use_tqdm=False))[0]
            for p in batch]
    cached = deepseek_llm(path)
    assert token_ids(cached.generate(batch, params, use_tqdm=False)) == solo
    again = cached.generate(batch, params, use_tqdm=False)
    assert token_ids(again) == solo and all(o.num_cached_tokens >= 16 for o in again[:4])
    chunked = deepseek_llm(path, max_num_batched_tokens=7)
    assert token_ids(chunked.generate(batch, params, use_tqdm=False)) == solo
    tight = deepseek_llm(path, num_blocks=16)
    assert token_ids(tight.generate(batch, params, use_tqdm=False)) == solo
    assert tight.engine.scheduler.num_preemptions > 0


def test_the_triton_backend_gives_the_torch_backends_tokens(runtime_checkpoint):
    """On the CPU the triton backend's latent ops run their references, through its own prompt path
    (all prompts' latents gathered and decompressed at once)."""
    path, _ = runtime_checkpoint
    batch = runtime_prompts(3, seed=5)
    triton = deepseek_llm(path, attention_backend="triton")
    assert triton.engine.kv_cache.pools[0][0].shape[1:] == (4, 24)
    assert triton.engine.runner.model.capturable
    assert token_ids(triton.generate(batch, GREEDY, use_tqdm=False)) == token_ids(
        deepseek_llm(path, attention_backend="torch").generate(batch, GREEDY, use_tqdm=False))


def test_compiled_decode_is_refused_clearly(runtime_checkpoint):
    path, _ = runtime_checkpoint
    with pytest.raises(ValueError, match="compile_decode: .* latent attention's paged path"):
        deepseek_llm(path, compile_decode=True)
