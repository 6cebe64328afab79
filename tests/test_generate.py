"""generate / stream_generate: naive == cached, stopping, events, seeds, bad arguments."""
import pytest
import torch
from conftest import SMALL, random_ids

from minillm import KVCache, SamplingParams, TokenEvent, generate, stream_generate

PROMPT = random_ids(SMALL.vocab_size, (9,)).tolist()
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)


def test_naive_and_cached_give_the_same_greedy_tokens(small_model):
    cached = generate(small_model, PROMPT, 30)
    assert cached == generate(small_model, PROMPT, 30, use_cache=False)
    assert len(cached) == 30 and len(set(cached)) > 3


def test_greedy_generation_follows_the_model_argmax(small_model):
    tokens = generate(small_model, PROMPT, 3)
    seq = torch.tensor([PROMPT])
    for token in tokens:
        assert token == int(small_model(seq)[0, -1].argmax())
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)


def test_seeded_sampling_repeats_exactly_and_different_seeds_differ(small_model):
    first = generate(small_model, PROMPT, 25, sampling=SAMPLED, seed=1)
    assert first == generate(small_model, PROMPT, 25, sampling=SAMPLED, seed=1)
    assert first == generate(small_model, PROMPT, 25, use_cache=False, sampling=SAMPLED, seed=1)
    assert first != generate(small_model, PROMPT, 25, sampling=SAMPLED, seed=2)
    assert first != generate(small_model, PROMPT, 25)  # not the greedy sequence


def test_stops_at_eos_which_is_yielded_and_nothing_after(small_model):
    free = generate(small_model, PROMPT, 30)
    eos = free[5]
    first = free.index(eos)  # the first time the model produces that token
    assert first >= 3  # so the run really is cut short
    for use_cache in (True, False):
        tokens = generate(small_model, PROMPT, 30, use_cache=use_cache, eos_token_id=eos)
        assert tokens == free[:first + 1]
        assert tokens[-1] == eos


def test_stops_at_max_new_tokens(small_model):
    for n in (1, 2, 7):
        events = list(stream_generate(small_model, PROMPT, n))
        assert len(events) == n
        assert [e.index for e in events] == list(range(n))


def test_stream_events_have_phases_and_monotone_timestamps(small_model):
    for use_cache in (True, False):
        events = list(stream_generate(small_model, PROMPT, 6, use_cache=use_cache))
        assert all(isinstance(e, TokenEvent) for e in events)
        assert [e.phase for e in events] == ["prefill"] + ["decode"] * 5
        times = [e.time for e in events]
        assert times == sorted(times) and times[0] < times[-1]
        assert [e.token_id for e in events] == generate(small_model, PROMPT, 6)


def test_the_prompt_may_be_a_tensor(small_model):
    assert generate(small_model, torch.tensor(PROMPT), 4) == generate(small_model, PROMPT, 4)


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(prompt_ids=[]), ValueError, ["empty"]),
    (dict(prompt_ids=[1, 61]), ValueError, ["token id 61", "[0, 61)"]),
    (dict(prompt_ids=[-3, 2]), ValueError, ["token id -3", "[0, 61)"]),
    (dict(prompt_ids=[[1, 2]]), ValueError, ["1-D", "(1, 2)"]),
    (dict(prompt_ids=[1.0, 2.0]), TypeError, ["integer", "float32"]),
    (dict(max_new_tokens=0), ValueError, ["max_new_tokens=0", ">= 1"]),
    (dict(max_new_tokens=-5), ValueError, ["max_new_tokens=-5", ">= 1"]),
    (dict(max_new_tokens=2.0), TypeError, ["max_new_tokens=2.0", "integer"]),
    (dict(max_new_tokens=56), ValueError, ["prompt length 9 + max_new_tokens 56 = 65", "max_seq_len=64"]),
    (dict(cache=KVCache(SMALL, 1, 12)), ValueError, ["= 13", "the cache's max_len=12"]),
    (dict(cache=KVCache(SMALL, 2, 20)), ValueError, ["batch_size=2", "not 1"]),
    (dict(cache=KVCache(SMALL, 1, 20), use_cache=False), ValueError, ["use_cache=False"]),
    (dict(eos_token_id=61), ValueError, ["eos_token_id=61", "[0, 61)"]),
    (dict(sampling=0.7), TypeError, ["sampling=0.7", "SamplingParams"]),
])
def test_bad_arguments_raise_at_the_call(small_model, kwargs, kind, words):
    args = dict(prompt_ids=PROMPT, max_new_tokens=4) | kwargs
    with pytest.raises(kind) as info:
        stream_generate(small_model, **args)  # not iterated: the error comes at once
    for word in words:
        assert word in str(info.value)
    with pytest.raises(kind):
        generate(small_model, **args)


def test_the_longest_allowed_request_runs(small_model):
    prompt = PROMPT * 6  # 54 tokens
    assert len(generate(small_model, prompt, 64 - 54)) == 10
    assert len(generate(small_model, PROMPT, 4, cache=KVCache(SMALL, 1, 13))) == 4
