"""Qwen3-30B-A3B-shaped MoE (or gpt-oss-20b-shaped, --shape), random bf16 weights, one GPU: zoo against HF
transformers and the roofline, and the two CUDA kernels of zoo's experts op against each other.

One run, about 6 minutes on an H200, most of it HF's: its first static-cache generate compiles, and
its continuous batching takes ~1000 decode steps at HF's step time whatever --hf-requests is.

    python3 benchmarks/bench_moe.py                         # kernels + decode + throughput, Markdown tables
    python3 benchmarks/bench_moe.py --task kernels          # the experts op alone (no model built)
    python3 benchmarks/bench_moe.py --task token-tiles      # one token's expert kernels per tiling (not in "all")
    python3 benchmarks/bench_moe.py --hf-decode none        # skip HF's static-cache generate (its first call compiles)
    python3 benchmarks/bench_moe.py --hf-requests 0         # skip HF's continuous batching (~4 minutes)
    python3 benchmarks/bench_moe.py --json moe.json         # also write the figures
    python3 benchmarks/bench_moe.py --shape gpt-oss-20b --task decode   # decode and throughput take any shape
    python3 benchmarks/bench_moe.py --shape gpt-oss-120b --experts mxfp4 --task decode --hf-decode none

kernels     zoo::moe_experts on one layer's expert shapes (128 experts, top-8, hidden 2048, intermediate 768,
            bf16; router-like routing: softmax top-8 of random logits, some experts favoured), for 1 to 4096
            tokens: the grouped-GEMM kernel (ops_cuda/moe_grouped_mm.py), the Triton fused-MoE kernel
            (ops_cuda/moe_triton.py) and, up to DECODE_MAX_TOKENS tokens, the decode kernel
            (ops_cuda/moe_decode.py), each called directly, and the one the op's dispatch picks
            (ops_cuda/moe.py: GROUPED_MM_MIN_PAIRS and DECODE_MAX_PAIRS come from this table). Time per
            call: the median of CUDA graph replays (CUDA events) of one call on each of KERNEL_LAYERS weight
            copies in turn, as the model's layers run, so the experts are read from HBM and not from L2;
            achieved weight bandwidth: the bytes of the distinct experts the routing touches over that
            time; max |diff|: against the op's PyTorch reference in bf16. Beside them the router after
            its logits GEMM (top-8 of 128, softmax, renormalised): zoo::route_topk's Triton kernel and its
            PyTorch reference (softmax, top-k, renormalisation: several launches), each in a CUDA graph.
token-tiles one token's two expert kernels (the op's batch-1 path in ops_cuda/moe_decode.py) over
            TOKEN_TILINGS, on Qwen3-30B-A3B's expert shape and DeepSeek-V3's (hidden 7168, intermediate
            2048; 16 of its experts held), timed as `kernels` times the op (the fastest of three medians);
            the tiling gpu_token_tiles picks for each shape is marked.
decode      batch 1, 128-token prompt, 256 new tokens (greedy, EOS ignored): zoo (CUDA graphs) ms/token as
            (time for 256 tokens - time for 1) / 255, against the active-weight roofline: the bytes of weight
            one decode step reads (attention, norms, router, top-k of the experts per layer, lm_head, one
            embedding row) over the HBM bandwidth measured here (4 GiB device-to-device copy). HF generate
            with a static cache (auto-compiled by transformers) is timed the same way when it runs.
throughput  1000 input / 1000 output tokens per request (random ids, EOS ignored): zoo's LLM with as many
            requests as its KV cache holds at once (at most --requests), HF's continuous-batching manager
            on the first --hf-requests of them, each with zoo's prompt and 1000 new tokens, EOS off;
            output tokens per second.
--experts mxfp4 (gpt-oss shapes): zoo's experts in MXFP4 as gpt-oss ships them (random codes and scales,
            zoo::mxfp4_moe_experts), the rest random bf16, built directly (no HF model to convert); HF, where
            it runs, holds the bf16 model of the same shape, as transformers dequantises gpt-oss without
            its hub kernels (gpt-oss-120b's, 234 GB, fits no GPU here: HF is skipped).
start-up    printed beside the table, per part and side, left out of the timed figures: the model's
            build, zoo's LLM() (KV cache, CUDA-graph capture), HF's static-cache compile, HF's manager
            and its warm-up, and each side's first call.

Memory (the model is ~61 GB in bf16): the random HF model is built on the GPU, converted with
models.AutoModelForCausalLM.from_hf (from host memory where the GPU cannot hold two copies: an 80 GB H100)
and deleted for zoo's runs; it is rebuilt (same seed, same weights) for HF's.
"""

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch
import transformers
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import (decode_ms_per_token, first_call_prompts, graph_us, hbm_bandwidth,  # noqa: E402
                       hf_continuous_batching, timed, workload, zoo_run)
