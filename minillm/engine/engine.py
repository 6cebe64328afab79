"""The engine: add requests at any time, step (schedule -> model call -> tokens), or run a whole workload."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..sampling import sample
from ..timing import now
from ..validate import check_int, check_token_ids
from .block_manager import BlockManager, blocks_for
from .model_runner import ModelRunner
from .paged_cache import PagedKVPool
from .request import Request, RequestRecord, Sequence, StepOutput
from .scheduler import Scheduler

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # a mixed step's token budget unless told (vLLM's varies by version and GPU)


@dataclass(frozen=True)
class StepRecord:
    """One engine step. ``n_running = n_prefill + n_decode``: the requests this step computed."""

    time: float  # seconds on the engine's clock at the end of the step
    n_running: int
    n_prefill: int  # requests with prefill tokens in this step (a whole prompt or a chunk of one)
    n_decode: int  # decode rows: running requests fed their last token
    n_padding: int  # static: finished rows computed as padding (output discarded)
    n_waiting: int  # arrived requests still waiting after this step's admissions
    blocks_used: int  # distinct KV blocks in the block tables of the step's requests, after its allocations
    n_preempted: int
    prefill_tokens: int  # tokens of prefill (prompt, or prompt + output when recomputed) computed
    decode_tokens: int  # tokens fed by decode rows, padding rows included (one each)
    cached_tokens: int  # tokens this step's admissions took from the prefix cache instead of computing
    model_calls: int  # 1 for a mixed step; separate: one per prefill, plus one for the decode rows
    n_sampled: int  # requests that got a token (decode rows + prefills that reached their end)
    n_finished: int  # requests that ended in this step
    duration: float  # seconds the step took: scheduling, model calls, sampling
    blocks_cached: int  # free blocks still holding a reusable prefix (prefix caching), after the step


@dataclass(frozen=True)
class RunResult:
    """Per-request records (in submission order), per-step records, and the run's clock.

    Real elapsed time is ``wall_time - idle_skipped``; throughput is output tokens / ``wall_time``.
    """

    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_time: float  # seconds from start to the last event, idle gaps included (real + idle_skipped)
    idle_skipped: float  # seconds of idle time jumped over instead of slept


class Engine:
    """Serves many requests with one model: a paged KV pool, a scheduler, one model call a step.

    ``num_blocks`` x ``block_size`` tokens is the KV budget, allocated once (default: enough for
    ``max_batch_size`` sequences of ``max_seq_len`` tokens, so nothing is ever preempted).

    ``enable_chunked_prefill`` (default, vLLM's name): a step is one model call over every running
    request's decode token and prefill chunks of admitted requests, at most ``max_num_batched_tokens``
    tokens in all (default 2048; at least ``max_batch_size``) and at most ``max_prefill_chunk`` of one
    request (default: the budget); a longer prompt is prefilled over several steps. Off: the old
    engine, each admitted request's whole prompt in a model call of its own, then one batched decode
    call. ``enable_prefix_caching``: full KV blocks are shared between requests whose tokens start the
    same way (continuous policy only: static padding rows rewrite cached positions).

    Online use (one thread; the engine is not thread-safe): ``add_request`` at any time, ``step``
    until ``has_unfinished()`` is False, ``abort`` to drop a request. ``run`` serves a whole
    workload with that loop.

    The clock: times are seconds since the engine was made (``run`` restarts it), read with
    ``minillm.timing.now`` (which synchronizes the device). In ``run``, when nothing is running or
    waiting and the next request arrives in the future, the engine does not sleep: it jumps its clock
    forward to that arrival and adds the gap to ``idle_skipped``. So the reported clock is real
    elapsed time + idle skipped, exactly what a sleeping engine would have read.
    """

    def __init__(self, model, policy: str = "continuous", max_batch_size: int = 8,
                 num_blocks: int | None = None, block_size: int = 16, eos_token_id: int | None = None, *,
                 enable_chunked_prefill: bool = True, max_num_batched_tokens: int | None = None,
                 max_prefill_chunk: int | None = None, enable_prefix_caching: bool = False):
        config = model.config
        check_int("max_batch_size", max_batch_size)
        check_int("block_size", block_size)
        if num_blocks is None:
            num_blocks = max_batch_size * blocks_for(config.max_seq_len, block_size)
        if enable_chunked_prefill:
            if max_num_batched_tokens is None:
                max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_batch_size)
            check_int("max_num_batched_tokens", max_num_batched_tokens)
            if max_num_batched_tokens < max_batch_size:
                raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_batch_size="
                                 f"{max_batch_size}: every running request's decode token must fit in a step")
        elif max_num_batched_tokens is not None or max_prefill_chunk is not None:
            raise ValueError("max_num_batched_tokens and max_prefill_chunk need enable_chunked_prefill=True "
                             "(without it each prompt is prefilled whole, in a call of its own)")
        if enable_prefix_caching and policy == "static":
            raise ValueError("enable_prefix_caching needs policy='continuous' (static padding rows "
                             "recompute positions that cached blocks may share)")
        self.model, self.eos_token_id = model, eos_token_id
        self.enable_chunked_prefill = enable_chunked_prefill
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(policy, max_batch_size, self.blocks, max_num_batched_tokens, max_prefill_chunk)
        self.pool = PagedKVPool(config, num_blocks, block_size, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool)
        self.live: dict[int | str, Sequence] = {}  # the requests waiting or running, by id
        self.last_step: StepRecord | None = None  # the record of the latest step that computed something
        self._start, self._idle = now(model.device), 0.0

    @property
    def policy(self) -> str:
        return self.scheduler.policy

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
        reason = self.rejection(request)
        if reason is not None:
            raise ValueError(f"request {request.request_id!r} rejected: {reason}")
        self._queue(Sequence(request, self.model.device), arrival_time)

    def abort(self, request_id: int | str) -> bool:
        """Drop a waiting or running request at once, freeing its KV blocks (e.g. its client left).

        Returns False when no such request is waiting or running (unknown, finished, or aborted)."""
        seq = self.live.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        seq.reason, seq.finish_time = "abort", self.clock()
        return True

    def has_unfinished(self) -> bool:
        """True while some request is waiting or running."""
        return bool(self.live)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, run the model once (mixed) or per batch (separate), sample, and report.

        Returns one ``StepOutput`` per request that got a token (the finished ones say so); an empty
        list when nothing is waiting or running. The step's ``StepRecord`` is in ``last_step``.
        """
        if not self.live:
            return []
        start = self.clock()
        plan = self.scheduler.schedule()
        if not plan.decode and not plan.prefill:
            raise RuntimeError("scheduler made no progress")  # a bug guard: admission always fits an empty pool
        n_waiting, blocks_used = len(self.scheduler.waiting), self._blocks_in_tables()
        samplers = plan.sampled
        logits, calls = self.runner.run(plan, mixed=self.enable_chunked_prefill)  # (len(samplers), vocab)
        for seq, n in plan.prefill:
            seq.num_computed += n
            seq.prefill_tokens += n
        for seq in plan.decode:
            seq.num_computed += 1
        for seq in self.scheduler.running:
            self.blocks.cache_full_blocks(seq)
        outputs = self._emit(samplers, logits)
        finished = [o for o in outputs if o.finished]
        for o in finished:
            self.scheduler.finish(self.live.pop(o.request_id))
        prefill_tokens = sum(n for _, n in plan.prefill)
        self.last_step = StepRecord(
            self.clock(), len(plan.prefill) + len(plan.decode), len(plan.prefill), len(plan.decode),
            len(plan.padding), n_waiting, blocks_used, plan.preempted, prefill_tokens,
            len(plan.decode) + len(plan.padding), plan.cached_tokens, calls, len(samplers), len(finished),
            self.clock() - start, self.blocks.num_cached)
        return outputs

    # ---- a whole workload ---------------------------------------------------------------------
    def run(self, requests: list[Request], concurrency: int | None = None) -> RunResult:
        """Serve ``requests`` to the end; every one ends "finished" or "rejected".

        Open loop (``concurrency=None``): each request arrives at its ``arrival_time``. Closed loop
        (``concurrency=N``): N users; the first N requests arrive at 0 and request i+N arrives when
        an earlier one ends (their ``arrival_time`` is ignored).
        """
        seqs = self._sequences(requests)
        if concurrency is None:
            for s in seqs:
                s.arrival_time = float(s.request.arrival_time)
            pending, unreleased = deque(sorted(seqs, key=lambda s: s.arrival_time)), deque()
        else:
            check_int("concurrency", concurrency)
            pending, unreleased = deque(seqs[:concurrency]), deque(seqs[concurrency:])
            for s in pending:
                s.arrival_time = 0.0
        self._start, self._idle = now(self.model.device), 0.0
        by_id, steps = {s.request.request_id: s for s in seqs}, []

        def end(seq: Sequence) -> None:  # a request left the system: in a closed loop, its user sends the next
            if unreleased:
                nxt = unreleased.popleft()
                nxt.arrival_time = seq.finish_time
                pending.append(nxt)

        while True:
            t = self.clock()
            while pending and pending[0].arrival_time <= t:
                seq = pending.popleft()
                reason = self.rejection(seq.request)
                if reason is None:
                    self._queue(seq, seq.arrival_time)
                else:
                    seq.status, seq.reason, seq.finish_time = "rejected", reason, seq.arrival_time
                    end(seq)
            if not self.live:
                if not pending:
                    break
                self._idle += pending[0].arrival_time - t  # jump to the next arrival instead of sleeping
                continue
            outputs = self.step()
            steps.append(self.last_step)
            for o in outputs:
                if o.finished:
                    end(by_id[o.request_id])
        return RunResult([s.record() for s in seqs], steps, self.clock(), self._idle)

    def rejection(self, request: Request) -> str | None:
        """Why ``request`` can never be served by this engine, or None if it can."""
        config, prompt = self.model.config, request.prompt_ids
        if not prompt:
            return "empty prompt"
        try:
            check_token_ids(prompt, config.vocab_size)
        except ValueError as error:
            return str(error)
        total = len(prompt) + request.max_tokens
        if total > config.max_seq_len:
            return (f"prompt length {len(prompt)} + max_tokens {request.max_tokens} = {total} "
                    f"exceeds max_seq_len={config.max_seq_len}")
        need = blocks_for(total - 1, self.blocks.block_size)  # the last token is never fed back
        if need > self.blocks.num_blocks:
            return (f"needs {need} KV blocks of {self.blocks.block_size} tokens, "
                    f"more than the whole pool of {self.blocks.num_blocks}")
        return None

    def _queue(self, seq: Sequence, arrival_time: float | None) -> None:
        request_id = seq.request.request_id
        if request_id in self.live:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        seq.arrival_time = self.clock() if arrival_time is None else float(arrival_time)
        self.live[request_id] = seq
        self.scheduler.add(seq)

    def _sequences(self, requests) -> list[Sequence]:
        if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
            raise TypeError("requests must be a list of Request")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request_id {dup!r} appears more than once")
        if self.live or self.blocks.num_used:
            raise RuntimeError("the engine is still holding requests from an earlier run")
        return [Sequence(r, self.model.device) for r in requests]

    def _blocks_in_tables(self) -> int:
        """Distinct blocks in the tables of the running and padding sequences: the memory in use,
        counted from the tables themselves, not from the allocator's free list."""
        return len({b for s in self.scheduler.running + self.scheduler.padding for b in s.block_table})

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Sample one token per row (each with its own parameters and generator), stamp, find who ended."""
        tokens = [int(sample(logits[i:i + 1], s.request.sampling, s.generator)) for i, s in enumerate(seqs)]
        t = self.clock()
        outputs = []
        for seq, token in zip(seqs, tokens):
            seq.output_ids.append(token)
            seq.token_times.append(t)
            if token == self.eos_token_id and not seq.request.ignore_eos:
                seq.reason = "eos"
            elif len(seq.output_ids) == seq.request.max_tokens:
                seq.reason = "max_tokens"
            if seq.reason:
                seq.finish_time = t
            outputs.append(StepOutput(seq.request.request_id, [token], bool(seq.reason), seq.reason or None, t))
        return outputs
