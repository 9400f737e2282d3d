"""``EngineLoop``: one engine, many clients.

A thread of its own owns the engine: it takes in submissions and aborts between steps, steps
the engine while anything is unfinished, and hands each request's new tokens and text to the
asyncio queue of the coroutine that submitted it. Requests submitted concurrently share the
engine's continuous batching. Everything that touches the engine's state runs in that thread.
Threads of their own (``PROMPT_THREADS``) prepare each submission's prompts before the engine's
takes it in (chat template, tokenizing, images: ``Engine.prepare_prompt``), so that a long
prompt's tokenizing stalls neither the requests that run nor the other submissions; the tokenizer
releases the GIL while it encodes. A submission whose caller has left before the engine's thread
takes it in is dropped, unprepared or unadded.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from runtime.detokenizer import token_text
from runtime.engine import RequestOutput
from runtime.llm import LLM, settled_text
from runtime.sampling_params import SamplingParams
from runtime.serving_metrics import ServingMetrics

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprob:
    """A generated token's text, bytes and log-probability, and those of the most likely tokens in
    its place. A token's text shows U+FFFD where it holds part of a character; its bytes are its own."""

    token: str
    token_bytes: bytes
    logprob: float
    top: list["TokenLogprob"]  # most likely first; none in the top entries themselves


@dataclass
class Delta:
    """What one request of a group gained in one step."""

    index: int  # the request's place in its group
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None  # one per token of token_ids, where the request asked for them
    finish_reason: str | None
    error: str | None = None


class EngineUnavailable(RuntimeError):
    """No request can be queued: the engine loop has stopped, the LLM's ranks have failed, or the
    server is shutting down (``GET /health`` says which)."""


class RequestRejected(ValueError):
    """The error of a request the engine refuses to add; ``index`` is its place in its group,
    ``error`` the ValueError it was refused with (a ConversationError names a chat's message and part)."""

    def __init__(self, index: int, error: ValueError):
        super().__init__(str(error))
        self.index, self.error = index, error


class PastTheContext(ValueError):
    """A prompt whose tokens and the ``max_tokens`` its request asks for exceed ``max_model_len``;
    ``field`` names the request's field that asks (OpenAI refuses such a request, not cuts it short)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class _Submission:
    prompts: list  # per request: a text, token ids, or a conversation (a list of messages); then prepared
    params: list[SamplingParams]
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    accepted: Future  # set to [(request_id, prompt_token_ids)], or to the error adding the requests raised
    arrival: float
    max_tokens_field: str | None = None  # the request's field that set max_tokens, where it did
    rejection: Exception | None = None  # why its prompts could not be prepared


@dataclass
class _Tracked:
    """The engine thread's view of a running request: where its deltas go and what they carried."""

    submission: _Submission
    index: int
    sent_tokens: int = 0
    sent_text: int = 0
    last_token_time: float | None = None


_STOP = object()
# Prompts prepared at once: a submission whose prompt takes seconds to tokenize holds up no other
# unless this many do.
PROMPT_THREADS = 4
_SHUTTING_DOWN = "the server is shutting down"


class RequestGroup:
    """The requests of one submission: their ids, prompt ids, and their deltas as they come."""

    def __init__(self, engine_loop: "EngineLoop", accepted: list[tuple[int, list[int]]], deltas: asyncio.Queue):
        self.request_ids = [request_id for request_id, _ in accepted]
        self.prompt_token_ids = [ids for _, ids in accepted]
        self._engine_loop = engine_loop
        self._deltas = deltas

    async def deltas(self):
        """Every delta of the group's requests until each has finished."""
        unfinished = len(self.request_ids)
        while unfinished:
            delta = await self._deltas.get()
            unfinished -= delta.finish_reason is not None
            yield delta

    def abort(self) -> None:
        """Drop the group's unfinished requests; their blocks are freed before the next step."""
        self._engine_loop.abort(self.request_ids)


