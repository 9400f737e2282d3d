"""Expert parallelism and the tensor-parallel forms of MoE, latent attention and LLaVA: two ranks (gloo
on the CPU, NCCL on two GPUs) in one process group load tiny checkpoints split over them; their logits
equal the one-rank model's, an expert-parallel rank reads only its experts' bytes, and experts the
ranks divide in neither way, or with biases by intermediate rows, are refused by name."""


import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from layers import ExpertParallelExperts, SparseMoE, TensorParallelExperts, tensor_parallel
from models import AutoModelForCausalLM
from models.auto import model_class_for
from ops_cuda.fp8 import FP8_DTYPE
from ops_cuda.paged_attention import attention_mask
from runtime.parallel import rank_device
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.layers.test_tensor_parallel import RANKS, TOLERANCE, counting_reads, run_ranks
from tests.loaders.test_fp8 import QUANTIZATION, write_pair
from tests.models.test_deepseek_v3 import deepseek_config, deepseek_hf_model
from tests.models.test_ernie4_5_moe import VARIANTS as ERNIE4_5_MOE_VARIANTS, biased_hf_model
from tests.models.test_exaone_moe import VARIANTS as EXAONE_MOE_VARIANTS
from tests.models.test_glm4_moe import LITE_VARIANTS, VARIANTS as GLM4_MOE_VARIANTS, glm4_moe_config
from tests.models.test_gpt_oss import gpt_oss_config, gpt_oss_hf_model, save_mxfp4_checkpoint
from tests.models.test_llava import PINPOINTS, hf_llava, inputs, llava_config, tiny_tokenizer
from tests.models.test_moe import per_expert_state_dict

QWEN3_MOE = tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
GRANITEMOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=12.0,
                  attention_multiplier=1 / 16, residual_multiplier=0.22, logits_scaling=6.0)
GRANITEMOESHARED = tiny_config("granitemoeshared", **GRANITEMOE, shared_intermediate_size=48)

