"""Self-attention (MHA/GQA, optional q/k norms, sliding window) and the metadata its backend reads.

A forward pass works on a flat stream of N tokens from one or more sequences. The layer
computes q/k/v, applies q/k-norm and rotary, writes the new keys and values into its paged KV
cache (with a per-head q/k-norm, rotary and the write in one op, ``rotary_write_kv``), and hands
q/k/v to an attention backend together with an ``AttentionMetadata`` that says how the stream
splits into sequences. The backend attends only.
"""

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from layers.linear import Linear, MergedLinear
from layers.norm import LayerNorm, RMSNorm
from layers.weights import Shard
from ops_cuda import apply_rotary, prompt_attention, rotary_write_kv
from ops_cuda.kv_cache import dequantize, holds_exactly
from ops_cuda.mla_attention import (
    gather_latents,
    mla_decode_attention_at_slots,
    mla_decode_attention_op,
    mla_prefill_attention_op,
)
from ops_cuda.paged_attention import (
    attention_mask,
    decode_attention_at_slots,
    decode_key_slots,
    gather_cache,
    paged_decode_attention_op,
    paged_prefill_attention_op,
    paged_prefill_attention_reference,
)


@dataclass
class AttentionMetadata:
    """How the flat token stream of one forward splits into sequences, and where their keys live.

    Sequence i contributes ``query_lens[i]`` new tokens, after ``context_lens[i]`` tokens it
    already has in the KV cache. Sequences that prefill (a prompt or a chunk of one) come first
    in the stream, then ``num_decodes`` sequences that decode one token each. Without a cache
    (``slot_mapping`` None) every sequence is a cache-free causal prefill.

    The lists live on the host (the scheduler reads them; the backends split the stream into
    prefills and decodes with them); the tensors live on the model's device, where the attention
    ops read them. Under CUDA-graph capture the tensors are views of buffers allocated once and
    rewritten in place before each replay; padding rows of a captured batch have ``seq_lens`` 0
    (their block-table rows, left from earlier steps, are never read) and slot -1 (nothing is
    written). No kernel of a step writes them: the CUDA kernels read them before waiting for the
    kernel launched just before (``begin_after_previous``).
    """

    query_lens: list[int]
    context_lens: list[int] | None = None
    slot_mapping: torch.Tensor | None = None  # [N] int64 cache slot of each new token: block * block_size + offset
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32 the cache blocks of each sequence
    num_decodes: int = 0
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32: context + new tokens of each sequence
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32: where each sequence's new tokens start
    # What a backend derives from the fields above once per forward and every layer reads (the
    # torch backend's decode key slots): a forward's metadata is built for it and not reused.
    derived: dict = field(default_factory=dict, repr=False)
    # Counted once from the lists: a compiled forward that read the lists would be specialised to
    # their length, and compiled again for every other batch size.
    num_prefills: int = field(init=False)
    num_prefill_tokens: int = field(init=False)

    def __post_init__(self):
        self.num_prefills = len(self.query_lens) - self.num_decodes
        self.num_prefill_tokens = sum(self.query_lens[: self.num_prefills])

    @classmethod
    def causal_prefill(cls, batch_size: int, seq_len: int) -> "AttentionMetadata":
        return cls(query_lens=[seq_len] * batch_size)


@dataclass(frozen=True)
class ScoreModifiers:
    """What a layer does to its attention scores ``s = q.k * scale`` besides the causal and window
    mask. Part of the attention contract: a backend lists the modifiers it implements in
    ``score_modifiers``, and ``select_backend`` falls back to one that implements what a model uses.

    ``softcap``: ``s -> softcap * tanh(s / softcap)`` (Gemma 2); 0 for none.
    ``sinks``: the layer's ``sinks`` [Hq], one learned logit per query head, joins each softmax as a
    key whose value is zero (GPT-OSS's attention sinks); False for none.
    """

    softcap: float = 0.0
    sinks: bool = False

    @property
    def used(self) -> frozenset[str]:
        return frozenset(f.name for f in fields(self) if getattr(self, f.name))


def score_modifiers_used(model: nn.Module) -> frozenset[str]:
    """The score modifiers any attention layer of ``model`` uses."""
    return frozenset().union(*(m.score_modifiers.used for m in model.modules() if isinstance(m, Attention)))


