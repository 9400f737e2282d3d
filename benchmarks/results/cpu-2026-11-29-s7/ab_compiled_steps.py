"""A/B, step by step: SmolLM2's decode steps of 16 sequences, eager (weights packed by
``PackedWeight``) against compiled (``LLM(..., compile_decode=True)``), seventh session.

Two engines of the same checkpoint take turns step by step, each generating the same 16 chat
prompts x 64 tokens twice (EOS ignored, prefix cache off); prints the compile time and the median
decode step of each.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/ab_compiled_steps.py [--dtype bfloat16]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    options = dict(dtype=args.dtype, device="cpu", max_model_len=512, enable_prefix_caching=False)
    start = time.perf_counter()
    engines = {"compiled": LLM(str(default_model_path()), compile_decode=True, **options)}
    print(f"LLM start with compile_decode: {time.perf_counter() - start:.1f} s")
    engines["eager"] = LLM(str(default_model_path()), **options)
    chats = [engines["eager"].chat_prompt([{"role": "user", "content": f"Write a short poem about {topic}."}])
             for topic in TOPICS]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    steps = {name: [] for name in engines}
    for round_ in range(2):
        for llm in engines.values():
            for i, prompt in enumerate(chats):
                llm.engine.add_request(100 * round_ + i, prompt, params)
            llm.engine.step()  # the prefills
        while any(llm.engine.has_unfinished() for llm in engines.values()):
            for name, llm in engines.items():
                if llm.engine.has_unfinished():
                    start = time.perf_counter()
                    llm.engine.step()
                    steps[name].append(time.perf_counter() - start)
    for name, spent in steps.items():
        print(f"{args.dtype} {name}: median decode step {statistics.median(spent) * 1e3:.1f} ms over {len(spent)} steps")


if __name__ == "__main__":
    main()
