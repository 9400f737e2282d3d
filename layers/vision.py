"""The vision side of LLaVA: CLIP's vision encoder, the multimodal projector, and LLaVA-NeXT's
anyres packing, with HuggingFace's module names:

    vision_tower.{embeddings.{class_embedding, patch_embedding, position_embedding}, pre_layrnorm,
                  encoder.layers.{i}.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.{fc1, fc2}},
                  post_layernorm}
    multi_modal_projector.{linear_1, linear_2}

The encoder is built from a ``CLIPVisionConfig``. Its q/k/v projections run as one fused linear
(``self_attn.qkv_proj``, filled from HF's three); its attention is full (every patch sees every
patch), through SDPA (``ops_cuda.paged_attention.sdpa``).
"""

import torch
from torch import nn

from layers.embedding import VocabEmbedding
from layers.linear import Linear, MergedLinear
from layers.mlp import UngatedMLP, plain_activation
from ops_cuda.paged_attention import sdpa


class CLIPVisionEmbeddings(nn.Module):
    """Pixels [N, C, S, S] -> [N, 1 + (S / patch)^2, hidden]: the class embedding, then one
    embedding per patch (a convolution with stride = kernel = patch), plus learned positions."""

    def __init__(self, config):
        super().__init__()
        self.image_size = config.image_size
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = VocabEmbedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values must be [images, channels, {self.image_size}, {self.image_size}], "
                             f"got shape {tuple(pixel_values.shape)}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        classes = self.class_embedding.expand(len(pixel_values), 1, -1)
        return torch.cat([classes, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Full multi-head self-attention over the patches, q/k/v fused, every projection with a bias."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, sources=["q_proj", "k_proj", "v_proj"], bias=True)
        self.out_proj = Linear(hidden, hidden, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = hidden_states.shape
        q, k, v = (t.view(batch, length, self.num_heads, self.head_dim)
                   for t in self.qkv_proj.split(self.qkv_proj(hidden_states)))
        out = sdpa(q, k, v, None, self.scale, causal=False)
        return self.out_proj(out.reshape(batch, length, hidden))


class CLIPMLP(UngatedMLP):
    up_name, down_name = "fc1", "fc2"

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)


class CLIPEncoderLayer(nn.Module):
    """x + attn(layer_norm1(x)), then + mlp(layer_norm2(.))."""

    def __init__(self, config):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states))
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """HuggingFace's ``CLIPVisionModel``. ``post_layernorm`` normalises CLIP's pooled CLS state,
    which LLaVA does not use: it is loaded and never run."""

    def __init__(self, config):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> torch.Tensor:
        """The hidden states at ``feature_layers`` (HF's ``hidden_states`` indices: 0 is the input of
        the first layer, -1 the output of the last; negative counted from the end), concatenated
        along the hidden dimension: [images, 1 + patches, hidden * len(feature_layers)]. Layers past
        the last one needed are not run."""
        count = len(self.encoder.layers) + 1
        wanted = []
        for index in feature_layers:
            if not -count <= index < count:
                raise ValueError(f"vision_feature_layer {index} is out of range for {count - 1} encoder layers")
            wanted.append(index % count)
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers[: max(wanted)]:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in wanted], dim=-1)


class MultiModalProjector(nn.Module):
    """Vision features -> the language model's hidden size: linear_1, activation, linear_2."""

    def __init__(self, vision_width: int, text_hidden: int, activation: str, bias: bool):
        super().__init__()
        self.linear_1 = Linear(vision_width, text_hidden, bias=bias)
        self.activation = plain_activation(activation)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(features)))


# -- LLaVA-NeXT's anyres: an image is resized to the best of the grid pinpoints, cut into tiles of
# the encoder's image size, and encoded as the tiles plus the whole image at the encoder's size.

def select_best_resolution(image_size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """The pinpoint (height, width) that keeps the most of an image of ``image_size`` (height,
    width) once resized to fit it, and wastes the least of its area among those (HF's rule)."""
    height, width = image_size
    best, best_effective, best_wasted = None, 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    return best


def anyres_grid(image_size: tuple[int, int], pinpoints: list, tile_size: int) -> tuple[int, int]:
    """Rows and columns of tiles an image of ``image_size`` (height, width) is cut into."""
    height, width = select_best_resolution(image_size, pinpoints)
    return height // tile_size, width // tile_size


def unpad(features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """Crop features [C, H, W] of an image padded to a pinpoint's aspect ratio back to the image's
    own: the padding rows (or columns) split evenly on both sides, as the processor added them."""
    height, width = image_size
    current_height, current_width = features.shape[1:]
    if width / height > current_width / current_height:
        new_height = int(round(height * (current_width / width), 7))
        padding = (current_height - new_height) // 2
        return features[:, padding : current_height - padding, :]
    new_width = int(round(width * (current_height / height), 7))
    padding = (current_width - new_width) // 2
    return features[:, :, padding : current_width - padding]


def pack_anyres(features: torch.Tensor, image_size: tuple[int, int], pinpoints: list, tile_size: int, side: int,
                newline: torch.Tensor) -> torch.Tensor:
    """One image's projected features [1 + tiles, side * side, hidden] (the whole image first, then
    its tiles row by row; ``side`` patches a side per tile) -> [tokens, hidden]: the whole image's
    features, then the tiles' features stitched into one grid, unpadded to the image's aspect
    ratio, read row by row with ``newline`` closing each row."""
    base, tiles = features[0], features[1:]
    rows, columns = anyres_grid(image_size, pinpoints, tile_size)
    if rows * columns != len(tiles) or side * side != tiles.shape[1]:
        raise ValueError(f"image of size {tuple(image_size)}: {len(tiles)} tiles of {tiles.shape[1]} features do not "
                         f"make its {rows}x{columns} grid of {side}x{side} patches")
    grid = tiles.view(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    grid = unpad(grid, image_size)
    grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.dtype)], dim=-1)
    return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)])
