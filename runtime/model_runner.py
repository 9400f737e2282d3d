"""Runs the model on a scheduled step: eagerly, as replayed CUDA graphs, or compiled on the CPU.
A step that holds image tokens runs eagerly, with their rows of the images' features."""

import numpy as np
import torch

from layers import AttentionMetadata, pack_cpu_weights
from ops_cuda import argmax
from runtime.compiled_decode import CompiledDecode
from runtime.cuda_graphs import PIECEWISE_MAX_TOKENS, DecodeGraphs, PiecewiseGraphs, Staging
from runtime.kv_cache import KVCache
from runtime.run_ahead import RunAhead
from runtime.sequence import Sequence
from runtime.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_tables: np.ndarray, run_ahead: RunAhead,
                 use_cuda_graphs: bool, max_num_batched_tokens: int, compile_decode: bool = False, ranks=None):
        """``block_tables``: the block manager's, a row per sequence that holds blocks; as many rows as
        sequences can run at once. ``run_ahead`` holds the previous step's sampled ids, which pending
        input ids are read from. ``compile_decode``: CPU decode steps run compiled (``CompiledDecode``).
        ``ranks``: the tensor-parallel group (``runtime.parallel.Ranks``) whose other ranks run each
        step ``run`` sends them. With ``use_cuda_graphs``, decode steps replay whole graphs and steps of
        up to ``PIECEWISE_MAX_TOKENS`` tokens (and ``max_num_batched_tokens``) that carry prompt tokens
        replay graphs in pieces between attention calls."""
        self.model = model
        self.ranks = ranks
        self.kv_cache = kv_cache
        self.block_tables = block_tables
        self.run_ahead = run_ahead
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cpu":
            pack_cpu_weights(model)
        max_num_seqs, table_width = block_tables.shape
        self.staging = (Staging(torch.long), Staging(torch.int32)) if self.device.type == "cuda" else None
        self.graphs = (DecodeGraphs(model, max_num_seqs, table_width, run_ahead, self.device)
                       if use_cuda_graphs else None)
        self.piecewise = (PiecewiseGraphs(model, kv_cache, min(PIECEWISE_MAX_TOKENS, max_num_batched_tokens),
                                          max_num_seqs, table_width, run_ahead, self.device)
                          if use_cuda_graphs else None)
        self.compiled = CompiledDecode(model, kv_cache, run_ahead) if compile_decode else None

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence], torch.Tensor | None]:
        """Logits [len(sampled), vocab], in the model's dtype, for the sequences that sample this step;
        those sequences; and their greedy tokens where the step computed them already (a decode graph
        in which every row samples: its argmax, in the run-ahead's sampled ids), else None."""
        step = StepInputs(scheduled, self.block_tables, self.kv_cache.block_size, self.run_ahead)
        images = self.image_embeds(scheduled)
        if self.ranks is not None:
            self.ranks.send_step(step)
        logits = self.forward(step, images)
        sampled_in_graph = self.replays_graph(step, images) and len(step.logits_rows) == len(step.input_ids)
        return logits, step.sampled, self.run_ahead.sampled_ids[: len(step.sampled)] if sampled_in_graph else None

    def replays_graph(self, step: StepInputs, images: dict) -> bool:
        """Whether the step replays a whole decode graph."""
        return self.graphs is not None and step.decode_only and not images and self.graphs.fits(len(step.input_ids))

    @torch.inference_mode()
    def forward(self, step: StepInputs, images: dict | None = None) -> torch.Tensor:
        """The logits of a built step's sampled rows; ``images``: the model's image arguments."""
        images = images or {}
        # A one-token prompt chunk counts as a decode: a decode-only step may hold an image token.
        plain_decode = step.decode_only and not images
        if self.replays_graph(step, images):
            return self.graphs.run(step)
        if self.compiled is not None and plain_decode:
            return self.compiled.run(step)
        if self.piecewise is not None and not images and self.piecewise.fits(len(step.input_ids)):
            return self.piecewise.run(step)
        input_ids, sources, positions, metadata, logits_rows = step.to_device(self.device, self.staging)
        input_ids = self.run_ahead.fill_pending(input_ids, sources)
        return self.model(input_ids, positions, metadata, logits_indices=logits_rows, **images)

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Runs once what only some steps launch, so that its Triton kernels compile at start and not
        in the first request that needs them (seconds each on a cold Triton cache): a prompt begun in
        an earlier step beside a decode (the paged prefill kernel), and argmax over logits in the
        model's dtype (greedy sampling) and in float32 (draws). It writes nothing into the cache, and
        what it reads there is thrown away."""
        device = self.device
        metadata = AttentionMetadata(
            query_lens=[2, 1], context_lens=[1, 1], num_decodes=1,
            slot_mapping=torch.full((3,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(2, self.block_tables.shape[1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([3, 2], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32, device=device),
        )
        positions = torch.tensor([1, 2, 1], device=device)
        logits = self.model(torch.zeros_like(positions), positions, metadata,
                            logits_indices=torch.tensor([1, 2], device=device))
        argmax(logits)
        argmax(logits.float())

    def image_embeds(self, scheduled: list[tuple[Sequence, int]]) -> dict:
        """The model's image arguments for the step: the features of the prompt image tokens it
        computes (``image_embeds``) and their rows in the flat stream (``image_rows``); none when it
        computes none. A request's images are encoded at the step that computes its first image
        token, and their features let go at the step that computes its last. Rows, not the image
        token's id, say where features go: a generated token may carry that id like any other."""
        features, rows, stream_start = [], [], 0
        for seq, count in scheduled:
            start, stream_start = stream_start, stream_start + count
            if seq.images is None:
                continue
            computed = seq.num_computed_tokens
            first, last = seq.images.feature_rows(computed, computed + count)
            if first == last:
                continue
            if seq.image_features is None:  # also after a preemption that let them go
                pixel_values = seq.images.pixel_values.to(self.device, self.dtype)
                # image_sizes stay on the host: they decide shapes (LLaVA-NeXT's tile grids)
                seq.image_features = torch.cat(self.model.encode_images(pixel_values, seq.images.image_sizes))
                if len(seq.image_features) != seq.images.num_tokens:
                    raise RuntimeError(f"request {seq.request_id}: the model encodes its images to "
                                       f"{len(seq.image_features)} feature rows, the processor gave them "
                                       f"{seq.images.num_tokens} image tokens")
            features.append(seq.image_features[first:last])
            rows.append(seq.images.token_positions[first:last] - computed + start)
            if last == seq.images.num_tokens:
                seq.image_features = None
        if not features:
            return {}
        return {"image_embeds": torch.cat(features),
                "image_rows": torch.from_numpy(np.concatenate(rows)).to(self.device)}
