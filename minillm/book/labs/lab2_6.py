"""Lab 2.6: the acceptance step of speculative decoding, greedy and sampled.

The learner writes ``accept_greedy`` (keep the guesses while the target agrees, then one token of the
target's own) and ``accept_sampled`` (the rejection rule that keeps the target's distribution: accept a
guess with probability min(1, p / q), else draw from norm(max(0, p - q)), and a bonus token after k
acceptances). The hidden cases call them on hand-made rounds, then inside ``minillm.speculative``'s loop:
greedy output must equal ``generate`` token for token, and sampled rounds must follow the target's
distribution (a chi-square test). ``speculate`` is the lab's payoff. Each function's catalogue
(:mod:`.diagnosis`) holds the bugs learners write, as code.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from ...generate import generate
from ...model import build_model
from ...sampling import filtered_probs
from ...speculative import PromptLookup, SpeculativeStats, accept_greedy, accept_sampled, generate_speculative
from .cases import encode_prompt, randn, show_text, tiny_model
from .checker import LearnerError, Mismatch, Property, Task, call, register, wrong_value
from .diagnosis import Bug, Catalogue, named

# --- accept_greedy and its known bugs ---------------------------------------------------------------------


def _logits_choosing(*choices: int, vocab: int = 12, seed: int = 500) -> torch.Tensor:
    """(len(choices), vocab) logits whose row i has its largest value at choices[i]."""
    logits = randn(len(choices), vocab, seed=seed)  # (k + 1, V)
    for row, token in enumerate(choices):
        logits[row, token] = float(logits[row].max()) + 1.0
    return logits


ALL_AGREE = ([3, 7, 1], _logits_choosing(3, 7, 1, 9))  # every guess kept, then the bonus 9
FIRST_WRONG = ([3, 7, 1], _logits_choosing(5, 7, 1, 9, seed=501))  # only the target's 5
MIDDLE_WRONG = ([3, 7, 1], _logits_choosing(3, 2, 1, 9, seed=502))  # 3, then the target's 2
AGREE_AGAIN = ([3, 7, 1, 4], _logits_choosing(3, 2, 1, 4, 6, seed=503))  # 3, 2: nothing after a rejection counts
NO_GUESS = ([], _logits_choosing(8, seed=504))  # k = 0: the target's 8


def _greedy_slip(guesses, logits, bonus=True, own=True, shifted=False, keep_going=False, draft_token=False):
    """The rule, and the usual slips (flags)."""
    best = logits.argmax(-1).tolist()  # (k + 1,)
    offset = 1 if shifted else 0
    if keep_going:
        kept = [g for i, g in enumerate(guesses) if g == best[i]]
        return kept + [best[len(kept)]]
    n = 0
    while n < len(guesses) and guesses[n] == best[n + offset]:
        n += 1
    if n == len(guesses):
        return list(guesses) + ([best[n + offset]] if bonus else [])
    if draft_token:
        return list(guesses[:n + 1])
    return list(guesses[:n]) + ([best[n + offset]] if own else [])


def _greedy(**slip):
    return lambda guesses, logits: _greedy_slip(guesses, logits, **slip)


GREEDY_BUGS = Catalogue("accept_greedy", accept_greedy, (
    Bug("greedy.no_bonus", "a round that ends without the target's token when every guess is kept",
        "The target's call also scored the position after the last guess: its choice there is a token the "
        "round gets for free (the bonus).", _greedy(bonus=False)),
    Bug("greedy.no_target_token", "a round that emits only the kept guesses", "Every round ends with one "
        "token of the target's own: the correction at the first rejection, the bonus after the last guess; "
        "without it a round that keeps nothing emits nothing.", _greedy(bonus=False, own=False)),
    Bug("greedy.shifted_rows", "guess i compared with row i + 1 of the logits", "Row i holds the target's "
        "next-token logits after the context and the first i guesses: the row that judges guess i is row i.",
        _greedy(shifted=True)),
    Bug("greedy.keeps_going", "guesses kept after a rejection", "Once a guess is rejected, the guesses after "
        "it followed a token the target did not choose: the round stops there.", _greedy(keep_going=True)),
    Bug("greedy.draft_correction", "the rejected guess emitted instead of the target's token",
        "At the first disagreement the round emits the target's choice, not the draft's.",
        _greedy(draft_token=True)),
), lambda: [ALL_AGREE, FIRST_WRONG, MIDDLE_WRONG, AGREE_AGAIN, NO_GUESS],
    observe=lambda f, guesses, logits: _emitted("accept_greedy", f(list(guesses), logits.clone()), len(guesses)))


def _emitted(name: str, out, k: int) -> list[int]:
    """The learner's round as a list of ints; a LearnerError for anything else."""
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise wrong_value(name, out, "a list of token ids (ints)")
    if len(out) > k + 1:
        raise LearnerError(f"{name} returned {len(out)} tokens for {k} guesses; a round emits at most k + 1")
    return list(out)


