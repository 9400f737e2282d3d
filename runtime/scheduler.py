"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step mixes decodes (one token each) with prefills, chunked under a per-step token
budget. When the cache runs out of blocks, the most recently admitted sequence is preempted:
its blocks are freed and it is recomputed later from its tokens, with identical results.
"""

from collections import deque

from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, Status


def is_decode(seq: Sequence, count: int) -> bool:
    """One new token after cached ones: the attention backend batches these as decodes."""
    return count == 1 and seq.num_computed_tokens > 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        seq.image_features = None  # the memory is short: encoded again when it computes its image tokens
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """(sequence, new tokens) for the next step, prefills before decodes; and the sequences
        that had to be failed because they cannot fit the cache even alone."""
        budget = self.max_num_batched_tokens
        prefills, decodes, failed = [], [], []

        # Running sequences first, oldest first; the newest are preempted to make room. One whose
        # pending token ends it is left out: the step can run ahead without waiting for that token.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = 0 if seq.ends_with_pending_token(self.max_model_len) else self._chunk(seq, budget)
            if count == 0:
                index += 1
                continue
            while not self.block_manager.allocate(seq, count):
                victim = self.running[-1]
                if victim is seq and index == 0:
                    failed.append(seq)
                    self.running.remove(seq)
                    self.block_manager.free_sequence(seq)
                    seq.finish("error", f"request {seq.request_id}: {seq.num_tokens} tokens do not fit the KV cache "
                                        f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                (decodes if is_decode(seq, count) else prefills).append((seq, count))
                budget -= count
                index += 1

        # Then admit waiting sequences while there is room.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            count = self._chunk(seq, budget)
            if count == 0 or not self.block_manager.allocate(seq, count):
                self.block_manager.free_sequence(seq)  # give back the prefix blocks until it is admitted
                break
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            (decodes if is_decode(seq, count) else prefills).append((seq, count))
            budget -= count
        # Prefills first, then decodes: the layout AttentionMetadata describes.
        return prefills + decodes, failed

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence, running or waiting, and free its blocks. (A call interrupted between
        this scheduler's failing a sequence and the engine's taking note may abort it in neither.)"""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free_sequence(seq)
