"""DeepSeek-V3-shaped model with few layers, random weights, one GPU: multi-head latent attention's
absorbed decode against its plain decode, zoo in bf16 and with FP8 block-quantised weights, and HF
transformers on the same bf16 model.

    python3 benchmarks/bench_deepseek.py                      # all, Markdown tables
    python3 benchmarks/bench_deepseek.py --hf-decode none     # skip HF's generate
    python3 benchmarks/bench_deepseek.py --json deepseek.json # also write the figures

The model: DeepSeek-V3's shapes (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128, 256 routed experts top-8 in 8 groups (4 kept), one shared expert, moe_intermediate 2048,
vocab 129280, YaRN) with --layers decoder layers, the first dense: 1 dense + 2 MoE layers by default,
about 51 GB in bf16: HF's model and zoo's copy of it fit one H200 together while zoo's is built; on an 80 GB
H100 HF's waits in host memory meanwhile (bench_moe.zoo_copy_of).
The FP8 model is that bf16 model quantised as DeepSeek-V3's official checkpoints are (float8_e4m3fn
weights with a float32 scale per 128 x 128 block for every linear layer of the decoder layers;
embeddings, norms, routers and lm_head in bf16), written to --fp8-dir as a checkpoint and loaded by
``AutoModelForCausalLM.from_pretrained``, which keeps those weights in FP8 on the GPU.

step        one decode step of the whole model, eager, timed with CUDA events (median of 10) over a
            latent paged cache holding --context tokens per sequence, at batch 1 and 64:
            absorbed: the decode rows as the runtime runs them (W_UK folded into the query, attention
            over the latents, W_UV after); plain: the same rows as one-token prompt chunks (every
            cached latent decompressed through kv_b_proj, then ordinary attention). Both through the
            attention backend zoo picks on CUDA. With CUDA graphs too where the model is capturable.
            bf16 and FP8 weights.
decode      batch 1, 128-token prompt, 128 new tokens (greedy, EOS ignored): zoo's LLM (CUDA graphs
            where capturable), bf16 and FP8 weights, ms/token as (time for 128 tokens - time for 1) / 127,
            against HF generate
            on the same weights (dynamic cache: HF's DeepSeek-V3 with a static cache is tried first,
            --hf-decode static, and reported when it fails). Printed under the table, untimed: each
            side's build or load, zoo's LLM() (KV cache, CUDA-graph capture) and each side's first
            call (HF's static-cache one compiles).
roofline    the bytes one batch-1 decode step reads (attention, dense MLP, router, shared expert, 8 of
            256 experts per MoE layer, lm_head, one embedding row; FP8 weights with their scales) over
            the HBM bandwidth measured here.
"""

import argparse
import datetime
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import decode_ms_per_token, hbm_bandwidth, sync_time  # noqa: E402
from bench_moe import free_memory, zoo_copy_of  # noqa: E402
from benchmarks.startup import stage, startup_text  # noqa: E402
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
FP8_BLOCK = (128, 128)
BATCHES = (1, 64)
PROMPT_LEN, DECODE_TOKENS = 128, 128


def random_hf(layers: int):
    fields = dict(DEEPSEEK_V3, num_hidden_layers=layers)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def active_weight_bytes(model) -> int:
    """The bytes of weight one batch-1 decode step reads: routed experts count top_k / n_routed_experts
    of themselves, the embedding one row, everything else in full (FP8 weights with their scales)."""
    config = model.config
    fraction = config.num_experts_per_tok / config.n_routed_experts
    active = 0
    scales = [(name, t) for name, t in model.named_buffers() if name.endswith("_scale_inv")]
    for name, param in [*model.named_parameters(), *scales]:
        nbytes = param.numel() * param.element_size()
        if "embed_tokens" in name:
            active += param.shape[-1] * param.element_size()
        elif ".experts." in name and "shared_experts" not in name:
            active += nbytes * fraction
        else:
            active += nbytes
    return int(active)


