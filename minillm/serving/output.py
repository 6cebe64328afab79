"""The output processor: a request's tokens become what its client reads, on the engine's side of the boundary.

One ``OutputProcessor`` per request (vLLM's output processor does the same in its engine client) owns the
request's incremental detokenization (``TextStream``), its stop strings (``StopText``: the text ends before
the first one generated, and the engine ends the request there with reason "stop") and the labels of its
log-probs. The routes only format what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import StepOutput
from ..text.stream import TextStream

FINISH_REASONS = {"eos": "stop", "max_tokens": "length", "stop": "stop"}  # engine -> OpenAI


@dataclass(frozen=True)
class Label:
    """A token as a client sees it: its text (or ``bytes:\\xe4\\xbd`` for a piece of a character), its bytes."""

    text: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-prob and the most likely tokens at its position, labelled; ``text_offset``:
    where in the reply the text it completes begins (a piece of a character completes none)."""

    token: Label
    top: list[Label]
    text_offset: int


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step gives a request's client: its new tokens, the text they complete, their
    log-probs (None unless asked) and, at the end, OpenAI's finish reason ("stop" or "length")."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopText:
    """Stop strings over a stream of text: ``push`` returns the text that is safe to send (never a part
    that could begin a stop string) and whether a stop string has appeared (the text ends before it)."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        buffer = self.held + text
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return buffer[:min(found)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buffer) + 1))
                    if buffer.endswith(s[:k])), default=0)  # a tail that may grow into a stop string
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def token_label(tokenizer, token_id: int, logprob: float) -> Label:
    """A token's text where its bytes are whole UTF-8, else OpenAI's ``bytes:\\xe4\\xbd``; special tokens by
    their names."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return Label(raw.decode("utf-8"), raw, logprob)
    except UnicodeDecodeError:
        return Label("bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw, logprob)


class OutputProcessor:
    """Turns one request's ``StepOutput`` s into ``RequestOutput`` s (call ``process`` once per step, in order).

    ``stops``: its stop strings. A ``RequestOutput`` whose finish reason is "stop" while the engine's request
    has not ended means a stop string appeared: the caller ends the engine's request (``Engine.abort`` with
    reason "stop")."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.text = TextStream(tokenizer)
        self.stops = StopText(stops) if stops else None
        self.produced = 0  # characters of text the tokens so far completed (before stop strings)

    def process(self, out: StepOutput) -> RequestOutput:
        text, offsets = "", []
        for token_id in out.new_token_ids:
            offsets.append(self.produced + len(text))
            text += self.text.push(token_id)
        text += self.text.flush() if out.finished else ""
        self.produced += len(text)
        finish = FINISH_REASONS[out.finish_reason] if out.finished else None
        if self.stops is not None:
            text, stopped = self.stops.push(text)
            if stopped:
                finish = "stop"
            elif out.finished:
                text += self.stops.flush()
        logprobs = None if out.logprobs is None else [
            TokenLogprobs(token_label(self.tokenizer, lp.token_id, lp.logprob),
                          [token_label(self.tokenizer, i, p) for i, p in lp.top], offset)
            for lp, offset in zip(out.logprobs, offsets)]
        return RequestOutput(list(out.new_token_ids), text, logprobs, finish)
