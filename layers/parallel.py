"""Tensor parallelism over a torch.distributed process group: the parallel forms of the dense
layers, and ``tensor_parallel`` that swaps them into a model built from the dense declarations.

Each rank holds a slice of every linear weight and declares it as the part of the checkpoint
tensor it reads (``Shard.source``), so the one loader reads each rank's bytes alone:

- column-parallel (``ColumnParallelLinear``): a slice of the output rows of each fused source;
  attention's q/k/v split by heads (a KV head replicated on several ranks where there are fewer KV
  heads than ranks), the MLP's gate/up (an ungated MLP's up, with its bias) by intermediate rows; no
  communication. A q/k norm with a weight of its own for each head (``HeadParallelLayerNorm``) holds
  the rows of the rank's heads, and attention sinks the rank's query heads' (``Attention.sink_heads``).
- row-parallel (``RowParallelLinear``): a slice of the input columns; the partial products are
  summed over the ranks (all-reduce), then the bias is added once.
- the vocabulary-parallel embedding (``VocabParallelEmbedding``: rows of the rank's vocabulary
  range, others zero, all-reduced) and LM head (``VocabParallelLMHead``: the rank's logits, from its
  rows of the weight and of a bias, gathered); a tied head shares the embedding's slice.
- a mixture of experts: each rank holds whole experts (``ExpertParallelExperts``: E / ranks of
  them, any experts' layout cut to them; experts with biases split this way only) or every expert's
  slice of intermediate rows (``TensorParallelExperts``), its shared experts column/row-parallel
  (not where their down projection has a bias, which would be added on every rank); the block's
  partial outputs are summed by one all-reduce (``SparseMoE.group``). Every rank holds every token
  (the activations are replicated after each all-reduce), so the router runs unchanged on each and
  dispatch is a local selection: no all-to-all.
- multi-head latent attention: heads split (``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
  column-parallel by heads, ``o_proj`` row-parallel), the latent path replicated, so every rank
  caches the same whole latent.
Norms, rotary tables, routers, a vision tower and its projector are replicated. A block whose
attention and MLP sit side by side (``DecoderLayer``'s ``parallel``) all-reduces each branch's
row-parallel output, as a block of one branch after the other does.
"""

import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layers.attention import Attention
from layers.embedding import LMHead, VocabEmbedding
from layers.linear import Linear, MergedLinear
from layers.mla import MLAttention
from layers.mlp import GatedMLP, UngatedMLP
from layers.moe import Experts, SparseMoE, TopKRouter
from layers.norm import LayerNorm, RMSNorm
from layers.rotary import RotaryEmbedding
from layers.vision import CLIPVisionTower, MultiModalProjector
from layers.weights import OneOf, Shard, parent_of
from ops_cuda.linear import linear
from ops_cuda.moe import ids_within


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
    """The rank's output rows of one or more fused projections: ``source_rows[i]`` of source i,
    whose whole width is ``source_sizes[i]`` (where a checkpoint holds the sources stacked in one
    tensor, source i's rows start after the widths before it)."""

    def __init__(self, in_features: int, source_rows: list[slice], sources: list[str], source_sizes: list[int],
                 bias: bool = False):
        # Sliced tensors load dequantised: the rank's part cuts FP8 scale blocks (loaders.load).
        super().__init__(in_features, [rows.stop - rows.start for rows in source_rows], sources, bias)
        self.fp8_parameters = ()
        self.source_rows = list(source_rows)
        self.source_sizes = list(source_sizes)

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf | list[Shard]]:
        parent = parent_of(prefix)
        layouts = {}
        for name, _ in self.named_parameters(recurse=False):
            apart, stacked = [], []
            starts = itertools.accumulate(self.source_sizes, initial=0)
            held = itertools.accumulate(self.output_sizes, initial=0)
            for source, rows, start, offset, size in zip(self.sources, self.source_rows, starts, held,
                                                          self.output_sizes):
                index = (slice(offset, offset + size),)
                apart.append(Shard(f"{parent}.{source}.{name}", index, (rows,)))
                stacked.append(Shard(f"{prefix}.{name}", index, (slice(start + rows.start, start + rows.stop),)))
            # One source under the module's own name (MLA's q_b_proj) is one layout.
            layouts[name] = apart if stacked == apart else OneOf(apart, stacked)
        return layouts