def quantised(name: str) -> bool:
    """The decoder layers' linear weights, as DeepSeek-V3's official checkpoints quantise them."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj", "_proj_with_mqa.weight"))


def quantise_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (float8_e4m3fn weight, float32 scale_inv [..., rows / 128, cols / 128]),
    edge blocks partial."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
    padded = F.pad(weight.float(), (0, grid[1] * FP8_BLOCK[1] - cols, 0, grid[0] * FP8_BLOCK[0] - rows))
    blocks = padded.view(*weight.shape[:-2], grid[0], FP8_BLOCK[0], grid[1], FP8_BLOCK[1])
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    fp8 = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)
    return fp8[..., :rows, :cols].contiguous(), scale


def write_fp8_checkpoint(reference, path: Path) -> None:
    """``reference`` as an FP8 block-quantised checkpoint at ``path`` (config.json with its
    quantization_config, one safetensors file)."""
    tensors = {}
    for name, tensor in reference.state_dict().items():
        if quantised(name):  # stacked experts one at a time: float32 copies of them all would not fit
            parts = [quantise_blocks(part) for part in (tensor.unbind() if tensor.dim() == 3 else [tensor])]
            fp8, scale = (torch.stack([p[i].cpu() for p in parts]) if tensor.dim() == 3 else parts[0][i].cpu()
                          for i in (0, 1))
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        else:
            tensors[name] = tensor.contiguous().cpu()
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    reference.config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": list(FP8_BLOCK)}
    reference.config.save_pretrained(path)
    del reference.config.quantization_config
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def event_ms(fn) -> float:
    """The median of 10 CUDA-event timings of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(10):
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


def decode_steps(results, model, weights: str, context: int):
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
            rows.append(dict(weights=weights, batch=batch, form=form, backend=backend.name, graphs=False, ms=ms))
            print(f"{weights} step batch {batch}, context {context}, {form}: {ms:.2f} ms (eager, {backend.name} "
                  f"backend)", flush=True)
        if model.capturable:
            metadata = decode_metadata(batch, context, plain=False)
            with torch.inference_mode():
                model(ids, positions, metadata)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model(ids, positions, metadata)
                ms = event_ms(graph.replay)
            del graph
            rows.append(dict(weights=weights, batch=batch, form="absorbed", backend=backend.name, graphs=True, ms=ms))
            print(f"{weights} step batch {batch}, context {context}, absorbed: {ms:.2f} ms (CUDA graph)", flush=True)
    del cache
    model.unbind_kv_cache()


