"""Runs the model on a scheduled step: the KV cache pools, the flat batch and its metadata, the
CUDA graphs that replay decode steps, and the compiled CPU decode step."""

import weakref
from collections.abc import Callable
from itertools import chain

import numpy as np
import torch
import torch._inductor.config as inductor_config

from layers import Attention, AttentionMetadata, pack_for_cpu_decode
from ops_cuda.linear import PackedWeight
from runtime.sequence import PENDING, Sequence


class KVCache:
    """One pool of fixed-size blocks per attention layer: [num_blocks, block_size, kv_heads, head_dim] for K and V.

    With ``padding_block`` the pools hold one block more, which no sequence is given: padding
    tokens of a compiled step write there (``padding_slot``), as a graph cannot skip them."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 padding_block: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.padding_slot = num_blocks * block_size if padding_block else None
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.pools = []
        for layer in self.layers:
            shape = (num_blocks + padding_block, block_size, layer.num_kv_heads, layer.head_dim)
            pool = (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            layer.kv_cache = pool
            self.pools.append(pool)
        # When the engine goes, its cache goes with it, though the model it ran lives on.
        weakref.finalize(self, KVCache._unbind, self.layers, self.pools)

    @staticmethod
    def _unbind(layers, pools) -> None:
        for layer, pool in zip(layers, pools):
            if layer.kv_cache is pool:  # not a newer engine's
                layer.kv_cache = None

    def bound(self) -> bool:
        """Whether the model's layers still hold these pools (a newer engine of the model rebinds them)."""
        return all(layer.kv_cache is pool for layer, pool in zip(self.layers, self.pools))

    @staticmethod
    def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        per_token = sum(2 * m.num_kv_heads * m.head_dim for m in model.modules() if isinstance(m, Attention))
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class StepInputs:
    """The flat batch of one step as host arrays; ``to_device`` turns it into the model's arguments.

    ``scheduled`` lists prefills before decodes. The per-token arrays are built with numpy, the
    block tables are a gather of the block manager's rows.
    """

    def __init__(self, scheduled: list[tuple[Sequence, int]], block_tables: np.ndarray, block_size: int,
                 sampled_rows: dict[Sequence, int]):
        """``sampled_rows``: each sequence's row among the previous step's sampled ids, where a
        pending input token is read from (``sources``)."""
        seqs = [seq for seq, _ in scheduled]
        self.query_lens = [count for _, count in scheduled]
        self.context_lens = [seq.num_computed_tokens for seq in seqs]
        # One fixed table width for every step: kernels see the same shapes eagerly and in graphs.
        self.block_tables = block_tables[[seq.table_row for seq in seqs]]
        counts = np.array(self.query_lens, dtype=np.int64)
        starts = np.array(self.context_lens, dtype=np.int64)
        ends = np.cumsum(counts)  # where each sequence's new tokens end in the stream
        new_tokens = (seq.token_ids[start : start + count]
                      for seq, start, count in zip(seqs, self.context_lens, self.query_lens))
        self.input_ids = np.fromiter(chain.from_iterable(new_tokens), dtype=np.int64, count=int(ends[-1]))
        self.positions = np.arange(ends[-1]) + np.repeat(starts - (ends - counts), counts)
        owner = np.repeat(np.arange(len(seqs)), counts)  # the sequence of each token
        self.sources = np.zeros_like(self.input_ids)
        pending = np.flatnonzero(self.input_ids == PENDING)
        if pending.size:
            self.sources[pending] = [sampled_rows[seqs[i]] for i in owner[pending]]
        blocks = self.block_tables[owner, self.positions // block_size].astype(np.int64)
        self.slots = blocks * block_size + self.positions % block_size
        self.seq_lens = (starts + counts).astype(np.int32)
        self.query_start_loc = np.concatenate(([0], ends)).astype(np.int32)
        # A sequence samples once its last token is computed.
        samples = np.array([seq.num_tokens for seq in seqs]) == starts + counts
        self.logits_rows = ends[samples] - 1
        self.sampled = [seq for seq, sampling in zip(seqs, samples.tolist()) if sampling]
        self.num_decodes = int(np.count_nonzero((counts == 1) & (starts > 0)))  # is_decode of each

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows of ``logits`` (one per token of a decode-only step) of the sequences that sample."""
        if len(self.sampled) == len(logits):
            return logits
        # A one-token chunk of a longer prompt is a decode to attention, but samples nothing.
        return logits[torch.from_numpy(self.logits_rows).to(logits.device)]

    def to_device(self, device, staging: "tuple[Staging, Staging] | None"):
        """The model's arguments on ``device``: on CUDA sent through ``staging`` (int64s, int32s),
        each dtype in one asynchronous copy, so the host can go on while the device works."""
        longs = (self.input_ids, self.sources, self.positions, self.slots, self.logits_rows)
        ints = (self.seq_lens, self.query_start_loc, self.block_tables)
        if staging is None:
            longs, ints = ([torch.from_numpy(a) for a in arrays] for arrays in (longs, ints))
        else:
            longs, ints = (buffers.send_arrays(arrays, device) for buffers, arrays in zip(staging, (longs, ints)))
        input_ids, sources, positions, slots, logits_rows = longs
        seq_lens, query_start_loc, block_tables = ints
        metadata = AttentionMetadata(
            query_lens=self.query_lens, context_lens=self.context_lens, slot_mapping=slots,
            block_tables=block_tables, num_decodes=self.num_decodes, seq_lens=seq_lens,
            query_start_loc=query_start_loc,
        )
        return input_ids, sources, positions, metadata, logits_rows


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

    def send_arrays(self, arrays, device) -> list[torch.Tensor]:
        """The arrays on the device, packed into one new tensor there."""
        starts = np.cumsum([0] + [-(-a.size // self.ALIGN) * self.ALIGN for a in arrays])
        host = self.host(int(starts[-1]))
        for start, array in zip(starts, arrays):
            host[start : start + array.size] = array.reshape(-1)
        packed = torch.empty(int(starts[-1]), dtype=self.buffer.dtype, device=device)
        self.send(packed)
        return [packed[start : start + a.size].view(a.shape) for start, a in zip(starts, arrays)]


def fill_pending(input_ids: torch.Tensor, sources: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """The input ids, with each pending one read from the previous step's sampled ids on the device."""
    return torch.where(input_ids == PENDING, sampled_ids[sources], input_ids)


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
    Pending input ids are read inside the graph from ``sampled_ids``.
    """

    def __init__(self, model, max_batch: int, table_width: int, sampled_ids: torch.Tensor, device: torch.device):
        self.model = model
        self.sampled_ids = sampled_ids
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
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _arguments(self, size: int):
        metadata = AttentionMetadata(
            query_lens=[1] * size, context_lens=[0] * size, slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size], num_decodes=size, seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
        )
        input_ids = fill_pending(self.input_ids[:size], self.sources[:size], self.sampled_ids)
        return input_ids, self.positions[:size], metadata

    @torch.inference_mode()
    def _capture(self) -> None:
        self.slots.fill_(-1)  # capture and warm-up runs must not touch the cache
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self.model(*self._arguments(size))  # warm-up: compiles kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.model(*self._arguments(size))
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
        ints_used = self.table_start + step.block_tables.size  # every length, the first n table rows
        host_ints = self.staged_ints.host(ints_used)
        host_ints[:n] = step.seq_lens
        host_ints[n:size] = 0
        host_ints[self.table_start :] = step.block_tables.reshape(-1)
        self.staged_longs.send(self.longs)
        self.staged_ints.send(self.ints[:ints_used])
        self.graphs[size].replay()
        return step.sampled_logits(self.logits[size][:n])


class CompiledDecode:
    """CPU decode steps of up to 16 sequences (fewer if ``max_batch`` is smaller), run through
    ``torch.compile`` (inductor, the weights frozen into the graph).

    Eager PyTorch dispatches the small ops between a layer's matrix products (norms, rotary,
    SiLU-and-mul, the attention's gathers, the KV write) one by one, each slowed by the caches the
    products have just flushed; inductor fuses them into a few C++ loops. The graph is compiled
    once, at start, for 16 rows: with a fixed row count inductor multiplies by weights packed for
    MKL, as ``PackedWeight`` does (for a dynamic one it takes oneDNN's, slower in float32), so a
    smaller batch runs padded. Its padding rows attend to nothing (length 0) and write their keys
    into the cache's padding block (a graph cannot skip a slot -1). Larger batches run eagerly.
    The block-table width is dynamic. The table is cut to the blocks the longest sequence uses,
    since in a graph the attention reads keys up to its width, and to two blocks at least (dynamo
    would specialise a width of 1).
    """

    MIN_BLOCKS = 2

    def __init__(self, model, max_batch: int, kv_cache: KVCache, sampled_ids: torch.Tensor):
        self.rows = min(PackedWeight.ROWS, max_batch)
        self.block_size, self.padding_slot = kv_cache.block_size, kv_cache.padding_slot
        self.sampled_ids = sampled_ids
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
        return fill_pending(input_ids, sources, self.sampled_ids), positions, metadata

    def fits(self, batch: int) -> bool:
        return batch <= self.rows

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


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_tables: np.ndarray, use_cuda_graphs: bool,
                 compile_decode: bool = False):
        """``block_tables``: the block manager's, a row per sequence that holds blocks; as many rows as
        sequences can run at once. ``compile_decode``: CPU decode steps run compiled (``CompiledDecode``)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_tables = block_tables
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and not compile_decode:  # a compiled graph packs its own weights
            pack_for_cpu_decode(model)
        max_num_seqs, table_width = block_tables.shape
        # The last step's sampled ids stay on the device for the next step's pending inputs; on
        # their way to the host they go through two pinned buffers, used by turns.
        self.sampled_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.sampled_rows: dict[Sequence, int] = {}
        if self.device.type == "cuda":
            self.host_ids = [torch.zeros(max_num_seqs, dtype=torch.long).pin_memory() for _ in range(2)]
            self.host_ids_ready = [torch.cuda.Event() for _ in range(2)]
            self.turn = 0
        self.staging = (Staging(torch.long), Staging(torch.int32)) if self.device.type == "cuda" else None
        self.graphs = (DecodeGraphs(model, max_num_seqs, table_width, self.sampled_ids, self.device)
                       if use_cuda_graphs else None)
        self.compiled = (CompiledDecode(model, max_num_seqs, kv_cache, self.sampled_ids)
                         if compile_decode else None)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [len(sampled), vocab], in the model's dtype, for the sequences that sample this step."""
        step = StepInputs(scheduled, self.block_tables, self.kv_cache.block_size, self.sampled_rows)
        if self.graphs is not None and step.decode_only and self.graphs.fits(len(step.input_ids)):
            return self.graphs.run(step), step.sampled
        if self.compiled is not None and step.decode_only and self.compiled.fits(len(step.input_ids)):
            return self.compiled.run(step), step.sampled
        input_ids, sources, positions, metadata, logits_rows = step.to_device(self.device, self.staging)
        input_ids = fill_pending(input_ids, sources, self.sampled_ids)
        return self.model(input_ids, positions, metadata, logits_indices=logits_rows), step.sampled

    def keep_sampled(self, tokens: torch.Tensor, seqs: list[Sequence]) -> Callable[[], list[int]]:
        """Keep a step's sampled ids on the device for the next step, and start their copy to the
        host. Returns what waits for that copy and gives the ids."""
        self.sampled_ids[: len(seqs)] = tokens
        self.sampled_rows = {seq: row for row, seq in enumerate(seqs)}
        if self.device.type != "cuda":
            return tokens.tolist
        host, ready = self.host_ids[self.turn][: len(seqs)], self.host_ids_ready[self.turn]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready.record()

        def wait_for_ids() -> list[int]:
            ready.synchronize()
            return host.tolist()

        return wait_for_ids
