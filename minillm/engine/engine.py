"""The engine: add requests at any time, step (schedule -> model call -> tokens), or run a whole workload."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from ..model import CausalLM
from ..timing import now
from ..validate import check_int, check_token_ids
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig, kv_tokens_needed
from .model_runner import ModelRunner
from .paged_cache import PagedKVPool
from .request import Request, RequestRecord, Sequence, Status, StepOutput
from .sampler import requested_logprobs, sample_rows
from .scheduler import Scheduler, StepPlan

__all__ = ["Engine", "EngineLoad", "Rejection", "RunResult", "StepRecord", "StepResult"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One engine step. ``n_running = n_prefill + n_decode``: the requests this step computed."""

    time: float  # seconds on the engine's clock at the end of the step (when its tokens were sampled)
    n_running: int
    n_prefill: int  # requests with prefill tokens in this step (a whole prompt or a chunk of one)
    n_decode: int  # decode rows: running requests fed their last token
    n_padding: int  # static: finished rows computed as padding (output discarded)
    n_waiting: int  # arrived requests still waiting after this step's admissions
    blocks_used: int  # KV blocks held by the step's requests, after its allocations
    n_preempted: int
    prefill_tokens: int  # tokens of prefill (prompt, or prompt + output when recomputed) computed
    decode_tokens: int  # tokens fed by decode rows, padding rows included (one each)
    cached_tokens: int  # tokens this step's admissions took from the prefix cache instead of computing
    n_sampled: int  # requests that got a token (decode rows + prefills that reached their end)
    n_finished: int  # requests that ended in this step
    duration: float  # seconds the step took: scheduling, model call, sampling (it began at time - duration)
    blocks_cached: int  # free blocks still holding a reusable prefix (prefix caching), after the step


@dataclass(frozen=True)
class StepResult:
    """Everything one step did: a token for each request that got one, the step's record (None when
    nothing was waiting or running), and the records of the requests the step ended."""

    outputs: list[StepOutput]
    record: StepRecord | None
    ended: list[RequestRecord]


