"""The batching timeline: spans derived from an engine run's records, checked against its step records."""
from dataclasses import dataclass

import matplotlib
import pytest

from minillm.analysis.workload import random_requests
from minillm.book.instruments import serve_live
from minillm.book.viz.batching import (
    SHARED,
    draw_batching_comparison,
    draw_pool_timeline,
    pool_owners,
    slot_spans,
    token_steps,
    ttft_steps,
)
from minillm.engine import Engine, EngineConfig, Request

matplotlib.use("Agg")
SLOTS = 4


@dataclass
class Step:  # the fields of minillm.engine.StepRecord that the timeline reads
    time: float
    n_running: int
    n_padding: int = 0


@dataclass
class Record:  # the fields of minillm.engine.RequestRecord that the timeline reads
    request_id: int
    token_times: list
    arrival_time: float = 0.0


@dataclass
class Run:
    requests: list
    steps: list


@pytest.fixture(scope="module")
def runs(small_model):
    requests = random_requests(10, (4, 24), (1, 20), seed=3, vocab_size=small_model.config.vocab_size,
                               length_dist="loguniform")
    return {policy: Engine(small_model, EngineConfig(policy=policy, max_batch_size=SLOTS)).run(
        requests, concurrency=SLOTS) for policy in ("static", "continuous")}


def test_token_steps_assigns_each_token_to_the_step_that_ends_after_it():
    run = Run([Record(0, [0.5, 1.5, 2.0]), Record(1, [])], [Step(1.0, 1), Step(2.0, 1), Step(3.0, 0)])
    assert token_steps(run) == {0: [0, 1, 1], 1: []}


def test_ttft_in_steps_counts_from_the_first_step_after_arrival():
    steps = [Step(1.0, 1), Step(2.0, 1), Step(3.0, 1), Step(4.0, 1)]
    run = Run([Record(0, [0.9], 0.0), Record(1, [3.5], 1.0), Record(2, [])], steps)
    assert ttft_steps(run) == {0: 1, 1: 3}  # 1 arrived as step 0 ended: steps 1, 2 and 3


def test_continuous_batching_gives_a_first_token_the_step_after_arrival(runs):
    waited = {policy: ttft_steps(result) for policy, result in runs.items()}
    assert set(waited["continuous"].values()) == {1}
    assert max(waited["static"].values()) > 1 and min(waited["static"].values()) == 1


def test_a_token_after_the_last_step_is_an_error():
    run = Run([Record(0, [0.5, 4.0])], [Step(1.0, 1), Step(2.0, 1)])
    with pytest.raises(ValueError, match="request 0 has a token at 4.0 s"):
        token_steps(run)


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_spans_reproduce_the_engine_step_records(runs, policy):
    result = runs[policy]
    spans = slot_spans(result, SLOTS)
    for i, step in enumerate(result.steps):
        active = [s for s in spans if s.first_step <= i <= s.last_step]
        assert sum(s.kind == "busy" for s in active) == step.n_running
        assert sum(s.kind == "padding" for s in active) == step.n_padding
        assert sum(s.kind == "busy" and s.first_step == i for s in active) == step.n_prefill
        slots = [s.slot for s in active]
        assert len(slots) == len(set(slots)) and all(0 <= s < SLOTS for s in slots)
    for record in result.requests:
        busy = [s for s in spans if s.request_id == record.request_id and s.kind == "busy"]
        assert sum(s.n_steps for s in busy) == len(record.output_ids)  # one token per step
        assert len(busy) == 1 + record.preemptions  # unbroken from prefill to last token


def test_static_holds_finished_rows_and_continuous_refills_them(runs):
    padding = {p: sum(s.n_steps for s in slot_spans(r, SLOTS) if s.kind == "padding") for p, r in runs.items()}
    assert padding["continuous"] == 0
    assert padding["static"] == sum(step.n_padding for step in runs["static"].steps) > 0
    busy = {p: sum(s.n_steps for s in slot_spans(r, SLOTS) if s.kind == "busy") for p, r in runs.items()}
    assert busy["static"] == busy["continuous"]  # the same tokens, in fewer steps when refilled
    assert len(runs["continuous"].steps) < len(runs["static"].steps)


def test_a_preempted_request_gets_two_spans(small_model):
    requests = random_requests(4, (8, 8), (24, 24), seed=0, vocab_size=small_model.config.vocab_size)
    result = Engine(small_model, EngineConfig(max_batch_size=4, num_blocks=6, block_size=8)).run(requests)
    assert sum(r.preemptions for r in result.requests) > 0
    spans = slot_spans(result, 4)
    preempted = [r.request_id for r in result.requests if r.preemptions]
    assert all(sum(s.request_id == rid for s in spans) >= 2 for rid in preempted)


def test_records_that_disagree_with_the_steps_are_rejected():
    run = Run([Record(0, [0.5, 1.5])], [Step(1.0, 1), Step(2.0, 2)])
    with pytest.raises(ValueError, match="step 1: the request records give 1 running"):
        slot_spans(run, 2)