def _greedy_case(case, what):
    guesses, logits = case

    def run(fns):
        got = _emitted("accept_greedy", call(fns["accept_greedy"], list(guesses), logits.clone()), len(guesses))
        expected = accept_greedy(list(guesses), logits)
        if got != expected:
            raise Mismatch(f"{what}: accept_greedy returned {got}; expected {expected}",
                           **GREEDY_BUGS.hint(fns, list(guesses), logits))
    return run


GREEDY_HINT = ("Write the target's choice at each row (the argmax) under the guesses, then walk the guesses "
               "by hand: where do you stop, and which token ends the round?")
GREEDY = Task("accept_greedy", "2.6", ("accept_greedy",), (
    Property("returns the round's tokens as a list of ints",
             "What does your function return when nothing is kept?",
             lambda fns: _emitted("accept_greedy", call(fns["accept_greedy"], *FIRST_WRONG), 3)),
    Property("every guess kept: the k guesses, then the target's next token (k + 1 tokens)", GREEDY_HINT,
             _greedy_case(ALL_AGREE, "guesses 3, 7, 1, the target choosing 3, 7, 1 and then 9")),
    Property("the first guess rejected: only the target's own token", GREEDY_HINT,
             _greedy_case(FIRST_WRONG, "guesses 3, 7, 1, the target choosing 5 first")),
    Property("a rejection in the middle: the agreeing prefix, then the target's token there", GREEDY_HINT,
             _greedy_case(MIDDLE_WRONG, "guesses 3, 7, 1, the target choosing 3, 2, 1, 9"), central=True),
    Property("nothing after a rejection counts, even a guess that agrees again", GREEDY_HINT,
             _greedy_case(AGREE_AGAIN, "guesses 3, 7, 1, 4, the target choosing 3, 2, 1, 4, 6")),
    Property("no guesses (k = 0): the target's token", "What does a round with no guesses emit?",
             _greedy_case(NO_GUESS, "no guesses, the target choosing 8")),
))


# --- the greedy rule inside speculative decoding -----------------------------------------------------------

def _learner_round(accept_greedy_fn, accept_sampled_fn=None):
    """``speculative_generate``'s acceptance step from the learner's functions (checked each round)."""
    def accept(guesses, draft_probs, target_logits, sampling, generator):
        if sampling.greedy:
            out = _emitted("accept_greedy", call(accept_greedy_fn, list(guesses), target_logits.clone()),
                           len(guesses))
        else:
            target_probs = filtered_probs(target_logits, sampling)  # (k + 1, V)
            if draft_probs is None:  # prompt lookup: certain guesses, each q one-hot
                draft_probs = F.one_hot(torch.tensor(guesses, dtype=torch.long), target_probs.shape[-1]).float()
            out = _emitted("accept_sampled", call(accept_sampled_fn, list(guesses), draft_probs, target_probs,
                                                  generator), len(guesses))
        if not out or out[:-1] != list(guesses[:len(out) - 1]):
            raise Mismatch(f"for guesses {list(guesses)} the rule emitted {out}; expected the kept guesses (a "
                           "prefix of them), then one token of the target's")
        return out
    return accept


@functools.lru_cache(maxsize=1)
def _other_draft():
    """The tiny model with other random weights: a draft the target mostly rejects."""
    return build_model("tiny", seed=7)


REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # a prompt whose continuation prompt lookup can guess