def sequence_starts(metadata: AttentionMetadata, device) -> torch.Tensor:
    """[num_seqs + 1] int32: where each sequence's new tokens start, from the metadata or, where a
    cache-free forward's metadata has none, counted from its query lengths."""
    if metadata.query_start_loc is not None:
        return metadata.query_start_loc
    return torch.tensor([0, *itertools.accumulate(metadata.query_lens)], dtype=torch.int32, device=device)


def decode_keys(metadata: AttentionMetadata, block_size: int, window: int):
    """``decode_key_slots`` of the forward's decoding sequences. Where their keys are is the same in
    every layer of a block size and window: it is derived once per forward and kept in
    ``metadata.derived`` (a CPU decode step spent a fifth of its attention time deriving it again
    in each layer)."""
    key = ("torch decode keys", block_size, window)
    if key not in metadata.derived:
        prefills = metadata.num_prefills
        metadata.derived[key] = decode_key_slots(
            metadata.block_tables[prefills:], metadata.seq_lens[prefills:], block_size, window
        )
    return metadata.derived[key]


class TorchAttentionBackend:
    """Reference backend: the PyTorch references of the paged attention ops (SDPA over keys gathered
    from the cache), and ``prompt_attention`` for prompts with nothing cached (flash attention on
    CUDA). Works on any device and is the oracle for faster ones."""

    name = "torch"
    score_modifiers = frozenset({"softcap", "sinks"})
    prefill = staticmethod(paged_prefill_attention_reference)
    # Whether MLAttention's paged path (attend_latent) reads nothing on the host, so a CUDA graph or a
    # compiled graph can hold it: not the reference's, which reads the prompts' lengths there.
    latent_capturable = False

    def forward(self, layer: "Attention", q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]. Prefill tokens first, then one per decode.
        # With a cache, the layer has written the new tokens' keys and values into it (rotary_write_kv).
        softcap, window, sinks = layer.score_modifiers.softcap, layer.sliding_window or 0, layer.sinks
        if metadata.slot_mapping is None:  # no cache: every sequence is a prompt of new tokens
            return prompt_attention(q, k, v, sequence_starts(metadata, q.device), max(metadata.query_lens),
                                    layer.scale, window, softcap, sinks)
        k_cache, v_cache = layer.kv_cache
        k_scale, v_scale = layer.k_scale, layer.v_scale
        prefills, tokens = metadata.num_prefills, metadata.num_prefill_tokens
        out = []
        if prefills:
            args = (q[:tokens], k[:tokens], v[:tokens])
            starts, longest = metadata.query_start_loc[: prefills + 1], max(metadata.query_lens[:prefills])
            # Prompts with nothing cached yet, over a cache that holds their k/v exactly (q's dtype,
            # scale 1.0), attend the k/v they have rather than read them back from the cache.
            new = metadata.context_lens is not None and not any(metadata.context_lens[:prefills])
            if new and holds_exactly(k_cache, q.dtype, k_scale, v_scale):
                out.append(prompt_attention(*args, starts, longest, layer.scale, window, softcap, sinks))
            else:
                out.append(self.prefill(*args, k_cache, v_cache, metadata.block_tables[:prefills],
                                        metadata.seq_lens[:prefills], starts, longest, layer.scale, window, softcap,
                                        k_scale, v_scale, sinks))
        if tokens < q.shape[0]:  # decodes follow; a shape, which a compiled graph leaves dynamic
            out.append(self.attend_decodes(q[tokens:], k_cache, v_cache, metadata, layer.scale, window, softcap,
                                           k_scale, v_scale, sinks))
        return torch.cat(out) if len(out) > 1 else out[0]

    def attend_latent(self, layer, q_nope, q_rope, metadata: AttentionMetadata) -> torch.Tensor:
        """Multi-head latent attention (``layers.mla.MLAttention``) over its paged latent cache, which
        already holds the new tokens' latents and rope keys (the layer wrote them, ``rotary_write_kv``):
        prefill rows take the plain form over their sequence's cached latents (``prefill_latent``),
        decode rows the absorbed form (``decode_latent``). -> [N, H, v_head_dim]."""
        (cache,) = layer.kv_cache  # [num_blocks, block_size, kv_lora_rank + rope]
        tokens = metadata.num_prefill_tokens
        out = []
        if metadata.num_prefills:
            out.append(self.prefill_latent(layer, q_nope[:tokens], q_rope[:tokens], cache, metadata))
        if tokens < q_nope.shape[0]:
            attended = self.decode_latent(layer.absorb_query(q_nope[tokens:]), q_rope[tokens:], cache, metadata,
                                          layer.scale, layer.kv_scale)
            out.append(layer.expand_latent(attended))
        return torch.cat(out) if len(out) > 1 else out[0]

    def prefill_latent(self, layer, q_nope, q_rope, cache, metadata: AttentionMetadata) -> torch.Tensor:
        # The new tokens at positions context..seq_len-1 of each prompt, over all its seq_len cached entries.
        rank, out = layer.kv_lora_rank, []
        prefills = metadata.num_prefills
        starts, seq_lens = metadata.query_start_loc[: prefills + 1].tolist(), metadata.seq_lens[:prefills].tolist()
        for i, seq_len in enumerate(seq_lens):
            rows = slice(starts[i], starts[i + 1])
            entries = dequantize(gather_cache(cache, metadata.block_tables[i : i + 1], seq_len)[0], layer.kv_scale,
                                 q_nope.dtype)
            mask = attention_mask(torch.arange(seq_len - (rows.stop - rows.start), seq_len, device=cache.device),
                                  seq_len, None)
            out.append(layer.plain_attention(q_nope[rows], q_rope[rows], entries[:, :rank], entries[:, rank:], mask))
        return torch.cat(out) if len(out) > 1 else out[0]

    def decode_latent(self, q_latent, q_rope, cache, metadata: AttentionMetadata, scale, kv_scale) -> torch.Tensor:
        # mla_decode_attention_reference in two parts: where the keys are, then attention at them.
        return mla_decode_attention_at_slots(q_latent, q_rope, cache, *decode_keys(metadata, cache.shape[1], 0), scale,
                                             kv_scale)

    def attend_decodes(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, window, softcap, k_scale,
                       v_scale, sinks) -> torch.Tensor:
        # paged_decode_attention_reference in two parts: where the keys are, then attention at them.
        return decode_attention_at_slots(q, k_cache, v_cache, *decode_keys(metadata, k_cache.shape[1], window),
                                         scale, softcap, k_scale, v_scale, sinks)