class RowParallelLinear(Linear):
    """The rank's ``columns`` of the input features; the outputs of all ranks summed over ``group``,
    or by the caller where ``group`` is None (a mixture of experts sums its parts in one all-reduce)."""

    def __init__(self, columns: slice, out_features: int, group, bias: bool = False):
        if bias and group is None:
            raise ValueError("a row-parallel bias is added once, after the all-reduce: it needs the group")
        super().__init__(columns.stop - columns.start, out_features, bias, fp8=False)
        self.columns, self.group = columns, group

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        shards = {"weight": [Shard(f"{prefix}.weight", (), (slice(None), self.columns))]}
        if self.bias is not None:
            shards["bias"] = [Shard(f"{prefix}.bias")]
        return shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.packed)
        if self.group is not None:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class HeadParallelLayerNorm(LayerNorm):
    """The rows of the rank's ``heads`` of the ``num_heads`` of a LayerNorm with a weight of its own
    for each head (Cohere's and StableLM's q/k norms): of the stacked tensor, or the rank's heads'
    tensors of one per head (the others ``Shard.elsewhere``)."""

    def __init__(self, heads: slice, num_heads: int, head_dim: int, eps: float, bias: bool, weight_offset: float):
        super().__init__((heads.stop - heads.start, head_dim), eps, bias, weight_offset)
        self.heads, self.num_heads = heads, num_heads

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        layouts = {}
        for name, _ in self.named_parameters(recurse=False):
            per_head = [Shard(f"{prefix}.norms.{h}.{name}", (h - self.heads.start,))
                        if self.heads.start <= h < self.heads.stop else Shard.elsewhere(f"{prefix}.norms.{h}.{name}")
                        for h in range(self.num_heads)]
            layouts[name] = OneOf([Shard(f"{prefix}.{name}", (), (self.heads,))], per_head)
        return layouts


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
    """The logits of the rank's ``vocab`` range (its rows of the weight and of a bias), gathered from
    every rank into the whole vocabulary's."""

    def __init__(self, vocab: slice, vocab_size: int, hidden_size: int, group, ranks: int,
                 tie_to: VocabParallelEmbedding | None = None, bias: bool = False):
        super().__init__(vocab.stop - vocab.start, hidden_size, tie_to, bias)
        self.vocab, self.vocab_size, self.group, self.ranks = vocab, vocab_size, group, ranks

    def checkpoint_shards(self, prefix: str) -> dict[str, list[Shard]]:
        return {name: [Shard(f"{prefix}.{name}", (), (self.vocab,))] for name, _ in self.named_parameters()}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, self.bias, packed=self.packed)
        # all_gather takes equal sizes: every rank's part padded to the largest, ceil(vocab / ranks).
        per_rank = -(-self.vocab_size // self.ranks)
        padded = F.pad(logits, (0, per_rank - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.ranks)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class ExpertParallelExperts(Experts):
    """The rank's ``experts`` (a range of the ``num_experts``) whole, with their biases where the
    experts have them. Routed ids of other ranks' experts become -1, which the expert op skips: the
    rank's output is its experts' part of the sum. Its checkpoint layouts are the unsplit module's
    (``unsplit``: any layout a subclass of ``Experts`` declares) cut to its experts: of one tensor
    per expert, its experts' (the others ``Shard.elsewhere``); of a stacked tensor, its experts'
    slice."""

    def __init__(self, experts: slice, unsplit: Experts):
        _, hidden_size, intermediate_size = unsplit.down_proj.shape
        super().__init__(experts.stop - experts.start, hidden_size, intermediate_size, unsplit.hidden_act,
                         bias=unsplit.gate_up_proj_bias is not None)
        self.experts, self.total_experts = experts, unsplit.num_experts
        self.unsplit_shards = unsplit.checkpoint_shards

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        return {name: OneOf(*(self._held(layout) for layout in declaration))
                if isinstance(declaration, OneOf) else self._held(declaration)
                for name, declaration in self.unsplit_shards(prefix).items()}

    def _held(self, layout) -> list[Shard]:
        held = []
        for shard in layout:
            first = shard.index[0] if shard.index else slice(None)
            if isinstance(first, int):  # one expert's tensor
                if self.experts.start <= first < self.experts.stop:
                    held.append(dataclasses.replace(shard, index=(first - self.experts.start, *shard.index[1:])))
                else:
                    held.append(Shard.elsewhere(shard.name))
            else:  # every expert's, stacked along the first dimension
                assert first == slice(None), f"{shard.name}: a stacked layout covers every expert"
                held.append(dataclasses.replace(shard, source=(self.experts, *shard.source[1:])))
        return held

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(x, topk_weights, ids_within(topk_ids, self.experts))

    def extra_repr(self) -> str:
        return f"experts={self.experts.start}..{self.experts.stop - 1} of {self.total_experts}, " + super().extra_repr()


class TensorParallelExperts(Experts):
    """Every expert's ``rows`` of its ``intermediate_size`` (its gate and up rows, its down columns):
    the rank's output is its rows' part of every expert's. Sliced tensors load dequantised. Reads the
    per-expert layout of the hub's checkpoints and the stacked one transformers may save (its
    gate_up tensor read in two parts, the rank's gate rows and its up rows)."""

    def __init__(self, rows: slice, intermediate_size: int, num_experts: int, hidden_size: int, hidden_act: str):
        super().__init__(num_experts, hidden_size, rows.stop - rows.start, hidden_act)
        self.fp8_parameters = ()
        self.rows = rows
        self.up_rows = slice(intermediate_size + rows.start, intermediate_size + rows.stop)  # of a stacked gate_up

    def checkpoint_shards(self, prefix: str) -> dict[str, OneOf]:
        size, every = self.intermediate_size, slice(None)
        gate, up = slice(0, size), slice(size, 2 * size)
        experts = range(self.num_experts)
        per_expert_gate_up = [Shard(f"{prefix}.{e}.{source}.weight", (e, rows), (self.rows,)) for e in experts
                              for source, rows in (("gate_proj", gate), ("up_proj", up))]
        per_expert_down = [Shard(f"{prefix}.{e}.down_proj.weight", (e,), (every, self.rows)) for e in experts]
        stacked_gate_up = [Shard(f"{prefix}.gate_up_proj", (every, gate), (every, self.rows)),
                           Shard(f"{prefix}.gate_up_proj", (every, up), (every, self.up_rows))]
        stacked_down = [Shard(f"{prefix}.down_proj", (), (every, every, self.rows))]
        return {"gate_up_proj": OneOf(per_expert_gate_up, stacked_gate_up),
                "down_proj": OneOf(per_expert_down, stacked_down)}


def tensor_parallel(model: nn.Module, group, expert_parallel: bool | None = None) -> nn.Module:
    """Replace, in place, the dense layers of ``model`` (built on the meta device, not loaded) by
    their parallel forms for this process's rank in ``group`` (a ``torch.distributed`` process
    group): attention, latent attention, gated and ungated MLP, mixture of experts, embedding and LM head.
    ``expert_parallel``: a mixture of experts holds whole experts per rank (True) or every expert's
    slice of intermediate rows (False); None: whole experts where the ranks divide the experts.
    Routers, norms, rotary tables, a vision tower and its projector, and the parameters a module names
    in ``replicated_parameters`` are replicated. Raises for a module with weights it cannot split,
    and for sizes the ranks do not divide."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    embeddings: dict[int, VocabParallelEmbedding] = {}
    replicated: set[int] = set()  # modules every rank holds whole
    split: set[int] = set()  # shared experts, split with their mixture of experts; attention, its sinks split
    for name, module in list(model.named_modules()):
        if id(module) in split or id(module) in replicated:
            continue
        if isinstance(module, (CLIPVisionTower, MultiModalProjector)):
            replicated.update(id(m) for m in module.modules())
        elif isinstance(module, Attention):
            _split_attention(module, name, rank, ranks, group)
            split.add(id(module))
        elif isinstance(module, MLAttention):
            _split_latent_attention(module, name, rank, ranks, group)
            latent = [module.kv_a_proj_with_mqa, module.kv_a_layernorm]
            if module.q_lora_rank is not None:
                latent += [module.q_a_proj, module.q_a_layernorm]
            replicated.update(id(m) for m in latent)
        elif isinstance(module, SparseMoE):
            _split_moe(module, name, rank, ranks, group, expert_parallel)
            split.update(id(m) for m in (module.shared_expert, module.shared_experts) if m is not None)
            if module.shared_expert_gate is not None:
                replicated.add(id(module.shared_expert_gate))
        elif isinstance(module, GatedMLP):
            _split_mlp(module, rank, ranks, group)
        elif isinstance(module, UngatedMLP):
            _split_ungated_mlp(module, rank, ranks, group)
        elif type(module) is VocabEmbedding:
            vocab_size, hidden_size = module.weight.shape
            parallel = VocabParallelEmbedding(rank_range(vocab_size, rank, ranks), hidden_size, group, module.scale)
            embeddings[id(module.weight)] = parallel
            _replace(model, name, parallel)
        elif type(module) is LMHead:
            vocab_size, hidden_size = module.weight.shape
            _replace(model, name, VocabParallelLMHead(rank_range(vocab_size, rank, ranks), vocab_size, hidden_size,
                                                      group, ranks, tie_to=embeddings.get(id(module.weight)),
                                                      bias=module.bias is not None))
    parallel_types = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead,
                      ExpertParallelExperts, TensorParallelExperts)
    replicated_types = (RMSNorm, LayerNorm, RotaryEmbedding, TopKRouter)
    for name, module in model.named_modules():
        if isinstance(module, parallel_types + replicated_types) or id(module) in replicated | split:
            continue
        own = {local for local, _ in module.named_parameters(recurse=False)}
        if own - set(getattr(module, "replicated_parameters", ())):
            raise NotImplementedError(f"tensor parallelism cannot split {name} ({type(module).__name__}): it splits "
                                      "attention, latent attention, MLPs, experts, embeddings and LM heads")
    return model


def _split_attention(attention: Attention, name: str, rank: int, ranks: int, group) -> None:
    q_norm, k_norm = attention.qk_norms
    if q_norm is not None and not attention.qk_norm_per_head:
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
                                              qkv.output_sizes, bias=qkv.bias is not None)
    o = attention.o_proj
    attention.o_proj = RowParallelLinear(rows[0], o.out_features, group, bias=o.bias is not None)
    attention.num_heads, attention.num_kv_heads = q_heads.stop - q_heads.start, kv.stop - kv.start
    if attention.sinks is not None:
        attention.sinks = nn.Parameter(torch.empty(attention.num_heads, device=attention.sinks.device),
                                       requires_grad=False)
        attention.sink_heads = q_heads
    if q_norm is not None and attention.qk_norm_weight_per_head:
        for norm_name, norm, held in zip(attention.qk_norm_names, (q_norm, k_norm), (q_heads, kv)):
            setattr(attention, norm_name, _split_head_norm(norm, held))


def _split_head_norm(norm: LayerNorm, heads: slice) -> HeadParallelLayerNorm:
    num_heads, head_dim = norm.weight.shape
    return HeadParallelLayerNorm(heads, num_heads, head_dim, norm.eps, norm.bias is not None, norm.weight_offset)


def _split_latent_attention(attention: MLAttention, name: str, rank: int, ranks: int, group) -> None:
    heads = split_evenly(attention.num_heads, rank, ranks, f"{name}'s attention heads")

    def head_rows(head_size: int) -> slice:
        return slice(heads.start * head_size, heads.stop * head_size)

    q_head = attention.qk_nope_head_dim + attention.qk_rope_head_dim
    q_name = "q_proj" if attention.q_lora_rank is None else "q_b_proj"
    q = getattr(attention, q_name)
    setattr(attention, q_name, ColumnParallelLinear(q.in_features, [head_rows(q_head)], [q_name], [q.out_features]))
    kv_b = attention.kv_b_proj
    attention.kv_b_proj = ColumnParallelLinear(
        kv_b.in_features, [head_rows(attention.qk_nope_head_dim + attention.v_head_dim)], ["kv_b_proj"],
        [kv_b.out_features])
    o = attention.o_proj
    attention.o_proj = RowParallelLinear(head_rows(attention.v_head_dim), o.out_features, group,
                                         bias=o.bias is not None)
    attention.num_heads = heads.stop - heads.start


def _split_moe(moe: SparseMoE, name: str, rank: int, ranks: int, group, expert_parallel: bool | None) -> None:
    if moe.shared_experts is not None and moe.shared_experts.down_proj.bias is not None:
        raise NotImplementedError(f"tensor parallelism cannot split {name}'s shared experts: their down_proj has a "
                                  "bias, which the block's one all-reduce of its ranks' outputs would add on every "
                                  "rank")
    experts = moe.experts
    num_experts, intermediate = experts.num_experts, experts.intermediate_size
    hidden_size = experts.gate_up_proj.shape[2]
    # Whole experts only where they have biases (a slice of rows would add a down bias on every rank)
    # or a checkpoint layout of their own (TensorParallelExperts declares the common ones).
    whole_only = experts.gate_up_proj_bias is not None or type(experts) is not Experts
    if whole_only and expert_parallel is False:
        raise NotImplementedError(f"tensor parallelism cannot split {name}'s experts by intermediate rows: they have "
                                  "biases or a checkpoint layout of their own; they split by whole experts")
    if expert_parallel is None and not whole_only:
        if num_experts % ranks and intermediate % ranks:
            raise ValueError(f"parallelism over {ranks} ranks: {name} has {num_experts} experts of intermediate size "
                             f"{intermediate}, neither a multiple of {ranks}")
        expert_parallel = num_experts % ranks == 0
    if expert_parallel or whole_only:
        held = split_evenly(num_experts, rank, ranks, f"{name}'s experts")
        moe.experts = ExpertParallelExperts(held, experts)
    else:
        rows = split_evenly(intermediate, rank, ranks, f"{name}'s expert intermediate size")
        moe.experts = TensorParallelExperts(rows, intermediate, num_experts, hidden_size, experts.hidden_act)
    for shared in (moe.shared_expert, moe.shared_experts):
        if shared is not None:  # its partial output joins the experts' in the block's all-reduce
            _split_mlp(shared, rank, ranks, None)
    moe.group = group


def _split_mlp(mlp: GatedMLP, rank: int, ranks: int, group) -> None:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    rows = split_evenly(down.in_features, rank, ranks, "the MLP's intermediate size")
    mlp.gate_up_proj = ColumnParallelLinear(gate_up.in_features, [rows, rows], gate_up.sources,
                                            gate_up.output_sizes, bias=gate_up.bias is not None)
    mlp.down_proj = RowParallelLinear(rows, down.out_features, group, bias=down.bias is not None)


def _split_ungated_mlp(mlp: UngatedMLP, rank: int, ranks: int, group) -> None:
    up, down = getattr(mlp, mlp.up_name), getattr(mlp, mlp.down_name)
    rows = split_evenly(down.in_features, rank, ranks, "the MLP's intermediate size")
    setattr(mlp, mlp.up_name, ColumnParallelLinear(up.in_features, [rows], [mlp.up_name], [up.out_features],
                                                   bias=up.bias is not None))
    setattr(mlp, mlp.down_name, RowParallelLinear(rows, down.out_features, group, bias=down.bias is not None))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, module)
