"""The engine: same tokens as `generate`, nothing lost, memory within budget.

Chunked prefill, prefix caching and the online interface have their own files (test_engine_*.py),
which share the helpers in conftest.py.
"""

import json

import pytest
import torch
from conftest import ENGINE_CONFIG, ENGINE_MODEL, check_invariants, drive, greedy_reference, workload, write_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import KVCache, SamplingParams, generate
from minillm.engine import (
    BlockManager,
    Engine,
    EngineConfig,
    PagedCacheView,
    PagedKVPool,
    Rejection,
    Request,
    Scheduler,
    Sequence,
    Status,
    StepRecord,
    StepResult,
    blocks_for,
)
from minillm.engine.sampler import sample_rows
from minillm.sampling import sample


def make(**settings) -> Engine:
    return Engine(ENGINE_MODEL, EngineConfig(**settings))


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("max_batch_size,num_blocks", [(1, None), (3, None), (8, 6)])
def test_greedy_tokens_equal_generate_alone(policy, max_batch_size, num_blocks):
    requests = workload(10, seed=1)
    engine = make(policy=policy, max_batch_size=max_batch_size, num_blocks=num_blocks, block_size=8)
    result = engine.run(requests)
    assert all(r.status == "finished" for r in result.requests)
    check_invariants(engine, requests, result)
    if num_blocks is not None:  # 6 blocks of 8 tokens cannot hold 8 running requests: preemption happened
        assert sum(r.preemptions for r in result.requests) > 0
        assert result.requests[0].preemptions == 0  # the oldest running request is never the victim
    else:
        assert max(s.n_running for s in result.steps) == max_batch_size
        assert [r.prefill_tokens for r in result.requests] == [r.prompt_len for r in result.requests]


def test_seeded_sampling_matches_generate_and_survives_preemption():
    params = SamplingParams(temperature=1.0, top_k=50)
    requests = [Request(r.request_id, r.prompt_ids, r.max_tokens, params, seed=100 + i)
                for i, r in enumerate(workload(6, seed=2))]
    alone = [generate(ENGINE_MODEL, r.prompt_ids, r.max_tokens, sampling=params, seed=r.seed) for r in requests]
    for num_blocks in (None, 6):
        result = make(max_batch_size=6, num_blocks=num_blocks, block_size=8).run(requests)
        assert [r.output_ids for r in result.requests] == alone


def test_greedy_and_seeded_rows_in_one_batch_each_match_generate_alone():
    """The greedy rows take one argmax over the batch, the seeded rows their own draws: neither disturbs the other."""
    params = SamplingParams(temperature=0.8, top_p=0.9)
    requests = [Request(r.request_id, r.prompt_ids, r.max_tokens, params if i % 2 else SamplingParams(), seed=50 + i)
                for i, r in enumerate(workload(8, seed=12))]
    alone = [generate(ENGINE_MODEL, r.prompt_ids, r.max_tokens, sampling=r.sampling, seed=r.seed) for r in requests]
    result = make(max_batch_size=8).run(requests)
    assert [r.output_ids for r in result.requests] == alone
    assert max(s.n_sampled for s in result.steps) == 8  # greedy and sampled rows did share steps


def test_eos_stops_a_request_unless_ignored():
    prompt = [5, 6, 7]
    eos = greedy_reference(tuple(prompt))[2]  # make the third greedy token the end of sequence
    stop = greedy_reference(tuple(prompt)).index(eos) + 1
    requests = [Request("stop", prompt, 10), Request("ignore", prompt, 10, ignore_eos=True)]
    result = make(max_batch_size=2, eos_token_id=eos).run(requests)
    stopped, ignored = result.requests
    alone = generate(ENGINE_MODEL, prompt, 10, eos_token_id=eos)
    assert stopped.output_ids == alone == greedy_reference((5, 6, 7))[:stop]
    assert stopped.reason == "eos" and stopped.output_ids[-1] == eos
    assert ignored.reason == "max_tokens" and ignored.output_ids == greedy_reference((5, 6, 7))[:10]


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    requests = [Request("ok", [1, 2, 3], 4), Request("empty", [], 4), Request("vocab", [1, 300], 4),
                Request("long", [1] * 90, 10), Request("pool", [1] * 40, 20), Request("ok2", [4], 2)]
    engine = make(max_batch_size=4, num_blocks=7, block_size=8)  # 56 tokens of KV budget
    result = engine.run(requests)
    by_id = {r.request_id: r for r in result.requests}
    assert by_id["ok"].status == by_id["ok2"].status == "finished"
    assert by_id["empty"].reason == "empty prompt"
    assert "300" in by_id["vocab"].reason and "[0, 258)" in by_id["vocab"].reason
    assert "100" in by_id["long"].reason and "max_seq_len=96" in by_id["long"].reason
    assert "needs 8 KV blocks" in by_id["pool"].reason and "pool of 7" in by_id["pool"].reason
    check_invariants(engine, requests, result)


