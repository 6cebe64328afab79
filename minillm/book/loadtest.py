"""Load tests as a serving engineer runs them, on minillm's engine: open-loop points that are repeated and
interleaved with capacity runs, and a closed loop whose users start staggered.

A load point sends Poisson arrivals at a fraction of the capacity and takes its rates from its steady window
(``minillm.analysis.metrics.steady_window``), so it needs enough requests that the window holds hundreds of
completions. A machine's speed drifts between runs, so every point runs several times, and the capacity (a
closed loop's steady-window rate) is measured before the first pass, between the passes and after the last.
"""
from __future__ import annotations

import heapq
import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..analysis.metrics import SLO, ServingMetrics, SteadyWindow, serving_metrics, steady_window
from ..analysis.workload import poisson_arrivals, random_requests
from ..engine import Engine, Request, RunResult
from ..validate import check_int, check_number


def steady_requests(result: RunResult) -> list:
    """The records of the requests that arrived at or after the run's first completion: its latencies
    without the first wave, whose requests all found an empty engine (or, in a closed loop, arrived at once)."""
    window = steady_window(result.requests)
    return [r for r in result.requests if r.token_times and r.arrival_time >= window.start]


def busy_share(result: RunResult, slots: int, window: SteadyWindow | None = None) -> float:
    """Share of the slot-steps in which a request computed (its prefill or a decode row), over the steps
    that end inside ``window`` (default: every step): the batch's occupancy."""
    check_int("slots", slots)
    steps = [s for s in result.steps if window is None or window.start < s.time <= window.end]
    if not steps:
        raise ValueError("no step ends inside the window")
    return sum(s.n_running for s in steps) / (slots * len(steps))


@dataclass(frozen=True)
class LoadPoint:
    """One open-loop run: Poisson arrivals at ``load`` times the capacity measured before the sweep."""

    load: float  # the fraction of the first capacity run asked for
    repeat: int  # which pass of the sweep (0-based)
    offered: float  # req/s the drawn arrivals realise: (n - 1) / the last arrival time
    result: RunResult
    window: SteadyWindow

    @property
    def completed(self) -> float:
        """Requests completed per second in the steady window."""
        return self.window.rate

    def latencies(self, slo: SLO | None = None) -> ServingMetrics:
        """The metrics of the run's steady requests (see ``steady_requests``), goodput under ``slo``."""
        return serving_metrics(steady_requests(self.result), slo=slo)


@dataclass(frozen=True)
class Sweep:
    """Every point of a load sweep, in the order it ran, and the capacity runs around them (req/s)."""

    loads: tuple[float, ...]
    capacities: tuple[float, ...]  # before the first pass, then after each pass
    points: tuple[LoadPoint, ...]

    @property
    def capacity(self) -> float:
        """The median of the capacity runs, req/s."""
        return statistics.median(self.capacities)

    def at(self, load: float) -> list[LoadPoint]:
        """The runs of one load, one per pass."""
        return [p for p in self.points if p.load == load]


def capacity_run(make_engine: Callable[[], Engine], requests: Sequence[Request], users: int) -> float:
    """A closed loop of ``users`` on a fresh engine: its steady-window rate, req/s (the engine's capacity
    when ``users`` fills every batch slot)."""
    return steady_window(make_engine().run(list(requests), concurrency=check_int("users", users)).requests).rate


def load_sweep(make_engine: Callable[[], Engine], loads: Sequence[float], n: int, repeats: int,
               workload: dict, users: int, capacity_requests: int, seed: int = 0) -> Sweep:
    """Open-loop points at ``loads`` (fractions of the capacity), each of ``n`` requests drawn from
    ``workload`` (the keyword arguments of ``random_requests`` but ``n``, ``seed`` and ``arrival_times``),
    ``repeats`` passes with fresh draws; a pass starts one load further along than the one before, so that a
    drift of the machine does not always meet the same load. The capacity is a closed loop of ``users`` and
    ``capacity_requests`` requests, run before the first pass and after each; the loads are fractions of the
    first run's. Every run gets a fresh engine from ``make_engine``."""
    check_int("n", n)
    check_int("repeats", repeats)
    loads = tuple(check_number(f"loads[{i}]", f) for i, f in enumerate(loads))
    seeds = itertools.count(seed)

    def measure_capacity() -> float:
        return capacity_run(make_engine, random_requests(capacity_requests, seed=next(seeds), **workload), users)

    capacities, points = [measure_capacity()], []
    for repeat in range(repeats):
        order = loads[repeat % len(loads):] + loads[:repeat % len(loads)]
        for load in order:
            arrivals = poisson_arrivals(n, load * capacities[0], seed=next(seeds))
            requests = random_requests(n, seed=next(seeds), arrival_times=arrivals, **workload)
            result = make_engine().run(requests)
            points.append(LoadPoint(load, repeat, (n - 1) / arrivals[-1], result,
                                    steady_window(result.requests)))
        capacities.append(measure_capacity())
    return Sweep(loads, tuple(capacities), tuple(points))


def closed_loop(engine: Engine, requests: Sequence[Request], users: int, stagger: float = 0.0,
                seed: int = 0) -> RunResult:
    """Serve ``requests`` to ``users`` users in a closed loop, on the engine's online interface.

    User i sends its first request at a random time in [0, ``stagger``) s (all at once with 0, as
    ``Engine.run`` does); each user sends the next request not yet sent the moment its previous one ends.
    Staggered starts and requests of varied lengths keep the users from moving in lock-step, which would
    make every wave of requests arrive, and be prefilled, together. Times are on the engine's clock.
    """
    check_int("users", users)
    if stagger != 0:
        check_number("stagger", stagger)
    rng = random.Random(seed)
    unsent, order = list(requests), itertools.count()
    t0 = engine.clock()
    pending = [(t0 + rng.uniform(0, stagger), next(order), r) for r in unsent[:users]]  # (arrival, tie, request)
    heapq.heapify(pending)
    unsent = unsent[users:][::-1]  # popped from the end: the next request to send is last
    records, steps = {}, []
    while pending or engine.has_unfinished():
        now = engine.clock()
        while pending and pending[0][0] <= now:
            arrival, _, request = heapq.heappop(pending)
            engine.add_request(request, arrival_time=arrival)
        if not engine.has_unfinished():
            time.sleep(pending[0][0] - now)  # the next user has not started yet
            continue
        step = engine.step()
        steps.append(step.record)
        for record in step.ended:
            records[record.request_id] = record
            if unsent:
                heapq.heappush(pending, (record.finish_time, next(order), unsent.pop()))
    return RunResult([records[r.request_id] for r in requests], steps, engine.clock() - t0, 0.0)
