"""LLaVA 1.5 and LLaVA-NeXT: CLIP's vision encoder and a projector in front of any registered decoder.

    pixels -> vision_tower (CLIP) -> hidden states of vision_feature_layer (CLS dropped by the
    "default" strategy) -> multi_modal_projector -> image features, written over the embeddings
    of the image tokens -> the language model

Module paths are those of transformers 5: ``model.vision_tower``, ``model.multi_modal_projector``,
``model.image_newline`` (NeXT), ``model.language_model`` (the text model's decoder: its
``embed_tokens``, ``layers``, ``norm``) and ``lm_head``. The language model is the registered class
of ``config.text_config``, built through the registry.

What the runtime uses, besides a causal LM's API (``kv_cache_spec``, ``bind_kv_cache``, ...,
delegated to the text model):

- ``encode_images(pixel_values, image_sizes=None)``: one [tokens, text hidden] tensor per image,
  ``tokens`` the number of image tokens the HF processor expands that image's placeholder to;
- ``model(input_ids[N], positions[N], metadata, image_embeds=..., image_rows=...)``: ``image_embeds``
  holds one row per prompt image token of the flat stream and replaces the embeddings of the rows
  ``image_rows`` (a generated token that carries the image token's id is embedded as a token).
"""

import torch
from torch import nn

from layers import AttentionMetadata
from layers.vision import CLIPVisionTower, MultiModalProjector, pack_anyres, select_best_resolution
from models.auto import model_class_for, register
from models.base import CausalLM, check_batch

# The module tree's names (transformers 5's) -> the layout transformers 5 saves -> the hub's
# (llava-hf/*), each rewrite applied after the ones before it (see loaders.load.declared_layouts).
LAYOUT_ALIASES = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.", ""),
    (r"^vision_tower\.", "vision_tower.vision_model."),
)


def under_language_model(pattern: str) -> str:
    """A regex of the text model's tensor names, anchored at its ``model.``, for the same tensors
    under LLaVA: ``model.language_model.`` (the module tree) or ``language_model.model.`` (saved, hub)."""
    anchor = r"^model\."
    if not pattern.startswith(anchor):
        return pattern
    return r"^(?:model\.language_model|language_model\.model)\." + pattern.removeprefix(anchor)


def image_token_id(config) -> int:
    """``config.image_token_id`` (transformers 5), ``image_token_index`` in older configs."""
    token = getattr(config, "image_token_id", None)
    return config.image_token_index if token is None else token


class LlavaModel(nn.Module):
    """HuggingFace's ``LlavaModel``: the vision tower, the projector and the language model."""

    def __init__(self, config, language_model: nn.Module):
        super().__init__()
        vision = config.vision_config
        if vision.model_type != "clip_vision_model":
            raise ValueError(f"vision_config.model_type {vision.model_type!r} is not supported; zoo's LLaVA takes "
                             "CLIP's vision encoder (clip_vision_model)")
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_cls = config.vision_feature_select_strategy == "default"  # or "full": transformers checks
        self.vision_tower = CLIPVisionTower(vision)
        self.multi_modal_projector = MultiModalProjector(
            vision.hidden_size * len(self.feature_layers), config.text_config.hidden_size,
            config.projector_hidden_act, getattr(config, "multimodal_projector_bias", True),
        )
        self.language_model = language_model

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixels [images, C, S, S] -> projected features [images, tokens, text hidden]."""
        features = self.vision_tower(pixel_values, self.feature_layers)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


class LlavaNextModel(LlavaModel):
    """``LlavaModel`` with the learned ``image_newline`` that closes each row of an image's tile grid."""

    replicated_parameters = ("image_newline",)  # every rank holds it whole (layers.tensor_parallel)

    def __init__(self, config, language_model: nn.Module):
        if config.vision_feature_select_strategy == "full":
            # A tile's features, CLS token kept, are no square grid of patches to stitch.
            raise ValueError("vision_feature_select_strategy 'full' is not supported with LLaVA-NeXT (nor by "
                             "HuggingFace's packing of its tiles): its tiles' features must be square grids")
        super().__init__(config, language_model)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size), requires_grad=False)


