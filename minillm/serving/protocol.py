"""The OpenAI-compatible wire format: the request bodies (validated), the response and chunk bodies, errors.

Field names and defaults follow OpenAI's API; ``top_k``, ``ignore_eos`` and ``return_token_ids`` are the
extensions vLLM accepts under the same names. Unknown fields are ignored (as vLLM does); known fields
this server cannot honour (``stop``, ``logprobs``, ``n > 1``, penalties, ...) are refused by name.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ..sampling import SamplingParams

FINISH_REASONS = {"eos": "stop", "max_tokens": "length"}  # engine -> OpenAI
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Fields this server does not implement, and the values that mean "not used" (accepted).
UNSUPPORTED = {"stop": (None, "", []), "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0),
               "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}


class ApiError(Exception):
    """An error the client caused (400, 404) or the server hit (500), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: StrictFloat = Field(1.0, ge=0, le=2)  # OpenAI's default and range; 0 is greedy
    top_p: StrictFloat = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM extension: 0 or -1 disables it
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM extension: generate max_tokens tokens even past EOS
    return_token_ids: StrictBool = False  # vLLM extension: the token ids with the text

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, max(self.top_k, 0), self.top_p)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[int]
    max_tokens: StrictInt = Field(DEFAULT_COMPLETION_TOKENS, ge=1)

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

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, model_class: type[SamplingRequest]) -> SamplingRequest:
    """Request bytes -> a validated request; ApiError(400) naming the field and the rule broken."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    for name, neutral in UNSUPPORTED.items():
        if name in data and data[name] not in neutral:
            raise ApiError(400, f"{name}={data[name]!r} is not supported by this server", param=name)
    try:
        return model_class.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"] if part != "str" and not str(part).startswith("list[")]
        param = ".".join(loc) or None
        message = first["msg"].removeprefix("Value error, ")
        if param is not None and first["type"] != "missing":
            message = f"{param}: {message} (got {first['input']!r})"
        elif param is not None:
            message = f"{param}: {message}"
        raise ApiError(400, message, param=loc[0] if loc else None) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shape:
    """What differs between the two endpoints' bodies: the object names and the choice's layout."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"
        self.full_object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, text: str | None, finish_reason: str | None, stream: bool, role: bool = False) -> dict:
        """Choice 0 of a response (``stream=False``) or of a chunk; ``role``: the chat stream's first chunk."""
        if not self.chat:
            body = {"text": text}
        elif stream:
            body = {"delta": ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"
