"""The bandwidth figures draw what they are given: points, the bound line, bars, and refuse bad input."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

from minillm.book.viz.bandwidth import plot_bandwidth_law, plot_kernel_bandwidth


def test_bandwidth_law_draws_each_point_and_the_bound_through_bandwidth_over_bytes():
    fig, ax = plt.subplots()
    plot_bandwidth_law(ax, {"a": (500e6, 20.0), "b": (125e6, 60.0)}, bandwidth=20e9)
    bound, *points = ax.get_lines()
    mb, speed = bound.get_data()
    np.testing.assert_allclose(speed, 20e9 / (np.asarray(mb) * 1e6))  # tokens/s = bandwidth / bytes
    assert [(p.get_xdata()[0], p.get_ydata()[0]) for p in points] == [(500.0, 20.0), (125.0, 60.0)]
    assert ax.get_xscale() == ax.get_yscale() == "log" and "MB" in ax.get_xlabel()
    plt.close(fig)


def test_kernel_bars_are_bytes_over_seconds_in_gb_per_s():
    fig, ax = plt.subplots()
    plot_kernel_bandwidth(ax, {"fast": (2e9, 0.1), "slow": (2e9, 1.0)}, bandwidth=25e9)
    widths = {bar.get_width() for bar in ax.patches}
    assert widths == {20.0, 2.0}
    assert ax.get_lines()[0].get_xdata()[0] == 25.0
    plt.close(fig)


def test_points_that_fit_in_the_cache_are_hollow_and_every_point_carries_its_speed():
    fig, ax = plt.subplots()
    plot_bandwidth_law(ax, {"big": (500e6, 20.0), "small": (10e6, 300.0), "peer": (100e6, 60.0)},
                       bandwidth=20e9, cache_bytes=32 * 2**20, quoted=("peer",))
    _, big, small, peer = ax.get_lines()
    assert big.get_markerfacecolor() != "none" and small.get_markerfacecolor() == "none"
    assert peer.get_marker() == "x"
    labels = ax.get_legend_handles_labels()[1]
    assert labels[1:] == ["big", "small (in cache)", "peer (quoted)"]
    assert [t.get_text() for t in ax.texts] == ["20", "300", "60"]
    plt.close(fig)


def test_a_label_that_would_crowd_another_goes_on_the_left():
    """int4 and a quoted llama.cpp sat 2% apart in bytes and 13% in speed: their labels overlapped."""
    fig, ax = plt.subplots()
    plot_bandwidth_law(ax, {"int4": (99.9e6, 76.0), "far": (540e6, 15.0), "llama.cpp": (98.3e6, 67.0)},
                       bandwidth=25e9, quoted=("llama.cpp",))
    sides = {label.get_text(): (label.get_position()[0] > 0, label.get_ha()) for label in ax.texts}
    assert sides == {"76": (True, "left"), "15": (True, "left"), "67": (False, "right")}
    plt.close(fig)


def test_kernel_bars_carry_their_values():
    fig, ax = plt.subplots()
    plot_kernel_bandwidth(ax, {"fast": (2e9, 0.1), "slow": (2e9, 1.0)}, bandwidth=25e9)
    assert sorted(t.get_text() for t in ax.texts) == ["2.0", "20.0"]
    assert len({bar.get_facecolor() for bar in ax.patches}) == 2
    plt.close(fig)


def test_kernel_bars_whose_bytes_fit_in_the_cache_are_hatched_and_marked():
    fig, ax = plt.subplots()
    plot_kernel_bandwidth(ax, {"big": (2e9, 0.1), "small": (20e6, 0.01)}, bandwidth=25e9,
                          cache_bytes=32 * 2**20)
    hatches = {t.get_text(): bar.get_hatch() for t, bar in zip(ax.get_yticklabels(), ax.patches)}
    assert hatches == {"small (in cache)": "//", "big": ""}
    plt.close(fig)


@pytest.mark.parametrize("call, match", [
    (lambda ax: plot_bandwidth_law(ax, {}, 1e9), "points is empty"),
    (lambda ax: plot_bandwidth_law(ax, {"a": (0, 1.0)}, 1e9), "a bytes per step=0"),
    (lambda ax: plot_bandwidth_law(ax, {"a": (1e6, 1.0)}, -1), "bandwidth=-1"),
    (lambda ax: plot_kernel_bandwidth(ax, {"k": (1e6, float("nan"))}, 1e9), "k seconds=nan"),
    (lambda ax: plot_kernel_bandwidth(ax, {}, 1e9), "kernels is empty"),
])
def test_bad_input_is_refused(call, match):
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match=match):
        call(ax)
    plt.close(fig)
