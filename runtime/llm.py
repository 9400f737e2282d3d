"""``LLM``: offline generation with any registered model."""

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import transformers
from tqdm import tqdm

from loaders import chat_template_error, load_generation_config, load_processor, load_tokenizer
from models import AutoModelForCausalLM
from models.auto import check_load_flags, model_device
from runtime.config import EngineConfig
from runtime.engine import Engine, RequestOutput
from runtime.parallel import Ranks
from runtime.sampling_params import SamplingParams, is_integer

logger = logging.getLogger(__name__)


@dataclass
class StreamDelta:
    """What one request gained in one step of ``LLM.stream``."""

    index: int  # position of the request in the prompts given
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None


def generation_eos_ids(model, path_or_repo_id=None) -> list[int]:
    """The EOS ids HuggingFace's generate stops at: generation_config.json, else the model config.
    Each must be a token id of the model's vocabulary (its config's ``vocab_size``, which counts an
    LM head's padding rows), or generation could never stop at it."""
    config = None if path_or_repo_id is None else load_generation_config(path_or_repo_id)
    where = "generation_config.json"
    if config is None:
        config = transformers.GenerationConfig.from_model_config(model.config)
        where = "the model's config"
    eos = config.eos_token_id
    ids = [] if eos is None else [eos] if is_integer(eos) else list(eos) if isinstance(eos, (list, tuple)) else None
    if ids is None or not all(is_integer(i) for i in ids):  # a string id would never match a token: no stop
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
    vocab_size = model.config.get_text_config().vocab_size
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"{where}: eos_token_id {i} is outside the vocabulary [0, {vocab_size})")
    return ids


class ConversationError(ValueError):
    """A conversation's message the chat template cannot take: ``message_index`` is its place,
    ``part_index`` that of the content part at fault (or None), ``reason`` what is wrong."""

    def __init__(self, reason: str, message_index: int, part_index: int | None = None):
        where = f"message {message_index}" + ("" if part_index is None else f", part {part_index}")
        super().__init__(f"{where}: {reason}")
        self.reason, self.message_index, self.part_index = reason, message_index, part_index


