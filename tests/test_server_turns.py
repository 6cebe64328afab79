"""The engine's steps and the event loop's passes take turns (``minillm.serving.turns``): never at once, in
alternation when both wait, an idle loop holds no turn; and the records endpoint renders each record once."""
from __future__ import annotations

import asyncio
import json
import threading
import time

from minillm.engine import Engine, EngineConfig, Request
from minillm.request import RequestRecord, RequestSummary, Status
from minillm.serving.limits import Admission
from minillm.serving.loop import EngineLoop
from minillm.serving.output import OutputProcessor
from minillm.serving.records import Records
from minillm.serving.turns import ENGINE, FRONT, Turns, event_loop_factory
from minillm.text.byte import ByteTokenizer


def take_turns(turns: Turns, side: str, n: int, log: list, seconds: float = 0.002) -> None:
    for _ in range(n):
        with turns.turn(side):
            start = time.perf_counter()
            time.sleep(seconds)
            log.append((side, start, time.perf_counter()))


def test_turns_never_overlap_and_alternate_while_both_sides_wait():
    turns, log = Turns(), []
    threads = [threading.Thread(target=take_turns, args=(turns, side, 30, log)) for side in (ENGINE, FRONT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(log) == 60
    assert all(before[2] <= after[1] for before, after in zip(log, log[1:]))  # one at a time
    sides = [side for side, _, _ in log]
    assert all(a != b for a, b in zip(sides[1:], sides[2:-1])), sides  # alternating once both are there


def test_a_front_turn_goes_on_while_the_engine_does_not_wait_then_for_its_share_of_the_engines_turn():
    turns = Turns(front_share=0.5)
    with turns.turn(ENGINE):
        time.sleep(0.1)  # the engine's last turn: 0.1 s
    turns.begin(FRONT)
    waiter = threading.Thread(target=turns.begin, args=(ENGINE,))
    assert turns.front_may_go_on()  # the engine does not wait
    waiter.start()
    while not turns.waiting[ENGINE]:
        time.sleep(0.001)
    assert turns.front_may_go_on()  # well within 0.5 x 0.1 s of its start
    time.sleep(0.08)
    assert not turns.front_may_go_on()  # past it: the waiting engine goes next
    turns.end()
    waiter.join(5)
    assert turns.busy and turns.last == ENGINE  # the engine took the next turn
    turns.end()


def test_the_event_loop_runs_no_callback_during_an_engine_turn():
    """A callback handed to the loop while the engine holds its turn runs only after that turn ends; the loop's
    own passes are FRONT turns."""
    turns = Turns()
    seen = {}

    async def main():
        loop, ran = asyncio.get_running_loop(), asyncio.Event()

        def callback():
            seen["ran"], seen["turn"] = time.perf_counter(), (turns.busy, turns.last)
            ran.set()

        def engine():
            with turns.turn(ENGINE):
                loop.call_soon_threadsafe(callback)
                time.sleep(0.2)
                seen["engine ended"] = time.perf_counter()

        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(ran.wait(), 5)
        thread.join(5)

    with asyncio.Runner(loop_factory=event_loop_factory(turns)) as runner:
        runner.run(main())
    assert seen["ran"] >= seen["engine ended"] and seen["turn"] == (True, FRONT)


def test_an_idle_event_loop_holds_no_turn():
    turns, took = Turns(), {}

    async def main():
        def engine():
            start = time.perf_counter()
            with turns.turn(ENGINE):
                took["wait"] = time.perf_counter() - start

        await asyncio.sleep(0.05)
        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.sleep(0.5)  # the loop waits in select meanwhile
        thread.join(5)

    with asyncio.Runner(loop_factory=event_loop_factory(turns)) as runner:
        runner.run(main())
    assert took["wait"] < 0.25, took  # not the loop's 0.5 s of sleep


def test_the_engine_thread_steps_only_in_its_turns(tiny_model):
    """While the front end holds a turn, a submitted request waits; after it, the request runs to its end."""
    turns = Turns()
    loop = EngineLoop(Engine(tiny_model, EngineConfig(num_blocks=32)), turns)
    loop.start()

    async def main():
        stream = loop.submit(Request("r", [5, 6, 7], 20, ignore_eos=True), OutputProcessor(ByteTokenizer(), []),
                             Admission(1, 1).admit(), time.perf_counter())
        with turns.turn(FRONT):
            time.sleep(0.3)  # the engine thread has the request by now, and no turn to step it
            steps = loop.stats.steps
        return steps, [t async for out in stream for t in out.token_ids]

    try:
        steps, tokens = asyncio.run(main())
    finally:
        loop.stop()
    assert steps == 0 and len(tokens) == 20


# ---- the records endpoint: each record rendered once ---------------------------------------------------------
def record(i: int, tokens: int = 50) -> RequestRecord:
    return RequestRecord(f"r{i}", Status.FINISHED, "max_tokens", 3, [5] * tokens, 0.5 * i,
                         [0.5 * i + 0.01 * t for t in range(tokens)], 0.5 * i + 1, i % 2)


def whole_page(rows: list[RequestSummary], offset: int, limit: int, token_times: bool) -> bytes:
    """The page as one ``json.dumps`` of all of it renders it."""
    chosen = rows[max(0, len(rows) - offset - limit):len(rows) - offset]
    end = offset + len(chosen)
    return json.dumps({"requests": [row.to_json(token_times) for row in chosen], "total": len(rows),
                       "offset": offset, "next_offset": end if end < len(rows) else None},
                      separators=(",", ":")).encode()


def test_pages_are_the_json_of_their_records_each_rendered_once(monkeypatch):
    records = Records(kept=40, kept_token_times=10**6)
    for i in range(60):  # the 20 oldest go
        records.keep(record(i))
    asks = ((0, 10, True), (5, 10, True), (0, 40, False), (0, 40, True), (30, 100, True), (0, 10, True))
    expected = [whole_page(list(records.rows), *ask) for ask in asks]
    records.keep(record(60))  # r20 goes, r60 comes
    expected_after = whole_page(list(records.rows), 0, 40, True)
    records = Records(kept=40, kept_token_times=10**6)
    for i in range(60):
        records.keep(record(i))
    rendered, real = [], RequestSummary.to_json
    monkeypatch.setattr(RequestSummary, "to_json", lambda self, times=True: rendered.append(self) or real(self, times))
    assert [records.page(*ask) for ask in asks] == expected
    assert len(rendered) == 40 + 40  # each kept row once with its token times, once without
    records.keep(record(60))
    rendered.clear()
    assert records.page(0, 40, True) == expected_after  # only r60 is new to render
    assert [r.request_id for r in rendered] == ["r60"]
