"""From a request's bytes to the engine's ``Request``: the typed body, the prompt's token ids, the engine's
verdict. ``Prepare`` runs on the preparation worker (``limits.Preparer``), never on the event loop.

Work is bounded before it is done: a text longer than ``max_prompt_chars`` has more tokens than any request
may hold (no token stands for more characters than the tokenizer's longest), so it is refused before it is
tokenized, and so is a chat prompt whose rendered template is; a request that can never fit the context or
the KV pool (``Engine.rejection``) is refused here, never queued.
"""
from __future__ import annotations

import uuid

from ..engine import Engine, Request
from ..intmath import ceil_div
from .limits import ServerLimits
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest, parse_body, short_repr


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template; a tokenizer without one (the tiny model's) gets ``role: content`` lines."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def max_chars_per_token(tokenizer, vocab_size: int) -> int:
    """The most characters one token of text can stand for (a character is at least one byte of UTF-8, so
    no more than the longest token's bytes; BOS and EOS come from no text)."""
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    return max(len(tokenizer.token_bytes(i)) for i in range(vocab_size) if i not in specials)


class Prepare:
    """``prepare(raw, chat)`` -> (the typed body, the engine's request), or ApiError / RequestValidationError."""

    def __init__(self, tokenizer, engine: Engine, model_name: str, limits: ServerLimits):
        self.tokenizer, self.engine, self.model_name, self.limits = tokenizer, engine, model_name, limits
        self.max_total = engine.max_total_tokens  # the longest prompt + reply the engine accepts
        self.per_token = max_chars_per_token(tokenizer, engine.model.config.vocab_size)
        self.max_prompt_chars = self.per_token * self.max_total

    def __call__(self, raw: bytes, chat: bool) -> tuple[SamplingRequest, Request]:
        body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
        self.check_model(body.model)
        prompt_ids, max_tokens = self.chat_prompt(body) if chat else (self.completion_prompt(body), body.token_limit)
        request = Request(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", prompt_ids, max_tokens,
                          sampling=body.sampling(), ignore_eos=body.ignore_eos, seed=body.seed,
                          logprobs=body.logprob_count)
        rejection = self.engine.rejection(request)  # reads only constants (config, pool size): thread-safe
        if rejection is not None:
            param = ("messages" if chat else "prompt") if rejection.field == "prompt" else "max_tokens"
            raise ApiError(400, f"this request can never be served: {rejection.message}", param=param)
        return body, request

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {short_repr(name)} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def check_text_length(self, chars: int, param: str, what: str) -> None:
        """Refuse, before tokenizing, a text that has more tokens than any request may hold."""
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"{what} has {chars} characters, so at least {ceil_div(chars, self.per_token)} "
                                f"tokens, which leaves no room for a reply (at most {self.max_total} tokens in all: "
                                "max_seq_len and the KV pool); refused before tokenizing", param=param,
                           code="context_length_exceeded")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if body.prompt in ("", []):
            raise ApiError(400, "prompt is empty; give some text or token ids", param="prompt")
        if isinstance(body.prompt, list):
            if len(body.prompt) >= self.max_total:
                raise ApiError(400, f"the prompt has {len(body.prompt)} tokens, which leaves no room for a reply "
                                    f"(at most {self.max_total} tokens in all)", param="prompt",
                               code="context_length_exceeded")
            return list(body.prompt)
        self.check_text_length(len(body.prompt), "prompt", "the prompt")
        return self.tokenizer.encode(body.prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], int]:
        """(prompt ids, max_tokens); without a limit the reply may fill what the context leaves."""
        if len(body.messages) > self.limits.max_messages:
            raise ApiError(400, f"{len(body.messages)} messages, more than this server's limit of "
                                f"{self.limits.max_messages}", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages", "the messages' content")
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(messages)  # compiled once; bounded before encoding
            self.check_text_length(len(rendered), "messages", "the chat prompt the template renders")
        ids = chat_prompt_ids(self.tokenizer, messages)
        limit = body.token_limit
        if limit is None:
            limit = self.max_total - len(ids)
            if limit < 1:
                raise ApiError(400, f"the messages take {len(ids)} tokens, which leaves no room for a reply "
                                    f"(at most {self.max_total} tokens in all)", param="messages")
        return ids, limit
