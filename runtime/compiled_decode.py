"""CPU decode steps compiled with torch.compile."""

import numpy as np
import torch
import torch._inductor.config as inductor_config
from torch._inductor.cpp_builder import get_cpp_compiler

from layers import AttentionMetadata
from runtime.kv_cache import KVCache
from runtime.run_ahead import RunAhead
from runtime.step_inputs import StepInputs


def check_compilable(model, device: torch.device) -> None:
    """Raise ValueError where ``compile_decode`` cannot apply: off the CPU, with a forward that
    cannot be captured (it reads values on the host), or with no C++ compiler for inductor's kernels."""
    if device.type != "cpu":
        raise ValueError(f"compile_decode is for models on the CPU; this one is on {device} "
                         "(on CUDA, decode steps replay CUDA graphs)")
    if not model.capturable:
        raise ValueError("compile_decode: the model's forward reads values on the host (positions under dynamic rope "
                         "scaling, sequence lengths in latent attention's paged path), which a compiled graph cannot; "
                         "run it without compile_decode")
    try:
        get_cpp_compiler()
    except Exception as exc:  # inductor says which compiler it looked for
        raise ValueError(f"compile_decode needs a C++ compiler to build inductor's kernels: {exc}") from exc


class CompiledDecode:
    """CPU decode steps of 8 to 16 sequences (with a ``max_batch`` under 16, of half of it to all of
    it), run through ``torch.compile`` (inductor, the weights frozen into the graph).

    Eager PyTorch dispatches the small ops between a layer's matrix products (norms, rotary,
    SiLU-and-mul, the attention's gathers, the KV write) one by one, each slowed by the caches the
    products have just flushed; inductor fuses them into a few C++ loops. The products read the
    runtime's oneDNN packs, as eager steps do, through zoo::packed_linear, an op the graph calls
    with the pack's number (``ops_cuda.linear.PackedWeight``): oneDNN's opaque packs cannot enter a
    graph, and the packs inductor makes itself for float32 are MKL's, 2.6x slower at 16 rows.
    (Where the runtime packs nothing, for want of memory, float32 products multiply as W x^T and
    bfloat16 ones by inductor's packs.) The graph is compiled once, at start, for 16 rows, so a
    smaller batch runs padded. Its padding rows attend to nothing (length 0) and write their keys
    into the cache's padding block (a graph cannot skip a slot -1). Batches under half its rows run
    eagerly, their products cheaper unpadded than what the graph saves (SmolLM2 on 2 cores, float32
    and bfloat16: steps of 1 to 4 sequences up to 1.2x faster eagerly, of 8 about as fast, of 16
    1.2x slower), and so do larger batches. The block-table width is dynamic. The table is cut to
    the blocks the longest sequence uses, since in a graph the attention reads keys up to its width,
    and to two blocks at least (dynamo would specialise a width of 1).
    """

    ROWS = 16
    MIN_BLOCKS = 2

    def __init__(self, model, max_batch: int, kv_cache: KVCache, run_ahead: RunAhead):
        self.rows = min(self.ROWS, max_batch)
        self.block_size, self.padding_slot = kv_cache.block_size, kv_cache.padding_slot
        self.run_ahead = run_ahead
        self.forward = torch.compile(model, fullgraph=True)
        zeros, padding = np.zeros(self.rows, dtype=np.int64), np.full(self.rows, self.padding_slot)
        # Compiled here, by a step of padding rows only. (With freezing set through torch.compile's
        # options instead, the graph multiplied by unpacked weights, aten::mm.)
        with torch.inference_mode(), inductor_config.patch(freezing=True):
            self.forward(*self._arguments(zeros, zeros, zeros, padding, zeros.astype(np.int32),
                                          np.zeros((self.rows, self.MIN_BLOCKS), dtype=np.int32)))

    def _arguments(self, input_ids, sources, positions, slots, seq_lens, block_tables):
        arrays = (input_ids, sources, positions, slots, seq_lens, block_tables)
        input_ids, sources, positions, slots, seq_lens, block_tables = map(torch.from_numpy, arrays)
        torch._dynamo.mark_dynamic(block_tables, 1)
        metadata = AttentionMetadata(query_lens=[1] * self.rows, slot_mapping=slots, block_tables=block_tables,
                                     num_decodes=self.rows, seq_lens=seq_lens)
        return self.run_ahead.fill_pending(input_ids, sources), positions, metadata

    def fits(self, batch: int) -> bool:
        return self.rows // 2 <= batch <= self.rows

    def run(self, step: StepInputs) -> torch.Tensor:
        n = len(step.input_ids)
        blocks = max(-(-int(step.seq_lens.max()) // self.block_size), self.MIN_BLOCKS)
        tables = np.zeros((self.rows, blocks), dtype=np.int32)
        used = step.block_tables[:, :blocks]
        tables[:n, : used.shape[1]] = used

        def padded(values, padding):
            return np.concatenate([values, np.full(self.rows - n, padding, dtype=values.dtype)])

        logits = self.forward(*self._arguments(
            padded(step.input_ids, 0), padded(step.sources, 0), padded(step.positions, 0),
            padded(step.slots, self.padding_slot), padded(step.seq_lens, 0), tables,
        ))
        return step.sampled_logits(logits[:n])
