"""A step's tokens from its logits (the greedy rows in one argmax, each other row with its own generator), and
the log-probs of the requests that ask."""
from __future__ import annotations

import torch

from ..sampling import sample
from .request import Sequence, TokenLogprob


def sample_rows(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """One token per row of ``logits`` (n, vocab), for ``seqs[i]``, with one host sync.

    The greedy rows take the batch's argmax. A sampled row draws on its own, from its request's own
    generator, so that its tokens do not depend on who shares its batch (a batched draw would take every
    row from one random stream). ``sample`` is total: any logits give a token of the vocabulary."""
    tokens = logits.argmax(-1)  # (n,)
    for i, seq in enumerate(seqs):
        if not seq.request.sampling.greedy:
            tokens[i] = sample(logits[i:i + 1], seq.request.sampling, seq.generator)[0]
    return tokens.tolist()


def requested_logprobs(seqs: list[Sequence], logits: torch.Tensor,
                       tokens: list[int]) -> list[list[TokenLogprob] | None]:
    """Per row of ``logits`` (n, vocab): its token's ``TokenLogprob`` in a list if ``seqs[i]`` asks for log-probs
    (``Request.logprobs``), else None."""
    return [None if s.request.logprobs is None else [token_logprobs(row, token, s.request.logprobs)]
            for s, row, token in zip(seqs, logits, tokens)]


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-prob and the ``k`` most likely tokens' under the raw distribution ``logits`` (V,) stand
    for (before temperature, top-k, top-p: vLLM's default), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (V,)
    top = torch.topk(logprobs, min(k, logprobs.numel()))  # sorted, most likely first
    return TokenLogprob(token, float(logprobs[token]), list(zip(top.indices.tolist(), top.values.tolist())))