class EngineLoop:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine
        self._commands: queue.Queue = queue.Queue()
        self._unprepared: queue.Queue = queue.Queue()  # submissions on their way to the prompt threads
        self._tracked: dict[int, _Tracked] = {}
        # The deltas of one pass of the thread, per client event loop: each loop is woken once a pass.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        self._request_ids = itertools.count()
        # Requests submitted and taken in, each counted by one thread: the difference waits in the queue.
        self._num_submitted = self._num_taken_in = 0
        # Once stopping, no submission enters a queue: those not yet in the engine's are refused.
        self._stopping, self._stopping_lock = False, threading.Lock()
        self.metrics = ServingMetrics(self.engine, lambda: self._num_submitted - self._num_taken_in)
        self._thread = threading.Thread(target=self._run, name="zoo-engine", daemon=True)
        self._prompt_threads = [
            threading.Thread(target=self._prepare_submissions, name=f"zoo-prompts-{i}", daemon=True)
            for i in range(PROMPT_THREADS)
        ]
        self._thread.start()
        for thread in self._prompt_threads:
            thread.start()

    # -- the clients' side (any thread; submit from a coroutine) ------------------------------

    async def submit(self, prompts: list, params: list[SamplingParams], max_tokens_field: str | None = None
                     ) -> RequestGroup:
        """Queue requests (one per prompt, each with its params) as one group. The group's first bad
        request raises RequestRejected naming what is wrong, and none of the group runs.
        ``max_tokens_field``: the request field that set the params' max_tokens, which the prompt
        and its max_tokens must then fit in max_model_len (``PastTheContext``); None: the engine
        stops each request where the context ends."""
        if self.unavailable is not None:
            raise EngineUnavailable(self.unavailable)
        submission = _Submission(prompts, params, asyncio.get_running_loop(), asyncio.Queue(), Future(),
                                 time.perf_counter(), max_tokens_field)
        with self._stopping_lock:
            if self._stopping:
                raise EngineUnavailable(_SHUTTING_DOWN)
            self._num_submitted += len(prompts)
            self._unprepared.put(submission)
        try:
            accepted = await asyncio.wrap_future(submission.accepted)
        except asyncio.CancelledError:
            # The caller left while the requests were being queued. Unless the engine's thread had
            # already taken them in, cancelling drops them (``_admit``); else they are aborted.
            def abort_once_accepted(done: Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.abort([request_id for request_id, _ in done.result()])

            submission.accepted.add_done_callback(abort_once_accepted)
            raise
        return RequestGroup(self, accepted, submission.deltas)

    def abort(self, request_ids) -> None:
        self._commands.put(list(request_ids))

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served (the thread has ended, or the LLM's ranks have failed), or None."""
        if not (self._thread.is_alive() and all(thread.is_alive() for thread in self._prompt_threads)):
            return "the engine loop has stopped"
        return self.llm.failure

    def stop(self) -> None:
        """End what still runs (its clients get an error delta) and the engine's thread; refuse
        the submissions not yet taken in. A prompt being tokenized is not waited for: its
        submission is refused once it is."""
        with self._stopping_lock:
            self._stopping = True
            self._commands.put(_STOP)
            for _ in self._prompt_threads:
                self._unprepared.put(_STOP)
        self._thread.join()

    # -- the prompt threads -----------------------------------------------------------------

    def _prepare_submissions(self) -> None:
        while (submission := self._unprepared.get()) is not _STOP:
            if not (self._stopping or submission.accepted.cancelled()):
                self._prepare(submission)
            with self._stopping_lock:
                if not self._stopping:
                    self._commands.put(submission)  # a rejected one too: the engine thread answers every submission
                    continue
            if submission.accepted.set_running_or_notify_cancel():
                submission.accepted.set_exception(EngineUnavailable(_SHUTTING_DOWN))

    def _prepare(self, submission: _Submission) -> None:
        # The server repeats a prompt once per choice: each distinct prompt is prepared once.
        prepared, by_identity = [], {}
        try:
            for prompt in submission.prompts:
                if id(prompt) not in by_identity:
                    conversation = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
                    rendered = self.llm.chat_prompt(prompt) if conversation else prompt
                    by_identity[id(prompt)] = self.engine.prepare_prompt(rendered)
                self._check_room(submission, by_identity[id(prompt)], submission.params[len(prepared)])
                prepared.append(by_identity[id(prompt)])
        except Exception as exc:  # a bad prompt fails its submission alone, never the thread
            if isinstance(exc, ValueError):  # the request at fault is the one after those prepared
                exc = RequestRejected(len(prepared), exc)
            else:
                logger.exception("a request's prompt could not be prepared")
            submission.rejection = exc
            return
        submission.prompts = prepared

    def _check_room(self, submission: _Submission, prompt, params: SamplingParams) -> None:
        max_model_len, field = self.engine.config.max_model_len, submission.max_tokens_field
        if field is not None and len(prompt.token_ids) + params.max_tokens > max_model_len:
            raise PastTheContext(f"{len(prompt.token_ids)} prompt tokens and {field}={params.max_tokens} make "
                                 f"{len(prompt.token_ids) + params.max_tokens}, past max_model_len ({max_model_len}); "
                                 f"lower {field}, or leave it out to generate until the context is full", field)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            command = self._next_command(block=not self.engine.has_unfinished())
            while command is not None:
                if command is _STOP:
                    self._fail(list(self._tracked), _SHUTTING_DOWN)
                    self._deliver()
                    return
                self._handle(command)
                command = self._next_command(block=False)
            if self.engine.has_unfinished():
                self._step()
            self._deliver()

    def _handle(self, command) -> None:
        if isinstance(command, _Submission):
            self._num_taken_in += len(command.prompts)
            self._admit(command)
        else:
            self._abort(command)

    def _next_command(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _admit(self, submission: _Submission) -> None:
        if not submission.accepted.set_running_or_notify_cancel():
            return  # its caller has left: the requests would run for no one
        if submission.rejection is not None:
            submission.accepted.set_exception(submission.rejection)
            return
        added = []
        try:
            for prompt, params in zip(submission.prompts, submission.params, strict=True):
                output = self.engine.add_request(next(self._request_ids), prompt, params)
                if output.error:
                    raise ValueError(output.error.partition(": ")[2])  # without the engine's request id
                added.append(output)
        except Exception as exc:  # a request the engine rejects or chokes on fails alone, never the loop
            if isinstance(exc, ValueError):  # the request at fault is the one after those added
                exc = RequestRejected(len(added), exc)
            else:
                logger.exception("a request failed to enter the engine")
            self.engine.abort([o.request_id for o in added])
            submission.accepted.set_exception(exc)
            return
        for index, output in enumerate(added):
            self._tracked[output.request_id] = _Tracked(submission, index)
        submission.accepted.set_result([(o.request_id, o.prompt_token_ids) for o in added])

    def _abort(self, request_ids: list[int]) -> None:
        self.engine.abort(request_ids)
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def _step(self) -> None:
        try:
            changed = self.engine.step()
        except Exception as exc:  # a failed step fails what runs, never the loop
            logger.exception("an engine step failed")
            self._fail(list(self._tracked), f"the engine failed: {exc}")
            return
        now = time.perf_counter()
        for output in changed:
            if output.request_id in self._tracked:
                self._send(output, now)

    def _fail(self, request_ids: list[int], message: str) -> None:
        self.engine.abort(request_ids)
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id)
            self._put(tracked, Delta(tracked.index, [], "", None, "error", message))

    def _send(self, output: RequestOutput, now: float) -> None:
        tracked = self._tracked[output.request_id]
        if output.finished:
            del self._tracked[output.request_id]
            text = output.text
        else:
            self.engine.refresh_text(output)
            text = settled_text(output.text, self.engine.sequences[output.request_id].params.stop)
        new_ids = output.token_ids[tracked.sent_tokens:]
        logprobs = None
        if output.logprobs is not None:
            top = tracked.submission.params[tracked.index].logprobs
            # Logprobs are recorded when a token is sampled, before it reaches the host: the
            # entries of the tokens in this delta are those at the same places.
            entries = output.logprobs[tracked.sent_tokens:len(output.token_ids)]
            logprobs = [self._token_logprob(token, entry, top) for token, entry in zip(new_ids, entries)]
        self._record_timing(tracked, output, len(new_ids), now)
        self._put(tracked, Delta(tracked.index, new_ids, text[tracked.sent_text:], logprobs, output.finish_reason,
                                 output.error))
        tracked.sent_tokens, tracked.sent_text = len(output.token_ids), len(text)

    def _token_logprob(self, token: int, entry: dict[int, float], top: int) -> TokenLogprob:
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:top]
        return TokenLogprob(*self._token_text(token), entry[token],
                            [TokenLogprob(*self._token_text(t), v, []) for t, v in ranked])

    def _token_text(self, token: int) -> tuple[str, bytes]:
        tokenizer = self.llm.tokenizer
        return token_text(tokenizer, token) if tokenizer is not None else ("", b"")

    def _record_timing(self, tracked: _Tracked, output: RequestOutput, new_tokens: int, now: float) -> None:
        if not new_tokens:
            return
        metrics = self.metrics
        if tracked.last_token_time is None:
            metrics.time_to_first_token.observe(now - tracked.submission.arrival)
            metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        else:
            gap = (now - tracked.last_token_time) / new_tokens
            for _ in range(new_tokens):
                metrics.inter_token_latency.observe(gap)
        metrics.generation_tokens.inc(new_tokens)
        tracked.last_token_time = now

    def _put(self, tracked: _Tracked, delta: Delta) -> None:
        submission = tracked.submission
        self._outbox.setdefault(submission.loop, []).append((submission.deltas, delta))

    def _deliver(self) -> None:
        for loop, deltas in self._outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, deltas)
            except RuntimeError:  # the client's event loop has closed: no one is listening
                pass
        self._outbox = {}


def _put_all(deltas: list[tuple[asyncio.Queue, Delta]]) -> None:
    for deltas_queue, delta in deltas:
        deltas_queue.put_nowait(delta)
