"""Serving under open-loop load: `zoo serve` (and `transformers serve` with --peer hf) over HTTP.

For each request rate, requests arrive as a Poisson process (exponential gaps, seeded) whatever
the server's pace, each a streamed ``/v1/chat/completions`` call (one user message; the route
every version of ``transformers serve`` has) through the openai client, greedy, with a prompt and
an output length drawn uniformly from [0.5, 1.5] x the given means (seeded: every server and rate
gets the same requests). Reported per rate: output tokens/s over the span from
the first arrival to the last token, requests/s, time to first token (TTFT) and inter-token
latency (ITL, the gaps between streamed chunks that carry text) at p50 and p99. Both servers are
asked to ignore EOS, so that each request produces its drawn length on both: zoo by its
``ignore_eos`` field, the peer by a ``generation_config`` field (the JSON of a GenerationConfig,
which transformers serve builds its own from) with ``eos_token_id`` -1. Output tokens are each
response's usage (``stream_options.include_usage``), and each row says how many requests produced
their drawn length. Beside each server's rows, its start-up: from its launch to its first answer on
``/health``, and its first request (untimed; the peer loads its model in it).

Each rate's requests are shared among client processes (--clients, by default one per two cores
up to 8), all on one schedule: one Python process streaming tens of responses at once spends more
CPU per chunk than the server (openai's parsing and models), falls behind, and would read chunks
in bursts that the ITL charges to the server.

The script starts each server on a free loopback port, runs every rate against it and stops it.
With --compile-decode zoo serves twice: eagerly, then with ``zoo serve --compile-decode`` (CPU
decode steps through one graph torch.compile builds at start).
Models: the embedded SmolLM2-135M-Instruct (default), any checkpoint (--model), or --shape 8b: a
random bf16 Llama-3.1-8B-shaped checkpoint (SmolLM2's tokenizer and vocabulary) written to
--workdir and served by both servers. With --peer hf, a GGUF file is first dequantized into a
float32 checkpoint in --workdir, which both servers serve (the peer loads no GGUF file). Prompts
are random words of the tokenizer, decoded to text, so their lengths in tokens are close to the
drawn ones (plus the chat template's few).

    .venv/bin/python benchmarks/bench_serve.py --rates 0.5 --requests 16 --peer hf  # CPU, SmolLM2
    python3 benchmarks/bench_serve.py --shape 8b --rates 1,4,16 --requests 200 --peer hf   # H200
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.startup import stage, startup_text  # noqa: E402
from benchmarks.workdir import written_once  # noqa: E402
from loaders import load_tokenizer  # noqa: E402
from loaders.default_model import default_model_path  # noqa: E402


# A rate's schedule begins this long after its shares are handed to the client processes.
CLIENTS_READY_S = 0.5


@dataclass
class Request:
    arrival: float  # seconds after the start of the run
    prompt: str
    output_len: int


@dataclass
class Result:
    sent: float
    asked: int  # the request's drawn output length
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carries text
    tokens: int | None = None  # output tokens, as the response's usage gives them
    error: str | None = None


def workload(tokenizer, rate: float, count: int, input_len: int, output_len: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    # Ordinary words: ids past the specials, whose decoded text re-tokenises to about as many ids.
    words = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids][256:]
    requests, clock = [], 0.0
    for _ in range(count):
        clock += rng.expovariate(rate)
        length = rng.randint(max(1, input_len // 2), input_len * 3 // 2)
        prompt = tokenizer.decode([rng.choice(words) for _ in range(length)])
        requests.append(Request(clock, prompt, rng.randint(max(1, output_len // 2), output_len * 3 // 2)))
    return requests


async def send(client, model: str, request: Request, start: float, extra_body: dict) -> Result:
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    result = Result(time.perf_counter(), request.output_len)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": request.prompt}], max_tokens=request.output_len,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                result.chunk_times.append(time.perf_counter())
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        result.error = str(exc)
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def send_share(base_url: str, model: str, requests: list[Request], start: float,
                     extra_body: dict) -> list[Result]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600)
    results = await asyncio.gather(*(send(client, model, r, start, extra_body) for r in requests))
    await client.close()
    return results


def share_in_process(base_url: str, model: str, requests: list[Request], start: float,
                     extra_body: dict) -> list[Result]:
    return asyncio.run(send_share(base_url, model, requests, start, extra_body))


def client_started(started) -> None:
    with started.get_lock():
        started.value += 1


class Clients:
    """Client processes, spawned with this script imported (openai, the loaders), that share each
    rate's requests: each sends every ``count``-th request, all on one schedule (time.perf_counter
    is the system's monotonic clock, the same in every process). A share holds its process at least
    until the schedule begins, by when every process has taken one."""

    def __init__(self, count: int):
        context = multiprocessing.get_context("spawn")
        self.count = count
        self.started = context.Value("i", 0)
        self.pool = context.Pool(count, initializer=client_started, initargs=(self.started,))

    def send(self, base_url: str, model: str, requests: list[Request], extra_body: dict) -> tuple[float, list[Result]]:
        """The schedule's start and each request's result."""
        while self.started.value < self.count:
            time.sleep(0.05)
        start = time.perf_counter() + CLIENTS_READY_S
        shares = [(base_url, model, requests[i :: self.count], start, extra_body) for i in range(self.count)]
        return start, [result for share in self.pool.starmap(share_in_process, shares) for result in share]

    def __enter__(self) -> "Clients":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.terminate()


def run_rate(clients: Clients, base_url: str, model: str, requests: list[Request], extra_body: dict) -> dict:
    start, results = clients.send(base_url, model, requests, extra_body)
    done = [r for r in results if r.error is None and r.chunk_times]
    first = min((r.sent for r in results), default=start)  # the schedule's first arrival, not its start
    end = max((r.chunk_times[-1] for r in done), default=first)
    ttft = [r.chunk_times[0] - r.sent for r in done]
    gaps = [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] for r in done]  # each request's
    itl = [gap for request_gaps in gaps for gap in request_gaps]
    if any(r.tokens is None for r in done):
        raise RuntimeError(f"the server at {base_url} gave no usage at the end of a streamed response")
    tokens = sum(r.tokens for r in done)
    errors = [r.error for r in results if r.error is not None]
    # Each request's send time (s after the rate's start), TTFT and longest gap between chunks (ms):
    # whether the slow ones come together (a stall of the server) or alone (their own prompt).
    per_request = [dict(sent_s=r.sent - start, ttft_ms=1e3 * first, total_ms=1e3 * (r.chunk_times[-1] - r.sent),
                        longest_gap_ms=1e3 * max(request_gaps, default=0.0), chunks=len(r.chunk_times),
                        tokens=r.tokens, asked=r.asked)
                   for r, first, request_gaps in zip(done, ttft, gaps)]
    return dict(requests=len(requests), completed=len(done), errors=len(errors), first_error=errors[0] if errors else None,
                drawn_lengths=sum(r.tokens == r.asked for r in done),
                seconds=end - first, output_tokens=tokens, output_tokens_per_s=tokens / (end - first),
                requests_per_s=len(done) / (end - first), ttft_p50_ms=1e3 * percentile(ttft, 50),
                ttft_p99_ms=1e3 * percentile(ttft, 99), itl_p50_ms=1e3 * percentile(itl, 50),
                itl_p99_ms=1e3 * percentile(itl, 99), per_request=per_request)


def default_clients() -> int:
    """A client process per two cores, up to 8; one on a small machine (the module's docstring says why)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: list[str], base_url: str, log_path: Path, timeout_s: float) -> subprocess.Popen:
    """The server process, once ``/health`` answers."""
    print(f"$ {' '.join(command)}  (log: {log_path})", flush=True)
    process = subprocess.Popen(command, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log_path}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(1)


def random_8b_checkpoint(workdir: Path, tokenizer_path: str | None) -> Path:
    """A random bf16 Llama-3.1-8B-shaped checkpoint with SmolLM2's tokenizer, or the one at
    ``tokenizer_path`` (built on the GPU)."""
    import torch

    from bench_gpu import LLAMA_8B, random_hf

    def write(folder: Path) -> None:
        tokenizer = load_tokenizer(tokenizer_path or str(default_model_path()))
        model = random_hf({**LLAMA_8B, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id})
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()

    return written_once(workdir / "llama-8b-shape-random", write)


def dequantized_checkpoint(gguf: Path, workdir: Path) -> Path:
    """A GGUF file's model dequantized to a float32 safetensors checkpoint with its tokenizer, for
    ``transformers serve``, which loads no GGUF file (both servers then serve this directory)."""
    import torch
    import transformers

    def write(folder: Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        # Its weights are dequantized at load: what marks them quantized only stops save_pretrained.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)

    return written_once(workdir / f"{gguf.stem}-float32", write)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory, .gguf file or hub repo id (default: the embedded SmolLM2)")
    parser.add_argument("--shape", choices=["8b"], help="serve a random Llama-3.1-8B-shaped bf16 checkpoint instead")
    parser.add_argument("--tokenizer", help="the tokenizer of --shape 8b's checkpoint (default: SmolLM2's)")
    parser.add_argument("--workdir", help="where the checkpoints of --shape 8b and of --peer hf with a GGUF file, "
                                          "and the servers' logs, are written (default: a temporary directory)")
    parser.add_argument("--rates", default="0.5", help="comma-separated request rates (requests/s)")
    parser.add_argument("--requests", type=int, default=16, help="requests per rate")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", choices=["hf"], help="also run `transformers serve` on the same requests")
    parser.add_argument("--device", help="both servers' device (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="zoo's --dtype (the peer takes the checkpoint's)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="zoo's --max-num-seqs")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also run zoo serve --compile-decode (CPU decode steps through one compiled graph)")
    parser.add_argument("--startup-timeout", type=float, default=1800, help="seconds a server may take to start")
    parser.add_argument("--clients", type=int, default=default_clients(),
                        help="client processes sharing each rate's requests (default: one per two cores, up to 8)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_serve_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(random_8b_checkpoint(workdir, args.tokenizer)) if args.shape else args.model or str(default_model_path())
    if args.peer == "hf" and model.endswith(".gguf"):
        model = str(dequantized_checkpoint(Path(model), workdir))
    tokenizer = load_tokenizer(model)
    rates = [float(rate) for rate in args.rates.split(",")]
    device = ["--device", args.device] if args.device else []
    # Each server: its command, the model name its requests give, and their extra body, which turns
    # EOS off: zoo's own field; for the peer a generation config, whose EOS its CB manager takes per
    # request (-1: none).
    zoo = [sys.executable, "-m", "runtime.cli", "serve", model, "--served-model-name", "bench",
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), *device]
    servers = {"zoo": (zoo, "bench", {"ignore_eos": True})}
    if args.compile_decode:
        servers["zoo --compile-decode"] = ([*zoo, "--compile-decode"], "bench", {"ignore_eos": True})
    if args.peer == "hf":
        transformers_cli = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
        # The model is named by each request and loaded by the first (the first untimed one below).
        servers["hf"] = ([transformers_cli, "serve", "--continuous-batching", *device], model,
                         {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})})
    print(f"bench_serve: {model}, rates {rates} req/s, {args.requests} requests each, prompts ~{args.input_len} "
          f"tokens, outputs ~{args.output_len} tokens (U[0.5, 1.5] x mean), seed {args.seed}", flush=True)

    results = {}
    with Clients(args.clients) as clients:  # started while the servers start
        for name, (command, served, extra_body) in servers.items():
            run_server(name, command, served, extra_body, clients, model, tokenizer, rates, args, workdir, results)


