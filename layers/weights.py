"""How a parameter declares the checkpoint tensors that fill it.

A parameter of a plain module is filled by the checkpoint tensor of the same qualified name.
A module whose parameters are fused from several HuggingFace tensors (QKV, gate-up, stacked
experts) implements ``checkpoint_shards(prefix)`` and returns, for each of its parameters, the
shards that tile it: a list of ``Shard``, or ``OneOf(layout, layout, ...)`` when checkpoints store
the parameter in more than one way (stacked experts: one tensor per expert and projection, or the
stacked tensor itself). The one generic loader in ``loaders/`` reads these declarations; no model
writes a loading loop.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """The checkpoint tensor ``name``, or only its part ``name[source]``, fills ``parameter[index]``
    (index tuples of ints/slices). A tensor-parallel layer declares the part its rank holds in
    ``source``; the loader then reads only that part's bytes. ``source=None`` (``elsewhere``): a
    tensor another rank holds whole (an expert of expert parallelism), part of the layout but never
    read here; its ``index`` selects nothing. ``transposed``: the tensor (its part) holds
    ``parameter[index]`` with the last two dimensions swapped (GPT-OSS stores its experts as
    [experts, in, out], where a zoo weight is [out, in]); the loader swaps them back as it copies."""

    name: str
    index: tuple = ()
    source: tuple | None = ()
    transposed: bool = False

    @classmethod
    def elsewhere(cls, name: str) -> "Shard":
        return cls(name, (slice(0, 0),), None)


class OneOf(tuple):
    """Alternative layouts of one parameter, in order of preference; each is a list of shards that
    tiles the whole parameter. The loader takes the first layout the checkpoint holds completely,
    and reports what is missing from the closest one when none is complete."""

    def __new__(cls, *layouts):
        return super().__new__(cls, (tuple(layout) for layout in layouts))


def parent_of(prefix: str) -> str:
    """The qualified name of a module's parent: fused modules read their siblings' HF names."""
    return prefix.rpartition(".")[0]
