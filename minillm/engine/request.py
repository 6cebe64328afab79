"""A request as submitted, its state inside the engine, and the record it leaves behind."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ..sampling import SamplingParams
from ..validate import check_int, check_number, check_seed


@dataclass(frozen=True)
class Request:
    """One generation request.

    ``arrival_time`` is in seconds from the start of the run (ignored in a closed-loop run, where a
    request arrives when an earlier one ends). ``seed`` seeds this request's own sampling generator.
    An empty prompt or ids outside the vocabulary are not errors here: the engine rejects such a
    request with a reason, and the run goes on.
    """

    request_id: int | str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    arrival_time: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, (int, str)) or isinstance(self.request_id, bool):
            raise TypeError(f"request_id={self.request_id!r} must be an int or a str")
        ids = self.prompt_ids.tolist() if isinstance(self.prompt_ids, torch.Tensor) else self.prompt_ids
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"prompt_ids of request {self.request_id!r} must be a list of ints")
        object.__setattr__(self, "prompt_ids", list(ids))
        check_int("max_tokens", self.max_tokens)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling={self.sampling!r} must be a SamplingParams")
        check_number("arrival_time", self.arrival_time, inclusive=True)
        check_seed("seed", self.seed)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, minimum=0, hint="None computes none")


class Status(str, Enum):
    """Where a sequence is in its life. A ``str`` enum: ``Status.FINISHED == "finished"``, and records and
    JSON carry the plain strings."""

    PENDING = "pending"  # made, not yet arrived (a whole run releases it at its arrival time)
    WAITING = "waiting"  # queued: not admitted yet, or preempted
    RUNNING = "running"  # admitted: holds a batch slot and blocks
    FINISHED = "finished"  # ended with "eos" or "max_tokens"
    REJECTED = "rejected"  # never admitted: the engine can never serve it (the reason says why)
    ABORTED = "aborted"  # dropped while waiting or running (e.g. its client left)

    __str__ = str.__str__  # "finished", not "Status.FINISHED"
    __format__ = str.__format__


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; every time is in seconds from the start of the run.

    ``minillm.analysis.metrics`` reads TTFT, TPOT, ITL and E2E latency from ``arrival_time`` and ``token_times``.
    Each time the request is admitted (once, plus once per preemption) its tokens so far are either
    found in the prefix cache or computed: ``cached_tokens + prefill_tokens`` sums them over admissions.
    """

    request_id: int | str
    status: Status  # FINISHED, REJECTED or ABORTED (a str: "finished", "rejected", "aborted")
    reason: str  # why it ended: "eos", "max_tokens", "abort", or the rejection reason
    prompt_len: int
    output_ids: list[int]
    arrival_time: float
    token_times: list[float]  # one per output token, the first included
    finish_time: float
    preemptions: int
    cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed, over all admissions
    prefill_tokens: int = 0  # tokens computed in prefill, over all admissions (recomputation included)


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
    """What one engine step produced for one request (``Engine.step`` returns one per request that
    got a token; a request whose prompt chunk did not reach its end gets none that step)."""

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

    def __init__(self, request: Request, device: torch.device):
        self.request = request
        self.output_ids: list[int] = []
        self.token_times: list[float] = []
        self.block_table: list[int] = []
        self.block_keys: list = []  # prefix caching: the keys of the full blocks it has registered or reused
        self.num_computed = self.prefill_end = 0
        self.arrival_time: float | None = None  # known once it arrives (closed loop: on release)
        self.finish_time: float | None = None
        self.status, self.preemptions = Status.PENDING, 0
        self.finish_reason: str | None = None  # None until it ends: "eos", "max_tokens", "abort", or a rejection
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
        """What happened to it (call once it has ended)."""
        return RequestRecord(
            request_id=self.request.request_id, status=self.status, reason=self.finish_reason,
            prompt_len=len(self.request.prompt_ids), output_ids=list(self.output_ids),
            arrival_time=self.arrival_time, token_times=list(self.token_times), finish_time=self.finish_time,
            preemptions=self.preemptions, cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens)
