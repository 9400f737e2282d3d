"""Host time per decode step of the runtime, with the model's compute taken out, on this CPU.

On a GPU the decode step itself is one CUDA-graph replay; the host's share of a step is the
engine's bookkeeping, scheduling, building the next step's inputs, sampling, LLM.generate's loop.
When decodes run ahead (``Engine.step``) it overlaps the GPU's work on the step before, and must
stay under it; otherwise the GPU waits for all of it. This measures that work, on the eager
(CPU) path: the copies to the device and the graph launch of the CUDA-graph path are left out.

The model is a tiny Llama (real ``Attention`` modules, so the KV cache is built as usual) whose
forward returns preallocated logits at once and notes when it was called; the time between two
consecutive decode-only calls is one whole turn of host work. Time is the Python thread's CPU
time (``time.thread_time``): wall time would also count a busy neighbour's turns on the core.
The vocabulary is small on purpose: on a GPU the argmax over it is one kernel launch whatever
its size, but here it runs on the CPU (451 rows x 128256 take ~130 ms) and would hide the rest.

Each batch size runs that many requests at once: random 1000-token prompts, 64 new tokens,
greedy, EOS ignored, prefix caching on, max_model_len 2048 (or --max-model-len: the block
tables are as wide as it needs), block size 16 (the shape of the 8B 1000/1000 throughput
benchmark, whose 451 concurrent sequences are the last column, with fewer output tokens). All
prompts prefill in one step, so every decode step holds the whole batch. Reported: the median
and the mean milliseconds between decode steps, of the least disturbed of --repeats runs (the
one of the lowest median: a busy neighbour only adds time).

    .venv/bin/python benchmarks/bench_host.py [--max-model-len 131072]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.modeling_llama import LlamaForCausalLM  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

VOCAB = 128
PROMPT_TOKENS = 1000
OUTPUT_TOKENS = 64
MAX_MODEL_LEN = 2048
NEXT_TOKEN = 7  # what every step samples


class HostOnlyLlama(LlamaForCausalLM):
    """A Llama of one tiny layer whose forward does no compute: logits that always pick NEXT_TOKEN."""

    def __init__(self, max_rows: int, max_model_len: int):
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                          num_attention_heads=1, num_key_value_heads=1,
                                          max_position_embeddings=max_model_len)
        super().__init__(config)
        self.logits = torch.zeros(max_rows, VOCAB)
        self.logits[:, NEXT_TOKEN] = 1.0
        self.decode_calls: list[float] = []  # thread CPU time at each decode-only forward

    def forward(self, input_ids, positions=None, attn_metadata=None, logits_indices=None):
        if attn_metadata.num_decodes == len(attn_metadata.query_lens):
            self.decode_calls.append(time.thread_time())
        rows = len(input_ids) if logits_indices is None else len(logits_indices)
        return self.logits[:rows]


def host_ms_per_decode_step(batch: int, max_model_len: int) -> tuple[float, float]:
    model = HostOnlyLlama(max_rows=batch, max_model_len=max_model_len)
    # All prompts in one step, so that every request decodes in every decode step.
    llm = LLM(model, max_num_seqs=batch, max_model_len=max_model_len, block_size=16,
              max_num_batched_tokens=batch * PROMPT_TOKENS)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.token_ids == [NEXT_TOKEN] * OUTPUT_TOKENS for o in outputs)
    intervals = [(b - a) * 1e3 for a, b in zip(model.decode_calls, model.decode_calls[1:])]
    return statistics.median(intervals), statistics.mean(intervals)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 451])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                        help="the block tables are as wide as this many tokens need (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host work is one Python thread; keep torch's own threads out of the way
    print("| batch | host ms / decode step (median) | mean |")
    print("| ---: | ---: | ---: |")
    for batch in args.batches:
        median, mean = min(host_ms_per_decode_step(batch, args.max_model_len) for _ in range(args.repeats))
        print(f"| {batch} | {median:.3f} | {mean:.3f} |", flush=True)


if __name__ == "__main__":
    main()
