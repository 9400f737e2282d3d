"""The engine: requests in, one scheduled model step at a time, tokens and text out."""

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from layers import Attention, AttentionMetadata
from layers.attention import score_modifiers_used, select_backend
from runtime.block_manager import BlockManager
from runtime.model_runner import KVCache, ModelRunner
from runtime.sampler import sample_tokens
from runtime.sampling_params import SamplingParams, is_integer, is_number
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence, Status

CPU_KV_CACHE_GIB = 1.0


@dataclass
class RequestOutput:
    """A finished (or, while streaming, running) request. ``token_ids`` are the generated ids only."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "error"
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class LaunchedStep:
    """A step on the device: what it computes, who samples, and what waits for the sampled ids."""

    scheduled: list[tuple[Sequence, int]]
    sampled: list[Sequence]
    token_ids: Callable[[], list[int]]


def check_options(**options) -> None:
    """Raise ValueError naming the first engine option out of its range (None: the default)."""
    positive_ints = ("max_num_seqs", "max_model_len", "block_size", "num_blocks", "max_num_batched_tokens")
    for name in positive_ints:
        value = options[name]
        if value is not None and not (is_integer(value) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    gib, utilization = options["kv_cache_gib"], options["gpu_memory_utilization"]
    if gib is not None and not (is_number(gib) and gib > 0):
        raise ValueError(f"kv_cache_gib must be > 0, got {gib!r}")
    if not (is_number(utilization) and 0 < utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")


def check_compilable(model, device: torch.device) -> None:
    """Raise ValueError where ``compile_decode`` cannot apply: off the CPU, with rope scaling that
    reads positions on the host, or with no C++ compiler for inductor's kernels."""
    if device.type != "cpu":
        raise ValueError(f"compile_decode is for models on the CPU; this one is on {device} "
                         "(on CUDA, decode steps replay CUDA graphs)")
    if model.model.rotary_emb.rope_type == "dynamic":
        raise ValueError("compile_decode: the model's dynamic rope scaling reads positions on the host, "
                         "which a compiled graph cannot; run it without compile_decode")
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # inductor says which compiler it looked for
        raise ValueError(f"compile_decode needs a C++ compiler to build inductor's kernels: {exc}") from exc


