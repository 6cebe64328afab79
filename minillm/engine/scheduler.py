"""Who runs this step, and how many of their tokens: the waiting and running queues, two batching
policies, a per-step token budget, preemption; once the step has run, what its tokens change; and the
one door every request's ending goes through."""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .request import Sequence, Status

__all__ = ["ABORT_REASONS", "Scheduler", "StepPlan", "may_admit"]

# Engine.abort's reasons, and how each ends a request: its client left, its caller found a stop string in
# its text (a normal ending, as vLLM's output processor makes it), or the step it was in failed.
ABORT_REASONS = {"client": Status.ABORTED, "stop": Status.FINISHED, "error": Status.FAILED}
STEP_ENDINGS = ("eos", "max_tokens")  # the endings a step's own token decides


def may_admit(policy: str, preempted: bool, busy: bool) -> bool:
    """Whether a step may admit waiting requests at all: the admission difference between the two policies
    (static batching also keeps finished rows as padding until its batch ends).

    ``busy``: something still holds a batch slot. Static batching admits only into an empty batch;
    continuous batching admits at every step, except one that had to preempt while others still run
    (the preempted would be readmitted at once, into the room just freed).
    """
    return not busy or (policy == "continuous" and not preempted)


@dataclass(frozen=True)
class StepPlan:
    """What one step computes: decode rows (one token each), prefill chunks, static padding rows."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens of its prefill computed this step)
    padding: list[Sequence]  # static only: finished rows still computed, their tokens thrown away
    preempted: int
    cached_tokens: int  # tokens this step's admissions found in the prefix cache
    sampled: list[Sequence] = field(init=False)  # set from the others, before anything runs: see below

    def __post_init__(self) -> None:
        # The sequences that get a token this step, in the order of the runner's logits: every decode row,
        # then every prefill chunk that reaches the end of its prefill. Fixed here, while ``num_computed``
        # is still where the step starts (postprocessing moves it).
        object.__setattr__(self, "sampled", self.decode + [s for s, n in self.prefill if self.finishes_prefill(s, n)])

    @staticmethod
    def finishes_prefill(seq: Sequence, n: int) -> bool:
        """True when ``n`` prefill tokens from ``seq.num_computed`` reach the end of its prefill: that chunk's
        last logits give the sequence its next token (a chunk short of the end samples nothing).
        Ask before the step's postprocessing, which advances ``num_computed``."""
        return seq.num_computed + n == seq.prefill_end


