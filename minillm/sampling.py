"""Turning next-token logits into a token: greedy, temperature, top-k, top-p.

``SamplingParams`` needs no torch (the request types and the bench client use it); the functions that sample
import it when called.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .validate import check_int, check_number

if TYPE_CHECKING:
    import torch

# The smallest temperature that is sampled; below it float32's logits / temperature overflows (NaN in the
# softmax), and sampling would be greedy anyway: every non-tied logit but the largest gets probability 0.
MIN_TEMPERATURE = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, the smallest normal float32


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (so does any temperature below ``MIN_TEMPERATURE``, too small to divide by
    in float32); top_k 0 means no top-k cut; top_p 1.0 means no nucleus cut (and any top_p keeps the most
    likely token)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, inclusive=True, hint="0 means greedy")
        check_int("top_k", self.top_k, minimum=0, hint="0 disables top-k")
        check_number("top_p", self.top_p, maximum=1, hint="1 disables top-p")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from: logits (B, V) -> probabilities (B, V).

    In float32. Temperature divides the logits; top-k keeps the k largest (and any tied
    with the k-th); top-p keeps the smallest set of most likely tokens whose mass reaches
    p (the token that crosses p is kept, and the most likely token always is). Greedy (a
    temperature below ``MIN_TEMPERATURE``) puts all the mass on the argmax. Every row sums
    to 1: a row the arithmetic cannot make a distribution of (NaN or +inf logits, or every
    logit -inf) falls back to the argmax's one-hot.
    """
    import torch

    logits = logits.float()
    if params.greedy:
        return _one_hot_argmax(logits)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # Shift the largest logit to 0 before dividing: the scaled logits lie in
    # [-inf, 0], so a small temperature can only push unlikely tokens to -inf
    # (probability 0), never to +inf.
    shifted = logits - logits.amax(-1, keepdim=True)
    probs = torch.softmax(shifted / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # the mass of the strictly more likely tokens
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # top_p=1e-300 is 0.0 in float32: that alone would drop all
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    finite = torch.isfinite(probs).all(-1, keepdim=True)
    bad = ~finite | (probs.sum(-1, keepdim=True) <= 0)
    # no `if bad.any()`: that would sync a GPU
    return torch.where(bad, _one_hot_argmax(logits), probs)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """All the mass on the largest logit (NaN counts as the smallest; a row of all -inf picks token 0)."""
    import torch

    safe = torch.nan_to_num(logits, nan=float("-inf"))
    return torch.nn.functional.one_hot(safe.argmax(-1), logits.shape[-1]).float()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    import torch

    if params.greedy:
        return logits.argmax(-1)
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
