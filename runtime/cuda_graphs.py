"""Steps replayed as CUDA graphs (decode steps whole, steps that carry prompt tokens in pieces between
attention calls), and the pinned buffers that send a step's inputs to the device."""

import itertools
from collections.abc import Callable

import numpy as np
import torch

from layers import AttentionMetadata
from ops_cuda import argmax
from runtime.kv_cache import KVCache
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
        starts = np.cumsum([0] + [aligned(size) for size in sizes])
        host = self.host(int(starts[-1]))
        for start, size, shape, array in zip(starts, sizes, shapes, arrays):
            if shape == array.shape:
                host[start : start + size] = array.reshape(-1)
            else:
                fill_leading_columns(host[start : start + size].reshape(shape), array)
        packed = torch.empty(int(starts[-1]), dtype=self.buffer.dtype, device=device)
        self.send(packed)
        return [packed[start : start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]


def aligned(count: int) -> int:
    """``count`` rounded up to a multiple of ``Staging.ALIGN``: where the next part of a packed buffer starts."""
    return -(-count // Staging.ALIGN) * Staging.ALIGN


class GraphInputs:
    """A graph's inputs on the device: rows of int64s, then int32s, in one byte buffer sent from its
    pinned host copy in one asynchronous copy a step (each copy is an operation of its own on the
    stream, between one step's graph and the next)."""

    def __init__(self, long_rows: int, long_width: int, num_ints: int, device: torch.device):
        self.long_bytes = long_rows * long_width * 8
        self.device_bytes = torch.zeros(self.long_bytes + 4 * num_ints, dtype=torch.uint8, device=device)
        self.longs = self.device_bytes[: self.long_bytes].view(torch.long).view(long_rows, long_width)
        self.ints = self.device_bytes[self.long_bytes :].view(torch.int32)
        self.staging = Staging(torch.uint8, self.device_bytes.numel())

    def host(self, ints_used: int) -> tuple[np.ndarray, np.ndarray]:
        """The host copies of ``longs`` and of the first ``ints_used`` int32s, free to be written."""
        host = self.staging.host(self.long_bytes + 4 * ints_used)
        return host[: self.long_bytes].view(np.int64).reshape(self.longs.shape), host[self.long_bytes :].view(np.int32)

    def send(self, ints_used: int) -> None:
        """Sends what ``host`` gave, without waiting for the device."""
        self.staging.send(self.device_bytes[: self.long_bytes + 4 * ints_used])


def fill_leading_columns(out: np.ndarray, array: np.ndarray) -> None:
    """``out`` [rows, width] holds ``array`` [rows, <= width] in its leading columns, zeros after:
    block tables cut to the step's blocks, as wide again as the kernels were compiled for."""
    out[:, : array.shape[1]] = array
    out[:, array.shape[1] :] = 0


def stage_tokens(host_longs: np.ndarray, step: StepInputs, size: int) -> None:
    """The step's input ids, their sources, positions and slots into the first four rows of a graph's
    staged int64 buffer, padded to ``size`` tokens: id 0, position 0, slot -1 (nothing is written)."""
    n = len(step.input_ids)
    arrays = (step.input_ids, step.sources, step.positions, step.slots)
    for staged, values, padding in zip(host_longs, arrays, (0, 0, 0, -1)):
        staged[:n] = values
        staged[n:size] = padding


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, then every 8 rows up to ``max_batch``
    (always included). A batch pads by at most 7 rows, whose products cost as much as real ones."""
    return sorted({min(size, max_batch) for size in [1, 2, 4, *range(8, max_batch + 8, 8)]})


class DecodeGraphs:
    """Decode steps captured as CUDA graphs for batch sizes 1, 2, 4, 8, 16, 24, ... up to ``max_batch``.

    A step of n decodes replays the smallest graph of at least n rows; the inputs and metadata
    live in buffers allocated once and rewritten in place, padding rows write nothing and read
    nothing (slot -1, length 0). A step writes its inputs into a pinned host copy of those
    buffers and sends them over in one asynchronous copy (``GraphInputs``). Pending input ids are
    read inside the graph from the run-ahead's sampled ids, and the graph ends with greedy sampling:
    each row's argmax written into those sampled ids and into the host row of the step's turn
    (``RunAhead.write_greedy``), where a step that samples otherwise overwrites it (and pays for one
    read of its logits it does not use). Outside a graph, argmax, the write and the copy to the host
    would be four more operations between two steps.
    """

    def __init__(self, model, max_batch: int, table_width: int, run_ahead: RunAhead, device: torch.device):
        self.model = model
        self.run_ahead = run_ahead
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]

        # Sent in one copy a step: int64 ids, their sources, positions and slots, then the run-ahead's
        # turn; int32 lengths, then table rows. Each part starts at a multiple of 16 elements, aligned
        # for the kernels.
        self.table_start = aligned(largest)
        self.inputs = GraphInputs(5, self.table_start, self.table_start + largest * table_width, device)
        self.input_ids, self.sources, self.positions, self.slots = self.inputs.longs[:4, :largest]
        self.turn = self.inputs.longs[4, :1]
        self.seq_lens = self.inputs.ints[:largest]
        self.block_tables = self.inputs.ints[self.table_start :].view(largest, table_width)
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
        sampled_ids = self.run_ahead.sampled_ids
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            argmax(self.model(*self._arguments(size)))  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(*self._arguments(size))
                if self.logits is None:
                    self.logits = logits
                else:
                    # One logits buffer for every graph: a graph's own output stays allocated for good,
                    # and over 1024 batch sizes of a 128k vocabulary they would hold ~17 GB.
                    self.logits[:size].copy_(logits)
                rows = min(size, len(sampled_ids))  # the largest graph may pad past max_num_seqs
                self.run_ahead.write_greedy(argmax(logits[:rows]), self.turn)
            del logits  # a smaller graph's output goes back to the pool for the next capture
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        n = len(step.input_ids)
        size = next(s for s in self.sizes if s >= n)
        table_width = self.block_tables.shape[1]
        ints_used = self.table_start + n * table_width  # every length, the first n table rows
        host_longs, host_ints = self.inputs.host(ints_used)
        stage_tokens(host_longs, step, size)
        host_longs[4, 0] = self.run_ahead.turn
        host_ints[:n] = step.seq_lens
        host_ints[n:size] = 0
        fill_leading_columns(host_ints[self.table_start :].reshape(n, table_width), step.block_tables)
        self.inputs.send(ints_used)
        self.graphs[size].replay()
        return step.sampled_logits(self.logits[:n])


# Steps of up to this many tokens replay piecewise graphs. On the Llama-3.1-8B shape the host takes
# ~22 ms to launch an eager forward of any length; its GPU work is 5.3 ms at 128 tokens, 11.5 ms at
# 512 and near the host's time at 1,024: past it the host's launches hide behind the GPU's work.
PIECEWISE_MAX_TOKENS = 1024


def piece_sizes(max_tokens: int) -> list[int]:
    """The token counts piecewise graphs are captured for: 16, 32, 64, ... up to ``max_tokens``
    (always included). Of the rows a step of more than 16 tokens replays, fewer than half are padding."""
    sizes = [16]
    while sizes[-1] < max_tokens:
        sizes.append(2 * sizes[-1])
    return sorted({min(size, max_tokens) for size in sizes})


class PiecewiseGraphs:
    """Steps that carry prompt tokens, alone or beside decodes, of up to ``max_tokens`` tokens,
    replayed as CUDA graphs in pieces: the forward is captured for token counts 16, 32, 64, ...,
    one graph from each attention call to the next, and attention runs eagerly between them on the
    step's own metadata. The prompts' lengths, what each has cached and the decodes beside them
    then take the kernels they take in an eager step, and every other launch of the forward
    (embedding, products, norms, rotary and the KV write, MoE, LM head) is replayed.

    An eager forward launches a few hundred kernels (~340 on the Llama-3.1-8B shape), each with
    tens of µs of the host's work, which short steps wait on: a 128-token prompt's GPU work there
    is 5.3 ms and its eager forward ~22 ms. A replayed step's host work is the pieces' replays and
    the attention calls.

    The step's inputs live in buffers allocated once, as ``DecodeGraphs``'s do; padding rows have
    id 0, position 0 and slot -1 (nothing is written), and attention sees only the real rows. The
    LM head computes as many rows as a step of the size can sample (one a sequence). Each piece ends by
    copying the attention call's inputs into buffers every layer shares, and the attention call
    writes its output into one the next piece reads: no tensor lives from one piece to the next
    in the graphs' memory pool, which every size shares.
    """

    def __init__(self, model, kv_cache: KVCache, max_tokens: int, max_seqs: int, table_width: int,
                 run_ahead: RunAhead, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.run_ahead = run_ahead
        self.longest_prompt = table_width * kv_cache.block_size  # as many tokens as a table row holds
        self.sizes = piece_sizes(min(max_tokens, max_seqs * self.longest_prompt))
        self.max_seqs = max_seqs
        largest = self.sizes[-1]

        # int64: ids, their sources, positions, slots, then the rows that give logits; int32: lengths,
        # query starts, then table rows. Each part starts at a multiple of 16 elements, aligned for the kernels.
        self.starts_at = aligned(max_seqs)
        self.table_start = aligned(self.starts_at + max_seqs + 1)
        self.inputs = GraphInputs(5, aligned(max(largest, max_seqs)), self.table_start + max_seqs * table_width, device)
        self.input_ids, self.sources, self.positions, self.slots = self.inputs.longs[:4, :largest]
        self.logits_rows = self.inputs.longs[4, :max_seqs]
        self.seq_lens = self.inputs.ints[:max_seqs]
        self.query_start_loc = self.inputs.ints[self.starts_at : self.starts_at + max_seqs + 1]
        self.block_tables = self.inputs.ints[self.table_start :].view(max_seqs, table_width)

        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.buffers: dict[tuple, torch.Tensor] = {}  # attention calls' inputs and outputs, shared by the layers
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.attention_calls: dict[int, list[Callable]] = {}  # the call after each piece but the last
        self.logits: torch.Tensor | None = None  # the largest size's logits; each smaller size copies its rows in
        self._capture()

    def fits(self, tokens: int) -> bool:
        return tokens <= self.sizes[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        n, seqs, rows = len(step.input_ids), len(step.query_lens), len(step.logits_rows)
        size = next(s for s in self.sizes if s >= n)
        table_width = self.block_tables.shape[1]
        ints_used = self.table_start + seqs * table_width
        host_longs, host_ints = self.inputs.host(ints_used)
        stage_tokens(host_longs, step, size)
        host_longs[4, :rows] = step.logits_rows
        host_longs[4, rows : self._logits_rows(size)] = 0
        host_ints[:seqs] = step.seq_lens
        host_ints[self.starts_at : self.starts_at + seqs + 1] = step.query_start_loc
        fill_leading_columns(host_ints[self.table_start :].reshape(seqs, table_width), step.block_tables)
        self.inputs.send(ints_used)
        metadata = AttentionMetadata(
            query_lens=step.query_lens, context_lens=step.context_lens, slot_mapping=self.slots[:n],
            block_tables=self.block_tables[:seqs], num_decodes=step.num_decodes, seq_lens=self.seq_lens[:seqs],
            query_start_loc=self.query_start_loc[: seqs + 1],
        )
        pieces = self.pieces[size]
        for piece, attend in zip(pieces, self.attention_calls[size]):
            piece.replay()
            attend(n, metadata)
        pieces[-1].replay()
        return self.logits[:rows]

    def _logits_rows(self, size: int) -> int:
        return min(size, self.max_seqs)  # each row that gives logits is one sequence's

    def _capture_prompts(self, size: int) -> list[int]:
        """The lengths of the prompts, nothing cached, that a size is captured as: as few as the block
        tables' rows hold. Their lengths are written into the buffers (not inside a capture: a replay
        would write them again)."""
        lengths = [min(self.longest_prompt, size - start) for start in range(0, size, self.longest_prompt)]
        self.seq_lens[: len(lengths)] = torch.tensor(lengths)
        self.query_start_loc[: len(lengths) + 1] = torch.tensor([0, *itertools.accumulate(lengths)])
        return lengths

    def _forward(self, lengths: list[int]) -> torch.Tensor:
        """The forward on the buffers of prompts of ``lengths`` with nothing cached."""
        size, seqs = sum(lengths), len(lengths)
        metadata = AttentionMetadata(
            query_lens=lengths, context_lens=[0] * seqs, slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:seqs], num_decodes=0, seq_lens=self.seq_lens[:seqs],
            query_start_loc=self.query_start_loc[: seqs + 1],
        )
        input_ids = self.run_ahead.fill_pending(self.input_ids[:size], self.sources[:size])
        return self.model(input_ids, self.positions[:size], metadata,
                          logits_indices=self.logits_rows[: self._logits_rows(size)])

    @torch.inference_mode()
    def _capture(self) -> None:
        self.slots.fill_(-1)  # capture and warm-up runs must not touch the cache
        backend, pools = self.kv_cache.backend, self.kv_cache.pools
        for size in reversed(self.sizes):  # largest first, so that smaller sizes reuse its memory
            lengths = self._capture_prompts(size)
            self._forward(lengths)  # warm-up: compiles kernels outside the capture
            self.pieces[size], self.attention_calls[size] = [], []
            self.model.bind_kv_cache(AttentionBetweenPieces(self, backend, size), pools)
            self.stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(self.stream):
                    self.begin_piece(size)
                    logits = self._forward(lengths)
                    if self.logits is None:
                        self.logits = logits
                    else:
                        self.logits[: len(logits)].copy_(logits)
                    self.pieces[size][-1].capture_end()
            finally:
                self.model.bind_kv_cache(backend, pools)
            torch.cuda.current_stream().wait_stream(self.stream)
            del logits  # a smaller size's output goes back to the pool for the next capture
        torch.cuda.synchronize()

    def begin_piece(self, size: int) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces[size].append(graph)

    def buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """The buffer of ``key``, shared by every layer: as many rows as the largest size, ``like``'s
        other dimensions and dtype."""
        if key not in self.buffers:
            self.buffers[key] = torch.empty(self.sizes[-1], *like.shape[1:], dtype=like.dtype, device=like.device)
        return self.buffers[key]


class AttentionBetweenPieces:
    """The attention backend the layers are bound to while ``PiecewiseGraphs`` captures a size.
    A call copies its inputs into the shared buffers, ends the piece being captured, runs the
    backend once (which gives its output's shape), notes the call for the replays and begins the
    next piece, which reads the output's buffer."""

    def __init__(self, graphs: PiecewiseGraphs, backend, size: int):
        self.graphs, self.backend, self.size = graphs, backend, size

    def forward(self, layer, q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        return self._attend(self.backend.forward, layer, (q, k, v), metadata)

    def attend_latent(self, layer, q_nope, q_rope, metadata: AttentionMetadata) -> torch.Tensor:
        return self._attend(self.backend.attend_latent, layer, (q_nope, q_rope), metadata)

    def _attend(self, method, layer, inputs, metadata: AttentionMetadata) -> torch.Tensor:
        held = []
        for i, tensor in enumerate(inputs):
            buffer = self.graphs.buffer(("input", i, tuple(tensor.shape[1:]), tensor.dtype), tensor)[: self.size]
            buffer.copy_(tensor)
            held.append(buffer)
        self.graphs.pieces[self.size][-1].capture_end()
        out = method(layer, *held, metadata)
        out_buffer = self.graphs.buffer(("output", tuple(out.shape[1:]), out.dtype), out)

        def attend(n: int, step_metadata: AttentionMetadata) -> None:
            out_buffer[:n].copy_(method(layer, *(buffer[:n] for buffer in held), step_metadata))

        self.graphs.attention_calls[self.size].append(attend)
        self.graphs.begin_piece(self.size)
        return out_buffer[: self.size]
