"""Decode steps replayed as CUDA graphs, and the pinned buffers that send a step's inputs to the device."""

import numpy as np
import torch

from layers import AttentionMetadata
from runtime.run_ahead import RunAhead
from runtime.step_inputs import StepInputs


class Staging:
    """A pinned host buffer that a step's inputs are packed into and sent to the device in one
    asynchronous copy. A pageable copy would wait for the device to finish its earlier work; this
    one lets the host build and launch step n+1 while step n runs. Packing waits only until the
    previous copy has read the buffer."""

    ALIGN = 16  # each packed array starts at a multiple of 16 elements, aligned for the kernels

    def __init__(self, dtype: torch.dtype, numel: int = 0):
        self.buffer = torch.zeros(numel, dtype=dtype).pin_memory()
        self.copied = torch.cuda.Event()

    def host(self, numel: int) -> np.ndarray:
        """The first ``numel`` elements of the buffer, free to be written (grown when too small)."""
        self.copied.synchronize()
        if numel > self.buffer.numel():
            self.buffer = torch.zeros(2 * numel, dtype=self.buffer.dtype).pin_memory()
        return self.buffer.numpy()[:numel]

    def send(self, out: torch.Tensor) -> None:
        """Copy the first ``out.numel()`` packed elements into ``out`` without waiting for the device."""
        out.view(-1).copy_(self.buffer[: out.numel()], non_blocking=True)
        self.copied.record()

    def send_arrays(self, arrays, device, shapes=None) -> list[torch.Tensor]:
        """The arrays on the device, packed into one new tensor there. An array given a wider 2-D
        shape in ``shapes`` (None: its own) arrives with that shape: its values in the leading
        columns of each row, zeros after them."""
        shapes = [a.shape if s is None else s for a, s in zip(arrays, shapes or [None] * len(arrays))]
        sizes = [int(np.prod(shape)) for shape in shapes]
        starts = np.cumsum([0] + [-(-size // self.ALIGN) * self.ALIGN for size in sizes])
        host = self.host(int(starts[-1]))
        for start, size, shape, array in zip(starts, sizes, shapes, arrays):
            if shape == array.shape:
                host[start : start + size] = array.reshape(-1)
            else:
                fill_leading_columns(host[start : start + size].reshape(shape), array)
        packed = torch.empty(int(starts[-1]), dtype=self.buffer.dtype, device=device)
        self.send(packed)
        return [packed[start : start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]


def fill_leading_columns(out: np.ndarray, array: np.ndarray) -> None:
    """``out`` [rows, width] holds ``array`` [rows, <= width] in its leading columns, zeros after:
    block tables cut to the step's blocks, as wide again as the kernels were compiled for."""
    out[:, : array.shape[1]] = array
    out[:, array.shape[1] :] = 0


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, then every 8 rows up to ``max_batch``
    (always included). A batch pads by at most 7 rows, whose products cost as much as real ones."""
    return sorted({min(size, max_batch) for size in [1, 2, 4, *range(8, max_batch + 8, 8)]})


class DecodeGraphs:
    """Decode steps captured as CUDA graphs for batch sizes 1, 2, 4, 8, 16, 24, ... up to ``max_batch``.

    A step of n decodes replays the smallest graph of at least n rows; the inputs and metadata
    live in buffers allocated once and rewritten in place, padding rows write nothing and read
    nothing (slot -1, length 0). A step writes its inputs into pinned host copies of those
    buffers and sends them over in two asynchronous copies, one of int64s and one of int32s.
    Pending input ids are read inside the graph from the run-ahead's sampled ids.
    """

    def __init__(self, model, max_batch: int, table_width: int, run_ahead: RunAhead, device: torch.device):
        self.model = model
        self.run_ahead = run_ahead
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]

        # Two buffers, each sent in one copy a step: int64 ids, their sources, positions and slots;
        # int32 lengths, then table rows. Each part starts at a multiple of 16 elements, aligned for the kernels.
        self.table_start = -(-largest // 16) * 16
        self.longs = torch.zeros(4, self.table_start, dtype=torch.long, device=device)
        self.input_ids, self.sources, self.positions, self.slots = self.longs[:, :largest]
        self.ints = torch.zeros(self.table_start + largest * table_width, dtype=torch.int32, device=device)
        self.seq_lens = self.ints[:largest]
        self.block_tables = self.ints[self.table_start :].view(largest, table_width)
        self.staged_longs = Staging(torch.long, self.longs.numel())
        self.staged_ints = Staging(torch.int32, self.ints.numel())
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # the largest graph's logits; each smaller graph copies its rows in
        self._capture()

    def _arguments(self, size: int):
        metadata = AttentionMetadata(
            query_lens=[1] * size, context_lens=[0] * size, slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size], num_decodes=size, seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
        )
        input_ids = self.run_ahead.fill_pending(self.input_ids[:size], self.sources[:size])
        return input_ids, self.positions[:size], metadata

    @torch.inference_mode()
    def _capture(self) -> None:
        self.slots.fill_(-1)  # capture and warm-up runs must not touch the cache
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self.model(*self._arguments(size))  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(*self._arguments(size))
                if self.logits is None:
                    self.logits = logits
                else:
                    # One logits buffer for every graph: a graph's own output stays allocated for good,
                    # and over 1024 batch sizes of a 128k vocabulary they would hold ~17 GB.
                    self.logits[:size].copy_(logits)
            del logits  # a smaller graph's output goes back to the pool for the next capture
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        n = len(step.input_ids)
        size = next(s for s in self.sizes if s >= n)
        host_longs = self.staged_longs.host(self.longs.numel()).reshape(self.longs.shape)
        arrays = (step.input_ids, step.sources, step.positions, step.slots)
        for staged, values, padding in zip(host_longs, arrays, (0, 0, 0, -1)):
            staged[:n] = values
            staged[n:size] = padding
        table_width = self.block_tables.shape[1]
        ints_used = self.table_start + n * table_width  # every length, the first n table rows
        host_ints = self.staged_ints.host(ints_used)
        host_ints[:n] = step.seq_lens
        host_ints[n:size] = 0
        fill_leading_columns(host_ints[self.table_start :].reshape(n, table_width), step.block_tables)
        self.staged_longs.send(self.longs)
        self.staged_ints.send(self.ints[:ints_used])
        self.graphs[size].replay()
        return step.sampled_logits(self.logits[:n])
