"""How much batch-1 decode could gain at most by folding small kernels away: the decode step timed
with chosen kernels removed from the chain, on the Qwen3-30B-A3B shape (default) or the
Llama-3.1-8B shape. The outputs are wrong; only the time counts. Each removal bounds what any
fusion of that kernel into its neighbours can save.

    python3 benchmarks/bench_decode_without.py                          # DEFAULT's configurations
    python3 benchmarks/bench_decode_without.py none route_topk post_norm input_norm+post_norm
    python3 benchmarks/bench_decode_without.py --shape llama-3.1-8b     # DEFAULT_DENSE's

DEFAULT: none, each kernel alone, route_topk+post_norm, all four, and none again last, whose time
against the first shows how far the step's time drifts over the run. DEFAULT_DENSE: the same for
the dense shape's kernels (its norms split first, then unsplit), then both norms and decode attention
with rotary.

Each argument is one configuration, "none" or kernels joined by "+":

route_topk        the router after its logits: every token takes experts 0, 8, ..., 56 at weight 1/8
                  (the same bytes of expert weights as a real routing); the MoE shape only
input_norm        each layer's input RMSNorm (with the residual add): the attention reads a fixed row
post_norm         each layer's post-attention RMSNorm: the MLP or MoE block reads a fixed row
split_norms       not a removal: the norms a single-row step splits between the products around them
                  (models.base.DecoderLayer.splits_norms) run as kernels of their own,
                  as they do where a model does not split them; input_norm and post_norm imply it
rotary_write_kv   the per-head q/k-norm, rotary and KV-cache write (the cache stays zero)
decode_attention  both decode-attention kernels (split and reduce): o_proj reads the queries
rotary_emb        the step's cos and sin from its positions (a product, cos and sin): every layer reads
                  fixed rows
fill_pending      the input ids' pending entries read from the sampled ids (a comparison, a gather, a
                  select): the embedding reads the sampled ids as they are

Random bf16 weights (bench_moe.zoo_from_random_hf, bench_gpu.zoo_8b), one model for every configuration; per
configuration a fresh LLM (max_model_len 1024 unless --max-model-len says otherwise; CUDA graphs
captured after the removal), a 128-token prompt and 256 greedy tokens timed as bench_moe's decode,
five times: the fastest run and all five are printed. Each removal applies to single-row steps
only, so the KV-cache sizing's prefill runs unchanged.
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import layers.attention  # noqa: E402
import layers.moe  # noqa: E402
import runtime.run_ahead  # noqa: E402
from bench_gpu import LLAMA_8B, decode_ms_per_token, zoo_8b  # noqa: E402
from bench_moe import (  # noqa: E402
    DECODE_TOKENS,
    PROMPT_LEN,
    QWEN3_30B_A3B,
    free_memory,
    random_mxfp4_zoo,
    zoo_from_random_hf,
)
from bench_moe import SHAPES as MOE_SHAPES  # noqa: E402
from models.base import norms_unsplit  # noqa: E402
from runtime import LLM  # noqa: E402

KERNELS = ("route_topk", "input_norm", "post_norm", "split_norms", "rotary_write_kv", "decode_attention", "rotary_emb",
           "fill_pending")
DEFAULT = ("none", "route_topk", "post_norm", "input_norm", "rotary_write_kv",
           "route_topk+post_norm", "route_topk+post_norm+input_norm+rotary_write_kv", "none")
DEFAULT_DENSE = ("none", "split_norms", "input_norm", "post_norm", "input_norm+post_norm", "rotary_write_kv",
                 "decode_attention", "rotary_write_kv+decode_attention", "none")
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "llama-3.1-8b": LLAMA_8B}
# Shapes whose experts model_and_prompt keeps in MXFP4 (bench_decode_ab.py's A/Bs; no kernel removals here).
MXFP4_SHAPES = ("gpt-oss-20b",)
RUNS = 5
MAX_MODEL_LEN = 1024
MAX_MODEL_LEN_HELP = ("the LLM's max_model_len (default %(default)s): the decode graphs' block tables are that wide, "
                      "and decode attention splits each sequence's keys by it")


class Removed:
    """The model's kernels of one configuration taken out of single-row steps, put back on exit."""

    def __init__(self, model, kernels: set[str], fields: dict):
        self.model, self.kernels = model, kernels
        self.row = torch.randn(1, fields["hidden_size"], dtype=torch.bfloat16, device="cuda") * 0.1
        if "route_topk" in kernels:  # main() takes it for the MoE shape only
            top_k = fields["num_experts_per_tok"]
            self.routing = (torch.full((1, top_k), 1 / top_k, device="cuda"),
                            torch.arange(0, 8 * top_k, 8, device="cuda").view(1, top_k))
        self.route_topk, self.rotary_write_kv = layers.moe.route_topk, layers.attention.rotary_write_kv
        self.attend_decodes = layers.attention.TritonAttentionBackend.attend_decodes
        self.fill_pending = runtime.run_ahead.RunAhead.fill_pending
        self.angles_of = model.model.rotary_emb.forward  # bound before __enter__ patches the instance
        self.angles = self.angles_of(torch.zeros(1, dtype=torch.long, device="cuda"))
        splits = kernels & {"input_norm", "post_norm", "split_norms"}
        self.unsplit = norms_unsplit(model) if splits else contextlib.nullcontext()

    def fixed_norm(self, hidden_states, residual=None):
        normed = self.row if hidden_states.shape[0] == 1 else hidden_states
        return normed if residual is None else (normed, hidden_states)

    def fixed_routing(self, logits, *args, **kwargs):
        return self.routing if logits.shape[0] == 1 else self.route_topk(logits, *args, **kwargs)

    def unrotated(self, q, k, *args, **kwargs):
        return (q, k) if q.shape[0] == 1 else self.rotary_write_kv(q, k, *args, **kwargs)

    def fixed_angles(self, positions, through_cache=False):
        return self.angles if positions.shape[0] == 1 else self.angles_of(positions, through_cache)

    def __enter__(self):
        if "route_topk" in self.kernels:
            layers.moe.route_topk = self.fixed_routing
        if "rotary_write_kv" in self.kernels:
            layers.attention.rotary_write_kv = self.unrotated
        if "decode_attention" in self.kernels:  # a step of one sequence has no prefill rows
            attend_decodes = self.attend_decodes
            layers.attention.TritonAttentionBackend.attend_decodes = \
                lambda backend, q, *args: q if q.shape[0] == 1 else attend_decodes(backend, q, *args)
        if "fill_pending" in self.kernels:
            fill_pending = self.fill_pending
            runtime.run_ahead.RunAhead.fill_pending = lambda run_ahead, input_ids, sources: (
                run_ahead.sampled_ids[:1] if input_ids.shape[0] == 1 else fill_pending(run_ahead, input_ids, sources))
        if "rotary_emb" in self.kernels:
            self.model.model.rotary_emb.forward = self.fixed_angles
        self.unsplit.__enter__()
        for layer in self.model.model.layers:
            if "input_norm" in self.kernels:
                layer.input_layernorm.forward = self.fixed_norm
            if "post_norm" in self.kernels:
                layer.post_attention_layernorm.forward = self.fixed_norm
        return self

    def __exit__(self, *exc):
        layers.moe.route_topk, layers.attention.rotary_write_kv = self.route_topk, self.rotary_write_kv
        layers.attention.TritonAttentionBackend.attend_decodes = self.attend_decodes
        runtime.run_ahead.RunAhead.fill_pending = self.fill_pending
        self.model.model.rotary_emb.__dict__.pop("forward", None)
        self.unsplit.__exit__(*exc)
        for layer in self.model.model.layers:
            layer.input_layernorm.__dict__.pop("forward", None)
            layer.post_attention_layernorm.__dict__.pop("forward", None)


