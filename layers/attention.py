"""Self-attention (MHA/GQA, optional q/k RMSNorm, sliding window) and the metadata its backend reads.

A forward pass works on a flat stream of N tokens from one or more sequences. The layer
computes q/k/v, applies q/k-norm and rotary, and hands them to an attention backend together
with an ``AttentionMetadata`` that says how the stream splits into sequences.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import Linear, MergedLinear
from layers.norm import RMSNorm
from ops_cuda import apply_rotary, write_kv_cache


@dataclass
class AttentionMetadata:
    """How the flat token stream of one forward splits into sequences, and where their keys live.

    Sequence i contributes ``query_lens[i]`` new tokens, after ``context_lens[i]`` tokens it
    already has in the KV cache. Sequences that prefill (a prompt or a chunk of one) come first
    in the stream, then ``num_decodes`` sequences that decode one token each. Without a cache
    (``slot_mapping`` None) every sequence is a cache-free causal prefill.
    """

    query_lens: list[int]
    context_lens: list[int] | None = None
    slot_mapping: torch.Tensor | None = None  # [N] cache slot of each new token: block * block_size + offset
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] the cache blocks of each sequence
    num_decodes: int = 0

    @classmethod
    def causal_prefill(cls, batch_size: int, seq_len: int) -> "AttentionMetadata":
        return cls(query_lens=[seq_len] * batch_size)

    @property
    def num_prefills(self) -> int:
        return len(self.query_lens) - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])


def attention_mask(query_positions: torch.Tensor, key_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean [queries, keys] mask (True = attend) for queries at absolute positions over keys 0..key_len-1.

    HuggingFace's window: key t is visible from the query at position p when p - window < t <= p.
    """
    keys = torch.arange(key_len, device=query_positions.device)[None, :]
    positions = query_positions[:, None]
    mask = keys <= positions
    if sliding_window is not None:
        mask &= keys > positions - sliding_window
    return mask


def _sdpa(q, k, v, mask, scale):
    # q: [B, Tq, Hq, D], k/v: [B, Tk, Hkv, D], mask: [B or 1, 1, Tq, Tk] or None (plain causal)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class TorchAttentionBackend:
    """Reference backend on PyTorch's SDPA over the paged cache: works on any device and is the
    oracle for faster ones."""

    name = "torch"

    def forward(self, layer: "Attention", q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]
        if metadata.slot_mapping is None:
            return self._cache_free(q, k, v, metadata, layer.scale, layer.sliding_window)
        k_cache, v_cache = layer.kv_cache
        write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        num_prefill_tokens = metadata.num_prefill_tokens
        out = [self._prefills(layer, q, k, v, metadata)] if metadata.num_prefills else []
        if metadata.num_decodes:
            out.append(self._decodes(layer, q[num_prefill_tokens:], metadata))
        return torch.cat(out) if len(out) > 1 else out[0]

    @staticmethod
    def _cache_free(q, k, v, metadata, scale, sliding_window):
        lengths = metadata.query_lens

        def attend(q, k, v):  # [B, T, H, D] sequences of equal length T
            length = q.shape[1]
            mask = None
            if sliding_window is not None and sliding_window < length:
                mask = attention_mask(torch.arange(length, device=q.device), length, sliding_window)
            return _sdpa(q, k, v, mask, scale)

        if len(set(lengths)) == 1:  # a [B, T] batch: one call
            return attend(*(t.view(len(lengths), lengths[0], *t.shape[1:]) for t in (q, k, v))).reshape(q.shape)
        return torch.cat([attend(*(t[None] for t in seq))[0] for seq in zip(q.split(lengths), k.split(lengths), v.split(lengths))])

    @staticmethod
    def _gather(cache, block_tables, length):
        # [S, max_blocks, block_size, H, D] -> [S, length, H, D]: keys 0..length-1 of each sequence
        blocks = -(-length // cache.shape[1])
        gathered = cache[block_tables[:, :blocks]]
        return gathered.reshape(gathered.shape[0], -1, *cache.shape[2:])[:, :length]

    def _prefills(self, layer, q, k, v, metadata):
        k_cache, v_cache = layer.kv_cache
        outs, start = [], 0
        for i in range(metadata.num_prefills):
            length, context = metadata.query_lens[i], metadata.context_lens[i]
            qs, ks, vs = q[start : start + length], k[start : start + length], v[start : start + length]
            if context:  # attend the cached prefix, then this chunk
                table = metadata.block_tables[i : i + 1]
                ks = torch.cat([self._gather(k_cache, table, context)[0], ks])
                vs = torch.cat([self._gather(v_cache, table, context)[0], vs])
            positions = torch.arange(context, context + length, device=q.device)
            mask = attention_mask(positions, context + length, layer.sliding_window)
            outs.append(_sdpa(qs[None], ks[None], vs[None], mask[None, None], layer.scale)[0])
            start += length
        return torch.cat(outs)

    def _decodes(self, layer, q, metadata):
        # One token per sequence: gather every sequence's keys, padded to the longest, in one call.
        k_cache, v_cache = layer.kv_cache
        rows = slice(metadata.num_prefills, None)
        seq_lens = torch.tensor(
            [c + 1 for c in metadata.context_lens[rows]], device=q.device
        )
        longest = int(seq_lens.max())
        table = metadata.block_tables[rows]
        keys, values = self._gather(k_cache, table, longest), self._gather(v_cache, table, longest)
        t = torch.arange(longest, device=q.device)[None, :]
        mask = t < seq_lens[:, None]
        if layer.sliding_window is not None:
            mask &= t > (seq_lens[:, None] - 1) - layer.sliding_window
        return _sdpa(q[:, None], keys, values, mask[:, None, None, :], layer.scale)[:, 0]


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads.

    q/k/v are one fused projection (HF's ``q_proj``/``k_proj``/``v_proj`` stacked), ``head_dim``
    is independent of ``hidden_size / num_heads``; ``qk_norm_eps`` adds per-head RMSNorm on q and k
    before rotary (Qwen3); ``sliding_window`` limits how far back a token looks (Mistral).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, [q_size, kv_size, kv_size], sources=["q_proj", "k_proj", "v_proj"], bias=qkv_bias
        )
        self.o_proj = Linear(q_size, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.backend = TorchAttentionBackend()
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the runtime

    def forward(self, hidden_states, position_embeddings, metadata: AttentionMetadata) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        out = self.backend.forward(self, q, k, v, metadata)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