@register("LlavaForConditionalGeneration")
class LlavaForConditionalGeneration(nn.Module):
    """LLaVA 1.5: one image, resized to the encoder's size, becomes (S / patch)^2 image tokens
    (one more with the "full" strategy)."""

    model_class = LlavaModel

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.image_token_id = image_token_id(config)
        text = model_class_for(config.text_config, "text_config")(config.text_config)
        if config.tie_word_embeddings:  # HF ties LLaVA's head by its own config's flag (True where its text config's is)
            text.lm_head.weight = text.model.embed_tokens.weight
        self.model = self.model_class(config, text.model)
        self.lm_head = text.lm_head
        # The text model's CausalLM, whose decoder and head are this model's ``model.language_model``
        # and ``lm_head``: in a tuple, so that its modules stay registered under LLaVA's paths alone.
        self.text = (text,)
        self.checkpoint_aliases = LAYOUT_ALIASES + tuple(text.checkpoint_aliases)
        ignored = [under_language_model(pattern) for pattern in text.ignored_checkpoint_keys]
        ignored.append(r"\.embeddings\.position_ids$")  # CLIP's position index buffer, in older checkpoints
        if text.lm_head.weight is text.model.embed_tokens.weight:
            ignored.append(r"^language_model\.lm_head\.weight$")  # the tied head's copy, hub layout
        self.ignored_checkpoint_keys = tuple(ignored)

    @property
    def text_model(self) -> CausalLM:
        return self.text[0]

    def encode_images(self, pixel_values: torch.Tensor, image_sizes=None) -> list[torch.Tensor]:
        """Pixels [images, C, S, S] (the processor's ``pixel_values``) -> per image, its features
        [tokens, text hidden]. ``image_sizes`` is not needed: every image has the same size here."""
        return list(self.model.image_features(pixel_values))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_metadata: AttentionMetadata | None = None,
        logits_indices: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_sizes=None,
    ) -> torch.Tensor:
        """``input_ids[N], positions[N], attn_metadata`` -> logits [N, vocab] over a flat token
        stream (the rows ``logits_indices`` when given), ``image_embeds`` [image tokens, text hidden]
        replacing the embeddings of the stream's rows ``image_rows`` (by default: the image tokens of
        input_ids, in order); or
        ``input_ids[B, T]`` with ``pixel_values`` (and ``image_sizes`` for NeXT) -> logits
        [B, T, vocab] of a cache-free causal prefill, the image tokens filled image by image in
        the order they appear in the batch."""
        if attn_metadata is None:
            return self._batched_prefill(input_ids, pixel_values, image_sizes, image_embeds)
        if pixel_values is not None:
            raise ValueError("the flat forward takes image_embeds (from encode_images), not pixel_values")
        embeddings = self.embed(input_ids, image_embeds, image_rows)
        hidden_states = self.model.language_model(input_ids, positions, attn_metadata, inputs_embeds=embeddings)
        if logits_indices is not None:
            hidden_states = hidden_states[logits_indices]
        return self.compute_logits(hidden_states)

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
              image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The token embeddings of ``input_ids`` [N], the rows ``image_rows`` replaced by
        ``image_embeds`` (by default the image tokens' rows; the runtime names them, as a generated
        token may carry the image token's id)."""
        embeddings = self.model.language_model.embed_tokens(input_ids)
        if image_embeds is None:
            return embeddings
        if image_rows is None:
            image_rows = (input_ids.reshape(-1) == self.image_token_id).nonzero()[:, 0]
        if image_embeds.dim() != 2 or image_embeds.shape != (len(image_rows), embeddings.shape[-1]):
            raise ValueError(f"image_embeds of shape {tuple(image_embeds.shape)} for {len(image_rows)} image tokens "
                             f"(id {self.image_token_id}) of hidden size {embeddings.shape[-1]}")
        flat = embeddings.reshape(-1, embeddings.shape[-1])
        return flat.index_copy(0, image_rows, image_embeds.to(embeddings.dtype)).view(embeddings.shape)

    def _batched_prefill(self, input_ids, pixel_values, image_sizes, image_embeds) -> torch.Tensor:
        check_batch(input_ids, self.config.text_config.vocab_size)
        if pixel_values is not None:
            if image_embeds is not None:
                raise ValueError("pass pixel_values or image_embeds, not both")
            image_embeds = torch.cat(self.encode_images(pixel_values, image_sizes))
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        metadata = AttentionMetadata.causal_prefill(batch, length)
        logits = self.forward(input_ids.reshape(-1), positions, metadata, image_embeds=image_embeds)
        return logits.view(batch, length, -1)

    # -- What the runtime asks of a causal LM: the text model's answers.

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # LLaVA's own lm_head, the text model's until tensor_parallel replaces the module at this path.
        # Never soft-capped: HF's LLaVA does not read its text model's final_logit_softcapping (Gemma 2's).
        return self.lm_head(hidden_states)

    def kv_cache_spec(self) -> list[tuple[tuple[int, ...], ...]]:
        return self.text_model.kv_cache_spec()

    def bind_kv_cache(self, backend, pools: list[tuple[torch.Tensor, ...]]) -> None:
        self.text_model.bind_kv_cache(backend, pools)

    def unbind_kv_cache(self, pools: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        self.text_model.unbind_kv_cache(pools)

    @property
    def bound_kv_cache(self) -> list[tuple[torch.Tensor, ...]] | None:
        return self.text_model.bound_kv_cache

    def fix_max_model_len(self, max_model_len: int) -> None:
        self.text_model.fix_max_model_len(max_model_len)

    @property
    def capturable(self) -> bool:
        return self.text_model.capturable


@register("LlavaNextForConditionalGeneration")
class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): anyres. An image is resized to the best of ``image_grid_pinpoints`` and cut
    into tiles of the encoder's size; its tokens are the whole image's features (at the encoder's
    size), then the tiles' features stitched into one grid, unpadded to the image's aspect ratio,
    each row closed by ``image_newline``."""

    model_class = LlavaNextModel

    def encode_images(self, pixel_values: torch.Tensor, image_sizes=None) -> list[torch.Tensor]:
        """``pixel_values`` [images, tiles, C, S, S] as the processor pads them (or the images'
        tiles concatenated, [all tiles, C, S, S]) and ``image_sizes`` [images, 2] (height, width of
        each original image) -> per image, its packed features [tokens, text hidden]."""
        if image_sizes is None:
            raise ValueError("LLaVA-NeXT needs image_sizes (the processor's) to tile and unpad its images")
        sizes = [tuple(int(side) for side in size) for size in torch.as_tensor(image_sizes).tolist()]
        pinpoints = self.config.image_grid_pinpoints
        tile_size = self.config.vision_config.image_size
        tiles = []
        for size in sizes:
            height, width = select_best_resolution(size, pinpoints)
            tiles.append((height // tile_size) * (width // tile_size) + 1)
        if pixel_values.dim() == 5:
            if len(pixel_values) != len(sizes):
                raise ValueError(f"pixel_values hold {len(pixel_values)} images, image_sizes {len(sizes)}")
            pixel_values = torch.cat([pixels[:count] for pixels, count in zip(pixel_values, tiles)])
        elif pixel_values.dim() != 4 or len(pixel_values) != sum(tiles):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} for images of sizes {sizes}: expected "
                             f"[images, tiles, C, H, W] or the images' {sum(tiles)} tiles, [tiles, C, H, W]")
        features = self.model.image_features(pixel_values).split(tiles)
        side = tile_size // self.config.vision_config.patch_size
        return [pack_anyres(image, size, pinpoints, tile_size, side, self.model.image_newline)
                for image, size in zip(features, sizes)]
