"""Probe, seventh session: would inductor's fused CPU kernels pay for a decode step?

Thirty decoder layers of SmolLM2's shapes (random float32 weights) run one decode step of 16
sequences, 150 tokens into their caches, two ways, alternating call by call in one process:
eager, as zoo runs them (its op references, weights packed by ``PackedWeight``), and
``torch.compile(fullgraph=True)`` with freezing (inductor packs the weights for MKL itself and fuses
the norms, rotary and SiLU-and-mul into C++ loops). The KV write and the decode attention are one
opaque custom op, as they would have to be: the attention reads lengths on the host. Prints the
compile time, the largest difference of the outputs and the median step of each.

    .venv/bin/python benchmarks/results/cpu-2026-11-29-s7/compile_layers.py
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ops_cuda.calls import PackedWeight, linear  # noqa: E402
from ops_cuda.kv_cache import write_kv_cache_reference  # noqa: E402
from ops_cuda.norm import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402
from ops_cuda.paged_attention import decode_attention_at_slots, decode_key_slots  # noqa: E402
from ops_cuda.rotary import apply_rotary_reference  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 576, 9, 3, 64, 1536, 30
SEQUENCES, CONTEXT, BLOCK, BLOCKS_PER_SEQ = 16, 150, 16, 10


@torch.library.custom_op("probe::write_and_attend", mutates_args=("k_cache", "v_cache"))
def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping)
    return decode_attention_at_slots(q, k_cache, v_cache, slots, mask, None, HEAD_DIM**-0.5)


@write_and_attend.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, slots, mask):
    return torch.empty_like(q)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()

        def weight(*shape):
            return torch.nn.Parameter(torch.randn(*shape) * 0.05, requires_grad=False)

        self.qkv, self.o = weight(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), weight(HIDDEN, HIDDEN)
        self.gate_up, self.down = weight(2 * INTERMEDIATE, HIDDEN), weight(HIDDEN, INTERMEDIATE)
        self.norm1, self.norm2 = weight(HIDDEN), weight(HIDDEN)
        cache_shape = (SEQUENCES * BLOCKS_PER_SEQ, BLOCK, KV_HEADS, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(cache_shape))
        self.register_buffer("v_cache", torch.zeros(cache_shape))
        self.packs = {}  # eager only: the compiled copy must not trace them

    def forward(self, h, residual, cos, sin, slot_mapping, slots, mask):
        if residual is None:
            residual, h = h, rms_norm_reference(h, self.norm1, 1e-5)
        else:
            h, residual = fused_add_rms_norm_reference(h, residual, self.norm1, 1e-5)
        qkv = linear(h, self.qkv, None, self.packs.get("qkv"))
        q, k, v = qkv.split([HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k = apply_rotary_reference(q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), cos, sin)
        a = write_and_attend(q, k, v.view(-1, KV_HEADS, HEAD_DIM), self.k_cache, self.v_cache, slot_mapping, slots, mask)
        h = linear(a.reshape(-1, HIDDEN), self.o, None, self.packs.get("o"))
        h, residual = fused_add_rms_norm_reference(h, residual, self.norm2, 1e-5)
        gate, up = linear(h, self.gate_up, None, self.packs.get("gate_up")).chunk(2, -1)
        return linear(F.silu(gate) * up, self.down, None, self.packs.get("down")), residual


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, h, cos, sin, slot_mapping, slots, mask):
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, slot_mapping, slots, mask)
        return h + residual


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    inductor_config.freezing = True
    torch.manual_seed(0)

    block_tables = torch.arange(SEQUENCES * BLOCKS_PER_SEQ, dtype=torch.int32).view(SEQUENCES, BLOCKS_PER_SEQ)
    slots, mask, _ = decode_key_slots(block_tables, torch.full((SEQUENCES,), CONTEXT, dtype=torch.int32), BLOCK, 0)
    slot_mapping = block_tables[:, (CONTEXT - 1) // BLOCK].long() * BLOCK + (CONTEXT - 1) % BLOCK
    angles = torch.randn(SEQUENCES, HEAD_DIM)
    inputs = (torch.randn(SEQUENCES, HIDDEN), angles.cos(), angles.sin(), slot_mapping, slots, mask)

    with torch.inference_mode():
        eager = Layers().eval()
        for layer in eager.layers:
            layer.packs = {name: PackedWeight(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")}
        compiled_model = Layers().eval()
        compiled_model.load_state_dict(eager.state_dict())
        start = time.perf_counter()
        compiled = torch.compile(compiled_model, fullgraph=True)
        difference = (compiled(*inputs) - eager(*inputs)).abs().max()
        print(f"compile: {time.perf_counter() - start:.1f} s; largest difference from eager {float(difference):.1e}")
        times = {"eager, packed weights": [], "compiled": []}
        for _ in range(args.steps):
            for run, spent in zip((eager, compiled), times.values()):
                start = time.perf_counter()
                run(*inputs)
                spent.append(time.perf_counter() - start)
    for name, spent in times.items():
        print(f"{name}: median {statistics.median(spent) * 1e3:.1f} ms over {len(spent)} steps")


if __name__ == "__main__":
    main()