def test_too_few_slots_is_an_error(runs):
    with pytest.raises(ValueError, match="n_slots=2"):
        slot_spans(runs["continuous"], 2)
    with pytest.raises(ValueError, match="n_slots=0"):
        slot_spans(runs["continuous"], 0)


def test_the_figure_draws_one_prefill_bar_per_busy_span(runs):
    fig = draw_batching_comparison(runs, SLOTS, titles={"static": "static batching"})
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["static batching", "continuous"]
    for ax, result in zip(axes, runs.values()):
        prefill = sum(len(c.get_paths()) for c in ax.collections if c.get_gid() == "prefill")
        assert prefill == sum(s.kind == "busy" for s in slot_spans(result, SLOTS))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["prefill step", "decode steps", "padding (finished, still in the batch)"]
    with pytest.raises(ValueError, match="runs is empty"):
        draw_batching_comparison({}, SLOTS)


# --- the KV pool over steps -------------------------------------------------------------------------

def test_pool_owners_reads_each_step_s_tables():
    tables = [{"A": [0, 2]}, {"A": [0, 2], "B": [1]}, {"B": [1, 0]}, {"A": [3], "B": [3]}]
    assert pool_owners(tables, 4) == [["A", None, "A", None], ["A", "B", "A", None],
                                      ["B", "B", None, None], [None, None, None, SHARED]]


@pytest.mark.parametrize("tables, match", [
    ([{"A": [0, 4]}], r"step 0: request 'A' holds block 4, outside \[0, 4\)"),
    ([{}, {"B": [1, 1]}], "step 1: request 'B' lists a block twice"),
])
def test_pool_owners_rejects_impossible_tables(tables, match):
    with pytest.raises(ValueError, match=match):
        pool_owners(tables, 4)


def test_the_pool_figure_draws_every_held_block_step_once(small_model):
    requests = [Request(name, list(range(1, 9)), 24, ignore_eos=True) for name in "ABCD"]
    engine = Engine(small_model, EngineConfig(max_batch_size=4, num_blocks=6, block_size=8))
    for request in requests:
        engine.add_request(request)
    tables, preempted = [], {}
    while engine.has_unfinished():
        step = engine.step()
        tables.append({s.request.request_id: list(s.block_table) for s in engine.scheduler.running})
        if step.record.n_preempted:
            preempted[len(tables) - 1] = "preemption"
    assert preempted  # 4 requests of 32 tokens cannot all fit in 6 blocks of 8
    ax = draw_pool_timeline(tables, 6, marks=preempted, title="pool")
    drawn = {}
    for bars in ax.collections:
        _, name, block = bars.get_gid().split("-")
        for path in bars.get_paths():
            x0, x1 = path.vertices[:, 0].min(), path.vertices[:, 0].max()
            for step in range(round(x0), round(x1)):
                assert (step, int(block)) not in drawn
                drawn[step, int(block)] = name
    held = {(i, b): name for i, step in enumerate(tables) for name, table in step.items() for b in table}
    assert drawn == held
    assert sorted(line.get_xdata()[0] for line in ax.lines) == sorted(preempted)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == list(dict.fromkeys(n for step in tables for n in step)) + ["preemption"]


def test_a_shared_block_is_drawn_as_shared():
    ax = draw_pool_timeline([{"A": [0, 1]}, {"A": [0, 1], "B": [0, 2]}], 3)
    assert {bars.get_gid() for bars in ax.collections} == {"hold-A-0", "hold-A-1", "hold-shared-0",
                                                           "hold-B-2"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A", "B", SHARED]


def test_serve_live_notes_every_token_step_and_table(small_model):
    requests = [Request(name, list(range(1, 9)), 24, ignore_eos=True) for name in "ABC"]
    late = Request("late", list(range(2, 12)), 4, ignore_eos=True)
    live = serve_live(Engine(small_model, EngineConfig(max_batch_size=4, num_blocks=7, block_size=8)), requests,
                      late=late, at_step=3)
    assert sorted(live.tokens) == ["A", "B", "C", "late"]
    assert all(len(live.tokens[r.request_id]) == len(live.times[r.request_id]) == r.max_tokens
               for r in requests + [late])
    assert live.arrival is not None and live.times["late"][0] > live.arrival
    assert len(live.steps) == len(live.tables) == len(live.held)
    assert "late" not in live.tables[2] and any("late" in t for t in live.tables[3:])
    assert any(step.n_preempted for step in live.steps)  # 3 x 4 blocks do not fit in 7
    assert pool_owners(live.tables, 7)  # every table names blocks of the pool, none twice
    roomy = Engine(small_model, EngineConfig(max_batch_size=4, block_size=8)).run(requests + [late])
    assert {r.request_id: r.output_ids for r in roomy.requests} == dict(live.tokens)
