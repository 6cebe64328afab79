"""Speculative decoding is exact: greedy text token for token as ``generate``'s, sampled text with the
target's distribution, caches after a rollback as if the rejected guesses had never been fed."""
from __future__ import annotations

import copy

import pytest
import torch

from minillm import KVCache, ModelConfig, SamplingParams, build_model, filtered_probs, generate, stream_generate
from minillm.speculative import (
    ModelDraft,
    PromptLookup,
    SpeculativeStats,
    accept_greedy,
    accept_round,
    accept_sampled,
    generate_speculative,
    speculative_generate,
)

PROMPT = [1, 7, 3, 9, 7, 3, 9, 7, 3, 2, 5]  # repeats, so prompt lookup finds matches
KS = [1, 2, 3, 4, 8]


@pytest.fixture(scope="module")
def target():
    return build_model("tiny", seed=0)


def noisy_copy(model, scale: float, seed: int):
    """The model with every weight moved by ``scale`` x its own spread: a draft that agrees often, not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * scale)
    return draft


@pytest.fixture(scope="module")
def drafts(target):
    """Drafts that agree always (the target itself), often, never (another random model), and prompt lookup."""
    return {"self": target, "noisy": noisy_copy(target, 0.05, seed=1), "random": build_model("tiny", seed=5),
            "lookup": PromptLookup()}


# --- greedy: the same tokens as generate ----------------------------------------------------------------

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("name", ["self", "noisy", "random", "lookup"])
def test_greedy_is_generate_token_for_token(target, drafts, name, k):
    stats = SpeculativeStats()
    out = generate_speculative(target, drafts[name], PROMPT, k, 40, stats=stats)
    assert out == generate(target, PROMPT, 40)
    assert stats.tokens + 1 == 40  # every token but the first came from a round
    assert stats.tokens == stats.accepted + len(stats.rounds)  # each round: its accepted guesses + one
    if name == "self":
        assert stats.acceptance_rate == 1.0
    if name == "random":
        assert stats.acceptance_rate < 0.2


def test_the_noisy_draft_is_partly_rejected(target, drafts):
    """The test above exercises corrections as well as full acceptances only if the noisy draft is mixed."""
    stats = SpeculativeStats()
    generate_speculative(target, drafts["noisy"], PROMPT, 4, 40, stats=stats)
    assert 0.3 < stats.acceptance_rate < 0.95
    assert {a for _, a in stats.rounds} >= {0, 4}


@pytest.mark.parametrize("k", [2, 8])
def test_eos_inside_an_accepted_run_ends_there(target, k):
    reference = generate(target, PROMPT, 30)
    eos = reference[5]  # accepted in the middle of a round: the draft is the target, every guess is kept
    stats = SpeculativeStats()
    out = generate_speculative(target, target, PROMPT, k, 30, eos_token_id=eos, stats=stats)
    assert out == generate(target, PROMPT, 30, eos_token_id=eos) == reference[:reference.index(eos) + 1]
    assert stats.tokens + 1 == len(out)
    assert stats.accepted + len(stats.rounds) + 1 > len(out)  # the last round had tokens after EOS


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 10])
def test_max_new_tokens_inside_a_run(target, drafts, max_new_tokens):
    """A round never guesses past the limit: with k = 8 the last round is cut to what is left."""
    for name in ("self", "lookup"):
        stats = SpeculativeStats()
        out = generate_speculative(target, drafts[name], PROMPT, 8, max_new_tokens, stats=stats)
        assert out == generate(target, PROMPT, max_new_tokens)
        assert all(drafted <= max_new_tokens - 2 for drafted, _ in stats.rounds)


def test_events_match_stream_generate(target, drafts):
    events = list(speculative_generate(target, drafts["noisy"], PROMPT, 4, 20))
    plain = list(stream_generate(target, PROMPT, 20))
    assert [(e.token_id, e.index, e.phase) for e in events] == [(e.token_id, e.index, e.phase) for e in plain]
    assert all(b.time >= a.time for a, b in zip(events, events[1:]))


def test_bad_arguments_are_named(target):
    other = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                    d_ff=64, max_seq_len=64))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, other, PROMPT, 4, 10)
    with pytest.raises(ValueError, match="k=0"):
        speculative_generate(target, target, PROMPT, 0, 10)
    with pytest.raises(ValueError, match="max_ngram=1 is below min_ngram=2"):
        PromptLookup(max_ngram=1, min_ngram=2)


# --- the acceptance step ----------------------------------------------------------------------------------

def test_accept_greedy_keeps_the_agreeing_prefix_and_one_target_token():
    logits = torch.eye(5)[[3, 1, 4, 0]]  # (k + 1 = 4, V = 5): the target's argmax is 3, 1, 4, then 0
    assert accept_greedy([3, 1, 2], logits) == [3, 1, 4]  # third guess wrong: corrected
    assert accept_greedy([2, 1, 4], logits) == [3]  # first guess wrong
    assert accept_greedy([3, 1, 4], logits) == [3, 1, 4, 0]  # all right: the bonus token
    assert accept_greedy([], logits[:1]) == [3]  # nothing guessed: a plain decode step


def test_prompt_lookup_guesses_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    assert lookup.lookup([5, 1, 2, 3, 8, 1, 2, 3, 9, 4, 1, 2, 3], 3) == [9, 4, 1]  # 3-gram, latest match
    assert lookup.lookup([5, 1, 2, 3, 8, 6, 1], 4) == [2, 3, 8, 6]  # only a 1-gram matches
    assert lookup.lookup([1, 2, 3], 4) == []  # nothing repeats
    assert lookup.lookup([4, 4], 3) == [4]  # the match may touch the suffix
    assert PromptLookup().lookup([5, 1, 2, 3, 8, 6, 1], 4) == []  # by default a match is 2 tokens or more


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test that ``counts`` were drawn from ``probs``: the p-value, over the cells expected > 0."""
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the distribution gives probability 0 was drawn"
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def rejection_draws(rule, p: torch.Tensor, q: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """Counts (V,) of the first token a round emits, over n rounds of one guess drawn from q."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    for _ in range(n):
        guess = int(torch.multinomial(q, 1, generator=generator))
        counts[rule([guess], q[None], torch.stack([p, p]), generator)[0]] += 1
    return counts


def accept_on_argmax(guesses, draft_probs, target_probs, generator):
    """A wrong rule students write: keep a guess when it is the target's most likely token."""
    return accept_greedy(guesses, target_probs)


def residual_from_p(guesses, draft_probs, target_probs, generator):
    """A wrong rule: the right acceptance test, but the correction drawn from p instead of max(0, p - q)."""
    for i, token in enumerate(guesses):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] >= p[token]:
            return guesses[:i] + [int(torch.multinomial(p, 1, generator=generator))]
    return guesses + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.20, 0.10])  # the target's distribution; one token impossible