def time_decode(model, prompt, max_model_len: int = MAX_MODEL_LEN) -> list[float]:
    llm = LLM(model, max_num_seqs=1, max_model_len=max_model_len, enable_prefix_caching=False)
    for module in model.modules():  # entries no kernel writes read as zeros, not NaN
        for cache in getattr(module, "kv_cache", None) or ():
            cache.zero_()
    decode_ms_per_token(llm, prompt, 8)
    return [decode_ms_per_token(llm, prompt, DECODE_TOKENS) for _ in range(RUNS)]


def model_and_prompt(shape: str) -> tuple:
    """The random bf16 model of ``shape`` (a key of SHAPES; of MXFP4_SHAPES: random MXFP4 experts, as
    bench_moe.py --experts mxfp4 builds them) and the 128-token prompt its decode is timed on."""
    if shape in MXFP4_SHAPES:
        model, fields = random_mxfp4_zoo(shape), MOE_SHAPES[shape]
    else:
        model = zoo_from_random_hf(shape) if shape == "qwen3-30b-a3b" else zoo_8b()
        fields = SHAPES[shape]
    free_memory()
    generator = torch.Generator().manual_seed(0)
    return model, torch.randint(0, fields["vocab_size"], (PROMPT_LEN,), generator=generator).tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configurations", nargs="*")
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=MAX_MODEL_LEN_HELP)
    args = parser.parse_args()
    fields = SHAPES[args.shape]
    names = args.configurations or (DEFAULT if args.shape == "qwen3-30b-a3b" else DEFAULT_DENSE)
    configurations = [set() if name == "none" else set(name.split("+")) for name in names]
    for kernels in configurations:
        if unknown := kernels - set(KERNELS):
            parser.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)} or none")
        if "route_topk" in kernels and "num_experts" not in fields:
            parser.error(f"{args.shape} has no router: route_topk is the MoE shape's")
    print({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape}, flush=True)
    model, prompt = model_and_prompt(args.shape)
    print("\n| kernels removed | ms/token, fastest | all runs |\n|---|---:|---|", flush=True)
    for name, kernels in zip(names, configurations):
        with Removed(model, kernels, fields):
            runs = time_decode(model, prompt, args.max_model_len)
        print(f"| {name} | {min(runs):.3f} | {', '.join(f'{r:.3f}' for r in runs)} |", flush=True)
        free_memory()


if __name__ == "__main__":
    main()
