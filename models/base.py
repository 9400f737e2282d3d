"""Base classes shared by decoder-only models, with HuggingFace's module paths:

    model.embed_tokens, model.layers.{i}.{self_attn, mlp, <the block's norms>}, model.norm,
    model.rotary_emb, lm_head

An architecture file subclasses these and states only what its blocks are made of, as declarations:
the attention and MLP modules (the MLP under HF's name for it, ``DecoderLayer.mlp_name``, and a
shared MLP beside it, ``DecoderLayer``'s ``shared_mlp``), the block's norm slots under HF's names
(``NormSlots``), the model's norm (``DecoderLayer.norm_layer``: an RMSNorm variant or LayerNorm) and
the config field of its epsilon (``norm_eps_field``, or ``norm_eps`` where HF fixes the number), a
scale of each branch's output (``DecoderLayer``'s ``branch_scale``), attention and the MLP side by
side (``DecoderLayer``'s ``parallel``), embedding scaling (``CausalLM.scale_embeddings``), the config
field that multiplies the input (``CausalLM.input_multiplier_field``) and the one that scales the
logits, with its operation (``CausalLM.logits_scale``), the one that gives the LM head a bias
(``CausalLM.lm_head_bias_field``), partial rotary (``CausalLM.partial_rotary``).
"""

import contextlib
import itertools
import warnings
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
from torch import nn

from layers import (Attention, AttentionMetadata, GatedMLP, LayerNorm, LMHead, MLAttention, RMSNorm,
                    RotaryEmbedding, SparseMoE, VocabEmbedding, rope_layer_types)
from layers.norm import RowProduct, new_norm_stats
from layers.parallel import RowParallelLinear


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_window(config, layer_idx: int) -> int | None:
    """The layer's attention window where ``config.layer_types`` marks it ``"sliding_attention"``
    (Ministral, CWM, Qwen2, Qwen3, Qwen2-MoE, Gemma 2, VaultGemma, Gemma 3, OLMo 3, SmolLM3). Each
    architecture reads its window as HF's does: Mistral, Mixtral and Qwen3-MoE put
    ``config.sliding_window`` on every layer; Llama, Gemma, OLMo 2 and OLMoE read none."""
    layer_types = getattr(config, "layer_types", None)
    return config.sliding_window if layer_types is not None and layer_types[layer_idx] == "sliding_attention" else None


def attention_shape(config, sliding_window: int | None = None) -> dict:
    """The arguments of ``layers.Attention`` every HF decoder config spells the same way, and the
    layer's window (as its architecture reads it)."""
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim(config),
        sliding_window=sliding_window,
    )


@dataclass(frozen=True)
class NormSlots:
    """The norms of a decoder block by where they sit, each with HuggingFace's module name, None
    where the block has none. The default is Llama's pre-norm block (whose
    ``post_attention_layernorm`` is the norm before the MLP)."""

    pre_attention: str | None = "input_layernorm"
    post_attention: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None

    def __post_init__(self):
        names = [name for name in astuple(self) if name is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"NormSlots names a module twice: {self}")


