"""GPU benchmarks of zoo against HuggingFace transformers and the hardware's ceilings, one run.

    python3 benchmarks/bench_gpu.py --task all          # or decode | throughput | throughput-8b | prefill

decode         batch-1 decode latency, Llama-3.1-8B shape (random bf16 weights), 128-token prompt,
               256 new tokens: zoo (CUDA graphs) vs HF generate with a static cache (auto-compiled),
               and zoo as a fraction of the weight-read roofline (weight bytes / HBM bandwidth
               measured here with a device-to-device copy); beside it each side's time to the first
               token of that prompt (a generation of one token: zoo replays its prefill as piecewise CUDA
               graphs, HF runs it eagerly).
throughput     nano-vllm's workload: Qwen3-0.6B shape, 256 requests of random tokens, input and
               output lengths U[100, 1024], EOS ignored: output tokens/s, zoo vs HF's continuous
               batching.
throughput-8b  Llama-3.1-8B shape, 1000 input / 1000 output tokens, as many requests as the KV cache
               holds at once (at most --requests-8b), zoo vs HF's continuous batching; --kv-cache-dtype
               fp8 runs zoo over an e4m3 cache, which holds about twice the requests. Beside it, the
               run's serial bound (serial_bound): its K/V reads at the copy bandwidth plus its matmuls
               at the bf16 matmul peak, both measured here; and the GPU's SM clock and power
               through the timed run (gpu_clocks), which show whether the power cap held it back.
prefill        Llama-3.1-8B shape, 4096-token prompts: tokens/s and MFU against the bf16 matmul
               peak measured here, counting the FLOPs zoo runs: the LM head on the last row of
               each prompt only (prefill_flops).

HF's continuous batching (its manager, ``init_continuous_batching``) gets zoo's requests, each with
its prompt and its number of new tokens, EOS off on both sides; --hf-requests takes the first N of
them. Each task prints, beside its timed figure, the start-up it leaves out of it, per side: the
model's build or conversion, zoo's LLM() (KV cache, CUDA-graph capture), HF's manager and its
warm-up, HF's static-cache compile (decode), and each side's first call.
"""

import argparse
import contextlib
import datetime
import itertools
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers.generation.continuous_batching.utils import WorkloadHints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.startup import stage, startup_text  # noqa: E402
from models import AutoModelForCausalLM  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.kv_cache import bytes_per_block  # noqa: E402

LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)


def config_of(fields):
    fields = dict(fields)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_hf(fields):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(config_of(fields), dtype=torch.bfloat16).eval()


