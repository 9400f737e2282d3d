"""The OpenAI API's requests as the server takes them (pydantic models), turned into
``SamplingParams``; and its error shape.

Requests are checked strictly: a field of the wrong type or one the API does not have (or zoo
does not take) is a 400 naming the field. zoo also takes vLLM's sampling extensions ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos`` and ``stop_token_ids`` (the openai client sends
them through ``extra_body``).
"""

import base64
import binascii
import io
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from runtime.sampling_params import SamplingParams


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


# A request's choices are built and queued at once: OpenAI's maximum of n bounds that work, and
# MAX_CHOICES its prompts times n (a list of 2,048 prompts, one choice each).
MAX_N = 128
MAX_CHOICES = 2048
# OpenAI takes 4 stop sequences; zoo takes 16 for requests written for vLLM, which has no cap,
# while bounding the stop strings matched against every new token's text: 16 of at most 1,024
# characters each.
MAX_STOP = 16
MAX_STOP_LENGTH = 1024
# Stop token ids are checked against every new token: a few hundred cover any model's end tokens.
MAX_STOP_TOKEN_IDS = 256


def _list_of(item):
    """A list that stops at its first bad element: one error, where pydantic would otherwise record one
    per element (a list of millions of them in a 32 MiB body took a minute and gigabytes to reject)."""
    return Annotated[list[item], Field(fail_fast=True)]


class _SamplingRequest(_Strict):
    """The fields chat and completions share; ``None`` is the default, as in the API."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: str | _list_of(str) | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: _list_of(int) | None = None

    def check(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
        for i, stop in enumerate(stops):
            if len(stop) > MAX_STOP_LENGTH:
                param = f"stop[{i}]" if isinstance(self.stop, list) else "stop"
                raise APIError(400, f"{param}: a stop sequence takes at most {MAX_STOP_LENGTH} characters, "
                                    f"got {len(stop)}", param)
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
                           "stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is for streamed requests: set stream to true, or leave it out",
                           "stream_options")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_model_len: int, vocab_size: int) -> list[SamplingParams]:
        """One SamplingParams per choice, checked; choice i of a seeded request draws with seed + i
        (``_choice_seed``). Without max_tokens a request may run to max_model_len."""
        given = {
            "max_tokens": self._max_tokens(), "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "logprobs": self._logprobs(),
        }
        params = SamplingParams(**{name: value for name, value in given.items() if value is not None})
        if self._max_tokens() is None:
            params.max_tokens = max_model_len
        choices = []
        for index in range(self.num_choices):
            choice = SamplingParams(**{**vars(params), "seed": self._choice_seed(index)})
            try:
                choice.validate(vocab_size)
            except ValueError as exc:
                # The message names the request's field, not SamplingParams' (a chat's top_logprobs sets logprobs).
                name = str(exc).split()[0]
                param = self._request_field(name)
                raise APIError(400, param + str(exc)[len(name):], param) from exc
            choices.append(choice)
        return choices

    @property
    def max_tokens_field(self) -> str | None:
        """The field that sets max_tokens (``max_tokens``, or a chat's ``max_completion_tokens``), or
        None where the request leaves it out (it then runs until the context is full)."""
        return None if self._max_tokens() is None else self._request_field("max_tokens")

    def _choice_seed(self, index: int) -> int | None:
        """Choice ``index``'s seed, seed + index, wrapped modulo 2**64 past the largest seed: the
        choices' seeds stay distinct and in range. Choice 0's is the request's as given, checked
        before any other (a seed out of range is named, not wrapped)."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**64

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _request_field(self, sampling_field: str) -> str:
        """The request's field that sets a SamplingParams field of the same name."""
        return sampling_field


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | _list_of(Annotated[TextPart | ImagePart, Field(discriminator="type")]) | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's: the call it answers, which chat templates render

    def for_template(self, index: int) -> dict:
        """The message (``messages[index]``) as ``LLM.chat`` takes it (which joins text-only parts):
        its parts as dicts, each image decoded from its data URL."""
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                       else {"type": "image", "image": decoded_image(part.image_url.url,
                                                                     f"messages[{index}].content[{i}].image_url.url")}
                       for i, part in enumerate(content)]
        message = {"role": self.role, "content": content or ""}
        for field in ("name", "tool_call_id"):
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        return message


