"""Prefix caching: full KV blocks shared by content, reference-counted, evicted least recently used first;
the tokens are those of generating each request alone, and the prefill tokens saved are counted exactly."""
import pytest
from conftest import ENGINE_MODEL, check_invariants, check_tables, drive, greedy_reference, workload

from minillm.engine import BlockManager, Engine, EngineConfig, Request, block_key
from minillm.engine.request import Sequence

SYSTEM = list(range(100, 110))  # a 10-token system prompt: 2 full blocks of 4 tokens, and 2 tokens over
USERS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def make(**settings) -> Engine:
    return Engine(ENGINE_MODEL, EngineConfig(**settings))


@pytest.mark.parametrize("budget", [None, 5])  # the default (whole prompts in a step), or chunks of a few tokens
def test_a_shared_system_prompt_is_computed_once_and_the_saving_counted_exactly(budget):
    requests = [Request(i, SYSTEM + user, 4, arrival_time=float(i)) for i, user in enumerate(USERS)]
    runs = {}
    for caching in (False, True):
        engine = make(max_batch_size=4, block_size=4, enable_prefix_caching=caching, max_num_batched_tokens=budget)
        runs[caching] = engine.run(requests)
        check_invariants(engine, requests, runs[caching])  # includes: tokens equal generate alone
    off, on = runs[False].requests, runs[True].requests
    assert [r.cached_tokens for r in off] == [0, 0, 0, 0]
    assert [r.cached_tokens for r in on] == [0, 8, 8, 8]  # the system prompt's 2 full blocks
    assert [r.prefill_tokens for r in on] == [13, 6, 4, 7]  # = prompt length - cached tokens
    assert [r.prefill_tokens for r in off] == [r.prompt_len for r in off] == [13, 14, 12, 15]
    saved = sum(s.prefill_tokens for s in runs[False].steps) - sum(s.prefill_tokens for s in runs[True].steps)
    assert saved == sum(s.cached_tokens for s in runs[True].steps) == 24
    assert [r.output_ids for r in on] == [r.output_ids for r in off]


@pytest.mark.parametrize("prompt_len,cached", [(12, 8), (13, 12), (4, 0), (5, 4)])
def test_the_last_token_is_always_computed(prompt_len, cached):
    """An identical prompt reuses its full blocks but always computes at least its last token (its
    logits give the first new token): 12 tokens = 3 full blocks, of which 2 are reused."""
    prompt = list(range(40, 40 + prompt_len))
    requests = [Request("first", prompt, 3), Request("again", prompt, 3, arrival_time=1.0)]
    engine = make(max_batch_size=2, block_size=4, enable_prefix_caching=True)
    result = engine.run(requests)
    check_invariants(engine, requests, result)
    again = result.requests[1]
    assert (again.cached_tokens, again.prefill_tokens) == (cached, prompt_len - cached)


def test_least_recently_freed_blocks_are_evicted_first_tail_first():
    """7 blocks of 4 tokens, one request at a time. a and b leave 2 cached blocks each; c (12 tokens
    + 2 new) needs 4 blocks: the 3 free blocks that hold nothing, then one eviction: the least
    recently freed cached block, which is a's tail block. So b is still fully cached, a only half."""
    a, b, c = list(range(10, 19)), list(range(30, 39)), list(range(50, 62))
    requests = [Request("a", a, 1), Request("b", b, 1), Request("c", c, 2), Request("b2", b, 1), Request("a2", a, 1)]
    engine = make(max_batch_size=1, num_blocks=7, block_size=4, enable_prefix_caching=True)
    result = engine.run(requests, concurrency=1)
    check_invariants(engine, requests, result)
    assert [r.cached_tokens for r in result.requests] == [0, 0, 0, 8, 4]
    assert [s.blocks_cached for s in result.steps] == [2, 4, 4, 6, 6, 6]  # free blocks holding a prefix


