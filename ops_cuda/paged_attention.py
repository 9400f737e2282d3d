"""Attention over the paged KV cache: decode (one query per sequence) and prefill (a run of new
queries per sequence after its cached context).

The references here are the one PyTorch implementation of zoo's attention math: the ops' default
kernels, the torch attention backend, and the oracle of the Triton kernels
(``ops_cuda/paged_attention_triton.py``) that the ops run on CUDA. The triton attention backend
calls the registered ops (``paged_decode_attention_op``, ``paged_prefill_attention_op``) on every
device.

Shapes: q [tokens, Hq, D]; k/v [tokens, Hkv, D]; caches [num_blocks, block_size, Hkv, D] (views of
any layout, ``ops_cuda.kv_layout.new_kv_cache``);
block_tables [sequences, max_blocks] int32; seq_lens [sequences] int32 (cached + new tokens).
``sliding_window`` 0 means none; otherwise the query at position p sees keys t with
p - window < t <= p (HuggingFace's window). ``softcap`` 0 means none; otherwise each score
s = q.k * scale becomes softcap * tanh(s / softcap) before the mask and softmax (Gemma 2).
``sinks`` None means none; otherwise a [Hq] tensor of learned logits, one per query head, each joining
its head's softmax as one more key whose value is zero (GPT-OSS's attention sinks): every weight shrinks
by the sink's share of the mass, out = sum_t p_t v_t with p = softmax([s_1..s_T, sink])[:T].
The caches are the model's dtype or float8_e4m3fn, holding keys divided by ``k_scale`` and values
by ``v_scale`` (``ops_cuda/kv_cache.py``); the ops read them back as q's dtype times the scale.
"""

import torch
import torch.nn.functional as F

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.kv_cache import dequantize, holds_exactly
from ops_cuda.kv_layout import read_slots


