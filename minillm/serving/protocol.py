"""The OpenAI-compatible wire format: the request bodies (validated), the response and chunk bodies, errors.

Field names and defaults follow OpenAI's API (an explicit ``null`` means the default, as in OpenAI's and
vLLM's); ``top_k``, ``ignore_eos`` and ``return_token_ids`` are the extensions vLLM accepts under the same
names. Unknown fields are ignored (as vLLM does); known fields this server cannot honour (``n > 1``,
penalties, ...) are refused by name. A body is parsed by pydantic's own JSON parser (``parse_body``), which
refuses invalid JSON, lone surrogates, nesting deeper than it allows and numbers too long for it; every
refusal, of a body or of a query parameter, becomes one OpenAI error (``request_error``). ``stop`` (up to
``MAX_STOP`` strings) is implemented: the text ends before the first one generated, finish_reason "stop".

Log-probs: ``/v1/completions`` takes ``logprobs: N`` (0 to ``MAX_LOGPROBS``), ``/v1/chat/completions``
``logprobs: true`` and ``top_logprobs: K`` (0 to ``MAX_TOP_LOGPROBS``), OpenAI's limits; each choice (and
each streamed chunk, for the tokens it carries) then holds each token's log-prob and the N (K) most likely
tokens at its position, in OpenAI's shape for that endpoint (with a stop string: every token generated,
though the text ends before the stop string). As in vLLM (its default), they are log-probs
of the model's raw distribution, ``log_softmax`` of its logits, before temperature, top-k and top-p: what
the model thinks of the token, whatever the sampler then did. A log-prob of -inf is sent as -9999.0 (JSON
has no infinity), as OpenAI and vLLM do.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal

from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..sampling import SamplingParams
from ..validate import check_seed
from .output import Label, TokenLogprobs

MAX_STOP, MAX_STOP_CHARS = 4, 256  # stop strings: at most 4 (as OpenAI), each at most this long
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # OpenAI's limits: completions' logprobs, chat's top_logprobs
NO_LOGPROB = -9999.0  # sent for a log-prob of -inf (or NaN), as OpenAI and vLLM do
# Fields this server does not implement, and the values that mean "not used" (accepted). A value must equal
# one of them with the same JSON type: ``n: true`` or ``logprobs: 0.0`` is refused, not read as 1 or 0.
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "functions": (None, []), "function_call": (None, "none"),  # OpenAI's legacy names for tools
               # vLLM's extensions, beside the top_k and ignore_eos accepted here
               "stop_token_ids": (None, []), "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
               "min_p": (None, 0, 0.0), "include_stop_str_in_output": (None, False)}


def _neutral(value, neutral: tuple) -> bool:
    """``value`` is one of the "not used" values, with the same type (``True == 1`` in Python, not in JSON)."""
    return any(type(value) is type(n) and value == n for n in neutral)


def short_repr(value, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error message never echoes a client's megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ApiError(Exception):
    """An error the client caused (400, 404) or the server hit (500), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # of the HTTP response (Retry-After on a 429 or 503)

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: StrictFloat | None = Field(None, ge=0, le=2)  # OpenAI's range; null: its default, 1; 0 is greedy
    top_p: StrictFloat | None = Field(None, gt=0, le=1)  # null: 1
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM extension: 0 or -1 (or null) disables it
    seed: StrictInt | None = None
    stream: StrictBool | None = None  # null: false
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM extension: generate max_tokens tokens even past EOS
    return_token_ids: StrictBool = False  # vLLM extension: the token ids with the text
    stop: str | list[str] | None = None  # up to MAX_STOP strings; the text ends before the first one generated

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        for name, neutral in UNSUPPORTED.items():
            if isinstance(data, dict) and name in data and not _neutral(data[name], neutral):
                raise PydanticCustomError("unsupported", "{param}={value} is not supported by this server "
                                          "(accepted: {accepted}, which mean not used)",
                                          {"param": name, "value": short_repr(data[name]),
                                           "accepted": " or ".join(json.dumps(n) for n in neutral)})
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [] if value is None or value == "" else [value] if isinstance(value, str) else value
        if len(strings) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(strings)}")
        for text in strings:
            if not text or len(text) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, "
                                 f"got one of {len(text)}")
        return strings

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value):
        return check_seed("seed", value)  # torch.Generator takes 64 bits: 2**64 would overflow (a 500)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling(self) -> SamplingParams:
        temperature, top_p = (1.0 if v is None else v for v in (self.temperature, self.top_p))
        return SamplingParams(temperature, max(self.top_k or 0, 0), top_p)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def logprob_count(self) -> int | None:
        """How many most likely tokens to return with each token's log-prob; None: no log-probs."""
        return None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[int]
    max_tokens: StrictInt | None = Field(None, ge=1)  # null: OpenAI's default for completions, 16
    logprobs: StrictInt | None = None  # each token's log-prob and the N most likely, N <= MAX_LOGPROBS

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value):
        return None if value is False else value  # false: not used (true is no count: refused)

    @field_validator("logprobs")
    @classmethod
    def _logprobs_in_range(cls, value):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_LOGPROBS} (OpenAI's limit on the most likely tokens "
                             "returned with each token)")
        return value

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def token_limit(self) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, str) or (isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value)):
            return value
        raise ValueError("must be a string or a list of token ids (one prompt per request)")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. Without ``max_tokens``, the reply may fill the context (as in vLLM)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: StrictBool | None = None  # each token's log-prob (null: false) ...
    top_logprobs: StrictInt | None = None  # ... and the K most likely, K <= MAX_TOP_LOGPROBS

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_in_range(cls, value, info: ValidationInfo):
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS} (OpenAI's limit)")
        if value and not info.data.get("logprobs"):  # as vLLM: 0 without logprobs means not used
            raise ValueError("needs logprobs: true (the log-probs of the tokens it ranks)")
        return value

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, model_class: type[SamplingRequest]) -> SamplingRequest:
    """Request bytes -> a validated request, or RequestValidationError (``request_error`` makes it a 400)."""
    try:
        return model_class.model_validate_json(raw)
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


