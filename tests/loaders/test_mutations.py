"""Damaged checkpoints, 200 of each format: a seeded run of byte mutations of a GGUF file's header
(metadata, tokenizer, tensor infos) and of a safetensors file's header. Each case either loads
exactly the original weights or raises a ValueError (CheckpointError among them) with a message;
none crashes with another exception, hangs, or loads other weights."""

import random
import signal
import struct
from contextlib import contextmanager

import pytest
import torch
from gguf import GGUFReader

from loaders import load_tokenizer
from models import AutoModelForCausalLM
from tests.conftest import hf_model, save_checkpoint, tiny_config
from tests.loaders.gguf_writer import T, write_llama_gguf

CASES = 200
SECONDS_PER_CASE = 20  # far above a case's time: only a hang reaches it
TINY = dict(hidden=32, intermediate=64, layers=1, vocab=288, heads=2, kv_heads=1)  # the tokenizer's 275 tokens fit
INTERESTING = [0, 1, 2**31 - 1, 2**32 - 1, 0x40000040, 2**63 - 1, 2**64 - 1]


def mutated(data: bytes, header_end: int, rng: random.Random) -> bytes:
    """``data`` with one change inside its first ``header_end`` bytes: a random byte, a flipped
    bit, an aligned 4- or 8-byte field set to an extreme value, or the file cut short."""
    data = bytearray(data)
    kind = rng.random()
    at = rng.randrange(header_end)
    if kind < 0.45:
        data[at] = rng.randrange(256)
    elif kind < 0.7:
        data[at] ^= 1 << rng.randrange(8)
    elif kind < 0.9:
        size = rng.choice([4, 8])
        at -= at % size
        data[at:at + size] = struct.pack("<Q", rng.choice(INTERESTING))[:size]
    else:
        del data[at:]
    return bytes(data)


class Hung(Exception):
    pass


@contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise Hung(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def run_cases(path, original_bytes: bytes, header_end: int, load, seed: int) -> dict[str, int]:
    """Mutate, load, judge, for CASES cases; returns how many cases ended each way."""
    expected = weights(load(path))
    rng, outcomes, failures = random.Random(seed), {"loaded the original": 0, "clear error": 0}, []
    for case in range(CASES):
        path.write_bytes(mutated(original_bytes, header_end, rng))
        try:
            with time_limit(SECONDS_PER_CASE):
                model = load(path)
        except Hung as exc:
            failures.append(f"case {case}: hung ({exc})")
        except ValueError as exc:
            if str(exc).strip():
                outcomes["clear error"] += 1
            else:
                failures.append(f"case {case}: {type(exc).__name__} without a message")
        except Exception as exc:  # anything else is a crash the loader let through
            failures.append(f"case {case}: {type(exc).__name__}: {exc}")
        else:
            loaded = weights(model)
            if loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected):
                outcomes["loaded the original"] += 1
            else:
                failures.append(f"case {case}: loaded other weights without an error")
    assert not failures, "\n".join(failures)
    return outcomes


@pytest.mark.filterwarnings("ignore")  # mutated metadata may make transformers warn
def test_mutated_gguf_headers_load_the_original_or_fail_clearly(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, T.F32, tokenizer="gpt2", shape=TINY)
    original = path.read_bytes()

    def load(file):
        load_tokenizer(str(file))
        return AutoModelForCausalLM.from_pretrained(file)

    outcomes = run_cases(path, original, GGUFReader(path).data_offset, load, seed=17)
    assert outcomes["clear error"] >= CASES // 2


@pytest.mark.filterwarnings("ignore")
def test_mutated_safetensors_headers_load_the_original_or_fail_clearly(tmp_path):
    directory = save_checkpoint(hf_model(tiny_config("llama", num_hidden_layers=1)), tmp_path / "ckpt")
    path = directory / "model.safetensors"
    original = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]

    outcomes = run_cases(path, original, header_end, lambda file: AutoModelForCausalLM.from_pretrained(file.parent),
                         seed=23)
    assert outcomes["clear error"] >= CASES // 2
