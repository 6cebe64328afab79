"""Turning next-token logits into a token: greedy, temperature, top-k, top-p."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .validate import check_int, check_number


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means no top-k cut; top_p 1.0 means no nucleus cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, inclusive=True, hint="0 means greedy")
        check_int("top_k", self.top_k, minimum=0, hint="0 disables top-k")
        check_number("top_p", self.top_p, maximum=1, hint="1 disables top-p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from: logits (B, V) -> probabilities (B, V).

    In float32. Temperature divides the logits; top-k keeps the k largest (and any tied
    with the k-th); top-p keeps the smallest set of most likely tokens whose mass reaches
    p (the token that crosses p is kept). Greedy puts all the mass on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # the mass of the strictly more likely tokens
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
