"""What a client asks for and what it leaves behind: a request, how it ended, its record, and the record as a
server publishes it. No tensors and no engine here: a load generator uses it as it is."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .sampling import SamplingParams
from .validate import check_int, check_number, check_seed


@dataclass(frozen=True)
class Request:
    """One generation request.

    ``arrival_time`` is in seconds from the start of a whole run (``Engine.run``; ignored in a closed
    loop, where a request arrives when an earlier one ends). ``seed`` seeds this request's own sampling
    generator. An empty prompt or ids outside the vocabulary are not errors here: the engine refuses such a
    request (``Engine.rejection`` says why), and a run goes on.
    """

    request_id: int | str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    arrival_time: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # each token's log-prob and the ``logprobs`` most likely; None: none

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, (int, str)) or isinstance(self.request_id, bool):
            raise TypeError(f"request_id={self.request_id!r} must be an int or a str")
        if not isinstance(self.prompt_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.prompt_ids):
            raise TypeError(f"prompt_ids of request {self.request_id!r} must be a list of ints")
        object.__setattr__(self, "prompt_ids", list(self.prompt_ids))
        check_int("max_tokens", self.max_tokens)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling={self.sampling!r} must be a SamplingParams")
        check_number("arrival_time", self.arrival_time, inclusive=True)
        check_seed("seed", self.seed)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, minimum=0, hint="None computes none")


class Status(StrEnum):
    """Where a request is in its life; records and JSON carry the plain strings (``"finished"``)."""

    PENDING = "pending"  # made, not yet arrived (a whole run releases it at its arrival time)
    WAITING = "waiting"  # queued: not admitted yet, or preempted
    RUNNING = "running"  # admitted: holds a batch slot and blocks
    FINISHED = "finished"  # ended with "eos", "max_tokens", or "stop" (its caller found a stop string)
    REJECTED = "rejected"  # never admitted: the engine can never serve it (the reason says why)
    ABORTED = "aborted"  # dropped while waiting or running because its client left (reason "client")
    FAILED = "failed"  # ended by an error in a step it was part of (reason "error")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; every time is in seconds on the engine's clock.

    ``minillm.analysis.metrics`` reads TTFT, TPOT, ITL and E2E latency from ``arrival_time`` and ``token_times``.
    Each time the request is admitted (once, plus once per preemption) its tokens so far are either
    found in the prefix cache or computed: ``cached_tokens + prefill_tokens`` sums them over admissions.
    """

    request_id: int | str
    status: Status  # FINISHED, REJECTED, ABORTED or FAILED
    reason: str  # "eos", "max_tokens", "stop", "client", "error", or the rejection's message
    prompt_len: int
    output_ids: list[int]
    arrival_time: float
    token_times: list[float]  # one per output token, the first included
    finish_time: float
    preemptions: int
    cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed, over all admissions
    prefill_tokens: int = 0  # tokens computed in prefill, over all admissions (recomputation included)


@dataclass(frozen=True)
class RequestSummary:
    """A record as a server publishes it (minillm's ``GET /minillm/requests``): times and counts, never the
    tokens, since any client may read it. ``to_json`` and ``from_json`` are the one definition of its JSON."""

    request_id: int | str
    status: Status
    reason: str
    prompt_len: int
    completion_tokens: int
    arrival_time: float
    token_times: list[float] | None  # None when the page was asked for without them
    finish_time: float
    preemptions: int

    @classmethod
    def of(cls, record: RequestRecord) -> RequestSummary:
        return cls(record.request_id, record.status, record.reason, record.prompt_len, len(record.output_ids),
                   record.arrival_time, record.token_times, record.finish_time, record.preemptions)

    def to_json(self, token_times: bool = True) -> dict:
        return {"id": self.request_id, "status": str(self.status), "reason": self.reason,
                "prompt_tokens": self.prompt_len, "completion_tokens": self.completion_tokens,
                "arrival_time": self.arrival_time, "token_times": self.token_times if token_times else None,
                "finish_time": self.finish_time, "preemptions": self.preemptions}

    @classmethod
    def from_json(cls, row: dict) -> RequestSummary:
        """The summary ``to_json`` wrote; KeyError or ValueError (an unknown status) if ``row`` is not one."""
        return cls(row["id"], Status(row["status"]), row["reason"], row["prompt_tokens"], row["completion_tokens"],
                   row["arrival_time"], row["token_times"], row["finish_time"], row["preemptions"])
