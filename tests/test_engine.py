"""The continuous-batching engine: same tokens as `generate`, nothing lost, memory within budget."""
import random
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minillm import KVCache, SamplingParams, build_model, generate, get_config
from minillm.engine import Engine, PagedBatchCache, PagedKVPool, Request

CONFIG = get_config("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=96)
MODEL = build_model(CONFIG, seed=0)
REF_TOKENS = 24  # greedy outputs are prefixes of a longer greedy run


@lru_cache(maxsize=None)
def greedy_reference(prompt: tuple[int, ...]) -> list[int]:
    return generate(MODEL, list(prompt), REF_TOKENS)


def workload(n, seed, max_prompt=20, max_tokens=20, **kwargs):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_tokens),
                    **kwargs) for i in range(n)]


def check_invariants(engine, requests, result):
    """Every request ends once, finished or rejected; memory never exceeds the pool; times are ordered."""
    assert [r.request_id for r in result.requests] == [r.request_id for r in requests]
    assert all(r.status in ("finished", "rejected") for r in result.requests)
    assert all(s.blocks_used <= engine.blocks.num_blocks for s in result.steps)
    assert engine.blocks.num_used == 0 and sorted(engine.blocks.free_ids) == list(range(engine.blocks.num_blocks))
    for req, rec in zip(requests, result.requests):
        if rec.status == "rejected":
            assert rec.reason and rec.output_ids == [] and rec.token_times == []
            continue
        assert len(rec.output_ids) == len(rec.token_times) == req.max_tokens  # no EOS id: runs to max_tokens
        assert rec.arrival_time <= rec.token_times[0]
        assert rec.token_times == sorted(rec.token_times) and rec.finish_time == rec.token_times[-1]
        assert rec.output_ids == greedy_reference(tuple(req.prompt_ids))[:req.max_tokens]


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("max_batch_size,num_blocks", [(1, None), (3, None), (8, 6)])
def test_greedy_tokens_equal_generate_alone(policy, max_batch_size, num_blocks):
    requests = workload(10, seed=1)
    engine = Engine(MODEL, policy, max_batch_size=max_batch_size, num_blocks=num_blocks, block_size=8)
    result = engine.run(requests)
    assert all(r.status == "finished" for r in result.requests)
    check_invariants(engine, requests, result)
    if num_blocks is not None:  # 6 blocks of 8 tokens cannot hold 8 running requests: preemption happened
        assert sum(r.preemptions for r in result.requests) > 0
        assert sum(s.n_preempted for s in result.steps) == sum(r.preemptions for r in result.requests)
        assert result.requests[0].preemptions == 0  # the oldest running request is never the victim
    else:
        assert max(s.n_running for s in result.steps) == max_batch_size


def test_seeded_sampling_matches_generate_and_survives_preemption():
    params = SamplingParams(temperature=1.0, top_k=50)
    requests = [Request(r.request_id, r.prompt_ids, r.max_tokens, params, seed=100 + i)
                for i, r in enumerate(workload(6, seed=2))]
    alone = [generate(MODEL, r.prompt_ids, r.max_tokens, sampling=params, seed=r.seed) for r in requests]
    for num_blocks in (None, 6):
        result = Engine(MODEL, max_batch_size=6, num_blocks=num_blocks, block_size=8).run(requests)
        assert [r.output_ids for r in result.requests] == alone


def test_eos_stops_a_request_unless_ignored():
    prompt = [5, 6, 7]
    eos = greedy_reference(tuple(prompt))[2]  # make the third greedy token the end of sequence
    stop = greedy_reference(tuple(prompt)).index(eos) + 1
    requests = [Request("stop", prompt, 10), Request("ignore", prompt, 10, ignore_eos=True)]
    result = Engine(MODEL, max_batch_size=2, eos_token_id=eos).run(requests)
    stopped, ignored = result.requests
    assert stopped.output_ids == generate(MODEL, prompt, 10, eos_token_id=eos) == greedy_reference((5, 6, 7))[:stop]
    assert stopped.reason == "eos" and stopped.output_ids[-1] == eos
    assert ignored.reason == "max_tokens" and ignored.output_ids == greedy_reference((5, 6, 7))[:10]


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    requests = [Request("ok", [1, 2, 3], 4), Request("empty", [], 4), Request("vocab", [1, 300], 4),
                Request("long", [1] * 90, 10), Request("pool", [1] * 40, 20), Request("ok2", [4], 2)]
    engine = Engine(MODEL, max_batch_size=4, num_blocks=7, block_size=8)  # 56 tokens of KV budget
    result = engine.run(requests)
    by_id = {r.request_id: r for r in result.requests}
    assert by_id["ok"].status == by_id["ok2"].status == "finished"
    assert by_id["empty"].reason == "empty prompt"
    assert "300" in by_id["vocab"].reason and "[0, 258)" in by_id["vocab"].reason
    assert "100" in by_id["long"].reason and "max_seq_len=96" in by_id["long"].reason
    assert "needs 8 KV blocks" in by_id["pool"].reason and "pool of 7" in by_id["pool"].reason
    check_invariants(engine, requests, result)


