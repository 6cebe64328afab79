"""The engine's steps and the event loop's passes take turns at the interpreter, instead of fighting for it.

The engine thread and the event loop share one interpreter lock (the GIL). A step of the engine calls torch
about 340 times (the tiny model, 4 requests), and each call lets the lock go and takes it back; while the
event loop is busy, every one of those takes waits for the loop to let go. Beside one client that sent JSON
nested 100,000 deep back to back (each a 400), the tiny model's step went from 1.8 ms to 6.2 ms of wall time,
and the other clients kept 28% of their tokens/s (``benchmarks/soak.py``, before this module).

``Turns`` makes those waits rare: a step of the engine (with its outputs' text and delivery) is one turn,
and a pass of the event loop over its ready callbacks (``TurnSelector``) is one; only one runs at a time,
and when both sides want the next turn they alternate. A step then runs without a wait inside it, and the
event loop runs between steps: on, pass after pass, while the engine does not wait for it, else for at most
``front_share`` of the engine's last step (at least one pass; a pass wakes tasks that run in the next one,
so a chain of them, a client's disconnection for one, needs a few). The preparation worker
(``limits.Preparer``) takes no turns: its jobs run in C or Rust (json, pydantic, the tokenizer) that either
holds the lock for the whole job or lets it go to work, so there are no waits to save, and its large jobs
are paced to a share of the time instead.
"""
from __future__ import annotations

import asyncio
import selectors
import threading
import time
from contextlib import contextmanager

ENGINE, FRONT = "engine", "front"  # the two sides: the engine thread; the event loop


class Turns:
    """One turn at a time; a side that waits while the other side had the last turn goes next. A FRONT turn
    may go on for more passes while the engine does not wait, or for ``front_share`` of the engine's last turn
    (a pass chains to the next: a woken task runs in the pass after the one that woke it)."""

    def __init__(self, front_share: float = 0.1):
        self.front_share = front_share
        self.changed = threading.Condition()
        self.busy = False  # a turn is running
        self.last: str | None = None  # the side whose turn ran last
        self.waiting = {ENGINE: 0, FRONT: 0}  # threads of each side waiting for a turn
        self.began = 0.0  # time.perf_counter() when the turn running now began
        self.engine_turn = 0.0  # s, how long the engine's last turn took

    def begin(self, side: str) -> None:
        """Wait for a turn of ``side`` (ENGINE or FRONT), and take it."""
        other = FRONT if side == ENGINE else ENGINE
        with self.changed:
            self.waiting[side] += 1
            while self.busy or (self.waiting[other] and self.last == side):
                self.changed.wait()
            self.waiting[side] -= 1
            self.busy, self.last, self.began = True, side, time.perf_counter()

    def end(self) -> None:
        """End the turn taken by ``begin``."""
        with self.changed:
            if self.last == ENGINE:
                self.engine_turn = time.perf_counter() - self.began
            self.busy = False
            self.changed.notify_all()

    def front_may_go_on(self) -> bool:
        """Whether the FRONT turn running now may take one more pass."""
        return not self.waiting[ENGINE] or time.perf_counter() - self.began < self.front_share * self.engine_turn

    @contextmanager
    def turn(self, side: str):
        self.begin(side)
        try:
            yield
        finally:
            self.end()


class TurnSelector(selectors.DefaultSelector):
    """The event loop's selector: the loop's pass over its ready callbacks, between two ``select`` calls,
    is one FRONT turn (it waits in ``select`` without one)."""

    def __init__(self, turns: Turns):
        super().__init__()
        self.turns, self.in_turn = turns, False

    def select(self, timeout: float | None = None):
        if self.in_turn and (timeout != 0 or not self.turns.front_may_go_on()):  # it may wait, or its time is up
            self.in_turn = False
            self.turns.end()
        ready = super().select(timeout)
        if not self.in_turn:
            self.turns.begin(FRONT)
            self.in_turn = True
        return ready

    def close(self) -> None:
        if self.in_turn:
            self.in_turn = False
            self.turns.end()
        super().close()


def event_loop_factory(turns: Turns):
    """A factory of asyncio event loops whose passes take ``turns`` (for ``asyncio.Runner``)."""
    return lambda: asyncio.SelectorEventLoop(TurnSelector(turns))