def _exact(draft_name: str, k: int, prompt=REPEATING, n: int = 16):
    def run(fns):
        model = tiny_model()
        draft = {"itself": model, "another model": _other_draft(), "prompt lookup": PromptLookup()}[draft_name]
        with torch.inference_mode():
            expected = generate(model, prompt, n)
            try:
                got = generate_speculative(model, draft, prompt, k, n, accept=_learner_round(fns["accept_greedy"]))
            except Mismatch as exc:  # a round that is not a prefix of the guesses and one token
                raise Mismatch(f"the tiny model drafted by {draft_name}, k = {k}: {exc}",
                               **named(GREEDY_BUGS.identify(fns))) from exc
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            raise Mismatch(f"the tiny model drafted by {draft_name}, k = {k}: {len(got)} tokens, the same as generate "
                           f"for the first {first} only; expected all {len(expected)}",
                           **named(GREEDY_BUGS.identify(fns)))
    return run


EXACT_HINT = "Pass the checks of accept_greedy first: a single wrong round changes everything after it."
EXACT = Task("your rule inside speculative decoding", "2.6", ("accept_greedy",), (
    Property("drafted by the target itself (every guess kept): the same tokens as generate, k = 4", EXACT_HINT,
             _exact("itself", 4), central=True),
    Property("drafted by another model (most guesses rejected): the same tokens as generate, k = 3", EXACT_HINT,
             _exact("another model", 3), central=True),
    Property("drafted by prompt lookup on a repeating prompt: the same tokens as generate, k = 5", EXACT_HINT,
             _exact("prompt lookup", 5)),
))


# --- accept_sampled and its known bugs ---------------------------------------------------------------------

P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.20, 0.10])  # the target's distribution; token 4 impossible
Q = torch.tensor([0.20, 0.10, 0.30, 0.05, 0.15, 0.10, 0.10])  # the draft's: off nearly everywhere
ROUNDS = 1000  # rounds of the distribution check: each wrong rule of the catalogue and of the tests scores a
# p-value under 1e-12 over 20 seeds, 8 orders of magnitude below the threshold, the right rule above 0.004
PROBE_ROUNDS = 600  # rounds of each probe that names a bug
# Each round is one call into the notebook's process: well under a millisecond here, but a slower or loaded
# machine may take several. The distribution check's own time limit counts this many seconds a call, for its
# rounds and, when it fails, the probes that name the bug. A rule that loops on every call is stopped by the
# checks before it, within the usual limit.
CALL_SECONDS = 0.005
P_SPLIT = torch.tensor([0.5, 0.5, 0.0])  # with Q_SPLIT, a rejected guess must become token 0, never 1
Q_SPLIT = torch.tensor([0.0, 0.5, 0.5])


def _rounds(function, p: torch.Tensor, q: torch.Tensor, k: int, n: int, seed: int) -> torch.Tensor:
    """Over n rounds of k guesses drawn from q, the frequencies (V + 1,) of the round's first token, and
    last, of the rounds that kept every guess (k + 1 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1] + 1, dtype=torch.float64)
    draft, target = q.expand(k, -1).clone(), p.expand(k + 1, -1).clone()  # (k, V), (k + 1, V)
    for _ in range(n):
        guesses = torch.multinomial(q, k, replacement=True, generator=generator).tolist() if k else []
        out = _emitted("accept_sampled", function(guesses, draft, target, generator), k)
        if not out:
            raise LearnerError("accept_sampled returned an empty round; a round emits at least one token")
        counts[out[0]] += 1
        counts[-1] += len(out) == k + 1
    return counts / n


def _sampled_slip(guesses, draft_probs, target_probs, generator, argmax=False, residual="max(0, p - q)",
                  bonus=True, always=False, inverted=False):
    """The rule, and the usual slips (flags)."""
    if argmax:
        return accept_greedy(guesses, target_probs)
    for i, token in enumerate(guesses):
        p, q = target_probs[i], draft_probs[i]  # (V,), (V,)
        u = torch.rand((), generator=generator)
        keep = always or (u * p[token] < q[token] if inverted else u * q[token] < p[token])
        if keep:
            continue
        weights = (p - q).clamp(min=0) if residual == "max(0, p - q)" else p
        return list(guesses[:i]) + [int(torch.multinomial(weights, 1, generator=generator))]
    if not bonus:
        return list(guesses)
    return list(guesses) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


def _sampled(**slip):
    return lambda guesses, q, p, generator: _sampled_slip(guesses, q, p, generator, **slip)


def _same_frequencies(a, b) -> bool:
    """Two frequency vectors equal within sampling noise (PROBE_ROUNDS: a standard deviation under 0.03)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool((a - b).abs().max() <= 0.1)
    return type(a) is type(b) and a == b


