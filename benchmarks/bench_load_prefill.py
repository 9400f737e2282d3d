"""CPU benchmark: zoo against HuggingFace transformers, loading and a 512-token prefill.

Rows of the table (float32 on the CPU throughout):

  a. load SmolLM2-135M-Instruct Q4_1 GGUF   zoo ``AutoModelForCausalLM.from_pretrained(file)`` vs
                                            HF ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``
  b. load ~1 GB float32 safetensors dir     a random Llama-architecture model of ~258M parameters,
                                            written once with HF ``save_pretrained`` into --workdir
                                            (default: <system temp dir>/zoo-bench) and reused after
  c. prefill 512 tokens, batch 1            zoo ``m(ids)`` vs HF ``hf(input_ids=ids, use_cache=False).logits``
                                            on the SmolLM2 model, under ``torch.inference_mode()``

How it is measured:

* Every measurement runs in a fresh Python subprocess of this script, one per implementation and
  repeat, so neither side inherits the other's imports, caches or allocator state.
* Loads: before the timed runs, one untimed load per implementation in its own subprocess warms
  the OS file cache. Each timed subprocess first imports torch, transformers (including its
  ``AutoModelForCausalLM``) and zoo's ``models`` package for *both* sides, untimed, then times
  only the ``from_pretrained`` call with ``time.perf_counter``. Work a library defers to its
  first load (lazy submodule imports such as transformers' per-architecture config and modeling
  modules, the gguf package) is inside the timer, for both alike: that is the "first load" row,
  what a user waits for. The same subprocess then loads the checkpoint a second time: the "loaded
  again" row, the loader's own work without any one-off cost. Each row is the median over
  --load-repeats subprocesses.
* Prefill: one subprocess per implementation loads the model (untimed), runs the forward once
  as a warm-up, then times --repeats forwards and reports their median. The last-position logits
  of both sides are compared and their max abs difference is printed under the table.
* Both sides use the same torch thread count (torch's default unless --threads is given).

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
    torch_dtype="float32",
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
    load = _load(spec["impl"], path)

    if spec["task"] == "load":
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

    # prefill
    model = load()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, spec["tokens"]), generator=torch.Generator().manual_seed(0))
    if spec["impl"] == "zoo":
        forward = lambda: model(ids)  # noqa: E731
    else:
        forward = lambda: model(input_ids=ids, use_cache=False).logits  # noqa: E731
    times = []
    with torch.inference_mode():
        logits = forward()  # warm-up
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            logits = forward()
            times.append(time.perf_counter() - start)
    torch.save(logits[0, -1].clone(), spec["logits_out"])
    return {"seconds": statistics.median(times), "times": times, "threads": torch.get_num_threads()}


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
        raise RuntimeError(f"benchmark worker failed ({spec['task']}, {spec['impl']}), exit code {proc.returncode}")
    return json.loads(results[-1][len(RESULT_MARK):])


def ensure_safetensors_checkpoint(workdir: Path) -> Path:
    """The random float32 Llama checkpoint, created once with HF ``save_pretrained``."""
    target = workdir / CHECKPOINT_NAME
    done = target / ".complete"
    if done.is_file():
        return target
    print(f"creating the float32 Llama checkpoint in {target} (once) ...", file=sys.stderr, flush=True)
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_CONFIG)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=CHECKPOINT_NAME + ".", dir=workdir))
    model.save_pretrained(tmp)
    del model
    if target.exists():  # an interrupted earlier attempt
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    done.write_text("")
    return target


def bench_load(path: Path, repeats: int, threads: int | None) -> dict:
    out = {}
    for impl in ("zoo", "hf"):
        spec = {"task": "load", "impl": impl, "path": str(path), "threads": threads}
        run_worker(spec)  # untimed: warms the OS file cache
        runs = [run_worker(spec) for _ in range(repeats)]
        out[impl] = {
            "first": {"seconds": statistics.median(r["seconds"] for r in runs), "runs": [r["seconds"] for r in runs]},
            "again": {"seconds": statistics.median(r["again"] for r in runs), "runs": [r["again"] for r in runs]},
            "params": runs[0]["params"],
        }
    return out


def load_rows(name: str, result: dict) -> list[dict]:
    """Two rows per checkpoint: the first load in a fresh process, and a second one in that process."""
    return [
        {"task": f"{name}: first load in the process", "zoo": result["zoo"]["first"], "hf": result["hf"]["first"]},
        {"task": f"{name}: loaded again, same process", "zoo": result["zoo"]["again"], "hf": result["hf"]["again"]},
    ]


def bench_prefill(path: Path, repeats: int, threads: int | None, workdir: Path) -> dict:
    import torch

    out = {}
    for impl in ("zoo", "hf"):
        logits_out = workdir / f"prefill-logits-{impl}.pt"
        spec = {"task": "prefill", "impl": impl, "path": str(path), "threads": threads, "tokens": PREFILL_TOKENS,
                "repeats": repeats, "logits_out": str(logits_out)}
        result = run_worker(spec)
        result["runs"] = result.pop("times")
        out[impl] = result
        out[impl]["logits"] = torch.load(logits_out)
        logits_out.unlink()
    zoo_logits, hf_logits = out["zoo"].pop("logits"), out["hf"].pop("logits")
    out["max_abs_diff_last_logits"] = float((zoo_logits - hf_logits).abs().max())
    return out


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

    rows = []
    print("load GGUF ...", file=sys.stderr, flush=True)
    r = bench_load(gguf, args.load_repeats, args.threads)
    rows += load_rows(f"load {gguf.name} -> float32", r)
    print("load safetensors ...", file=sys.stderr, flush=True)
    r = bench_load(safetensors_dir, args.load_repeats, args.threads)
    rows += load_rows(f"load Llama {r['zoo']['params'] / 1e6:.0f}M float32 safetensors ({size_gb:.2f} GB)", r)
    print("prefill ...", file=sys.stderr, flush=True)
    r = bench_prefill(gguf, args.repeats, args.threads, args.workdir)
    rows.append({"task": f"prefill {PREFILL_TOKENS} tokens, batch 1, SmolLM2 float32 (median of {args.repeats})", **r})

    info = {
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
          f"{info['cpu_count']} CPUs ({info['torch_threads']} torch threads), {info['cpu']}\n")
    print("| task | zoo s | HF s | HF/zoo |")
    print("|---|---:|---:|---:|")
    for row in rows:
        zoo, hf = row["zoo"]["seconds"], row["hf"]["seconds"]
        row["ratio_hf_over_zoo"] = hf / zoo
        print(f"| {row['task']} | {zoo:.3f} | {hf:.3f} | {hf / zoo:.2f} |")
    print(f"\nloads: median of {args.load_repeats} fresh subprocesses per side, timing only from_pretrained "
          f"(torch/transformers/zoo imported beforehand, OS file cache warm); 'first' includes the lazy imports "
          f"and one-off set-up a library does on its first load, 'again' is a second load in the same process")
    print(f"prefill: last-position logits max |zoo - HF| = {rows[-1]['max_abs_diff_last_logits']:.2e}")

    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
