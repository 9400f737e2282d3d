"""Run-ahead: step n+1 is launched before the ids that step n sampled reach the host.

Reading a step's sampled ids on the host waits for the whole step on the device. Instead, each
sampled token enters its sequence as ``PENDING``, the next step is scheduled and launched at
once, and only then does the host read the ids of the step before: its bookkeeping for one step
overlaps the device's work on the next. ``RunAhead`` holds the whole scheme:

1. The decision (``must_take_in_first``). The next step may run ahead unless it needs the
   pending ids on the host: a sampling setting reads them (penalties, logprobs), or the step may
   preempt a sequence (which would be recomputed from tokens the host does not have yet). Then the
   step in flight is taken in first. A sequence whose pending token is its last by length needs no
   waiting: the scheduler leaves it out of the next step (``Sequence.ends_with_pending_token``), and
   its row and blocks are freed once that token is taken in, after the next step's launch.
2. The ids on the device (``launch``). A launched step's sampled ids stay on the device in
   ``sampled_ids``, each sequence's row noted, and their copy to the host starts: on CUDA into
   one of two rows of a pinned buffer, used by turns, so that the copy does not wait for the next
   step. A decode graph writes its greedy ids into both itself (``write_greedy``): the host row
   through the buffer's device mapping, so no copy follows the graph.
3. The next step's inputs. Its input ids hold ``PENDING`` where a token is pending; ``sources``
   gives the row of ``sampled_ids`` each one is read from, ``fill_pending`` reads it there, on the
   device (inside a CUDA graph or a compiled step too).
4. The resolution (``resolve``). Once the next step is launched, the host waits for the copy and
   fills in each pending token. A sequence that an earlier token ended was computed ahead for
   nothing and is left as it is (``Sequence.finish`` dropped its pending tokens).

On the CPU a step has been computed by the time its launch returns: running ahead would overlap
nothing and only hold each token back a step (a request's first token, a streamed token, a finished
sequence's blocks). There each step is taken in as soon as it is launched (``runs_ahead`` False).
"""

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from runtime.scheduler import Scheduler
from runtime.sequence import Sequence, Status

PENDING = -1  # an input id still on its way from the device


@dataclass
class LaunchedStep:
    """A step on the device: what it computes, who samples, and what waits for the sampled ids."""

    scheduled: list[tuple[Sequence, int]]
    sampled: list[Sequence]
    token_ids: Callable[[], list[int]]


