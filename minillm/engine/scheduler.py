"""Who runs this step, and how many of their tokens: the waiting and running queues, two batching
policies, a per-step token budget, preemption."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..validate import check_int
from .block_manager import BlockManager
from .request import Sequence

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class StepPlan:
    """What one step computes: decode rows (one token each), prefill chunks, static padding rows."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens of its prefill computed this step)
    padding: list[Sequence]  # static only: finished rows still computed, their tokens thrown away
    preempted: int
    cached_tokens: int  # tokens this step's admissions found in the prefix cache

    @staticmethod
    def finishes_prefill(seq: Sequence, n: int) -> bool:
        """True when ``n`` prefill tokens from ``seq.num_computed`` reach the end of its prefill: that chunk's
        last logits give the sequence its next token (a chunk short of the end samples nothing)."""
        return seq.num_computed + n == seq.prefill_end

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order of the runner's logits: every decode row,
        then every prefill chunk that reaches the end of its prefill."""
        return self.decode + [s for s, n in self.prefill if self.finishes_prefill(s, n)]


class Scheduler:
    """Moves sequences waiting -> running -> finished under a batch limit, a block budget and a
    token budget.

    ``continuous`` (iteration-level, Orca/vLLM): every step admits waiting sequences while the batch
    limit, the free blocks and the token budget allow, and a finished sequence frees its slot and
    blocks at once. ``static`` (request-level): a batch of up to ``max_batch_size`` is admitted only
    when nothing is running, and holds its slots and blocks until its slowest member ends; finished
    rows stay in the step as padding (recomputing their last cached position, output discarded), as
    a fixed-shape batch on a GPU computes them until the batch is done.

    Each step takes, in this order (Sarathi-Serve's stall-free batching): one token for every
    running sequence past its prefill (decode), oldest first; then prefill chunks of the running
    sequences still in prefill, oldest first; then admissions, first come first served. Every token
    counts against ``max_num_batched_tokens`` (None: no limit), and no sequence gets more than
    ``max_prefill_chunk`` prefill tokens in one step (None: only the budget limits it). Admission
    reserves blocks for every token the sequence holds, as vLLM's V0 scheduler does; when a decode
    step finds no free block, the most recently admitted running sequence is preempted: its blocks
    are freed and it goes back to the front of the waiting queue, to be recomputed (prompt + output
    so far) when it resumes (vLLM's policy).
    """

    def __init__(self, policy: str, max_batch_size: int, blocks: BlockManager,
                 max_num_batched_tokens: int | None = None, max_prefill_chunk: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        check_int("max_batch_size", max_batch_size)
        # max_num_batched_tokens (None: no limit) is checked by Engine, which builds the Scheduler:
        # an int >= max_batch_size, so that every running sequence's decode token fits in a step
        if max_prefill_chunk is not None:
            check_int("max_prefill_chunk", max_prefill_chunk)
        self.policy, self.max_batch_size, self.blocks = policy, max_batch_size, blocks
        self.max_num_batched_tokens, self.max_prefill_chunk = max_num_batched_tokens, max_prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.padding: list[Sequence] = []  # static: finished, still holding slot and blocks

    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """Decode rows first (growing their tables, preempting the newest when blocks run
        out, so that new admissions never take the blocks a running sequence needs), then
        prefill chunks, then admissions; no one is admitted in a step that had to preempt,
        unless nothing is left running."""
        decode, preempted = [], 0
        for seq in list(self.running):
            if seq.status != "running" or seq.prefilling:
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
        budget = self.max_num_batched_tokens or math.inf
        budget -= len(decode) + len(self.padding)  # >= 0: budget >= max_batch_size
        prefill = []
        for seq in self.running:
            if seq.prefilling and budget > 0:
                prefill.append((seq, self._chunk(seq, budget)))
                budget -= prefill[-1][1]
        cached = 0
        if not self.running or (self.policy == "continuous" and not preempted):
            # a static batch forms whole (its chunks come in later steps)
            while self.waiting and len(self.running) < self.max_batch_size and (
                    budget > 0 or self.policy == "static"):
                seq = self.waiting[0]
                if not self.blocks.admit(seq):
                    break  # first come, first served: no one overtakes the head of the queue
                self.waiting.popleft()
                seq.status, seq.prefill_end = "running", seq.num_tokens
                seq.cached_tokens += seq.num_computed
                cached += seq.num_computed
                self.running.append(seq)
                if budget > 0:
                    prefill.append((seq, self._chunk(seq, budget)))
                    budget -= prefill[-1][1]
        return StepPlan(decode, prefill, list(self.padding), preempted, cached)

    def finish(self, seq: Sequence) -> None:
        """Continuous: release a finished sequence's slot and blocks at once; static: at batch end."""
        self.running.remove(seq)
        seq.status = "finished"
        if self.policy == "static":
            self.padding.append(seq)
        else:
            self.blocks.free(seq)
        self._close_batch()

    def abort(self, seq: Sequence) -> None:
        """Take a waiting or running sequence out, freeing its blocks at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.blocks.free(seq)
            self._close_batch()
        seq.status = "aborted"

    def _chunk(self, seq: Sequence, budget: float) -> int:
        """Prefill tokens ``seq`` computes this step: what it has left, within the budget
        and the cap."""
        cap = self.max_prefill_chunk or math.inf
        return int(min(seq.prefill_end - seq.num_computed, budget, cap))

    def _close_batch(self) -> None:
        if not self.running:  # a static batch is over: its finished rows let go
            for seq in self.padding:
                self.blocks.free(seq)
            self.padding.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.num_computed = "waiting", 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