def zoo_decode(results, model, weights: str, prompt, startup):
    with stage(startup, f"zoo {weights} LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    with stage(startup, f"zoo {weights} first call"):
        llm.generate([prompt], SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    ms = decode_ms_per_token(llm, prompt, DECODE_TOKENS)
    graphs = llm.engine.runner.graphs is not None
    active = active_weight_bytes(model)
    roofline = active / results["hbm_tb_s"] / 1e9
    results["decode"][weights] = dict(zoo_ms_per_token=ms, cuda_graphs=graphs, active_gb=active / 1e9,
                                      roofline_ms=roofline)
    print(f"zoo decode batch 1, {weights}: {ms:.2f} ms/token ({'CUDA graphs' if graphs else 'eager'}), "
          f"{roofline / ms:.0%} of the {roofline:.2f} ms roofline ({active / 1e9:.2f} GB)", flush=True)
    del llm


def hf_decode(results, reference, prompt, mode, startup):
    ids = torch.tensor([prompt], device="cuda")
    for cache in ([mode, "dynamic"] if mode == "static" else [mode]):
        extra = dict(cache_implementation="static") if cache == "static" else {}

        def run(n):
            with torch.inference_mode():
                out = reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)
            assert out.shape[1] == len(prompt) + n, out.shape

        try:
            with stage(startup, f"HF first call ({cache} cache{': compiles' if cache == 'static' else ''})"):
                run(DECODE_TOKENS)
            ms = (sync_time(lambda: run(DECODE_TOKENS), repeats=2) - sync_time(lambda: run(1))) / (DECODE_TOKENS - 1) * 1e3
        except Exception as exc:  # noqa: BLE001 - reported in the table
            results["decode"][f"hf_{cache}_error"] = short_error(exc)
            print(f"HF generate ({cache} cache) failed: {short_error(exc)}", flush=True)
            continue
        results["decode"]["hf"] = dict(ms_per_token=ms, cache=cache)
        print(f"HF decode batch 1 ({cache} cache): {ms:.2f} ms/token", flush=True)
        return


def table(results) -> str:
    lines = ["| decode step, whole model | weights | batch | form | ms |", "|---|---|---|---|---|"]
    for row in results["step"]:
        how = "CUDA graph" if row["graphs"] else f"eager, {row['backend']} backend"
        lines.append(f"| {results['context']}-token context | {row['weights']} | {row['batch']} "
                     f"| {row['form']} ({how}) | {row['ms']:.2f} |")
    d = results["decode"]
    lines += ["", "| batch-1 decode | ms/token | roofline ms (weights read) | of roofline |", "|---|---|---|---|"]
    for weights in ("bf16", "fp8"):
        if weights in d:
            zoo = d[weights]
            how = "CUDA graphs" if zoo["cuda_graphs"] else "eager"
            lines.append(f"| zoo LLM, {weights} weights ({how}) | {zoo['zoo_ms_per_token']:.2f} "
                         f"| {zoo['roofline_ms']:.2f} ({zoo['active_gb']:.2f} GB) "
                         f"| {zoo['roofline_ms'] / zoo['zoo_ms_per_token']:.0%} |")
    hf = d.get("hf", {})
    if "ms_per_token" in hf:
        lines.append(f"| HF generate, bf16 weights ({hf['cache']} cache) | {hf['ms_per_token']:.2f} "
                     f"| {d['bf16']['roofline_ms']:.2f} | {d['bf16']['roofline_ms'] / hf['ms_per_token']:.0%} |")
    else:
        lines.append(f"| HF generate, bf16 weights | n/a ({hf.get('cache', 'failed')}) | | |")
    lines.append(f"\nbatch-1 decode {startup_text(d['startup_s'])}")
    lines.append(f"\nHBM bandwidth measured here (4 GiB device-to-device copy): {results['hbm_tb_s']:.2f} TB/s")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="decoder layers, the first dense (default 3)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence of a timed step")
    parser.add_argument("--hf-decode", default="static", choices=["static", "dynamic", "none"])
    parser.add_argument("--fp8-dir", default="/tmp/zoo-deepseek-fp8", help="where the FP8 checkpoint is written")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                   torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                   context=args.context, step=[], decode={"startup_s": {}})
    print(f"{results['device']}, torch {results['torch']}, transformers {results['transformers']}", flush=True)
    prompt = torch.randint(0, DEEPSEEK_V3["vocab_size"], (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(0)).tolist()

    startup = results["decode"]["startup_s"]
    with stage(startup, "zoo bf16 build (random HF model, converted)"):
        reference = random_hf(args.layers)
        model = zoo_copy_of(reference)
    results["hbm_tb_s"] = hbm_bandwidth() / 1e12
    decode_steps(results, model, "bf16", args.context)
    zoo_decode(results, model, "bf16", prompt, startup)
    del model
    free_memory()
    reference.to("cuda")  # back from host memory where both copies did not fit: it quantises on the GPU
    write_fp8_checkpoint(reference, Path(args.fp8_dir))
    del reference
    free_memory()
    with stage(startup, "zoo fp8 load"):
        model = AutoModelForCausalLM.from_pretrained(args.fp8_dir, dtype=torch.bfloat16, device="cuda")
    decode_steps(results, model, "fp8", args.context)
    zoo_decode(results, model, "fp8", prompt, startup)
    del model
    free_memory()
    shutil.rmtree(args.fp8_dir)

    if args.hf_decode == "none":
        results["decode"]["hf"] = dict(cache="skipped: --hf-decode none")
    else:
        with stage(startup, "HF build"):
            reference = random_hf(args.layers)  # the same seed: the same weights
        hf_decode(results, reference, prompt, args.hf_decode, startup)
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