Q = torch.tensor([0.20, 0.10, 0.30, 0.05, 0.15, 0.10, 0.10])  # the draft's: wrong nearly everywhere


def test_rejection_sampling_keeps_the_target_distribution():
    counts = rejection_draws(accept_sampled, P, Q, 20_000)
    assert chi_square_p_value(counts, P) > 0.01
    assert chi_square_p_value(counts, Q) < 1e-12  # and the test can tell the two apart


@pytest.mark.parametrize("wrong_rule", [accept_on_argmax, residual_from_p])
def test_the_distribution_test_catches_a_broken_rule(wrong_rule):
    counts = rejection_draws(wrong_rule, P.clone(), Q, 20_000)
    p_value = chi_square_p_value(counts, P) if counts[P == 0].sum() == 0 else 0.0
    assert p_value < 1e-6


TINY_VOCAB = ModelConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                         max_seq_len=16)


def joint_counts(accept, runs: int) -> tuple[torch.Tensor, torch.Tensor, SpeculativeStats]:
    """Whole runs on a 5-token vocabulary (k = 2, a draft that disagrees): the counts (V^3,) of the three sampled
    tokens, the target's exact joint distribution (V^3,) by enumeration, and the runs' statistics."""
    target, draft = build_model(TINY_VOCAB, seed=0), build_model(TINY_VOCAB, seed=3)
    sampling, prompt, V = SamplingParams(temperature=2.0), [1, 2], TINY_VOCAB.vocab_size
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.inference_mode():
        for a in range(V):
            for b in range(V):
                logits = target(torch.tensor([prompt + [a, b]]))[0].double() / sampling.temperature  # (T, V)
                p = torch.softmax(logits, -1)
                exact[a, b] = p[-3, a] * p[-2, b] * p[-1]
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    stats = SpeculativeStats()
    for seed in range(runs):
        a, b, c = generate_speculative(target, draft, prompt, 2, 3, sampling=sampling, seed=seed, stats=stats,
                                       accept=accept)
        counts[(a * V + b) * V + c] += 1
    return counts, exact.flatten().float(), stats


def test_sampled_runs_have_the_target_distribution():
    counts, exact, stats = joint_counts(accept_round, 6_000)
    assert 0.2 < stats.acceptance_rate < 0.9  # both accept and reject paths ran
    assert chi_square_p_value(counts, exact) > 0.01


def test_sampled_runs_with_a_broken_rule_fail_the_test():
    def broken(guesses, draft_probs, target_logits, sampling, generator):  # the correction drawn from p
        return residual_from_p(guesses, draft_probs, filtered_probs(target_logits, sampling), generator)

    counts, exact, _ = joint_counts(broken, 2_000)
    assert chi_square_p_value(counts, exact) < 1e-6


# --- rollback ------------------------------------------------------------------------------------------------

def test_truncated_cache_equals_one_that_never_saw_the_rejected_tokens(target):
    kept, rejected = PROMPT + [4, 6], [8, 8, 8]
    rolled = KVCache(target.config, 1, 32)
    clean = KVCache(target.config, 1, 32)
    with torch.inference_mode():
        target(torch.tensor([kept + rejected]), cache=rolled)
        rolled.truncate(len(kept))
        target(torch.tensor([kept]), cache=clean)
        assert rolled.lengths.tolist() == clean.lengths.tolist() == [len(kept)]
        for K, K0 in zip(rolled.k + rolled.v, clean.k + clean.v):
            torch.testing.assert_close(K[:, :, :len(kept)], K0[:, :, :len(kept)])
        # the stale keys past the length are invisible: the next steps match the clean cache's
        for token in [3, 0, 2]:
            step = torch.tensor([[token]])
            torch.testing.assert_close(target(step, cache=rolled), target(step, cache=clean))