class TritonAttentionBackend(TorchAttentionBackend):
    """The fast GPU backend: the registered paged attention ops on any device, whose CUDA kernels
    are Triton (split-KV flash-decoding, tiled flash-attention prefill); without a cache,
    ``zoo::prompt_attention`` (flash attention's variable-length form)."""

    name = "triton"
    prefill = staticmethod(paged_prefill_attention_op)
    decode = staticmethod(paged_decode_attention_op)
    latent_prefill = staticmethod(mla_prefill_attention_op)
    latent_decode = staticmethod(mla_decode_attention_op)
    latent_capturable = True  # its latent path reads the host's lists (the prompts' lengths), never the device

    def attend_decodes(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale, window, softcap, k_scale,
                       v_scale, sinks) -> torch.Tensor:
        prefills = metadata.num_prefills
        return self.decode(
            q, k_cache, v_cache, metadata.block_tables[prefills:], metadata.seq_lens[prefills:], scale, window, softcap,
            k_scale, v_scale, sinks,
        )

    def prefill_latent(self, layer, q_nope, q_rope, cache, metadata: AttentionMetadata) -> torch.Tensor:
        # All prompts at once: their cache entries gathered on the device into one run of keys,
        # decompressed by one kv_b_proj product, then one ragged causal attention.
        prefills = metadata.num_prefills
        if metadata.context_lens is None:
            raise ValueError("the triton backend's latent prefill needs metadata.context_lens (the prompts' cached "
                             "token counts) to size its gather on the host")
        num_keys = sum(metadata.context_lens[:prefills]) + metadata.num_prefill_tokens
        entries, key_start_loc = gather_latents(cache, metadata.block_tables[:prefills], metadata.seq_lens[:prefills],
                                                num_keys)
        rank = layer.kv_lora_rank
        entries = dequantize(entries, layer.kv_scale, q_nope.dtype)
        k_nope, v = layer.decompress(entries[:, :rank])
        query_lens = metadata.query_lens[:prefills]
        return self.latent_prefill(
            q_nope, q_rope, k_nope, entries[:, rank:], v, metadata.query_start_loc[: prefills + 1], key_start_loc,
            max(query_lens), max(c + q for c, q in zip(metadata.context_lens[:prefills], query_lens)), layer.scale,
        )

    def decode_latent(self, q_latent, q_rope, cache, metadata: AttentionMetadata, scale, kv_scale) -> torch.Tensor:
        prefills = metadata.num_prefills
        return self.latent_decode(q_latent, q_rope, cache, metadata.block_tables[prefills:],
                                  metadata.seq_lens[prefills:], scale, kv_scale)