class LLM:
    """Load a model and generate with continuous batching over a paged KV cache.

    ``model``: a checkpoint directory, ``.gguf`` file or hub repo id, or a zoo model already
    built (then without a tokenizer or processor unless one is given; ``dtype``/``device`` are the
    model's, and a ``device`` other than the model's is an error). A model that takes images
    (LLaVA) preprocesses them with the checkpoint's ``processor`` (transformers' ``AutoProcessor``).
    ``dtype``: "auto" (the default) is the checkpoint's dtype on CUDA and float32 on the CPU.
    ``device``: CUDA when there is one, else the CPU. The engine's options (``EngineConfig``) are
    keywords, ``LLM(path, max_num_seqs=8)``, or a ``config``, and are checked before the model
    loads. On the CPU, weights already in ``dtype`` that a layer takes whole (embeddings, norms,
    linear layers of one HF projection; not fused ones such as q/k/v) map their safetensors file:
    truncating or rewriting it in place while the ``LLM`` lives ends the process (SIGBUS);
    ``mmap=False`` copies them. ``keep_mxfp4``: MXFP4 experts (gpt-oss's) stay in MXFP4, in about a
    quarter of their bfloat16 memory (``from_pretrained``'s option; None: on CUDA). On the CPU,
    ``compile_decode`` runs every decode step through one graph torch.compile builds when ``LLM``
    starts (30-60 s; inductor keeps what it built on disk):
    SmolLM2's steps of 1 to 64 sequences run 1.03-1.35x faster than eager ones in float32 and
    1.3-1.5x in bfloat16. Each ``LLM`` compiles its own graph, into which inductor freezes the
    weights and keeps them for the life of the process: a compiled ``LLM``'s weights stay in
    memory after it is released.

    ``tensor_parallel_size=N`` splits the model over N ranks (``layers.tensor_parallel``): this
    process is rank 0 and starts N-1 worker processes, on N CUDA devices (rank r on cuda:r) or the
    CPU (``runtime.parallel``). A rank that dies raises a RuntimeError naming it; ``shutdown``
    stops the workers.

    An ``LLM`` is not thread-safe: a call from a second thread while another thread's call (or
    stream) runs raises a RuntimeError at once. Use one ``LLM`` per thread, or ``zoo serve``.
    """

    def __init__(self, model, dtype="auto", device=None, *, tokenizer=None, processor=None,
                 config: EngineConfig | None = None, mmap: bool = True, keep_mxfp4: bool | None = None, **options):
        config = EngineConfig.from_options(config, **options)  # checked before a model loads for minutes
        check_load_flags(mmap=mmap, keep_mxfp4=keep_mxfp4)
        if tokenizer is not None and not isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a transformers tokenizer (transformers.AutoTokenizer.from_pretrained), "
                            f"got {type(tokenizer).__name__}")
        if isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"LLM takes a checkpoint or a zoo model, not transformers' {type(model).__name__}: "
                            "convert it with models.AutoModelForCausalLM.from_hf(model)")
        if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
            raise TypeError(f"LLM takes a checkpoint (a directory, a .gguf file or a hub repo id) or a zoo model, "
                            f"got {type(model).__name__}")
        self.ranks = None
        if isinstance(model, torch.nn.Module):
            if config.tensor_parallel_size > 1:
                raise ValueError("tensor_parallel_size > 1 takes a checkpoint, which each rank loads its slice of, "
                                 "not a model already built")
            if keep_mxfp4 is not None:
                raise ValueError("keep_mxfp4 says how a checkpoint loads: give LLM the checkpoint, or load the model "
                                 "with AutoModelForCausalLM.from_pretrained(..., keep_mxfp4=...)")
            where = next(model.parameters()).device
            asked = None if device is None else model_device(device)
            if asked is not None and (asked.type, asked.index or 0) != (where.type, where.index or 0):
                raise ValueError(f"device {str(asked)!r}: a built model runs where it is, on {where}; "
                                 f"move it first (model.to({str(asked)!r})) or leave device out")
            self.model, self.tokenizer, self.processor, checkpoint = model, tokenizer, processor, None
        else:
            device = model_device(("cuda" if torch.cuda.is_available() else "cpu") if device is None else device)
            if dtype == "auto" and device.type == "cpu":
                dtype = torch.float32
            self.tokenizer = tokenizer or load_tokenizer(model)  # a damaged tokenizer fails before the weights load
            if config.tensor_parallel_size > 1:
                self.ranks = Ranks.start(config.tensor_parallel_size, model, dtype, device, config, mmap=mmap,
                                         keep_mxfp4=keep_mxfp4)
                device = self.ranks.device
            with self._all_ranks():
                self.model = AutoModelForCausalLM.from_pretrained(
                    model, dtype=dtype, device=device, mmap=mmap, keep_mxfp4=keep_mxfp4,
                    tensor_parallel=None if self.ranks is None else self.ranks.group)
                takes_images = getattr(self.model, "image_token_id", None) is not None
                self.processor = processor or (load_processor(model) if takes_images else None)
            checkpoint = model
        # A template that does not compile fails every chat but no generation: named at load, raised by chat_prompt.
        self._chat_template_error = chat_template_error(self._renderer, checkpoint)
        if self._chat_template_error is not None:
            logger.warning("%s; chats fail, generation works", self._chat_template_error)
        # The engine writes its buffers in place at every step, whether generate runs under
        # inference_mode or not; made under inference_mode, they could not be written outside it.
        with torch.inference_mode(False), self._all_ranks():
            self.engine = Engine(self.model, self.tokenizer, generation_eos_ids(self.model, checkpoint), config,
                                 self.processor, self.ranks)
        self._next_id = 0
        self._owner: int | None = None  # the thread whose call is running
        self._owner_lock = threading.Lock()

    def _all_ranks(self):
        """Where ranks run a part together: a failure takes the group down (``runtime.parallel``)."""
        return contextlib.nullcontext() if self.ranks is None else self.ranks.together()

    @property
    def failure(self) -> str | None:
        """Why this LLM cannot generate any more (its tensor-parallel group is down), or None."""
        return None if self.ranks is None else self.ranks.failure

    def reset_prefix_cache(self) -> None:
        """Forget the prompts' blocks that the prefix cache keeps after their requests finished, so
        that a later call computes them again (a benchmark that runs the same prompts twice)."""
        with self._one_thread():
            self.engine.block_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel LLM; it generates no more. (Interpreter
        exit stops them too.)"""
        if self.ranks is not None:
            self.ranks.shutdown()

    @contextlib.contextmanager
    def _one_thread(self):
        """Marks a call as running in this thread; a call from another thread meanwhile raises
        (the engine's state is one batch, which two threads would corrupt)."""
        me = threading.get_ident()
        with self._owner_lock:
            if self._owner not in (None, me):
                raise RuntimeError("LLM is not thread-safe: another thread is generating with it; "
                                   "use one LLM per thread, or `zoo serve`")
            outermost, self._owner = self._owner is None, me
        try:
            yield
        finally:
            if outermost:
                self._owner = None

    def _add_requests(self, prompts, sampling_params) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and is_integer(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a string, a list of token ids, a dict, or a list of these, "
                            f"got {type(prompts).__name__}")
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, (str, dict, list, tuple)):
                raise TypeError(f"prompts[{index}] must be a string, a list of token ids or a dict, "
                                f"got {type(prompt).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            # Iterated, a dict would give its keys as requests' settings. An element of a list is
            # checked by the engine, failing its request alone.
            dict_hint = "; make one of its settings with SamplingParams(**settings)"
            hint = dict_hint if isinstance(sampling_params, dict) else ""
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}{hint}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        outputs = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                outputs.append(self.engine.add_request(self._next_id, prompt, params))
                self._next_id += 1
        except BaseException:  # the call fails whole: none of its requests is left to compute
            self.engine.abort([o.request_id for o in outputs if not o.finished])
            raise
        return outputs

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts -> finished outputs, in input order. A prompt is a string, a list of token ids, or
        a dict of vLLM's shape: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, with images in
        ``"multi_modal_data": {"image": img or [img, ...]}`` (``runtime.multimodal``).
        ``sampling_params``: one ``SamplingParams`` for every prompt, or a list of them, one per prompt."""
        with self._one_thread():
            outputs = self._add_requests(prompts, sampling_params)
            unfinished = {o.request_id for o in outputs if not o.finished}
            start, generated = time.perf_counter(), 0
            with self._aborting_unfinished(outputs), tqdm(total=len(outputs), initial=len(outputs) - len(unfinished),
                                                          desc="Generating", disable=not use_tqdm) as bar:
                # The engine may also hold the requests of a stream of this thread that waits for its reader.
                while unfinished and self.engine.has_unfinished():
                    changed = self.engine.step()
                    finished = unfinished.intersection(o.request_id for o in changed if o.finished)
                    unfinished -= finished
                    if bar.disable:
                        continue
                    generated += sum(1 for o in changed if o.error is None)
                    bar.update(len(finished))
                    bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}", refresh=False)
            return outputs

    @contextlib.contextmanager
    def _aborting_unfinished(self, outputs):
        # A call left early (an exception, Ctrl-C, a stream its reader stopped reading) drops its
        # unfinished requests: later calls must not compute them.
        try:
            yield
        finally:
            self.engine.abort([o.request_id for o in outputs if not o.finished])

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamDelta]:
        """Yield each request's new tokens and text as they are generated."""
        with self._one_thread():
            yield from self._stream(prompts, sampling_params)

    def _stream(self, prompts, sampling_params) -> Iterator[StreamDelta]:
        # Deltas come from the outputs' state, not from the steps this stream runs: while it is
        # suspended, another call of the same thread (a generate, a second stream) steps its requests too.
        outputs = self._add_requests(prompts, sampling_params)
        sent_tokens, sent_text, ended = [0] * len(outputs), [0] * len(outputs), [False] * len(outputs)
        with self._aborting_unfinished(outputs):
            while True:
                for index, output in enumerate(outputs):
                    if ended[index] or (len(output.token_ids) == sent_tokens[index] and not output.finished):
                        continue
                    self.engine.refresh_text(output)
                    stops = [] if output.finished else self.engine.sequences[output.request_id].params.stop
                    text = output.text if output.finished else settled_text(output.text, stops)
                    delta = StreamDelta(index, output.token_ids[sent_tokens[index]:], text[sent_text[index]:],
                                        output.finish_reason, output.error)
                    # Counted before the yield: while it waits, other calls' steps may add tokens.
                    sent_tokens[index] += len(delta.token_ids)
                    sent_text[index], ended[index] = len(text), delta.finish_reason is not None
                    yield delta
                if all(ended):
                    return
                if all(o.finished for o in outputs):  # finished by other calls' steps: their last deltas are due
                    continue
                if not self.engine.has_unfinished():  # dropped by another call
                    return
                self.engine.step()

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them. A content is a
        string or a list of OpenAI-style parts, ``{"type": "text", "text": ...}`` and, for a model
        that takes images, ``{"type": "image", "image": img}``, rendered by the processor's chat
        template. Of several conversations, one the template cannot take is named by its place."""
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a conversation (a list of message dicts) or a list of them, "
                            f"got {type(messages).__name__}")
        if messages and isinstance(messages[0], dict):
            return self.generate([self.chat_prompt(messages)], sampling_params, use_tqdm)
        prompts = []
        for index, conversation in enumerate(messages):
            try:
                prompts.append(self.chat_prompt(conversation))
            except ValueError as exc:
                raise ValueError(f"conversation {index}: {exc}") from exc
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict]) -> list[int] | dict:
        """The conversation's prompt: its token ids, or with images a ``prompt_token_ids`` dict. A
        conversation the chat template cannot take is a ValueError naming the message at fault, or
        quoting the template's own error; a template that does not compile, one naming its file."""
        renderer = self._renderer
        if renderer is None or not getattr(renderer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        if self._chat_template_error is not None:
            raise ValueError(self._chat_template_error)
        messages = self._template_messages(conversation)
        images = [part["image"] for message in messages if isinstance(message["content"], list)
                  for part in message["content"] if part["type"] == "image"]
        try:
            text = renderer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template rejects a conversation by raising its own errors
            raise ValueError(f"the chat template rejects the messages: {exc}") from exc
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids

    @property
    def _renderer(self):
        """What renders chats: the processor of a model that takes images, else the tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    def _template_messages(self, conversation) -> list[dict]:
        """The conversation, checked, as chat templates take it: a message of text parts only has them
        joined into one string, as most templates expect a string."""
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(f"a conversation is a non-empty list of messages, got {conversation!r:.80}")
        takes_images = self.engine.image_token_id is not None
        messages = []
        for i, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ConversationError(f"a message is a dict with a 'role' string, got {message!r:.80}", i)
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "image" and not takes_images:
                        raise ConversationError(f"{type(self.model).__name__} takes no images", i, j)
                    text_part = kind == "text" and isinstance(part.get("text"), str)
                    if not (text_part or kind == "image" and "image" in part):
                        raise ConversationError(f"a part is {{'type': 'text', 'text': str}} or "
                                                f"{{'type': 'image', 'image': img}}, got {part!r:.80}", i, j)
                if all(part["type"] == "text" for part in content):
                    message = {**message, "content": "".join(part["text"] for part in content)}
            elif not isinstance(content, str):
                raise ConversationError(f"its content is a string or a list of parts, got {content!r:.80}", i)
            texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
            for text in texts:
                try:
                    text.encode()
                except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
                    raise ConversationError(f"its text {text!r:.60} is not valid Unicode: {exc}", i) from None
            messages.append(message)
        return messages


def settled_text(text: str, stops: list[str]) -> str:
    """The part of a running request's text that no later token changes. A trailing U+FFFD is a
    character whose bytes have not all arrived yet; a tail that begins a stop string may be cut."""
    text = text.rstrip("\ufffd")
    return text[: len(text) - max((_stop_prefix_ending(text, stop) for stop in stops), default=0)]


def _stop_prefix_ending(text: str, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text`` ends with. Only the places
    of stop's first character in text's last len(stop) - 1 are tried: linear in len(stop) unless
    that character repeats."""
    start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while start != -1:
        if stop.startswith(text[start:]):
            return len(text) - start
        start = text.find(stop[0], start + 1)
    return 0
