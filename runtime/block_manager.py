"""Allocation of KV-cache blocks, with reference counts and prefix caching.

A full block is keyed by the tokens it holds and the key of the block before it (a chain), so
two prompts that share their leading blocks share those blocks' keys and values. Freed blocks
keep their content and key until they are reused, least recently freed first.
"""

from collections import OrderedDict

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}  # block key -> block holding it
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_key(self, seq: Sequence, index: int) -> tuple:
        parent = seq.block_hashes[index - 1] if index else None
        start = index * self.block_size
        return parent, tuple(seq.token_ids[start : start + self.block_size])

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.block_keys[block] is not None:  # evict its cached content
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def match_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks for the sequence's leading full blocks. The last token is always
        left to compute: it yields the logits of the next token."""
        if not self.enable_prefix_caching:
            return
        for index in range((seq.num_tokens - 1) // self.block_size):
            key = self._block_key(seq, index)
            block = self.cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(hash(key))
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give the sequence blocks for ``num_new_tokens`` more tokens; False (nothing taken) if too few are free."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks that became full of computed tokens, so later prompts can reuse them."""
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            key = self._block_key(seq, index)
            seq.block_hashes.append(hash(key))
            block = seq.block_table[index]
            if self.enable_prefix_caching and key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key

    def free_sequence(self, seq: Sequence) -> None:
        # Freed last-to-first, so a sequence's tail is evicted before the prefix others may share.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