def test_draft_cache_after_rollback_equals_a_fresh_one(target):
    context = PROMPT + [4]
    rolled, fresh = ModelDraft(target, 32), ModelDraft(target, 32)
    greedy = SamplingParams()
    guesses, _ = rolled.propose(context, 4, greedy, None)  # the cache now holds context + 3 guesses
    assert rolled.fed == len(context) + 3
    rolled.rollback(len(context) + 1)  # the first guess kept
    assert rolled.fed == len(context) + 1 and int(rolled.cache.lengths[0]) == len(context) + 1
    committed = context + guesses[:1] + [6]
    assert rolled.propose(committed, 3, greedy, None) == fresh.propose(committed, 3, greedy, None)
    n = int(fresh.cache.lengths[0])
    for K, K0 in zip(rolled.cache.k, fresh.cache.k):
        torch.testing.assert_close(K[:, :, :n], K0[:, :, :n])


# --- SmolLM2: the int4 weights draft for the float32 model ----------------------------------------------------

SMOL_PROMPTS = {  # one whose reply copies the prompt (prompt lookup finds it) and one whose reply does not
    "edit": "Fix the spelling and repeat the sentence: The quick brwon fox jumpd over the lazzy dog.",
    "story": "Write a short story about a robot who learns to paint.",
}
SMOL_NEW = 40


@pytest.fixture(scope="module")
def smollm2():
    """The float32 target, its int4 and prompt-lookup drafts, the prompts and generate's replies."""
    from minillm import load_pretrained
    from minillm.fast.int4 import load_int4

    target, tokenizer = load_pretrained("smollm2-135m-instruct")
    draft, _ = load_int4("smollm2-135m-instruct")
    prompts = {name: tokenizer.encode_chat(text) for name, text in SMOL_PROMPTS.items()}
    eos = tokenizer.eos_token_id
    references = {name: generate(target, ids, SMOL_NEW, eos_token_id=eos) for name, ids in prompts.items()}
    return target, {"int4": draft, "ngram": PromptLookup()}, prompts, references, eos


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("draft_name", ["int4", "ngram"])
def test_smollm2_greedy_is_generate_token_for_token(smollm2, draft_name, k):
    target, drafts, prompts, references, eos = smollm2
    for name, ids in prompts.items():
        stats = SpeculativeStats()
        out = generate_speculative(target, drafts[draft_name], ids, k, SMOL_NEW, eos_token_id=eos, stats=stats)
        assert out == references[name], f"{draft_name} k={k} on {name!r}"
        if draft_name == "int4":  # the file's own 4-bit weights nearly always agree with its float32 ones
            assert stats.acceptance_rate > 0.8


@pytest.mark.slow
def test_smollm2_edit_ends_with_eos_inside_an_accepted_run(smollm2):
    target, drafts, prompts, references, eos = smollm2
    assert references["edit"][-1] == eos and len(references["edit"]) < SMOL_NEW
    stats = SpeculativeStats()
    out = generate_speculative(target, drafts["int4"], prompts["edit"], 8, SMOL_NEW, eos_token_id=eos, stats=stats)
    assert out == references["edit"]
    assert stats.accepted + len(stats.rounds) + 1 > len(out)  # the target accepted guesses after EOS


@pytest.mark.slow
def test_smollm2_max_new_tokens_inside_a_run(smollm2):
    target, drafts, prompts, references, eos = smollm2
    stats = SpeculativeStats()
    out = generate_speculative(target, drafts["int4"], prompts["story"], 8, 6, eos_token_id=eos, stats=stats)
    assert out == references["story"][:6]
    assert stats.rounds[0][0] == 4  # 6 tokens: the prefill's, then at most 4 guesses + the target's own


# --- the demo's flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--speculative", "ngram"], "--speculative needs the trained model"),
    (["--speculative", "int4", "--precision", "int4"], "the model is int4 already"),
    (["--speculative", "ngram", "--compare"], "give --compare or --speculative"),
    (["--speculative", "ngram", "--k", "0"], "argument --k: 0 must be >= 1"),
])
def test_demo_refuses_contradictory_speculative_flags(capsys, argv, message):
    from minillm.demo import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["int4", "ngram"])
def test_demo_speculative_prints_acceptance_and_speed_up(capsys, draft):
    from minillm.demo import main

    prompt = SMOL_PROMPTS["edit"]
    assert main(["--speculative", draft, "--k", "4", "--chat", "--prompt", prompt, "--max-new-tokens", "12",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "speculative (k guesses, 1 check)" in out and "cached (KV cache: prefill, decode)" in out
    assert "drafting k = 4: acceptance rate" in out and "tokens per target call" in out
    assert "x plain decode (TPOT" in out and "same tokens: yes, all 12 identical" in out
