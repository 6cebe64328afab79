"""minillm.analysis.metrics against values computed by hand on small synthetic timelines."""
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.analysis.capacity import plan_for_slo, poisson_burst
from minillm.analysis.metrics import (
    SLO,
    RequestTiming,
    e2e_latency,
    in_system,
    itls,
    mean_in_system,
    min_samples,
    percentile_interval,
    serving_metrics,
    steady_window,
    summarize,
    time_average,
    tpot,
    ttft,
)

# A: 4 tokens; B: 2 tokens; C: 1 token (no TPOT); D: rejected (no token).
A = RequestTiming(0.0, [0.10, 0.15, 0.25, 0.30], prompt_len=10)
B = RequestTiming(0.2, [0.50, 0.52], prompt_len=20)
C = RequestTiming(0.4, [0.60], prompt_len=5)
D = RequestTiming(0.5, [], prompt_len=7)
RUN = [A, B, C, D]


def test_per_request_metrics_by_hand():
    assert ttft(A) == pytest.approx(0.10)
    assert e2e_latency(A) == pytest.approx(0.30)
    assert tpot(A) == pytest.approx((0.30 - 0.10) / 3)
    assert itls(A) == pytest.approx([0.05, 0.10, 0.05])
    assert ttft(B) == pytest.approx(0.30)  # queueing included: arrival 0.2, first token 0.5
    assert tpot(B) == pytest.approx(0.02)
    assert tpot(C) is None  # undefined for one token, not 0
    assert itls(C) == []
    assert ttft(C) == pytest.approx(0.20) and e2e_latency(C) == pytest.approx(0.20)


def test_no_token_is_an_error_for_latencies():
    for f in (ttft, e2e_latency, tpot):
        with pytest.raises(ValueError, match="at least 1 output token"):
            f(D)
    assert itls(D) == []


def test_run_metrics_by_hand():
    m = serving_metrics(RUN)
    assert (m.n_requests, m.n_completed, m.n_failed, m.n_single_token) == (4, 3, 1, 1)
    assert m.duration == pytest.approx(0.60)  # first arrival 0.0 to last token 0.60
    assert (m.prompt_tokens, m.output_tokens) == (35, 7)  # the rejected request's prompt is not counted
    assert m.request_throughput == pytest.approx(3 / 0.6)
    assert m.output_throughput == pytest.approx(7 / 0.6)
    assert m.total_token_throughput == pytest.approx(42 / 0.6)
    # TTFT per request: [0.1, 0.3, 0.2]; linear percentiles on sorted [0.1, 0.2, 0.3].
    assert m.ttft.n == 3
    assert m.ttft.mean == pytest.approx(0.2) and m.ttft.median == pytest.approx(0.2)
    assert m.ttft.p90 == pytest.approx(0.28) and m.ttft.p99 == pytest.approx(0.298)
    assert m.ttft.max == pytest.approx(0.3)
    # TPOT per request over requests with >= 2 tokens: [0.0667, 0.02].
    assert m.tpot.n == 2 and m.tpot.mean == pytest.approx((0.2 / 3 + 0.02) / 2)
    # ITL pooled per token gap: [0.05, 0.10, 0.05, 0.02]; not the mean of per-request means.
    assert m.itl.n == 4 and m.itl.mean == pytest.approx(0.055) and m.itl.median == pytest.approx(0.05)
    assert m.itl.mean != pytest.approx((0.2 / 3 + 0.02) / 2)
    assert m.e2e.n == 3 and m.e2e.mean == pytest.approx((0.30 + 0.32 + 0.20) / 3)
    assert m.goodput is None and m.n_good is None


def test_explicit_duration_is_used():
    m = serving_metrics(RUN, duration=2.0)
    assert m.duration == 2.0 and m.output_throughput == pytest.approx(3.5)