def timed(fn) -> float:
    """Seconds of one call of fn, the GPU's work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def sync_time(fn, repeats=3):
    """The median of ``repeats`` timed calls of fn, after one untimed."""
    fn()
    return statistics.median(timed(fn) for _ in range(repeats))


@contextlib.contextmanager
def gpu_clocks(readings: dict):
    """Samples this GPU's SM clock and power draw with nvidia-smi every 500 ms while the block runs,
    and puts their medians into ``readings``, with the highest clock it reports, its power limit and
    the share of samples in which the power cap held the clock back. Nothing where nvidia-smi is missing."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        yield
        return
    uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
    fields = "clocks.sm,clocks.max.sm,power.draw,enforced.power.limit,clocks_event_reasons.sw_power_cap"
    sampler = subprocess.Popen([smi, "-i", f"GPU-{uuid}", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                "-lms", "500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield
    finally:
        sampler.terminate()
        text = sampler.communicate()[0]
    samples = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # "[N/A]" fields, or a line that is no sample
            clock, max_clock, power, limit, capped = (field.strip() for field in line.split(","))
            samples.append((float(clock), float(max_clock), float(power), float(limit), capped == "Active"))
    if samples:
        readings.update(samples=len(samples), sm_clock_mhz=statistics.median(s[0] for s in samples),
                        max_sm_clock_mhz=max(s[1] for s in samples), power_w=statistics.median(s[2] for s in samples),
                        power_limit_w=samples[0][3], power_capped=sum(s[4] for s in samples) / len(samples))


def clocks_text(readings: dict) -> str:
    if not readings:
        return "no clock readings (nvidia-smi missing)"
    return (f"SM clock median {readings['sm_clock_mhz']:.0f} MHz (highest {readings['max_sm_clock_mhz']:.0f}), "
            f"power median {readings['power_w']:.0f} W (limit {readings['power_limit_w']:.0f} W), "
            f"held back by the power cap in {readings['power_capped']:.0%} of {readings['samples']} samples")


def hf_continuous_batching(model, prompts: list[list[int]], lengths: list[int], startup: dict,
                           kv_memory_share: float | None = None) -> tuple[int, float]:
    """HF's continuous-batching manager on ``prompts``, request i asking for ``lengths[i]`` new tokens,
    greedy, EOS off (eos_token_id -1 on every request, as zoo's ignore_eos): (tokens generated, seconds
    of the run). Every request must come back with all its tokens. The manager's set-up (sized from
    the workload, as ``generate_batch`` sizes it), its CUDA-graph warm-up and a first call of four
    8-token requests go into ``startup``, outside the timed run. ``kv_memory_share``: the share of the
    free GPU memory HF's KV cache takes (its ``max_memory_percent``; None: HF's own choice)."""
    config = transformers.GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(lengths),
                          num_requests=len(prompts))
    cache = transformers.ContinuousBatchingConfig(max_memory_percent=kv_memory_share)
    with stage(startup, "HF manager"):
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cache,
                                                 workload_hints=hints)
    with stage(startup, "HF warm-up (CUDA graphs)"):
        manager.warmup()
    manager.start()
    try:
        with stage(startup, "HF first call"):
            warm = first_call_prompts(prompts, 4)
            hf_requests(manager, warm, [8] * len(warm), "first")
        start = time.perf_counter()
        tokens = hf_requests(manager, prompts, lengths, "run")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()


def first_call_prompts(prompts: list[list[int]], count: int, step_tokens: int | None = None) -> list[list[int]]:
    """The first ``count`` prompts reversed, for a side's untimed first call: as long as the timed
    prompts but sharing no prefix with them, so that no prefix cache carries work into the timed run.
    With ``step_tokens`` (zoo's new tokens per step), more where needed, until the last one spans two
    steps: the timed run's prompt steps carry such chunks, which zoo's paged prefill kernel attends
    (a step of new prompts only does not run it), and the first call runs that path once too (the
    kernel itself compiles when ``LLM()`` starts: ``ModelRunner.compile_kernels``)."""
    if step_tokens is not None:
        filled = itertools.accumulate(len(prompt) for prompt in prompts)
        count = max(count, next((i for i, total in enumerate(filled, 1) if total > step_tokens), len(prompts)))
    return [prompt[::-1] for prompt in prompts[:count]]


def hf_requests(manager, prompts: list[list[int]], lengths: list[int], tag: str) -> int:
    """Adds the requests to a running HF manager and waits for all of them: the tokens generated."""
    asked = {}
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        request_id = f"{tag}{i}"
        manager.add_request(prompt, request_id=request_id, max_new_tokens=length, eos_token_id=-1)
        asked[request_id] = length
    tokens = 0
    while asked:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"HF's generation thread stopped with {len(asked)} requests unfinished")
            continue
        if not result.is_finished():
            continue
        if result.error is not None or len(result.generated_tokens) != asked[result.request_id]:
            raise RuntimeError(f"HF request {result.request_id}: {len(result.generated_tokens)} tokens of "
                               f"{asked[result.request_id]} ({result.error})")
        tokens += len(result.generated_tokens)
        del asked[result.request_id]
    return tokens


def graph_us(fn, replays=20, flush_l2_bytes=0) -> float:
    """Median µs of fn() over CUDA-graph replays timed with CUDA events (one eager call first compiles).
    With ``flush_l2_bytes``, that many bytes are zeroed before each replay, so that fn reads its
    inputs from HBM, not from the L2 cache the previous replay left them in."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()  # warm-up
    flush = torch.empty(flush_l2_bytes, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def decode_ms_per_token(llm, prompt: list[int], tokens: int) -> float:
    """Batch-1 greedy decode through ``llm``, EOS ignored: (time for ``tokens`` new tokens - time for
    1) / (tokens - 1), in ms, so that the prompt's prefill cancels out."""

    def run(n):
        out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert out[0].error is None and len(out[0].token_ids) == n, out[0].error

    return (sync_time(lambda: run(tokens)) - sync_time(lambda: run(1))) / (tokens - 1) * 1e3


