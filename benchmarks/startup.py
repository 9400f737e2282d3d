"""The start-up a benchmark reports beside its timed figure and leaves out of it: each stage's seconds."""

import contextlib
import time


@contextlib.contextmanager
def stage(startup: dict, name: str):
    """Puts the seconds the block takes, a GPU's work included, in ``startup[name]``."""
    import torch  # here: bench_serve's client processes import this module and need no torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    startup[name] = time.perf_counter() - start


def startup_text(startup: dict) -> str:
    return "start-up, untimed: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.items())
