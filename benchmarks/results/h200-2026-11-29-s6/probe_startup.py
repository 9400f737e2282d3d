"""How long LLM(...) takes to start on the 8B shape, with its decode graphs captured (67 at
max_num_seqs 512) and without (enforce_eager), and the second LLM on the same model: the
session-5 fix for a second engine finding no memory, run on the GPU."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_gpu import zoo_8b  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

model = zoo_8b()
torch.cuda.empty_cache()
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
outputs = {}
for label, options in (("graphs, max_num_seqs 512", {}), ("enforce_eager", {"enforce_eager": True}),
                       ("graphs, max_num_seqs 64", {"max_num_seqs": 64}), ("graphs again, 512", {})):
    options.setdefault("max_num_seqs", 512)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm = LLM(model, max_model_len=2048, **options)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    graphs = len(llm.engine.runner.graphs.sizes) if llm.engine.runner.graphs is not None else 0
    outputs[label] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(f"{label}: LLM(...) {seconds:.1f} s, {graphs} decode graphs, {llm.engine.block_manager.num_blocks} KV blocks, "
          f"free after {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB", flush=True)
    del llm
print("same tokens in every engine:", all(o == outputs["enforce_eager"] for o in outputs.values()))
