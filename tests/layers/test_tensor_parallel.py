"""Tensor parallelism: two ranks (spawned processes; gloo on the CPU, NCCL on two GPUs) load tiny
checkpoints split over them; their logits equal the one-rank model's, each rank reads only its part
of the checkpoint, and layouts the ranks cannot split are refused by name."""

import socket
import time
from pathlib import Path
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from layers import ColumnParallelLinear, tensor_parallel
from loaders import CheckpointError, copy_weights
from models import AutoModelForCausalLM
from models.auto import model_class_for
from runtime.parallel import rank_device
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_parity import COHERE_IDS, STABLELM_IDS, VARIANTS as PARITY

RANKS = 2
TIMEOUT_S = 120  # the whole two-rank run; a rank that fails or hangs ends the test, never CI
TOLERANCE = 1e-5

VARIANTS = {
    "llama-gqa": tiny_config("llama"),  # 4 heads, 2 KV heads: one KV head per rank
    "llama-kv1": tiny_config("llama", num_key_value_heads=1),  # the one KV head replicated on both ranks
    "llama-bias-tied": tiny_config("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen3": tiny_config("qwen3", head_dim=32),  # per-head q/k norms
    "gemma": tiny_config("gemma", head_dim=16, tie_word_embeddings=True),  # scaled embeddings
    "vaultgemma": PARITY["vaultgemma"],  # soft-capped scores and logits, a window on layer 0
    "ministral": PARITY["ministral"],  # a window on layer 0, none on layer 1
    "cwm": PARITY["cwm-mlp_bias-mha-tied"],  # down_proj's bias added once
    "phi3": PARITY["phi3"],  # q/k/v and gate/up stacked in the checkpoint: each rank reads its rows of each
    "granite": PARITY["granite"],  # each branch scaled after its all-reduce
    "stablelm": PARITY["stablelm"],  # LayerNorm replicated, partial rotary
    "seed_oss": PARITY["seed_oss-out_bias-mlp_bias-tied"],  # o_proj's and down_proj's biases added once
    "smollm3": PARITY["smollm3-windows-mqa"],  # NoPE layers, windows, the one KV head replicated on both ranks
    "stablelm-parallel": PARITY["stablelm-parallel"],  # attention and the MLP side by side: each all-reduced
    "cohere": PARITY["cohere"],
    "cohere2": PARITY["cohere2"],  # NoPE full layers, windowed sliding ones
    # q/k norms with a weight per head: each rank holds its heads' rows; o_proj's bias added once
    "cohere-qk_norm": PARITY["cohere-qk_norm-bias-mha-tied"],
    "cohere-qk_norm-kv1": tiny_config("cohere", use_qk_norm=True, num_key_value_heads=1, logit_scale=0.5,
                                      **COHERE_IDS),  # the one KV head's k_norm row on both ranks
    "glm4": PARITY["glm4"],  # gate_up_proj stacked; q/k/v bias; four norms a block, replicated
    "glm": PARITY["glm-mqa-no_bias-tied"],  # the one KV head replicated on both ranks
    # ungated MLPs: c_fc's (up_proj's) rows and their bias sliced, c_proj's (down_proj's) bias added once
    "starcoder2": PARITY["starcoder2"],
    "arcee": PARITY["arcee-bias-mha-tied"],
    "nemotron": PARITY["nemotron-bias-mha-tied"],  # LayerNorm1P replicated; partial rotary
    "olmo": PARITY["olmo"],  # q, k and v clamped on each rank's heads; LayerNorms without weight
    "helium": PARITY["helium"],  # interleaved rotary, no o_proj bias
    "exaone4": PARITY["exaone4"],  # post-norms and per-head q/k norms replicated; NoPE full layer, windowed others
    "ernie4_5": PARITY["ernie4_5-bias-mha"],  # interleaved rotary in float32; o_proj's and down_proj's biases once
    # StableLM 2 12B's layout: q/k norms stored one per head, each rank reading its heads' tensors
    "stablelm-qk_layernorm": PARITY["stablelm-qk_layernorm-parallel"],
    "stablelm-qk_layernorm-kv1": tiny_config("stablelm", qk_layernorm=True, num_key_value_heads=1,
                                             **STABLELM_IDS),  # the one KV head's k_layernorm on both ranks
}

UNSPLITTABLE = {  # config -> the error tensor_parallel raises, and words of its message
    "heads": (tiny_config("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48),
              ValueError, "attention heads (3) is not a multiple of 2"),
    "olmo2": (tiny_config("olmo2"), NotImplementedError, "q/k norm spans all heads"),
    "olmo3": (tiny_config("olmo3"), NotImplementedError, "q/k norm spans all heads"),
    "olmoe": (tiny_config("olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32), NotImplementedError,
              "q/k norm spans all heads"),
    "minimax_m2": (tiny_config("minimax_m2", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                               head_dim=16), NotImplementedError, "q/k norm spans all heads"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counting_reads(checkpoint, counts):
    """Wraps each tensor's readers to add the bytes they return to ``counts`` (whole, part)."""
    for ref in checkpoint.values():
        def load(load=ref.load):
            tensor = load()
            counts["whole"] += tensor.numel() * tensor.element_size()
            return tensor

        def load_part(index, ref=ref):
            tensor = ref.read_part(index)
            counts["part"] += tensor.numel() * tensor.element_size()
            return tensor

        ref.load, ref.load_part = load, load_part
    return checkpoint


def run_rank(rank, device_type, port, paths, input_ids, out_dir):
    import models.auto

    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=RANKS, timeout=timedelta(seconds=60))
    open_checkpoint = models.auto.open_checkpoint
    results = {}
    for variant, path in paths.items():
        counts = {"whole": 0, "part": 0}
        models.auto.open_checkpoint = lambda *a, counts=counts: counting_reads(open_checkpoint(*a), counts)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device=device,
                                                     tensor_parallel=dist.group.WORLD)
        with torch.no_grad():
            logits = model(input_ids.to(device)).cpu()
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        qkv_rows = model.model.layers[0].self_attn.qkv_proj.source_rows
        results[variant] = dict(logits=logits, counts=counts, held=held, kv_cache=model.kv_cache_spec()[0],
                                qkv_rows=qkv_rows, splits_norms=model.model.splitting)
    models.auto.open_checkpoint = open_checkpoint
    errors = {}
    for name, (config, _, _) in UNSPLITTABLE.items():
        try:
            with torch.device("meta"):
                tensor_parallel(model_class_for(config)(config), dist.group.WORLD)
        except Exception as exc:  # the test compares type and message
            errors[name] = (type(exc), str(exc))
    torch.save({"results": results, "errors": errors}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def ranks_run(request, tmp_path_factory):
    """Every variant's checkpoint, loaded and run by two ranks in one process group on ``request.param``
    devices: (device type, paths, inputs, per-rank results)."""
    device_type = request.param
    if device_type == "cuda" and torch.cuda.device_count() < RANKS:
        pytest.skip(f"needs {RANKS} CUDA devices")
    root = tmp_path_factory.mktemp(f"tp_{device_type}")
    paths = {name: str(save_checkpoint(hf_model(config), root / name)) for name, config in VARIANTS.items()}
    torch.manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 24))
    outputs = run_ranks(run_rank, device_type, paths, input_ids, root)
    return device_type, paths, input_ids, outputs


def run_ranks(run_rank, device_type: str, paths, model_inputs, root: Path) -> list:
    """``run_rank(rank, device_type, port, paths, model_inputs, root)`` in RANKS spawned processes, each
    saving its outputs to root/rank{rank}.pt; a rank that fails or hangs fails the test, never CI."""
    context = mp.start_processes(run_rank, args=(device_type, free_port(), paths, model_inputs, str(root)),
                                 nprocs=RANKS, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {RANKS} ranks did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in range(RANKS)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_give_the_one_rank_logits(variant, ranks_run):
    device_type, paths, input_ids, outputs = ranks_run
    device = rank_device(device_type, 0)
    one_rank = AutoModelForCausalLM.from_pretrained(paths[variant], dtype=torch.float32, device=device)
    with torch.no_grad():
        dense = one_rank(input_ids.to(device)).cpu()
    if variant == "llama-gqa":
        assert one_rank.model.splitting  # its norms split on a one-row GPU step
    for output in outputs:
        assert not output["results"][variant]["splits_norms"], "a row-parallel o_proj all-reduces first"
        logits = output["results"][variant]["logits"]
        assert logits.shape == dense.shape == (2, 24, 97)
        assert relative_error(logits, dense) <= TOLERANCE
        assert torch.equal(logits.argmax(-1), dense.argmax(-1))


def test_kv_heads_split_or_replicated(ranks_run):
    _, _, _, outputs = ranks_run
    head_dim = 16
    for rank, output in enumerate(outputs):
        gqa, kv1 = output["results"]["llama-gqa"], output["results"]["llama-kv1"]
        assert gqa["kv_cache"] == kv1["kv_cache"] == ((1, head_dim),) * 2
        q_rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)
        kv_rows = slice(rank * head_dim, (rank + 1) * head_dim)
        assert gqa["qkv_rows"] == [q_rows, kv_rows, kv_rows]
        assert kv1["qkv_rows"] == [q_rows, slice(0, head_dim), slice(0, head_dim)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rank_reads_only_its_part(variant, ranks_run):
    _, paths, _, outputs = ranks_run
    whole = sum(t.numel() * t.element_size() for t in load_file(f"{paths[variant]}/model.safetensors").values())
    for output in outputs:
        result = output["results"][variant]
        # Every byte read fills one parameter element of the rank: its slices, and the norms and
        # row-parallel biases every rank holds whole.
        assert result["counts"]["whole"] + result["counts"]["part"] == result["held"]
        assert result["counts"]["part"] > result["counts"]["whole"]
        assert result["held"] < 0.6 * whole


@pytest.mark.parametrize("name", UNSPLITTABLE)
def test_unsplittable_layouts_are_refused(name, ranks_run):
    _, _, _, outputs = ranks_run
    _, error_type, words = UNSPLITTABLE[name]
    for output in outputs:
        raised, message = output["errors"][name]
        assert raised is error_type
        assert words in message


def test_a_declared_part_is_filled_and_a_short_tensor_named():
    # A state dict in memory has no part reader: the loader cuts the part from the whole tensor.
    def block():
        with torch.device("meta"):
            model = nn.Module()
            model.mlp = nn.Module()
            model.mlp.gate_up_proj = ColumnParallelLinear(8, [slice(4, 8), slice(4, 8)], ["gate_proj", "up_proj"],
                                                          [8, 8])
        return model

    gate, up = torch.randn(8, 8), torch.randn(8, 8)
    loaded = copy_weights(block(), {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up}, torch.float32,
                          torch.device("cpu"), origin="parts")
    assert torch.equal(loaded.mlp.gate_up_proj.weight, torch.cat([gate[4:8], up[4:8]]))
    # Stacked under the module's own name (Phi-3's gate_up_proj): the rank's rows of each half.
    loaded = copy_weights(block(), {"mlp.gate_up_proj.weight": torch.cat([gate, up])}, torch.float32,
                          torch.device("cpu"), origin="stacked")
    assert torch.equal(loaded.mlp.gate_up_proj.weight, torch.cat([gate[4:8], up[4:8]]))
    with pytest.raises(CheckpointError, match=r"'mlp.up_proj.weight' in parts: the part \(slice\(4, 8, None\),\) "
                                              r"this rank reads has shape \(2, 8\), expected \(4, 8\)"):
        copy_weights(block(), {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up[:6]}, torch.float32,
                     torch.device("cpu"), origin="parts")