def hbm_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = sync_time(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    seconds = sync_time(lambda: a @ b, repeats=10)
    return 2 * 8192**3 / seconds


def decode(results):
    startup = {}
    with stage(startup, "HF build"):
        reference = random_hf(LLAMA_8B)
    with stage(startup, "zoo convert"):
        model = AutoModelForCausalLM.from_hf(reference)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    bandwidth = hbm_bandwidth()
    roofline_ms = weight_bytes / bandwidth * 1e3
    prompt = torch.randint(0, LLAMA_8B["vocab_size"], (128,), generator=torch.Generator().manual_seed(0)).tolist()

    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    with stage(startup, "zoo first call"):
        llm.generate([prompt], SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True), use_tqdm=False)
    zoo_ms = decode_ms_per_token(llm, prompt, 256)
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    zoo_first_ms = sync_time(lambda: llm.generate([prompt], first_token, use_tqdm=False), repeats=7) * 1e3
    del llm
    ids = torch.tensor([prompt], device="cuda")

    def hf(n):
        with torch.inference_mode():
            reference.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")

    with stage(startup, "HF first call (static cache: compiles)"):
        hf(256)
    hf_first_ms = sync_time(lambda: hf(1), repeats=7) * 1e3
    hf_ms = (sync_time(lambda: hf(256)) * 1e3 - hf_first_ms) / 255
    results["decode"] = dict(zoo_ms_per_token=zoo_ms, hf_static_compiled_ms_per_token=hf_ms, roofline_ms=roofline_ms,
                             weight_gb=weight_bytes / 1e9, hbm_tb_s=bandwidth / 1e12,
                             fraction_of_roofline=roofline_ms / zoo_ms, zoo_first_token_ms=zoo_first_ms,
                             hf_first_token_ms=hf_first_ms, startup_s=startup)
    print(f"decode 8B batch 1: zoo {zoo_ms:.2f} ms/token, HF static+compile {hf_ms:.2f} ms/token, "
          f"roofline {roofline_ms:.2f} ms ({weight_bytes / 1e9:.1f} GB at {bandwidth / 1e12:.2f} TB/s): "
          f"zoo at {roofline_ms / zoo_ms:.0%} of roofline", flush=True)
    print(f"decode 8B batch 1: first token of the 128-token prompt: zoo {zoo_first_ms:.1f} ms, "
          f"HF {hf_first_ms:.1f} ms", flush=True)
    print(f"decode 8B batch 1: {startup_text(startup)}", flush=True)


def workload(count, low, high, vocab, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]
    lengths = [rng.randint(low, high) for _ in range(count)]
    return prompts, lengths


def zoo_run(llm, prompts, params) -> tuple[int, float]:
    """(output tokens, seconds) of one timed ``llm.generate``; every request gets all its tokens."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(o.error is None for o in outputs), next(o.error for o in outputs if o.error)
    return sum(len(o.token_ids) for o in outputs), seconds


def hf_count(hf_requests: int | None, total: int) -> int:
    """How many of zoo's requests HF gets: the first ``hf_requests`` (all of them when None)."""
    return total if hf_requests is None else min(hf_requests, total)


def zoo_on_first(llm, prompts, params, count: int, all_tokens_per_s: float) -> float:
    """zoo's tok/s on the first ``count`` requests, the work HF gets: a continuous-batching run lasts
    about as many steps as its longest request, so a figure on fewer requests is lower and no
    ratio to one on all of them. The whole run's figure where ``count`` is all of them."""
    if count in (0, len(prompts)):
        return all_tokens_per_s
    llm.reset_prefix_cache()  # the whole run's prompts would be served from the cache
    tokens, seconds = zoo_run(llm, prompts[:count], params if isinstance(params, SamplingParams) else params[:count])
    return tokens / seconds


