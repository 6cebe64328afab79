"""Plots of autoregressive generation (chapter 2.1): how many tokens a sampler's cut keeps, and how a
generation's FLOPs divide between prefill and decode.

Both take data the chapter computed (distributions, FLOP shares) and only draw it.
"""
from __future__ import annotations

import numpy as np
import torch

from ...validate import check_int, check_number
from . import axes_or_new


def nucleus_size(probs: torch.Tensor, top_p: float) -> int:
    """Tokens top-p keeps from ``probs`` (V,): the most likely ones until their mass reaches ``top_p``
    (the token that crosses it included), as ``minillm.filtered_probs`` keeps them."""
    check_number("top_p", top_p, maximum=1)
    if probs.dim() != 1:
        raise ValueError(f"probs has shape {tuple(probs.shape)}; give one distribution (V,)")
    ranked = probs.float().sort(descending=True).values  # (V,), most likely first
    before = ranked.cumsum(0) - ranked  # (V,): the mass of the strictly more likely tokens
    return max(1, int((before < top_p).sum()))


def draw_nucleus(probs: dict[str, torch.Tensor], top_p: float, top_k: int, ax=None,
                 title: str | None = None):
    """Cumulative probability of the r most likely tokens against r (log axis, every rank of the
    vocabulary), one line per distribution, with the top-p mass and the top-k rank marked.

    ``probs``: label -> an uncut distribution (V,), e.g. the softmax at one temperature. Each line's
    point where top-p stops (``nucleus_size``) is marked and labelled. Returns the axes; the lines
    have gids ``"mass-<label>"``, the marks ``"nucleus-<label>"``.
    """
    check_int("top_k", top_k)
    ax = axes_or_new(ax, (7.5, 4.2))
    vocab = None
    for label, p in probs.items():
        mass = p.float().sort(descending=True).values.cumsum(0).clamp(max=1).cpu().numpy()  # (V,)
        vocab = len(mass)
        ranks = np.arange(1, vocab + 1)
        line, = ax.plot(ranks, mass, label=label, gid=f"mass-{label}")
        kept = nucleus_size(p, top_p)
        ax.plot([kept], [mass[kept - 1]], "o", color=line.get_color(), markersize=7,
                gid=f"nucleus-{label}")
        ax.annotate(f"top-p {top_p:g} keeps {kept:,}", (kept, mass[kept - 1]),
                    xytext=(8, -16), textcoords="offset points", color=line.get_color(),
                    fontsize=10)
    ax.axhline(top_p, color="0.4", linestyle="--", linewidth=1, label=f"top-p mass {top_p:g}")
    ax.axvline(top_k, color="0.4", linestyle=":", linewidth=1.2, label=f"top-k {top_k}: rank {top_k}")
    ax.set(xscale="log", xlim=(1, vocab), ylim=(0, 1.02),
           xlabel=f"rank r (1 = most likely; the vocabulary has {vocab:,} tokens)",
           ylabel="probability of the r most\nlikely tokens (cumulative)")
    ticks = [t for t in (1, 10, 100, 1000, 10_000, 100_000) if t < vocab]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.legend(loc="lower right")
    ax.set_title(title or "How many tokens each cut keeps")
    return ax


def draw_decode_share(curves: dict[str, tuple], marks: dict[str, tuple], threshold: float = 0.98,
                      ax=None, title: str | None = None):
    """Decode's share of a generation's FLOPs against T / (N - 1), the prompt length over the number
    of decode steps (log axis), with the share of token positions, 1 / (1 + T / (N - 1)), drawn
    under the curves and the ``threshold`` share marked.

    ``curves``: label -> (x values, shares); ``marks``: label -> (x, share), a request to point at.
    Returns the axes; the positions curve has gid ``"positions"``, the marks ``"mark-<label>"``.
    """
    check_number("threshold", threshold)
    ax = axes_or_new(ax, (7.5, 4.2))
    xs = np.concatenate([np.asarray(x, dtype=float) for x, _ in curves.values()]
                        + [np.array([x for x, _ in marks.values()], dtype=float)])
    grid = np.geomspace(xs.min(), xs.max(), 200)
    ax.plot(grid, 100 / (1 + grid), color="black", linewidth=5, alpha=0.18,
            label="share of token positions", gid="positions")
    for (label, (x, share)), style in zip(curves.items(), ("-", "--", "-.", ":") * 4):
        ax.plot(x, 100 * np.asarray(share, dtype=float), style, linewidth=1.4, label=label)
    ax.axhline(100 * threshold, color="0.2", linewidth=1, label=f"{threshold:.0%}")
    ax.axvline(1 / threshold - 1, color="0.2", linewidth=1, linestyle=":")
    for label, (x, share) in marks.items():
        ax.plot([x], [100 * share], "o", color="black", markersize=6, gid=f"mark-{label}")
        ax.annotate(label, (x, 100 * share), xytext=(7, 4), textcoords="offset points", fontsize=10)
    ax.set(xscale="log", ylim=(0, 103), xlabel="prompt length / decode steps, T / (N - 1)",
           ylabel="decode share of the FLOPs (%)")
    ax.legend(loc="lower left", fontsize=9)
    ax.set_title(title or "Decode's share of the FLOPs is set by T / (N - 1)")
    return ax
