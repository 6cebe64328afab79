"""The bandwidth law as pictures: tokens/s against bytes per step with the bound a memory
system sets, and the bandwidth a kernel achieves on a fixed weight.

Both take measured numbers (bytes, seconds) and draw them; nothing here measures.
"""
from __future__ import annotations

import numpy as np

from ...validate import check_number


def _check_measured(label: str, pairs: dict[str, tuple[float, float]], units: tuple[str, str],
                    bandwidth: float) -> None:
    """``pairs`` (name -> two numbers, named ``units``) is not empty, and each number and
    ``bandwidth`` are finite and > 0."""
    if not pairs:
        raise ValueError(f"{label} is empty; give at least one ({units[0]}, {units[1]})")
    check_number("bandwidth", bandwidth)
    for name, (first, second) in pairs.items():
        check_number(f"{name} {units[0]}", first)
        check_number(f"{name} {units[1]}", second)


LABEL_CLEARANCE = 0.1  # decades: a point this close to one labelled on its right gets its label on the left


def plot_bandwidth_law(ax, points: dict[str, tuple[float, float]], bandwidth: float,
                       title: str = "Decode speed follows the bytes per step",
                       cache_bytes: float | None = None, quoted: tuple[str, ...] = ()) -> None:
    """``points``: variant -> (bytes per step, tokens/s). Draws each variant, labelled with its
    tokens/s, and the bound tokens/s = bandwidth / bytes, on log-log axes (MB and tokens/s).

    A point whose bytes fit in ``cache_bytes`` (the last-level cache) is drawn hollow and
    marked "in cache": the bound does not hold for it. Names in ``quoted`` are numbers not
    measured on this run, drawn as crosses and marked "quoted". A point within
    ``LABEL_CLEARANCE`` of one labelled on its right is labelled on its left.
    """
    _check_measured("points", points, ("bytes per step", "tokens/s"), bandwidth)
    sizes = np.array([b for b, _ in points.values()], dtype=float)
    span = np.geomspace(sizes.min() / 2, sizes.max() * 2, 50)  # bytes
    ax.plot(span / 1e6, bandwidth / span, "k--", lw=1.2,
            label=f"bound: {bandwidth / 1e9:.1f} GB/s / bytes per step")
    labelled_right = []  # (log10 MB, log10 tokens/s) of the points labelled on their right
    for name, (step_bytes, speed) in points.items():
        in_cache = cache_bytes is not None and step_bytes <= cache_bytes
        marker = "x" if name in quoted else "o"
        note = " (quoted)" if name in quoted else " (in cache)" if in_cache else ""
        line, = ax.plot(step_bytes / 1e6, speed, marker, ms=8, label=name + note,
                        mfc="none" if in_cache else None)
        at = np.log10([step_bytes / 1e6, speed])
        crowded = any(np.abs(at - other).max() < LABEL_CLEARANCE for other in labelled_right)
        if not crowded:
            labelled_right.append(at)
        ax.annotate(f"{speed:.0f}", (step_bytes / 1e6, speed), textcoords="offset points",
                    xytext=(-6, 4) if crowded else (6, 4), ha="right" if crowded else "left",
                    fontsize=9, color=line.get_color())
    ax.set(xscale="log", yscale="log",
           xlabel="bytes read per decode step (MB, log scale)",
           ylabel="decode speed (tokens/s, log scale)", title=title)
    ax.legend(loc="upper right", fontsize=9)


def plot_kernel_bandwidth(ax, kernels: dict[str, tuple[float, float]], bandwidth: float,
                          title: str = "One weight, read at different speeds",
                          cache_bytes: float | None = None) -> None:
    """``kernels``: name -> (bytes of the weight it reads, seconds per call). Bars of the
    achieved bandwidth (bytes / seconds, GB/s), each labelled with its value, the measured
    read bandwidth as a dashed line. A kernel whose bytes fit in ``cache_bytes`` (the
    last-level cache) may read them from the cache when called again: its bar is hatched
    and its name marked "in cache"."""
    _check_measured("kernels", kernels, ("bytes", "seconds"), bandwidth)
    names = list(kernels)[::-1]  # the first kernel on top
    achieved = [kernels[n][0] / kernels[n][1] / 1e9 for n in names]
    colors = [f"C{i}" for i in range(len(names))][::-1]
    in_cache = [cache_bytes is not None and kernels[n][0] <= cache_bytes for n in names]
    labels = [n + " (in cache)" if cached else n for n, cached in zip(names, in_cache)]
    bars = ax.barh(labels, achieved, color=colors,
                   hatch=["//" if cached else "" for cached in in_cache])
    ax.bar_label(bars, labels=[f"{a:.1f}" for a in achieved], padding=3, fontsize=9)
    ax.axvline(bandwidth / 1e9, color="k", ls="--", lw=1.2,
               label=f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    ax.set(xlabel="weight bytes / time of one call (GB/s)", title=title)
    ax.legend(loc="lower right", fontsize=9)
