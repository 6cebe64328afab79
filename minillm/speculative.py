"""Speculative decoding: a cheap draft guesses k tokens, the target checks all of them in one call.

A decode step of a memory-bound model costs about the same for one new position or a few (chapter 2.6
measures it), so the target can score k guessed tokens for about the price of one step. Each round:

1. the draft proposes k tokens (a smaller model on its own cache, or prompt lookup: no model at all);
2. the target runs once on the last committed token + the k guesses: k + 1 positions, k + 1 next-token
   distributions;
3. ``accept_greedy`` / ``accept_sampled`` keep the longest prefix of guesses the target agrees with, plus
   one token of the target's own (the correction at the first rejection, or a bonus after k acceptances);
4. both caches forget the rejected positions (``KVCache.truncate``).

The output is exactly the target's: token for token the same greedy text as ``stream_generate``, and under
sampling the same distribution, through the rejection rule of Leviathan et al. 2023 and Chen et al. 2023
(accept a guess x with probability min(1, p(x) / q(x)), else draw from norm(max(0, p - q))).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .cache import KVCache
from .generate import TokenEvent, check_generation
from .sampling import SamplingParams, filtered_probs, sample
from .timing import now
from .validate import check_int, check_lengths

# --- the acceptance step ------------------------------------------------------------------------------

def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """The tokens a greedy round emits: the guesses while each is the target's argmax,
    then the target's own.

    draft_tokens: k guesses; target_logits (k + 1, V): row i is the target's next-token
    logits after the committed text + the first i guesses. Returns the n accepted
    guesses + 1 token (n in 0..k): the argmax of row n, a correction when guess n + 1
    was wrong, a bonus when all k were right.
    """
    best = target_logits.argmax(-1).tolist()  # (k + 1,) the target's own choices
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == best[n]:
        n += 1
    return draft_tokens[:n] + [best[n]]


def accept_sampled(draft_tokens: list[int], draft_probs: torch.Tensor,
                   target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> list[int]:
    """The tokens a sampled round emits, distributed exactly as the target would sample
    them one by one.

    draft_probs (k, V): q, the distribution each guess was drawn from; target_probs
    (k + 1, V): p, the target's. Guess i is accepted with probability
    min(1, p_i(x) / q_i(x)); at the first rejection the round ends with a draw from
    norm(max(0, p_i - q_i)), the mass where the target wants more than the draft gave;
    after k acceptances it ends with a bonus draw from p_k.
    """
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]  # (V,), (V,)
        u = torch.rand((), device=p.device, generator=generator)
        if u * q[token] < p[token]:  # u < p / q: accepted
            continue
        residual = (p - q).clamp(min=0)  # (V,): 0 wherever the draft gave enough
        if residual.sum() <= 0:  # p == q up to rounding: nothing is missing
            residual = p
        token = int(torch.multinomial(residual, 1, generator=generator))
        return draft_tokens[:i] + [token]  # the accepted guesses + the correction
    bonus = int(torch.multinomial(target_probs[-1], 1, generator=generator))
    return draft_tokens + [bonus]


def accept_round(guesses: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 sampling: SamplingParams, generator: torch.Generator | None = None) -> list[int]:
    """One round's acceptance step: ``accept_greedy`` when decoding greedily, else ``accept_sampled`` on the
    distributions ``sampling`` filters (temperature, top-k, top-p) from the target's logits (k + 1, V).
    ``draft_probs`` None under sampling: the guesses were certain (prompt lookup), each q one-hot."""
    if sampling.greedy:
        return accept_greedy(guesses, target_logits)
    if draft_probs is None:
        draft_probs = F.one_hot(torch.tensor(guesses, dtype=torch.long), target_logits.shape[-1]).float()  # (k, V)
    target_probs = filtered_probs(target_logits, sampling)  # (k + 1, V)
    return accept_sampled(guesses, draft_probs.to(target_probs.device), target_probs, generator)


# accept(guesses, draft_probs (k, V) or None, target_logits (k + 1, V), sampling, generator) -> emitted tokens
Accept = Callable[[list[int], torch.Tensor | None, torch.Tensor, SamplingParams, torch.Generator | None], list[int]]


# --- drafts -------------------------------------------------------------------------------------------

class Draft(Protocol):
    """What ``speculative_generate`` asks of a draft."""

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k guesses that follow ``context`` (every committed token), and under sampling the
        distributions they were drawn from, (len(guesses), V); None when greedy or when the guesses are
        certain (each q is one-hot)."""
        ...

    def rollback(self, length: int) -> None:
        """Forget everything past the first ``length`` tokens of the context."""
        ...