def test_shared_blocks_are_counted_and_freed_only_when_unused():
    """b shares a's system-prompt blocks while both run (count 2); when a ends they stay held by b;
    when b ends they are free but still cached; at the end every count is 0."""
    first, second = Request("a", SYSTEM + [1, 2, 3], 6), Request("b", SYSTEM + [4, 5], 8)
    engine = make(max_batch_size=2, block_size=4, enable_prefix_caching=True)
    counts = []

    def check(engine):
        check_tables(engine)
        counts.append(sorted((c for c in engine.blocks.ref_counts if c), reverse=True)[:2])

    outputs, _ = drive(engine, {0: [first], 1: [second]}, check)
    assert counts[0] == [1, 1] and counts[1] == [2, 2]  # step 1: b admitted on a's two full blocks
    assert counts[6] == [1, 1]  # a ended at step 5; b still holds them
    assert engine.blocks.ref_counts == [0] * engine.blocks.num_blocks
    assert engine.blocks.num_cached >= 2
    for request in (first, second):
        got = [t for out in outputs[request.request_id] for t in out.new_token_ids]
        assert got == greedy_reference(tuple(request.prompt_ids))[:request.max_tokens]


def test_a_preempted_request_finds_its_own_blocks_when_it_resumes():
    requests = workload(10, seed=1)
    prefill = {}
    for caching in (False, True):
        engine = make(max_batch_size=8, num_blocks=6, block_size=8, enable_prefix_caching=caching)
        result = engine.run(requests)
        check_invariants(engine, requests, result)
        prefill[caching] = sum(r.prefill_tokens for r in result.requests)
    resumed = [r for r in result.requests if r.preemptions]
    assert resumed and all(r.cached_tokens > 0 for r in resumed)
    assert prefill[True] == prefill[False] - sum(r.cached_tokens for r in result.requests)


def test_block_keys_chain_the_whole_prefix():
    """Equal tokens in a block are the same key only after equal prefixes."""
    root = block_key(None, [1, 2])
    assert block_key(root, [3, 4]) == block_key(block_key(None, [1, 2]), [3, 4])
    assert block_key(root, [3, 4]) != block_key(block_key(None, [9, 2]), [3, 4])
    blocks = BlockManager(4, 2, enable_prefix_caching=True)
    seq = Sequence(Request(0, [1, 2, 3, 4, 5], 1), device="cpu")
    assert blocks.admit(seq) == 0 and len(seq.block_table) == 3  # no hit: 0 tokens found in the cache
    seq.num_computed = 5
    blocks.cache_full_blocks(seq)
    assert [blocks.block_of[k] for k in seq.block_keys] == seq.block_table[:2]
    big = Sequence(Request(1, [1, 2, 3, 4, 6, 7, 8, 9], 1), device="cpu")
    assert blocks.admit(big) is None and big.block_table == []  # 2 shared + 2 new blocks; 1 is free
    other = Sequence(Request(2, [1, 2, 3, 4, 6, 7], 1), device="cpu")
    assert blocks.admit(other) == 4 and other.block_table[:2] == seq.block_table[:2]
    assert blocks.ref_counts == [2, 2, 1, 1] and blocks.num_free == 0
    blocks.free(seq)
    blocks.free(other)
    assert blocks.ref_counts == [0] * 4 and blocks.num_cached == 2 and list(blocks.free_blocks)[-2:] == [1, 0]


def test_admit_reports_the_cached_tokens_and_leaves_the_sequences_progress_to_the_scheduler():
    """``BlockManager.admit`` hands out blocks and says how many tokens it found cached; it does not write
    ``num_computed`` (the scheduler, the one owner of a sequence's state, does)."""
    blocks = BlockManager(6, 2, enable_prefix_caching=True)
    first = Sequence(Request(0, [1, 2, 3, 4, 5], 1), device="cpu")
    assert blocks.admit(first) == 0
    first.num_computed = 5
    blocks.cache_full_blocks(first)
    second = Sequence(Request(1, [1, 2, 3, 4, 9], 1), device="cpu")
    assert blocks.admit(second) == 4 and second.num_computed == 0
    assert second.block_table[:2] == first.block_table[:2]
