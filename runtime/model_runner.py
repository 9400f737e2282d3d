"""Runs the model on a scheduled step: the KV cache pools, the flat batch and its metadata, and
the CUDA graphs that replay decode steps."""

import numpy as np
import torch

from layers import Attention, AttentionMetadata
from runtime.scheduler import is_decode
from runtime.sequence import Sequence


class KVCache:
    """One pool of fixed-size blocks per attention layer: [num_blocks, block_size, kv_heads, head_dim] for K and V."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.pools = []
        for layer in self.layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            pool = (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            layer.kv_cache = pool
            self.pools.append(pool)

    @staticmethod
    def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        per_token = sum(2 * m.num_kv_heads * m.head_dim for m in model.modules() if isinstance(m, Attention))
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class StepInputs:
    """The flat batch of one step as host lists; ``to_device`` turns it into the model's arguments."""

    def __init__(self, scheduled: list[tuple[Sequence, int]], block_size: int, table_width: int):
        self.input_ids, self.positions, self.slots, self.logits_rows = [], [], [], []
        self.query_lens, self.context_lens, self.sampled = [], [], []
        for seq, count in scheduled:
            start = seq.num_computed_tokens
            span = range(start, start + count)
            self.input_ids.extend(seq.token_ids[start : start + count])
            self.positions.extend(span)
            self.slots.extend(seq.block_table[p // block_size] * block_size + p % block_size for p in span)
            self.query_lens.append(count)
            self.context_lens.append(start)
            if start + count == seq.num_tokens:
                self.logits_rows.append(len(self.input_ids) - 1)
                self.sampled.append(seq)
        # One fixed table width for every step: kernels see the same shapes eagerly and in graphs.
        self.block_tables = np.zeros((len(scheduled), table_width), dtype=np.int32)
        for row, (seq, _) in zip(self.block_tables, scheduled):
            row[: len(seq.block_table)] = seq.block_table
        self.seq_lens = [c + q for c, q in zip(self.context_lens, self.query_lens)]
        self.num_decodes = sum(1 for item in scheduled if is_decode(*item))

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)

    def to_device(self, device):
        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        starts = [0]
        for count in self.query_lens:
            starts.append(starts[-1] + count)
        metadata = AttentionMetadata(
            query_lens=self.query_lens, context_lens=self.context_lens, slot_mapping=tensor(self.slots),
            block_tables=torch.from_numpy(self.block_tables).to(device), num_decodes=self.num_decodes,
            seq_lens=tensor(self.seq_lens, torch.int32), query_start_loc=tensor(starts, torch.int32),
        )
        return tensor(self.input_ids), tensor(self.positions), metadata, tensor(self.logits_rows)


class DecodeGraphs:
    """Decode steps captured as CUDA graphs for batch sizes 1, 2, 4, 8, 16, 32, ... up to ``max_batch``.

    A step of n decodes replays the smallest graph of at least n rows; the inputs and metadata
    live in buffers allocated once and rewritten in place, padding rows write nothing and read
    nothing (slot -1, length 0).
    """

    def __init__(self, model, max_batch: int, table_width: int, device: torch.device):
        self.model = model
        sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
        self.sizes = sorted({min(size, max_batch) for size in sizes})
        largest = self.sizes[-1]

        def buffer(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.slots = buffer(largest), buffer(largest), buffer(largest)
        self.seq_lens = buffer(largest, dtype=torch.int32)
        self.block_tables = buffer(largest, table_width, dtype=torch.int32)
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
        return self.input_ids[:size], self.positions[:size], metadata

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
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor(step.input_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(step.positions + [0] * pad), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(step.slots + [-1] * pad), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(step.seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n].copy_(torch.from_numpy(step.block_tables), non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:n]


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, max_num_seqs: int, max_model_len: int, use_cuda_graphs: bool):
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.table_width = -(-max_model_len // kv_cache.block_size)
        self.graphs = DecodeGraphs(model, max_num_seqs, self.table_width, self.device) if use_cuda_graphs else None

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Float32 logits [len(sampled), vocab] for the sequences that sample this step."""
        step = StepInputs(scheduled, self.kv_cache.block_size, self.table_width)
        if self.graphs is not None and step.decode_only and self.graphs.fits(len(step.input_ids)):
            return self.graphs.run(step).float(), step.sampled
        input_ids, positions, metadata, logits_rows = step.to_device(self.device)
        logits = self.model(input_ids, positions, metadata, logits_indices=logits_rows)
        return logits.float(), step.sampled