class ModelDraft:
    """A smaller (or cheaper: int4) model that guesses by decoding k tokens on its own KV cache.

    Its cache runs behind the committed context: ``fed`` tokens are in it. Each ``propose`` feeds what is
    missing in one call (one token, or two after a round that accepted every guess, whose last guess the
    draft never fed), then k - 1 single-token steps.
    """

    def __init__(self, model, max_len: int):
        self.model = model
        self.cache = KVCache(model.config, 1, max_len, model.device, model.dtype)
        self.fed = 0  # context tokens whose keys and values are in the cache
        self.calls = 0  # forward passes, for the statistics

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        if k == 0:
            return [], None
        tokens, probs = [], []
        new = torch.tensor([context[self.fed:]], device=self.model.device)  # (1, T): the missing tokens
        for _ in range(k):
            logits = self.model(new, cache=self.cache)[:, -1]  # (1, V)
            self.calls += 1
            if sampling.greedy:
                token = logits.argmax(-1)  # (1,)
            else:
                probs.append(filtered_probs(logits, sampling)[0])  # (V,)
                token = torch.multinomial(probs[-1], 1, generator=generator)  # (1,)
            tokens.append(int(token))
            new = token.view(1, 1)
        self.fed = len(context) + k - 1  # the context and every guess but the last
        return tokens, (torch.stack(probs) if probs else None)  # (k, V) under sampling

    def rollback(self, length: int) -> None:
        if length < self.fed:
            self.fed = length
            self.cache.truncate(length)