# name -> (config, HF model maker, save_pretrained options, expert_parallel); experts per rank: E / 2 or all of them.
VARIANTS = {
    "qwen3_moe-ep": (QWEN3_MOE, hf_model, {}, None),  # 4 experts: 2 per rank by default
    "qwen3_moe-ep-stacked": (QWEN3_MOE, hf_model, {"save_original_format": False}, True),  # transformers 5's layout
    "qwen3_moe-tp": (QWEN3_MOE, hf_model, {}, False),  # every expert's 16 of 32 intermediate rows
    "qwen3_moe-tp-stacked": (QWEN3_MOE, hf_model, {"save_original_format": False}, False),  # two parts of gate_up
    "qwen2_moe-ep": (tiny_config("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48), hf_model, {}, None),  # a gated shared expert
    "mixtral-ep": (tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2), hf_model, {}, None),
    # the hub's stacked input_linear: a rank reads its experts' slice, or its gate rows and up rows of each expert
    "granitemoe-ep": (tiny_config("granitemoe", **GRANITEMOE), hf_model, {}, None),
    "granitemoeshared-tp": (GRANITEMOESHARED, hf_model, {}, False),  # the shared MLP split, all-reduced on its own
    "granitemoeshared-ep-stacked": (GRANITEMOESHARED, hf_model, {"save_original_format": False}, True),
    # heads 2 per rank, the latent replicated; 8 experts in 4 groups, 4 per rank; two shared experts split
    "deepseek_v3-ep": (deepseek_config(), deepseek_hf_model, {}, None),
    "deepseek_v3-no_q_lora-tp": (deepseek_config(q_lora_rank=None), deepseek_hf_model, {}, False),
    "glm4_moe-ep": (glm4_moe_config(), deepseek_hf_model, {}, None),  # q/k norms per head, partial rotary, q/k/v bias
    "glm4_moe_lite-tp": (LITE_VARIANTS["glm4_moe_lite-dense_between-no_q_lora"], deepseek_hf_model, {}, False),
    "dots1-ep": (GLM4_MOE_VARIANTS["dots1-window-groups"], deepseek_hf_model, {}, None),  # windows, q/k norms per head
    # the sinks split by heads; experts with biases, transposed and interleaved in the checkpoint, 2 per rank
    "gpt_oss-ep": (gpt_oss_config(num_local_experts=4), gpt_oss_hf_model, {}, None),
    # the router's correction bias, a row of the block's moe_statics, replicated; two shared experts split
    "ernie4_5_moe-ep": (ERNIE4_5_MOE_VARIANTS["ernie4_5_moe"], biased_hf_model, {}, None),
    # a bias on every projection, the tied LM head's split by vocabulary rows; no shared expert
    "ernie4_5_moe-bias-tied-ep": (ERNIE4_5_MOE_VARIANTS["ernie4_5_moe-norm_min-no_shared-bias-tied"],
                                  biased_hf_model, {}, None),
    # windows on three layers, q/k norms of one weight for all heads; 8 experts in 4 groups, 4 per rank
    "exaone_moe-ep": (EXAONE_MOE_VARIANTS["exaone_moe-window-groups"], biased_hf_model, {}, None),
    "exaone_moe-tp-stacked": (EXAONE_MOE_VARIANTS["exaone_moe-window-groups"], biased_hf_model,
                              {"save_original_format": False}, False),
    "llava_next": (llava_config(text=tiny_config("mistral", head_dim=16), next_pinpoints=PINPOINTS["wide-and-tall"]),
                   hf_llava, {}, None),  # the vision tower, projector and image_newline replicated
}
# An FP8 block-quantised DeepSeek-V3 (blocks of 16 x 32, experts per expert as on the hub), against its
# dequantised twin: the experts, read whole, stay FP8 on the CPU (whose FP8 ops dequantise and multiply);
# sliced weights load dequantised. On CUDA the FP8 kernels quantise the activations too, so there it
# loads dequantised (keep_fp8=False).
FP8_VARIANT = "deepseek_v3-fp8-ep"
VARIANTS[FP8_VARIANT] = (deepseek_config(), deepseek_hf_model, None, None)
FP8_QUANTIZATION = {**QUANTIZATION, "weight_block_size": [16, 32]}
# gpt-oss's MXFP4 experts, kept in MXFP4 (keep_mxfp4), 2 of 4 per rank, against one rank (dequantised).
MXFP4_VARIANT = "gpt_oss-mxfp4-ep"
VARIANTS[MXFP4_VARIANT] = (gpt_oss_config(num_local_experts=4), gpt_oss_hf_model, None, None)

# config -> words of the error tensor_parallel raises: 3 experts of 33 rows split neither way over 2 ranks
UNSPLITTABLE = {
    "neither": (None, "model.layers.0.mlp has 3 experts of intermediate size 33, neither a multiple of 2"),
    "expert_parallel": (True, "model.layers.0.mlp's experts (3) is not a multiple of 2"),
}


def run_rank(rank, device_type, port, paths, model_inputs, out_dir):
    import models.auto

    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=RANKS)
    open_checkpoint = models.auto.open_checkpoint
    results = {}
    for variant, path in paths.items():
        counts = {"whole": 0, "part": 0}
        if variant not in (FP8_VARIANT, MXFP4_VARIANT):  # an FP8 tensor's part is read whole, dequantised, then cut
            models.auto.open_checkpoint = lambda *a, counts=counts: counting_reads(open_checkpoint(*a), counts)
        else:
            models.auto.open_checkpoint = open_checkpoint
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device=device,
                                                     keep_fp8=variant == FP8_VARIANT and device.type == "cpu",
                                                     keep_mxfp4=variant == MXFP4_VARIANT,
                                                     tensor_parallel=dist.group.WORLD,
                                                     expert_parallel=VARIANTS[variant][3])
        with torch.no_grad():
            logits = model(**{k: v.to(device) for k, v in model_inputs[variant].items()}).cpu()
        experts = [m for m in model.modules() if isinstance(m, (ExpertParallelExperts, TensorParallelExperts))]
        results[variant] = dict(
            logits=logits, counts=counts, held=sum(p.numel() * p.element_size() for p in model.parameters()),
            experts=[(type(m).__name__, getattr(m, "experts", None), getattr(m, "rows", None)) for m in experts],
            expert_bytes=sum(p.numel() * p.element_size() for m in experts for p in m.parameters()),
            kv_cache=model.kv_cache_spec()[0],
            dtypes={name: p.dtype for name, p in model.named_parameters()},
        )
        if variant == "deepseek_v3-ep":
            results[variant]["absorbed"] = absorbed_attention(model, device)
    models.auto.open_checkpoint = open_checkpoint
    errors = {}
    config = tiny_config("qwen3_moe", num_experts=3, num_experts_per_tok=2, moe_intermediate_size=33)
    for name, (expert_parallel, _) in UNSPLITTABLE.items():
        try:
            with torch.device("meta"):
                tensor_parallel(model_class_for(config)(config), dist.group.WORLD, expert_parallel)
        except ValueError as exc:
            errors[name] = str(exc)
    torch.save({"results": results, "errors": errors}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def attention_inputs(model, device):
    """Layer 1's latent attention (the rank's heads) and its projected inputs for 20 random hidden states."""
    attention = model.model.layers[1].self_attn
    hidden = torch.randn(20, 64, generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(20, device=device)
    return attention, attention.project(hidden), attention_mask(positions, 20, None)


@torch.no_grad()
def absorbed_attention(model, device):
    """The decode form (W_UK folded into q, W_UV after attending over the latents) through the rank's
    slice of kv_b_proj: [20, rank's heads, v_head_dim]."""
    attention, (q_nope, q_rope, latent, k_rope), mask = attention_inputs(model, device)
    return attention.absorbed_attention(q_nope, q_rope, latent, k_rope, mask).cpu()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def ranks_run(request, tmp_path_factory):
    """Every variant's checkpoint, loaded and run by two ranks on ``request.param`` devices:
    (device type, paths, inputs, per-rank results)."""
    device_type = request.param
    if device_type == "cuda" and torch.cuda.device_count() < RANKS:
        pytest.skip(f"needs {RANKS} CUDA devices")
    root = tmp_path_factory.mktemp(f"tp_moe_{device_type}")
    torch.manual_seed(1)
    text_ids = torch.randint(0, 97, (2, 24))
    paths, dense_paths, model_inputs = {}, {}, {}
    for name, (config, make, save_options, _) in VARIANTS.items():
        if name == FP8_VARIANT:
            (root / name).mkdir()
            model = make(config)
            fp8, twin = write_pair(model, per_expert_state_dict(model), root / name, FP8_QUANTIZATION)
            paths[name], dense_paths[name] = str(fp8), str(twin)
        elif name == MXFP4_VARIANT:
            paths[name] = dense_paths[name] = str(save_mxfp4_checkpoint(make(config), root / name))
        else:
            paths[name] = dense_paths[name] = str(save_checkpoint(make(config), root / name, **save_options))
        if name.startswith("llava"):
            input_ids, images = inputs(config, tiny_tokenizer())
            model_inputs[name] = {"input_ids": input_ids, **images}
        else:
            model_inputs[name] = {"input_ids": text_ids}
    outputs = run_ranks(run_rank, device_type, paths, model_inputs, root)
    return device_type, (paths, dense_paths), model_inputs, outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_give_the_one_rank_logits(variant, ranks_run):
    device_type, (_, dense_paths), model_inputs, outputs = ranks_run
    device = rank_device(device_type, 0)
    with torch.no_grad():
        dense = AutoModelForCausalLM.from_pretrained(dense_paths[variant], dtype=torch.float32, device=device)(
            **{k: v.to(device) for k, v in model_inputs[variant].items()}).cpu()
    for output in outputs:
        logits = output["results"][variant]["logits"]
        assert logits.shape == dense.shape and logits.shape[-1] == 97
        assert relative_error(logits, dense) <= TOLERANCE
        assert torch.equal(logits.argmax(-1), dense.argmax(-1))


def test_experts_split_as_chosen(ranks_run):
    _, _, _, outputs = ranks_run
    for rank, output in enumerate(outputs):
        results = output["results"]
        ep, tp = results["qwen3_moe-ep"]["experts"], results["qwen3_moe-tp"]["experts"]
        assert ep == [("ExpertParallelExperts", slice(2 * rank, 2 * rank + 2), None)] * 2
        assert tp == [("TensorParallelExperts", None, slice(16 * rank, 16 * rank + 16))] * 2
        assert results["granitemoe-ep"]["experts"] == ep
        assert results["granitemoeshared-tp"]["experts"] == tp
        # DeepSeek-V3: the first layer is dense, the other two hold 4 of the 8 experts
        assert results["deepseek_v3-ep"]["experts"] == [("ExpertParallelExperts", slice(4 * rank, 4 * rank + 4),
                                                         None)] * 2
        # MLA: every rank caches the whole latent (kv_lora_rank 16 + rope 8), whatever its heads
        assert results["deepseek_v3-ep"]["kv_cache"] == ((24,),)


def test_latent_attention_heads_split_and_the_absorbed_form_reads_the_rank_s_slice(ranks_run):
    device_type, (_, dense_paths), _, outputs = ranks_run
    device = rank_device(device_type, 0)
    dense = AutoModelForCausalLM.from_pretrained(dense_paths["deepseek_v3-ep"], dtype=torch.float32, device=device)
    with torch.no_grad():
        attention, (q_nope, q_rope, latent, k_rope), mask = attention_inputs(dense, device)
        plain = attention.plain_attention(q_nope, q_rope, latent, k_rope, mask).cpu()  # [20, 4 heads, 12]
    for rank, output in enumerate(outputs):
        absorbed = output["results"]["deepseek_v3-ep"]["absorbed"]
        assert absorbed.shape == (20, 2, 12)
        assert relative_error(absorbed, plain[:, 2 * rank : 2 * rank + 2]) <= TOLERANCE
        dtypes = output["results"]["deepseek_v3-ep"]["dtypes"]
        assert dtypes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == torch.float32


def test_fp8_experts_stay_fp8_and_sliced_weights_load_dequantised(ranks_run):
    device_type, (paths, _), _, outputs = ranks_run
    stored = load_file(f"{paths[FP8_VARIANT]}/model.safetensors")
    expert_weights = sum(t.numel() * t.element_size() for name, t in stored.items()
                         if ".experts." in name and name.endswith(".weight"))  # their scales are buffers
    for output in outputs:
        if device_type == "cpu":  # kept in FP8: each rank holds its half of the experts' weights
            assert output["results"][FP8_VARIANT]["expert_bytes"] * RANKS == expert_weights
        dtypes = output["results"][FP8_VARIANT]["dtypes"]
        kept = FP8_DTYPE if device_type == "cpu" else torch.float32
        experts = "model.layers.1.mlp.experts"
        assert dtypes[f"{experts}.gate_up_proj"] == dtypes[f"{experts}.down_proj"] == kept
        assert dtypes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == kept  # replicated: read whole
        for sliced in ("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.shared_experts.down_proj"):
            assert dtypes[f"model.layers.1.{sliced}.weight"] == torch.float32


def test_mxfp4_experts_stay_mxfp4_each_rank_holding_its_experts_blocks(ranks_run):
    _, (paths, _), _, outputs = ranks_run
    stored = load_file(f"{paths[MXFP4_VARIANT]}/model.safetensors")
    experts = "model.layers.1.mlp.experts"
    blocks_and_biases = sum(t.numel() * t.element_size() for name, t in stored.items()
                            if ".experts." in name and not name.endswith("_scales"))  # the scales are buffers
    for rank, output in enumerate(outputs):
        dtypes = output["results"][MXFP4_VARIANT]["dtypes"]
        assert dtypes[f"{experts}.gate_up_proj"] == dtypes[f"{experts}.down_proj"] == torch.uint8
        assert output["results"][MXFP4_VARIANT]["expert_bytes"] * RANKS == blocks_and_biases
        assert output["results"][MXFP4_VARIANT]["experts"][0][1] == slice(2 * rank, 2 * rank + 2)


# An FP8 tensor's part is read whole, dequantised, then cut: its reads are not counted (what its ranks
# hold: test_fp8_experts_stay_fp8_and_sliced_weights_load_dequantised); an MXFP4 tensor's blocks are read
# past the counted references (test_mxfp4_experts_stay_mxfp4_each_rank_holding_its_experts_blocks).
@pytest.mark.parametrize("variant", [variant for variant in VARIANTS if variant not in (FP8_VARIANT, MXFP4_VARIANT)])
def test_each_rank_reads_only_its_part(variant, ranks_run):
    _, (paths, _), _, outputs = ranks_run
    whole = sum(t.numel() * t.element_size() for t in load_file(f"{paths[variant]}/model.safetensors").values())
    checkpoint_experts = sum(t.numel() * t.element_size() for name, t in
                             load_file(f"{paths[variant]}/model.safetensors").items() if is_expert_tensor(name))
    for output in outputs:
        result = output["results"][variant]
        # Every byte read fills one parameter element of the rank: an expert-parallel rank reads its
        # experts and no other's.
        assert result["counts"]["whole"] + result["counts"]["part"] == result["held"] < whole
        if result["experts"]:
            assert result["expert_bytes"] * RANKS == checkpoint_experts


def is_expert_tensor(name: str) -> bool:
    """A routed expert's tensor: one per expert or stacked (``experts.``), or GraniteMoe's stacked ones."""
    return ".experts." in name or any(f".block_sparse_moe.{stack}_linear." in name for stack in ("input", "output"))


@pytest.mark.parametrize("name", UNSPLITTABLE)
def test_experts_the_ranks_cannot_split_are_refused(name, ranks_run):
    _, _, _, outputs = ranks_run
    for output in outputs:
        assert UNSPLITTABLE[name][1] in output["errors"][name]


def test_experts_with_biases_split_by_whole_experts_only(monkeypatch):
    """A slice of intermediate rows would add each expert's down bias on every rank: refused by name."""
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)  # rank 0 of 2, without a process group
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    with torch.device("meta"):
        model = nn.ModuleDict({"mlp": SparseMoE(16, 4, 2, 8, "clamped_swiglu", renormalize=True, expert_bias=True)})
    with pytest.raises(NotImplementedError, match="cannot split mlp's experts by intermediate rows: they have biases"):
        tensor_parallel(model, None, expert_parallel=False)
    tensor_parallel(model, None)
    experts = model["mlp"].experts
    assert isinstance(experts, ExpertParallelExperts) and experts.down_proj_bias.shape == (2, 16)


def test_shared_experts_with_a_down_bias_are_refused(monkeypatch):
    """ERNIE 4.5 MoE's shared experts where use_bias: the block's one all-reduce would add their down bias on
    every rank. Refused by name before any weight is read."""
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)  # rank 0 of 2, without a process group
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    config = ERNIE4_5_MOE_VARIANTS["ernie4_5_moe-bias-interval2-end2-top3"]
    with torch.device("meta"):
        model = model_class_for(config)(config)
    with pytest.raises(NotImplementedError, match="cannot split model.layers.1.mlp's shared experts: their "
                                                  "down_proj has a bias"):
        tensor_parallel(model, object())  # a stand-in group: nothing is communicated
