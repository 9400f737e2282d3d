"""Shared building blocks of zoo's models. Nothing here imports models, loaders or runtime."""

from layers.attention import Attention, AttentionMetadata, TorchAttentionBackend
from layers.embedding import LMHead, VocabEmbedding
from layers.linear import Linear, MergedLinear
from layers.mlp import GatedMLP
from layers.norm import RMSNorm
from layers.rotary import RotaryEmbedding, rope_parameters
from layers.weights import Shard

__all__ = [
    "Attention", "AttentionMetadata", "GatedMLP", "LMHead", "Linear", "MergedLinear", "RMSNorm",
    "RotaryEmbedding", "Shard", "TorchAttentionBackend", "VocabEmbedding", "rope_parameters",
]