def attention_mask(query_positions: torch.Tensor, key_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean [queries, keys] mask (True = attend) for queries at absolute positions over keys 0..key_len-1."""
    keys = torch.arange(key_len, device=query_positions.device)[None, :]
    positions = query_positions[:, None]
    mask = keys <= positions
    if sliding_window:
        mask &= keys > positions - sliding_window
    return mask


def attend(q, k, v, mask, scale, softcap=0.0, causal=True, sinks=None):
    """Softmax attention in heads-first layout: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], mask bool
    [B or 1, 1 or Hq, Tq, Tk] (True = attend) or None: causal, aligned at the first key, or every
    query sees every key where not ``causal`` (a vision encoder's attention). ``sinks``: one logit per
    query row, broadcastable to [B, Hq, Tq, 1] (the module docstring)."""
    grouped = q.shape[1] != k.shape[1]
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal, scale=scale,
                                              enable_gqa=grouped)
    # SDPA has no hook for the scores nor a column of its own: HuggingFace's eager attention, step by step.
    if grouped:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
    sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink_column], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def sdpa(q, k, v, mask, scale, softcap=0.0, causal=True, sinks=None):
    # q: [B, Tq, Hq, D], k/v: [B, Tk, Hkv, D], mask: [B or 1, 1, Tq, Tk] or None (causal, or none where not
    # causal), sinks: [Hq] or None
    sinks = None if sinks is None else sinks[:, None, None]
    return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, softcap, causal,
                  sinks).transpose(1, 2)


def gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[S, length, H, D]: keys (or values) 0..length-1 of each sequence, read through its block table."""
    blocks = -(-length // cache.shape[1])
    # index_select over the flattened table: several times faster than advanced indexing on CPU
    gathered = cache.index_select(0, block_tables[:, :blocks].reshape(-1).long())
    return gathered.reshape(block_tables.shape[0], -1, *cache.shape[2:])[:, :length]


def _in_graph(t: torch.Tensor) -> bool:
    # A CUDA graph being captured, or a graph torch.compile traces: no values can be read on the host.
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def decode_key_slots(block_tables, seq_lens, block_size, sliding_window):
    """Where the keys of each decoding sequence are in the flattened cache, padded to a common
    length: ([B, L] int64 slots, [B, L] bool mask of the keys each attends, and a [B, 1, 1] bool
    of the rows that attend at all, or None when all do). The same for every layer of a forward
    that shares the block size and window, so the torch backend derives it once per forward."""
    batch, num_blocks = block_tables.shape
    in_graph = _in_graph(seq_lens)
    if in_graph:  # no host sync inside a graph: pad to the whole table width
        length = num_blocks * block_size
    else:  # pad only to the longest sequence (the table may be much wider)
        length = max(int(seq_lens.max()), 1)
    t = torch.arange(length, device=seq_lens.device)
    lens = seq_lens[:, None]
    filled = t < lens
    blocks = -(-length // block_size)
    slots = block_tables[:, :blocks, None].long() * block_size + torch.arange(block_size, device=seq_lens.device)
    slots = slots.view(batch, -1)[:, :length]
    # Padding positions read the sequence's first key, which was written, and are masked out: a
    # slot past a sequence's length may hold anything (torch.empty, a freed block), even NaN,
    # which would leak through a zero attention weight.
    slots = torch.where(filled, slots, slots[:, :1])
    mask = filled & (t > lens - 1 - sliding_window) if sliding_window else filled
    attending = lens[:, :, None] > 0
    if not in_graph and bool(attending.all()):
        attending = None
    return slots, mask, attending


def decode_attention_at_slots(q, k_cache, v_cache, slots, mask, attending, scale, softcap=0.0, k_scale=1.0,
                              v_scale=1.0, sinks=None):
    # q: [B, Hq, D] -> [B, Hq, D]. All sequences in one SDPA call over the keys at their slots.
    batch, length = slots.shape
    kv_heads, head_dim = k_cache.shape[2:]

    def at_slots(cache, cache_scale):
        entries = read_slots(cache, slots.view(-1))
        return dequantize(entries, cache_scale, q.dtype).view(batch, length, kv_heads, head_dim)

    keys, values = at_slots(k_cache, k_scale), at_slots(v_cache, v_scale)
    # GQA without repeating keys: the query heads that share a KV head are that head's query rows.
    group = q.shape[1] // kv_heads
    out = attend(
        q.reshape(batch, kv_heads, group, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
        mask[:, None, None, :], scale, softcap, sinks=None if sinks is None else sinks.view(kv_heads, group, 1),
    ).reshape(q.shape)
    return out if attending is None else torch.where(attending, out, 0)  # padding rows (length 0) attend nothing


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, sliding_window: int, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (its token at position seq_len - 1); rows of length 0 give zeros."""
    # q: [B, Hq, D] -> [B, Hq, D]
    keys = decode_key_slots(block_tables, seq_lens, k_cache.shape[1], sliding_window)
    return decode_attention_at_slots(q, k_cache, v_cache, *keys, scale, softcap, k_scale, v_scale, sinks)


def paged_prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
    scale: float, sliding_window: int, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequence s has new queries q[query_start_loc[s]:query_start_loc[s + 1]] at positions
    context_s + i (context_s = seq_lens[s] - its query count); they attend its cached context and,
    causally, each other. ``max_query_len`` bounds the query counts (it sizes the CUDA grid).
    Where the cache does not hold the new tokens' k/v exactly (another dtype than q's, FP8, or a
    scale other than 1) they are read back from it, as the CUDA kernel reads them, so both round
    them alike; otherwise k/v are taken as given."""
    # q: [N, Hq, D], k/v: [N, Hkv, D] (the new tokens, already in the cache too) -> [N, Hq, D].
    # One SDPA call per sequence over its cached context followed by its new tokens.
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    read_back = not holds_exactly(k_cache, q.dtype, k_scale, v_scale)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        context = seq_len - (end - start)
        table = block_tables[i : i + 1]
        if read_back:
            ks = dequantize(gather_cache(k_cache, table, seq_len)[0], k_scale, q.dtype)
            vs = dequantize(gather_cache(v_cache, table, seq_len)[0], v_scale, q.dtype)
        else:
            ks, vs = k[start:end], v[start:end]
            if context:
                ks = torch.cat([dequantize(gather_cache(k_cache, table, context)[0], k_scale, q.dtype), ks])
                vs = torch.cat([dequantize(gather_cache(v_cache, table, context)[0], v_scale, q.dtype), vs])
        mask = attention_mask(torch.arange(context, seq_len, device=q.device), seq_len, sliding_window)
        out[start:end] = sdpa(q[None, start:end], ks[None], vs[None], mask[None, None], scale, softcap,
                              sinks=sinks)[0]
    return out


paged_decode_attention_op = torch.library.custom_op("zoo::paged_decode_attention", paged_decode_attention_reference,
                                                    mutates_args=())


@paged_decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap=0.0, k_scale=1.0, v_scale=1.0,
      sinks=None):
    return torch.empty_like(q)


@cuda_implementation(paged_decode_attention_op)
def _(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap=0.0, k_scale=1.0, v_scale=1.0,
      sinks=None):
    from ops_cuda.paged_attention_triton import paged_decode_attention_triton  # triton only where a kernel runs

    out = torch.empty_like(q)
    paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out,
                                  softcap=softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return out


paged_decode_attention = public_op(paged_decode_attention_op, paged_decode_attention_reference)


paged_prefill_attention_op = torch.library.custom_op("zoo::paged_prefill_attention", paged_prefill_attention_reference,
                                                     mutates_args=())


@paged_prefill_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window,
      softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None):
    return torch.empty_like(q)


@cuda_implementation(paged_prefill_attention_op)
def _(q, k, v, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window,
      softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None):
    from ops_cuda.paged_attention_triton import paged_prefill_attention_triton  # triton only where a kernel runs

    # The new tokens' K/V are already in the cache (the layer's rotary_write_kv wrote them): read all keys there.
    out = torch.empty_like(q)
    paged_prefill_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window, out,
        softcap=softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
    )
    return out


# The reference reads the query lengths on the host.
paged_prefill_attention = public_op(
    paged_prefill_attention_op, paged_prefill_attention_reference, reads_host=True
)