class DecoderLayer(nn.Module):
    """A residual block of attention then MLP, each branch with an optional norm before and after:

        h = x + post_attention(attn(pre_attention(x))); out = h + post_mlp(mlp(pre_mlp(h)))

    or, ``parallel``, the two branches side by side on the one pre-attention norm (GPT-NeoX's
    parallel residual: Cohere's, StableLM's ``use_parallel_residual``), with no pre-MLP norm:

        n = pre_attention(x); out = x + post_attention(attn(n)) + post_mlp(mlp(n))

    A subclass declares ``norms`` (the slots filled and HF's names for them), ``norm_layer`` (the
    model's norm, an RMSNorm variant or LayerNorm, also used for the final norm),
    ``norm_eps_field`` (the config field of its epsilon) or ``norm_eps`` (the epsilon, where HF fixes
    it: OLMo's 1e-5) and ``mlp_name`` (HF's name of the MLP, ``block_sparse_moe`` in GraniteMoe).
    ``branch_scale``, where given, multiplies each branch's output before its residual add (Granite's
    ``residual_multiplier``); ``shared_mlp``, where given, runs beside the MLP on its input,
    ``mlp(y) + shared_mlp(y)`` (GraniteMoeShared's dense MLP beside its experts).
    Each residual add is deferred into the pre-norm that follows it, so ``forward`` returns
    ``(branch_out, residual)`` and the next pre-norm completes the add; a branch without a pre-norm
    adds explicitly, and so does the parallel block's attention, whose output joins the residual
    before the MLP's, in HF's order of the sums. HuggingFace's view of this layer's output is
    ``branch_out + residual``.
    """

    returns_residual = True
    norms = NormSlots()
    norm_layer: Callable[[int, float], RMSNorm | LayerNorm] = RMSNorm
    norm_eps_field = "rms_norm_eps"
    norm_eps: float | None = None
    mlp_name = "mlp"

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, branch_scale: float | None = None,
                 shared_mlp: nn.Module | None = None, parallel: bool = False):
        super().__init__()
        self.self_attn = self_attn
        self.add_module(self.mlp_name, mlp)
        self.shared_mlp = shared_mlp
        self.branch_scale = branch_scale
        self.parallel = parallel
        pre_attention, post_attention, pre_mlp, post_mlp = astuple(self.norms)
        names = (pre_attention, post_attention, None if parallel else pre_mlp, post_mlp)
        for name in names:
            if name is not None:
                self.add_module(name, self.model_norm(config))
        # In slot order; a tuple, so that the norms stay registered under their HF names alone.
        self.slot_norms = tuple(None if name is None else getattr(self, name) for name in names)

    @classmethod
    def model_norm(cls, config) -> RMSNorm | LayerNorm:
        """One of the model's norms, the block's and the final one: ``norm_layer`` over ``hidden_size``."""
        eps = cls.norm_eps if cls.norm_eps is not None else getattr(config, cls.norm_eps_field)
        return cls.norm_layer(config.hidden_size, eps)

    def forward(self, hidden_states, residual, position_embeddings, metadata: AttentionMetadata,
                norm_stats: torch.Tensor | None = None):
        # norm_stats: the split pre-norms' sums of squares, [2, NORM_SLOTS] (DecoderModel.split_norm_stats)
        pre_attention, post_attention, pre_mlp, post_mlp = self.slot_norms
        attention_stats, mlp_stats = (None, None) if norm_stats is None else norm_stats
        hidden_states, residual = branch_input(pre_attention, hidden_states, residual, attention_stats)
        attention_out = self.branch_output(self.self_attn(hidden_states, position_embeddings, metadata), post_attention)
        if self.parallel:
            mlp_in, residual = hidden_states, residual + attention_out
        else:
            mlp_in, residual = branch_input(pre_mlp, attention_out, residual, mlp_stats)
        return self.branch_output(self.mlp_output(mlp_in), post_mlp), residual

    @property
    def splits_norms(self) -> bool:
        """Whether a one-row GPU step splits this block's pre-norms between the products around them
        (``layers.norm.NormedRow``): a block of ``Attention`` then a ``GatedMLP`` or a mixture of experts
        that reads a split norm (``SparseMoE.reads_split_norm``), the products after the norms not in
        FP8, each norm an RMSNorm with the weight as HF stores it (no offset), and nothing between a
        branch's last product and the residual, which is whole on this rank (a row-parallel o_proj
        all-reduces its product before the residual add). The pre-MLP norm then sits between o_proj and gate_up
        (or the router and the experts), and after a ``GatedMLP`` the next block's pre-attention norm
        between down_proj and the next qkv_proj (``DecoderModel``'s ``split_norms``)."""
        pre_attention, post_attention, pre_mlp, post_mlp = self.slot_norms
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, GatedMLP):
            reads_split_norm = mlp.gate_up_proj.fp8_block is None
        else:
            reads_split_norm = isinstance(mlp, SparseMoE) and mlp.reads_split_norm
        return (isinstance(self.self_attn, Attention) and self.self_attn.qkv_proj.fp8_block is None
                and not isinstance(self.self_attn.o_proj, RowParallelLinear) and reads_split_norm
                and not self.parallel and self.shared_mlp is None and self.branch_scale is None
                and post_attention is None and post_mlp is None
                and all(type(norm) is RMSNorm and not norm.weight_offset for norm in (pre_attention, pre_mlp)))

    def branch_output(self, out: torch.Tensor, post_norm: RMSNorm | LayerNorm | None) -> torch.Tensor:
        """A branch's output as it joins the residual: after its post-norm and ``branch_scale``."""
        if post_norm is not None:
            out = post_norm(out)
        if self.branch_scale is not None:
            out = out * self.branch_scale
        return out

    def mlp_output(self, mlp_in: torch.Tensor) -> torch.Tensor:
        """The MLP's output on its input, plus the shared MLP's where there is one."""
        out = getattr(self, self.mlp_name)(mlp_in)
        return out if self.shared_mlp is None else out + self.shared_mlp(mlp_in)


