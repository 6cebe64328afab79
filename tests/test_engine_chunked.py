"""Mixed steps under a token budget (chunked prefill): one model call a step, decode rows never stall,
long prompts spread over steps, and the same tokens as generating each request alone."""
import pytest
import torch
from conftest import ENGINE_CONFIG, ENGINE_MODEL, check_invariants, drive, greedy_reference, workload

from minillm import SamplingParams, generate
from minillm.engine import Engine, EngineConfig, MixedStepView, PagedCacheView, PagedKVPool, Request

SHORT, LONG = Request("short", [1, 2, 3], 12), Request("long", list(range(10, 40)), 3)


def make(**settings) -> Engine:
    return Engine(ENGINE_MODEL, EngineConfig(**settings))


def plan(records):
    """(prefill tokens, decode tokens, requests that got a token) of each step."""
    return [(r.prefill_tokens, r.decode_tokens, r.n_sampled) for r in records]


def tokens(outputs, request):
    return [t for out in outputs[request.request_id] for t in out.new_token_ids]


@pytest.mark.parametrize("max_prefill_chunk,chunks,both,one_left", [(None, [7, 7, 7, 7, 2], 2, 2),
                                                                      (4, [4] * 7 + [2], 1, 1)])
def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_request_decodes(max_prefill_chunk, chunks, both,
                                                                                 one_left):
    engine = make(max_batch_size=4, max_num_batched_tokens=8, max_prefill_chunk=max_prefill_chunk)
    outputs, records = drive(engine, {0: [SHORT], 3: [LONG]})  # the long prompt arrives before step 3
    assert plan(records) == ([(3, 0, 1), (0, 1, 1), (0, 1, 1)]  # the short request alone
                             + [(c, 1, 1) for c in chunks[:-1]] + [(chunks[-1], 1, 2)]  # + a chunk each step
                             + [(0, 2, 2)] * both + [(0, 1, 1)] * one_left)
    assert [len(outputs[SHORT.request_id]), len(records)] == [12, 3 + len(chunks) + both + one_left]
    for request in (SHORT, LONG):
        assert tokens(outputs, request) == greedy_reference(tuple(request.prompt_ids))[:request.max_tokens]


def test_a_budget_that_holds_the_whole_prompt_computes_it_in_one_step_beside_the_decode_row():
    engine = make(max_batch_size=4)  # the default budget: 2048 tokens
    outputs, records = drive(engine, {0: [SHORT], 3: [LONG]})
    assert plan(records[3:5]) == [(30, 1, 2), (0, 2, 2)]  # the decode row waits for the whole prompt
    assert tokens(outputs, LONG) == greedy_reference(tuple(LONG.prompt_ids))[:3]


def test_decode_rows_take_the_budget_first_and_prefill_gets_the_rest():
    """Budget 4 = batch limit: with three requests decoding, a new prompt advances one token a step."""
    decoding = [Request(i, [5 + i], 10) for i in range(3)]
    prompt = Request("new", list(range(20, 26)), 2)
    engine = make(max_batch_size=4, max_num_batched_tokens=4)
    outputs, records = drive(engine, {0: decoding, 1: [prompt]})
    assert plan(records[:1]) == [(3, 0, 3)]
    assert plan(records[1:7]) == [(1, 3, 3)] * 5 + [(1, 3, 4)]
    for request in decoding + [prompt]:
        assert tokens(outputs, request) == greedy_reference(tuple(request.prompt_ids))[:request.max_tokens]


@pytest.mark.parametrize("budget,chunk", [(1, None), (3, 2), (5, None), (9, 4), (40, None)])
@pytest.mark.parametrize("num_blocks", [None, 7])
def test_greedy_tokens_equal_generate_alone_under_any_budget(budget, chunk, num_blocks):
    requests = workload(8, seed=4)
    max_batch_size = min(budget, 4)
    engine = make(max_batch_size=max_batch_size, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget,
                  max_prefill_chunk=chunk)
    result = engine.run(requests)
    check_invariants(engine, requests, result)
    assert all(r.status == "finished" for r in result.requests)
    if num_blocks is not None and max_batch_size > 1:
        assert sum(r.preemptions for r in result.requests) > 0
    if chunk is not None:
        assert max(s.prefill_tokens for s in result.steps if s.n_prefill == 1) <= chunk