def test_static_waits_for_the_slowest_and_continuous_refills_at_once():
    requests = [Request(i, [10 + i, 20], m) for i, m in enumerate([1, 5, 5, 5])]
    plan = {}
    for policy in ("static", "continuous"):
        result = Engine(MODEL, policy, max_batch_size=2).run(requests)
        plan[policy] = [(s.n_prefill, s.n_decode, s.n_padding) for s in result.steps]
    assert plan["static"] == [(2, 0, 0)] + [(0, 1, 1)] * 4 + [(2, 0, 0)] + [(0, 2, 0)] * 4
    assert plan["continuous"] == [(2, 0, 0), (1, 1, 0)] + [(0, 2, 0)] * 3 + [(1, 1, 0)] + [(0, 1, 0)] * 4


def test_idle_time_is_skipped_not_slept():
    requests = [Request(0, [1, 2], 3), Request(1, [3, 4], 3, arrival_time=1000.0)]
    result = Engine(MODEL).run(requests)
    first, late = result.requests
    assert late.arrival_time == 1000.0 and late.token_times[0] >= 1000.0
    assert 0 < result.idle_skipped <= 1000.0 - first.finish_time
    assert result.wall_time >= late.finish_time >= 1000.0


def test_closed_loop_keeps_n_users_in_the_system():
    requests = workload(7, seed=3, max_tokens=8)
    result = Engine(MODEL, max_batch_size=8).run(requests, concurrency=2)
    assert [r.arrival_time for r in result.requests[:2]] == [0.0, 0.0]
    ends = sorted(r.finish_time for r in result.requests)
    assert sorted(r.arrival_time for r in result.requests[2:]) == ends[:5]  # each end lets the next one in
    assert max(s.n_running + s.n_waiting for s in result.steps) <= 2
    assert all(r.status == "finished" for r in result.requests)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), policy=st.sampled_from(["continuous", "static"]), max_batch_size=st.integers(1, 4),
       block_size=st.sampled_from([2, 4, 8]), num_blocks=st.integers(1, 16), concurrency=st.sampled_from([None, 2]))
def test_random_workloads_lose_nothing_and_stay_in_budget(data, policy, max_batch_size, block_size, num_blocks,
                                                          concurrency):
    n = data.draw(st.integers(1, 8), label="n")
    requests = [Request(i, data.draw(st.lists(st.integers(0, 257), max_size=16), label="prompt"),
                        data.draw(st.integers(1, 12), label="max_tokens"),
                        arrival_time=data.draw(st.sampled_from([0.0, 0.01, 5.0]), label="arrival"))
                for i in range(n)]
    engine = Engine(MODEL, policy, max_batch_size=max_batch_size, num_blocks=num_blocks, block_size=block_size)
    result = engine.run(requests, concurrency=concurrency)
    check_invariants(engine, requests, result)
    for req, rec in zip(requests, result.requests):
        assert (rec.status == "rejected") == (engine.rejection(req) is not None)


def test_paged_cache_returns_keys_by_position_like_the_contiguous_cache():
    pool = PagedKVPool(CONFIG, num_blocks=10, block_size=4)
    tables = [[7, 2, 5], [0, 9]]  # scattered blocks: row 0 holds up to 12 positions, row 1 up to 8
    view = PagedBatchCache(pool, tables, [0, 0])
    contiguous = KVCache(CONFIG, 2, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]])  # (2, 8)
    k = torch.randn(2, CONFIG.n_kv_heads, 8, CONFIG.head_dim)
    view.check_room(positions)
    contiguous.check_room(positions)
    K, V = view.update(1, k, k + 1, positions)
    K_ref, V_ref = contiguous.update(1, k, k + 1, positions)
    assert K.shape == K_ref.shape == (2, CONFIG.n_kv_heads, 8, CONFIG.head_dim)
    assert torch.equal(K, K_ref) and torch.equal(V, V_ref)
    assert torch.equal(pool.k[1][9, :, :, :], k[1, :, 4:8].transpose(0, 1))  # row 1, positions 4..7
    with pytest.raises(ValueError, match="row 1 writes position 8 but holds only 2 blocks"):
        view.check_room(torch.tensor([[8], [8]]))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        Engine(MODEL, policy="fifo")
    with pytest.raises(ValueError, match="max_batch_size=0"):
        Engine(MODEL, max_batch_size=0)
    with pytest.raises(ValueError, match="num_blocks=0"):
        Engine(MODEL, num_blocks=0)
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        Request(0, [1], 0)
    with pytest.raises(TypeError, match="prompt_ids"):
        Request(0, "hello", 3)
    with pytest.raises(ValueError, match="arrival_time=-1"):
        Request(0, [1], 3, arrival_time=-1)
    with pytest.raises(ValueError, match="request_id 0 appears more than once"):
        Engine(MODEL).run([Request(0, [1], 1), Request(0, [2], 1)])
    with pytest.raises(ValueError, match="concurrency=0"):
        Engine(MODEL).run([Request(0, [1], 1)], concurrency=0)