def test_goodput_by_hand():
    # A misses TPOT (66.7 ms > 50), B misses TTFT (300 > 250), C has no TPOT and meets TTFT, D failed.
    m = serving_metrics(RUN, slo=SLO(ttft=0.25, tpot=0.05))
    assert m.n_good == 1 and m.goodput == pytest.approx(1 / 0.6)
    assert serving_metrics(RUN, slo=SLO(tpot=0.07)).n_good == 3
    assert serving_metrics(RUN, slo=SLO(e2e=0.31)).n_good == 2  # A (0.30) and C (0.20)
    assert not SLO(ttft=1.0).met_by(D)


def test_empty_run():
    with pytest.raises(ValueError, match="pass duration="):
        serving_metrics([])
    with pytest.raises(ValueError, match="none with a token"):
        serving_metrics([D])
    m = serving_metrics([D], duration=1.0, slo=SLO(ttft=0.1))
    assert (m.n_completed, m.n_failed, m.output_throughput, m.goodput) == (0, 1, 0.0, 0.0)
    assert m.ttft.n == 0 and m.ttft.mean is None and m.ttft.p99 is None and m.ttft.percentile(50) is None
    assert "n/a" in m.table()


def test_summarize_and_percentile():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert (s.n, s.mean, s.median, s.max) == (4, 2.5, 2.5, 4.0)
    assert s.p90 == pytest.approx(3.7) and s.percentile(25) == pytest.approx(1.75)
    assert s.ms("mean") == "2500.00"
    with pytest.raises(ValueError, match="between 0 and 100"):
        s.percentile(101)
    empty = summarize([])
    assert empty.n == 0 and empty.median is None and empty.ms() == "n/a"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_rejected(bad):
    with pytest.raises(ValueError, match="not finite"):
        summarize([1.0, bad])
    with pytest.raises(ValueError, match="request 1: arrival_time"):
        serving_metrics([A, RequestTiming(bad, [1.0])])
    with pytest.raises(ValueError, match=r"token_times\[1\]"):
        ttft(RequestTiming(0.0, [1.0, bad]))


