"""Multi-head latent attention (``layers.mla.MLAttention``) over its paged latent cache.

The cache is one pool [num_blocks, block_size, kv_lora_rank + rope] per layer: each token's latent
followed by its rope key, shared by all heads, found through the same block tables as any paged
cache. Two ops attend over it:

- ``mla_decode_attention``: one query per sequence in the absorbed form. The query arrives with
  ``W_UK`` folded in (q_latent [B, H, kv_lora_rank]) beside its rope part (q_rope [B, H, rope]);
  the scores are q_latent . latent + q_rope . k_rope, the values the latents themselves, and the
  result is the attended latent [B, H, kv_lora_rank] (the layer applies ``W_UV`` after).
- ``mla_prefill_attention``: new prompt tokens in the plain form, over keys and values already
  decompressed (``kv_b_proj``) from their sequences' latents: per-head k_nope and v, one k_rope
  per token shared by all heads. Sequences lie one after another in both the queries and the keys
  (``query_start_loc``, ``key_start_loc``); a sequence's queries are its last keys' tokens and
  attend its keys causally. The qk head dim (nope + rope) and the v head dim may differ. On CUDA
  it runs flash attention's variable-length form where that takes the heads (16-bit, one head dim
  for q/k and v, at most 256, in multiples of 8: GLM-4.7-Flash's 256, 1.4x the Triton kernel's
  speed there), the Triton kernel otherwise (DeepSeek-V3's 192 and 128: v zero-padded to 192, flash
  took 1.8x the Triton kernel's time; ``benchmarks/bench_mla.py``).

``gather_latents`` reads the prompts' cache entries into such a run of keys on the device.
The pool is the model's dtype or float8_e4m3fn, holding the entries divided by one per-tensor
``kv_scale`` (``ops_cuda/kv_cache.py``): decode reads them back times the scale, and the prompt
path dequantises the gathered entries before ``kv_b_proj`` decompresses them.
The references here are the math of the layer's two forms (``latent_attention`` and
``decompressed_attention``) and the oracle of the Triton kernels (``ops_cuda/mla_attention_triton.py``)
that the ops run on CUDA.
"""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.kv_cache import dequantize
from ops_cuda.paged_attention import attention_mask, decode_key_slots, sdpa
from ops_cuda.prompt_attention import takes_flash


