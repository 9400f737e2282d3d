"""Allocation of KV-cache blocks, with reference counts and prefix caching.

A full block is keyed by the tokens it holds, the digests of the images whose tokens it holds,
and the key of the block before it (a chain), so two prompts that share their leading blocks
(images included) share those blocks' keys and values. Freed blocks keep their content and key
until they are reused, least recently freed first.

Each sequence that holds blocks also has a row of ``block_tables``, its block table as the model
reads it (zero-padded), written here whenever it gains blocks: a step's tables are a gather of
its sequences' rows, with no per-block work. At most ``max_num_seqs`` sequences hold blocks:
the running ones, and the one the scheduler is admitting.
"""

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}  # block key -> block holding it
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables = np.zeros((max_num_seqs, self.blocks_needed(max_model_len)), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_key(self, seq: Sequence, index: int) -> tuple:
        parent = seq.block_hashes[index - 1] if index else None
        start, end = index * self.block_size, (index + 1) * self.block_size
        images = seq.images.digests_in(start, end) if seq.images is not None else ()
        return parent, tuple(seq.token_ids[start:end]), images

    def reset_prefix_cache(self) -> None:
        """Forget what the free blocks hold: no later prompt is served from it (blocks in use keep theirs)."""
        for block in self.free:
            if self.block_keys[block] is not None:
                del self.cached[self.block_keys[block]]
                self.block_keys[block] = None

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.block_keys[block] is not None:  # evict its cached content
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def _append_blocks(self, seq: Sequence, blocks: list[int]) -> None:
        if seq.table_row is None:
            seq.table_row = self.free_rows.pop()
        start = len(seq.block_table)
        seq.block_table.extend(blocks)
        self.block_tables[seq.table_row, start : start + len(blocks)] = blocks

    def match_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks for the sequence's leading full blocks. The last token is always
        left to compute: it yields the logits of the next token."""
        if not self.enable_prefix_caching:
            return
        matched = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            key = self._block_key(seq, index)
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            matched.append(block)
            seq.block_hashes.append(hash(key))
        if matched:
            self._append_blocks(seq, matched)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give the sequence blocks for ``num_new_tokens`` more tokens; False (nothing taken) if too few are free."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:  # most decode steps: the last block has room
            return True
        if needed > self.num_free_blocks:
            return False
        self._append_blocks(seq, [self._take_free_block() for _ in range(needed)])
        return True

    def cache_full_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Key the blocks that became full of computed tokens, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        for seq in seqs:
            for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
                key = self._block_key(seq, index)
                seq.block_hashes.append(hash(key))
                block = seq.block_table[index]
                if key not in self.cached and self.block_keys[block] is None:
                    self.cached[key] = block
                    self.block_keys[block] = key

    def free_sequence(self, seq: Sequence) -> None:
        # Freed last-to-first, so a sequence's tail is evicted before the prefix others may share.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        if seq.table_row is not None:
            self.block_tables[seq.table_row, : len(seq.block_table)] = 0
            self.free_rows.append(seq.table_row)
            seq.table_row = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
