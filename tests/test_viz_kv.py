"""The KV-cache diagrams: what they draw must be what the cache lengths and block tables say."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba
from matplotlib.path import Path

from minillm.book.viz.kv import (
    STATE_COLORS,
    draw_block_tables,
    draw_kv_growth,
    draw_memory_vs_concurrency,
    draw_step_times,
    draw_step_vs_context,
    growth_states,
    physical_blocks,
    window_medians,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _by_gid(ax) -> dict:
    return {p.get_gid(): p for p in ax.patches if p.get_gid()}


# --- the cache filling up -------------------------------------------------------------------------

def test_growth_states_write_new_positions_and_read_old_ones():
    rows = growth_states([3, 4, 6], max_len=7)
    assert rows == [
        ["written"] * 3 + ["empty"] * 4,
        ["read"] * 3 + ["written"] + ["empty"] * 3,
        ["read"] * 4 + ["written"] * 2 + ["empty"],
    ]


@pytest.mark.parametrize("lengths, max_len, error, match", [
    ([], 4, ValueError, "lengths is empty"),
    ([3, 3], 4, ValueError, "increase strictly"),
    ([2, 5], 4, ValueError, "more than max_len=4"),
    ([0, 1], 4, ValueError, "length=0"),
    ([1.5], 4, TypeError, "length=1.5"),
    ([1], 0, ValueError, "max_len=0"),
])
def test_growth_states_reject_bad_lengths(lengths, max_len, error, match):
    with pytest.raises(error, match=match):
        growth_states(lengths, max_len)


def test_growth_figure_colours_every_cell_by_its_state_and_notes_the_bytes():
    lengths, max_len = [3, 4, 5], 6
    ax = draw_kv_growth(lengths, max_len, tokens=["a", " b", "\n"], bytes_per_token=2_000)
    cells = _by_gid(ax)
    assert len(cells) == len(lengths) * max_len
    for r, states in enumerate(growth_states(lengths, max_len)):
        for p, state in enumerate(states):
            assert cells[f"cell-{r}-{p}"].get_facecolor() == to_rgba(STATE_COLORS[state])
    right = [a for a in ax.child_axes if a.get_yticklabels()][0]
    notes = [t.get_text() for t in right.get_yticklabels()]
    assert notes == ["writes 6 kB, reads 6 kB", "writes 2 kB, reads 8 kB", "writes 2 kB, reads 10 kB"]
    top = [a for a in ax.child_axes if a.get_xticklabels()][0]
    assert [t.get_text() for t in top.get_xticklabels()] == ["a", "b", "\\n"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["prefill", "decode 1", "decode 2"]


def test_growth_figure_without_bytes_counts_positions():
    ax = draw_kv_growth([2, 3], 3)
    right = [a for a in ax.child_axes if a.get_yticklabels()][0]
    assert [t.get_text() for t in right.get_yticklabels()] == ["writes 2, reads 2", "writes 1, reads 3"]


def test_growth_figure_rejects_more_labels_than_positions():
    with pytest.raises(ValueError, match="4 token labels for max_len=3"):
        draw_kv_growth([2], 3, tokens=["a", "b", "c", "d"])


# --- step times -----------------------------------------------------------------------------------

def _line(ax, gid):
    return next(line for line in ax.get_lines() if line.get_gid() == gid)


def test_window_medians_drop_a_partial_tail():
    assert window_medians([3, 1, 2, 10, 30, 20, 99], 3) == [2, 20]
    with pytest.raises(ValueError, match="2 values are fewer than one window of 3"):
        window_medians([1, 2], 3)


def test_step_time_figure_draws_each_path_in_ms_with_its_window_medians():
    naive = [0.001 * (i + 1) for i in range(32)]  # grows by 1 ms a step
    cached = [0.002] * 32
    ax = draw_step_times({"naive": naive, "cached": cached}, window=16, note="fixed cost")
    x, y = _line(ax, "median-naive").get_data()
    assert list(x) == [8.5, 24.5] and list(y) == pytest.approx([8.5, 24.5])
    assert list(_line(ax, "median-cached").get_data()[1]) == pytest.approx([2.0, 2.0])
    assert ax.get_ylabel() == "time for this token (ms)" and "index" in ax.get_xlabel()
    assert [t.get_text() for t in ax.texts] == ["fixed cost"]
    with pytest.raises(ValueError, match="per_token is empty"):
        draw_step_times({})


def test_step_vs_context_figure_draws_one_line_per_series_in_ms():
    ax = draw_step_vs_context([16, 4096, 8191], {"batch 1": [0.06, 0.075, 0.09],
                                                  "batch 4": [0.08, 0.15, 0.25]}, title="Figure 3: x")
    x, y = _line(ax, "step-batch 4").get_data()
    assert list(x) == [16, 4096, 8191] and list(y) == pytest.approx([80, 150, 250])
    assert ax.get_title() == "Figure 3: x" and "(ms)" in ax.get_ylabel() and "context" in ax.get_xlabel()
    with pytest.raises(ValueError, match="'b' has 1 times for 2 contexts"):
        draw_step_vs_context([1, 2], {"b": [0.1]})


def test_memory_figure_is_in_gib_and_marks_the_last_request_that_fits():
    gib = 2**30
    ax = draw_memory_vs_concurrency(10 * gib, {"1 GiB each": gib, "2 GiB each": 2 * gib}, 80 * gib,
                                    max_requests=100, device_label="80 GiB")
    fit = _line(ax, "fit-1 GiB each").get_data()
    assert list(fit[0]) == [70] and list(fit[1]) == pytest.approx([80.0])
    assert list(_line(ax, "fit-2 GiB each").get_data()[0]) == [35]
    assert "GiB" in ax.get_ylabel()
    horizontal = sorted(line.get_ydata()[0] for line in ax.get_lines() if len(set(line.get_ydata())) == 1
                        and line.get_gid() is None)
    assert horizontal == pytest.approx([10.0, 80.0])


# --- the paged pool -------------------------------------------------------------------------------

def test_physical_blocks_follow_the_tables():
    blocks = physical_blocks({"A": [2, 0], "B": [1]}, {"A": 5, "B": 2}, num_blocks=4, block_size=4)
    assert blocks == [([("A", 1)], 1), ([("B", 0)], 2), ([("A", 0)], 4), ([], 0)]


def test_a_shared_block_lists_every_holder():
    blocks = physical_blocks({"A": [0, 1], "B": [0, 2]}, {"A": 6, "B": 5}, num_blocks=3, block_size=4)
    assert blocks[0] == ([("A", 0), ("B", 0)], 4)
    assert blocks[1] == ([("A", 1)], 2) and blocks[2] == ([("B", 1)], 1)


def test_a_table_may_hold_a_block_not_yet_written():
    blocks = physical_blocks({"A": [1, 0]}, {"A": 4}, num_blocks=2, block_size=4)
    assert blocks == [([("A", 1)], 0), ([("A", 0)], 4)]


@pytest.mark.parametrize("tables, lengths, error, match", [
    ({"A": [0]}, {"B": 1}, ValueError, "block_tables has requests"),
    ({"A": [5]}, {"A": 1}, ValueError, r"request 'A' holds block 5, outside \[0, 4\)"),
    ({"A": [True]}, {"A": 1}, ValueError, r"request 'A' holds block True, outside \[0, 4\)"),
    ({"A": [1, 1]}, {"A": 5}, ValueError, r"request 'A' lists a block twice: \[1, 1\]"),
    ({"A": [0]}, {"A": 5}, ValueError, "holds 5 tokens but its 1 blocks of 4 hold at most 4"),
    ({"A": [0]}, {"A": -1}, ValueError, "must be >= 0"),
])
def test_physical_blocks_reject_inconsistent_tables(tables, lengths, error, match):
    with pytest.raises(error, match=match):
        physical_blocks(tables, lengths, num_blocks=4, block_size=4)


def test_block_figure_draws_one_arrow_per_table_entry_onto_its_physical_block():
    tables, lengths = {"A": [0, 1, 5], "C": [3, 4, 8], "D": [2, 6, 7]}, {"A": 12, "C": 10, "D": 11}
    ax = draw_block_tables(tables, lengths, num_blocks=12, block_size=4)
    patches = _by_gid(ax)
    arrows = {gid: p for gid, p in patches.items() if gid.startswith("map-")}
    assert sorted(arrows) == sorted(f"map-{r}-{j}-{b}" for r, t in tables.items() for j, b in enumerate(t))
    for gid, arrow in arrows.items():
        block = patches[f"block-{gid.split('-')[-1]}"]
        path = arrow.get_path()  # in data coordinates
        vertices = path.vertices[path.codes != Path.CLOSEPOLY]  # (a closing code's vertex is unused)
        end = vertices[vertices[:, 1].argmin()]  # the tip: arrows point down to the pool
        assert block.get_x() <= end[0] <= block.get_x() + block.get_width()
        assert abs(end[1] - (block.get_y() + block.get_height())) < 0.1


def test_block_figure_fills_exactly_the_slots_that_hold_tokens():
    tables, lengths = {"A": [0, 1, 5], "C": [3, 4, 8]}, {"A": 12, "C": 10}
    ax = draw_block_tables(tables, lengths, num_blocks=12, block_size=4)
    patches = _by_gid(ax)
    for b, (owners, held) in enumerate(physical_blocks(tables, lengths, 12, 4)):
        filled = [patches[f"block-{b}-slot-{s}"].get_facecolor() != to_rgba("white") for s in range(4)]
        assert filled == [s < held for s in range(4)], f"block {b}"
        assert bool(owners) == (held > 0)
    assert sum(patches[f"logical-C-2-slot-{s}"].get_facecolor() != to_rgba("white") for s in range(4)) == 2


def test_block_figure_writes_notes_under_their_blocks():
    ax = draw_block_tables({"A": [0, 2]}, {"A": 6}, num_blocks=4, block_size=4, notes={2: "was B's"})
    note = next(t for t in ax.texts if t.get_gid() == "note-2")
    block = _by_gid(ax)["block-2"]
    assert note.get_text() == "was B's"
    assert block.get_x() <= note.get_position()[0] <= block.get_x() + block.get_width()
    with pytest.raises(ValueError, match="a note for block 4"):
        draw_block_tables({"A": [0]}, {"A": 1}, num_blocks=4, block_size=4, notes={4: "x"})