def request_error(errors: Sequence[dict]) -> ApiError:
    """The 400 for pydantic's or FastAPI's validation errors (of a body or a query): OpenAI's error body,
    naming the first one's field (``param``), the rule it broke and the value it got."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first['ctx']['error']}")
    if first["type"] == "unsupported":
        return ApiError(400, first["msg"], param=first["ctx"]["param"])
    loc = [str(part) for part in first["loc"] if part != "str" and not str(part).startswith(("list[", "function"))]
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
    if not loc and first["type"] == "model_type":
        return ApiError(400, f"the request body must be a JSON object, got {short_repr(first['input'], 50)}")
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    if param is not None and first["type"] != "missing":
        message = f"{param}: {message} (got {short_repr(first['input'])})"
    elif param is not None:
        message = f"{param}: {message}"
    return ApiError(400, message, param=loc[0] if loc else None)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class EndpointFormat:
    """What differs between the two endpoints' bodies: the object names and the choice's layout."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.full_object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, text: str | None, finish_reason: str | None, stream: bool, role: bool = False,
               logprobs: dict | None = None) -> dict:
        """Choice 0 of a response (``stream=False``) or of a chunk; ``role``: the chat stream's first chunk;
        ``logprobs``: from ``self.logprobs``."""
        if not self.chat:
            body = {"text": text}
        elif stream:
            body = {"delta": ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, tokens: list[TokenLogprobs] | None) -> dict | None:
        """A choice's ``logprobs`` for ``tokens`` (a whole reply, or the tokens of one chunk; None: not asked).
        Completions: OpenAI's parallel lists (``text_offset``: where in the reply the text each token completed
        begins, so token i's text is ``text[text_offset[i]:text_offset[i + 1]]``, "" for a piece of a
        character); chat: ``content``, one entry per token with its bytes."""
        if tokens is None:
            return None
        if not self.chat:
            return {"tokens": [t.token.text for t in tokens],
                    "token_logprobs": [_sendable(t.token.logprob) for t in tokens],
                    "top_logprobs": [{label.text: _sendable(label.logprob) for label in t.top} for t in tokens],
                    "text_offset": [t.text_offset for t in tokens]}

        def entry(label: Label) -> dict:
            return {"token": label.text, "logprob": _sendable(label.logprob), "bytes": list(label.bytes)}

        return {"content": [entry(t.token) | {"top_logprobs": [entry(label) for label in t.top]} for t in tokens],
                "refusal": None}


def _sendable(logprob: float) -> float:
    """A log-prob JSON can carry: -inf (and NaN, for which every comparison is false) becomes ``NO_LOGPROB``."""
    return logprob if logprob > NO_LOGPROB else NO_LOGPROB


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line. The JSON is ASCII (``\\uXXXX`` escapes):
    clients that split lines as Python's ``str.splitlines`` does (httpx's ``iter_lines`` among them) would cut
    a data line at a U+2028 or U+0085 in the text."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"
