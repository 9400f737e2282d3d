"""The engine: requests in, one scheduled model step at a time, tokens and text out."""

import contextlib
import gc
from dataclasses import dataclass, field

from layers.attention import score_modifiers_used, select_backend
from runtime.block_manager import BlockManager
from runtime.compiled_decode import check_compilable
from runtime.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer, text_after
from runtime.kv_cache import KVCache, blocks_for_budget, cache_dtype, check_sizes
from runtime.model_runner import ModelRunner
from runtime.multimodal import ImageInputs, ImagePreprocessor, split_prompt
from runtime.run_ahead import LaunchedStep, RunAhead
from runtime.sampler import sample_tokens
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence, Status


@dataclass
class RequestOutput:
    """A finished (or, while streaming, running) request. ``token_ids`` are the generated ids only."""

    request_id: int  # unique over the engine's life: LLM counts its requests from 0 over all its calls
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length" or "error"
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # with finish_reason "error": "request {request_id}: " and the cause
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PreparedPrompt:
    """A request's prompt tokenized and checked (``Engine.prepare_prompt``)."""

    text: str | None  # None where the prompt came as token ids
    token_ids: list[int]
    image_inputs: ImageInputs | None


class Engine:
    def __init__(self, model, tokenizer, generation_eos: list[int], config: EngineConfig, processor=None,
                 ranks=None):
        """``config``: the engine's options, resolved here against the model's limits. ``processor``:
        transformers' processor of a model that takes images (``loaders.load_processor``). ``ranks``:
        the tensor-parallel group (``runtime.parallel.Ranks``) ``model`` is this rank's slice of;
        every rank builds an engine, rank 0's steps and the others' run together."""
        text_config = model.config.get_text_config()  # a model that takes images: its language model's
        self.config = config = config.resolved(text_config.max_position_embeddings)
        model.fix_max_model_len(config.max_model_len)
        self.tokenizer = tokenizer
        self.architecture = type(model).__name__
        self.image_token_id = getattr(model, "image_token_id", None)  # the model reads its config's spelling
        self.images = (ImagePreprocessor(processor, self.image_token_id)
                       if processor is not None and self.image_token_id is not None else None)
        self.eos_token_ids = set(generation_eos)
        self.vocab_size = text_config.vocab_size
        self.ranks = ranks
        if ranks is not None and self.image_token_id is not None:
            raise NotImplementedError(f"tensor parallelism runs models of text: {self.architecture} takes images")
        device = next(model.parameters()).device
        backend = select_backend(config.attention_backend, device, score_modifiers_used(model))
        # A model runs in one engine at a time: the cache an earlier engine bound to it goes, or
        # its memory would count as used when this one sizes its own.
        model.unbind_kv_cache()
        if config.compile_decode:
            check_compilable(model, device)
        kv_dtype = cache_dtype(config.kv_cache_dtype, model)  # an unsupported one is named before any profiling
        host_ranks = ranks.size if ranks is not None and device.type == "cpu" else 1  # they share the memory
        num_blocks = config.num_blocks or blocks_for_budget(model, config, kv_dtype, host_ranks)
        if ranks is not None:  # the block tables rank 0 sends index every rank's pools alike
            num_blocks = ranks.fewest(num_blocks)
        check_sizes(model, config, num_blocks, kv_dtype, config.compile_decode, host_ranks)
        self.kv_cache = KVCache(model, num_blocks, config.block_size, backend, padding_block=config.compile_decode,
                                dtype=kv_dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.max_num_seqs, config.max_model_len,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill)
        self.run_ahead = RunAhead(config.max_num_seqs, device)
        # CUDA graphs (decode steps whole, steps with prompt tokens in pieces) on the triton backend,
        # whose ops never sync with the host; the reference backend and a model that is not capturable
        # run eagerly.
        use_cuda_graphs = (device.type == "cuda" and not config.enforce_eager and backend.name == "triton"
                           and model.capturable)
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager.block_tables, self.run_ahead,
                                  use_cuda_graphs, config.max_num_batched_tokens, config.compile_decode, ranks)
        if device.type == "cuda":
            self.runner.compile_kernels()
        self.outputs: dict[int, RequestOutput] = {}
        self.sequences: dict[int, Sequence] = {}

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: int, prompt, params: SamplingParams) -> RequestOutput:
        """Queue one request: ``prompt`` as ``prepare_prompt`` takes it, or what it returned. A bad one
        gets a finished output with the error, and nothing else changes."""
        output = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, [])
        try:
            if not isinstance(prompt, PreparedPrompt):
                prompt = self.prepare_prompt(prompt)
            output.prompt, output.prompt_token_ids = prompt.text, prompt.token_ids
            self._check_params(params)
        except ValueError as exc:
            output.finish_reason, output.error = "error", f"request {request_id}: {exc}"
            return output
        seq = Sequence(request_id, prompt.token_ids, params, prompt.image_inputs)
        seq.seed_generator(self.runner.device)
        output.token_ids, output.logprobs = seq.output_token_ids, seq.logprobs
        self.outputs[request_id] = output
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return output

    def prepare_prompt(self, prompt) -> "PreparedPrompt":
        """A prompt (a text, token ids, or a dict of ``runtime.multimodal``'s shape) tokenized, its
        images processed, and checked against the model; a ValueError names what is wrong. It reads
        nothing the steps change, so another thread may prepare prompts while the engine steps (the
        server's does: a long prompt's tokenizing does not hold up the requests that run)."""
        text, token_ids, images = split_prompt(prompt)
        ids, image_inputs = self._prompt_ids(text, token_ids, images)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len}, "
                             f"which holds the prompt and at least one generated token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return PreparedPrompt(text, ids, image_inputs)

    def abort(self, request_ids) -> None:
        """Drop these requests where still unfinished: their blocks are freed and no later step
        computes them (a step already launched computes them for nothing)."""
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            if seq is not None:
                self.scheduler.abort(seq)
                seq.finish("abort")
                del self.outputs[request_id]

    def _prompt_ids(self, text: str | None, token_ids: list[int] | None,
                    images: list) -> tuple[list[int], ImageInputs | None]:
        """The prompt's token ids, image placeholders expanded, and its images' inputs (None without images)."""
        if text is not None and self.tokenizer is None:
            raise ValueError("the model has no tokenizer: pass token ids instead of text")
        if images:
            if self.image_token_id is None:
                raise ValueError(f"multi_modal_data is given, but {self.architecture} takes no images")
            if self.images is None:
                raise ValueError("multi_modal_data is given, but the checkpoint has no image processor")
            return self.images(text, token_ids, images)
        ids = token_ids if text is None else self.tokenizer(text).input_ids
        if self.image_token_id is not None and self.image_token_id in ids:
            raise ValueError(f"the prompt has {ids.count(self.image_token_id)} image placeholders and no image "
                             f"is given (multi_modal_data)")
        return ids, None

    def _check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and the model has none")

    def has_unfinished(self) -> bool:
        return self.run_ahead.in_flight is not None or self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, and take in the tokens of the one before it (on the CPU, of
        this one); return the outputs that changed. The step before is taken in first where the
        next one needs its tokens on the host (``runtime.run_ahead``). In a tensor-parallel group, a rank that died
        (or a step that failed halfway) takes the group down with a RuntimeError that names it."""
        if self.ranks is None:
            return self._step()
        with self.ranks.step():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if not self.kv_cache.bound():
            raise RuntimeError("this LLM's model has been taken over by a newer LLM, which bound its own KV cache "
                               "to the model's layers: a model runs in one LLM at a time")
        changed = []
        if self.run_ahead.must_take_in_first(self.scheduler):
            changed += self._take_in(self.run_ahead.take())
        scheduled, failed = self.scheduler.schedule()
        for seq in failed:  # the text of what it generated before
            self.outputs[seq.request_id].text = self._full_text(seq)
        changed += [self._finish_output(seq) for seq in failed]
        to_take_in = self._launch(scheduled) if scheduled else self.run_ahead.take()
        if to_take_in is not None:
            changed += self._take_in(to_take_in)
        return changed

    def _launch(self, scheduled: list[tuple[Sequence, int]]) -> LaunchedStep | None:
        """Run and sample a step; returns the step to take in now (``RunAhead.launch``)."""
        logits, sampled, greedy = self.runner.run(scheduled)
        tokens = sample_tokens(logits, sampled, greedy)
        for seq, count in scheduled:
            seq.num_computed_tokens += count
        to_take_in = self.run_ahead.launch(scheduled, sampled, tokens)
        if self.ranks is not None:  # the other ranks read the next step's pending ids from theirs
            self.ranks.share_sampled(self.run_ahead.sampled_ids[: len(sampled)])
        return to_take_in

    def _take_in(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Resolve a launched step's pending tokens, key the blocks they fill, end the sequences they stop."""
        resolved = self.run_ahead.resolve(launched)
        self.block_manager.cache_full_blocks(seq for seq, _ in launched.scheduled)
        changed = []
        for seq, token in resolved:
            if self._stops(seq, token):
                self.scheduler.finish(seq)
            changed.append(self._finish_output(seq))
        return changed

    def _stops(self, seq: Sequence, token: int) -> bool:
        """Whether the token ends the sequence; if so, it is finished with the reason and its text."""
        params = seq.params
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        last = stop_token or seq.reaches_length_limit(self.config.max_model_len, count_pending=False)
        if not (last or params.stop):
            return False
        output = self.outputs[seq.request_id]
        searched = len(output.text)
        # At the last token, the whole text: also what the detokenizer still holds back.
        output.text = self._full_text(seq) if last else self._running_text(seq)
        # Stop strings first: text the detokenizer held back until the last token may hold one.
        if (params.stop and self._cut_at_stop_string(output, params.stop, searched)) or stop_token:
            seq.finish("stop")
        elif last:
            seq.finish("length")
        else:
            return False
        return True

    @staticmethod
    def _cut_at_stop_string(output: RequestOutput, stops: list[str], searched: int) -> bool:
        """Cut the output's text where a stop string begins, if the text after its first ``searched``
        characters completes one. Read a character at a time, the text would stop at the first one
        to complete, whichever of the list it is (of two completed by the same character, the longer)."""
        found = [(start + len(stop), start) for stop in stops
                 if (start := output.text.find(stop, max(0, searched - len(stop) + 1))) >= 0]
        if not found:
            return False
        output.text = output.text[:min(found)[1]]
        return True

    def refresh_text(self, output: RequestOutput) -> None:
        """Decode a running request's text so far (streaming); finished ones have theirs."""
        if not output.finished:
            output.text = self._running_text(self.sequences[output.request_id])

    def _running_text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        return seq.detokenizer.update(seq.output_token_ids)

    def _full_text(self, seq: Sequence) -> str:
        """The text of all the sequence's generated ids."""
        return "" if self.tokenizer is None else text_after(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids)

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        output = self.outputs[seq.request_id]
        output.num_cached_tokens = seq.num_cached_tokens or 0
        if seq.status == Status.FINISHED:  # its text was settled where it finished
            output.finish_reason, output.error = seq.finish_reason, seq.error
            del self.sequences[seq.request_id], self.outputs[seq.request_id]  # the caller holds the output
        return output


@contextlib.contextmanager
def start_up_objects_frozen():
    """For a process that from here on only runs the engine (``zoo serve``, a tensor-parallel worker
    rank): what start-up made (torch, transformers, the model: ~400,000 objects) lives as long as the
    process. Frozen out of the garbage collector's sight, it leaves a full collection only what came
    after to walk; else each took up to a third of a second with every thread stopped (in a worker,
    every rank waiting for it at the next collective). Thawed on the way out, for the process's last
    collection: native modules report what is never freed (triton's nanobind: "leaked 514 functions")."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
