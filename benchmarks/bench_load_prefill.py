"""CPU benchmark: zoo against HuggingFace transformers, loading and a 512-token prefill.

Rows of the table (float32 on the CPU throughout):

  a. load SmolLM2-135M-Instruct Q4_1 GGUF   zoo ``AutoModelForCausalLM.from_pretrained(file)`` vs
                                            HF ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``
  b. load ~1 GB float32 safetensors dir     a random Llama-architecture model of ~258M parameters,
                                            written once with HF ``save_pretrained`` into --workdir
                                            (default: <system temp dir>/zoo-bench) and reused after
  c. prefill 512 tokens, batch 1            zoo ``m(ids)`` vs HF ``hf(input_ids=ids, use_cache=False).logits``
                                            on the SmolLM2 model, random token ids (seed 0), under
                                            ``torch.inference_mode()``

How it is measured:

* Loads run in fresh Python subprocesses of this script, one per implementation and repeat, so
  neither side inherits the other's imports or caches. Before the timed runs, one untimed load per
  implementation warms the OS file cache. Each timed subprocess first imports torch, transformers
  (including its ``AutoModelForCausalLM``) and zoo's ``models`` package for *both* sides, untimed,
  then times only the ``from_pretrained`` call with ``time.perf_counter``. Work a library defers
  to its first load (lazy imports such as transformers' per-architecture config and modeling
  modules, the gguf package) is inside the timer, for both alike: the "first load" row, what a
  user waits for. The same subprocess then loads the checkpoint a second time: the "loaded again"
  row, the loader's own work without any one-off cost. zoo and HF subprocesses alternate; each row
  is the median over --load-repeats subprocesses.
  Note on the safetensors rows: parameters that are one checkpoint tensor as stored come back as
  copy-on-write memory maps of the file on both sides, read on first use, after the timer. HF's
  Llama has only such parameters; zoo copies its fused q/k/v and gate/up weights (about half of
  this checkpoint's bytes) into its own storage inside its timer.
* Prefill: one subprocess loads both models (untimed), runs each forward once as a warm-up, then
  times --repeats forwards of each, zoo and HF alternating, and reports each side's median. The
  max abs difference of the two sides' logits and each side's warm-up forward (its first call,
  outside the median) are printed under the table.
* Both sides use the same torch thread count (torch's default unless --threads is given). The
  1-minute load average before and after the run is printed: on a busy machine, rerun.

Ratio = HF seconds / zoo seconds: above 1 means zoo is faster.

Run (also ``make bench``):

    .venv/bin/python benchmarks/bench_load_prefill.py [--repeats 5] [--load-repeats 3]
        [--workdir DIR] [--json results.json] [--threads N]
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workdir import written_once  # noqa: E402

PREFILL_TOKENS = 512
CHECKPOINT_NAME = "llama-258m-f32"
# A Llama-architecture config of ~258M parameters: 2 x 32000 x 1024 (embedding + untied head)
# + 15 layers x (4 x 1024^2 attention + 3 x 1024 x 2816 MLP) + norms = 258.3M, ~1.03 GB in float32.
LLAMA_CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=15,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    dtype="float32",
)
RESULT_MARK = "BENCH_RESULT "


# ---------------------------------------------------------------------------------------------
# Worker side: runs in a fresh subprocess, prints one RESULT_MARK line of JSON.


def _import_both():
    """Import both libraries (untimed) so that neither side's timer includes the import of torch,
    transformers or zoo; return the two from_pretrained entry points."""
    import torch  # noqa: F401
    import transformers

    from models import AutoModelForCausalLM as ZooAuto

    return ZooAuto, transformers.AutoModelForCausalLM


def _load(impl: str, path: Path):
    import torch

    zoo_auto, hf_auto = _import_both()
    if impl == "zoo":
        return lambda: zoo_auto.from_pretrained(path, dtype=torch.float32, device="cpu")
    if path.is_file():  # GGUF
        return lambda: hf_auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return lambda: hf_auto.from_pretrained(str(path), dtype=torch.float32).eval()


def worker(spec: dict) -> dict:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    path = Path(spec["path"])

    if spec["task"] == "load":
        load = _load(spec["impl"], path)
        start = time.perf_counter()
        model = load()
        first = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        del model
        gc.collect()
        start = time.perf_counter()  # again: the loader's own work, with every lazy import done
        load()
        again = time.perf_counter() - start
        return {"seconds": first, "again": again, "params": params}

    # prefill: both models in this one process, their forwards alternated so that both see the
    # same machine (a busy neighbour slows both sides alike, not one of them)
    zoo = _load("zoo", path)()
    hf = _load("hf", path)()
    ids = torch.randint(0, zoo.config.vocab_size, (1, spec["tokens"]), generator=torch.Generator().manual_seed(0))
    forwards = {"zoo": lambda: zoo(ids), "hf": lambda: hf(input_ids=ids, use_cache=False).logits}
    times = {impl: [] for impl in forwards}
    logits, first_call = {}, {}
    with torch.inference_mode():
        for impl, forward in forwards.items():  # warm-up, timed apart: each side's first call
            start = time.perf_counter()
            logits[impl] = forward()
            first_call[impl] = time.perf_counter() - start
        for _ in range(spec["repeats"]):
            for impl, forward in forwards.items():
                start = time.perf_counter()
                forward()
                times[impl].append(time.perf_counter() - start)
    out = {impl: {"seconds": statistics.median(runs), "runs": runs, "first_call_s": first_call[impl]}
           for impl, runs in times.items()}
    out["max_abs_diff_logits"] = float((logits["zoo"] - logits["hf"]).abs().max())
    return out


# ---------------------------------------------------------------------------------------------
# Driver side.


def run_worker(spec: dict) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not results:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"benchmark worker failed ({spec['task']}, {spec.get('impl', 'both')}), exit code {proc.returncode}")
    return json.loads(results[-1][len(RESULT_MARK):])


def ensure_safetensors_checkpoint(workdir: Path) -> Path:
    """The random float32 Llama checkpoint, created once with HF ``save_pretrained``."""

    def write(folder: Path) -> None:
        print(f"creating the float32 Llama checkpoint in {workdir / CHECKPOINT_NAME} (once) ...", file=sys.stderr,
              flush=True)
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG)).to(torch.float32)
        model.save_pretrained(folder)

    return written_once(workdir / CHECKPOINT_NAME, write)


def bench_load(path: Path, repeats: int, threads: int | None) -> dict:
    specs = {impl: {"task": "load", "impl": impl, "path": str(path), "threads": threads} for impl in ("zoo", "hf")}
    for spec in specs.values():
        run_worker(spec)  # untimed: warms the OS file cache
    runs = {impl: [] for impl in specs}
    for _ in range(repeats):  # zoo and HF alternate, so that both see the same machine
        for impl, spec in specs.items():
            runs[impl].append(run_worker(spec))
    return {
        impl: {
            "first": {"seconds": statistics.median(r["seconds"] for r in rs), "runs": [r["seconds"] for r in rs]},
            "again": {"seconds": statistics.median(r["again"] for r in rs), "runs": [r["again"] for r in rs]},
            "params": rs[0]["params"],
        }
        for impl, rs in runs.items()
    }


def load_rows(name: str, result: dict) -> list[dict]:
    """Two rows per checkpoint: the first load in a fresh process, and a second one in that process."""
    return [
        {"task": f"{name}: first load in the process", "zoo": result["zoo"]["first"], "hf": result["hf"]["first"]},
        {"task": f"{name}: loaded again, same process", "zoo": result["zoo"]["again"], "hf": result["hf"]["again"]},
    ]


def bench_prefill(path: Path, repeats: int, threads: int | None) -> dict:
    spec = {"task": "prefill", "path": str(path), "threads": threads, "tokens": PREFILL_TOKENS, "repeats": repeats}
    return run_worker(spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed prefill forwards (median reported)")
    parser.add_argument("--load-repeats", type=int, default=3, help="timed load subprocesses per side (median)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "zoo-bench",
                        help="cache dir for the generated safetensors checkpoint")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--threads", type=int, help="torch threads on both sides (default: torch's default)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(RESULT_MARK + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    import torch
    import transformers

    from loaders.default_model import default_model_path

    gguf = default_model_path()
    safetensors_dir = ensure_safetensors_checkpoint(args.workdir)
    size_gb = sum(f.stat().st_size for f in safetensors_dir.glob("*.safetensors")) / 1e9

    loadavg_before = os.getloadavg()[0]
    rows = []
    print("load GGUF ...", file=sys.stderr, flush=True)
    r = bench_load(gguf, args.load_repeats, args.threads)
    rows += load_rows(f"load {gguf.name} -> float32", r)
    print("load safetensors ...", file=sys.stderr, flush=True)
    r = bench_load(safetensors_dir, args.load_repeats, args.threads)
    rows += load_rows(f"load Llama {r['zoo']['params'] / 1e6:.0f}M float32 safetensors ({size_gb:.2f} GB)", r)
    print("prefill ...", file=sys.stderr, flush=True)
    r = bench_prefill(gguf, args.repeats, args.threads)
    rows.append({"task": f"prefill {PREFILL_TOKENS} tokens, batch 1, SmolLM2 float32 (median of {args.repeats})", **r})

    info = {
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg()[0],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads or torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_repeats": args.load_repeats,
        "prefill_repeats": args.repeats,
    }
    print(f"\nzoo vs HuggingFace transformers on CPU — {info['date']}")
    print(f"torch {info['torch']}, transformers {info['transformers']}, Python {info['python']}, "
          f"{info['cpu_count']} CPUs ({info['torch_threads']} torch threads), {info['cpu']}; "
          f"load average {info['loadavg_before']:.2f} before, {info['loadavg_after']:.2f} after\n")
    print("| task | zoo s | HF s | HF/zoo |")
    print("|---|---:|---:|---:|")
    for row in rows:
        zoo, hf = row["zoo"]["seconds"], row["hf"]["seconds"]
        row["ratio_hf_over_zoo"] = hf / zoo
        print(f"| {row['task']} | {zoo:.3f} | {hf:.3f} | {hf / zoo:.2f} |")
    print(f"\nloads: median of {args.load_repeats} fresh subprocesses per side, timing only from_pretrained "
          f"(torch/transformers/zoo imported beforehand, OS file cache warm); 'first' includes the lazy imports "
          f"and one-off set-up a library does on its first load, 'again' is a second load in the same process")
    print("safetensors: unfused parameters are copy-on-write memory maps of the file on both sides (read on first "
          "use, after the timer); zoo also copies its fused q/k/v and gate/up weights inside its timer")
    print(f"prefill: logits max |zoo - HF| = {rows[-1]['max_abs_diff_logits']:.2e}; first forward (untimed warm-up): "
          f"zoo {rows[-1]['zoo']['first_call_s']:.3f} s, HF {rows[-1]['hf']['first_call_s']:.3f} s")

    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