@dataclass(frozen=True)
class RunResult:
    """Per-request records (in submission order), per-step records, and the run's clock.

    Real elapsed time is ``wall_time - idle_skipped``; throughput is output tokens / ``wall_time``.
    """

    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_time: float  # seconds from start to the last event, idle gaps included (real + idle_skipped)
    idle_skipped: float  # seconds of idle time jumped over instead of slept


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is now, and what it has done since it was made."""

    running: int  # requests admitted (holding a batch slot)
    waiting: int  # requests queued, not admitted
    kv_blocks_used: int  # KV blocks held by at least one request
    kv_blocks_total: int  # the pool's blocks
    steps: int  # steps that computed something
    finished: int  # requests ended by EOS, max_tokens or a stop string
    aborted: int  # requests ended because their client left
    failed: int  # requests ended by an error in a step


@dataclass(frozen=True)
class Rejection:
    """Why the engine can never serve a request: the field at fault and what is wrong with it."""

    field: Literal["prompt", "max_tokens"]
    message: str


class Engine:
    """Serves many requests with one model: a paged KV pool, a scheduler, one model call a step.

    ``EngineConfig`` holds the settings and says what they imply (the default pool size, the token
    budget). Who owns what: the ``Scheduler`` every ``Sequence``'s state (queues, progress, tokens,
    endings) and the live requests by id; the ``BlockManager`` the blocks and block tables; the
    ``ModelRunner`` the model call. The engine keeps the clock and runs the step.

    Online use (one thread; the engine is not thread-safe): ``add_request`` at any time, ``step``
    until ``has_unfinished()`` is False, ``abort`` to end a request early. ``run`` serves a whole
    workload with that loop.

    The clock: times are seconds since the engine was made (``run`` restarts it), read with
    ``minillm.timing.now`` (which synchronizes the device). In ``run``, when nothing is running or
    waiting and the next request arrives in the future, the engine does not sleep: it jumps its clock
    forward to that arrival and adds the gap to ``idle_skipped``. So the reported clock is real
    elapsed time + idle skipped, exactly what a sleeping engine would have read.
    """

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig()):  # noqa: B008 (frozen: one default is safe)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if config.eos_token_id is not None and config.eos_token_id >= model.config.vocab_size:
            raise ValueError(f"eos_token_id={config.eos_token_id} is outside the model's vocabulary "
                             f"[0, {model.config.vocab_size})")
        self.model, self.config = model, config
        num_blocks = config.pool_blocks(model.config.max_seq_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.pool = PagedKVPool(model.config, num_blocks, config.block_size, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool)
        self.steps = 0  # steps that computed something
        self._start, self._idle = now(model.device), 0.0

    @property
    def max_total_tokens(self) -> int:
        """The longest prompt + max_tokens this engine can ever serve: the context, and what the whole KV
        pool holds (one token more than its slots: see ``kv_tokens_needed``). Reads constants only, so
        it is safe from any thread."""
        pool_tokens = self.blocks.num_blocks * self.blocks.block_size
        return min(self.model.config.max_seq_len, pool_tokens + 1)

    def clock(self) -> float:
        """Seconds on the engine's clock (since it was made, or since ``run`` started)."""
        return now(self.model.device) - self._start + self._idle

    # ---- online interface -------------------------------------------------------------------
    def add_request(self, request: Request, arrival_time: float | None = None) -> None:
        """Queue ``request`` (its ``arrival_time`` field is ignored: it arrives now, or at
        ``arrival_time`` on the engine's clock). Raises ValueError, queuing nothing, when the engine
        can never serve it (see ``rejection``) or its id is already waiting or running."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__}")
        rejection = self.rejection(request)
        if rejection is not None:
            raise ValueError(f"request {request.request_id!r} rejected: {rejection.message}")
        arrival = self.clock() if arrival_time is None else arrival_time
        self.scheduler.add(Sequence(request, self.model.device), float(arrival))

    def abort(self, request_id: int | str, reason: str = "client") -> RequestRecord | None:
        """End a waiting or running request now, freeing its KV blocks: ``reason`` "client" (its client
        left: ABORTED), "stop" (its caller found a stop string in its text: FINISHED) or "error" (FAILED).

        Returns its record, or None when no such request is waiting or running."""
        seq = self.scheduler.abort(request_id, reason, self.clock())
        return None if seq is None else seq.record()

    def has_unfinished(self) -> bool:
        """True while some request is waiting or running."""
        return bool(self.scheduler.requests)

    def load(self) -> EngineLoad:
        """Requests running and waiting, KV blocks used and in all, now; steps and endings so far."""
        ended = self.scheduler.ended
        return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                          kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
                          steps=self.steps, finished=ended[Status.FINISHED], aborted=ended[Status.ABORTED],
                          failed=ended[Status.FAILED])

    def rejection(self, request: Request) -> Rejection | None:
        """Why ``request`` can never be served by this engine, or None if it can (its ids are in the
        vocabulary, and its prompt and ``max_tokens`` fit ``max_total_tokens``). Reads constants only:
        safe from any thread."""
        config, prompt = self.model.config, request.prompt_ids
        if not prompt:
            return Rejection("prompt", "empty prompt")
        try:
            check_token_ids(prompt, config.vocab_size)
        except ValueError as error:
            return Rejection("prompt", str(error))
        total = len(prompt) + request.max_tokens
        if total <= self.max_total_tokens:
            return None
        field = "prompt" if len(prompt) >= self.max_total_tokens else "max_tokens"  # no room left for a reply
        if total > config.max_seq_len:
            return Rejection(field, f"prompt length {len(prompt)} + max_tokens {request.max_tokens} = {total} "
                                    f"exceeds max_seq_len={config.max_seq_len}")
        need = blocks_for(kv_tokens_needed(total), self.blocks.block_size)
        return Rejection(field, f"needs {need} KV blocks of {self.blocks.block_size} tokens, "
                                f"more than the whole pool of {self.blocks.num_blocks}")

    @torch.inference_mode()
    def step(self) -> StepResult:
        """Schedule, run the model once, sample (with the log-probs of the requests that ask,
        ``Request.logprobs``), postprocess; -> what the step did."""
        if not self.has_unfinished():
            return StepResult([], None, [])
        start = self.clock()
        plan = self.scheduler.schedule()
        if not plan.decode and not plan.prefill:
            raise RuntimeError("scheduler made no progress")  # a bug guard: admission always fits an empty pool
        n_waiting, blocks_used = len(self.scheduler.waiting), self.blocks.num_used
        logits = self.runner.run(plan)  # (len(plan.sampled), vocab)
        tokens = sample_rows(plan.sampled, logits)
        logprobs = requested_logprobs(plan.sampled, logits, tokens)
        end = self.clock()  # the tokens are ready: the step's end, read once
        ended = self.scheduler.postprocess(plan, tokens, end)
        outputs = [StepOutput(s.request.request_id, [token], s.finished, s.finish_reason, end, lp)
                   for s, token, lp in zip(plan.sampled, tokens, logprobs)]
        self.steps += 1
        record = self._record(plan, start, end, n_waiting, blocks_used, n_finished=len(ended))
        return StepResult(outputs, record, [s.record() for s in ended])

    # ---- a whole workload ---------------------------------------------------------------------
    def run(self, requests: list[Request], concurrency: int | None = None) -> RunResult:
        """Serve ``requests`` to the end; every one ends "finished" or "rejected".

        Open loop (``concurrency=None``): each request arrives at its ``arrival_time``. Closed loop
        (``concurrency=N``): N users; the first N requests arrive at 0 and request i+N arrives when
        an earlier one ends (their ``arrival_time`` is ignored).
        """
        seqs = self._sequences(requests)
        if concurrency is None:  # (arrival time, sequence), in order of arrival
            pending = deque(sorted(((float(s.request.arrival_time), s) for s in seqs), key=lambda p: p[0]))
            unreleased = deque()
        else:
            check_int("concurrency", concurrency)
            pending, unreleased = deque((0.0, s) for s in seqs[:concurrency]), deque(seqs[concurrency:])
        self._start, self._idle = now(self.model.device), 0.0
        steps = []

        def ended(time: float) -> None:  # a request left the system: in a closed loop, its user sends the next
            if unreleased:
                pending.append((time, unreleased.popleft()))

        while True:
            t = self.clock()
            while pending and pending[0][0] <= t:
                arrival, seq = pending.popleft()
                rejection = self.rejection(seq.request)
                if rejection is None:
                    self.scheduler.add(seq, arrival)
                else:
                    self.scheduler.reject(seq, rejection.message, arrival)
                    ended(arrival)
            if not self.has_unfinished():
                if not pending:
                    break
                self._idle += pending[0][0] - t  # jump to the next arrival instead of sleeping
                continue
            result = self.step()
            steps.append(result.record)
            for record in result.ended:
                ended(record.finish_time)
        return RunResult([s.record() for s in seqs], steps, self.clock(), self._idle)

    def _sequences(self, requests) -> list[Sequence]:
        if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
            raise TypeError("requests must be a list of Request")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request_id {dup!r} appears more than once")
        if self.has_unfinished() or self.blocks.num_used:
            raise RuntimeError("the engine is still holding requests from an earlier run")
        return [Sequence(r, self.model.device) for r in requests]

    def _record(self, plan: StepPlan, start: float, end: float, n_waiting: int, blocks_used: int,
                n_finished: int) -> StepRecord:
        return StepRecord(
            time=end, duration=end - start, n_running=len(plan.prefill) + len(plan.decode),
            n_prefill=len(plan.prefill), n_decode=len(plan.decode), n_padding=len(plan.padding),
            n_waiting=n_waiting, blocks_used=blocks_used, n_preempted=plan.preempted,
            prefill_tokens=sum(n for _, n in plan.prefill), decode_tokens=len(plan.decode) + len(plan.padding),
            cached_tokens=plan.cached_tokens, n_sampled=len(plan.sampled), n_finished=n_finished,
            blocks_cached=self.blocks.num_cached)