def decoded_image(url: str, param: str):
    """The PIL image of a ``data:image/...;base64,...`` URL. zoo fetches nothing: other URLs are an error."""
    from PIL import Image

    header, comma, payload = url.partition(",")
    if not (url.startswith("data:image/") and header.endswith(";base64") and comma):
        raise APIError(400, "an image_url must be a data URL (data:image/<format>;base64,<data>); zoo fetches no "
                            "URLs", param)
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(400, f"the image in the data URL cannot be read: {exc}", param) from exc
    return image


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    def first_image_part(self) -> str | None:
        """The parameter naming the first image part of the messages (``messages[i].content[j]``), or None."""
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if isinstance(part, ImagePart):
                        return f"messages[{i}].content[{j}]"
        return None

    def conversation(self) -> list[dict]:
        """The messages as ``LLM.chat`` takes them, their images decoded."""
        return [message.for_template(i) for i, message in enumerate(self.messages)]

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _request_field(self, sampling_field: str) -> str:
        if sampling_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs"}.get(sampling_field, sampling_field)


def _prompt_form(prompt) -> str:
    """A prompt's form, read off its first element: only that form is validated (a list of millions
    of token ids also validated as a list of texts took seconds, an error per id)."""
    if not isinstance(prompt, list):
        return "one text"
    first = prompt[0] if prompt else None
    if isinstance(first, list):
        return "token id lists"
    return "token ids" if isinstance(first, int) and not isinstance(first, bool) else "texts"


Prompt = Annotated[
    Annotated[str, Tag("one text")] | Annotated[_list_of(str), Tag("texts")] | Annotated[_list_of(int), Tag("token ids")]
    | Annotated[_list_of(_list_of(int)), Tag("token id lists")],
    Discriminator(_prompt_form),
]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError(400, "echo is not supported: the response carries the generated text only", "echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt is an empty list", "prompt")
        choices = len(self.prompts) * self.num_choices
        if choices > MAX_CHOICES:
            raise APIError(400, f"{len(self.prompts)} prompts times n={self.num_choices} make {choices} choices; "
                                f"a request takes at most {MAX_CHOICES}", "prompt")

    @property
    def prompts(self) -> dict[str, str | list[int]]:
        """Each prompt (a text or a list of token ids) by the parameter that names it in errors:
        ``prompt``, or ``prompt[i]`` for those of a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return {"prompt": prompt}
        return {f"prompt[{i}]": each for i, each in enumerate(prompt)}

    def _logprobs(self) -> int | None:
        return self.logprobs


_FIELD_NAMES = {name for model in (StreamOptions, TextPart, ImageURL, ImagePart, ChatMessage, ChatCompletionRequest,
                                    CompletionRequest)
                for name in model.model_fields}


def parse_request(model: type[_SamplingRequest], body: bytes):
    """The request ``body`` as a ``model``, or an APIError naming the first thing wrong with it."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise _api_error(exc) from exc
    request.check()
    return request


def _api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {errors[0]['msg']}")
    field = errors[0]["loc"][:1]
    # Where a field takes several types, each type's failures are listed in order, its name in their
    # locations: the type whose first failure lies furthest into the value (deepest, then latest in a
    # list) says best what is wrong, so a text among token ids is named where it stands.
    first_failures = {}
    for error in errors:
        if error["loc"][:1] == field:
            types = tuple(part for part in error["loc"] if isinstance(part, str) and part not in _FIELD_NAMES)
            first_failures.setdefault(types, error)
    error = max(first_failures.values(),
                key=lambda e: (len(e["loc"]), [part for part in e["loc"] if isinstance(part, int)]))
    if error["type"] == "extra_forbidden":
        *parent, name = error["loc"]
        param = f"{_param(tuple(parent))}.{name}" if parent else name
        return APIError(400, f"Unrecognized request argument supplied: {param}", param)
    param = _param(error["loc"])
    if error["type"] == "missing":
        return APIError(400, f"{param} is required", param)
    value = repr(error["input"])
    got = f", got {value}" if len(value) <= 80 else ""
    return APIError(400, f"{param or 'the body'}: {error['msg']}{got}", param or None)


def _param(loc: tuple) -> str:
    """A pydantic location as a parameter path (``messages[0].content[1].image_url.url``), without
    the names pydantic gives the member types of a union, nor the tag that picks a tagged union's
    member (a content part's ``type``, which can also be a field's name)."""
    param, tag_next = "", False
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif tag_next:
            tag_next = False
        elif part in _FIELD_NAMES:
            param += f".{part}" if param else part
        else:
            tag_next = "tagged-union[" in part
    return param