class RunAhead:
    def __init__(self, max_num_seqs: int, device: torch.device):
        self.device = device
        self.runs_ahead = device.type == "cuda"  # tests set it to run the scheme on the CPU
        self.in_flight: LaunchedStep | None = None  # the last step launched, not yet taken in
        self.num_steps_run_ahead = 0  # steps launched while the one before was in flight
        self.sampled_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.rows: dict[Sequence, int] = {}  # each sequence's row of sampled_ids
        if device.type == "cuda":
            self.host_ids = torch.zeros(2, max_num_seqs, dtype=torch.long).pin_memory()
            self.host_ids_mapped = mapped_on_device(self.host_ids, device)
            self.host_ids_ready = [torch.cuda.Event() for _ in range(2)]
            self.turn = 0  # the host row the next launched step's ids go to

    # 1. The decision

    def must_take_in_first(self, scheduler: Scheduler) -> bool:
        """Whether the step in flight must reach the host before the next step is scheduled."""
        if self.in_flight is None:
            return False
        if any(seq.params.penalised or seq.logprobs is not None for seq in self.in_flight.sampled):
            return True
        # The next step preempts nothing when the free blocks cover all that the running sequences
        # have left to compute (admitting a waiting sequence never preempts).
        manager = scheduler.block_manager
        needed = sum(max(0, manager.blocks_needed(seq.num_tokens) - len(seq.block_table)) for seq in scheduler.running)
        return needed > manager.num_free_blocks

    def take(self) -> LaunchedStep | None:
        """The step in flight, which the caller takes in now."""
        launched, self.in_flight = self.in_flight, None
        return launched

    # 2. The ids on the device

    def launch(self, scheduled: list[tuple[Sequence, int]], sampled: list[Sequence],
               tokens: torch.Tensor) -> LaunchedStep | None:
        """Put a launched step in flight: its sampled ``tokens`` (on the device) pending in their
        sequences, kept for the next step's inputs, on their way to the host. Returns the step the
        caller takes in now: the one in flight before it or, where steps do not run ahead, this one."""
        for seq in sampled:
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
        written_by_graph = tokens.data_ptr() == self.sampled_ids.data_ptr()  # ``write_greedy``, on both sides
        if not written_by_graph:
            self.sampled_ids[: len(sampled)] = tokens
        self.rows = {seq: row for row, seq in enumerate(sampled)}
        launched = LaunchedStep(scheduled, sampled, self._copy_to_host(tokens, on_host=written_by_graph))
        if not self.runs_ahead:
            return launched
        previous = self.take()
        self.num_steps_run_ahead += previous is not None
        self.in_flight = launched
        return previous

    def write_greedy(self, ids: torch.Tensor, turn: torch.Tensor) -> None:
        """Inside a decode graph: a step's greedy ``ids`` into ``sampled_ids`` and into the host
        buffer's row ``turn`` (a one-element int64 tensor on the device, the step's ``turn``)."""
        self.sampled_ids[: len(ids)] = ids
        self.host_ids_mapped[:, : len(ids)].index_copy_(0, turn, ids[None])

    def _copy_to_host(self, tokens: torch.Tensor, on_host: bool) -> Callable[[], list[int]]:
        if self.device.type != "cuda":
            return tokens.tolist
        host, ready = self.host_ids[self.turn, : len(tokens)], self.host_ids_ready[self.turn]
        self.turn ^= 1
        if not on_host:
            host.copy_(tokens, non_blocking=True)
        ready.record()

        def wait_for_ids() -> list[int]:
            ready.synchronize()
            return host.tolist()

        return wait_for_ids

    # 3. The next step's inputs

    def sources(self, input_ids: np.ndarray, seqs: list[Sequence], owner: np.ndarray) -> np.ndarray:
        """For each input id (of sequence ``seqs[owner[i]]``), its row of ``sampled_ids`` where it is pending."""
        sources = np.zeros_like(input_ids)
        pending = np.flatnonzero(input_ids == PENDING)
        if pending.size:
            sources[pending] = [self.rows[seqs[i]] for i in owner[pending]]
        return sources

    def fill_pending(self, input_ids: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """The input ids, each pending one read from the sampled ids on the device."""
        return torch.where(input_ids == PENDING, self.sampled_ids[sources], input_ids)

    # 4. The resolution

    @staticmethod
    def resolve(launched: LaunchedStep) -> list[tuple[Sequence, int]]:
        """Wait for a launched step's ids and fill in the pending tokens; the (sequence, token)
        pairs of the sequences still going."""
        resolved = []
        for seq, token in zip(launched.sampled, launched.token_ids()):
            if seq.status == Status.FINISHED:
                continue
            seq.token_ids[len(seq.token_ids) - seq.num_pending] = token
            seq.num_pending -= 1
            seq.output_token_ids.append(token)
            resolved.append((seq, token))
        return resolved


def mapped_on_device(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on CUDA ``device`` over a pinned host tensor's memory: kernels write it across the
    bus, and the host reads it once an event recorded after them completes. With unified
    addressing, pinned memory has one address on both sides."""
    if pinned.dtype != torch.long or not pinned.is_pinned() or not pinned.is_contiguous():
        raise ValueError("mapped_on_device takes a contiguous pinned int64 tensor")
    # The array interface CUDA libraries share; the tensor keeps the namespace, and so the host tensor, alive.
    interface = {"shape": tuple(pinned.shape), "typestr": "<i8", "strides": None,
                 "data": (pinned.data_ptr(), False), "version": 3}
    mapped = torch.as_tensor(SimpleNamespace(__cuda_array_interface__=interface, owner=pinned), device=device)
    if mapped.data_ptr() != pinned.data_ptr():  # torch copied it: the memory is another device's
        raise RuntimeError(f"pinned host memory allocated under another device cannot be mapped on {device}")
    return mapped
