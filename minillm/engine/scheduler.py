"""Who runs this step: the waiting and running queues, two batching policies, preemption."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..checks import check_int
from .block_manager import BlockManager
from .request import Sequence

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: prefills (one call each) and the rows of the one batched decode call."""

    prefill: list[Sequence]
    decode: list[Sequence]
    padding: list[Sequence]  # static only: finished rows still computed, their tokens thrown away
    preempted: int


class Scheduler:
    """Moves sequences waiting -> running -> finished under a batch limit and a block budget.

    ``continuous`` (iteration-level, Orca/vLLM): every step admits waiting sequences while the batch
    limit and the free blocks allow, and a finished sequence frees its slot and blocks at once.
    ``static`` (request-level): a batch of up to ``max_batch_size`` is admitted only when nothing is
    running, and holds its slots and blocks until its slowest member ends; finished rows stay in the
    batched call as padding (recomputing their last cached position, output discarded), as a
    fixed-shape batch on a GPU computes them until the batch is done.
    Both decode every running sequence each step. When a decode step finds no free block, the most
    recently admitted running sequence is preempted: its blocks are freed, it goes back to the front
    of the waiting queue and is recomputed (prompt + output so far) when it resumes (vLLM's policy).
    """

    def __init__(self, policy: str, max_batch_size: int, blocks: BlockManager):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        check_int("max_batch_size", max_batch_size)
        self.policy, self.max_batch_size, self.blocks = policy, max_batch_size, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.padding: list[Sequence] = []  # static: finished, still holding slot and blocks

    def add(self, seq: Sequence) -> None:
        seq.status = "waiting"
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """Reserve decode slots first (oldest first, preempting the newest when blocks run out), so
        new admissions never take the blocks a running sequence needs; no one is admitted in a step
        that had to preempt, unless nothing is left running."""
        decode, preempted, i = [], 0, 0
        while i < len(self.running):
            seq = self.running[i]
            while not self.blocks.can_hold(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_tokens)  # room for position num_tokens - 1
                decode.append(seq)
                i += 1
        self._close_batch()
        prefill = []
        if not self.running or (self.policy == "continuous" and not preempted):
            while self.waiting and len(self.running) < self.max_batch_size:
                seq = self.waiting[0]
                if not self.blocks.can_hold(seq, seq.num_tokens):
                    break  # first come, first served: no one overtakes the head of the queue
                self.blocks.grow(seq, seq.num_tokens)  # the prompt (and, on resume, its output so far)
                self.waiting.popleft()
                seq.status = "running"
                self.running.append(seq)
                prefill.append(seq)
        return StepPlan(prefill, decode, list(self.padding), preempted)

    def finish(self, seq: Sequence) -> None:
        """Continuous: release a finished sequence's slot and blocks at once; static: at batch end."""
        self.running.remove(seq)
        seq.status = "finished"
        if self.policy == "static":
            self.padding.append(seq)
        else:
            self.blocks.free(seq)
        self._close_batch()

    def _close_batch(self) -> None:
        if not self.running:  # a static batch is over: its finished rows let go
            for seq in self.padding:
                self.blocks.free(seq)
            self.padding.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = "waiting"
        seq.preemptions += 1
        self.waiting.appendleft(seq)
