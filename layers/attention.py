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
from ops_cuda import apply_rotary


@dataclass
class AttentionMetadata:
    """How the flat token stream of one forward splits into sequences.

    ``query_lens[i]`` tokens of sequence i follow those of sequence i-1 in the stream.
    """

    query_lens: list[int]

    @classmethod
    def causal_prefill(cls, batch_size: int, seq_len: int) -> "AttentionMetadata":
        return cls(query_lens=[seq_len] * batch_size)


def causal_mask(length: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Boolean [length, length] mask (True = attend); None when plain causal suffices."""
    if sliding_window is None or sliding_window >= length:
        return None
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    # HuggingFace's window: key j is visible from query i when i - window < j <= i.
    return (k <= q) & (k > q - sliding_window)


class TorchAttentionBackend:
    """Reference backend on PyTorch's SDPA: works on any device and is the oracle for faster ones."""

    name = "torch"

    def forward(self, q, k, v, metadata: AttentionMetadata, scale: float, sliding_window: int | None):
        # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]
        lengths = metadata.query_lens
        if len(set(lengths)) == 1:  # equal lengths: one batched call
            batch, length = len(lengths), lengths[0]
            out = self._sequences(
                *(t.view(batch, length, *t.shape[1:]) for t in (q, k, v)), scale, sliding_window
            )
            return out.reshape(q.shape)
        outs = [
            self._sequences(qs[None], ks[None], vs[None], scale, sliding_window)[0]
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return torch.cat(outs)

    @staticmethod
    def _sequences(q, k, v, scale, sliding_window):
        # [B, T, H, D] causal attention of each sequence over itself
        length = q.shape[1]
        mask = causal_mask(length, sliding_window, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


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
        out = self.backend.forward(q, k, v, metadata, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
