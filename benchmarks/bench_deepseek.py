"""DeepSeek-V3-shaped model with few layers, random bf16 weights, one GPU: multi-head latent attention's
absorbed decode against its plain decode, and zoo against HF transformers on the same model.

    python3 benchmarks/bench_deepseek.py                      # all, Markdown table
    python3 benchmarks/bench_deepseek.py --hf-decode none     # skip HF's generate
    python3 benchmarks/bench_deepseek.py --json deepseek.json # also write the figures

The model: DeepSeek-V3's shapes (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128, 256 routed experts top-8 in 8 groups (4 kept), one shared expert, moe_intermediate 2048,
vocab 129280, YaRN) with --layers decoder layers, the first dense: 1 dense + 2 MoE layers by default,
about 51 GB in bf16, so that HF's model and zoo's copy of it fit one H200 together while zoo's is built.

step        one decode step of the whole model, eager, timed with CUDA events (median of 10) over a
            latent paged cache holding --context tokens per sequence, at batch 1 and 64:
            absorbed: the decode rows as the runtime runs them (W_UK folded into the query, attention
            over the latents, W_UV after); plain: the same rows as one-token prompt chunks (every
            cached latent decompressed through kv_b_proj, then ordinary attention). Both through the
            attention backend zoo picks on CUDA. With CUDA graphs too where the model is capturable.
decode      batch 1, 128-token prompt, 128 new tokens (greedy, EOS ignored): zoo's LLM (CUDA graphs
            where capturable) ms/token as (time for 128 tokens - time for 1) / 127, against HF generate
            on the same weights (dynamic cache: HF's DeepSeek-V3 with a static cache is tried first,
            --hf-decode static, and reported when it fails).
roofline    the bytes one batch-1 decode step reads (attention, dense MLP, router, shared expert, 8 of
            256 experts per MoE layer, lm_head, one embedding row) over the HBM bandwidth measured here.
"""

import argparse
import datetime
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import hbm_bandwidth, sync_time  # noqa: E402
from layers import AttentionMetadata  # noqa: E402
from layers.attention import select_backend  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.kv_cache import KVCache  # noqa: E402

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False,
)
BLOCK_SIZE = 16
BATCHES = (1, 64)
PROMPT_LEN, DECODE_TOKENS = 128, 128


