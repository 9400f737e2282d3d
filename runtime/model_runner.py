"""Runs the model on a scheduled step: the KV cache pools, the flat batch and its metadata."""

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


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Flat input ids, positions and metadata for the step, and the row of each sequence whose
        last scheduled token is its last known one (it samples a next token)."""
        block_size = self.kv_cache.block_size
        input_ids, positions, slots, logits_rows, sampled = [], [], [], [], []
        query_lens, context_lens = [], []
        for seq, count in scheduled:
            start = seq.num_computed_tokens
            span = range(start, start + count)
            input_ids.extend(seq.token_ids[start : start + count])
            positions.extend(span)
            slots.extend(seq.block_table[p // block_size] * block_size + p % block_size for p in span)
            query_lens.append(count)
            context_lens.append(start)
            if start + count == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(seq.block_table) for seq, _ in scheduled)
        block_tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in scheduled]
        num_decodes = sum(1 for item in scheduled if is_decode(*item))

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=self.device)

        metadata = AttentionMetadata(
            query_lens=query_lens, context_lens=context_lens, slot_mapping=tensor(slots),
            block_tables=tensor(block_tables), num_decodes=num_decodes,
        )
        return tensor(input_ids), tensor(positions), metadata, tensor(logits_rows), sampled

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Float32 logits [len(sampled), vocab] for the sequences that sample this step."""
        input_ids, positions, metadata, logits_rows, sampled = self.prepare(scheduled)
        logits = self.model(input_ids, positions, metadata, logits_indices=logits_rows)
        return logits.float(), sampled
