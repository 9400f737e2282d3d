"""CPU decode steps compiled with torch.compile."""

import itertools

import numpy as np
import torch
from tqdm import tqdm

from layers import AttentionMetadata
from ops_cuda.linear import TRANSPOSED_ROWS
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
    # inductor imports triton where it is installed: loaded only when a decode graph is compiled
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # inductor says which compiler it looked for
        raise ValueError(f"compile_decode needs a C++ compiler to build inductor's kernels: {exc}") from exc


_ENGINES = itertools.count()


class CompiledDecode:
    """CPU decode steps run through ``torch.compile`` (inductor, the weights frozen into the graph),
    every decode step of the runtime from one graph compiled at start.

    Eager PyTorch dispatches the small ops between a layer's matrix products (norms, rotary,
    SiLU-and-mul, the attention's gathers, the KV write) one by one, each slowed by the caches the
    products have just flushed; inductor fuses them into a few C++ loops. The products read the
    runtime's oneDNN packs, as eager steps do, through zoo::packed_linear, an op the graph calls
    with the pack's number (``ops_cuda.linear.PackedWeight``): oneDNN's opaque packs cannot enter a
    graph, and the packs inductor makes itself for float32 are MKL's, 2.6x slower at 16 rows.
    (Where the runtime packs nothing, for want of memory, the graph leaves the products to inductor.)

    The graph's row count is dynamic, as is the block-table width, so one compile serves every batch
    size. A step of fewer than ``MIN_ROWS`` sequences runs padded to it: from three float32 rows
    the products read the packs and under three multiply as W x^T (``ops_cuda.linear``), and a graph
    holds one of the two. Padding rows attend to nothing (length 0) and write their keys into the
    cache's padding block (a graph cannot skip a slot -1). The table is cut to the blocks the longest
    sequence uses, since in a graph the attention reads keys up to its width, and to two blocks at
    least (dynamo would specialise a width of 1).
    """

    MIN_ROWS = TRANSPOSED_ROWS + 1
    MIN_BLOCKS = 2

    def __init__(self, model, kv_cache: KVCache, run_ahead: RunAhead):
        import torch._inductor.config as inductor_config

        self.block_size, self.padding_slot = kv_cache.block_size, kv_cache.padding_slot
        self.run_ahead = run_ahead

        def step(input_ids, positions, metadata):
            return model(input_ids, positions, metadata)

        # dynamo files each graph under the code object it traced from, guarded by the weights' ids.
        # Compiled through the model's own forward, every engine's graph would pile up on that one
        # code object, and the ninth engine of a process pass dynamo's recompile limit (8): each
        # engine compiles through a copy of ``step``'s code instead, under a name of its own, since
        # dynamo keeps the sizes it has seen by file, line and name, and an engine whose KV cache
        # entries differ from an earlier engine's would find its cache's sizes turned dynamic (a
        # symbolic stride its attention's read cannot trace).
        name = f"decode_step_{next(_ENGINES)}"
        step.__code__ = step.__code__.replace(co_name=name, co_qualname=name)
        self.forward = torch.compile(step, fullgraph=True)
        rows = self.MIN_ROWS
        zeros, padding = np.zeros(rows, dtype=np.int64), np.full(rows, self.padding_slot)
        # Compiled here, by a step of padding rows only, tens of seconds: the bar tells what the start
        # waits on. (With freezing set through torch.compile's options instead, the graph multiplied
        # by unpacked weights, aten::mm.)
        with tqdm(total=1, desc="Compiling decode steps") as bar, torch.inference_mode(), \
                inductor_config.patch(freezing=True):
            self.forward(*self._arguments(zeros, zeros, zeros, padding, zeros.astype(np.int32),
                                          np.zeros((rows, self.MIN_BLOCKS), dtype=np.int32)))
            bar.update()

    def _arguments(self, input_ids, sources, positions, slots, seq_lens, block_tables):
        arrays = (input_ids, sources, positions, slots, seq_lens, block_tables)
        input_ids, sources, positions, slots, seq_lens, block_tables = map(torch.from_numpy, arrays)
        input_ids = self.run_ahead.fill_pending(input_ids, sources)
        # The rows are marked "maybe" dynamic: the products narrow them to MIN_ROWS and more, which a
        # strict mark refuses (it asks the graph to take any row count from 2).
        for tensor in (input_ids, positions, slots, seq_lens, block_tables):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(block_tables, 1)
        metadata = AttentionMetadata(query_lens=[1] * len(input_ids), slot_mapping=slots, block_tables=block_tables,
                                     num_decodes=len(input_ids), seq_lens=seq_lens)
        return input_ids, positions, metadata

    def run(self, step: StepInputs) -> torch.Tensor:
        n = len(step.input_ids)
        rows = max(n, self.MIN_ROWS)
        blocks = max(-(-int(step.seq_lens.max()) // self.block_size), self.MIN_BLOCKS)
        tables = np.zeros((rows, blocks), dtype=np.int32)
        used = step.block_tables[:, :blocks]
        tables[:n, : used.shape[1]] = used

        def padded(values, padding):
            return np.concatenate([values, np.full(rows - n, padding, dtype=values.dtype)])

        logits = self.forward(*self._arguments(
            padded(step.input_ids, 0), padded(step.sources, 0), padded(step.positions, 0),
            padded(step.slots, self.padding_slot), padded(step.seq_lens, 0), tables,
        ))
        return step.sampled_logits(logits[:n])
