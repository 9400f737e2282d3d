"""``zoo serve``: the OpenAI API over one ``LLM``, on FastAPI and uvicorn.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus). Handlers submit their requests to one
``EngineLoop`` and await the tokens; a client that goes away, streaming or not, aborts its
requests. Errors take the API's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

import asyncio
import contextlib
import json
import secrets
import signal
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from runtime.engine_loop import (EngineLoop, EngineUnavailable, PastTheContext, RequestGroup, RequestRejected,
                                 TokenLogprob)
from runtime.llm import LLM, ConversationError
from runtime.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

# The largest request body read: room for an image or two as data URLs, or a long context's prompt
# as token ids; a larger one is a 413 before it is read into memory.
MAX_BODY_BYTES = 32 * 2**20
# On SIGINT/SIGTERM, how long running requests may take to finish before they are failed; the
# last second of it delivers their errors before uvicorn closes what is still open.
SHUTDOWN_GRACE_S = 30
_ERRORS_DELIVERED_S = 1


def build_app(llm: LLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server's app; its engine loop runs while the app does (uvicorn's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine_loop = EngineLoop(llm)
        yield
        app.state.engine_loop.stop()

    app = FastAPI(title="zoo", lifespan=lifespan)
    max_model_len, vocab_size = llm.engine.config.max_model_len, llm.engine.vocab_size
    takes_images = llm.engine.image_token_id is not None
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # the client left while sending its request: no one reads this

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {exc}", type="server_error").body(), status_code=500)

    if api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=api_key)

    async def submit(request, prompts: dict) -> RequestGroup:
        """Submit the request's prompts, each keyed by the parameter that names it in errors."""
        if request.model != model_name:
            raise APIError(404, f"The model `{request.model}` does not exist; this server serves `{model_name}`",
                           "model", "model_not_found")
        params = request.sampling_params(max_model_len, vocab_size)
        repeated = [prompt for prompt in prompts.values() for _ in range(request.num_choices)]
        try:
            return await app.state.engine_loop.submit(repeated, params * len(prompts), request.max_tokens_field)
        except RequestRejected as exc:  # the group repeats each prompt once per choice
            param, reason = list(prompts)[exc.index // request.num_choices], str(exc)
            if isinstance(exc.error, PastTheContext):  # the field at fault; the message names the prompt
                raise APIError(400, f"{exc.error.field}: {param}: {reason}", exc.error.field) from exc
            if isinstance(exc.error, ConversationError):  # the chat's message, or its part, at fault
                reason = exc.error.reason
                param += f"[{exc.error.message_index}]"
                if exc.error.part_index is not None:
                    param += f".content[{exc.error.part_index}]"
            raise APIError(400, f"{param}: {reason}", param) from exc
        except EngineUnavailable as exc:  # as /health says it: retry elsewhere
            raise APIError(503, str(exc), type="server_error", code="service_unavailable") from exc
        except Exception as exc:  # the engine loop logged it; the client gets the API's shape of it
            raise APIError(500, f"internal error: {exc}", type="server_error") from exc

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = parse_request(ChatCompletionRequest, await _body(raw))
        image_part = request.first_image_part()
        if image_part is not None and not takes_images:
            raise APIError(400, f"{image_part}: {type(llm.model).__name__} takes no images", image_part)
        # Images are decoded off the event loop, which serves every other client meanwhile.
        conversation = request.conversation() if image_part is None else await asyncio.to_thread(request.conversation)

        async def respond():
            group = await submit(request, {"messages": conversation})
            reply = _Reply("chatcmpl", model_name, request.num_choices, group)
            if request.stream:
                return _StreamAbortingOnClose(reply.chat_chunks(request.include_usage), group)
            return await reply.chat_completion()

        return await _unless_client_leaves(raw, respond())

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = parse_request(CompletionRequest, await _body(raw))

        async def respond():
            group = await submit(request, request.prompts)
            reply = _Reply("cmpl", model_name, request.num_choices, group)
            if request.stream:
                return _StreamAbortingOnClose(reply.completion_chunks(request.include_usage), group)
            return await reply.completion()

        return await _unless_client_leaves(raw, respond())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "zoo", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if (reason := app.state.engine_loop.unavailable) is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.engine_loop.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _body(raw: Request) -> bytes:
    """The request's body; a 413 once it is known to pass MAX_BODY_BYTES, from its Content-Length
    or as it arrives, before the rest is read."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    if int(raw.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


async def _unless_client_leaves(raw: Request, response):
    """The awaited ``response``; cancelled, its requests aborted, if the client goes away first
    (uvicorn answers ``receive`` with a disconnect once the connection closes). A stream's
    response is returned at once: the stream aborts its own requests."""
    answering = asyncio.ensure_future(response)
    leaving = asyncio.ensure_future(_disconnected(raw))
    await asyncio.wait({answering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    leaving.cancel()
    if not answering.done():
        answering.cancel()  # the reply aborts its group as it is cancelled
        return Response(status_code=499)  # no one reads it
    return answering.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class _RequireAPIKey:
    """Every route but /health answers 401 without the key. A plain ASGI middleware: the responses
    that pass it, streams included, go through untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and secrets.compare_digest(given, self.api_key)):
                refusal = JSONResponse(APIError(401, "Incorrect API key provided", code="invalid_api_key").body(),
                                       status_code=401)
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _StreamAbortingOnClose(StreamingResponse):
    """Server-sent events; when the stream ends, early or not, its unfinished requests are
    aborted (a client that goes away cancels the stream at once)."""

    def __init__(self, events, group: RequestGroup):
        super().__init__(events, media_type="text/event-stream")
        self.group = group

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