from benchmarks.startup import stage, startup_text  # noqa: E402
from layers.moe import Experts  # noqa: E402
from loaders.load import materialize  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from models.auto import model_class_for  # noqa: E402
from ops_cuda.moe import cuda_kernel, moe_experts_reference  # noqa: E402
from ops_cuda.router import route_topk_reference  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# gpt-oss-20b: attention sinks, a 128-token window on every other layer, 32 experts with biases, top-4
GPT_OSS_20B = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
# gpt-oss-120b: gpt-oss-20b's layers, 36 of them, with 128 experts
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}
SHAPE_NAMES = {"qwen3-30b-a3b": "Qwen3-30B-A3B shape (48 layers, 128 experts, top-8",
               "gpt-oss-20b": "gpt-oss-20b shape (24 layers, 32 experts, top-4",
               "gpt-oss-120b": "gpt-oss-120b shape (36 layers, 128 experts, top-4"}
PROMPT_LEN, DECODE_TOKENS = 128, 256
KERNEL_TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
KERNEL_LAYERS = 8  # weight copies the timed graph runs through: 8 x 1.2 GB, far over the 50 MB L2
IN_LEN, OUT_LEN = 1000, 1000
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.0f} s] {message}", flush=True)


def shape_config(shape: str):
    fields = dict(SHAPES[shape])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_hf(shape: str):
    config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return model


def random_mxfp4_zoo(shape: str):
    """zoo's model of ``shape`` on the GPU with its experts in MXFP4 (random codes, scales of 2^-8 to 2^-4),
    every other weight random bf16 (norms one), materialised as the loader keeps an MXFP4 checkpoint."""
    config = shape_config(shape)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    experts = {f"{prefix}.{name}" for prefix, module in model.named_modules() if isinstance(module, Experts)
               for name in module.mxfp4_parameters}
    materialize(model, torch.bfloat16, torch.device("cuda"), mxfp4=experts)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == torch.uint8:
                param.random_(0, 256, generator=g)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=g)
        for name, buffer in model.named_buffers():
            if name.endswith("_scales"):
                buffer.random_(119, 124, generator=g)
    return model.eval()


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB"


def active_weight_bytes(model) -> tuple[int, int]:
    """(bytes one decode step reads, bytes of all weights): stacked experts (with their MXFP4 scales) count
    top_k / num_experts of themselves, the embedding one row, everything else in full."""
    config = model.config
    fraction = config.num_experts_per_tok / config.num_experts
    active = total = 0
    scales = [(name, buffer) for name, buffer in model.named_buffers() if ".experts." in name]
    for name, param in [*model.named_parameters(), *scales]:
        nbytes = param.numel() * param.element_size()
        total += nbytes
        if "embed_tokens" in name:
            active += param.shape[-1] * param.element_size()
        elif ".experts." in name:
            active += nbytes * fraction
        else:
            active += nbytes
    return int(active), total


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


# -- the experts op's kernels -------------------------------------------------------------------