def run_server(name: str, command: list[str], served: str, extra_body: dict, clients: Clients, model: str,
               tokenizer, rates: list[float], args, workdir: Path, results: dict) -> None:
    """Starts the server ``name``, runs the untimed requests and every rate against it, adds its rows
    and its start-up to ``results`` and stops it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [*command, "--host", "127.0.0.1", "--port", str(port)]
    startup = {}
    with stage(startup, "launch to /health"):
        process = start_server(command, base_url, workdir / f"{name}_server.log", args.startup_timeout)
    try:
        # Untimed first, as not load: one request (the peer loads its model; the first call of each of
        # the server's paths: allocation, compile, graphs), then one per client process at once (each
        # process's first call: openai's lazy imports).
        first = run_rate(clients, base_url, served, workload(tokenizer, 1.0, 1, 8, 4, args.seed + 1), extra_body)
        if first["completed"] != 1:
            raise RuntimeError(f"{name}: the first request failed: {first['first_error']}")
        startup["first request"] = first["per_request"][0]["total_ms"] / 1e3
        results[f"{name} start-up"] = startup
        print(f"{name} {startup_text(startup)}", flush=True)
        one_each = workload(tokenizer, 10.0 * clients.count, clients.count, 8, 4, args.seed + 2)
        run_rate(clients, base_url, served, one_each, extra_body)
        for rate in rates:
            requests = workload(tokenizer, rate, args.requests, args.input_len, args.output_len, args.seed)
            row = run_rate(clients, base_url, served, requests, extra_body)
            results[f"{name}@{rate}"] = row
            print(f"{name:>4} {rate:6.2f} req/s: {row['completed']}/{row['requests']} done "
                  f"({row['drawn_lengths']} of their drawn length), {row['output_tokens']} tokens, "
                  f"{row['output_tokens_per_s']:8.1f} output tok/s, {row['requests_per_s']:6.2f} req/s, "
                  f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 {row['ttft_p99_ms']:8.1f} ms, "
                  f"ITL p50 {row['itl_p50_ms']:7.1f} ms p99 {row['itl_p99_ms']:7.1f} ms"
                  + (f"; {row['errors']} errors, first: {row['first_error']}" if row["errors"] else ""),
                  flush=True)
            slowest = sorted(row["per_request"], key=lambda r: r["ttft_ms"], reverse=True)[:3]
            print("     slowest TTFTs: " + ", ".join(f"{r['ttft_ms']:.0f} ms (sent at {r['sent_s']:.2f} s)"
                                                  for r in slowest), flush=True)
            if args.json:  # written after every rate, so an interrupted run keeps what it measured
                Path(args.json).write_text(json.dumps(dict(model=model, args=vars(args), results=results), indent=2))
    finally:
        process.terminate()
        print(f"{name} server exited with status {process.wait(timeout=120)}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
