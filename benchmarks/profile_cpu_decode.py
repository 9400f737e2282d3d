"""Where a CPU decode step goes: SmolLM2 (the embedded GGUF, float32 or --dtype bfloat16), 16
sequences decoding together, as in ``bench_generate.py``.

Each op the layers call is wrapped in a timer (``time.perf_counter`` around the call, ~0.1 µs):
the layers' linears, the LM head, the torch backend's decode attention, the norms, rotary with
the KV-cache write (one op), the gated activation and sampling. A profiler would add its own cost to each of
the ~1,500 small ops of a step; timers add almost nothing. "The rest" is the step's wall time
less the timed ops: the engine, the embedding, Python. The milliseconds are per step, averaged
over --steps decode steps.

With --compile-decode the steps run through the compiled graph (``compile_decode=True``), whose
ops no timer can reach: one step runs under torch's profiler instead, its ten costliest ops listed
by their own time. The profiler adds its own cost to each op, so its total is above an unprofiled
step's.

    .venv/bin/python benchmarks/profile_cpu_decode.py [--dtype bfloat16] [--compile-decode]
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layers.attention  # noqa: E402
import layers.embedding  # noqa: E402
import layers.linear  # noqa: E402
import layers.mlp  # noqa: E402
import layers.norm  # noqa: E402
import runtime.engine  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

spent: dict[str, float] = defaultdict(float)


def timed(function, label: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        spent[label] += time.perf_counter() - start
        return result

    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile-decode", action="store_true", help="profile one compiled step instead")
    args = parser.parse_args()
    if args.compile_decode:
        return profile_compiled_step(args)

    # The names each layer module calls the ops by.
    for module, name, label in (
        (layers.linear, "linear", "linears"), (layers.mlp, "act_and_mul", "SiLU-and-mul"),
        (layers.norm, "fused_add_rms_norm", "norms"), (layers.norm, "rms_norm", "norms"),
        (layers.attention, "rotary_write_kv", "rotary + KV write"),
    ):
        setattr(module, name, timed(getattr(module, name), label))
    head = layers.embedding.LMHead
    head.forward = timed(head.forward, "LM head")
    runtime.engine.sample_tokens = timed(runtime.engine.sample_tokens, "sampling")
    backend = layers.attention.TorchAttentionBackend
    backend.attend_decodes = timed(backend.attend_decodes, "decode attention")

    engine = decoding_engine(args)
    spent.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"SmolLM2 {args.dtype} decode step, {args.sequences} sequences: {step_ms:.1f} ms")
    print("| part | ms per step |")
    print("|---|---:|")
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"| {label} | {seconds / args.steps * 1e3:.2f} |")
    print(f"| the rest (engine, embedding, Python) | {step_ms - sum(spent.values()) / args.steps * 1e3:.2f} |")


def decoding_engine(args, compile_decode: bool = False):
    """An engine past its warm-up run, its --sequences prompts prefilled and decoding."""
    llm = LLM(str(default_model_path()), dtype=args.dtype, device="cpu", max_model_len=512,
              compile_decode=compile_decode)
    prompts = [llm.chat_prompt([{"role": "user", "content": f"Write a short poem about topic {i}."}])
               for i in range(args.sequences)]
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(10_000 + i, prompt, params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.sequences.values()):
        engine.step()  # the prompts, and one step more for the first decodes to be launched
    engine.step()
    return engine


def profile_compiled_step(args):
    engine = decoding_engine(args, compile_decode=True)
    with profile() as profiled:
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
    print(f"SmolLM2 {args.dtype} compiled decode step under the profiler, {args.sequences} sequences: "
          f"{step * 1e3:.1f} ms")
    print("| op | calls | ms, its own time |")
    print("|---|---:|---:|")
    for event in sorted(profiled.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"| {event.key[:60]} | {event.count} | {event.self_cpu_time_total / 1e3:.2f} |")


if __name__ == "__main__":
    main()