def hf_side(entry: dict, zoo_tokens_per_s: float, reference, prompts, lengths, count: int, startup) -> str:
    """HF's continuous batching on the first ``count`` of zoo's requests, each with the prompt and
    output length zoo's has, against zoo's ``zoo_tokens_per_s`` on the same requests
    (``zoo_on_first``); its figures go into ``entry``. The text to print beside zoo's."""
    if count == 0:
        return "HF skipped (--hf-requests 0)"
    tokens, seconds = hf_continuous_batching(reference, prompts[:count], lengths[:count], startup)
    entry.update(hf_tokens_per_s=tokens / seconds, hf_requests=count, hf_tokens=tokens, hf_seconds=seconds,
                 zoo_tokens_per_s_on_hf_requests=zoo_tokens_per_s)
    ratio = zoo_tokens_per_s / (tokens / seconds)
    return (f"HF continuous batching {tokens / seconds:.0f} tok/s ({count} of the requests, the same lengths, "
            f"{tokens} tokens, {seconds:.1f} s); zoo on the same {count} requests {zoo_tokens_per_s:.0f} tok/s: "
            f"zoo {ratio:.1f}x")


def throughput(results, hf_requests):
    startup = {}
    with stage(startup, "HF build"):
        reference = random_hf(QWEN3_06B)
    prompts, lengths = workload(256, 100, 1024, QWEN3_06B["vocab_size"])
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    with stage(startup, "zoo convert"):
        model = AutoModelForCausalLM.from_hf(reference)
    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=256, max_model_len=2048)
    with stage(startup, "zoo first call"):
        warm = first_call_prompts(prompts, 8, llm.engine.config.max_num_batched_tokens)
        llm.generate(warm, params[: len(warm)], use_tqdm=False)
    zoo_tokens, zoo_seconds = zoo_run(llm, prompts, params)
    count = hf_count(hf_requests, len(prompts))
    zoo_on_hf_requests = zoo_on_first(llm, prompts, params, count, zoo_tokens / zoo_seconds)
    del llm, model
    torch.cuda.empty_cache()
    results["throughput"] = dict(zoo_tokens_per_s=zoo_tokens / zoo_seconds, zoo_requests=len(prompts),
                                 zoo_tokens=zoo_tokens, zoo_seconds=zoo_seconds, startup_s=startup)
    print(f"throughput Qwen3-0.6B shape: zoo {zoo_tokens / zoo_seconds:.0f} tok/s ({len(prompts)} requests, "
          f"{zoo_tokens} tokens, {zoo_seconds:.1f} s)", flush=True)
    hf = hf_side(results["throughput"], zoo_on_hf_requests, reference, prompts, lengths, count, startup)
    print(f"throughput Qwen3-0.6B shape: {hf}", flush=True)
    print(f"throughput Qwen3-0.6B shape: {startup_text(startup)}", flush=True)
    del reference
    torch.cuda.empty_cache()