class Scheduler:
    """Moves sequences waiting -> running -> ended under a batch limit, a block budget and a token
    budget; the one owner of every ``Sequence``'s state and of the index of live requests by id
    (nano-vllm's split: the engine's step is ``schedule``, the model runs, ``postprocess``).

    ``continuous`` (iteration-level, Orca/vLLM): every step admits waiting sequences while the batch
    limit, the free blocks and the token budget allow, and a finished sequence frees its slot and
    blocks at once. ``static`` (request-level): a batch of up to ``max_batch_size`` is admitted only
    when nothing is running, and holds its slots and blocks until its slowest member ends; finished
    rows stay in the step as padding (recomputing their last cached position, output discarded), as
    a fixed-shape batch on a GPU computes them until the batch is done.

    Each step takes, in this order (Sarathi-Serve's stall-free batching): one token for every
    running sequence past its prefill (decode), oldest first; then prefill chunks of the running
    sequences still in prefill, oldest first; then admissions, first come first served. Every token
    counts against ``max_num_batched_tokens``, and no sequence gets more than ``max_prefill_chunk``
    prefill tokens in one step (None: only the budget limits it). Admission reserves blocks for every
    token the sequence holds, as vLLM's V0 scheduler does; when a decode step finds no free block,
    the most recently admitted running sequence is preempted: its blocks are freed and it goes back to
    the front of the waiting queue, to be recomputed (prompt + output so far) when it resumes (vLLM's
    policy). ``EngineConfig`` checks the settings: the budget holds every running sequence's decode token.
    """

    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.requests: dict[int | str, Sequence] = {}  # the waiting and running sequences, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.padding: list[Sequence] = []  # static: finished, still holding slot and blocks
        self.ended: Counter[Status] = Counter()  # requests ended so far, by status

    def add(self, seq: Sequence, arrival_time: float) -> None:
        """Queue ``seq``, which arrived at ``arrival_time`` on the engine's clock; ValueError if a request
        with its id is already waiting or running."""
        request_id = seq.request.request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        self.requests[request_id] = seq
        seq.status, seq.arrival_time = Status.WAITING, arrival_time
        self.waiting.append(seq)

    def reject(self, seq: Sequence, reason: str, arrival_time: float) -> None:
        """End ``seq`` at its arrival without queuing it: the engine can never serve it."""
        seq.arrival_time = arrival_time
        self.finish(seq, Status.REJECTED, reason, arrival_time)

    def abort(self, request_id: int | str, reason: str, time: float) -> Sequence | None:
        """End a waiting or running request at ``time`` for ``reason`` (a key of ``ABORT_REASONS``), freeing
        its blocks at once; -> its sequence, or None when no such request is waiting or running."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"unknown abort reason {reason!r}; choose one of {tuple(ABORT_REASONS)}")
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, ABORT_REASONS[reason], reason, time)
        return seq

    def finish(self, seq: Sequence, status: Status, reason: str, time: float) -> None:
        """The one door every ending goes through: EOS, max_tokens, a stop string, a client that left, a
        failure, a rejection. A running sequence lets go of its slot and blocks at once, except a static
        batch's row that the step itself ended: that one stays as padding until its batch is over."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            if self.config.policy == "static" and reason in STEP_ENDINGS:
                self.padding.append(seq)
            else:
                self.blocks.free(seq)
            self._close_batch()
        self.requests.pop(seq.request.request_id, None)
        seq.status, seq.finish_reason, seq.finish_time = status, reason, time
        self.ended[status] += 1

    def schedule(self) -> StepPlan:
        """Decode rows first (growing their tables, preempting the newest when blocks run
        out, so that new admissions never take the blocks a running sequence needs), then
        prefill chunks, then admissions; no one is admitted in a step that had to preempt,
        unless nothing is left running."""
        decode, preempted = [], 0
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.prefilling:
                continue  # preempted in this loop, or still in prefill
            while not self.blocks.can_hold(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_tokens)  # room for position num_tokens - 1
                decode.append(seq)
        self._close_batch()
        budget = self.config.max_num_batched_tokens - len(decode) - len(self.padding)  # >= 0: see EngineConfig
        prefill = []
        for seq in self.running:
            if seq.prefilling and budget > 0:
                prefill.append((seq, self._chunk(seq, budget)))
                budget -= prefill[-1][1]
        cached = 0
        if may_admit(self.config.policy, bool(preempted), busy=bool(self.running)):
            # a static batch forms whole (its chunks come in later steps)
            while self.waiting and len(self.running) < self.config.max_batch_size and (
                    budget > 0 or self.config.policy == "static"):
                seq = self.waiting[0]
                hit = self.blocks.admit(seq)  # tokens in the prefix cache, or None: no room
                if hit is None:
                    break  # first come, first served: no one overtakes the head of the queue
                self.waiting.popleft()
                seq.status, seq.prefill_end = Status.RUNNING, seq.num_tokens
                seq.num_computed = hit
                seq.cached_tokens += hit
                cached += hit
                self.running.append(seq)
                if budget > 0:
                    prefill.append((seq, self._chunk(seq, budget)))
                    budget -= prefill[-1][1]
        return StepPlan(decode, prefill, list(self.padding), preempted, cached)

    def postprocess(self, plan: StepPlan, tokens: list[int], time: float) -> list[Sequence]:
        """Apply a step that has run: ``tokens[i]`` is the token sampled for ``plan.sampled[i]``, ready at
        ``time`` on the engine's clock.

        Advances every row's computed tokens (and counts the prefill ones), registers the blocks they
        filled in the prefix cache, appends each token and its time, and ends the sequences that reached
        EOS or ``max_tokens``. Returns the sequences it ended.
        """
        if len(tokens) != len(plan.sampled):
            raise ValueError(f"{len(tokens)} tokens for {len(plan.sampled)} sampled sequences")
        for seq, n in plan.prefill:
            seq.num_computed += n
            seq.prefill_tokens += n
        for seq in plan.decode:
            seq.num_computed += 1
        for seq in self.running:
            self.blocks.cache_full_blocks(seq)
        ended = []
        for seq, token in zip(plan.sampled, tokens):
            seq.output_ids.append(token)
            seq.token_times.append(time)
            eos = token == self.config.eos_token_id and not seq.request.ignore_eos
            if eos or len(seq.output_ids) == seq.request.max_tokens:
                self.finish(seq, Status.FINISHED, "eos" if eos else "max_tokens", time)
                ended.append(seq)
        return ended

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill tokens ``seq`` computes this step: what it has left, within the budget
        and the cap."""
        cap = self.config.max_prefill_chunk or math.inf
        return int(min(seq.prefill_end - seq.num_computed, budget, cap))

    def _close_batch(self) -> None:
        if not self.running:  # a static batch is over: its finished rows let go
            for seq in self.padding:
                self.blocks.free(seq)
            self.padding.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
