"""A/B, step by step in one process: SmolLM2 bfloat16 decode steps of 16 sequences with the packed
weights (oneDNN) and without; first checks that both give the same tokens.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s6/ab_bf16_packs.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

llm = LLM(str(default_model_path()), dtype="bfloat16", device="cpu", max_model_len=512, enable_prefix_caching=False)
chats = [llm.chat_prompt([{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}])
         for i in range(16)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
engine = llm.engine
modules = [m for m in engine.runner.model.modules() if getattr(m, "packed", None) is not None]
packs = [m.packed for m in modules]


def packed(on: bool) -> None:
    for module, pack in zip(modules, packs):
        module.packed = pack if on else None


tokens = {}
for on in (False, True):
    packed(on)
    tokens[on] = [o.token_ids for o in llm.generate(chats, params, use_tqdm=False)]
print(f"{len(modules)} packed weights; the same tokens packed and unpacked: {tokens[True] == tokens[False]}")
times = {False: [], True: []}
for round_ in range(3):
    for i, prompt in enumerate(chats):
        engine.add_request(round_ * 100 + i, prompt, params)
    engine.step()
    engine.step()
    n = 0
    while engine.has_unfinished():
        on = bool(n % 2)
        n += 1
        packed(on)
        start = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - start)
for on, spent in times.items():
    print(f"{'packed' if on else 'unpacked'}: median decode step {statistics.median(spent) * 1e3:.1f} ms")