def serial_bound(model, prompt_lengths: list[int], output_lengths: list[int], kv_dtype: torch.dtype,
                 bandwidth: float, peak: float) -> dict:
    """The time zoo's work on these requests takes at the ceilings measured in the same run, one part
    after the other: every decode step's K/V reads (each context token's entries in every layer, the
    step's own token included) at ``bandwidth``, plus every matmul at ``peak``: the prompts' as
    prefill_flops counts them, then one decoder pass and one LM-head row per generated token after
    the first. Decode attention's FLOPs, the elementwise kernels and the host are left out."""
    kv_bytes_per_token = bytes_per_block(model, 1, kv_dtype)
    decoder, lm_head = matmul_parameters(model)
    kv_bytes = decode_steps = 0
    for prompt, output in zip(prompt_lengths, output_lengths):
        steps = output - 1  # the first token comes from the prefill
        kv_bytes += kv_bytes_per_token * (steps * prompt + steps * (steps + 1) // 2)
        decode_steps += steps
    # prefill_flops scans the model's parameters: once per prompt length, not once per prompt.
    flops = sum(prefill_flops(model, count, length) for length, count in Counter(prompt_lengths).items())
    flops += decode_steps * 2 * (decoder + lm_head)
    reads_s, matmuls_s = kv_bytes / bandwidth, flops / peak
    tokens = sum(output_lengths)
    return dict(kv_read_tb=kv_bytes / 1e12, matmul_pflop=flops / 1e15, kv_read_s=reads_s, matmul_s=matmuls_s,
                seconds=reads_s + matmuls_s, tokens_per_s=tokens / (reads_s + matmuls_s),
                hbm_tb_s=bandwidth / 1e12, matmul_peak_tflops=peak / 1e12)


def zoo_8b():
    return AutoModelForCausalLM.from_hf(random_hf(LLAMA_8B))


def throughput_8b(results, max_requests, batched_tokens, hf_requests, kv_cache_dtype="auto"):
    """As many 1000/1000 requests as the KV cache holds at once: all run concurrently, none is preempted.
    HF gets the same requests afterwards, on the same weights built again."""
    startup = {}
    bandwidth, peak = hbm_bandwidth(), matmul_peak()
    torch.cuda.empty_cache()
    with stage(startup, "zoo build (random HF model, converted)"):
        model = zoo_8b()
    torch.cuda.empty_cache()
    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=max_requests, max_model_len=2048, max_num_batched_tokens=batched_tokens,
                  kv_cache_dtype=kv_cache_dtype)
    blocks = llm.engine.block_manager.num_blocks
    requests = min(max_requests, blocks // llm.engine.block_manager.blocks_needed(2000))
    llm.engine.scheduler.max_num_seqs = requests
    prompts = workload(requests, 1000, 1000, LLAMA_8B["vocab_size"])[0]
    lengths = [1000] * requests
    with stage(startup, "zoo first call"):
        llm.generate(first_call_prompts(prompts, 4, batched_tokens), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    clocks = {}
    with gpu_clocks(clocks):
        tokens, seconds = zoo_run(llm, prompts, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    results["throughput_8b"] = dict(tokens_per_s=tokens / seconds, requests=requests, seconds=seconds,
                                    kv_cache_dtype=kv_cache_dtype, kv_blocks=blocks,
                                    preemptions=llm.engine.scheduler.num_preemptions,
                                    steps_run_ahead=llm.engine.run_ahead.num_steps_run_ahead, startup_s=startup,
                                    gpu_clocks=clocks)
    print(f"throughput 8B 1000/1000: {tokens / seconds:.0f} output tok/s ({requests} requests, {seconds:.1f} s, "
          f"{batched_tokens} tokens per step, "
          f"{blocks} KV blocks of {llm.engine.kv_cache.dtype}, {llm.engine.scheduler.num_preemptions} preemptions, "
          f"{llm.engine.run_ahead.num_steps_run_ahead} steps run ahead of the host)", flush=True)
    bound = serial_bound(model, [len(p) for p in prompts], lengths, llm.engine.kv_cache.dtype, bandwidth, peak)
    results["throughput_8b"]["serial_bound"] = bound
    print(f"throughput 8B 1000/1000: serial bound {bound['tokens_per_s']:.0f} tok/s ({bound['seconds']:.1f} s: "
          f"{bound['kv_read_tb']:.1f} TB of K/V reads at {bound['hbm_tb_s']:.2f} TB/s, {bound['kv_read_s']:.1f} s, + "
          f"{bound['matmul_pflop']:.1f} PFLOP of matmuls at {bound['matmul_peak_tflops']:.0f} TFLOP/s, "
          f"{bound['matmul_s']:.1f} s): zoo at {bound['seconds'] / seconds:.0%} of it", flush=True)
    print(f"throughput 8B 1000/1000: GPU during the timed run: {clocks_text(clocks)}", flush=True)
    count = hf_count(hf_requests, requests)
    zoo_on_hf_requests = zoo_on_first(llm, prompts, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
                                      count, tokens / seconds)
    del llm, model
    torch.cuda.empty_cache()
    if hf_requests != 0:
        with stage(startup, "HF build"):
            reference = random_hf(LLAMA_8B)
        hf = hf_side(results["throughput_8b"], zoo_on_hf_requests, reference, prompts, lengths, count, startup)
        print(f"throughput 8B 1000/1000: {hf}", flush=True)
        del reference
        torch.cuda.empty_cache()
    print(f"throughput 8B 1000/1000: {startup_text(startup)}", flush=True)


def matmul_parameters(model) -> tuple[int, int]:
    """(weights of the decoder's matrices, of the LM head): the norms' weights are no matmul, and the
    embedding is a lookup."""
    config = model.config
    decoder = sum(p.numel() for n, p in model.named_parameters()
                  if p.dim() == 2 and "embed_tokens" not in n and not n.startswith("lm_head."))
    return decoder, config.vocab_size * config.hidden_size


def prefill_flops(model, prompts: int, length: int) -> float:
    """The FLOPs of prefilling ``prompts`` prompts of ``length`` tokens as zoo does: every decoder
    matmul on every token, causal attention over half the square, and the LM head only on the
    last row of each prompt (the one row a prompt samples from; zoo computes no other row's logits)."""
    config = model.config
    decoder, lm_head = matmul_parameters(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # QK^T and PV, 2 FLOPs per multiply-add, over the causal half of the length x length scores
    attention = 2 * 2 * (length * length / 2) * config.num_attention_heads * head_dim * config.num_hidden_layers
    return prompts * (2 * decoder * length + attention + 2 * lm_head)


def prefill(results):
    startup = {}
    with stage(startup, "zoo build (random HF model, converted)"):
        model = zoo_8b()
    peak = matmul_peak()
    prompts = workload(8, 4096, 4096, LLAMA_8B["vocab_size"])[0]
    with stage(startup, "zoo LLM() (KV cache, CUDA graphs)"):
        llm = LLM(model, max_num_seqs=8, max_model_len=8192, max_num_batched_tokens=8192, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with stage(startup, "zoo first call"):
        llm.generate(prompts, params, use_tqdm=False)
    seconds = statistics.median(timed(lambda: llm.generate(prompts, params, use_tqdm=False)) for _ in range(2))
    tokens = 8 * 4096
    flops = prefill_flops(model, len(prompts), 4096)
    mfu = flops / seconds / peak
    results["prefill"] = dict(tokens_per_s=tokens / seconds, mfu=mfu, matmul_peak_tflops=peak / 1e12,
                              tflop=flops / 1e12, startup_s=startup)
    print(f"prefill 8B 4096-token prompts: {tokens / seconds:.0f} tok/s, MFU {mfu:.0%} of {peak / 1e12:.0f} TFLOP/s "
          f"measured bf16 matmul peak ({flops / 1e12:.0f} TFLOP per run: the LM head on the last row of each prompt, "
          f"the rows zoo computes logits for)", flush=True)
    print(f"prefill 8B: {startup_text(startup)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="all", choices=["all", "decode", "throughput", "throughput-8b", "prefill"])
    parser.add_argument("--hf-requests", type=int, help="HF continuous batching runs the first this many of zoo's "
                        "requests (throughput, throughput-8b; default: all of them; 0: skip HF)")
    parser.add_argument("--requests-8b", type=int, default=512, help="at most this many (throughput-8b)")
    parser.add_argument("--batched-tokens-8b", type=int, default=8192, help="tokens per step (throughput-8b)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the KV cache's dtype (throughput-8b): auto is the model's (bf16)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "transformers": transformers.__version__}
    print(results, flush=True)
    tasks = ["decode", "throughput", "throughput-8b", "prefill"] if args.task == "all" else [args.task]
    for task in tasks:
        if task == "decode":
            decode(results)
        elif task == "throughput":
            throughput(results, args.hf_requests)
        elif task == "throughput-8b":
            throughput_8b(results, args.requests_8b, args.batched_tokens_8b, args.hf_requests, args.kv_cache_dtype)
        else:
            prefill(results)
        torch.cuda.empty_cache()  # the task's models went with its frame
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
