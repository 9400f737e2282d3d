"""Multi-head latent attention (DeepSeek-V2/V3), with HuggingFace's module paths:

    q_a_proj -> q_a_layernorm -> q_b_proj     queries through a low rank (``q_lora_rank``), or one q_proj
    kv_a_proj_with_mqa                        the KV latent [kv_lora_rank] and the key's rope part [qk_rope_head_dim]
    kv_a_layernorm -> kv_b_proj               the latent decompressed to each head's key (nope part) and value
    o_proj

Each head's query is ``[q_nope | q_rope]`` and its key ``[k_nope | k_rope]``, where ``k_rope`` is one
vector per token shared by all heads. What a token keeps in a cache is its latent and ``k_rope``:
``kv_lora_rank + qk_rope_head_dim`` values for all heads together.

Attention over the latents has two forms, equal up to rounding:
- plain (prompts): K and V decompressed through ``kv_b_proj`` for every key, then ordinary attention;
- absorbed (decode): ``W_UK`` folded into the query, the scores taken against the latents
  themselves, and ``W_UV`` applied to the attended latent, so no key is ever decompressed.
"""

from collections.abc import Callable

import torch
from torch import nn

from layers.attention import AttentionMetadata, TorchAttentionBackend
from layers.linear import Linear
from layers.norm import RMSNorm
from ops_cuda import apply_rotary, rotary_write_kv
from ops_cuda.mla_attention import decompressed_attention, latent_attention
from ops_cuda.paged_attention import attention_mask

# HF builds q_a_layernorm and kv_a_layernorm with their default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention; ``scale`` multiplies the scores (HF's, YaRN's mscale included:
    the model computes it), ``rope_interleave`` rotates the rope part in DeepSeek's interleaved pairs."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rope_interleave: bool,
        bias: bool = False,
        rms_norm: Callable[[int, float], RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale, self.rope_interleave = scale, rope_interleave
        q_size = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_size)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = rms_norm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, q_size)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = rms_norm(kv_lora_rank, LATENT_NORM_EPS)
        # fp8=False: the absorbed form reads kv_b_proj.weight itself, so it stays in the model's dtype.
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), fp8=False)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        # Set through the model's bind_kv_cache: one pool, [blocks, block_size, kv_lora_rank + qk_rope_head_dim].
        self.backend = TorchAttentionBackend()
        self.kv_cache: tuple[torch.Tensor] | None = None
        self.kv_scale = 1.0  # the per-tensor scale of its cache entries: the pool holds them divided by it

    @property
    def capturable(self) -> bool:
        """Whether its paged path reads nothing on the host, so a CUDA graph or a compiled graph can
        hold it: that is up to the backend's ``attend_latent``."""
        return self.backend.latent_capturable

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One token's cache entry: its latent and rope key, [kv_lora_rank + qk_rope_head_dim], for all heads."""
        return ((self.kv_lora_rank + self.qk_rope_head_dim,),)

    def forward(self, hidden_states, position_embeddings, metadata: AttentionMetadata) -> torch.Tensor:
        n = hidden_states.shape[0]
        q_nope, q_rope, latent, k_rope = self.project(hidden_states)
        cos, sin = position_embeddings
        if metadata.slot_mapping is not None:
            # One launch for the latent's norm, the rotary and the write of latent and rope key into the pool.
            norm = self.kv_a_layernorm
            q_rope, _ = rotary_write_kv(
                q_rope, k_rope[:, None], latent[:, None], cos, sin, *self.cache_parts(), metadata.slot_mapping,
                self.kv_scale, self.kv_scale, self.rope_interleave, v_norm_weight=norm.weight, norm_eps=norm.eps,
                weight_offset=norm.weight_offset, multiply_in_float32=norm.multiply_in_float32,
            )
            out = self.backend.attend_latent(self, q_nope, q_rope, metadata)
        else:
            latent = self.kv_a_layernorm(latent.contiguous())
            q_rope, k_rope = apply_rotary(q_rope.contiguous(), k_rope.reshape(n, 1, -1), cos, sin, self.rope_interleave)
            k_rope = k_rope[:, 0]
            out, start = [], 0
            for length in metadata.query_lens:  # cache-free causal prefill of each sequence
                rows = slice(start, start + length)
                mask = attention_mask(torch.arange(length, device=hidden_states.device), length, None)
                out.append(self.plain_attention(q_nope[rows], q_rope[rows], latent[rows], k_rope[rows], mask))
                start += length
            out = torch.cat(out) if len(out) > 1 else out[0]
        return self.o_proj(out.reshape(n, self.num_heads * self.v_head_dim))

    def project(self, hidden_states):
        """hidden [N, hidden] -> q_nope [N, H, nope], q_rope [N, H, rope], latent [N, kv_lora_rank] and
        k_rope [N, rope]: views of the projections' outputs, before the latent's norm and the rotary."""
        n = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        return q_nope, q_rope, latent, k_rope

    def cache_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's rope-key and latent columns as two [blocks, block_size, 1, width] caches
        (``rotary_write_kv``'s k_cache and v_cache), one scale for both."""
        (cache,) = self.kv_cache
        return cache[:, :, None, self.kv_lora_rank :], cache[:, :, None, : self.kv_lora_rank]

    def decompress(self, latent) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [T, kv_lora_rank] -> each head's key nope part [T, H, nope] and value [T, H, v_head_dim]."""
        return self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, -1).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=-1
        )

    def absorb_query(self, q_nope) -> torch.Tensor:
        """q_nope [..., H, nope] -> [..., H, kv_lora_rank]: W_UK folded into the query, whose product
        with a latent is then its product with that latent's decompressed key."""
        w_uk = self.kv_b_proj.weight.reshape(self.num_heads, -1, self.kv_lora_rank)[:, : self.qk_nope_head_dim]
        return torch.einsum("...hn,hnr->...hr", q_nope, w_uk)

    def expand_latent(self, attended) -> torch.Tensor:
        """An attended latent [..., H, kv_lora_rank] -> [..., H, v_head_dim]: W_UV applied."""
        w_uv = self.kv_b_proj.weight.reshape(self.num_heads, -1, self.kv_lora_rank)[:, self.qk_nope_head_dim :]
        return torch.einsum("...hr,hvr->...hv", attended, w_uv)

    def plain_attention(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Queries q_nope/q_rope [Tq, H, *] over keys given by latent [Tk, kv_lora_rank] and k_rope
        [Tk, rope], mask bool [Tq, Tk] (True = attend) -> [Tq, H, v_head_dim]; K/V decompressed."""
        k_nope, v = self.decompress(latent)
        return decompressed_attention(q_nope, q_rope, k_nope, k_rope, v, mask, self.scale)

    def absorbed_attention(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """``plain_attention`` with W_UK folded into the query and W_UV applied after attending over
        the latents: the keys are never decompressed (the form of the backends' ``attend_latent``,
        which the tests compare with ``plain_attention`` through this). Takes a leading batch of
        sequences too (q [..., Tq, H, *], latent/k_rope [..., Tk, *], mask [..., Tq, Tk])."""
        attended = latent_attention(self.absorb_query(q_nope), q_rope, latent, k_rope, mask, self.scale)
        return self.expand_latent(attended)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}, rope_interleave={self.rope_interleave}")
