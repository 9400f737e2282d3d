"""Shared building blocks of zoo's models. Nothing here imports models, loaders or runtime."""

from layers.attention import (
    Attention,
    AttentionMetadata,
    ScoreModifiers,
    TorchAttentionBackend,
    TritonAttentionBackend,
    score_modifiers_used,
    select_backend,
)
from layers.embedding import LMHead, VocabEmbedding
from layers.linear import Linear, MergedLinear, pack_cpu_weights
from layers.mla import MLAttention
from layers.mlp import GatedMLP, UngatedMLP
from layers.moe import Experts, SparseMoE, TopKRouter
from layers.norm import LayerNorm, RMSNorm
from layers.parallel import (
    ColumnParallelLinear,
    ExpertParallelExperts,
    HeadParallelLayerNorm,
    RowParallelLinear,
    TensorParallelExperts,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    tensor_parallel,
)
from layers.rotary import RotaryEmbedding, rope_layer_types, rope_parameters
from layers.weights import OneOf, Shard

__all__ = [
    "Attention", "AttentionMetadata", "ColumnParallelLinear", "ExpertParallelExperts", "Experts", "GatedMLP", "HeadParallelLayerNorm", "LayerNorm", "LMHead", "Linear", "MergedLinear", "MLAttention", "RMSNorm",
    "OneOf", "RotaryEmbedding", "RowParallelLinear", "ScoreModifiers", "Shard", "SparseMoE", "TopKRouter", "TorchAttentionBackend",
    "TensorParallelExperts", "TritonAttentionBackend", "UngatedMLP", "VocabEmbedding", "VocabParallelEmbedding", "VocabParallelLMHead",
    "pack_cpu_weights", "rope_layer_types", "rope_parameters", "score_modifiers_used",
    "select_backend", "tensor_parallel",
]