def test_a_rejection_names_the_field_at_fault():
    engine = make(max_batch_size=4, num_blocks=7, block_size=8)  # at most 57 tokens in all
    assert engine.rejection(Request(0, [], 4)) == Rejection("prompt", "empty prompt")
    assert engine.rejection(Request(0, [1, 300], 4)).field == "prompt"
    assert engine.rejection(Request(0, [1] * 57, 4)).field == "prompt"  # no room left for a reply
    assert engine.rejection(Request(0, [1] * 56, 4)) == Rejection(
        "max_tokens", "needs 8 KV blocks of 8 tokens, more than the whole pool of 7")
    assert engine.rejection(Request(0, [1] * 56, 1)) is None


def test_static_waits_for_the_slowest_and_continuous_refills_at_once():
    requests = [Request(i, [10 + i, 20], m) for i, m in enumerate([1, 5, 5, 5])]
    plan = {}
    for policy in ("static", "continuous"):
        result = make(policy=policy, max_batch_size=2).run(requests)
        plan[policy] = [(s.n_prefill, s.n_decode, s.n_padding) for s in result.steps]
    assert plan["static"] == [(2, 0, 0)] + [(0, 1, 1)] * 4 + [(2, 0, 0)] + [(0, 2, 0)] * 4
    assert plan["continuous"] == [(2, 0, 0), (1, 1, 0)] + [(0, 2, 0)] * 3 + [(1, 1, 0)] + [(0, 1, 0)] * 4


def test_idle_time_is_skipped_not_slept():
    requests = [Request(0, [1, 2], 3), Request(1, [3, 4], 3, arrival_time=1000.0)]
    result = make().run(requests)
    first, late = result.requests
    assert late.arrival_time == 1000.0 and late.token_times[0] >= 1000.0
    assert 0 < result.idle_skipped <= 1000.0 - first.finish_time
    assert result.wall_time >= late.finish_time >= 1000.0


def test_closed_loop_keeps_n_users_in_the_system():
    requests = workload(7, seed=3, max_tokens=8)
    result = make(max_batch_size=8).run(requests, concurrency=2)
    assert [r.arrival_time for r in result.requests[:2]] == [0.0, 0.0]
    ends = sorted(r.finish_time for r in result.requests)
    assert sorted(r.arrival_time for r in result.requests[2:]) == ends[:5]  # each end lets the next one in
    assert max(s.n_running + s.n_waiting for s in result.steps) <= 2
    assert all(r.status == "finished" for r in result.requests)


def test_rejection_is_exact_at_the_pool_boundary():
    """2 blocks of 8 tokens: a 10-token prompt with 7 new tokens caches 10 + 7 - 1 = 16 tokens (the last
    token is never fed back) and must finish; with 8 new tokens it would cache 17 and is rejected."""
    prompt = list(range(1, 11))
    fits, too_long = Request("fits", prompt, 7), Request("too_long", prompt, 8)
    engine = make(max_batch_size=1, num_blocks=2, block_size=8)
    result = engine.run([fits, too_long])
    done, rejected = result.requests
    assert done.status == "finished" and done.output_ids == greedy_reference(tuple(prompt))[:7]
    assert max(s.blocks_used for s in result.steps) == 2
    assert rejected.status == "rejected" and "needs 3 KV blocks of 8 tokens" in rejected.reason
    assert engine.rejection(fits) is None
    with pytest.raises(ValueError, match="'too_long' rejected: needs 3 KV blocks of 8 tokens, more than the whole"):
        engine.add_request(too_long)


