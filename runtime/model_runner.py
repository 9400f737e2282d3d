"""Runs the model on a scheduled step: eagerly, as a replayed CUDA graph, or compiled on the CPU."""

import numpy as np
import torch

from layers import pack_for_cpu_decode
from runtime.compiled_decode import CompiledDecode
from runtime.cuda_graphs import DecodeGraphs, Staging
from runtime.kv_cache import KVCache
from runtime.run_ahead import RunAhead
from runtime.sequence import Sequence
from runtime.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_tables: np.ndarray, run_ahead: RunAhead,
                 use_cuda_graphs: bool, compile_decode: bool = False):
        """``block_tables``: the block manager's, a row per sequence that holds blocks; as many rows as
        sequences can run at once. ``run_ahead`` holds the previous step's sampled ids, which pending
        input ids are read from. ``compile_decode``: CPU decode steps run compiled (``CompiledDecode``)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_tables = block_tables
        self.run_ahead = run_ahead
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and not compile_decode:  # a compiled graph packs its own weights
            pack_for_cpu_decode(model)
        max_num_seqs, table_width = block_tables.shape
        self.staging = (Staging(torch.long), Staging(torch.int32)) if self.device.type == "cuda" else None
        self.graphs = (DecodeGraphs(model, max_num_seqs, table_width, run_ahead, self.device)
                       if use_cuda_graphs else None)
        self.compiled = CompiledDecode(model, max_num_seqs, kv_cache, run_ahead) if compile_decode else None

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [len(sampled), vocab], in the model's dtype, for the sequences that sample this step."""
        step = StepInputs(scheduled, self.block_tables, self.kv_cache.block_size, self.run_ahead)
        if self.graphs is not None and step.decode_only and self.graphs.fits(len(step.input_ids)):
            return self.graphs.run(step), step.sampled
        if self.compiled is not None and step.decode_only and self.compiled.fits(len(step.input_ids)):
            return self.compiled.run(step), step.sampled
        input_ids, sources, positions, metadata, logits_rows = step.to_device(self.device, self.staging)
        input_ids = self.run_ahead.fill_pending(input_ids, sources)
        return self.model(input_ids, positions, metadata, logits_indices=logits_rows), step.sampled