def branch_input(norm: RMSNorm | LayerNorm | None, hidden_states, residual, stats: torch.Tensor | None = None):
    """Completes the deferred residual add (in ``norm`` when there is one): returns the branch's
    input and the residual stream. ``residual`` is None at the first layer. Where the previous branch
    left its last product to the norm (``RowProduct``), the norm is split and adds into ``stats``."""
    if residual is None:
        return (hidden_states if norm is None else norm(hidden_states)), hidden_states
    if norm is None:
        residual = hidden_states + residual
        return residual, residual
    if isinstance(hidden_states, RowProduct):
        return norm(hidden_states, residual, stats)
    return norm(hidden_states, residual)


class DecoderModel(nn.Module):
    """Embedding, a stack of decoder layers and the final norm (HF's ``XxxModel``), and the rotary
    embedding the layers share, or, where the config sets rope apart per layer type, one per type,
    each layer taking its own type's (``rope_layer_types``). ``embedding_scale``
    multiplies the embedding's rows inside ``embed_tokens`` (Gemma's); ``input_multiplier`` the
    decoder's input after it, image rows included (Granite's ``embedding_multiplier``)."""

    def __init__(self, config, decoder_layer: type[DecoderLayer], embedding_scale: float | None = None,
                 partial_rotary: bool = False, input_multiplier: float | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, embedding_scale)
        self.input_multiplier = input_multiplier
        self.layers = nn.ModuleList(decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = decoder_layer.model_norm(config)
        self.split_norms()
        layer_types = rope_layer_types(config)
        if layer_types is None:
            self.rotary_emb = RotaryEmbedding(config, head_dim(config), partial_rotary)
            self.rope_of_layer = None
        else:  # rotary of its own per layer type (Gemma 3's sliding and full attention layers)
            self.rotary_emb = nn.ModuleDict(
                {kind: RotaryEmbedding(config, head_dim(config), partial_rotary, kind) for kind in layer_types}
            )
            self.rope_of_layer = list(config.layer_types)

    def split_norms(self, split: bool = True) -> None:
        """Marks the products before the norms a one-row GPU step splits (``DecoderLayer.splits_norms``):
        each such block's o_proj, and its MLP's last product where the next block splits too (a
        GatedMLP's down_proj, a SparseMoE's experts; the last block's feeds the final norm, whose
        hidden states the model returns). ``split=False`` clears the marks:
        every norm runs as a kernel of its own (``norms_unsplit``). The loader marks them again once the
        weights are in (``split_loaded_norms``): FP8 and MXFP4 weights are known from then on."""
        self.splitting = False
        for layer, next_layer in itertools.pairwise([*self.layers, None]):
            splits = split and layer.splits_norms
            self.splitting |= splits
            if isinstance(layer.self_attn, Attention):
                layer.self_attn.o_proj.into_norm = splits
            into_next_norm = splits and next_layer is not None and next_layer.splits_norms
            mlp = getattr(layer, layer.mlp_name)
            if isinstance(mlp, GatedMLP):
                mlp.down_proj.into_norm = into_next_norm
            elif isinstance(mlp, SparseMoE):
                mlp.into_norm = into_next_norm

    def split_norm_stats(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Zeroed slots for the sums of squares of a step's split norms, [layers, 2, NORM_SLOTS] float64
        (each layer's pre-attention and pre-MLP norm), where the step may split them: a single row on
        the GPU. One memset at the step's start: the products that add into them never zero them."""
        if not (self.splitting and hidden_states.is_cuda and hidden_states.shape[0] == 1):
            return None
        return new_norm_stats((len(self.layers), 2), hidden_states.device)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [self.rotary_emb] if self.rope_of_layer is None else list(self.rotary_emb.values())

    def forward(self, input_ids, positions, metadata: AttentionMetadata, inputs_embeds=None) -> torch.Tensor:
        """Final hidden states of the tokens ``input_ids``, or of the embeddings ``inputs_embeds``
        given instead (LLaVA's, holding image features at its image tokens)."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.input_multiplier is not None:
            hidden_states = hidden_states * self.input_multiplier
        through_cache = metadata.slot_mapping is not None
        if self.rope_of_layer is None:
            layer_position_embeddings = itertools.repeat(self.rotary_emb(positions, through_cache))
        else:
            of_kind = {kind: rotary(positions, through_cache) for kind, rotary in self.rotary_emb.items()}
            layer_position_embeddings = [of_kind[kind] for kind in self.rope_of_layer]
        residual = None
        norm_stats = self.split_norm_stats(hidden_states)
        for i, (layer, position_embeddings) in enumerate(zip(self.layers, layer_position_embeddings)):
            layer_stats = None if norm_stats is None else norm_stats[i]
            hidden_states, residual = layer(hidden_states, residual, position_embeddings, metadata, layer_stats)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


@contextlib.contextmanager
def norms_unsplit(model: nn.Module):
    """Within the context every norm of ``model``'s decoders runs as a kernel of its own, as in prefill,
    so that each module returns its output as a tensor (the diff's hooks read them); graphs captured
    within keep it so."""
    split_loaded_norms(model, False)
    try:
        yield
    finally:
        split_loaded_norms(model)


def split_loaded_norms(model: nn.Module, split: bool = True) -> None:
    """``DecoderModel.split_norms`` on each decoder of ``model``, as its weights now are."""
    for module in model.modules():
        if isinstance(module, DecoderModel):
            module.split_norms(split)


def config_number(config, field: str) -> float:
    """The value of the config field a declaration names: a number the model computes with (finite
    and positive, checked at load: ``models.auto.POSITIVE_FIELDS``), never unset."""
    value = getattr(config, field, None)
    if value is None:
        raise ValueError(f"config field {field!r} is not set; the model computes with it")
    return value


def check_batch(input_ids: torch.Tensor, vocab_size: int) -> None:
    """What a cache-free forward ``model(input_ids[B, T])`` takes: a non-empty [B, T] batch of ids in the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        what = f"a {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"input_ids must be a torch.long (or int32) tensor of token ids, got {what}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq_len] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        raise ValueError(
            f"input_ids hold ids outside [0, {vocab_size}): min {int(input_ids.min())}, max {int(input_ids.max())}"
        )


class CausalLM(nn.Module):
    """A decoder model with an LM head; subclasses set ``decoder_layer``, ``scale_embeddings``
    where the embeddings are multiplied by ``sqrt(hidden_size)`` (Gemma), ``input_multiplier_field``,
    the config field whose value multiplies the decoder's input (Granite's ``embedding_multiplier``),
    ``logits_scale``, the config field whose value scales the logits and the operation that applies
    it, HF's (Granite's ``("logits_scaling", operator.truediv)``, Cohere's ``("logit_scale",
    operator.mul)``), ``lm_head_bias_field``, the config field whose truth gives the LM head a bias
    (ERNIE 4.5 MoE's ``use_bias``), and ``partial_rotary`` where the config's
    ``partial_rotary_factor`` says how much of each head rotates (Phi-3, StableLM, GLM-4). A config's
    ``final_logit_softcapping`` caps the logits at ``cap * tanh(logits / cap)`` (Gemma 2).

    ``ignored_checkpoint_keys`` are regexes of checkpoint tensors the model does not use;
    any other tensor the model has no place for is a loading error. ``prediction_layers_field`` names
    the config field counting the multi-token-prediction layers checkpoints carry past
    ``num_hidden_layers`` (DeepSeek-V3's, GLM-4.5's): generation does not use them, and their
    tensors are ignored. ``checkpoint_aliases`` are
    ``(regex, replacement)`` rewrites from the model's tensor names (HF transformers 5's module
    tree) to another spelling its checkpoints use, e.g. Mixtral's ``block_sparse_moe.experts.{e}.w1``
    for ``mlp.experts.{e}.gate_proj``; the loader accepts either spelling.
    """

    decoder_layer: type[DecoderLayer]
    ignored_checkpoint_keys: tuple[str, ...] = (r"\.rotary_emb\.inv_freq$",)
    checkpoint_aliases: tuple[tuple[str, str], ...] = ()
    scale_embeddings = False
    input_multiplier_field: str | None = None
    logits_scale: tuple[str, Callable[[torch.Tensor, float], torch.Tensor]] | None = None
    lm_head_bias_field: str | None = None
    partial_rotary = False
    prediction_layers_field: str | None = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        if self.prediction_layers_field and (count := getattr(config, self.prediction_layers_field, 0)):
            first = config.num_hidden_layers
            skipped = "|".join(str(i) for i in range(first, first + count))
            self.ignored_checkpoint_keys = (*self.ignored_checkpoint_keys, rf"^model\.layers\.({skipped})\.")
        embedding_scale = config.hidden_size**0.5 if self.scale_embeddings else None
        input_multiplier = config_number(config, self.input_multiplier_field) if self.input_multiplier_field else None
        self.model = DecoderModel(config, self.decoder_layer, embedding_scale, self.partial_rotary, input_multiplier)
        self.logits_factor = config_number(config, self.logits_scale[0]) if self.logits_scale else None
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        # Tied embeddings: the head holds the embedding's own Parameter, so the loader
        # sees one parameter and fills it once.
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        head_bias = bool(getattr(config, self.lm_head_bias_field)) if self.lm_head_bias_field else False
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tied, bias=head_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids[N], positions[N], attn_metadata`` -> logits [N, vocab] over a flat token
        stream (only the rows ``logits_indices`` when given: the runtime needs each sequence's
        last token); or ``input_ids[B, T]`` alone -> logits [B, T, vocab] of a cache-free causal prefill."""
        if attn_metadata is None:
            return self._batched_prefill(input_ids)
        hidden_states = self.model(input_ids, positions, attn_metadata)
        if logits_indices is not None:
            hidden_states = hidden_states[logits_indices]
        return self.compute_logits(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits; every forward (flat stream, cache-free batch, a captured
        CUDA graph) calls it once, on the rows it returns."""
        logits = self.lm_head(hidden_states)
        if self.logits_factor is not None:
            logits = self.logits_scale[1](logits, self.logits_factor)
        return self.cap_logits(logits)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Final-logit soft-capping (Gemma 2's), where the config asks for it."""
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _batched_prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        check_batch(input_ids, self.config.vocab_size)
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        metadata = AttentionMetadata.causal_prefill(batch, length)
        logits = self.forward(input_ids.reshape(-1), positions, metadata)
        return logits.view(batch, length, -1)

    # -- What the runtime asks of a model: the KV cache it needs, binding one, and whether its
    # forward can be captured. The runtime touches no layer itself.

    bound_kv_cache: list[tuple[torch.Tensor, ...]] | None = None  # the pools bind_kv_cache bound last

    def kv_cache_spec(self) -> list[tuple[tuple[int, ...], ...]]:
        """Per layer that keeps a KV cache, in order: the shape of one token's entry in each of its
        pools (K and V, [kv_heads, head_dim] each, for ``layers.Attention``; one latent pool for
        ``layers.MLAttention``)."""
        return [layer.kv_cache_shapes for layer in self._attention_layers()]

    def bind_kv_cache(self, backend, pools: list[tuple[torch.Tensor, ...]]) -> None:
        """Attend with ``backend`` (``layers.attention.select_backend``) over ``pools``: per entry of
        ``kv_cache_spec``, its pools of shape [num_blocks, block_size, *shape]."""
        layers = self._attention_layers()
        if len(pools) != len(layers):
            raise ValueError(f"{len(pools)} KV-cache pools for {len(layers)} attention layers")
        for layer, pool in zip(layers, pools):
            layer.backend, layer.kv_cache = backend, pool
        self.bound_kv_cache = pools

    def unbind_kv_cache(self, pools: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        """Let go of the bound KV cache; with ``pools``, only if those are the ones bound."""
        if pools is not None and pools is not self.bound_kv_cache:
            return
        for layer in self._attention_layers():
            layer.kv_cache = None
        self.bound_kv_cache = None

    def fix_max_model_len(self, max_model_len: int) -> None:
        """No sequence will pass ``max_model_len`` tokens: LongRoPE fixes its set of frequencies by
        the positions the forwards reach (``layers.RotaryEmbedding.fix_context``), one fewer, as
        the token that completes a sequence is sampled and never fed."""
        for rotary in self.model.rotary_embeddings():
            rotary.fix_context(max_model_len - 1)
            if not rotary.long_context:
                continue
            original = rotary.params["original_max_position_embeddings"]
            warnings.warn(f"LongRoPE with max_model_len {max_model_len}: every position takes the long factors, "
                          f"where HF takes the short ones for a sequence of at most {original} positions; "
                          f"max_model_len <= {original + 1} keeps HF's")

    @property
    def capturable(self) -> bool:
        """Whether a forward can be captured in a CUDA graph or compiled: not where it reads
        positions on the host (dynamic rope scaling; LongRoPE before ``fix_max_model_len``), nor where
        an attention layer says its paged path does (``capturable``: latent attention's on the torch
        backend reads the sequences' lengths)."""
        layers_capturable = all(layer.capturable for layer in self._attention_layers())
        rotary_capturable = not any(rotary.reads_positions_on_host for rotary in self.model.rotary_embeddings())
        return rotary_capturable and layers_capturable

    def _attention_layers(self) -> list[Attention | MLAttention]:
        return [module for module in self.modules() if isinstance(module, (Attention, MLAttention))]
