"""KV-cache figures: a contiguous cache filling up over decode steps, the time of naive and cached
steps, a cached step against the context it reads, memory against concurrency, and a paged pool whose
block tables map each request's logical blocks to physical blocks.

Each takes plain data (cache lengths, step times, byte counts, block tables), so a chapter draws it from
a real run: the lengths a ``KVCache`` reports after each forward pass, the times it measured, or the
tables a ``BlockManager`` hands out.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...validate import check_int
from . import axes_or_new

STATE_COLORS = {"read": "tab:blue", "written": "tab:orange", "empty": "0.93"}
STATE_LABELS = {"read": "read (written earlier)", "written": "written now, then read",
                "empty": "allocated, still empty"}
PATH_COLORS = {"naive": "tab:red", "cached": "tab:blue"}
REQUEST_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink",
                  "tab:olive", "tab:cyan"]


# --- a contiguous cache over decode steps ---------------------------------------------------------

def growth_states(lengths: Sequence[int], max_len: int) -> list[list[str]]:
    """For each forward pass (prefill first), the state of every cache position 0 .. max_len-1.

    ``lengths[i]``: positions the cache holds after pass i (strictly increasing). Pass i writes
    positions ``lengths[i-1] .. lengths[i]-1`` ("written"), reads every earlier one ("read") and
    leaves the rest of the allocation untouched ("empty").
    """
    check_int("max_len", max_len)
    lengths = [check_int("length", n) for n in lengths]
    if not lengths:
        raise ValueError("lengths is empty; give the cache length after each forward pass")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths={lengths} must increase strictly: every pass writes a position")
    if lengths[-1] > max_len:
        raise ValueError(f"the cache reaches {lengths[-1]} positions, more than max_len={max_len}")
    rows, before = [], 0
    for n in lengths:
        rows.append(["read" if p < before else "written" if p < n else "empty" for p in range(max_len)])
        before = n
    return rows


def _token_label(text: str) -> str:
    shown = text.replace("\n", "\\n").strip()
    return shown if shown else "␣"


def draw_kv_growth(lengths: Sequence[int], max_len: int, tokens: Sequence[str] | None = None,
                   bytes_per_token: int | None = None, ax=None, title: str | None = None):
    """One row per forward pass, one cell per cache position: what the pass writes, what it reads.

    ``tokens``: a label per position (at most ``max_len``), shown above the columns.
    ``bytes_per_token``: K and V of one position in all layers; the right margin then gives each
    pass's bytes written and read (kB = 10^3 bytes). Returns the axes; cell (row r, position p) is
    the rectangle with gid ``"cell-r-p"``.
    """
    from matplotlib.patches import Patch, Rectangle

    rows = growth_states(lengths, max_len)
    if tokens is not None and len(tokens) > max_len:
        raise ValueError(f"{len(tokens)} token labels for max_len={max_len} positions")
    if bytes_per_token is not None:
        check_int("bytes_per_token", bytes_per_token)
    ax = axes_or_new(ax, (7.5, 1.9 + 0.42 * len(rows)))
    for r, states in enumerate(rows):
        for p, state in enumerate(states):
            ax.add_patch(Rectangle((p + 0.05, r + 0.08), 0.9, 0.84, facecolor=STATE_COLORS[state],
                                   edgecolor="0.6", linewidth=0.6, gid=f"cell-{r}-{p}"))
    ax.set_xlim(0, max_len)
    ax.set_ylim(len(rows), 0)  # the prefill on top
    ax.set_xticks([p + 0.5 for p in range(max_len)], [str(p) for p in range(max_len)])
    ax.set_xlabel("cache position (one cell = K and V of one token, in every layer)")
    names = ["prefill"] + [f"decode {i}" for i in range(1, len(rows))]
    ax.set_yticks([r + 0.5 for r in range(len(rows))], names)
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    if tokens is not None:
        top = ax.secondary_xaxis("top")
        top.set_xticks([p + 0.5 for p in range(len(tokens))], [_token_label(t) for t in tokens],
                       rotation=45, ha="left", rotation_mode="anchor")
        top.tick_params(length=0)
        top.spines["top"].set_visible(False)
    right = ax.secondary_yaxis("right")
    notes = []
    for r, n in enumerate(lengths):
        written = n - (lengths[r - 1] if r else 0)
        if bytes_per_token is None:
            notes.append(f"writes {written}, reads {n}")
        else:
            notes.append(f"writes {written * bytes_per_token / 1e3:,.0f} kB, "
                         f"reads {n * bytes_per_token / 1e3:,.0f} kB")
    right.set_yticks([r + 0.5 for r in range(len(rows))], notes)
    right.tick_params(length=0)
    right.spines["right"].set_visible(False)
    handles = [Patch(facecolor=STATE_COLORS[s], edgecolor="0.6", label=STATE_LABELS[s]) for s in STATE_COLORS]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    ax.set_title(title or "Each step writes its new tokens' K and V once and reads every earlier one")
    return ax


# --- step times ---------------------------------------------------------------------------------

def window_medians(values: Sequence[float], window: int) -> list[float]:
    """Medians of consecutive, non-overlapping windows of ``window`` values (a partial tail is dropped)."""
    import statistics

    check_int("window", window)
    if len(values) < window:
        raise ValueError(f"{len(values)} values are fewer than one window of {window}")
    return [statistics.median(values[i:i + window]) for i in range(0, len(values) - window + 1, window)]


def draw_step_times(per_token: Mapping[str, Sequence[float]], window: int = 16, ax=None,
                    title: str | None = None, note: str | None = None):
    """Seconds per generated token of each path (``{"naive": [...], "cached": [...]}``), as dots in ms,
    with the median of every ``window`` steps as a line (its ``gid``: ``"median-<path>"``).

    ``note``: a text placed at the cached line (what its height is). Returns the axes.
    """
    if not per_token:
        raise ValueError("per_token is empty; give the step times of at least one path")
    ax = axes_or_new(ax, (7.5, 3.8))
    for name, times in per_token.items():
        color = PATH_COLORS.get(name, "tab:gray")
        ax.plot(range(1, len(times) + 1), [t * 1e3 for t in times], ".", color=color, alpha=0.3,
                markersize=3)
        medians = window_medians(times, window)
        centres = [window * i + (window + 1) / 2 for i in range(len(medians))]
        ax.plot(centres, [m * 1e3 for m in medians], "-", color=color, gid=f"median-{name}",
                label=f"{name} (median of {window} steps)")
    if note is not None and "cached" in per_token:
        level = window_medians(per_token["cached"], window)[-1] * 1e3
        ax.annotate(note, (len(per_token["cached"]) * 0.55, level), xytext=(0, 14),
                    textcoords="offset points", ha="center", va="bottom", color=PATH_COLORS["cached"])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("generated token index (position = prompt length + index)")
    ax.set_ylabel("time for this token (ms)")
    ax.set_title(title or "Time per generated token")
    ax.legend(loc="upper left")
    return ax


def draw_step_vs_context(contexts: Sequence[int], step_times: Mapping[str, Sequence[float]], ax=None,
                         title: str | None = None):
    """Median seconds of one cached decode step (shown in ms) against the positions it reads, one line
    per label of ``step_times`` (e.g. a batch size; its ``gid``: ``"step-<label>"``). Returns the axes."""
    contexts = [check_int("context", s) for s in contexts]
    if not step_times:
        raise ValueError("step_times is empty; give the times of at least one series")
    for label, times in step_times.items():
        if len(times) != len(contexts):
            raise ValueError(f"{label!r} has {len(times)} times for {len(contexts)} contexts")
    ax = axes_or_new(ax, (7.5, 3.8))
    for label, times in step_times.items():
        ax.plot(contexts, [t * 1e3 for t in times], "o-", gid=f"step-{label}", label=label)
    ax.set_xlim(0, max(contexts) * 1.03)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("positions the decode step reads from the cache (context)")
    ax.set_ylabel("time per decode step (ms)")
    ax.set_title(title or "A cached decode step against the context it reads")
    ax.legend(loc="upper left")
    return ax


# --- memory against concurrency ----------------------------------------------------------------

def draw_memory_vs_concurrency(weight_bytes: int, request_bytes: Mapping[str, int], device_bytes: int,
                               max_requests: int, device_label: str, ax=None, title: str | None = None):
    """Weights + KV cache (GiB = 2^30 bytes) against concurrent requests, one line per request size
    (``request_bytes``: label -> KV bytes of one request), with the weights and the device's memory as
    horizontal lines. The last request count that fits under the device is marked on each line (a dot,
    gid ``"fit-<label>"``). Returns the axes."""
    check_int("weight_bytes", weight_bytes)
    check_int("device_bytes", device_bytes)
    check_int("max_requests", max_requests)
    if not request_bytes:
        raise ValueError("request_bytes is empty; give the KV bytes of at least one request size")
    gib = 2**30
    ax = axes_or_new(ax, (7.5, 3.8))
    counts = range(1, max_requests + 1)
    top = weight_bytes + max_requests * max(request_bytes.values())
    for label, per_request in request_bytes.items():
        check_int(f"request_bytes[{label!r}]", per_request)
        line, = ax.plot(counts, [(weight_bytes + n * per_request) / gib for n in counts], label=label)
        fit = (device_bytes - weight_bytes) // per_request
        if 1 <= fit <= max_requests:
            ax.plot([fit], [(weight_bytes + fit * per_request) / gib], "o", color=line.get_color(),
                    gid=f"fit-{label}")
            ax.annotate(f"{fit}", (fit, (weight_bytes + fit * per_request) / gib), xytext=(4, -14),
                        textcoords="offset points", color=line.get_color())
    ax.axhline(weight_bytes / gib, color="black", linestyle="--", label="weights alone")
    ax.axhline(device_bytes / gib, color="tab:red", linestyle=":", label=device_label)
    ax.set_xlim(0, max_requests)
    ax.set_ylim(0, max(top, device_bytes) / gib * 1.35)  # room for the legend above the lines
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("memory (GiB, 2³⁰ bytes)")
    ax.set_title(title or "Weights + KV cache against concurrency")
    ax.legend(loc="upper left")
    return ax


# --- a paged pool and its block tables ------------------------------------------------------------

def check_block_table(owner: str, table: Sequence[int], num_blocks: int) -> None:
    """``table`` lists distinct block ids in ``[0, num_blocks)``; errors start with ``owner``."""
    if len(set(table)) != len(table):
        raise ValueError(f"{owner} lists a block twice: {list(table)}")
    for block in table:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < num_blocks:
            raise ValueError(f"{owner} holds block {block!r}, outside [0, {num_blocks})")


def physical_blocks(block_tables: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
                    num_blocks: int, block_size: int) -> list[tuple[list[tuple[str, int]], int]]:
    """For each physical block id: its owners ``[(request, logical index), ...]`` and the tokens it holds.

    ``block_tables[r][j]`` is the physical block that holds request r's logical block j (tokens
    ``j*block_size .. (j+1)*block_size - 1``); ``lengths[r]`` is the tokens r's cache holds. A block may
    appear in several tables (a shared prefix); a free block has no owner and holds 0 tokens.
    """
    check_int("num_blocks", num_blocks)
    check_int("block_size", block_size)
    if set(block_tables) != set(lengths):
        raise ValueError(f"block_tables has requests {sorted(block_tables)} but lengths has {sorted(lengths)}")
    blocks: list[tuple[list[tuple[str, int]], int]] = [([], 0) for _ in range(num_blocks)]
    for name, table in block_tables.items():
        n = check_int(f"lengths[{name!r}]", lengths[name], minimum=0)
        if n > len(table) * block_size:
            raise ValueError(f"request {name!r} holds {n} tokens but its {len(table)} blocks of "
                             f"{block_size} hold at most {len(table) * block_size}")
        check_block_table(f"request {name!r}", table, num_blocks)
        for j, block in enumerate(table):
            owners, held = blocks[block]
            owners.append((name, j))
            blocks[block] = (owners, max(held, min(block_size, n - j * block_size)))
    return blocks


def draw_block_tables(block_tables: Mapping[str, Sequence[int]], lengths: Mapping[str, int],
                      num_blocks: int, block_size: int, ax=None, title: str | None = None,
                      notes: Mapping[int, str] | None = None):
    """Each request's logical blocks (top) with an arrow to the physical block that holds it (bottom).

    A block is drawn as ``block_size`` slots, filled up to the tokens it holds. ``notes``: a short text
    under some physical blocks (e.g. the request that held it before), gid ``"note-b"``. Returns the
    axes; the arrow of request r's logical block j has gid ``"map-r-j-b"`` (b: its physical block),
    physical block b is ``"block-b"`` and its slot s ``"block-b-slot-s"`` (logical: ``"logical-r-j..."``).
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    blocks = physical_blocks(block_tables, lengths, num_blocks, block_size)
    colors = {name: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, name in enumerate(block_tables)}
    step, group_gap, pool_y, logical_y, height = 1.25, 0.6, 0.0, 2.6, 0.8

    def draw_block(x: float, y: float, held: int, color: str, gid: str) -> None:
        ax.add_patch(Rectangle((x, y), 1, height, facecolor="white", edgecolor="0.35", linewidth=1.0,
                               gid=gid))
        for s in range(block_size):
            ax.add_patch(Rectangle((x + s / block_size, y), 1 / block_size, height,
                                   facecolor=color if s < held else "white", edgecolor="0.75",
                                   linewidth=0.5, alpha=0.85 if s < held else 1.0,
                                   gid=f"{gid}-slot-{s}"))

    n_logical = sum(len(t) for t in block_tables.values())
    width = max(num_blocks * step, n_logical * step + group_gap * (len(block_tables) - 1))
    ax = axes_or_new(ax, (7.5, 3.7))
    for b, (owners, held) in enumerate(blocks):
        color = colors[owners[0][0]] if owners else "white"
        draw_block(b * step, pool_y, held, color, f"block-{b}")
        ax.text(b * step + 0.5, pool_y - 0.12, str(b), ha="center", va="top")
    for b, note in (notes or {}).items():
        check_int("notes block", b, minimum=0)
        if b >= num_blocks:
            raise ValueError(f"a note for block {b}, outside [0, {num_blocks})")
        ax.text(b * step + 0.5, pool_y - 0.45, note, ha="center", va="top", fontsize=9, color="0.3",
                gid=f"note-{b}")
    x = 0.0
    for name, table in block_tables.items():
        start = x
        for j, block in enumerate(table):
            held = min(block_size, max(0, lengths[name] - j * block_size))
            draw_block(x, logical_y, held, colors[name], f"logical-{name}-{j}")
            ax.text(x + 0.5, logical_y + height / 2, str(j), ha="center", va="center", fontweight="bold")
            ax.add_patch(FancyArrowPatch((x + 0.5, logical_y), (block * step + 0.5, pool_y + height),
                                         arrowstyle="-|>", mutation_scale=10, color=colors[name],
                                         linewidth=1.3, shrinkA=2, shrinkB=2, gid=f"map-{name}-{j}-{block}"))
            x += step
        ax.text((start + x - step + 1) / 2, logical_y + height + 0.12,
                f"{name}: {lengths[name]} tokens\ntable {list(table)}", ha="center", va="bottom",
                color=colors[name])
        x += group_gap
    ax.set_xlim(-0.2, width)
    ax.set_ylim(pool_y - (1.0 if notes else 0.75), logical_y + height + 1.0)
    ax.set_yticks([pool_y + height / 2, logical_y + height / 2],
                  [f"physical pool\n({num_blocks} blocks;\nwhite: free)", "logical blocks\n(per request)"])
    ax.set_xticks([])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"Block tables: logical blocks of {block_size} tokens live anywhere in the pool")
    return ax
