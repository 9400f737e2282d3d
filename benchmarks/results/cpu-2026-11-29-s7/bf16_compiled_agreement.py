"""How close compiled bfloat16 decode steps stay to HuggingFace, next to eager ones (seventh session).

In bfloat16 inductor's fused kernels compute a chain of elementwise ops in float32 and round once,
where eager PyTorch (and HF) rounds after each op, so ``compile_decode=True`` need not give eager's
tokens. SmolLM2 (the embedded GGUF), 16 chat prompts x up to 64 greedy tokens (to EOS), each prompt
generated alone by HF: for zoo eager bfloat16, zoo compiled bfloat16 and HF bfloat16, the
number of sequences identical to HF's bfloat16 and to HF's float32 ones, and the mean number of
leading tokens they share with them.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/bf16_compiled_agreement.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.bench_generate import TOPICS  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402
from loaders.diff import load_reference  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

TOKENS = 64


def shared_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hf_generations(path, dtype, chats):
    model = load_reference(path, dtype, "cpu")
    with torch.inference_mode():
        return [model.generate(torch.tensor([chat]), do_sample=False, max_new_tokens=TOKENS)
                [0, len(chat):].tolist() for chat in chats]


def main():
    path = default_model_path()
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    runs = {}
    for name, compile_decode in (("zoo eager", False), ("zoo compiled", True)):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=512, compile_decode=compile_decode)
        chats = [llm.chat_prompt([{"role": "user", "content": f"Write a short poem about {t}."}]) for t in TOPICS]
        runs[name] = [o.token_ids for o in llm.generate(chats, params, use_tqdm=False)]
        del llm
    runs["HF bfloat16"] = hf_generations(path, torch.bfloat16, chats)
    float32 = hf_generations(path, torch.float32, chats)
    print(f"SmolLM2 bfloat16, {len(chats)} prompts x {TOKENS} greedy tokens")
    print("| run | = HF bf16 | leading tokens shared with HF bf16 | = HF f32 | leading tokens shared with HF f32 |")
    print("|---|---:|---:|---:|---:|")
    for name, generations in runs.items():
        cells = []
        for reference in (runs["HF bfloat16"], float32):
            same = sum(g == r for g, r in zip(generations, reference))
            mean = sum(shared_prefix(g, r) for g, r in zip(generations, reference)) / len(generations)
            cells += [f"{same}/{len(generations)}", f"{mean:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
