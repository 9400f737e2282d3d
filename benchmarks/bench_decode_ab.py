"""Batch-1 decode with chosen Triton kernels taken from another tree, against this tree's own, in one
process and alternating: an A/B that the drift between machines (±3%) and over a run cannot blur.

    git worktree add /tmp/base <commit>          # or any copy of the other tree
    python3 benchmarks/bench_decode_ab.py /tmp/base ops_cuda/triton_kernels.py:_rms_norm_kernel \\
        ops_cuda/paged_attention_triton.py:_decode_split_kernel --shape qwen3-30b-a3b --pairs 4

Each FILE:NAME is loaded from the other tree's FILE, as a module of its own that imports this tree's
packages, and put in place of NAME in this tree's module of FILE for the "base" configurations (the
launchers look their kernels up when they run). A kernel keeps its launcher's arguments: an A/B of
its body, not of its signature; to change a signature too, swap the launcher (the op files import
theirs when they run), which brings the other tree's kernels with it. Where the other tree's files
named import from one another (a launcher's file from a helper's), they get each other's objects,
not this tree's: with helpers whose signatures changed, name the helper's file too, e.g.

    python3 benchmarks/bench_decode_ab.py /tmp/base ops_cuda/moe_decode.py:moe_experts_mxfp4_token \
        ops_cuda/mxfp4_triton.py:mxfp4_rows_times_vector --shape gpt-oss-20b

Random bf16 weights of the shape, one model (gpt-oss-20b: its experts random MXFP4, as
bench_moe.py --experts mxfp4 builds them); per configuration a fresh LLM (max_model_len as
bench_decode_without.py's; CUDA graphs captured with the kernels in place), a 128-token prompt and
256 greedy tokens timed five times, as bench_decode_without.py does; "this" and "base" alternate
--pairs times. Prints the fastest, the median and all five runs of each configuration.

Each --also LABEL=TREE adds a configuration to every round, the same FILE:NAMEs taken from TREE
(variants of a kernel or of its tiles, timed beside the two on one model, which for the
Qwen3-30B-A3B shape takes a minute to build):

    python3 benchmarks/bench_decode_ab.py /tmp/base ops_cuda/moe_decode.py:gpu_token_tiles \
        --also two_rows=/tmp/two_rows --also narrow_steps=/tmp/narrow_steps
"""

import argparse
import contextlib
import importlib
import importlib.util
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode_without import (  # noqa: E402
    MAX_MODEL_LEN,
    MAX_MODEL_LEN_HELP,
    MXFP4_SHAPES,
    SHAPES,
    model_and_prompt,
    time_decode,
)
from bench_moe import free_memory  # noqa: E402


def base_kernels(base: Path, names: list[str]) -> list[tuple[object, str, object]]:
    """(this tree's module, NAME, the other tree's object of that name) for each FILE:NAME."""
    loaded, ours, swaps = {}, {}, []
    for spec in names:
        file, _, name = spec.partition(":")
        if not name or not file.endswith(".py"):
            raise ValueError(f"{spec!r}: give FILE.py:NAME, a path from the tree's root and a name in it")
        if not (base / file).is_file():
            raise FileNotFoundError(f"{spec!r}: no {file} under {base}")
        ours[file] = module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
        if file not in loaded:
            alias = "base_" + file.removesuffix(".py").replace("/", "_")
            module_spec = importlib.util.spec_from_file_location(alias, base / file)
            loaded[file] = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(loaded[file])
        for tree, where in ((module, "this tree"), (loaded[file], str(base))):
            if not hasattr(tree, name):
                raise AttributeError(f"{spec!r}: {where}'s {file} has no {name}")
        swaps.append((module, name, getattr(loaded[file], name)))
    link_base_modules(loaded, ours)
    return swaps


def link_base_modules(loaded: dict, ours: dict) -> None:
    """In each loaded base module, the names it imported from another named file (this tree's objects,
    since it imports this tree's packages) rebound to that file's base objects. Triton kernels look
    their globals up in their module when they compile, so the base launcher runs the base helpers."""
    for file, base_module in loaded.items():
        for other, other_base in loaded.items():
            if other == file:
                continue
            for name, value in list(vars(base_module).items()):
                if value is getattr(ours[other], name, None) and hasattr(other_base, name):
                    setattr(base_module, name, getattr(other_base, name))


@contextlib.contextmanager
def swapped(swaps):
    """The other tree's objects in place of this tree's, put back on exit."""
    with contextlib.ExitStack() as stack:
        for module, name, theirs in swaps:
            stack.enter_context(mock.patch.object(module, name, theirs))
        yield


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="the other tree's root")
    parser.add_argument("kernels", nargs="+", metavar="FILE:NAME")
    parser.add_argument("--shape", choices=(*SHAPES, *MXFP4_SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=TREE",
                        help="one more configuration: the same FILE:NAMEs from TREE (repeatable)")
    parser.add_argument("--pairs", type=int, default=3, help="rounds, each running every configuration once")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=MAX_MODEL_LEN_HELP)
    args = parser.parse_args()
    trees = {"base": args.base}
    for spec in args.also:
        label, _, tree = spec.partition("=")
        if not label or not tree or label in ("this", *trees):
            parser.error(f"--also {spec!r}: give LABEL=TREE with a label of its own (not this, base or one given)")
        trees[label] = Path(tree)
    configurations = {"this": []} | {label: base_kernels(tree, args.kernels) for label, tree in trees.items()}
    print({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
           **{label: str(tree) for label, tree in trees.items()}, "kernels": args.kernels,
           "max_model_len": args.max_model_len}, flush=True)
    model, prompt = model_and_prompt(args.shape)
    print("\n| kernels | ms/token, fastest | median | all runs |\n|---|---:|---:|---|", flush=True)
    for label, runs in rounds(configurations, args.pairs, lambda: time_decode(model, prompt, args.max_model_len)):
        print(f"| {label} | {min(runs):.3f} | {statistics.median(runs):.3f} | {', '.join(f'{r:.3f}' for r in runs)} |",
              flush=True)


def rounds(configurations: dict, count: int, timed):
    """(label, timed()) for each configuration in turn, its swaps in place, ``count`` rounds over all of them."""
    for _ in range(count):
        for label, swaps in configurations.items():
            with swapped(swaps):
                runs = timed()
            free_memory()
            yield label, runs


if __name__ == "__main__":
    main()