SAMPLED_BUGS = Catalogue("accept_sampled", accept_sampled, (
    Bug("sampled.argmax", "a guess kept when it is the target's most likely token", "Under sampling a guess "
        "is kept with probability min(1, p / q): the draw u < p(x) / q(x) decides, not the argmax.",
        _sampled(argmax=True)),
    Bug("sampled.residual_from_p", "the correction drawn from p", "After a rejection, draw from the mass the "
        "draft gave too little: max(0, p - q), renormalized. Drawing from p counts again the mass the "
        "accepted guesses already stand for.", _sampled(residual="p")),
    Bug("sampled.no_bonus", "a round that ends without a bonus token after k acceptances", "After k kept "
        "guesses the target's last row is a distribution for one more token: draw the bonus from it.",
        _sampled(bonus=False)),
    Bug("sampled.always", "every guess kept", "A guess is kept only with probability min(1, p / q): draw u "
        "and compare.", _sampled(always=True)),
    Bug("sampled.inverted", "a guess kept with probability min(1, q / p)", "The ratio is the target's "
        "probability over the draft's, p(x) / q(x).", _sampled(inverted=True)),
), lambda: [(P, Q, 1, PROBE_ROUNDS, 1), (P, P, 2, PROBE_ROUNDS, 2), (P_SPLIT, Q_SPLIT, 1, PROBE_ROUNDS, 4)],
    observe=_rounds, same=_same_frequencies)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test that ``counts`` were drawn from ``probs``: its p-value (0 when a token of probability 0
    was drawn)."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return 0.0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64),
                                         statistic / 2))


def _sampled_call(fns, guesses, q, p, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return _emitted("accept_sampled", call(fns["accept_sampled"], list(guesses), q, p, generator), len(guesses))


def _impossible_guess(fns):
    p = torch.tensor([0.0, 0.6, 0.4, 0.0])  # the target never picks token 0
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])  # the draft gives token 2 nothing: p - q is positive only there
    for seed in range(5):
        out = _sampled_call(fns, [0], q[None], torch.stack([p, p]), seed)
        if out != [2]:
            raise Mismatch(f"a guess the target gives probability 0 (token 0), p = {p.tolist()}, q = {q.tolist()}: "
                           f"the round emitted {out}; expected [2], the only token where p exceeds q",
                           **SAMPLED_BUGS.hint(fns, P, Q, 1, PROBE_ROUNDS, 1))


def _favoured_guess(fns):
    p = torch.tensor([0.1, 0.7, 0.2])
    q = torch.tensor([0.3, 0.4, 0.3])
    for seed in range(5):
        out = _sampled_call(fns, [1], q[None], torch.stack([p, torch.tensor([0.0, 0.0, 1.0])]), seed)
        if out != [1, 2]:
            raise Mismatch(f"a guess the target wants more than the draft (p = 0.7, q = 0.4) and a last row "
                           f"certain of token 2: the round emitted {out}; expected [1, 2]",
                           **SAMPLED_BUGS.hint(fns, P, Q, 1, PROBE_ROUNDS, 1))