def shared_prefix_requests(data, n):
    """Requests whose prompts often start with the same tokens (so prefix caching finds hits)."""
    stem = data.draw(st.lists(st.integers(0, 257), min_size=8, max_size=24), label="stem")
    return [Request(i, stem[:data.draw(st.sampled_from([0, len(stem) // 2, len(stem)]), label="shared")]
                    + data.draw(st.lists(st.integers(0, 257), max_size=8), label="own"),
                    data.draw(st.integers(1, 12), label="max_tokens"),
                    arrival_time=data.draw(st.sampled_from([0.0, 0.0, 0.01, 5.0]), label="arrival"))
            for i in range(n)]


def engine_settings(data, requests) -> EngineConfig:
    """A random engine: policy, batch limit, block size, budget, chunk cap, caching, and a pool from one
    block less than the largest request needs (a rejection) to half as much again (preemption)."""
    policy = data.draw(st.sampled_from(["continuous", "static"]), label="policy")
    max_batch_size = data.draw(st.integers(1, 4), label="max_batch_size")
    block_size = data.draw(st.sampled_from([2, 4, 8]), label="block_size")
    need = max(1, max(blocks_for(len(r.prompt_ids) + r.max_tokens - 1, block_size) for r in requests))
    kwargs = dict(policy=policy, max_batch_size=max_batch_size, block_size=block_size,
                  num_blocks=data.draw(st.integers(max(1, need - 1), need + need // 2 + 1), label="num_blocks"))
    if data.draw(st.booleans(), label="chunked"):  # else the default budget: whole prompts in a step
        kwargs["max_num_batched_tokens"] = data.draw(st.integers(max_batch_size, 24), label="budget")
        kwargs["max_prefill_chunk"] = data.draw(st.sampled_from([None, 1, 3, 8]), label="chunk")
    kwargs["enable_prefix_caching"] = policy == "continuous" and data.draw(st.booleans(), label="caching")
    return EngineConfig(**kwargs)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), concurrency=st.sampled_from([None, 2]))
def test_random_workloads_lose_nothing_and_stay_in_budget(data, concurrency):
    """The reference test: any budget, chunk cap, batch limit, pool size (so preemption), caching."""
    requests = shared_prefix_requests(data, data.draw(st.integers(2, 8), label="n"))
    engine = Engine(ENGINE_MODEL, engine_settings(data, requests))
    result = engine.run(requests, concurrency=concurrency)
    check_invariants(engine, requests, result)
    for req, rec in zip(requests, result.requests):
        assert (rec.status == "rejected") == (engine.rejection(req) is not None)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_online_workloads_keep_block_tables_consistent_at_every_step(data):
    """The same, driven step by step, with the block tables checked after every step."""
    requests = shared_prefix_requests(data, data.draw(st.integers(2, 8), label="n"))
    engine = Engine(ENGINE_MODEL, engine_settings(data, requests))
    requests = [r for r in requests if engine.rejection(r) is None]
    arrivals = {}
    for r in requests:
        arrivals.setdefault(data.draw(st.integers(0, 6), label="arrival step"), []).append(r)
    outputs, records = drive(engine, arrivals)
    for r in requests:
        tokens = [t for out in outputs[r.request_id] for t in out.new_token_ids]
        assert tokens == greedy_reference(tuple(r.prompt_ids))[:r.max_tokens]
        assert [out.finished for out in outputs[r.request_id]] == [False] * (r.max_tokens - 1) + [True]
    assert engine.blocks.ref_counts == [0] * engine.blocks.num_blocks


def test_paged_cache_returns_keys_by_position_like_the_contiguous_cache():
    pool = PagedKVPool(ENGINE_CONFIG, num_blocks=10, block_size=4)
    tables = [[7, 2, 5], [0, 9]]  # scattered blocks: row 0 holds up to 12 positions, row 1 up to 8
    view = PagedCacheView(pool, tables, [0, 0])
    contiguous = KVCache(ENGINE_CONFIG, 2, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]])  # (2, 8)
    k = torch.randn(2, ENGINE_CONFIG.n_kv_heads, 8, ENGINE_CONFIG.head_dim)
    K, V = write_kv(view, 1, k, k + 1, positions)
    K_ref, V_ref = write_kv(contiguous, 1, k, k + 1, positions)
    assert K.shape == K_ref.shape == (2, ENGINE_CONFIG.n_kv_heads, 8, ENGINE_CONFIG.head_dim)
    assert torch.equal(K, K_ref) and torch.equal(V, V_ref)
    assert torch.equal(pool.k[1][9, :, :, :], k[1, :, 4:8].transpose(0, 1))  # row 1, positions 4..7
    with pytest.raises(ValueError, match="row 1 writes position 8 but holds only 2 blocks"):
        view.check_room(torch.tensor([[8], [8]]))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        EngineConfig(policy="fifo")
    with pytest.raises(ValueError, match="max_batch_size=0"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="num_blocks=0"):
        EngineConfig(num_blocks=0)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got str"):
        Engine(ENGINE_MODEL, "static")
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        Request(0, [1], 0)
    with pytest.raises(TypeError, match="prompt_ids"):
        Request(0, "hello", 3)
    with pytest.raises(ValueError, match="arrival_time=-1"):
        Request(0, [1], 3, arrival_time=-1)
    with pytest.raises(ValueError, match="request_id 0 appears more than once"):
        make().run([Request(0, [1], 1), Request(0, [2], 1)])
    with pytest.raises(ValueError, match="concurrency=0"):
        make().run([Request(0, [1], 1)], concurrency=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be >= max_batch_size=8"):
        EngineConfig(max_batch_size=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_prefill_chunk=0 must be >= 1"):
        EngineConfig(max_prefill_chunk=0)
    with pytest.raises(ValueError, match="enable_prefix_caching needs policy='continuous'"):
        EngineConfig(policy="static", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="unknown abort reason 'bored'"):
        make().abort("x", "bored")


def test_status_is_a_str_enum_whose_values_are_the_plain_strings():
    assert [s.value for s in Status] == ["pending", "waiting", "running", "finished", "rejected", "aborted", "failed"]
    assert Status.FINISHED == "finished" and str(Status.REJECTED) == "rejected" and f"{Status.ABORTED}" == "aborted"
    result = make(num_blocks=2, block_size=8).run([Request("ok", [1, 2], 2), Request("big", [1] * 20, 2)])
    ok, big = result.requests
    assert ok.status is Status.FINISHED and big.status is Status.REJECTED
    assert json.loads(json.dumps({"status": ok.status})) == {"status": "finished"}


def test_the_finish_reason_is_none_until_the_request_ends():
    engine = make()
    engine.add_request(Request("r", [1, 2, 3], 3))
    seq = engine.scheduler.requests["r"]
    assert seq.finish_reason is None and not seq.finished and seq.status == "waiting"
    engine.step()
    assert seq.finish_reason is None and not seq.finished and seq.status == "running"
    while engine.has_unfinished():
        engine.step()
    assert seq.finished and seq.finish_reason == "max_tokens" and seq.status == "finished"
    assert "r" not in engine.scheduler.requests  # the engine forgets it once it has ended


def test_a_step_returns_its_outputs_its_record_and_the_records_it_ended():
    """``time`` is when the step's tokens were ready (the time every StepOutput of the step carries), and the
    step began ``duration`` before it, after the previous step ended; each request's record comes out once,
    from the step that ended it, with the tokens its outputs carried."""
    engine = make(max_batch_size=2)
    assert engine.step() == StepResult([], None, [])  # idle: nothing to do
    requests = workload(4, seed=11, max_tokens=5)
    for request in requests:
        engine.add_request(request)
    previous, tokens, ended = 0.0, {}, []
    while engine.has_unfinished():
        step = engine.step()
        outputs, record, records = step.outputs, step.record, step.ended
        assert outputs and all(out.time == record.time for out in outputs)
        assert record.duration > 0 and record.time - record.duration >= previous
        assert record.n_sampled == len(outputs) and record.n_finished == len(records)
        assert sorted(r.request_id for r in records) == sorted(o.request_id for o in outputs if o.finished)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        ended += records
        previous = record.time
    assert sorted(r.request_id for r in ended) == [r.request_id for r in requests]  # each exactly once
    assert all(r.output_ids == tokens[r.request_id] and r.status is Status.FINISHED for r in ended)
    assert engine.load().finished == 4 and engine.load().steps > 0
    with pytest.raises(TypeError):
        StepRecord(*range(15))


@pytest.mark.parametrize("reason, status", [("client", Status.ABORTED), ("stop", Status.FINISHED),
                                            ("error", Status.FAILED)])
def test_abort_ends_a_request_with_its_reason_and_returns_its_record(reason, status):
    engine = make(max_batch_size=1)
    engine.add_request(Request("running", [1, 2, 3], 8))
    engine.add_request(Request("waiting", [4, 5], 8))
    first = engine.step().outputs
    for request_id, held in (("running", 1), ("waiting", 0)):
        record = engine.abort(request_id, reason)
        assert (record.request_id, record.status, record.reason) == (request_id, status, reason)
        assert len(record.output_ids) == held and record.finish_time <= engine.clock()
    assert record.output_ids == [] and engine.abort("running", reason) is None  # once only
    assert first[0].new_token_ids == greedy_reference((1, 2, 3))[:1]
    assert not engine.has_unfinished() and engine.blocks.num_used == 0
    load = engine.load()
    assert (load.finished, load.aborted, load.failed) == tuple(2 * (status is s) for s in
                                                               (Status.FINISHED, Status.ABORTED, Status.FAILED))
    assert engine.step().record is None  # nothing left: no step, no record


def test_the_steps_run_the_models_unchecked_compute(monkeypatch):
    """Token ids are checked once, at admission; the steps call ``compute`` (no per-call checks, no host syncs)."""
    requests = workload(5, seed=13)
    expected = [greedy_reference(tuple(r.prompt_ids))[:r.max_tokens] for r in requests]

    def checked(*args, **kwargs):
        raise AssertionError("a step called the model's checked forward")

    monkeypatch.setattr(ENGINE_MODEL, "forward", checked)
    result = make(max_batch_size=3, max_num_batched_tokens=8).run(requests)
    assert [r.output_ids for r in result.requests] == expected


@settings(max_examples=200)
@given(temperature=st.floats(0, 1e6), top_k=st.integers(0, 300), top_p=st.floats(1e-6, 1),
       special=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e38, -1e38]), max_size=6),
       seed=st.integers(0, 2**63 - 1))
def test_no_request_can_make_its_own_sampling_fail(temperature, top_k, top_p, special, seed):
    """Why a failing step fails its whole batch (no per-row isolation): every sampling setting a client can
    send draws a token of the vocabulary from any logits, NaN and infinities included."""
    logits = torch.randn(2, 258, generator=torch.Generator().manual_seed(seed % 2**32))
    logits[1, :len(special)] = torch.tensor(special)
    params = SamplingParams(temperature, top_k, top_p)
    seqs = [Sequence(Request(i, [1], 1, params, seed=seed), "cpu") for i in range(2)]
    tokens = sample_rows(seqs, logits)
    assert all(0 <= t < 258 for t in tokens)
    assert tokens[0] == int(sample(logits[:1], params, torch.Generator().manual_seed(seed)))  # each its own stream


def test_the_scheduler_postprocesses_a_step_without_a_model():
    """Schedule -> (tokens from anywhere) -> postprocess: the scheduler advances the sequences, appends the
    tokens and their time, finishes on EOS or max_tokens and frees at once (continuous); abort goes through it."""
    blocks = BlockManager(8, 4)
    scheduler = Scheduler(EngineConfig(max_batch_size=3, max_num_batched_tokens=16, eos_token_id=9), blocks)
    a, b, c = (Sequence(Request(i, [1, 2, 3, 4, 5], 2), device="cpu") for i in range(3))
    for seq in (a, b, c):
        scheduler.add(seq, 0.0)
    plan = scheduler.schedule()
    assert plan.sampled == [a, b, c] and a.num_computed == 0
    assert scheduler.postprocess(plan, [7, 9, 7], time=1.5) == [b]
    assert [(s.finished, s.finish_reason) for s in (a, b, c)] == [(False, None), (True, "eos"), (False, None)]
    assert a.num_computed == 5 and a.prefill_tokens == 5 and a.output_ids == [7] and a.token_times == [1.5]
    assert b.status is Status.FINISHED and b.finish_time == 1.5 and b.block_table == []
    assert scheduler.running == [a, c] and list(scheduler.requests) == [0, 2]
    assert scheduler.abort(2, "client", 1.7) is c
    assert c.status is Status.ABORTED and c.finish_reason == "client" and c.finish_time == 1.7 and not c.block_table
    plan = scheduler.schedule()
    assert plan.decode == [a] and plan.sampled == [a]
    assert scheduler.postprocess(plan, [8], time=2.0) == [a]
    assert a.finish_reason == "max_tokens" and a.num_computed == 6
    assert not scheduler.running and not scheduler.requests and blocks.num_used == 0
    assert scheduler.ended == {Status.FINISHED: 2, Status.ABORTED: 1}


def test_one_admission_rule_for_the_engine_and_the_lab_simulator(monkeypatch):
    """``may_admit`` is the policies' one difference; the model-free simulator of lab 2.3 asks the same function."""
    from minillm.book.labs import batching
    from minillm.engine.scheduler import may_admit

    assert may_admit("static", False, busy=False) and not may_admit("static", False, busy=True)
    assert may_admit("continuous", False, busy=True) and not may_admit("continuous", True, busy=True)
    assert may_admit("continuous", True, busy=False)
    asked = []

    def spy(policy, preempted, busy):
        asked.append(policy)
        return may_admit(policy, preempted, busy)

    monkeypatch.setattr(batching, "may_admit", spy)
    specs = [batching.Spec(4, 3), batching.Spec(6, 2, arrival_step=1)]
    result = batching.simulate(specs, admit=lambda waiting, running, free, bs, limit: waiting[:limit - len(running)],
                               finished=lambda seq, eos: len(seq.output) >= seq.max_tokens,
                               preempt=lambda running, free, bs: [], num_blocks=8, block_size=4, max_batch_size=2,
                               policy="static")
    assert result.complete and asked and set(asked) == {"static"}
