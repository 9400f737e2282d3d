"""Tensor parallelism over a torch.distributed process group: the parallel forms of the dense
layers, and ``tensor_parallel`` that swaps them into a model built from the dense declarations.

Each rank holds a slice of every linear weight and declares it as the part of the checkpoint
tensor it reads (``Shard.source``), so the one loader reads each rank's bytes alone:

- column-parallel (``ColumnParallelLinear``): a slice of the output rows of each fused source;
  attention's q/k/v split by heads (a KV head replicated on several ranks where there are fewer KV
  heads than ranks), the MLP's gate/up by intermediate rows; no communication.
- row-parallel (``RowParallelLinear``): a slice of the input columns; the partial products are
  summed over the ranks (all-reduce), then the bias is added once.
- the vocabulary-parallel embedding (``VocabParallelEmbedding``: rows of the rank's vocabulary
  range, others zero, all-reduced) and LM head (``VocabParallelLMHead``: the rank's logits,
  gathered); a tied head shares the embedding's slice.
Norms and rotary tables are replicated.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers.attention import Attention
from layers.embedding import LMHead, VocabEmbedding
from layers.linear import Linear, MergedLinear
from layers.mlp import GatedMLP
from layers.norm import RMSNorm
from layers.rotary import RotaryEmbedding
from layers.weights import Shard, parent_of
from ops_cuda.linear import linear


def rank_range(size: int, rank: int, ranks: int) -> slice:
    """The rank's part of ``size`` rows split as evenly as the ranks allow: ceil(size / ranks)
    each, the last rank's the rest."""
    per_rank = -(-size // ranks)
    return slice(min(rank * per_rank, size), min((rank + 1) * per_rank, size))


def split_evenly(size: int, rank: int, ranks: int, what: str) -> slice:
    if size % ranks:
        raise ValueError(f"tensor parallelism over {ranks} ranks: {what} ({size}) is not a multiple of {ranks}")
    per_rank = size // ranks
    return slice(rank * per_rank, (rank + 1) * per_rank)


class ColumnParallelLinear(MergedLinear):
    """The rank's output rows of one or more fused projections: ``source_rows[i]`` of source i."""

    def __init__(self, in_features: int, source_rows: list[slice], sources: list[str], bias: bool = False):
        # Sliced tensors load dequantised: the rank's part cuts FP8 scale blocks (loaders.load).
        super().__init__(in_features, [rows.stop - rows.start for rows in source_rows], sources, bias)
        self.fp8_parameters = ()
        self.source_rows = list(source_rows)

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        parent = parent_of(prefix)
        shards = {name: [] for name, _ in self.named_parameters(recurse=False)}
        offset = 0
        for source, rows, size in zip(self.sources, self.source_rows, self.output_sizes):
            for name in shards:
                shards[name].append(Shard(f"{parent}.{source}.{name}", (slice(offset, offset + size),), (rows,)))
            offset += size
        return shards


class RowParallelLinear(Linear):
    """The rank's ``columns`` of the input features; the outputs of all ranks summed."""

    def __init__(self, columns: slice, out_features: int, group, bias: bool = False):
        super().__init__(columns.stop - columns.start, out_features, bias, fp8=False)
        self.columns, self.group = columns, group

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        shards = {"weight": [Shard(f"{prefix}.weight", (), (slice(None), self.columns))]}
        if self.bias is not None:
            shards["bias"] = [Shard(f"{prefix}.bias")]
        return shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.packed)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """The embedding rows of the rank's ``vocab`` range; each id's row comes from the rank that holds it."""

    def __init__(self, vocab: slice, hidden_size: int, group, scale: float | None = None):
        super().__init__(vocab.stop - vocab.start, hidden_size, scale)
        self.vocab, self.group = vocab, group

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        return {"weight": [Shard(f"{prefix}.weight", (), (self.vocab,))]}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        held = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        local_ids = torch.where(held, input_ids - self.vocab.start, 0)
        embeddings = F.embedding(local_ids, self.weight) * held.unsqueeze(-1)
        dist.all_reduce(embeddings, group=self.group)
        if self.scale is None:
            return embeddings
        return embeddings * self.scale_in.get(embeddings.dtype, self.scale)