BACKENDS = {backend.name: backend for backend in (TorchAttentionBackend, TritonAttentionBackend)}


def select_backend(name: str | None, device, score_modifiers: frozenset[str] = frozenset()) -> TorchAttentionBackend:
    """The attention backend called ``name``; None picks triton on CUDA when triton imports, else torch.
    Where it lacks one of the ``score_modifiers`` a model uses (``score_modifiers_used``), the torch
    backend, which implements them all, with a warning."""
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" and _triton_imports() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    missing = score_modifiers - BACKENDS[name].score_modifiers
    if missing:
        warnings.warn(f"the {name} attention backend does not implement the score modifiers "
                      f"{', '.join(sorted(missing))} this model uses; it runs on the torch backend")
        return TorchAttentionBackend()
    return BACKENDS[name]()


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Where a layer's rotation rounds, as its HF model computes it: "activations" (Llama's): cos and sin
# rounded to q's dtype, each product and sum rounded as q's dtype; "float32" (Cohere's): cos and sin
# rounded to q's dtype, the products and sums in float32, rounded once; "float32_tables" (OLMo 2's,
# OLMo 3's): cos and sin kept in float32, the products and sums in float32, rounded once.
ROTARY_PRECISIONS = frozenset({"activations", "float32", "float32_tables"})


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads.

    q/k/v are one fused projection (HF's ``q_proj``/``k_proj``/``v_proj`` stacked), ``head_dim``
    is independent of ``hidden_size / num_heads``; ``scale`` multiplies the scores (by default
    ``head_dim**-0.5``); ``qk_norm_eps`` adds a norm on q and k before rotary, built by ``qk_norm``
    (the model's RMSNorm variant, or LayerNorm): over each head with one weight for all heads
    (Qwen3), with ``qk_norm_weight_per_head`` a weight of its own for each head (Cohere's
    LayerNorm), or, with ``qk_norm_per_head`` False, over the whole projection (OLMo 2);
    ``clip_qkv`` clamps q, k and v to ``[-clip_qkv, clip_qkv]`` after the projection and a
    whole-projection norm, before rotary (OLMoE's); ``rope_interleaved`` rotates the channel pairs
    (2i, 2i+1) instead of (i, i + rotary_dim/2) (Cohere); ``rotary_precision`` is where the rotation
    rounds (``ROTARY_PRECISIONS``); ``sliding_window`` limits how far back a token looks (Mistral);
    ``logit_softcap`` soft-caps the scores and ``sinks`` gives each query head a learned logit in
    its softmax, the parameter ``sinks`` (see ``ScoreModifiers``); ``rotary`` False makes a layer
    without position embedding (NoPE, SmolLM3's): it rotates none of q's and k's channels, handing
    the rotary ops zero-width cos/sin, so the KV-cache write stays in ``rotary_write_kv``.

    A subclass declares its q/k norms' HF module names in ``qk_norm_names`` (StableLM's
    ``q_layernorm``, ``k_layernorm``); ``qk_norms`` returns them, None where the layer has none.
    """

    capturable = True  # the Triton backend's paged ops read nothing on the host (see CausalLM.capturable)
    qk_norm_names = ("q_norm", "k_norm")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_per_head: bool = True,
        qk_norm_weight_per_head: bool = False,
        qk_norm: Callable[..., RMSNorm | LayerNorm] = RMSNorm,
        rope_interleaved: bool = False,
        rotary_precision: str = "activations",
        sliding_window: int | None = None,
        scale: float | None = None,
        logit_softcap: float | None = None,
        rotary: bool = True,
        clip_qkv: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        if rotary_precision not in ROTARY_PRECISIONS:
            raise ValueError(f"rotary_precision {rotary_precision!r}; one of {sorted(ROTARY_PRECISIONS)}")
        if clip_qkv is not None and qk_norm_eps is not None and qk_norm_per_head:
            # A per-head norm runs inside rotary_write_kv, after where the clamp is.
            raise ValueError("clip_qkv after a per-head q/k norm is not implemented")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.score_modifiers = ScoreModifiers(softcap=logit_softcap or 0.0, sinks=sinks)
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.sink_heads: slice | None = None  # the query heads whose sinks a tensor-parallel rank holds
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, [q_size, kv_size, kv_size], sources=["q_proj", "k_proj", "v_proj"], bias=qkv_bias
        )
        self.o_proj = Linear(q_size, hidden_size, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        self.qk_norm_weight_per_head = qk_norm_weight_per_head
        self.clip_qkv = clip_qkv
        self.rope_interleaved, self.rotary_precision = rope_interleaved, rotary_precision
        norms = (None, None)
        if qk_norm_eps is not None:
            if not qk_norm_per_head:
                q_shape, k_shape = q_size, kv_size
            elif qk_norm_weight_per_head:
                q_shape, k_shape = (num_heads, head_dim), (num_kv_heads, head_dim)
            else:
                q_shape = k_shape = head_dim
            norms = (qk_norm(q_shape, qk_norm_eps), qk_norm(k_shape, qk_norm_eps))
            if qk_norm_weight_per_head and not (qk_norm_per_head and isinstance(norms[0], LayerNorm)):
                # the one norm with a weight per head that the layer, its tensor-parallel split and
                # the loader know: a LayerNorm over each head
                raise ValueError("q/k norms with a weight of their own per head are LayerNorms over each head")
        for name, norm in zip(self.qk_norm_names, norms):
            self.add_module(name, norm)
        # Set through the model's bind_kv_cache: one pool per entry of kv_cache_shapes, [blocks, block_size, *shape].
        self.backend = TorchAttentionBackend()
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # The per-tensor scales of its cached keys and values: the cache holds k / k_scale and v / v_scale.
        self.k_scale = self.v_scale = 1.0

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        """The rank's part of the sinks, where tensor parallelism split the heads; else the one tensor."""
        if self.sink_heads is None:
            return {}
        return {"sinks": [Shard(f"{prefix}.sinks", (), (self.sink_heads,))]}

    @property
    def qk_norms(self) -> tuple[RMSNorm | LayerNorm | None, RMSNorm | LayerNorm | None]:
        """q's norm and k's, under their ``qk_norm_names``."""
        return tuple(getattr(self, name) for name in self.qk_norm_names)

    def per_head_norm(self) -> dict:
        """``rotary_write_kv``'s norm arguments: the q and k norms' weights and their shared
        RMSNorm options where they are RMSNorms of each head with one weight for all heads; none
        otherwise (the layer applies other norms itself)."""
        q_norm, k_norm = self.qk_norms
        if not (isinstance(q_norm, RMSNorm) and self.qk_norm_per_head):
            return {}
        return dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps,
                    weight_offset=q_norm.weight_offset, multiply_in_float32=q_norm.multiply_in_float32)

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What this layer keeps in the paged KV cache for one token: K and V, [kv_heads, head_dim] each."""
        return ((self.num_kv_heads, self.head_dim),) * 2

    def forward(self, hidden_states, position_embeddings, metadata: AttentionMetadata) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q_norm, k_norm = self.qk_norms
        if q_norm is not None and not self.qk_norm_per_head:
            q, k = q_norm(q), k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        if not self.rotary:
            cos, sin = cos[:, :0], sin[:, :0]
        elif self.rotary_precision == "float32":  # the tables as the activations' dtype holds them
            cos, sin = cos.to(q.dtype).float(), sin.to(q.dtype).float()
        rotate_in_float32 = self.rotary_precision != "activations"
        # Through the cache, one launch for a per-head RMSNorm of q/k, rotary and the cache write.
        fused_norm = self.per_head_norm() if metadata.slot_mapping is not None else {}
        if q_norm is not None and self.qk_norm_per_head and not fused_norm:
            q, k = q_norm(q), k_norm(k)
        if metadata.slot_mapping is None:  # cache-free: nothing to write
            q, k = apply_rotary(q, k, cos, sin, self.rope_interleaved, rotate_in_float32)
        else:
            q, k = rotary_write_kv(q, k, v, cos, sin, *self.kv_cache, metadata.slot_mapping, self.k_scale,
                                   self.v_scale, self.rope_interleaved, rotate_in_float32=rotate_in_float32,
                                   **fused_norm)
        out = self.backend.forward(self, q, k, v, metadata)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
