"""Request timelines from a real run's timestamps: one request with TTFT, ITL, TPOT and E2E marked,
and several requests side by side. Every latency comes from :mod:`minillm.analysis.metrics`.

A request is anything ``minillm.analysis.metrics`` accepts (``arrival_time``, ``token_times`` in seconds):
an engine's ``RequestRecord`` or a ``RequestTiming``. The figures show milliseconds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...analysis import metrics
from . import axes_or_new

MS = 1e3  # milliseconds per second
COLORS = {"queue": "0.75", "prefill": "tab:orange", "decode": "tab:blue", "arrival": "tab:green"}


@dataclass(frozen=True)
class TimelineMarks:
    """Where one request's marks go, in seconds on the run's clock."""

    arrival: float
    admitted: float | None  # its prefill began here, when known: TTFT = queue + prefill
    token_times: tuple[float, ...]  # first token ... last token (the finish)
    ttft: float
    tpot: float | None  # None for a one-token request
    itls: tuple[float, ...]  # the n - 1 gaps
    e2e: float

    @property
    def finish(self) -> float:
        return self.token_times[-1]


def timeline_marks(request, admitted: float | None = None) -> TimelineMarks:
    """The marks of ``request``'s timeline; ``admitted`` (s) must lie between arrival and first token."""
    ttft = metrics.ttft(request)  # checks the timestamps; a request without tokens is a ValueError
    arrival, times = float(request.arrival_time), tuple(float(t) for t in request.token_times)
    if admitted is not None and not arrival <= admitted <= times[0]:
        raise ValueError(f"admitted={admitted} s must lie between the arrival ({arrival} s) and the "
                         f"first token ({times[0]} s)")
    return TimelineMarks(arrival, admitted, times, ttft, metrics.tpot(request),
                         tuple(metrics.itls(request)), metrics.e2e_latency(request))


def _pad_left(ax, start: float, end: float) -> None:
    """Room before the first arrival, so its marker is not cut by the axis."""
    pad = 0.03 * (end - start) or 1.0
    ax.set_xlim(start - pad, end + pad)


def _bracket(ax, x0: float, x1: float, y: float, text: str, below: bool = False) -> None:
    """A double-headed arrow from x0 to x1 at height y, labelled in its middle."""
    ax.annotate("", xy=(x1, y), xytext=(x0, y),
                arrowprops=dict(arrowstyle="<|-|>", color="k", lw=1.2, shrinkA=0, shrinkB=0,
                                mutation_scale=8))
    ax.text((x0 + x1) / 2, y - 0.12 if below else y + 0.1, text, ha="center",
            va="top" if below else "bottom")


def draw_request(request, ax=None, admitted: float | None = None,
                 token_labels: Sequence[str] | None = None, title: str | None = None):
    """One request's timeline: arrival, (queue,) prefill, every token, finish, and the brackets of
    TTFT, one ITL, TPOT and E2E. ``token_labels``: one string per token, written above its tick.

    Returns the axes. The token ticks are the collection with gid ``"tokens"``.
    """
    m = timeline_marks(request, admitted)
    n = len(m.token_times)
    if token_labels is not None and len(token_labels) != n:
        raise ValueError(f"{len(token_labels)} token labels for {n} tokens; give one per token")
    ax = axes_or_new(ax, (7.5, 3.9))
    x = [t * MS for t in m.token_times]
    x_arrival = m.arrival * MS
    start = x_arrival if m.admitted is None else m.admitted * MS
    if m.admitted is not None and start > x_arrival:
        ax.barh(0, start - x_arrival, left=x_arrival, height=0.3, color=COLORS["queue"],
                label="waiting in the queue")
    ax.barh(0, x[0] - start, left=start, height=0.3, color=COLORS["prefill"], label="prefill")
    ax.barh(0, x[-1] - x[0], left=x[0], height=0.12, color=COLORS["decode"], label="decode")
    ticks = ax.vlines(x, -0.28, 0.28, color="k", lw=1.6, label="an output token")
    ticks.set_gid("tokens")
    ax.plot([x_arrival], [0], ">", ms=11, color=COLORS["arrival"], label="arrival", zorder=3)
    if token_labels is not None:
        for xi, label in zip(x, token_labels):
            ax.text(xi, 0.36, label, rotation=50, ha="left", va="bottom", fontsize=9.5)
    for xi in (x_arrival, x[0], x[-1]):  # guide lines down to the brackets
        ax.plot([xi, xi], [-0.3, -2.25], ls=":", color="0.45", lw=0.9)
    _bracket(ax, x_arrival, x[0], -0.7, f"TTFT {m.ttft * MS:.0f} ms")
    if m.itls:
        gap = max(range(n - 1), key=lambda i: (m.itls[i], i))  # the longest gap, the last of equals
        _bracket(ax, x[gap], x[gap + 1], -0.7, f"ITL {m.itls[gap] * MS:.0f} ms")
        tpot_text = f"TPOT = mean of the {n - 1} gaps = {m.tpot * MS:.1f} ms"
        _bracket(ax, x[0], x[-1], -1.45, tpot_text)
    _bracket(ax, x_arrival, x[-1], -2.2, f"E2E {m.e2e * MS:.0f} ms")
    ax.set_ylim(-2.5, 1.6 if token_labels is not None else 0.8)
    _pad_left(ax, x_arrival, x[-1])
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.grid(False)
    ax.set_xlabel("time since the start of the run (ms)")
    ax.legend(loc="upper left", ncols=3, frameon=False, bbox_to_anchor=(0, -0.22))
    ax.set_title(title or "One request: TTFT, ITL, TPOT and E2E from its timestamps")
    return ax


def draw_requests(requests: Sequence, ax=None, title: str | None = None):
    """Several requests, one row each (request 0 on top): arrival, TTFT (queue + prefill), decode,
    and a tick per token. Returns the axes; row i's token ticks have gid ``"tokens-i"``."""
    marks = [timeline_marks(r) for r in requests]
    if not marks:
        raise ValueError("draw_requests needs at least one request")
    ax = axes_or_new(ax, (7.5, 1.2 + 0.45 * len(marks)))
    for i, m in enumerate(marks):
        x = [t * MS for t in m.token_times]
        first = i == 0
        ax.barh(i, x[0] - m.arrival * MS, left=m.arrival * MS, height=0.5, color=COLORS["prefill"],
                alpha=0.7, label="TTFT (queue + prefill)" if first else None)
        ax.barh(i, x[-1] - x[0], left=x[0], height=0.14, color=COLORS["decode"],
                label="decode" if first else None)
        ax.vlines(x, i - 0.3, i + 0.3, color="k", lw=1.2,
                  label="token (each gap is one ITL)" if first else None).set_gid(f"tokens-{i}")
        ax.plot([m.arrival * MS], [i], ">", ms=9, color=COLORS["arrival"], zorder=3,
                label="arrival" if first else None)
    _pad_left(ax, min(m.arrival for m in marks) * MS, max(m.finish for m in marks) * MS)
    ax.set_yticks(range(len(marks)), [str(getattr(r, "request_id", i)) for i, r in enumerate(requests)])
    ax.set_ylim(len(marks) - 0.4, -0.6)  # request 0 on top
    ax.set_ylabel("request")
    ax.set_xlabel("time since the start of the run (ms)")
    ax.legend(loc="upper left", ncols=2, frameon=False, bbox_to_anchor=(0, -0.25))
    ax.set_title(title or "Requests over time: arrival, TTFT, decode, tokens")
    return ax
