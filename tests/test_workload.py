"""Synthetic workloads: arrival schedules with the right mean and shape, seeded random requests."""
import math
import statistics
import subprocess
import sys

import pytest

from minillm import SamplingParams
from minillm.analysis.workload import poisson_arrivals, random_requests


def gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_repeat_with_the_seed():
    times = poisson_arrivals(20000, rate=4.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert statistics.mean(gaps(times)) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps(times)) == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_arrivals(50, 4.0, seed=0) == times[:50]
    assert poisson_arrivals(50, 4.0, seed=1) != times[:50]


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_changes_the_spread_not_the_mean(burstiness):
    g = gaps(poisson_arrivals(20000, rate=2.0, seed=3, burstiness=burstiness))
    assert statistics.mean(g) == pytest.approx(0.5, rel=0.05)
    cv = statistics.stdev(g) / statistics.mean(g)  # gamma with shape k: cv = 1 / sqrt(k)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_means_all_at_once():
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, 1.0, seed=0) == []


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(n=-1, rate=1.0, seed=0), ValueError, "n=-1"),
    (dict(n=5, rate=0.0, seed=0), ValueError, "rate=0.0"),
    (dict(n=5, rate=-2, seed=0), ValueError, "rate=-2"),
    (dict(n=5, rate=1.0, seed=0, burstiness=0), ValueError, "burstiness=0"),
    (dict(n=5, rate=1.0, seed=0, burstiness=math.inf), ValueError, "burstiness=inf"),
    (dict(n=5, rate=1.0, seed="a"), TypeError, "seed='a'"),
])
def test_poisson_arrivals_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        poisson_arrivals(**kwargs)


@pytest.mark.parametrize("dist", ["uniform", "loguniform"])
def test_random_requests_stay_in_bounds_and_repeat_with_the_seed(dist):
    reqs = random_requests(2000, (4, 64), (2, 300), seed=5, vocab_size=100, length_dist=dist)
    assert [r.request_id for r in reqs] == list(range(2000))
    prompt_lens, out_lens = [len(r.prompt_ids) for r in reqs], [r.max_tokens for r in reqs]
    assert min(prompt_lens) == 4 and max(prompt_lens) == 64
    assert min(out_lens) == 2 and 280 < max(out_lens) <= 300
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_ids)
    assert all(r.ignore_eos and r.arrival_time == 0.0 and r.sampling.greedy for r in reqs)
    if dist == "uniform":
        assert statistics.mean(out_lens) == pytest.approx(151, rel=0.05)
    else:  # log-uniform: the median is near the geometric mean sqrt(2 x 301), far below the midpoint
        assert statistics.median(out_lens) == pytest.approx(math.sqrt(2 * 301), rel=0.15)
    again = random_requests(2000, (4, 64), (2, 300), seed=5, vocab_size=100, length_dist=dist)
    assert again == reqs
    assert random_requests(20, (4, 64), (2, 300), seed=6, vocab_size=100, length_dist=dist) != reqs[:20]


def test_random_requests_take_arrivals_and_sampling():
    times = poisson_arrivals(4, 2.0, seed=0)
    params = SamplingParams(temperature=0.7)
    reqs = random_requests(4, (1, 3), (1, 3), seed=0, arrival_times=times, sampling=params, ignore_eos=False)
    assert [r.arrival_time for r in reqs] == times
    assert all(r.sampling == params and not r.ignore_eos for r in reqs)
    assert len({r.seed for r in reqs}) == 4  # each request samples with its own generator


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompt_len=(10, 5)), ValueError, r"low 10 > high 5"),
    (dict(prompt_len=(0, 5)), ValueError, r"prompt_len\[0\]=0"),
    (dict(output_len=8), TypeError, "output_len=8"),
    (dict(vocab_size=0), ValueError, "vocab_size=0"),
    (dict(length_dist="zipf"), ValueError, "unknown length_dist 'zipf'"),
    (dict(arrival_times=[0.0]), ValueError, "1 arrival times given for n=3"),
    (dict(n=-2), ValueError, "n=-2"),
])
def test_random_requests_bad_arguments(kwargs, error, match):
    args = dict(n=3, prompt_len=(1, 8), output_len=(1, 8), seed=0) | kwargs
    with pytest.raises(error, match=match):
        random_requests(**args)


def test_a_workload_is_drawn_without_the_engine():
    """The bench client draws its workload for any server: the generator loads nothing of the engine."""
    code = ("import sys; from minillm.analysis.workload import random_requests; random_requests(2, (1, 2), (1, 2), 0); "
            "print(sorted(m for m in sys.modules if m.startswith('minillm.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
