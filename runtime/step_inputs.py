"""The flat batch of one scheduled step, built on the host and sent to the device."""

from itertools import chain

import numpy as np
import torch

from layers import AttentionMetadata
from runtime.run_ahead import RunAhead
from runtime.sequence import Sequence


class StepInputs:
    """The flat batch of one step as host arrays; ``to_device`` turns it into the model's arguments.

    ``scheduled`` lists prefills before decodes. The per-token arrays are built with numpy, the
    block tables are a gather of the block manager's rows, cut to the columns that hold the step's
    blocks: the manager's tables are as wide as ``max_model_len`` needs, often far wider than the
    step's sequences, and the host gathers and packs only what the kernels will read.
    """

    def __init__(self, scheduled: list[tuple[Sequence, int]], block_tables: np.ndarray, block_size: int,
                 run_ahead: RunAhead):
        """``run_ahead`` says where on the device each pending input id is read from (``sources``)."""
        seqs = [seq for seq, _ in scheduled]
        self.query_lens = [count for _, count in scheduled]
        self.context_lens = [seq.num_computed_tokens for seq in seqs]
        # On CUDA the model sees the manager's full width (``table_width``), zeros past a sequence's
        # blocks as in the manager, in every step, eager or in a graph: kernels compile once.
        self.table_width = block_tables.shape[1]
        held = max(len(seq.block_table) for seq in seqs)
        self.block_tables = block_tables[[seq.table_row for seq in seqs], :held]
        counts = np.array(self.query_lens, dtype=np.int64)
        starts = np.array(self.context_lens, dtype=np.int64)
        ends = np.cumsum(counts)  # where each sequence's new tokens end in the stream
        new_tokens = (seq.token_ids[start : start + count]
                      for seq, start, count in zip(seqs, self.context_lens, self.query_lens))
        self.input_ids = np.fromiter(chain.from_iterable(new_tokens), dtype=np.int64, count=int(ends[-1]))
        self.positions = np.arange(ends[-1]) + np.repeat(starts - (ends - counts), counts)
        owner = np.repeat(np.arange(len(seqs)), counts)  # the sequence of each token
        self.sources = run_ahead.sources(self.input_ids, seqs, owner)
        blocks = self.block_tables[owner, self.positions // block_size].astype(np.int64)
        self.slots = blocks * block_size + self.positions % block_size
        self.seq_lens = (starts + counts).astype(np.int32)
        self.query_start_loc = np.concatenate(([0], ends)).astype(np.int32)
        # A sequence samples once its last token is computed.
        samples = np.array([seq.num_tokens for seq in seqs]) == starts + counts
        self.logits_rows = ends[samples] - 1
        self.sampled = [seq for seq, sampling in zip(seqs, samples.tolist()) if sampling]
        self.num_decodes = int(np.count_nonzero((counts == 1) & (starts > 0)))  # is_decode of each

    def __getstate__(self) -> dict:
        # The step as tensor-parallel workers receive it: its arrays; the sequences stay on rank 0.
        return {name: value for name, value in self.__dict__.items() if name != "sampled"}

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows of ``logits`` (one per token of a decode-only step) of the sequences that sample."""
        if len(self.logits_rows) == len(logits):
            return logits
        # A one-token chunk of a longer prompt is a decode to attention, but samples nothing.
        return logits[torch.from_numpy(self.logits_rows).to(logits.device)]

    def to_device(self, device, staging: tuple | None):
        """The model's arguments on ``device``: on CUDA sent through ``staging``, the int64s' and
        the int32s' ``runtime.cuda_graphs.Staging``, each dtype in one asynchronous copy, so the
        host can go on while the device works."""
        longs = (self.input_ids, self.sources, self.positions, self.slots, self.logits_rows)
        ints = (self.seq_lens, self.query_start_loc, self.block_tables)
        if staging is None:  # the CPU: the columns the step's blocks fill
            longs, ints = ([torch.from_numpy(a) for a in arrays] for arrays in (longs, ints))
        else:
            longs = staging[0].send_arrays(longs, device)
            full_width = (len(self.block_tables), self.table_width)
            ints = staging[1].send_arrays(ints, device, shapes=(None, None, full_width))
        input_ids, sources, positions, slots, logits_rows = longs
        seq_lens, query_start_loc, block_tables = ints
        metadata = AttentionMetadata(
            query_lens=self.query_lens, context_lens=self.context_lens, slot_mapping=slots,
            block_tables=block_tables, num_decodes=self.num_decodes, seq_lens=seq_lens,
            query_start_loc=query_start_loc,
        )
        return input_ids, sources, positions, metadata, logits_rows
