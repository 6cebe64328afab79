"""The engine loop: arrivals -> schedule -> prefill + one batched decode -> tokens -> records."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..checks import check_int
from ..sampling import sample
from ..timing import now
from .block_manager import BlockManager, blocks_for
from .paged_cache import PagedBatchCache, PagedKVPool
from .request import Request, RequestRecord, Sequence
from .scheduler import Scheduler


@dataclass(frozen=True)
class StepRecord:
    """One engine step. ``n_running = n_prefill + n_decode``: the requests that got a token this step."""

    time: float  # seconds from the start of the run, at the end of the step
    n_running: int
    n_prefill: int  # requests prefilled this step (one model call each)
    n_decode: int  # running rows of the one batched decode call
    n_padding: int  # static: finished rows computed in that call as padding (output discarded)
    n_waiting: int  # arrived requests still waiting after this step's admissions
    blocks_used: int  # KV blocks held after the step's allocations (before finished ones free theirs)
    n_preempted: int


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
    """Serves many requests with one model: a paged KV pool, a scheduler, one batched decode a step.

    ``num_blocks`` x ``block_size`` tokens is the KV budget, allocated once (default: enough for
    ``max_batch_size`` sequences of ``max_seq_len`` tokens, so nothing is ever preempted).
    Prefill runs one model call per newly admitted request; decode runs every other running request
    in one batched call, each row at its own position.

    The clock: times are seconds since the start of ``run``, read with ``minillm.timing.now`` (which
    synchronizes the device). When nothing is running or waiting and the next request arrives in the
    future, the engine does not sleep: it jumps its clock forward to that arrival and adds the gap to
    ``idle_skipped``. So the reported clock is real elapsed time + idle skipped, exactly what a
    sleeping engine would have read, without waiting for it.
    """

    def __init__(self, model, policy: str = "continuous", max_batch_size: int = 8,
                 num_blocks: int | None = None, block_size: int = 16, eos_token_id: int | None = None):
        config = model.config
        check_int("max_batch_size", max_batch_size)
        check_int("block_size", block_size)
        if num_blocks is None:
            num_blocks = max_batch_size * blocks_for(config.max_seq_len, block_size)
        self.model, self.eos_token_id = model, eos_token_id
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(policy, max_batch_size, self.blocks)
        self.pool = PagedKVPool(config, num_blocks, block_size, model.device, model.dtype)

    @property
    def policy(self) -> str:
        return self.scheduler.policy

    @torch.inference_mode()
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
        self._start, self._idle, self._steps = now(self.model.device), 0.0, []

        def end(seq: Sequence) -> None:  # a request left the system: in a closed loop, its user sends the next
            if unreleased:
                nxt = unreleased.popleft()
                nxt.arrival_time = seq.finish_time
                pending.append(nxt)

        while True:
            t = self._clock()
            while pending and pending[0].arrival_time <= t:
                self._arrive(pending.popleft(), end)
            sched = self.scheduler
            if not sched.waiting and not sched.running:
                if not pending:
                    break
                self._idle += pending[0].arrival_time - t  # jump to the next arrival instead of sleeping
                continue
            self._step(end)
        return RunResult([s.record() for s in seqs], self._steps, self._clock(), self._idle)

    def _clock(self) -> float:
        return now(self.model.device) - self._start + self._idle

    def _sequences(self, requests) -> list[Sequence]:
        if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
            raise TypeError("requests must be a list of Request")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request_id {dup!r} appears more than once")
        if self.scheduler.waiting or self.scheduler.running or self.blocks.num_used:
            raise RuntimeError("the engine is still holding requests from an earlier run")
        return [Sequence(r, self.model.device) for r in requests]

    def rejection(self, request: Request) -> str | None:
        """Why ``request`` can never be served by this engine, or None if it can."""
        config, prompt = self.model.config, request.prompt_ids
        if not prompt:
            return "empty prompt"
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})"
        total = len(prompt) + request.max_tokens
        if total > config.max_seq_len:
            return (f"prompt length {len(prompt)} + max_tokens {request.max_tokens} = {total} "
                    f"exceeds max_seq_len={config.max_seq_len}")
        need = blocks_for(total - 1, self.blocks.block_size)  # the last token is never fed back
        if need > self.blocks.num_blocks:
            return (f"needs {need} KV blocks of {self.blocks.block_size} tokens, "
                    f"more than the whole pool of {self.blocks.num_blocks}")
        return None

    def _arrive(self, seq: Sequence, end) -> None:
        reason = self.rejection(seq.request)
        if reason is None:
            self.scheduler.add(seq)
            return
        seq.status, seq.reason, seq.finish_time = "rejected", reason, seq.arrival_time
        end(seq)

    def _step(self, end) -> None:
        plan = self.scheduler.schedule()
        if not plan.prefill and not plan.decode:
            raise RuntimeError("scheduler made no progress")  # a bug guard: admission always fits an empty pool
        n_waiting, blocks_used = len(self.scheduler.waiting), self.blocks.num_used
        done = []
        for seq in plan.prefill:  # the prompt (plus, on resume, the output so far) in one call
            ids = torch.tensor([seq.tokens], device=self.model.device)  # (1, T)
            positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T)
            logits = self.model(ids, positions, PagedBatchCache(self.pool, [seq.block_table], [0]))[:, -1]
            done += self._emit([seq], logits)  # logits: (1, vocab)
        if plan.decode:  # every running row at its own position, plus static padding rows, in one call
            rows = [(s, s.num_tokens - 1) for s in plan.decode] + [(s, s.num_tokens - 2) for s in plan.padding]
            ids = torch.tensor([[s.token_at(p)] for s, p in rows], device=self.model.device)  # (B, 1)
            positions = torch.tensor([[p] for _, p in rows], device=ids.device)  # (B, 1)
            cache = PagedBatchCache(self.pool, [s.block_table for s, _ in rows], [p for _, p in rows])
            logits = self.model(ids, positions, cache)[:, -1]  # (B, vocab)
            done += self._emit(plan.decode, logits[:len(plan.decode)])
        self._steps.append(StepRecord(self._clock(), len(plan.prefill) + len(plan.decode), len(plan.prefill),
                                      len(plan.decode), len(plan.padding), n_waiting, blocks_used,
                                      plan.preempted))
        for seq in done:
            self.scheduler.finish(seq)
            end(seq)

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Sample one token per row (each with its own parameters and generator), stamp, find who ended."""
        tokens = [int(sample(logits[i:i + 1], s.request.sampling, s.generator)) for i, s in enumerate(seqs)]
        t = self._clock()
        done = []
        for seq, token in zip(seqs, tokens):
            seq.output_ids.append(token)
            seq.token_times.append(t)
            if token == self.eos_token_id and not seq.request.ignore_eos:
                seq.reason = "eos"
            elif len(seq.output_ids) == seq.request.max_tokens:
                seq.reason = "max_tokens"
            else:
                continue
            seq.finish_time = t
            done.append(seq)
        return done
