"""Where a compiled float32 decode step of SmolLM2 goes (16 sequences, ``compile_decode=True``),
seventh session: torch's profiler over one step after five, the ops by their own time. The
profiler adds its own cost to each op, so its total is above an unprofiled step's.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/profile_compiled_step.py
"""

import sys
import time
from pathlib import Path

from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


def main():
    llm = LLM(str(default_model_path()), dtype="float32", device="cpu", max_model_len=512,
              enable_prefix_caching=False, compile_decode=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, topic in enumerate(TOPICS):
        engine.add_request(i, llm.chat_prompt([{"role": "user", "content": f"Write a short poem about {topic}."}]), params)
    for _ in range(6):  # the prefills, then five decode steps
        engine.step()
    with profile() as profiled:
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
    print(f"one profiled decode step: {step * 1e3:.1f} ms")
    for event in sorted(profiled.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"{event.key[:60]:60s} {event.count:5d} calls {event.self_cpu_time_total / 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
