"""A/B, step by step in one process: the torch backend deriving the decodes' key slots once per
forward (new) against deriving them in every layer (old, through paged_decode_attention_reference).
SmolLM2 float32, 16 sequences x 64 tokens, four rounds; prints the median decode step of each.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s6/ab_decode_keys.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import layers.attention as attention  # noqa: E402
from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from ops_cuda.paged_attention import paged_decode_attention_reference  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

new = attention.TorchAttentionBackend.attend_decodes


def old(self, q, k_cache, v_cache, metadata, scale, window):
    p = metadata.num_prefills
    return paged_decode_attention_reference(q, k_cache, v_cache, metadata.block_tables[p:], metadata.seq_lens[p:],
                                            scale, window)


variants = {"old": old, "new": new}
llm = LLM(str(default_model_path()), dtype="float32", device="cpu", max_model_len=512)
chats = [llm.chat_prompt([{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}])
         for i in range(16)]
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
engine = llm.engine
times = {name: [] for name in variants}
for round_ in range(4):
    for i, prompt in enumerate(chats):
        engine.add_request(round_ * 100 + i, prompt, params)
    engine.step()
    engine.step()
    n = 0
    while engine.has_unfinished():
        name = list(variants)[n % 2]
        n += 1
        attention.TorchAttentionBackend.attend_decodes = variants[name]
        start = time.perf_counter()
        engine.step()
        times[name].append(time.perf_counter() - start)
for name, spent in times.items():
    print(f"{name}: median decode step {statistics.median(spent) * 1e3:.1f} ms over {len(spent)} steps")