def latent_attention(q_latent, q_rope, latent, k_rope, mask, scale) -> torch.Tensor:
    """The absorbed form's attention: q_latent [..., Tq, H, rank] and q_rope [..., Tq, H, rope]
    over keys latent [..., Tk, rank] and k_rope [..., Tk, rope], mask bool [..., Tq, Tk] (True =
    attend) -> the attended latent [..., Tq, H, rank]."""
    scores = torch.einsum("...thr,...sr->...hts", q_latent, latent) + torch.einsum(
        "...thd,...sd->...hts", q_rope, k_rope
    )
    scores = (scores * scale).masked_fill(~mask.unsqueeze(-3), float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(latent.dtype)
    return torch.einsum("...hts,...sr->...thr", probs, latent)


def whole_heads(q_nope, q_rope, k_nope, k_rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain form's q [Tq, H, nope + rope] and k [Tk, H, nope + rope]: each head's parts joined, the
    rope key of a token (k_rope [Tk, rope], shared by the heads) repeated for every head."""
    return (torch.cat((q_nope, q_rope), dim=-1),
            torch.cat((k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1)), dim=-1))


def decompressed_attention(q_nope, q_rope, k_nope, k_rope, v, mask, scale) -> torch.Tensor:
    """The plain form's attention: queries q_nope/q_rope [Tq, H, *] over keys k_nope [Tk, H, nope]
    and k_rope [Tk, rope] (one per token, shared by the heads), values v [Tk, H, v_dim], mask bool
    [Tq, Tk] (True = attend) -> [Tq, H, v_dim]."""
    q, k = whole_heads(q_nope, q_rope, k_nope, k_rope)
    return sdpa(q[None], k[None], v[None], mask[None, None], scale)[0]


def gather_latents(cache, block_tables, seq_lens, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache entries of sequences 0..S-1, positions 0..seq_len-1 each, one sequence after another:
    ([num_keys, kv_lora_rank + rope] entries, [S + 1] int32 ``key_start_loc``). ``num_keys`` is the sum
    of ``seq_lens``, given from the host so nothing is read back from the device."""
    block_size = cache.shape[1]
    ends = seq_lens.cumsum(0)
    key_start_loc = F.pad(ends, (1, 0)).to(torch.int32)
    sequence = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=cache.device), seq_lens.long(),
                                       output_size=num_keys)
    position = torch.arange(num_keys, device=cache.device) - key_start_loc[sequence]
    slots = block_tables[sequence, position // block_size].long() * block_size + position % block_size
    return cache.view(-1, cache.shape[-1]).index_select(0, slots), key_start_loc


def mla_decode_attention_at_slots(q_latent, q_rope, cache, slots, mask, attending, scale,
                                  kv_scale=1.0) -> torch.Tensor:
    """``mla_decode_attention_reference`` at keys already located (``decode_key_slots``): the torch
    attention backend derives those once per forward for all layers."""
    rank = q_latent.shape[-1]
    entries = cache.view(-1, cache.shape[-1]).index_select(0, slots.view(-1)).view(*slots.shape, -1)
    entries = dequantize(entries, kv_scale, q_latent.dtype)
    out = latent_attention(q_latent[:, None], q_rope[:, None], entries[..., :rank], entries[..., rank:],
                           mask[:, None, :], scale)[:, 0]
    return out if attending is None else torch.where(attending, out, 0)  # padding rows (length 0) attend nothing


def mla_decode_attention_reference(
    q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, kv_scale: float = 1.0,
) -> torch.Tensor:
    """One query per sequence (its token at position seq_len - 1) over the sequence's cache entries:
    q_latent [B, H, rank], q_rope [B, H, rope], cache [num_blocks, block_size, rank + rope],
    block_tables [B, max_blocks] int32, seq_lens [B] int32 -> the attended latent [B, H, rank];
    rows of length 0 give zeros. The entries are read as q's dtype times ``kv_scale``."""
    keys = decode_key_slots(block_tables, seq_lens, cache.shape[1], 0)
    return mla_decode_attention_at_slots(q_latent, q_rope, cache, *keys, scale, kv_scale)


def mla_prefill_attention_reference(
    q_nope: torch.Tensor, q_rope: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
    query_start_loc: torch.Tensor, key_start_loc: torch.Tensor, max_query_len: int, max_key_len: int, scale: float,
) -> torch.Tensor:
    """Sequence s has queries q[query_start_loc[s]:query_start_loc[s + 1]] and keys
    k[key_start_loc[s]:key_start_loc[s + 1]]; its queries are the tokens of its last keys and attend
    its keys causally. q_nope [N, H, nope], q_rope [N, H, rope], k_nope [K, H, nope], k_rope [K, rope],
    v [K, H, v_dim] -> [N, H, v_dim]. ``max_query_len`` and ``max_key_len`` bound the query and key
    counts (they size the CUDA kernels' launches)."""
    out = q_nope.new_empty(*q_nope.shape[:2], v.shape[-1])
    query_starts, key_starts = query_start_loc.tolist(), key_start_loc.tolist()
    for s in range(len(query_starts) - 1):
        rows, keys = slice(*query_starts[s : s + 2]), slice(*key_starts[s : s + 2])
        num_keys = keys.stop - keys.start
        mask = attention_mask(torch.arange(num_keys - (rows.stop - rows.start), num_keys, device=q_nope.device),
                              num_keys, None)
        out[rows] = decompressed_attention(q_nope[rows], q_rope[rows], k_nope[keys], k_rope[keys], v[keys], mask,
                                           scale)
    return out


mla_decode_attention_op = torch.library.custom_op("zoo::mla_decode_attention", mla_decode_attention_reference,
                                                  mutates_args=())


@mla_decode_attention_op.register_fake
def _(q_latent, q_rope, cache, block_tables, seq_lens, scale, kv_scale=1.0):
    return torch.empty_like(q_latent)


@cuda_implementation(mla_decode_attention_op)
def _(q_latent, q_rope, cache, block_tables, seq_lens, scale, kv_scale=1.0):
    from ops_cuda.mla_attention_triton import mla_decode_attention_triton  # triton only where a kernel runs

    out = torch.empty_like(q_latent)
    mla_decode_attention_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale, out, kv_scale=kv_scale)
    return out


mla_decode_attention = public_op(mla_decode_attention_op, mla_decode_attention_reference)


mla_prefill_attention_op = torch.library.custom_op("zoo::mla_prefill_attention", mla_prefill_attention_reference,
                                                   mutates_args=())


@mla_prefill_attention_op.register_fake
def _(q_nope, q_rope, k_nope, k_rope, v, query_start_loc, key_start_loc, max_query_len, max_key_len, scale):
    return q_nope.new_empty(*q_nope.shape[:2], v.shape[-1])


def prefill_takes_flash(q_nope: torch.Tensor, q_rope: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the CUDA prefill runs flash attention on these heads (the module docstring)."""
    qk_dim = q_nope.shape[-1] + q_rope.shape[-1]
    return v.shape[-1] == qk_dim and takes_flash(v, 0.0)


@cuda_implementation(mla_prefill_attention_op)
def _(q_nope, q_rope, k_nope, k_rope, v, query_start_loc, key_start_loc, max_query_len, max_key_len, scale):
    from ops_cuda.mla_attention_triton import mla_prefill_attention_triton  # triton only where a kernel runs

    if prefill_takes_flash(q_nope, q_rope, v):
        q, k = whole_heads(q_nope, q_rope, k_nope, k_rope)
        # Flash's causal mask aligns the queries with the last keys, as a prompt after its cached context.
        out, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, query_start_loc, key_start_loc, max_query_len, max_key_len, 0.0, True, False, scale=scale,
        )
        return out
    out = q_nope.new_empty(*q_nope.shape[:2], v.shape[-1])
    mla_prefill_attention_triton(q_nope, q_rope, k_nope, k_rope, v, query_start_loc, key_start_loc, max_query_len,
                                 scale, out)
    return out


# The reference reads the sequences' query and key counts on the host.
mla_prefill_attention = public_op(mla_prefill_attention_op, mla_prefill_attention_reference, reads_host=True)