def random_hf(layers: int):
    fields = dict(DEEPSEEK_V3, num_hidden_layers=layers)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def active_weight_bytes(model) -> int:
    """The bytes of weight one batch-1 decode step reads: routed experts count top_k / n_routed_experts
    of themselves, the embedding one row, everything else in full."""
    config = model.config
    fraction = config.num_experts_per_tok / config.n_routed_experts
    active = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if "embed_tokens" in name:
            active += param.shape[-1] * param.element_size()
        elif ".experts." in name and "shared_experts" not in name:
            active += nbytes * fraction
        else:
            active += nbytes
    return int(active)


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def event_ms(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def decode_metadata(batch: int, context: int, plain: bool) -> AttentionMetadata:
    """One new token for each of ``batch`` sequences after ``context`` cached ones, in consecutive
    blocks: as decodes (the absorbed form), or as one-token prompt chunks (the plain form)."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
    slots = tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    return AttentionMetadata(
        query_lens=[1] * batch, context_lens=[context] * batch, slot_mapping=slots, block_tables=tables,
        num_decodes=0 if plain else batch, seq_lens=seq_lens,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
    )


def decode_steps(results, model, context: int):
    backend = select_backend(None, "cuda")
    blocks = max(BATCHES) * -(-(context + 1) // BLOCK_SIZE)
    cache = KVCache(model, blocks, BLOCK_SIZE, backend)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for (pool,) in cache.pools:  # cached latents and rope keys of about the scale the layers produce
        pool.normal_(generator=generator)
    rows = results["step"]
    for batch in BATCHES:
        ids = torch.randint(0, DEEPSEEK_V3["vocab_size"], (batch,), device="cuda", generator=generator)
        positions = torch.full((batch,), context, device="cuda")
        for form in ("absorbed", "plain"):
            metadata = decode_metadata(batch, context, plain=form == "plain")
            with torch.inference_mode():
                ms = event_ms(lambda: model(ids, positions, metadata))
            rows.append(dict(batch=batch, form=form, backend=backend.name, graphs=False, ms=ms))
            print(f"step batch {batch}, context {context}, {form}: {ms:.2f} ms (eager, {backend.name} backend)",
                  flush=True)
        if model.capturable:
            metadata = decode_metadata(batch, context, plain=False)
            with torch.inference_mode():
                model(ids, positions, metadata)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model(ids, positions, metadata)
                ms = event_ms(graph.replay)
            del graph
            rows.append(dict(batch=batch, form="absorbed", backend=backend.name, graphs=True, ms=ms))
            print(f"step batch {batch}, context {context}, absorbed: {ms:.2f} ms (CUDA graph)", flush=True)
    del cache
    model.unbind_kv_cache()


def zoo_decode(results, model, prompt):
    llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731

    def run(n):
        out = llm.generate([prompt], params(n), use_tqdm=False)
        assert out[0].error is None and len(out[0].token_ids) == n, out[0].error

    ms = (sync_time(lambda: run(DECODE_TOKENS)) - sync_time(lambda: run(1))) / (DECODE_TOKENS - 1) * 1e3
    graphs = llm.engine.runner.graphs is not None
    results["decode"].update(zoo_ms_per_token=ms, zoo_cuda_graphs=bool(graphs))
    roofline = results["decode"]["roofline_ms"]
    print(f"zoo decode batch 1: {ms:.2f} ms/token ({'CUDA graphs' if graphs else 'eager'}), "
          f"{roofline / ms:.0%} of the {roofline:.2f} ms roofline", flush=True)
    del llm


def hf_decode(results, reference, prompt, mode):
    if mode == "none":
        results["decode"]["hf"] = "skipped (--hf-decode none)"
        return
    ids = torch.tensor([prompt], device="cuda")
    for cache in ([mode, "dynamic"] if mode == "static" else [mode]):
        extra = dict(cache_implementation="static") if cache == "static" else {}

        def run(n):
            with torch.inference_mode():
                out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)
            assert out.shape[1] == len(prompt) + n, out.shape

        try:
            ms = (sync_time(lambda: run(DECODE_TOKENS), repeats=2) - sync_time(lambda: run(1))) / (DECODE_TOKENS - 1) * 1e3
        except Exception as exc:  # noqa: BLE001 - reported in the table
            results["decode"][f"hf_{cache}_error"] = short_error(exc)
            print(f"HF generate ({cache} cache) failed: {short_error(exc)}", flush=True)
            continue
        results["decode"].update(hf_ms_per_token=ms, hf=f"{cache} cache")
        print(f"HF decode batch 1 ({cache} cache): {ms:.2f} ms/token", flush=True)
        return


def table(results) -> str:
    lines = ["| decode step | batch | form | ms |", "|---|---|---|---|"]
    for row in results["step"]:
        how = "CUDA graph" if row["graphs"] else f"eager, {row['backend']} backend"
        lines.append(f"| whole model, {results['context']}-token context | {row['batch']} | {row['form']} ({how}) "
                     f"| {row['ms']:.2f} |")
    d = results["decode"]
    zoo, hf = d.get("zoo_ms_per_token"), d.get("hf_ms_per_token")
    lines += ["", "| batch-1 decode | ms/token | of roofline |", "|---|---|---|"]
    if zoo:
        lines.append(f"| zoo LLM ({'CUDA graphs' if d['zoo_cuda_graphs'] else 'eager'}) | {zoo:.2f} "
                     f"| {d['roofline_ms'] / zoo:.0%} |")
    hf_figures = f"{hf:.2f} | {d['roofline_ms'] / hf:.0%}" if hf else "n/a | "
    lines.append(f"| HF generate ({d.get('hf', 'n/a')}) | {hf_figures} |")
    lines.append(f"| roofline: {d['active_gb']:.2f} GB at {d['hbm_tb_s']:.2f} TB/s | {d['roofline_ms']:.2f} | 100% |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="decoder layers, the first dense (default 3)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence of a timed step")
    parser.add_argument("--hf-decode", default="static", choices=["static", "dynamic", "none"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                   torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                   context=args.context, step=[], decode={})
    print(f"{results['device']}, torch {results['torch']}, transformers {results['transformers']}", flush=True)
    prompt = torch.randint(0, DEEPSEEK_V3["vocab_size"], (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    reference = random_hf(args.layers)
    model = AutoModelForCausalLM.from_hf(reference)
    del reference
    free_memory()
    active = active_weight_bytes(model)
    bandwidth = hbm_bandwidth()
    results["decode"].update(active_gb=active / 1e9, hbm_tb_s=bandwidth / 1e12, roofline_ms=active / bandwidth * 1e3)
    decode_steps(results, model, args.context)
    zoo_decode(results, model, prompt)
    del model
    free_memory()

    reference = random_hf(args.layers)  # the same seed: the same weights
    hf_decode(results, reference, prompt, args.hf_decode)
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