def test_inconsistent_timelines_are_rejected():
    with pytest.raises(ValueError, match="before its arrival"):
        ttft(RequestTiming(1.0, [0.5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        tpot(RequestTiming(0.0, [0.2, 0.1]))
    with pytest.raises(TypeError, match="token_times"):
        ttft(object())
    with pytest.raises(TypeError, match="prompt_len"):
        serving_metrics([type("R", (), {"arrival_time": 0.0, "token_times": [1.0]})()])
    with pytest.raises(ValueError, match="duration=0"):
        serving_metrics(RUN, duration=0)
    with pytest.raises(TypeError, match="slo must be"):
        serving_metrics(RUN, slo={"ttft": 0.3})


def test_slo_validation():
    with pytest.raises(ValueError, match="at least one objective"):
        SLO()
    with pytest.raises(ValueError, match="tpot=-0.03"):
        SLO(tpot=-0.03)


@given(st.floats(0, 10), st.lists(st.floats(0, 1), min_size=2, max_size=20))
def test_tpot_is_mean_itl_of_the_request(arrival, gaps):
    times = [arrival + 0.5]
    for g in gaps[1:]:
        times.append(times[-1] + g)
    r = RequestTiming(arrival, times)
    assert tpot(r) == pytest.approx(sum(itls(r)) / len(itls(r)), abs=1e-9)
    assert e2e_latency(r) == pytest.approx(ttft(r) + tpot(r) * (len(times) - 1), abs=1e-9)


def test_time_average():
    assert time_average([0.0, 1.0, 3.0], [2, 4, 0], end=4.0) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="same length"):
        time_average([0.0], [1, 2], end=1.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        time_average([0.0, 2.0], [1, 2], end=1.0)


def test_in_system_and_littles_law():
    times, counts = in_system(RUN)  # A in [0, 0.30), B in [0.2, 0.52), C in [0.4, 0.60), D never
    assert times == pytest.approx([0.0, 0.2, 0.3, 0.4, 0.52, 0.6]) and counts == [1, 2, 1, 2, 1, 0]
    mean_in_system = time_average(times, counts, end=0.6)
    m = serving_metrics(RUN)
    # Little's law over a window holding every request whole: L = (completed / window) x mean E2E.
    assert mean_in_system == pytest.approx(m.request_throughput * m.e2e.mean)
    with pytest.raises(ValueError, match="nothing was in the system"):
        in_system([D])


def test_plan_reproduces_the_documents():
    p = plan_for_slo(concurrency=100, output_tokens=200, tpot_slo=0.030, decode_tokens_per_s=2000)
    assert p.request_time == pytest.approx(6.0)  # 200 x 30 ms
    assert p.request_rate == pytest.approx(100 / 6)  # 16.7 req/s
    assert p.decode_tokens_per_s_needed == pytest.approx(100 / 0.03)  # 3333 tok/s
    assert p.streams_per_device == pytest.approx(60)  # 2000 tok/s x 30 ms = 10 req/s x 6 s
    assert p.devices == 2 and p.limited_by == "tpot" and p.ttft_estimate is None


def test_plan_with_ttft_and_serial_prefill():
    kw = dict(concurrency=100, output_tokens=200, tpot_slo=0.030, decode_tokens_per_s=2000,
              ttft_slo=0.300, prompt_tokens=1000, prefill_tokens_per_s=10_000, prefill_overlap=False)
    p = plan_for_slo(**kw)
    assert p.request_time == pytest.approx(0.3 + 199 * 0.03)
    assert p.prefill_time == pytest.approx(0.1)
    assert p.streams_per_device == pytest.approx(60 / (1 + 60 * 0.1 / 6.27))  # 30.7
    assert p.devices_for_tpot == 4 and p.prompts_per_device_within_ttft == 2  # floor(270 ms / 100 ms)
    assert p.devices == 4 and p.limited_by == "tpot"
    assert p.prefill_share == pytest.approx(25 / 6.27 * 0.1)
    burst = plan_for_slo(**kw, burst=10)  # 10 prompts at once need 5 devices (2 each)
    assert burst.devices == 5 and burst.limited_by == "ttft"
    assert burst.ttft_estimate == pytest.approx(0.03 + 2 * 0.1)
    none = plan_for_slo(**{**kw, "prompt_tokens": 3000})  # 300 ms of prefill + one step > 300 ms
    assert none.devices is None and none.limited_by.startswith("ttft: one prompt")


def test_plan_with_prefill_riding_in_the_decode_steps():
    # A step of m rows takes max(memory m / 2000, compute m * (1 + 1000 x 30 ms / 6.27 s) / 10,000):
    # each stream brings 4.78 prompt tokens a step, so compute caps m at 300 / 5.78 = 51.9 (memory: 60).
    kw = dict(concurrency=100, output_tokens=200, tpot_slo=0.030, decode_tokens_per_s=2000,
              ttft_slo=0.300, prompt_tokens=1000, prefill_tokens_per_s=10_000)
    p = plan_for_slo(**kw)
    assert p.prefill_overlap and p.streams_per_device == pytest.approx(300 / (1 + 30 / 6.27))
    assert p.devices == 2 and p.limited_by == "tpot"  # serial prefill needs 4 (test above)
    assert p.prefill_share == pytest.approx(50 / 6.27 * 0.1)  # what the prefills would take alone
    short = plan_for_slo(**{**kw, "prompt_tokens": 100})  # compute cap 300 / 1.48 = 203: memory binds
    assert short.streams_per_device == pytest.approx(60) and short.devices == 2
    with pytest.raises(TypeError, match="prefill_overlap='yes'"):
        plan_for_slo(**kw, prefill_overlap="yes")


def test_steady_window_leaves_out_start_up_and_drain():
    # Two users, closed loop, 1 s per request (first token after 0.5 s); the last request is slow (2 s).
    run = [RequestTiming(a, [a + 0.5, f]) for a, f in [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 4)]]
    w = steady_window(run)  # first completion 1 s, last first token 2.5 s: the completions at 2 s
    assert (w.start, w.end, w.completions) == (1, 2.5, 2) and w.rate == pytest.approx(2 / 1.5)
    assert w.good is None and w.goodput is None
    tight = steady_window(run, slo=SLO(e2e=0.9))  # the two requests finishing at 2 s took 1 s each
    assert tight.good == 0 and tight.goodput == 0.0
    assert steady_window(run, slo=SLO(e2e=1.0)).goodput == pytest.approx(2 / 1.5)
    m = serving_metrics(run)
    assert m.request_throughput == pytest.approx(6 / 4)  # the whole run's rate counts the drain
    assert mean_in_system(run, w.start, w.end) == pytest.approx(2.0)  # both users always inside
    assert mean_in_system(run) == pytest.approx(m.request_throughput * m.e2e.mean)  # 7 / 4
    with pytest.raises(ValueError, match="no steady window"):  # the last starts before the first ends
        steady_window([RequestTiming(0.0, [0.5, 1.0]), RequestTiming(0.0, [0.6, 2.0])])
    with pytest.raises(ValueError, match="empty"):
        mean_in_system(run, 2.0, 2.0)


def test_steady_window_of_an_overload_holds_the_queue_emptying():
    # Ten requests arrive within 0.1 s; the server takes them one at a time, 1 s each. The arrivals end
    # before anything completes, yet the window runs until the last one starts: 8 completions at 1 req/s.
    run = [RequestTiming(0.01 * i, [i + 0.5, i + 1.0]) for i in range(10)]
    w = steady_window(run)
    assert (w.start, w.end, w.completions) == (1.0, 9.5, 8) and w.rate == pytest.approx(8 / 8.5)


def test_percentile_interval_by_hand():
    values = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    # n = 6, median: P(no value below it) = 1/64 <= 2.5 %, so the interval is (min, max); n = 5: 1/32 > 2.5 %
    assert percentile_interval(values, 50) == (1.0, 6.0) == summarize(values).interval(50)
    assert percentile_interval(values[:5], 50) is None and summarize(values).interval(90) is None
    assert (min_samples(50), min_samples(90), min_samples(99)) == (6, 36, 368)
    for q in (50, 90, 99):  # min_samples is where the interval starts to exist
        n = min_samples(q)
        assert percentile_interval(range(n), q) is not None and percentile_interval(range(n - 1), q) is None
    with pytest.raises(ValueError, match="strictly between 0 and 100"):
        percentile_interval(values, 100)
    with pytest.raises(ValueError, match="confidence=1"):
        min_samples(50, confidence=1)


def test_percentile_interval_covers_the_true_percentile():
    rng = random.Random(0)
    for q, n in ((90, 100), (99, 400)):
        held = sum(lo <= q / 100 <= hi for lo, hi in (
            percentile_interval([rng.random() for _ in range(n)], q) for _ in range(400)))
        assert 0.93 <= held / 400 <= 1.0  # at least 95 % in theory; 400 draws give a little noise


def test_plan_validation():
    with pytest.raises(ValueError, match="concurrency=0"):
        plan_for_slo(0, 200, 0.03, 2000)
    with pytest.raises(TypeError, match="output_tokens=2.5 must be an integer"):
        plan_for_slo(100, 2.5, 0.03, 2000)
    with pytest.raises(ValueError, match="together"):
        plan_for_slo(100, 200, 0.03, 2000, ttft_slo=0.3)
    with pytest.raises(ValueError, match="decode_tokens_per_s=nan"):
        plan_for_slo(100, 200, 0.03, math.nan)


def test_poisson_burst_by_hand():
    # 10 req/s over 0.1 s: Poisson(1), P(N <= 0, 1, 2, 3) = 0.368, 0.736, 0.920, 0.981
    assert [poisson_burst(10, 0.1, q) for q in (0.3, 0.5, 0.9, 0.95)] == [1, 1, 2, 3]
    # the source's plan: 100 streams of 6.27 s, a 300 ms TTFT window: P(N >= 10) is 2.5 %, P(N >= 12) 0.4 %
    assert poisson_burst(100 / 6.27, 0.3, 0.97) == 9 and poisson_burst(100 / 6.27, 0.3, 0.996) == 11
    with pytest.raises(ValueError, match="quantile=1"):
        poisson_burst(10, 0.1, 1)