def _same_distributions(fns):
    certain = torch.tensor([0.0, 0.0, 0.0, 1.0])
    q = torch.tensor([0.25, 0.25, 0.5, 0.0])
    rows = torch.stack([q, q, certain])  # (k + 1, V): the target agrees with the draft, then is certain of 3
    for seed in range(5):
        guesses = torch.multinomial(q, 2, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()
        out = _sampled_call(fns, guesses, torch.stack([q, q]), rows, seed)
        if out != guesses + [3]:
            raise Mismatch(f"a draft whose distribution is the target's (every guess kept) and a last row certain "
                           f"of token 3: guesses {guesses} gave {out}; expected {guesses + [3]}",
                           **SAMPLED_BUGS.hint(fns, P, P, 2, PROBE_ROUNDS, 2))


def _distribution(fns):
    frequencies = _rounds(lambda g, q, p, gen: call(fns["accept_sampled"], g, q, p, gen), P, Q, 1, ROUNDS, 3)
    counts = frequencies[:-1] * ROUNDS
    p_value = chi_square_p_value(counts, P)
    if p_value < 1e-4:
        worst = int((counts / ROUNDS - P).abs().argmax())
        raise Mismatch(f"{ROUNDS} rounds of one guess drawn from q: the first token is {worst} in "
                       f"{float(counts[worst]) / ROUNDS:.1%} of them, where the target gives it {float(P[worst]):.0%} "
                       f"(chi-square p-value {p_value:.2g}); expected the target's distribution p",
                       **SAMPLED_BUGS.hint(fns, P, Q, 1, PROBE_ROUNDS, 1))


SAMPLED_HINT = ("For one guess x drawn from q, write down the probability that the round's first token is "
                "x, and the probability that it is some other token y: do they add up to p(x) and p(y)?")
SAMPLED = Task("accept_sampled", "2.6", ("accept_sampled",), (
    Property("returns the round's tokens as a list of ints", "What does your function return in each branch?",
             lambda fns: _sampled_call(fns, [1], Q[None], torch.stack([P, P]))),
    Property("a guess the target never picks is rejected, and the correction comes from max(0, p - q)",
             SAMPLED_HINT, _impossible_guess),
    Property("a guess the target wants more than the draft (p >= q) is always kept, then a bonus token",
             SAMPLED_HINT, _favoured_guess),
    Property("a draft with the target's distribution: every guess kept, and the bonus drawn from the last row",
             "What is min(1, p / q) when p = q, and what ends a round that kept every guess?", _same_distributions),
    Property(f"over {ROUNDS} rounds, the first token follows the target's distribution p (a chi-square test)",
             SAMPLED_HINT, _distribution, seconds=(ROUNDS + 4 * PROBE_ROUNDS) * CALL_SECONDS, central=True),
))

register(GREEDY, EXACT, SAMPLED)


# --- the payoff --------------------------------------------------------------------------------------------

def speculate(model, tokenizer, accept_greedy, prompt: str, k: int = 4, max_new_tokens: int = 48) -> None:
    """SmolLM2 with prompt lookup as its draft and the learner's acceptance rule, next to plain greedy
    generation: the same text or not, the acceptance rate, tokens per target call, and both times. Call it
    once ``ready(accept_greedy)`` passes."""
    ids = encode_prompt(tokenizer, prompt)
    stats = SpeculativeStats()
    with torch.inference_mode():
        start = time.perf_counter()
        plain = generate(model, ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        drafted = generate_speculative(model, PromptLookup(), ids, k, max_new_tokens,
                                       eos_token_id=tokenizer.eos_token_id, stats=stats,
                                       accept=_learner_round(accept_greedy))
        drafted_s = time.perf_counter() - start
    show_text("prompt: ", prompt)
    show_text("speculative, your rule: ", tokenizer.decode(drafted))
    same = "the same tokens as" if drafted == plain else "DIFFERENT tokens from"
    print(f"{len(drafted)} tokens, {same} plain greedy decoding")
    print(f"acceptance rate {stats.acceptance_rate:.2f}; {stats.tokens_per_call:.2f} tokens per target call "
          f"({len(stats.rounds)} calls)")
    print(f"plain decoding {plain_s:.2f} s, speculative {drafted_s:.2f} s: x{plain_s / drafted_s:.2f}")


def sampled_rounds(accept_sampled, rounds: int = 2000, seed: int = 0) -> None:
    """The first token of ``rounds`` one-guess rounds under the learner's rule, next to the target's
    distribution p and the draft's q. Call it once ``ready(accept_sampled)`` passes."""
    frequencies = _rounds(lambda g, q, p, gen: call(accept_sampled, g, q, p, gen), P, Q, 1, rounds, seed)
    print(f"{'token':>6}{'draft q':>9}{'target p':>10}{'your rounds':>13}")
    for token in range(P.shape[0]):
        print(f"{token:>6}{float(Q[token]):>9.2f}{float(P[token]):>10.2f}{float(frequencies[token]):>13.3f}")
    print(f"rounds that kept their guess: {float(frequencies[-1]):.0%}; chi-square p-value of your rounds "
          f"against p: {chi_square_p_value(frequencies[:-1] * rounds, P):.2g}")
