"""Offline generation throughput on this CPU: zoo's runtime vs HuggingFace transformers' generate.

SmolLM2-135M-Instruct (the embedded GGUF, float32 or --dtype bfloat16 on both sides), 16 prompts
x 64 new tokens, greedy, EOS ignored on both sides so both produce exactly 16 x 64 tokens. HF
runs the 16 prompts as one left-padded batch (its fastest form here), with its default cache. zoo
runs twice: eagerly, and with its decode steps compiled (``compile_decode=True``). zoo's prefix
cache is off: the timed runs repeat the same prompts, whose prefill a warm prefix cache would skip.
After one untimed first call each, the three take turns --repeats times (a noisy neighbour slows
all alike); the medians are reported. Beside them, the start-up each side leaves out of them: zoo's
two ``LLM()`` (the load, the weights' packs, the compile at start), HF's load, and each one's first call.

    .venv/bin/python benchmarks/bench_generate.py [--dtype bfloat16]
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.startup import stage, startup_text  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from runtime.diff import load_reference  # noqa: E402

TOPICS = ["the sea", "a mountain", "the city at night", "an old library", "a robot", "autumn", "the moon",
          "a cat", "coffee", "the desert", "a train journey", "winter", "a garden", "the stars", "music", "rain"]


def timed_alternately(runs: dict, repeats: int, startup: dict):
    """Median seconds of each run of ``runs`` (name: run), after a first call each, timed into
    ``startup``; the runs take turns so that a noisy neighbour slows all alike."""
    for name, run in runs.items():
        with stage(startup, f"{name} first call"):
            run()
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, spent in zip(runs.values(), times):
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    path = default_model_path()
    prompts = [f"Write a short poem about {TOPICS[i % len(TOPICS)]}." for i in range(args.prompts)]
    new_tokens = args.prompts * args.max_tokens

    options = dict(dtype=args.dtype, device="cpu", max_model_len=512, enable_prefix_caching=False)
    startup = {}
    with stage(startup, "zoo LLM() (load, packs)"):
        llm = LLM(str(path), **options)
    with stage(startup, "zoo LLM(compile_decode=True) (load, packs, compile)"):
        compiled = LLM(str(path), compile_decode=True, **options)
    chats = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    zoo_tokens = {}

    def zoo_run(engine, name):
        def run():
            outputs = engine.generate(chats, params, use_tqdm=False)
            assert sum(len(o.token_ids) for o in outputs) == new_tokens
            zoo_tokens[name] = [o.token_ids for o in outputs]

        return run

    with stage(startup, "HF load"):
        reference = load_reference(path, getattr(torch, args.dtype), "cpu")
    tokenizer = llm.tokenizer
    width = max(len(c) for c in chats)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in chats])
    attention_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chats])

    def run_hf():
        with torch.inference_mode():
            out = reference.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                     max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, pad_token_id=pad)
        assert out.shape == (args.prompts, width + args.max_tokens)

    runs = {"zoo": zoo_run(llm, "eager"), "zoo compiled": zoo_run(compiled, "compiled"), "HF": run_hf}
    zoo_seconds, compiled_seconds, hf_seconds = timed_alternately(runs, args.repeats, startup)

    results = {
        "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "transformers": transformers.__version__, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "zoo_tokens_per_s": new_tokens / zoo_seconds, "zoo_compiled_tokens_per_s": new_tokens / compiled_seconds,
        "hf_tokens_per_s": new_tokens / hf_seconds, "startup_s": startup,
        "compiled_tokens_equal_eager": zoo_tokens["compiled"] == zoo_tokens["eager"],
    }
    results["speedup"] = results["zoo_tokens_per_s"] / results["hf_tokens_per_s"]
    results["compiled_speedup"] = results["zoo_compiled_tokens_per_s"] / results["hf_tokens_per_s"]
    print(f"SmolLM2-135M-Instruct {args.dtype}, {args.prompts} prompts x {args.max_tokens} new tokens, greedy "
          f"({results['date']}, {results['cpus']} CPUs, torch {results['torch']}, transformers {results['transformers']})")
    print("| engine | tokens/s | seconds |")
    print("|---|---|---|")
    print(f"| zoo LLM.generate | {results['zoo_tokens_per_s']:.1f} | {zoo_seconds:.2f} |")
    print(f"| zoo LLM.generate, compile_decode=True | {results['zoo_compiled_tokens_per_s']:.1f} | {compiled_seconds:.2f} |")
    print(f"| HF transformers generate (batched) | {results['hf_tokens_per_s']:.1f} | {hf_seconds:.2f} |")
    print(f"zoo / HF: {results['speedup']:.2f}x; compiled: {results['compiled_speedup']:.2f}x "
          f"(the same tokens as eager: {results['compiled_tokens_equal_eager']})")
    print(startup_text(startup))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