class Engine:
    def __init__(self, model, tokenizer, generation_eos: list[int], *, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_blocks: int | None, kv_cache_gib: float | None, gpu_memory_utilization: float,
                 max_num_batched_tokens: int | None, enable_chunked_prefill: bool, enable_prefix_caching: bool,
                 attention_backend: str | None, enforce_eager: bool, compile_decode: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = set(generation_eos)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs) if enable_chunked_prefill else max_model_len
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
            )
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        backend = select_backend(attention_backend, device, score_modifiers_used(model))
        for layer in model.modules():
            if isinstance(layer, Attention):
                # A model runs in one engine at a time: the cache an earlier engine bound to the
                # layers goes, or its memory would count as used when this one sizes its own.
                layer.backend, layer.kv_cache = backend, None
        # Graphs capture the decode step: it must not sync with the host (the triton backend does
        # not; the reference backend and dynamic rope do).
        use_cuda_graphs = (device.type == "cuda" and not enforce_eager and backend.name == "triton"
                           and model.model.rotary_emb.rope_type != "dynamic")
        if compile_decode:
            check_compilable(model, device)
        if num_blocks is None:
            num_blocks = self._blocks_for_budget(block_size, dtype, kv_cache_gib, gpu_memory_utilization,
                                                 max_num_seqs, max_num_batched_tokens)
        self.kv_cache = KVCache(model, num_blocks, block_size, dtype, device, padding_block=compile_decode)
        self.block_manager = BlockManager(num_blocks, block_size, max_num_seqs, max_model_len, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager.block_tables, use_cuda_graphs,
                                  compile_decode)
        self.outputs: dict[int, RequestOutput] = {}
        self.sequences: dict[int, Sequence] = {}
        self.launched: LaunchedStep | None = None
        self.num_steps_run_ahead = 0

    def _blocks_for_budget(self, block_size, dtype, kv_cache_gib, utilization, max_num_seqs, max_tokens) -> int:
        """On CUDA: what is free after a profiling forward of the largest step, times ``utilization``;
        on CPU an explicit budget. Never more than max_num_seqs sequences of max_model_len tokens need."""
        per_block = KVCache.bytes_per_block(self.model, block_size, dtype)
        device = next(self.model.parameters()).device
        if kv_cache_gib is not None:
            budget = kv_cache_gib * (1 << 30)
        elif device.type == "cuda":
            gc.collect()  # an earlier engine of this model, dropped but in a reference cycle, frees its cache
            # The largest step: max_tokens new tokens, as prompts of at most max_model_len tokens.
            length = min(max_tokens, self.max_model_len)
            batch = -(-max_tokens // length)
            positions = torch.arange(length, device=device).repeat(batch)
            last_tokens = torch.arange(1, batch + 1, device=device) * length - 1
            torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode():
                self.model(torch.zeros_like(positions), positions, AttentionMetadata.causal_prefill(batch, length),
                           logits_indices=last_tokens)
            total = torch.cuda.mem_get_info(device)[1]
            budget = total * utilization - torch.cuda.max_memory_allocated(device)
        else:
            budget = CPU_KV_CACHE_GIB * (1 << 30)
        useful = max_num_seqs * math.ceil(self.max_model_len / block_size)
        num_blocks = min(int(budget // per_block), useful)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget / (1 << 30):.2f} GiB)")
        return num_blocks

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: int, prompt, params: SamplingParams) -> RequestOutput:
        """Queue one request. A bad one gets a finished output with the error, and nothing else changes."""
        text = prompt if isinstance(prompt, str) else None
        output = RequestOutput(request_id, text, [])
        try:
            output.prompt_token_ids = self._prompt_ids(prompt)
            self._validate(output.prompt_token_ids, params)
        except ValueError as exc:
            output.finish_reason, output.error = "error", f"request {request_id}: {exc}"
            return output
        seq = Sequence(request_id, output.prompt_token_ids, params)
        seq.seed_generator(self.runner.device)
        output.token_ids, output.logprobs = seq.output_token_ids, seq.logprobs
        self.outputs[request_id] = output
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return output

    def abort(self, request_ids) -> None:
        """Drop these requests where still unfinished: their blocks are freed and no later step
        computes them (a step already launched computes them for nothing)."""
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            if seq is not None:
                self.scheduler.abort(seq)
                seq.finish("abort")
                del self.outputs[request_id]

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the model has no tokenizer: pass token ids instead of text")
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, (list, tuple)) or not all(is_integer(t) for t in prompt):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        return [int(t) for t in prompt]

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) + 1 > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens; the whole KV cache holds {capacity}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and the model has none")

    def has_unfinished(self) -> bool:
        return self.launched is not None or self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, and take in the tokens of the one before it; return the
        outputs that changed.

        When the next step cannot need the previous step's tokens on the host (``_can_run_ahead``:
        nothing is preempted, no sampling setting reads them), it is launched before they get
        there: the device reads them where they are, and the host's bookkeeping for one step
        overlaps the device's work on the next. Otherwise the previous step is taken in first.
        """
        if not self.kv_cache.bound():
            raise RuntimeError("this LLM's model has been taken over by a newer LLM, which bound its own KV cache "
                               "to the model's layers: a model runs in one LLM at a time")
        changed = []
        if self.launched is not None and not self._can_run_ahead(self.launched):
            changed += self._take_in(self.launched)
            self.launched = None
        scheduled, failed = self.scheduler.schedule()
        changed += [self._finish_output(seq) for seq in failed]
        launched = self._launch(scheduled) if scheduled else None
        if self.launched is not None:
            self.num_steps_run_ahead += launched is not None
            changed += self._take_in(self.launched)
        self.launched = launched
        return changed

    def _can_run_ahead(self, launched: LaunchedStep) -> bool:
        # Penalties and logprobs need each step's tokens on the host; a sequence that surely ends
        # with the pending token must not be scheduled again.
        for seq in launched.sampled:
            params = seq.params
            if params.penalised or seq.logprobs is not None:
                return False
            if len(seq.output_token_ids) + seq.num_pending >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                return False
        return self.scheduler.next_step_preempts_nothing()

    def _launch(self, scheduled: list[tuple[Sequence, int]]) -> LaunchedStep:
        logits, sampled = self.runner.run(scheduled)
        tokens = sample_tokens(logits, sampled)
        for seq, count in scheduled:
            seq.num_computed_tokens += count
        for seq in sampled:
            seq.append_pending()
        return LaunchedStep(scheduled, sampled, self.runner.keep_sampled(tokens, sampled))

    def _take_in(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Resolve a launched step's pending tokens, key the blocks they fill, end the sequences they stop."""
        # A sequence that ended on an earlier token was computed ahead for nothing.
        resolved = [(seq, token) for seq, token in zip(launched.sampled, launched.token_ids())
                    if seq.status != Status.FINISHED]
        for seq, token in resolved:
            seq.resolve(token)
        self.block_manager.cache_full_blocks(seq for seq, _ in launched.scheduled)
        changed = []
        for seq, token in resolved:
            if self._stops(seq, token):
                self.scheduler.finish(seq)
            changed.append(self._finish_output(seq))
        return changed

    def _stops(self, seq: Sequence, token: int) -> bool:
        """Whether the token ends the sequence; if so, it is finished with the reason."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish("stop")
        elif params.stop and self._cut_at_stop_string(seq):
            seq.finish("stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_resolved_tokens >= self.max_model_len:
            seq.finish("length")
        else:
            return False
        return True

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        output = self.outputs[seq.request_id]
        previous_length = len(output.text)
        output.text = self.decode(seq.output_token_ids)
        for stop in seq.params.stop:
            # Only text this token added can complete a stop string.
            start = output.text.find(stop, max(0, previous_length - len(stop) + 1))
            if start >= 0:
                output.text = output.text[:start]
                return True
        return False

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def refresh_text(self, output: RequestOutput) -> None:
        """Decode a running request's text so far (streaming); finished ones have theirs."""
        if not output.finished:
            output.text = self.decode(output.token_ids)

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        output = self.outputs[seq.request_id]
        output.num_cached_tokens = seq.num_cached_tokens
        if seq.status == Status.FINISHED:
            if not (seq.finish_reason == "stop" and seq.params.stop):  # else the stop string already cut it
                output.text = self.decode(seq.output_token_ids)
            output.finish_reason, output.error = seq.finish_reason, seq.error
            del self.sequences[seq.request_id], self.outputs[seq.request_id]  # the caller holds the output
        return output
