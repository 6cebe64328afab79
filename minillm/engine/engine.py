"""The engine: add requests at any time, step (schedule -> model call -> tokens), or run a whole workload."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace

import torch

from ..sampling import sample
from ..timing import now
from ..validate import check_int, check_token_ids
from .block_manager import BlockManager, blocks_for
from .config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, kv_tokens_needed
from .model_runner import ModelRunner
from .paged_cache import PagedKVPool
from .request import Request, RequestRecord, Sequence, StepOutput, TokenLogprob
from .scheduler import Scheduler, StepPlan

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "Engine", "EngineLoad", "RunResult", "StepRecord"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One engine step. ``n_running = n_prefill + n_decode``: the requests this step computed."""

    time: float  # seconds on the engine's clock at the end of the step (when its tokens were sampled)
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
    duration: float  # seconds the step took: scheduling, model calls, sampling (it began at time - duration)
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


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is now (what a server's ``/health`` reports)."""

    running: int  # requests admitted (holding a batch slot)
    waiting: int  # requests queued, not admitted
    blocks_used: int  # KV blocks held by at least one request
    blocks_total: int  # the pool's blocks


class Engine:
    """Serves many requests with one model: a paged KV pool, a scheduler, one model call a step.

    The arguments are those of ``EngineConfig``, which checks them and says what they imply (the
    default pool size; what ``enable_chunked_prefill`` turns on); ``Engine.from_config`` takes one.

    Who owns what: the ``Scheduler`` every ``Sequence``'s state (queues, progress, tokens, finishing),
    the ``BlockManager`` the blocks and block tables, the ``ModelRunner`` the model calls; the engine
    holds them together, keeps the clock and the index of live requests by id, and samples.

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
        config = EngineConfig(policy=policy, max_batch_size=max_batch_size, num_blocks=num_blocks,
                              block_size=block_size, eos_token_id=eos_token_id,
                              enable_chunked_prefill=enable_chunked_prefill,
                              max_num_batched_tokens=max_num_batched_tokens, max_prefill_chunk=max_prefill_chunk,
                              enable_prefix_caching=enable_prefix_caching)
        if config.eos_token_id is not None and config.eos_token_id >= model.config.vocab_size:
            raise ValueError(f"eos_token_id={config.eos_token_id} is outside the model's vocabulary "
                             f"[0, {model.config.vocab_size})")
        self.model, self.config = model, config
        num_blocks = config.pool_blocks(model.config.max_seq_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.policy, config.max_batch_size, self.blocks, config.max_num_batched_tokens,
                                   config.max_prefill_chunk, eos_token_id=config.eos_token_id)
        self.pool = PagedKVPool(model.config, num_blocks, config.block_size, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool, one_call_per_step=config.enable_chunked_prefill)
        self._live: dict[int | str, Sequence] = {}  # the requests waiting or running, by id
        self.last_step: StepRecord | None = None  # the record of the latest step that computed something
        # the requests the latest step ended because their own row failed (sampling): id -> the exception;
        # they are aborted (record status "aborted", reason "error"), and the step went on for the others
        self.last_failures: dict[int | str, Exception] = {}
        self._start, self._idle = now(model.device), 0.0

    @classmethod
    def from_config(cls, model, config: EngineConfig) -> Engine:
        """The engine ``config`` describes, for ``model``."""
        return cls(model, **asdict(config))  # the fields are the constructor's keywords

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.config.enable_chunked_prefill

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

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
        reason = self.rejection(request)
        if reason is not None:
            raise ValueError(f"request {request.request_id!r} rejected: {reason}")
        self._queue(Sequence(request, self.model.device), self.clock() if arrival_time is None else arrival_time)

    def abort(self, request_id: int | str) -> bool:
        """Drop a waiting or running request at once, freeing its KV blocks (e.g. its client left).

        Returns False when no such request is waiting or running (unknown, finished, or aborted)."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq, self.clock())
        return True

    def has_unfinished(self) -> bool:
        """True while some request is waiting or running."""
        return bool(self._live)

    def sequence(self, request_id: int | str) -> Sequence | None:
        """The engine's state of a waiting or running request (read it, do not change it; its
        ``record()`` once it has ended), or None."""
        return self._live.get(request_id)

    def load(self) -> EngineLoad:
        """Requests running and waiting, KV blocks used and in all, now."""
        return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                          blocks_used=self.blocks.num_used, blocks_total=self.blocks.num_blocks)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, run the model once (mixed) or per batch (separate), sample (and take the log-probs of
        the requests that ask, ``Request.logprobs``), and report.

        Returns one ``StepOutput`` per request that got a token (the finished ones say so); an empty
        list when nothing is waiting or running. The step's ``StepRecord`` is in ``last_step``.
        """
        self.last_failures = {}
        if not self._live:
            return []
        start = self.clock()
        plan = self.scheduler.schedule()
        if not plan.decode and not plan.prefill:
            raise RuntimeError("scheduler made no progress")  # a bug guard: admission always fits an empty pool
        n_waiting, blocks_used = len(self.scheduler.waiting), self._blocks_in_tables()
        logits, calls = self.runner.run(plan)  # (len(plan.sampled), vocab)
        tokens, failed = self._sample(plan.sampled, logits, self.model.config.vocab_size)
        logprobs = [token_logprobs(row, token, s.request.logprobs)  # only for the requests that ask
                    if s.request.logprobs is not None and s not in failed else None
                    for s, row, token in zip(plan.sampled, logits, tokens)]
        end = self.clock()  # the tokens are ready: the step's end, read once
        if failed:  # those requests alone end (aborted, reason "error"); the step goes on for the others
            for seq, error in failed.items():
                self.scheduler.abort(seq, end)
                seq.finish_reason = "error"
                del self._live[seq.request.request_id]
                self.last_failures[seq.request.request_id] = error
            kept = [i for i, s in enumerate(plan.sampled) if s not in failed]
            plan = StepPlan([s for s in plan.decode if s not in failed],
                            [(s, n) for s, n in plan.prefill if s not in failed], plan.padding, plan.preempted,
                            plan.cached_tokens)
            tokens, logprobs = [tokens[i] for i in kept], [logprobs[i] for i in kept]
        outputs = self.scheduler.postprocess(plan, tokens, end)  # one per plan.sampled, in that order
        outputs = [out if lp is None else replace(out, logprobs=[lp]) for out, lp in zip(outputs, logprobs)]
        for out in outputs:
            if out.finished:
                del self._live[out.request_id]
        self.last_step = StepRecord(
            time=end, duration=end - start, n_running=len(plan.prefill) + len(plan.decode),
            n_prefill=len(plan.prefill), n_decode=len(plan.decode), n_padding=len(plan.padding),
            n_waiting=n_waiting, blocks_used=blocks_used, n_preempted=plan.preempted,
            prefill_tokens=sum(n for _, n in plan.prefill), decode_tokens=len(plan.decode) + len(plan.padding),
            cached_tokens=plan.cached_tokens, model_calls=calls, n_sampled=len(tokens),
            n_finished=sum(out.finished for out in outputs), blocks_cached=self.blocks.num_cached)
        return outputs

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
        by_id, steps = {s.request.request_id: s for s in seqs}, []

        def end(seq: Sequence) -> None:  # a request left the system: in a closed loop, its user sends the next
            if unreleased:
                pending.append((seq.finish_time, unreleased.popleft()))

        while True:
            t = self.clock()
            while pending and pending[0][0] <= t:
                arrival, seq = pending.popleft()
                reason = self.rejection(seq.request)
                if reason is None:
                    self._queue(seq, arrival)
                else:
                    self.scheduler.reject(seq, reason, arrival)
                    end(seq)
            if not self._live:
                if not pending:
                    break
                self._idle += pending[0][0] - t  # jump to the next arrival instead of sleeping
                continue
            outputs = self.step()
            steps.append(self.last_step)
            for o in outputs:
                if o.finished:
                    end(by_id[o.request_id])
        return RunResult([s.record() for s in seqs], steps, self.clock(), self._idle)

    def rejection(self, request: Request) -> str | None:
        """Why ``request`` can never be served by this engine, or None if it can (its prompt and
        ``max_tokens`` fit ``max_total_tokens``). Reads constants only: safe from any thread."""
        config, prompt = self.model.config, request.prompt_ids
        if not prompt:
            return "empty prompt"
        try:
            check_token_ids(prompt, config.vocab_size)
        except ValueError as error:
            return str(error)
        total = len(prompt) + request.max_tokens
        if total <= self.max_total_tokens:
            return None
        if total > config.max_seq_len:
            return (f"prompt length {len(prompt)} + max_tokens {request.max_tokens} = {total} "
                    f"exceeds max_seq_len={config.max_seq_len}")
        need = blocks_for(kv_tokens_needed(total), self.blocks.block_size)
        return (f"needs {need} KV blocks of {self.blocks.block_size} tokens, "
                f"more than the whole pool of {self.blocks.num_blocks}")

    def _queue(self, seq: Sequence, arrival_time: float) -> None:
        request_id = seq.request.request_id
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        self._live[request_id] = seq
        self.scheduler.add(seq, float(arrival_time))

    def _sequences(self, requests) -> list[Sequence]:
        if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
            raise TypeError("requests must be a list of Request")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request_id {dup!r} appears more than once")
        if self._live or self.blocks.num_used:
            raise RuntimeError("the engine is still holding requests from an earlier run")
        return [Sequence(r, self.model.device) for r in requests]

    def _blocks_in_tables(self) -> int:
        """Distinct blocks in the tables of the running and padding sequences: the memory in use,
        counted from the tables themselves, not from the allocator's free list."""
        return len({b for s in self.scheduler.running + self.scheduler.padding for b in s.block_table})

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor,
                vocab_size: int) -> tuple[list[int], dict[Sequence, Exception]]:
        """One token per row of ``logits`` (n, vocab), for ``seqs[i]``. Row by row, on purpose: each request
        has its own sampling parameters and its own seeded generator, so that its tokens do not depend on
        who shares its batch (a batched sampler would draw every row from one random stream).

        A row that fails (sampling raises, or gives no token of the vocabulary) belongs to its request
        alone: it is returned in the dict of failures (its token is a placeholder -1), the others go on."""
        tokens, failed = [], {}
        for i, s in enumerate(seqs):
            try:
                token = int(sample(logits[i:i + 1], s.request.sampling, s.generator))
                if not 0 <= token < vocab_size:
                    raise ValueError(f"sampled token {token} is outside the vocabulary [0, {vocab_size})")
            except Exception as error:  # any failure of one row is that request's
                failed[s], token = error, -1
            tokens.append(token)
        return tokens, failed


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-prob and the ``k`` most likely tokens' under the raw distribution ``logits`` (V,) stand
    for (before temperature, top-k, top-p: vLLM's default), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    top = torch.topk(logprobs, min(k, logprobs.numel()))  # sorted, most likely first
    return TokenLogprob(token, float(logprobs[token]), list(zip(top.indices.tolist(), top.values.tolist())))
