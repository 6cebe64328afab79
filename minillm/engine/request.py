"""A request's state inside the engine (``Sequence``) and what a step gives it (``StepOutput``). The request
itself and its record are ``minillm.request``'s, re-exported here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request, RequestRecord, Status

__all__ = ["Request", "RequestRecord", "Sequence", "Status", "StepOutput", "TokenLogprob"]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely tokens at its position, under the model's own
    distribution: ``log_softmax`` of its logits in float32, before temperature, top-k and top-p (what vLLM
    returns by default). Greedy, the chosen token is the first of ``top``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-prob) of the ``Request.logprobs`` most likely, most likely first


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request (a request whose prompt chunk did not reach its end
    gets none that step)."""

    request_id: int | str
    new_token_ids: list[int]  # the tokens this step added (one here; a list, as in vLLM)
    finished: bool
    finish_reason: str | None  # "eos" or "max_tokens" once finished, else None
    time: float  # seconds on the engine's clock when the tokens were ready
    logprobs: list[TokenLogprob] | None = None  # one per new token, if the request asked (``Request.logprobs``)


class Sequence:
    """A request's state inside the engine: its tokens, its blocks, its progress, its clock readings.

    ``num_computed`` tokens have their K, V in the cache. When admitted (again, after a preemption)
    every token it holds is prefill, computed in chunks (or found in the prefix cache) up to
    ``prefill_end``; the chunk that reaches it yields the next token. After that, each step feeds the
    last token at position ``num_tokens - 1`` (decode): the cache then holds every token but the last.

    Who writes what: the ``Scheduler`` owns its state (status, progress, output, times, finish
    reason, counters); the ``BlockManager`` owns ``block_table`` and ``block_keys``. Everyone else reads.
    """

    def __init__(self, request: Request, device: torch.device | str):
        self.request = request
        self.output_ids: list[int] = []
        self.token_times: list[float] = []
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []  # prefix caching: the keys of the full blocks it registered or reused
        self.num_computed = self.prefill_end = 0
        self.arrival_time: float | None = None  # known once it arrives (closed loop: on release)
        self.finish_time: float | None = None
        self.status, self.preemptions = Status.PENDING, 0
        self.finish_reason: str | None = None  # None until it ends (``RequestRecord.reason``)
        self.cached_tokens = self.prefill_tokens = 0
        self.generator = (torch.Generator(device=device).manual_seed(request.seed)
                          if request.seed is not None else None)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """The token at ``position`` of prompt + output."""
        n = len(self.request.prompt_ids)
        return self.request.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def block(self, i: int, block_size: int) -> list[int]:
        """The tokens of its ``i``-th block of ``block_size`` (the last one may be partial)."""
        start, end, prompt = i * block_size, (i + 1) * block_size, self.request.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        return prompt[start:] + self.output_ids[max(0, start - len(prompt)):end - len(prompt)]

    @property
    def finished(self) -> bool:
        """True once it has ended, for whatever reason (``finish_reason`` says which)."""
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """True until the prefill since its last admission has reached its end."""
        return self.num_computed < self.prefill_end

    def record(self) -> RequestRecord:
        """What happened to it (once it has ended)."""
        return RequestRecord(
            request_id=self.request.request_id, status=self.status, reason=self.finish_reason,
            prompt_len=len(self.request.prompt_ids), output_ids=list(self.output_ids),
            arrival_time=self.arrival_time, token_times=list(self.token_times), finish_time=self.finish_time,
            preemptions=self.preemptions, cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens)
