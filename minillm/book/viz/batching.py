"""Static against continuous batching, drawn from an engine run's own records; the KV pool over steps.

The picture is the batch as a row of slots over engine steps: each request occupies one slot from
the step of its prefill to the step of its last token. A static batch keeps a finished request's row
(as padding) until its slowest member ends; a continuous batch refills the slot at the next step.
Everything comes from a ``minillm.engine.RunResult``: which step produced each token (from the token
and step times), and the per-step counts of running and padding rows, against which the spans are
checked. The pool picture is the physical KV blocks over engine steps, coloured by the request whose
block table holds each block after each step (tables read from a running engine, step by step).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...validate import check_int
from . import axes_or_new
from .kv import REQUEST_COLORS, check_block_table

COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "padding": "0.8"}


@dataclass(frozen=True)
class SlotSpan:
    """Steps ``first_step .. last_step`` (inclusive, 0-based) in which a request holds ``slot``.

    ``kind`` is "busy" (it gets a token every step; its first step is a prefill) or "padding" (a
    static batch's finished row, still computed, its output thrown away).
    """

    request_id: int | str
    slot: int
    first_step: int
    last_step: int
    kind: str

    @property
    def n_steps(self) -> int:
        return self.last_step - self.first_step + 1


def token_steps(result) -> dict:
    """Request id -> the engine step (0-based) that produced each of its output tokens.

    A token belongs to the first step that ends at or after its time stamp (the engine stamps the
    tokens of a step before it records the step's end).
    """
    ends = [step.time for step in result.steps]
    found = {}
    for record in result.requests:
        steps = [bisect_left(ends, t) for t in record.token_times]
        if steps and steps[-1] >= len(ends):
            raise ValueError(f"request {record.request_id!r} has a token at {record.token_times[-1]} s, "
                             f"after the last step ends ({ends[-1] if ends else 'no steps'} s)")
        found[record.request_id] = steps
    return found


def ttft_steps(result) -> dict:
    """Request id -> the engine steps from its arrival to its first token, that step included:
    a TTFT counted in steps (1: admitted and prefilled in the first step after it arrived), the
    same on every machine. Steps that ended at or before the arrival are not counted."""
    ends = [step.time for step in result.steps]
    first = token_steps(result)
    return {r.request_id: first[r.request_id][0] - bisect_right(ends, r.arrival_time) + 1
            for r in result.requests if r.token_times}


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive step indices: [3, 4, 5, 9, 10] -> [(3, 5), (9, 10)]."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


def slot_spans(result, n_slots: int) -> list[SlotSpan]:
    """The busy and padding spans of every request, each placed in the lowest free slot.

    Checked against the step records: in every step the busy spans number ``n_running`` and the
    padding spans ``n_padding`` (a mismatch raises ValueError), and at most ``n_slots`` are held.
    """
    check_int("n_slots", n_slots)
    busy = [(rid, a, b) for rid, steps in token_steps(result).items() for a, b in _runs(steps)]
    n_padding = [step.n_padding for step in result.steps]
    if any(n_padding):  # static: a finished row stays until the last member of its batch ends
        batch_end = {}
        for _, a, b in busy:
            batch_end[a] = max(batch_end.get(a, b), b)
        held = [(rid, a, b, batch_end[a]) for rid, a, b in busy]
    else:
        held = [(rid, a, b, b) for rid, a, b in busy]
    _check_counts(result, held)
    free_from = [0] * n_slots  # the first step at which each slot is free again
    spans = []
    for rid, a, b, end in sorted(held, key=lambda h: (h[1], h[3])):
        slot = next((i for i, f in enumerate(free_from) if f <= a), None)
        if slot is None:
            raise ValueError(f"step {a} needs more than n_slots={n_slots} slots; "
                             "pass the engine's max_batch_size")
        free_from[slot] = end + 1
        spans.append(SlotSpan(rid, slot, a, b, "busy"))
        if end > b:
            spans.append(SlotSpan(rid, slot, b + 1, end, "padding"))
    return spans


def _check_counts(result, held) -> None:
    """Busy and padding rows per step, as derived from the request records, equal the step records."""
    n = len(result.steps)
    busy, padding = [0] * (n + 1), [0] * (n + 1)  # difference arrays
    for _, a, b, end in held:
        busy[a] += 1
        busy[b + 1] -= 1
        padding[b + 1] += 1
        padding[end + 1] -= 1
    n_busy = n_pad = 0
    for i, step in enumerate(result.steps):
        n_busy, n_pad = n_busy + busy[i], n_pad + padding[i]
        if (n_busy, n_pad) != (step.n_running, step.n_padding):
            raise ValueError(f"step {i}: the request records give {n_busy} running and {n_pad} padding "
                             f"rows, the step record {step.n_running} and {step.n_padding}")


def draw_batching_timeline(result, n_slots: int, ax=None, title: str | None = None):
    """One run as slots (rows) over engine steps: prefill step, decode steps, padding. Returns ax.

    Each slot's bars of one kind are one collection whose gid is the kind ("prefill", "decode",
    "padding"); a request that holds a slot for 12 steps or more is labelled with its id.
    """
    spans = slot_spans(result, n_slots)
    ax = axes_or_new(ax, (7.5, 3.2))
    bars = {"prefill": [], "decode": [], "padding": []}
    for span in spans:
        if span.kind == "padding":
            bars["padding"].append((span.slot, span.first_step, span.n_steps))
            continue
        bars["prefill"].append((span.slot, span.first_step, 1))
        if span.n_steps > 1:
            bars["decode"].append((span.slot, span.first_step + 1, span.n_steps - 1))
        if span.n_steps >= 12:
            ax.text(span.first_step + span.n_steps / 2, span.slot, str(span.request_id), ha="center",
                    va="center", color="white", fontsize=9)
    labels = {"prefill": "prefill step", "decode": "decode steps",
              "padding": "padding (finished, still in the batch)"}
    for kind, rows in bars.items():
        if not rows:
            continue
        for slot in sorted({r[0] for r in rows}):
            ranges = [(x, w) for s, x, w in rows if s == slot]
            collection = ax.broken_barh(ranges, (slot - 0.4, 0.8), facecolors=COLORS[kind],
                                        edgecolor="white", linewidth=0.6, label=labels[kind])
            collection.set_gid(kind)
            labels[kind] = "_nolegend_"  # one legend entry per kind
    ax.set(xlim=(0, len(result.steps)), ylim=(n_slots - 0.5, -0.5), yticks=range(n_slots),
           xlabel="engine step", ylabel="batch slot")
    ax.grid(False)
    if title is not None:
        ax.set_title(title)
    return ax


def draw_batching_comparison(runs: Mapping[str, object], n_slots: int,
                             titles: Mapping[str, str] | None = None):
    """Runs (label -> RunResult) stacked on one step axis, with one legend. Returns the figure."""
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs is empty; give at least one label -> RunResult")
    fig, axes = plt.subplots(len(runs), 1, figsize=(7.5, 2.2 + 1.9 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (label, result) in zip(axes[:, 0], runs.items()):
        draw_batching_timeline(result, n_slots, ax, (titles or {}).get(label, label))
    steps = max(len(result.steps) for result in runs.values())
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    axes[0, 0].set_xlim(0, steps)
    handles = {}
    for ax in axes[:, 0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))  # label -> handle
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3, frameon=False)
    return fig


SHARED = "shared"  # a block in two or more tables at once (a cached prefix)


def pool_owners(tables: Sequence[Mapping[str, Sequence[int]]], num_blocks: int) -> list[list]:
    """Per step, the holder of every physical block: a request, ``SHARED`` or None (free).

    ``tables[i]``: request -> its block table after step i. A block id outside ``[0, num_blocks)``
    or listed twice in one table is an error.
    """
    check_int("num_blocks", num_blocks)
    owners = []
    for i, step in enumerate(tables):
        row = [None] * num_blocks
        for name, table in step.items():
            check_block_table(f"step {i}: request {name!r}", table, num_blocks)
            for block in table:
                row[block] = name if row[block] is None else SHARED
        owners.append(row)
    return owners


def draw_pool_timeline(tables: Sequence[Mapping[str, Sequence[int]]], num_blocks: int,
                       marks: Mapping[int, str] | None = None, ax=None, title: str | None = None):
    """Physical blocks (rows) over engine steps, coloured by the request that holds each. Returns ax.

    ``tables[i]``: request -> block table after step i (see ``pool_owners``); requests take the
    colours of ``minillm.book.viz.kv.draw_block_tables`` in order of first appearance. ``marks``: step ->
    label, drawn as a dashed vertical line (e.g. the steps that preempted). Each request's bars are
    one collection per block row, with gid ``"hold-<request>-<block>"``.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    owners = pool_owners(tables, num_blocks)
    names = list(dict.fromkeys(name for step in tables for name in step))
    colors = {name: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, name in enumerate(names)}
    colors[SHARED] = "0.3"
    ax = axes_or_new(ax, (7.5, 3.6))
    for block in range(num_blocks):
        held: dict[str, list[int]] = {}  # holder -> the steps after which it holds this block
        for step, row in enumerate(owners):
            if row[block] is not None:
                held.setdefault(row[block], []).append(step)
        for holder, steps in held.items():
            spans = [(a, b - a + 1) for a, b in _runs(steps)]  # (first step, n steps)
            ax.broken_barh(spans, (block - 0.4, 0.8), facecolors=colors[holder]).set_gid(
                f"hold-{holder}-{block}")
    shown = names + ([SHARED] if any(SHARED in row for row in owners) else [])
    handles = [Patch(facecolor=colors[name], label=str(name)) for name in shown]
    for step in marks or {}:
        ax.axvline(step, color="k", linestyle="--", linewidth=1)
    for label in dict.fromkeys((marks or {}).values()):
        handles.append(Line2D([], [], color="k", linestyle="--", linewidth=1, label=label))
    ax.set(xlim=(0, len(tables)), ylim=(num_blocks - 0.5, -0.5), xlabel="engine step",
           ylabel="physical KV block")
    ax.set_yticks(range(num_blocks))
    ax.grid(False)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    if title is not None:
        ax.set_title(title)
    return ax