def test_a_request_preempted_mid_prefill_is_recomputed_and_counted():
    """A pool of 7 blocks of 4 tokens: the running request's growth preempts the newest one while its
    prompt is still being prefilled in chunks; it starts again from scratch and still gets the right
    tokens, and its record counts every prefill token it computed (recomputation included)."""
    first, second = Request("first", [7, 8, 9], 24), Request("second", list(range(30, 50)), 4)
    engine = make(max_batch_size=2, num_blocks=7, block_size=4, max_num_batched_tokens=4)
    result = engine.run([first, second])
    a, b = result.requests
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert b.prefill_tokens > b.prompt_len == 20
    assert sum(s.prefill_tokens for s in result.steps) == a.prefill_tokens + b.prefill_tokens
    for rec, req in zip(result.requests, (first, second)):
        assert rec.output_ids == greedy_reference(tuple(req.prompt_ids))[:req.max_tokens]


def test_seeded_sampling_under_chunking_matches_generate():
    params = SamplingParams(temperature=1.0, top_k=50)
    requests = [Request(r.request_id, r.prompt_ids, r.max_tokens, params, seed=200 + i)
                for i, r in enumerate(workload(6, seed=5))]
    alone = [generate(ENGINE_MODEL, r.prompt_ids, r.max_tokens, sampling=params, seed=r.seed) for r in requests]
    result = make(max_batch_size=4, num_blocks=8, block_size=4, max_num_batched_tokens=6,
                  max_prefill_chunk=5).run(requests)
    assert [r.output_ids for r in result.requests] == alone


def test_a_mixed_call_computes_what_separate_calls_compute():
    """Two decode rows at different positions, a fresh prompt chunk and a chunk that continues a cached
    prefix, laid out in one row of tokens: same logits and the same KV
    as three separate calls."""
    torch.manual_seed(0)
    ids = {k: torch.randint(0, ENGINE_CONFIG.vocab_size, (20,)) for k in "ABCD"}
    tables = {"A": [0, 1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8, 9]}
    pools = [PagedKVPool(ENGINE_CONFIG, 12, 4) for _ in range(2)]
    with torch.inference_mode():
        for pool in pools:  # A holds 10 tokens, B 5, D 3
            for k, n in (("A", 10), ("B", 5), ("D", 3)):
                ENGINE_MODEL(ids[k][None, :n], torch.arange(n)[None], PagedCacheView(pool, [tables[k]], [0]))
        separate = torch.cat([
            ENGINE_MODEL(torch.stack([ids["A"][10:11], ids["B"][5:6]]), torch.tensor([[10], [5]]),
                  PagedCacheView(pools[0], [tables["A"], tables["B"]], [10, 5]))[:, 0],
            ENGINE_MODEL(ids["C"][None, :7], torch.arange(7)[None], PagedCacheView(pools[0], [tables["C"]], [0]))[0],
            ENGINE_MODEL(ids["D"][None, 3:9], torch.arange(3, 9)[None],
                         PagedCacheView(pools[0], [tables["D"]], [3]))[0]])
        parts = [(2, 1, PagedCacheView(pools[1], [tables["A"], tables["B"]], [10, 5])),
                 (1, 7, PagedCacheView(pools[1], [tables["C"]], [0])),
                 (1, 6, PagedCacheView(pools[1], [tables["D"]], [3]))]
        row = torch.cat([ids["A"][10:11], ids["B"][5:6], ids["C"][:7], ids["D"][3:9]])[None]  # (1, 15)
        positions = torch.cat([torch.tensor([10, 5]), torch.arange(7), torch.arange(3, 9)])[None]
        mixed = ENGINE_MODEL(row, positions, MixedStepView(parts))[0]  # (15, vocab)
    assert mixed.shape == separate.shape == (15, ENGINE_CONFIG.vocab_size)
    assert (mixed - separate).abs().max() < 1e-5  # equal up to float32 rounding (other matmul shapes)
    for layer in range(ENGINE_CONFIG.n_layers):
        assert (pools[1].k[layer] - pools[0].k[layer]).abs().max() < 1e-5
        assert (pools[1].v[layer] - pools[0].v[layer]).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"positions shape \(1, 14\) != \(1, 15\)"):
        ENGINE_MODEL(row[:, :14], positions[:, :14], MixedStepView(parts))
    with pytest.raises(ValueError, match="a mixed batch needs explicit positions"):
        ENGINE_MODEL(row, None, MixedStepView(parts))