def _event(payload) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Reply:
    """One response's choices (the group's requests, ``n`` per prompt), whole or as chunks."""

    def __init__(self, prefix: str, model_name: str, n: int, group: RequestGroup):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.group = group
        # A prompt is counted once however many choices it has.
        self.prompt_tokens = sum(len(ids) for ids in group.prompt_token_ids[::n])
        self.completion_tokens = 0

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def deltas(self):
        """The group's deltas; an error in any ends the reply with it."""
        async for delta in self.group.deltas():
            if delta.error:
                raise APIError(500, delta.error, type="server_error")
            self.completion_tokens += len(delta.token_ids)
            yield delta

    async def choices(self) -> list[dict]:
        """Each choice's text, logprobs and finish reason once all have finished."""
        choices = [{"text": "", "logprobs": None, "finish_reason": None} for _ in self.group.request_ids]
        try:
            async for delta in self.deltas():
                choice = choices[delta.index]
                choice["text"] += delta.text
                if delta.logprobs is not None:
                    choice["logprobs"] = (choice["logprobs"] or []) + delta.logprobs
                choice["finish_reason"] = delta.finish_reason
        finally:
            self.group.abort()  # all finished, unless the handler was cancelled
        return choices

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name}

    # -- chat -----------------------------------------------------------------------------

    async def chat_completion(self) -> dict:
        choices = [{"index": index, "message": {"role": "assistant", "content": choice["text"]},
                    "logprobs": _chat_logprobs(choice["logprobs"]), "finish_reason": choice["finish_reason"]}
                   for index, choice in enumerate(await self.choices())]
        return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}

    async def chat_chunks(self, include_usage: bool):
        def chunk(choices: list[dict]) -> str:
            return _event({**self._head("chat.completion.chunk"), "choices": choices,
                           **({"usage": None} if include_usage else {})})

        for index in range(len(self.group.request_ids)):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for event in self._chunks(chunk, lambda delta: (
                {"index": delta.index, "delta": {"content": delta.text}, "logprobs": _chat_logprobs(delta.logprobs),
                 "finish_reason": None}),
                lambda delta: {"index": delta.index, "delta": {}, "logprobs": None,
                               "finish_reason": delta.finish_reason}):
            yield event
        if include_usage:
            yield _event({**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    # -- completions ----------------------------------------------------------------------

    async def completion(self) -> dict:
        choices = [{"index": index, "text": choice["text"], "logprobs": _completion_logprobs(choice["logprobs"]),
                    "finish_reason": choice["finish_reason"]}
                   for index, choice in enumerate(await self.choices())]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage()}

    async def completion_chunks(self, include_usage: bool):
        def chunk(choices: list[dict]) -> str:
            return _event({**self._head("text_completion"), "choices": choices,
                           **({"usage": None} if include_usage else {})})

        text_offsets = [0] * len(self.group.request_ids)  # each choice's tokens' text so far

        def content(delta) -> dict:
            logprobs = _completion_logprobs(delta.logprobs, text_offsets[delta.index])
            text_offsets[delta.index] += sum(len(t.token) for t in delta.logprobs or [])
            return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}

        async for event in self._chunks(chunk, content, lambda delta: {"index": delta.index, "text": "",
                                                                       "logprobs": None,
                                                                       "finish_reason": delta.finish_reason}):
            yield event
        if include_usage:
            yield _event({**self._head("text_completion"), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    async def _chunks(self, chunk, content, finish):
        """A chunk per delta that carries text or tokens, and one per choice that finishes;
        an error becomes the stream's last event."""
        try:
            async for delta in self.deltas():
                if delta.text or delta.token_ids:
                    yield chunk([content(delta)])
                if delta.finish_reason is not None:
                    yield chunk([finish(delta)])
        except APIError as exc:
            yield _event(exc.body())


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(t: TokenLogprob) -> dict:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}

    return {"content": [{**entry(t), "top_logprobs": [entry(top) for top in t.top]} for t in logprobs]}


def _completion_logprobs(logprobs: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    """The legacy logprobs of tokens whose text starts at ``text_offset`` of the choice's (a
    stream's chunk carries the tokens after those before it)."""
    if logprobs is None:
        return None
    offsets = []
    for t in logprobs:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{top.token: top.logprob for top in t.top} for t in logprobs], "text_offset": offsets}


class Server(uvicorn.Server):
    """uvicorn's server of a ``build_app`` app. Requests still running near the end of its
    graceful shutdown are failed by the engine loop, each client reading an error that says the
    server is shutting down, rather than cut off when uvicorn cancels what is left."""

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        if grace is None:  # uvicorn waits for every request
            return await super().shutdown(sockets)
        loop = asyncio.get_running_loop()
        engine_loop = self.config.app.state.engine_loop
        failing = loop.call_later(max(0, grace - _ERRORS_DELIVERED_S), loop.run_in_executor, None, engine_loop.stop)
        try:
            await super().shutdown(sockets)
        finally:
            failing.cancel()


def serve(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM: then stop accepting, let running requests finish (for up to
    SHUTDOWN_GRACE_S, then fail them), and return."""
    app = build_app(llm, model_name, api_key)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    if threading.current_thread() is threading.main_thread():
        # uvicorn raises the signal that stopped it again once it has shut down, under the
        # handlers it found: these make that a return, and the process's exit status 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: None)
    try:
        Server(config).run()
    finally:
        # A second Ctrl-C makes uvicorn skip the app's shutdown: the engine's thread must not be
        # stepping on the device while the interpreter exits.
        if (engine_loop := getattr(app.state, "engine_loop", None)) is not None:
            engine_loop.stop()