class PromptLookup:
    """Prompt lookup: no model. Find the context's last n tokens earlier in the context and guess the
    tokens that followed them there (n from ``max_ngram`` down to ``min_ngram``, the latest match first).

    It pays where the output copies the input (a summary, an edit, code); elsewhere it finds nothing and the
    round is a plain decode step. One repeated token is weak evidence: by default a match is 2 to 4 tokens.
    Its guesses are certain (q is one-hot), so it returns no distributions.
    """

    calls = 0  # no model, no forward passes

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        check_int("min_ngram", min_ngram, minimum=1)
        if check_int("max_ngram", max_ngram, minimum=1) < min_ngram:
            raise ValueError(f"max_ngram={max_ngram} is below min_ngram={min_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens: those that followed the latest earlier occurrence of the
        longest suffix of ``context`` that occurs earlier (``max_ngram`` .. ``min_ngram``
        tokens long); none when no suffix does."""
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest first
                if context[start:start + n] == suffix:
                    return context[start + n:start + n + k]
        return []

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        return self.lookup(context, k), None

    def rollback(self, length: int) -> None:
        pass  # it keeps nothing between rounds


# --- the loop -----------------------------------------------------------------------------------------

@dataclass
class SpeculativeStats:
    """What a speculative run did: per target call (round), how many guesses and how many were kept."""

    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verification call
    tokens: int = 0  # tokens the rounds emitted (all but the first; a round cut by EOS counts what it emitted)
    draft_calls: int = 0  # the draft model's forward passes (0 for prompt lookup)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.rounds)

    @property
    def judged(self) -> int:
        """Guesses the target ruled on: every accepted one and the first rejected one of each round (the
        guesses after a rejection are never looked at)."""
        return sum(a + (a < d) for d, a in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """a: the fraction of judged guesses accepted (nan before any), the per-guess probability that
        E[tokens per call] = (1 - a^(k+1)) / (1 - a) assumes."""
        return self.accepted / self.judged if self.judged else float("nan")

    @property
    def tokens_per_call(self) -> float:
        """Tokens emitted per verification call (accepted guesses + the target's own token)."""
        return self.tokens / len(self.rounds) if self.rounds else float("nan")


def speculative_generate(target, draft, prompt_ids: Sequence[int] | torch.Tensor, k: int, max_new_tokens: int,
                         sampling: SamplingParams | None = None, eos_token_id: int | None = None,
                         seed: int | None = None, stats: SpeculativeStats | None = None,
                         accept: Accept = accept_round) -> Iterator[TokenEvent]:
    """Yield the target's tokens as ``TokenEvent``s, drafted k at a time and verified in one call each.

    ``draft``: a model with the target's vocabulary (its own KV cache is made here) or a ``PromptLookup``.
    Greedy output is ``generate``'s token for token; sampled output has its distribution. Stops after EOS
    (yielded) or ``max_new_tokens``; a round never guesses past either limit. The tokens of one round are
    stamped with one time: they arrive together. ``stats`` (optional) collects the acceptance figures.
    ``accept``: the acceptance step (``accept_round``'s signature), replaceable to try another rule.
    """
    ids, sampling = check_generation(target, prompt_ids, max_new_tokens, sampling, eos_token_id, seed)  # (1, T)
    check_int("k", k, minimum=1)
    vocab_size = target.config.vocab_size
    max_len = ids.shape[1] + max_new_tokens
    if not isinstance(draft, PromptLookup):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                             f"({vocab_size}): its guesses would be other tokens")
        check_lengths(ids.shape[1], max_new_tokens, draft.config.max_seq_len, "the draft's max_seq_len")
        draft = ModelDraft(draft, max_len)
    cache = KVCache(target.config, 1, max_len, target.device, target.dtype)
    stats = SpeculativeStats() if stats is None else stats
    return _speculate(target, draft, ids, k, max_new_tokens, cache, sampling, eos_token_id, seed, stats, accept)


@torch.inference_mode()
def _speculate(target, draft: Draft, ids: torch.Tensor, k: int, max_new_tokens: int, cache: KVCache,
               sampling: SamplingParams, eos_token_id: int | None, seed: int | None,
               stats: SpeculativeStats, accept: Accept) -> Iterator[TokenEvent]:
    """The loop behind speculative_generate. The target's cache holds every committed token but the last."""
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    token = int(sample(target(ids, cache=cache)[:, -1], sampling, generator))  # prefill: the first token
    context = ids[0].tolist() + [token]
    yield TokenEvent(token, 0, "prefill", now(device))
    emitted = 1
    while token != eos_token_id and emitted < max_new_tokens:
        n_guess = min(k, max_new_tokens - emitted - 1)  # a round emits at most n_guess + 1 tokens
        guesses, draft_probs = draft.propose(context, n_guess, sampling, generator)
        fed = len(context) - 1  # what the target's cache holds
        new = torch.tensor([context[-1:] + guesses], device=device)  # (1, 1 + n): last token + guesses
        logits = target(new, cache=cache)[0]  # (1 + n, V): row i follows the context + i guesses
        out = accept(guesses, draft_probs, logits, sampling, generator)
        accepted = len(out) - 1
        cache.truncate(fed + 1 + accepted)  # the last token and the kept guesses; not the new token
        draft.rollback(fed + 1 + accepted)
        stats.rounds.append((len(guesses), accepted))
        stats.draft_calls = draft.calls
        stamp = now(device)
        for token in out:
            stats.tokens += 1
            yield TokenEvent(token, emitted, "decode", stamp)
            emitted += 1
            if token == eos_token_id:
                return
        context += out


def generate_speculative(target, draft, prompt_ids, k: int, max_new_tokens: int, **kwargs) -> list[int]:
    """The new token ids of ``speculative_generate`` (EOS included when it ends the run)."""
    return [e.token_id for e in speculative_generate(target, draft, prompt_ids, k, max_new_tokens, **kwargs)]
