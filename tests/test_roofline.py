"""Roofline arithmetic and the machine probes (arithmetic checked with a fake clock, never timed)."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.roofline import (matmul_flops, measure_bandwidth, measure_matmul_flops, median_time,
                              ridge_point, roofline)


def fake_clock(readings):
    """A clock that returns the given readings in order, whatever the device."""
    it = iter(readings)
    return lambda device: next(it)


# Three timed calls lasting 1.0 s, 2.0 s and 0.5 s: the median is 1.0 s.
READINGS = [0.0, 1.0, 10.0, 12.0, 20.0, 20.5]


def test_median_time_uses_the_clock_and_counts_calls():
    calls = []
    seconds = median_time(lambda: calls.append(1), repeats=3, warmup=2, clock=fake_clock(READINGS))
    assert seconds == 1.0
    assert len(calls) == 5  # 2 warm-up + 3 timed


def test_matmul_flops_formula():
    assert matmul_flops(1) == 2
    assert matmul_flops(512) == 2 * 512 ** 3


def test_measure_matmul_flops_divides_flops_by_median_time():
    flops = measure_matmul_flops(n=8, repeats=3, clock=fake_clock(READINGS))
    assert flops == 2 * 8 ** 3 / 1.0


def test_measure_bandwidth_counts_read_and_write():
    bw = measure_bandwidth(n_bytes=4096, repeats=3, clock=fake_clock(READINGS))
    assert bw == 2 * 4096 / 1.0


def test_probes_return_positive_finite_numbers():
    flops = measure_matmul_flops(n=64, repeats=3)
    bw = measure_bandwidth(n_bytes=2 ** 20, repeats=3)
    for value in (flops, bw):
        assert math.isfinite(value) and value > 0


def test_roofline_two_regimes_and_ridge():
    peak_flops, peak_bw = 100e9, 20e9  # ridge at 5 FLOP/byte
    assert ridge_point(peak_flops, peak_bw) == 5.0
    assert roofline(0.5, peak_flops, peak_bw) == 10e9  # memory-bound: 0.5 x 20e9
    assert roofline(5.0, peak_flops, peak_bw) == 100e9  # exactly at the ridge
    assert roofline(50.0, peak_flops, peak_bw) == 100e9  # compute-bound: flat at the peak
    assert roofline(0, peak_flops, peak_bw) == 0.0
    curve = roofline(np.array([1.0, 2.0, 10.0]), peak_flops, peak_bw)
    np.testing.assert_array_equal(curve, [20e9, 40e9, 100e9])


@given(st.floats(0, 1e6), st.floats(1e3, 1e18), st.floats(1e3, 1e15))
def test_roofline_never_exceeds_either_roof(intensity, peak_flops, peak_bw):
    attainable = roofline(intensity, peak_flops, peak_bw)
    assert attainable <= peak_flops
    assert attainable <= intensity * peak_bw * (1 + 1e-12)
    assert attainable == pytest.approx(min(peak_flops, intensity * peak_bw))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True])
def test_roofline_rejects_bad_peaks(bad):
    with pytest.raises(ValueError, match="peak_flops"):
        roofline(1.0, bad, 1e9)
    with pytest.raises(ValueError, match="peak_bw"):
        ridge_point(1e9, bad)


def test_roofline_rejects_negative_intensity():
    with pytest.raises(ValueError, match="intensity"):
        roofline(np.array([1.0, -2.0]), 1e9, 1e9)


@pytest.mark.parametrize("kwargs, name", [({"n": 0}, "n="), ({"n": 2.5}, "n="), ({"repeats": 0}, "repeats=")])
def test_matmul_probe_rejects_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        measure_matmul_flops(**kwargs)


def test_bandwidth_probe_rejects_tiny_buffers():
    with pytest.raises(ValueError, match="n_bytes=2"):
        measure_bandwidth(n_bytes=2)
