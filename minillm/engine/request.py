"""A request as submitted, its state inside the engine, and the record it leaves behind."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; every time is in seconds from the start of the run.

    ``minillm.analysis.metrics`` reads TTFT, TPOT, ITL and E2E latency from ``arrival_time`` and ``token_times``.
    Each time the request is admitted (once, plus once per preemption) its tokens so far are either
    found in the prefix cache or computed: ``cached_tokens + prefill_tokens`` sums them over admissions.
    """

    request_id: int | str
    status: str  # "finished" | "rejected"
    reason: str  # why it ended: "eos", "max_tokens", or the rejection reason
    prompt_len: int
    output_ids: list[int]
    arrival_time: float
    token_times: list[float]  # one per output token, the first included
    finish_time: float
    preemptions: int
    cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed, over all admissions
    prefill_tokens: int = 0  # tokens computed in prefill, over all admissions (recomputation included)


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request (``Engine.step`` returns one per request that
    got a token; a request whose prompt chunk did not reach its end gets none that step)."""

    request_id: int | str
    new_token_ids: list[int]  # the tokens this step added (one here; a list, as in vLLM)
    finished: bool
    finish_reason: str | None  # "eos" or "max_tokens" once finished, else None
    time: float  # seconds on the engine's clock when the tokens were ready


class Sequence:
    """A request's state inside the engine: its tokens, its blocks, its progress, its clock readings.

    ``num_computed`` tokens have their K, V in the cache. When admitted (again, after a preemption)
    every token it holds is prefill, computed in chunks (or found in the prefix cache) up to
    ``prefill_end``; the chunk that reaches it yields the next token. After that, each step feeds the
    last token at position ``num_tokens - 1`` (decode): the cache then holds every token but the last.
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
        self.status, self.reason, self.preemptions = "pending", "", 0
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

    @property
    def prefilling(self) -> bool:
        """True until the prefill since its last admission has reached its end."""
        return self.num_computed < self.prefill_end

    def record(self) -> RequestRecord:
        return RequestRecord(self.request.request_id, self.status, self.reason, len(self.request.prompt_ids),
                             list(self.output_ids), self.arrival_time, list(self.token_times),
                             self.finish_time, self.preemptions, self.cached_tokens, self.prefill_tokens)
