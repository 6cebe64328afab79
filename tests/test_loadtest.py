"""minillm.book.loadtest on the tiny model: the closed loop's arrivals, the sweep's order and its windows."""
from collections import Counter

import pytest

from minillm.analysis.metrics import in_system, steady_window
from minillm.analysis.workload import random_requests
from minillm.book.loadtest import busy_share, closed_loop, load_sweep, steady_requests
from minillm.engine import Engine, EngineConfig

CHAT = dict(prompt_len=(8, 24), output_len=(4, 12))


def engine_of(model, slots=4):
    return Engine(model, EngineConfig(max_batch_size=slots, num_blocks=slots * 3))


def test_closed_loop_without_stagger_moves_in_lock_step(tiny_model):
    # Equal outputs and a common start: every wave of 4 requests ends in one step, and the 4 next arrive
    # together, as Engine.run's closed loop sends them.
    requests = random_requests(12, (8, 24), (6, 6), seed=1)
    run = closed_loop(engine_of(tiny_model), requests, users=4)
    arrivals = Counter(r.arrival_time for r in run.requests)
    assert sorted(arrivals.values()) == [4, 4, 4]
    assert [r.output_ids for r in run.requests] == [
        r.output_ids for r in engine_of(tiny_model).run(requests, concurrency=4).requests]


def test_closed_loop_with_stagger_and_varied_lengths_keeps_users_apart(tiny_model):
    requests = random_requests(24, seed=2, **CHAT)
    run = closed_loop(engine_of(tiny_model), requests, users=4, stagger=0.02, seed=3)
    assert all(r.status == "finished" and len(r.output_ids) == q.max_tokens
               for r, q in zip(run.requests, requests))
    first = sorted(r.arrival_time for r in run.requests)[:4]
    assert len(set(first)) == 4 and first[-1] - first[0] < 0.02  # four starts within the stagger
    assert max(Counter(r.arrival_time for r in run.requests).values()) < 4  # no wave arrives whole
    finishes = {r.finish_time for r in run.requests}
    later = sorted(r.arrival_time for r in run.requests)[4:]
    assert all(t in finishes for t in later)  # every later request arrives as one ends
    assert max(in_system(run.requests)[1]) == 4  # never more requests inside than users


def test_busy_share_in_a_closed_loops_steady_window_is_full(tiny_model):
    run = engine_of(tiny_model).run(random_requests(24, seed=4, **CHAT), concurrency=4)
    window = steady_window(run.requests)
    assert busy_share(run, 4, window) == 1.0  # a finished slot is refilled in the next step
    assert busy_share(run, 4) < 1.0  # the drain leaves slots idle
    assert all(r.arrival_time >= window.start for r in steady_requests(run))
    assert len(steady_requests(run)) == 24 - 4  # the first wave left out
    with pytest.raises(ValueError, match="no step"):
        busy_share(run, 4, window.__class__(1e9, 2e9, 0))


def test_load_sweep_order_and_capacity_runs(tiny_model):
    sweep = load_sweep(lambda: engine_of(tiny_model), loads=(0.5, 2.0), n=24, repeats=3, workload=CHAT,
                       users=4, capacity_requests=24)
    assert len(sweep.capacities) == 4 and min(sweep.capacities) > 0
    assert [(p.load, p.repeat) for p in sweep.points] == [
        (0.5, 0), (2.0, 0), (2.0, 1), (0.5, 1), (0.5, 2), (2.0, 2)]  # each pass starts one load along
    assert [p.repeat for p in sweep.at(2.0)] == [0, 1, 2]
    for p in sweep.points:
        arrivals = [r.arrival_time for r in p.result.requests]
        assert p.offered == pytest.approx(23 / max(arrivals))
        assert p.window.completions > 0 and p.completed == p.window.rate
        assert p.latencies().n_completed == len(steady_requests(p.result))
        assert 0.5 < p.offered / (p.load * sweep.capacities[0]) < 2  # the first capacity sets the rates


def test_an_overloaded_run_counts_its_queue_emptying(tiny_model):
    # Three times the capacity: the arrivals end long before the queue empties. The window still holds
    # every completion but the first wave's and the last batch's, so its rate is the engine's.
    sweep = load_sweep(lambda: engine_of(tiny_model), loads=(3.0,), n=48, repeats=1, workload=CHAT,
                       users=4, capacity_requests=24)
    (point,) = sweep.points
    last_arrival = max(r.arrival_time for r in point.result.requests)
    assert point.window.end > last_arrival  # the window outlives the arrivals
    assert point.window.completions >= 48 - 2 * 4
    assert point.completed < point.offered / 1.5  # the engine could not keep up
