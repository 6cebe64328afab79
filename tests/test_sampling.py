"""Greedy, temperature, top-k and top-p: the exact support, the distribution, seeds, bad parameters."""
import math

import pytest
import torch

from minillm import SamplingParams, filtered_probs, sample

# Probabilities 0.1, 0.4, 0.2, 0.3 for tokens 0..3; sorted: token 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1).
PROBS = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
LOGITS = PROBS.log()


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def test_greedy_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    assert torch.equal(filtered_probs(logits, SamplingParams()), torch.eye(100)[logits.argmax(-1)])
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_temperature_one_is_the_softmax_and_temperature_scales_the_logits():
    torch.testing.assert_close(filtered_probs(LOGITS, SamplingParams(temperature=1.0)), PROBS)
    sharp = filtered_probs(LOGITS, SamplingParams(temperature=0.5))  # p^2 renormalized
    torch.testing.assert_close(sharp, PROBS**2 / (PROBS**2).sum())


@pytest.mark.parametrize("top_k, kept", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3}),
                                         (0, {0, 1, 2, 3}), (10, {0, 1, 2, 3})])
def test_top_k_keeps_exactly_the_k_most_likely(top_k, kept):
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=top_k))
    assert support(probs) == kept
    mass = PROBS[0, sorted(kept)].sum()
    torch.testing.assert_close(probs[0, sorted(kept)], PROBS[0, sorted(kept)] / mass)  # renormalized


@pytest.mark.parametrize("top_p, kept", [
    (0.3, {1}),           # 0.4 alone reaches 0.3
    (0.39, {1}),
    (0.6, {1, 3}),        # 0.4 < 0.6, 0.4 + 0.3 = 0.7 >= 0.6: token 3 crosses p and is kept
    (0.75, {1, 3, 2}),    # 0.7 < 0.75, 0.9 >= 0.75
    (0.95, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_that_reaches_p(top_p, kept):
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert support(probs) == kept
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def test_top_k_then_top_p():
    # top-k 3 leaves 0.4, 0.3, 0.2 -> renormalized 4/9, 3/9, 2/9; top-p 0.7 then needs 4/9 + 3/9 = 0.78.
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert support(probs) == {1, 3}
    torch.testing.assert_close(probs[0, [1, 3]], torch.tensor([4 / 7, 3 / 7]))


def test_samples_follow_the_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=3)
    logits = LOGITS.expand(20_000, 4)
    tokens = sample(logits, params, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9])
    assert frequencies[0] == 0  # filtered out: never drawn
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.015)  # ~4 standard errors


def test_seeded_sampling_repeats_and_different_seeds_differ():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(64, 50)  # uniform over 50 tokens
    first = sample(logits, params, torch.Generator().manual_seed(7))
    again = sample(logits, params, torch.Generator().manual_seed(7))
    other = sample(logits, params, torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(temperature=-0.1), ValueError, ["temperature=-0.1", ">= 0"]),
    (dict(temperature=math.nan), ValueError, ["temperature=nan", ">= 0"]),
    (dict(top_p=0.0), ValueError, ["top_p=0.0", "> 0 and <= 1"]),
    (dict(top_p=1.5), ValueError, ["top_p=1.5", "> 0 and <= 1"]),
    (dict(top_p=-0.2), ValueError, ["top_p=-0.2", "> 0 and <= 1"]),
    (dict(top_k=-1), ValueError, ["top_k=-1", ">= 0"]),
    (dict(top_k=2.5), TypeError, ["top_k=2.5", "must be an integer"]),
])
def test_bad_sampling_parameters(kwargs, kind, words):
    with pytest.raises(kind) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert support(probs) == {1, 2}
    torch.testing.assert_close(probs[0, [1, 2]], torch.tensor([0.5, 0.5]))


# A temperature or top_p inside the accepted ranges but too small for float32 (1e-300 is 0 there) once gave
# NaN probabilities, and torch.multinomial raised (in the engine: every request in flight failed).
@pytest.mark.parametrize("kwargs", [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e-45),
                                    dict(temperature=1e-39), dict(temperature=1.0, top_p=1e-300),
                                    dict(temperature=1.0, top_p=1e-50), dict(temperature=1e-300, top_p=1e-300),
                                    dict(temperature=1e-45, top_k=2, top_p=1e-300)])
def test_degenerate_temperature_and_top_p_sample_the_argmax(kwargs):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 10
    params = SamplingParams(**kwargs)
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert (probs.max(-1).values == 1).all()  # all the mass on the most likely token
    assert torch.equal(sample(logits, params, torch.Generator().manual_seed(0)), logits.argmax(-1))


def test_a_temperature_below_float32s_smallest_normal_is_greedy_and_one_above_is_sampled():
    from minillm.sampling import MIN_TEMPERATURE
    assert MIN_TEMPERATURE == torch.finfo(torch.float32).tiny  # a literal, so that SamplingParams needs no torch
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    # just above the threshold: finite, and still the argmax (the gaps underflow); ties share the mass
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


def test_filtered_probs_is_a_distribution_even_for_broken_logits():
    logits = torch.tensor([[math.nan, 1.0, 2.0], [-math.inf] * 3, [1.0, math.inf, 0.0]])
    probs = filtered_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert probs.argmax(-1).tolist() == [2, 0, 1]


def test_generate_with_a_degenerate_temperature_is_greedy(tiny_model):
    from minillm import generate
    prompt = [256, 72, 105]
    greedy = generate(tiny_model, prompt, 6)
    assert generate(tiny_model, prompt, 6, sampling=SamplingParams(temperature=1e-300), seed=3) == greedy
    assert generate(tiny_model, prompt, 6, sampling=SamplingParams(temperature=1.0, top_p=1e-300), seed=3) == greedy