class VocabParallelLMHead(LMHead):
    """The logits of the rank's ``vocab`` range, gathered from every rank into the whole vocabulary's."""

    def __init__(self, vocab: slice, vocab_size: int, hidden_size: int, group, ranks: int,
                 tie_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab.stop - vocab.start, hidden_size, tie_to)
        self.vocab, self.vocab_size, self.group, self.ranks = vocab, vocab_size, group, ranks

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        return {"weight": [Shard(f"{prefix}.weight", (), (self.vocab,))]}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, packed=self.packed)
        # all_gather takes equal sizes: every rank's part padded to the largest, ceil(vocab / ranks).
        per_rank = -(-self.vocab_size // self.ranks)
        padded = F.pad(logits, (0, per_rank - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.ranks)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def tensor_parallel(model: nn.Module, group) -> nn.Module:
    """Replace, in place, the dense layers of ``model`` (built on the meta device, not loaded) by
    their parallel forms for this process's rank in ``group`` (a ``torch.distributed`` process
    group): attention, gated MLP, embedding and LM head. Raises for a module with weights it cannot
    split (experts, latent attention, a vision tower), and for sizes the ranks do not divide."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    embeddings: dict[int, VocabParallelEmbedding] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            _split_attention(module, name, rank, ranks, group)
        elif isinstance(module, GatedMLP):
            _split_mlp(module, rank, ranks, group)
        elif type(module) is VocabEmbedding:
            vocab_size, hidden_size = module.weight.shape
            parallel = VocabParallelEmbedding(rank_range(vocab_size, rank, ranks), hidden_size, group, module.scale)
            embeddings[id(module.weight)] = parallel
            _replace(model, name, parallel)
        elif type(module) is LMHead:
            vocab_size, hidden_size = module.weight.shape
            _replace(model, name, VocabParallelLMHead(rank_range(vocab_size, rank, ranks), vocab_size, hidden_size,
                                                      group, ranks, tie_to=embeddings.get(id(module.weight))))
    parallel_types = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead)
    for name, module in model.named_modules():
        if isinstance(module, parallel_types) or isinstance(module, (RMSNorm, RotaryEmbedding)):
            continue
        if next(module.parameters(recurse=False), None) is not None:
            raise NotImplementedError(f"tensor parallelism cannot split {name} ({type(module).__name__}): "
                                      "it splits attention, gated MLPs, embeddings and LM heads")
    return model


def _split_attention(attention: Attention, name: str, rank: int, ranks: int, group) -> None:
    if attention.q_norm is not None and not attention.qk_norm_per_head:
        raise NotImplementedError(f"tensor parallelism cannot split {name}: its q/k norm spans all heads")
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    q_heads = split_evenly(heads, rank, ranks, f"{name}'s attention heads")
    if kv_heads % ranks == 0:
        kv = split_evenly(kv_heads, rank, ranks, f"{name}'s KV heads")
    elif ranks % kv_heads == 0:  # each KV head replicated on ranks / kv_heads ranks, those of its query heads
        first = rank // (ranks // kv_heads)
        kv = slice(first, first + 1)
    else:
        raise ValueError(f"tensor parallelism over {ranks} ranks: {name}'s KV heads ({kv_heads}) neither divide "
                         f"nor are a multiple of the ranks")
    rows = [slice(q_heads.start * head_dim, q_heads.stop * head_dim), slice(kv.start * head_dim, kv.stop * head_dim)]
    qkv = attention.qkv_proj
    attention.qkv_proj = ColumnParallelLinear(qkv.in_features, [rows[0], rows[1], rows[1]], qkv.sources,
                                              bias=qkv.bias is not None)
    o = attention.o_proj
    attention.o_proj = RowParallelLinear(rows[0], o.out_features, group, bias=o.bias is not None)
    attention.num_heads, attention.num_kv_heads = q_heads.stop - q_heads.start, kv.stop - kv.start


def _split_mlp(mlp: GatedMLP, rank: int, ranks: int, group) -> None:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    rows = split_evenly(down.in_features, rank, ranks, "the MLP's intermediate size")
    mlp.gate_up_proj = ColumnParallelLinear(gate_up.in_features, [rows, rows], gate_up.sources,
                                            bias=gate_up.bias is not None)
    mlp.down_proj = RowParallelLinear(rows, down.out_features, group, bias=down.bias is not None)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, module)