def expert_weight_copies(num_experts, hidden_size, intermediate, generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KERNEL_LAYERS random bf16 (gate_up, down) pairs of one layer's experts: the layers a timed graph runs
    through in turn."""
    return [
        (torch.randn(num_experts, 2 * intermediate, hidden_size, device="cuda", generator=generator,
                     dtype=torch.bfloat16) / hidden_size**0.5,
         torch.randn(num_experts, hidden_size, intermediate, device="cuda", generator=generator,
                     dtype=torch.bfloat16) / intermediate**0.5)
        for _ in range(KERNEL_LAYERS)
    ]


def kernels(results):
    from ops_cuda.moe_decode import decode_supported, moe_experts_decode
    from ops_cuda.moe_grouped_mm import grouped_mm_supported, moe_experts_grouped_mm
    from ops_cuda.moe_triton import moe_experts_triton
    from ops_cuda.router_triton import route_topk_triton

    hidden_size, intermediate = QWEN3_30B_A3B["hidden_size"], QWEN3_30B_A3B["moe_intermediate_size"]
    num_experts, top_k = QWEN3_30B_A3B["num_experts"], QWEN3_30B_A3B["num_experts_per_tok"]
    g = torch.Generator(device="cuda").manual_seed(0)
    layer_weights = expert_weight_copies(num_experts, hidden_size, intermediate, g)
    expert_bytes = (3 * intermediate * hidden_size) * 2  # gate, up and down of one expert, bf16
    paths = {"triton": moe_experts_triton, "decode": moe_experts_decode}
    if grouped_mm_supported(torch.empty(1, hidden_size, device="cuda", dtype=torch.bfloat16), *layer_weights[0]):
        paths = {"grouped_mm": moe_experts_grouped_mm, **paths}
    log(f"kernels: {', '.join(paths)} on {KERNEL_LAYERS} layers of {num_experts} experts "
        f"({num_experts * expert_bytes / 1e9:.2f} GB each)")
    rows = []
    for tokens in KERNEL_TOKENS:
        hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g, dtype=torch.bfloat16)
        logits = torch.randn(tokens, num_experts, device="cuda", generator=g)
        logits += 2.0 * torch.randn(num_experts, device="cuda", generator=g)  # some experts favoured
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        touched = ids.unique().numel()
        reference = moe_experts_reference(hidden, weights, ids, *layer_weights[0], "silu").float()
        row = dict(tokens=tokens, pairs=ids.numel(), experts=touched, weight_mb=touched * expert_bytes / 1e6,
                   dispatch=cuda_kernel(hidden, ids, *layer_weights[0], "silu"))
        for name, kernel in paths.items():
            if name == "decode" and not decode_supported(hidden, ids, *layer_weights[0], "silu"):
                continue
            diff = (kernel(hidden, weights, ids, *layer_weights[0], "silu").float() - reference).abs().max().item()
            us = graph_us(lambda: [kernel(hidden, weights, ids, *layer, "silu") for layer in layer_weights])
            us /= KERNEL_LAYERS
            row[name] = dict(us=us, gb_s=touched * expert_bytes / us / 1e3, max_diff=diff)
        router_logits = logits.bfloat16()
        router_options = (None, top_k, "softmax", True, 1, 1, "top2_sum", 1.0)
        row["router_us"] = {name: graph_us(lambda: route(router_logits, *router_options))
                            for name, route in (("kernel", route_topk_triton), ("reference", route_topk_reference))}
        rows.append(row)
        log(f"kernels: {tokens} tokens: " + ", ".join(f"{name} {row[name]['us']:.1f} µs" for name in paths
                                                      if name in row)
            + ", router kernel {kernel:.1f} µs, reference {reference:.1f} µs".format(**row["router_us"]))
    results["kernels"] = rows


# The one-token expert kernels' tilings: (columns of h per gate_up program, output rows per down program,
# gate_up tile width, down tile width, warps), each shape's own choice (gpu_token_tiles) among them.
TOKEN_TILINGS = ((2, 4, 1024, 256, 4), (1, 4, 1024, 256, 4), (1, 4, 2048, 256, 4), (1, 4, 2048, 256, 2),
                 (2, 4, 2048, 256, 4), (1, 4, 1024, 128, 2), (1, 4, 2048, 128, 2), (1, 8, 1024, 256, 8))
# name -> (hidden, intermediate, experts held, top-k). DeepSeek-V3 holds 16 of its 256 experts: its
# KERNEL_LAYERS copies are 5.6 GB, and one token reads 8 experts whichever they are.
TOKEN_TILE_SHAPES = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "DeepSeek-V3": (7168, 2048, 16, 8)}


def token_tiles(results):
    results["token_tiles"] = []
    for shape, dims in TOKEN_TILE_SHAPES.items():
        results["token_tiles"] += token_tilings_of_shape(shape, *dims)
        free_memory()  # the shape's experts went with the function's frame


def token_tilings_of_shape(shape, hidden_size, intermediate, num_experts, top_k) -> list[dict]:
    from ops_cuda.moe_decode import TokenTiles, gpu_token_tiles, moe_experts_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    layer_weights = expert_weight_copies(num_experts, hidden_size, intermediate, g)
    hidden = torch.randn(1, hidden_size, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.randperm(num_experts, device="cuda", generator=g)[:top_k].view(1, top_k)
    weights = torch.rand(1, top_k, device="cuda", generator=g).softmax(-1)
    reference = moe_experts_reference(hidden, weights, ids, *layer_weights[0], "silu").float()
    picked = gpu_token_tiles(hidden_size)
    read = top_k * 3 * intermediate * hidden_size * 2  # the picked experts' gate, up and down, bf16
    rows = []
    for tiling in TOKEN_TILINGS:
        tiles = TokenTiles(*tiling)

        def experts(weights_of_layer, tiles=tiles):
            return moe_experts_decode(hidden, weights, ids, *weights_of_layer, "silu", token_tiles=tiles)

        diff = (experts(layer_weights[0]).float() - reference).abs().max().item()
        us = min(graph_us(lambda: [experts(layer) for layer in layer_weights]) for _ in range(3)) / KERNEL_LAYERS
        rows.append(dict(shape=shape, tiles=tiles._asdict(), us=us, tb_s=read / us / 1e6, max_diff=diff,
                         picked=tiles == picked))
        log(f"token tiles: {shape} {tiles}: {us:.2f} µs{' (picked)' if tiles == picked else ''}")
    return rows


def token_tiles_table(results) -> str:
    lines = [
        f"One token's experts (zoo::moe_experts' two one-token kernels, top-8, bf16), per tiling: µs per layer "
        f"(fastest of three medians of CUDA-graph replays over {KERNEL_LAYERS} weight copies). {results['date']}, "
        f"{results['device']}, torch {results['torch']}, triton {results['triton']}.",
        "",
        "| shape | gate_up columns | down rows | gate_up tile | down tile | warps | µs | TB/s "
        "| max \\|diff\\| | picked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["token_tiles"]:
        t = row["tiles"]
        lines.append(f"| {row['shape']} | {t['gate_up_n']} | {t['down_n']} | {t['gate_up_k']} | {t['down_k']} | "
                     f"{t['num_warps']} | {row['us']:.2f} | {row['tb_s']:.2f} | {row['max_diff']:.1e} | "
                     f"{'yes' if row['picked'] else ''} |")
    return "\n".join(lines)


def kernels_table(results) -> str:
    rows = results["kernels"]
    names = [name for name in ("grouped_mm", "triton", "decode") if name in rows[0]]
    header = "| tokens | pairs | experts touched | their weights (MB) | " + " | ".join(
        f"{name} µs | {name} GB/s | {name} max \\|diff\\|" for name in names) + (
        " | dispatch picks | router µs: kernel / reference |")
    lines = [
        f"zoo::moe_experts, Qwen3-30B-A3B expert shapes (128 experts, top-8, 2048 -> 768 -> 2048, bf16). "
        f"{results['date']}, {results['device']}, torch {results['torch']}, triton {results['triton']}; "
        f"HBM copy bandwidth {results['hbm_tb_s']:.2f} TB/s.",
        "",
        header,
        "|" + "---|" * (6 + 3 * len(names)),
    ]
    for row in rows:
        cells = [str(row["tokens"]), str(row["pairs"]), str(row["experts"]), f"{row['weight_mb']:.0f}"]
        for name in names:
            if name in row:
                cells += [f"{row[name]['us']:.1f}", f"{row[name]['gb_s']:.0f}", f"{row[name]['max_diff']:.1e}"]
            else:
                cells += ["n/a"] * 3
        router = row["router_us"]
        lines.append("| " + " | ".join(cells) + f" | {row['dispatch']} | {router['kernel']:.1f} / "
                     f"{router['reference']:.1f} |")
    return "\n".join(lines)


# -- zoo ----------------------------------------------------------------------------------------


def decode_moe_kernel(model) -> str:
    """The kernel zoo::moe_experts's dispatch runs at batch-1 decode (one token, top-k pairs)."""
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    if experts.mxfp4:
        return "MXFP4 one-token"  # zoo::mxfp4_moe_experts' kernels for a single token
    hidden = torch.zeros(1, experts.gate_up_proj.shape[2], dtype=experts.gate_up_proj.dtype, device="cuda")
    ids = torch.zeros(1, model.config.num_experts_per_tok, dtype=torch.int64, device="cuda")
    return cuda_kernel(hidden, ids, experts.gate_up_proj, experts.down_proj, experts.hidden_act,
                       experts.gate_up_proj_bias, experts.down_proj_bias)


def zoo_decode(results, model, prompt, startup):
    results["decode"]["moe_kernel"] = decode_moe_kernel(model)
    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    with stage(startup, "zoo first call"):
        llm.generate([prompt], SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    ms = decode_ms_per_token(llm, prompt, DECODE_TOKENS)
    results["decode"]["zoo_ms_per_token"] = ms
    roofline = results["decode"]["roofline_ms"]
    log(f"zoo decode: {ms:.2f} ms/token (CUDA graphs, experts: {results['decode']['moe_kernel']} kernel), "
        f"{roofline / ms:.0%} of the {roofline:.2f} ms roofline")


def zoo_throughput(results, model, max_requests, hf_requests, startup):
    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=max_requests, max_model_len=2048, max_num_batched_tokens=8192,
                  enable_prefix_caching=False)
    blocks = llm.engine.block_manager.num_blocks
    requests = min(max_requests, blocks // llm.engine.block_manager.blocks_needed(IN_LEN + OUT_LEN))
    llm.engine.scheduler.max_num_seqs = requests
    log(f"zoo LLM ready: {blocks} KV blocks, {requests} concurrent requests of {IN_LEN}+{OUT_LEN} tokens")
    prompts = workload(requests, IN_LEN, IN_LEN, model.config.vocab_size)[0]
    with stage(startup, "zoo first call"):
        llm.generate(first_call_prompts(prompts, 4, llm.engine.config.max_num_batched_tokens),
                     SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    greedy = SamplingParams(max_tokens=OUT_LEN, temperature=0.0, ignore_eos=True)
    tokens, seconds = zoo_run(llm, prompts, greedy)
    results["throughput"].update(zoo_tokens_per_s=tokens / seconds, zoo_requests=requests, zoo_seconds=seconds,
                                 zoo_kv_blocks=blocks, zoo_preemptions=llm.engine.scheduler.num_preemptions)
    log(f"zoo throughput: {tokens / seconds:.0f} output tok/s ({requests} requests, {tokens} tokens, {seconds:.1f} s, "
        f"{llm.engine.scheduler.num_preemptions} preemptions)")
    if 0 < hf_requests < requests:
        # The work HF gets: a run of fewer requests lasts about as many steps, so its tok/s are lower.
        tokens, seconds = zoo_run(llm, prompts[:hf_requests], greedy)  # the cache keeps no prefix
        results["throughput"]["zoo_tokens_per_s_on_hf_requests"] = tokens / seconds
        log(f"zoo throughput on HF's {hf_requests} requests: {tokens / seconds:.0f} output tok/s")
    return prompts


# -- HF -----------------------------------------------------------------------------------------


def hf_decode(results, reference, prompt, mode, startup):
    if mode == "none":
        results["decode"]["hf"] = "n/a (skipped: --hf-decode none)"
        return
    ids = torch.tensor([prompt], device="cuda")
    cache = dict(cache_implementation="static") if mode == "static" else {}

    def run(n):
        with torch.inference_mode():
            out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache)
        assert out.shape[1] == len(prompt) + n, out.shape

    try:
        compiles = " (transformers compiles the decode step)" if mode == "static" else ""
        log(f"HF generate, {mode} cache: first call{compiles}")
        first_call = f"HF first call ({mode} cache{': compiles' if mode == 'static' else ''})"
        with stage(startup, first_call):
            run(DECODE_TOKENS)
        many = min(timed(lambda: run(DECODE_TOKENS)) for _ in range(2))
        one = min(timed(lambda: run(1)) for _ in range(3))
        ms = (many - one) / (DECODE_TOKENS - 1) * 1e3
        results["decode"].update(hf_ms_per_token=ms, hf_first_call_s=startup[first_call], hf=f"{mode} cache")
        log(f"HF decode ({mode} cache): {ms:.2f} ms/token (first call {startup[first_call]:.0f} s)")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        results["decode"]["hf"] = f"n/a ({mode} cache: {short_error(exc)})"
        log(f"HF decode failed: {short_error(exc)}")


def hf_throughput(results, reference, prompts, hf_requests, kv_memory_share, startup):
    subset = prompts[:hf_requests]
    share = "HF's own" if kv_memory_share is None else f"{kv_memory_share:.0%}"
    log(f"HF continuous batching: {len(subset)} of zoo's requests, {IN_LEN} + {OUT_LEN} tokens each "
        f"(~{OUT_LEN} decode steps whatever the count: the longest part of the run); KV cache share of the free "
        f"memory: {share}")
    try:
        tokens, seconds = hf_continuous_batching(reference, subset, [OUT_LEN] * len(subset), startup,
                                                 kv_memory_share)
        results["throughput"].update(hf_tokens_per_s=tokens / seconds, hf_requests=len(subset), hf_seconds=seconds,
                                     hf_tokens=tokens)
        log(f"HF continuous batching: {tokens / seconds:.0f} output tok/s ({len(subset)} requests, {tokens} tokens, "
            f"{seconds:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        results["throughput"]["hf"] = f"n/a ({short_error(exc)})"
        log(f"HF continuous batching failed: {short_error(exc)}")


# -- report -------------------------------------------------------------------------------------


def table(results) -> str:
    d, t = results["decode"], results["throughput"]
    zoo_ms, hf_ms = d.get("zoo_ms_per_token"), d.get("hf_ms_per_token")
    zoo_decode = f"{zoo_ms:.2f}" if zoo_ms else "n/a"
    hf_decode = f"{hf_ms:.2f} ({d['hf']}, first call {d['hf_first_call_s']:.0f} s)" if hf_ms else d.get("hf", "n/a")
    roofline = (f"roofline {d['roofline_ms']:.2f} ms ({d['active_weight_gb']:.2f} GB of active weights at "
                f"{d['hbm_tb_s']:.2f} TB/s)")
    if zoo_ms:
        roofline += f"; zoo at {d['roofline_ms'] / zoo_ms:.0%} of it (experts: {d['moe_kernel']} kernel)"
    zoo_tps, hf_tps = t.get("zoo_tokens_per_s"), t.get("hf_tokens_per_s")
    zoo_throughput = f"{zoo_tps:.0f} ({t['zoo_requests']} requests)" if zoo_tps else "n/a"
    hf_throughput = f"{hf_tps:.0f} ({t['hf_requests']} requests)" if hf_tps else t.get("hf", "n/a")
    zoo_same = t.get("zoo_tokens_per_s_on_hf_requests", zoo_tps)  # zoo on the requests HF ran
    ratio = (f"zoo on HF's {t['hf_requests']} requests {zoo_same:.0f} tok/s: zoo / HF = {zoo_same / hf_tps:.1f}x"
             if zoo_tps and hf_tps else "")
    return "\n".join([
        f"{SHAPE_NAMES[results['shape']]}; random weights, {results['zoo_experts']} experts in zoo, "
        f"{d['total_weight_gb']:.1f} GB). "
        f"{results['date']}, {results['device']}, torch {results['torch']}, transformers {results['transformers']}, "
        f"HF experts implementation: {results.get('hf_experts_implementation')}.",
        "",
        "| measurement | zoo | HF transformers | notes |",
        "|---|---|---|---|",
        f"| decode, batch 1, {PROMPT_LEN}-token prompt, {DECODE_TOKENS} new tokens (ms/token) | {zoo_decode} | "
        f"{hf_decode} | {roofline} |",
        f"| throughput, {IN_LEN} in / {OUT_LEN} out (output tok/s) | {zoo_throughput} | {hf_throughput} | {ratio} |",
        "",
        *(f"{name} {startup_text(part['startup_s'])}" for name, part in (("decode", d), ("throughput", t))
          if "zoo_seconds" in part or "zoo_ms_per_token" in part),
    ])


def zoo_copy_of(reference):
    """zoo's model of the HF model ``reference``, on the GPU. Where the GPU cannot hold both copies,
    ``reference`` moves to host memory first and stays there."""
    # zoo's copy, with a tenth to spare, must fit beside HF's in what is free
    if sum(p.numel() * p.element_size() for p in reference.parameters()) > 0.9 * torch.cuda.mem_get_info()[0]:
        reference.to("cpu")
        free_memory()
    return AutoModelForCausalLM.from_hf(reference, device="cuda")


def zoo_from_random_hf(shape):
    """zoo's model of ``shape``'s random HF model (``zoo_copy_of``). It keeps HF's config object, with
    the experts implementation HF's model picked."""
    reference = random_hf(shape)
    model = zoo_copy_of(reference)
    del reference
    free_memory()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="all", choices=["all", "kernels", "token-tiles", "decode", "throughput"])
    parser.add_argument("--hf-decode", default="static", choices=["static", "dynamic", "none"],
                        help="HF generate's cache for the decode timing (static: transformers compiles it)")
    parser.add_argument("--requests", type=int, default=256, help="zoo: at most this many concurrent requests")
    parser.add_argument("--hf-requests", type=int, default=64,
                        help="HF continuous batching: the first this many of zoo's requests (0: skip it)")
    parser.add_argument("--hf-kv-memory-share", type=float,
                        help="HF continuous batching: the share of the free GPU memory its KV cache takes (its "
                             "max_memory_percent; default: HF's own). gpt-oss-20b on an 80 GB GPU needs "
                             "less: HF attends with sinks eagerly, and its prompt steps' float32 attention "
                             "weights outgrow what HF's own share leaves")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                        help="the model of the decode and throughput tasks")
    parser.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4"],
                        help="zoo's experts (mxfp4: gpt-oss shapes, built without HF)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.experts == "mxfp4" and not args.shape.startswith("gpt-oss"):
        parser.error("--experts mxfp4 takes a gpt-oss shape")
    if args.hf_kv_memory_share is not None and not 0 < args.hf_kv_memory_share <= 1:
        parser.error(f"--hf-kv-memory-share {args.hf_kv_memory_share}: a share of the free memory, in (0, 1]")
    if args.shape == "gpt-oss-120b" and (args.hf_decode != "none" or args.hf_requests):
        parser.error("gpt-oss-120b in bf16 (234 GB) fits no single GPU: give --hf-decode none --hf-requests 0")
    results = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "shape": args.shape,
               "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
               "decode": {"startup_s": {}}, "throughput": {"startup_s": {}}, "zoo_experts": args.experts}
    print({k: v for k, v in results.items() if isinstance(v, str)}, flush=True)
    decode, throughput = args.task in ("all", "decode"), args.task in ("all", "throughput")
    prompt = torch.randint(0, SHAPES[args.shape]["vocab_size"], (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    bandwidth = hbm_bandwidth()
    free_memory()
    results["hbm_tb_s"] = bandwidth / 1e12
    log(f"HBM bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.task in ("all", "kernels"):
        kernels(results)
        free_memory()  # the experts' weights went with the function's frame
        print("\n" + kernels_table(results) + "\n", flush=True)
        save()
    if args.task == "token-tiles":
        token_tiles(results)
        print("\n" + token_tiles_table(results) + "\n", flush=True)
        save()
    if not (decode or throughput):
        return

    # zoo: build the HF model, convert, drop the HF copy (two copies are ~122 GB). Where the GPU
    # cannot hold both (an 80 GB H100), the HF model waits in host memory while zoo copies it back.
    decode_startup, throughput_startup = results["decode"]["startup_s"], results["throughput"]["startup_s"]
    if args.experts == "mxfp4":
        with stage(decode_startup, "zoo build (random MXFP4 experts)"):
            model = random_mxfp4_zoo(args.shape)
    else:
        with stage(decode_startup, "zoo build (random HF model, converted)"):
            model = zoo_from_random_hf(args.shape)
            results["hf_experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    throughput_startup.update(decode_startup)
    active, total = active_weight_bytes(model)
    log(f"zoo model ready: {total / 1e9:.1f} GB of weights, {active / 1e9:.2f} GB read per decode step; "
        f"{gib(torch.cuda.memory_allocated())} allocated")
    results["decode"].update(roofline_ms=active / bandwidth * 1e3, active_weight_gb=active / 1e9,
                             total_weight_gb=total / 1e9, hbm_tb_s=bandwidth / 1e12)
    log(f"roofline {active / bandwidth * 1e3:.2f} ms/token")
    prompts = None
    if decode:
        zoo_decode(results, model, prompt, decode_startup)
        free_memory()  # the LLM (KV cache, graphs) went with the function's frame
        save()
    if throughput:
        prompts = zoo_throughput(results, model, args.requests, args.hf_requests, throughput_startup)
        free_memory()
        save()
    del model
    free_memory()

    hf_decodes, hf_throughputs = decode and args.hf_decode != "none", throughput and args.hf_requests > 0
    if not (hf_decodes or hf_throughputs):
        print("\n" + table(results), flush=True)
        return
    # HF: the same weights again (same seed), its decode, then its throughput last.
    hf_build = {}
    with stage(hf_build, "HF build"):
        reference = random_hf(args.shape)
        results["hf_experts_implementation"] = getattr(reference.config, "_experts_implementation", None)
    log(f"HF model ready ({results['hf_experts_implementation']} experts)")
    if hf_decodes:
        decode_startup.update(hf_build)
    if hf_throughputs:
        throughput_startup.update(hf_build)
    if decode:
        hf_decode(results, reference, prompt, args.hf_decode, decode_startup)
        torch._dynamo.reset()  # drop the compiled decode step (and its CUDA graphs)
        free_memory()
        save()
    if hf_throughputs:
        hf_throughput(results, reference, prompts, args.hf_requests, args.hf_kv_memory_share, throughput_startup)
        save()
    del reference
    free_memory()

    if "kernels" in results:
        print("\n" + kernels_table(results), flush=True)
    print("\n" + table(results), flush=True)
    save()


if __name__ == "__main__":
    main()
