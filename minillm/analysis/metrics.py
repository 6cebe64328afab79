"""Serving metrics from per-request timestamps: TTFT, TPOT, ITL, E2E latency, throughput, goodput.

The definitions are those of vLLM's serving benchmark (``benchmark_serving.py`` / ``vllm bench serve``):

* TTFT = first token time - arrival time (queueing included), one value per request;
* TPOT = (E2E - TTFT) / (output tokens - 1), one value per request, defined only for two or more tokens
  (it excludes the first token);
* ITL  = every gap between two consecutive tokens of a request, pooled over all requests (per token);
* E2E  = last token time - arrival time, one value per request;
* throughput = completed requests, output tokens, prompt + output tokens, each divided by the run's duration;
* goodput = completed requests that meet every SLO given, divided by the run's duration.

A request is any object with ``arrival_time`` and ``token_times`` (seconds, one time per output token,
first included) and ``prompt_len``; :class:`RequestTiming` is the smallest such object. This module knows
nothing of the engine. Percentiles interpolate linearly between order statistics (``numpy.percentile``); a
percentile is a measurement only when the sample is large enough to bracket it (:func:`percentile_interval`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..validate import check_number


@dataclass(frozen=True)
class RequestTiming:
    """The timestamps of one request (seconds on one clock)."""

    arrival_time: float
    token_times: Sequence[float]
    prompt_len: int = 0


def _times(request, index: int | None = None) -> tuple[float, list[float]]:
    """(arrival, token times) of ``request``, checked: finite, non-decreasing, no token before arrival."""
    where = f"request {index}" if index is not None else "request"
    for name in ("arrival_time", "token_times"):
        if not hasattr(request, name):
            raise TypeError(f"{where} ({type(request).__name__}) has no attribute {name!r}; "
                            "metrics need arrival_time and token_times")
    arrival = float(request.arrival_time)
    times = [float(t) for t in request.token_times]
    if not math.isfinite(arrival):
        raise ValueError(f"{where}: arrival_time={arrival} is not a finite number")
    for i, t in enumerate(times):
        if not math.isfinite(t):
            raise ValueError(f"{where}: token_times[{i}]={t} is not a finite number")
    if times and times[0] < arrival:
        raise ValueError(f"{where}: first token at {times[0]} s is before its arrival at {arrival} s")
    for i in range(1, len(times)):
        if times[i] < times[i - 1]:
            raise ValueError(f"{where}: token_times[{i}]={times[i]} < token_times[{i - 1}]={times[i - 1]}; "
                             "token times must be non-decreasing")
    return arrival, times


def _need_tokens(times: list[float], what: str, minimum: int = 1) -> None:
    if len(times) < minimum:
        raise ValueError(f"{what} needs at least {minimum} output token(s); the request has {len(times)}")


def ttft(request) -> float:
    """Time to first token (s) of one request: first token time - arrival time.

    Queueing is included: the clock starts when the request arrives, not when it is
    scheduled.
    """
    arrival, times = _times(request)
    _need_tokens(times, "TTFT")
    return times[0] - arrival


def e2e_latency(request) -> float:
    """End-to-end latency (s) of one request: last token time - arrival time."""
    arrival, times = _times(request)
    _need_tokens(times, "E2E latency")
    return times[-1] - arrival


def tpot(request) -> float | None:
    """Time per output token (s) of one request, first token excluded.

    TPOT = (E2E - TTFT) / (tokens - 1): the mean gap between the request's own tokens.
    ``None`` for a request with exactly one output token: TPOT is undefined there, not 0.
    """
    _, times = _times(request)
    _need_tokens(times, "TPOT")
    if len(times) == 1:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def itls(request) -> list[float]:
    """Inter-token latencies (s) of one request: every gap between consecutive tokens.

    n tokens give n - 1 gaps; a run's ITL pools the gaps of all its requests (per token).
    """
    _, times = _times(request)
    return [b - a for a, b in zip(times, times[1:])]


@dataclass(frozen=True)
class Summary:
    """Distribution of one metric (seconds): count, mean, median, p90, p99, max.

    With no values (``n == 0``) every statistic is ``None``, never a silent zero.
    """

    n: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    max: float | None
    values: tuple[float, ...] = field(repr=False, default=())

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0 <= q <= 100), linear interpolation; ``None`` when there are no values."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile q={q} must be between 0 and 100")
        return float(np.percentile(self.values, q)) if self.n else None

    def interval(self, q: float, confidence: float = 0.95) -> tuple[float, float] | None:
        """The distribution-free interval of the q-th percentile (see :func:`percentile_interval`)."""
        return percentile_interval(self.values, q, confidence)

    def ms(self, stat: str = "median") -> str:
        """One statistic formatted in milliseconds, or ``"n/a"`` when there are no values."""
        value = getattr(self, stat)
        return "n/a" if value is None else f"{value * 1e3:.2f}"


def summarize(values: Iterable[float]) -> Summary:
    """Count, mean, median, p90, p99 and max of plain numbers; NaN or infinite values are a ValueError."""
    vals = tuple(float(v) for v in values)
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{len(bad)} value(s) are not finite (first: {bad[0]}); drop or fix them first")
    if not vals:
        return Summary(0, None, None, None, None, None, ())
    arr = np.asarray(vals)
    p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
    return Summary(len(vals), float(arr.mean()), p50, p90, p99, float(arr.max()), vals)


def _interval_ranks(n: int, p: float, confidence: float) -> tuple[int, int] | None:
    """1-based ranks (l, u) of the shortest-tailed order-statistic interval for the quantile ``p``: the number
    of values below the true quantile is Binomial(n, p), and each tail outside [l, u) has probability at most
    (1 - confidence) / 2. None when either rank would fall outside 1..n."""
    tail = (1 - confidence) / 2
    lo, hi, below = None, None, 0.0  # below: P(B <= k - 1), B ~ Binomial(n, p)
    for k in range(1, n + 1):
        below += math.exp(math.lgamma(n + 1) - math.lgamma(k) - math.lgamma(n - k + 2)
                          + (k - 1) * math.log(p) + (n - k + 1) * math.log1p(-p))  # P(B = k - 1)
        if below <= tail:
            lo = k
        if hi is None and below >= 1 - tail:
            hi = k
    return None if lo is None or hi is None else (lo, hi)


def percentile_interval(values: Iterable[float], q: float,
                        confidence: float = 0.95) -> tuple[float, float] | None:
    """An interval that holds the true q-th percentile with at least ``confidence``, whatever the
    distribution: two order statistics of the sample (the number of values below the true percentile is
    binomial). ``None`` when the sample is too small for the interval to lie inside it; then the q-th
    percentile of the sample is its minimum or maximum in disguise, not a measurement. See ``min_samples``."""
    if not 0 < q < 100:
        raise ValueError(f"percentile q={q} must be strictly between 0 and 100")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be strictly between 0 and 1")
    ordered = sorted(float(v) for v in values)
    ranks = _interval_ranks(len(ordered), q / 100, confidence) if ordered else None
    return None if ranks is None else (ordered[ranks[0] - 1], ordered[ranks[1] - 1])


def min_samples(q: float, confidence: float = 0.95) -> int:
    """The fewest values whose q-th percentile has a ``percentile_interval``: the smallest n with
    max(p, 1 - p)^n <= (1 - confidence) / 2, p = q / 100 (p99: 368 values; p90: 36; the median: 6)."""
    if not 0 < q < 100:
        raise ValueError(f"percentile q={q} must be strictly between 0 and 100")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be strictly between 0 and 1")
    return math.ceil(math.log((1 - confidence) / 2) / math.log(max(q, 100 - q) / 100))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; ``None`` means "no objective on this metric".

    A request with one output token has no TPOT, so it meets a TPOT objective (as in vLLM's goodput).
    """

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(self, name)
            if value is not None:
                check_number(f"SLO {name}", value)  # seconds
        if self.ttft is None and self.tpot is None and self.e2e is None:
            raise ValueError("an SLO needs at least one objective (ttft, tpot or e2e)")

    def met_by(self, request) -> bool:
        """True when the request produced tokens and meets every objective given."""
        _, times = _times(request)
        if not times:
            return False
        tp = tpot(request)
        return ((self.ttft is None or ttft(request) <= self.ttft)
                and (self.tpot is None or tp is None or tp <= self.tpot)
                and (self.e2e is None or e2e_latency(request) <= self.e2e))


@dataclass(frozen=True)
class ServingMetrics:
    """Metrics of one run. Throughputs are per second of ``duration``.

    ttft, tpot, e2e: per request (each request counts once; ``tpot`` over requests with >= 2 tokens).
    itl: per token gap, pooled over all requests (long requests weigh more).
    """

    n_requests: int  # given
    n_completed: int  # produced at least one token
    n_failed: int  # produced no token (rejected, or never scheduled)
    n_single_token: int  # completed with one token: no TPOT
    duration: float  # s
    prompt_tokens: int  # of completed requests
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    slo: SLO | None = None
    n_good: int | None = None  # completed requests meeting every objective of ``slo``
    goodput: float | None = None  # n_good / duration, requests / s

    def table(self) -> str:
        """A text report in the layout of vLLM's serving benchmark (latencies in ms)."""
        lines = [
            f"{'Requests: completed / given':<34}{self.n_completed} / {self.n_requests}",
            f"{'Duration (s)':<34}{self.duration:.3f}",
            f"{'Output tokens':<34}{self.output_tokens}",
            f"{'Request throughput (req/s)':<34}{self.request_throughput:.2f}",
            f"{'Output token throughput (tok/s)':<34}{self.output_throughput:.1f}",
            f"{'Total token throughput (tok/s)':<34}{self.total_token_throughput:.1f}",
        ]
        if self.slo is not None:
            lines.append(f"{'Goodput (req/s)':<34}{self.goodput:.2f}  ({self.n_good} good requests)")
        lines.append(f"{'(ms)':<10}{'n':>6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
        for name in ("ttft", "tpot", "itl", "e2e"):
            s = getattr(self, name)
            cells = "".join(f"{s.ms(stat):>10}" for stat in ("mean", "median", "p90", "p99"))
            lines.append(f"{name.upper():<10}{s.n:>6}{cells}")
        return "\n".join(lines)


def serving_metrics(requests: Sequence, duration: float | None = None, slo: SLO | None = None) -> ServingMetrics:
    """All metrics of a run.

    ``duration`` (s) is the run's wall time; by default, first arrival to last token. A request with no
    token counts as failed: in ``n_failed``, never in a latency, never good. An empty run needs an explicit
    ``duration`` (its throughputs are then a measured 0); without one it is a ValueError.
    """
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO or None, got {type(slo).__name__}")
    requests = list(requests)
    checked = [_times(r, i) for i, r in enumerate(requests)]
    for i, r in enumerate(requests):
        if not hasattr(r, "prompt_len"):
            raise TypeError(f"request {i} ({type(r).__name__}) has no attribute 'prompt_len'")
    done = [(r, times) for r, (_, times) in zip(requests, checked) if times]
    if duration is None:
        if not done:
            raise ValueError(f"cannot derive a duration: {len(checked)} request(s), none with a token; "
                             "pass duration= (seconds) explicitly")
        duration = max(times[-1] for _, times in done) - min(arrival for arrival, _ in checked)
    check_number("duration", duration)
    out_tokens = sum(len(times) for _, times in done)
    in_tokens = sum(int(r.prompt_len) for r, _ in done)
    n_good = sum(slo.met_by(r) for r, _ in done) if slo is not None else None
    return ServingMetrics(
        n_requests=len(checked), n_completed=len(done), n_failed=len(checked) - len(done),
        n_single_token=sum(len(times) == 1 for _, times in done), duration=float(duration),
        prompt_tokens=in_tokens, output_tokens=out_tokens,
        request_throughput=len(done) / duration, output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft=summarize(ttft(r) for r, _ in done),
        tpot=summarize(v for v in (tpot(r) for r, _ in done) if v is not None),
        itl=summarize(g for r, _ in done for g in itls(r)),
        e2e=summarize(e2e_latency(r) for r, _ in done),
        slo=slo, n_good=n_good, goodput=None if n_good is None else n_good / duration,
    )


def time_average(times: Sequence[float], values: Sequence[float], end: float) -> float:
    """Time-weighted mean of a step function: ``values[i]`` holds from ``times[i]`` until the next time
    (the last one until ``end``). E.g. the mean number of requests in the system, for Little's law."""
    if len(times) != len(values):
        raise ValueError(f"times ({len(times)}) and values ({len(values)}) must have the same length")
    if not times:
        raise ValueError("time_average needs at least one (time, value) point")
    edges = [float(t) for t in times] + [float(end)]
    if any(not math.isfinite(t) for t in edges) or any(b < a for a, b in zip(edges, edges[1:])):
        raise ValueError("times must be finite, non-decreasing and end at or after the last time")
    span = edges[-1] - edges[0]
    if span <= 0:
        raise ValueError(f"the time span {edges[0]}..{edges[-1]} s is empty")
    return sum(v * (b - a) for v, a, b in zip(values, edges, edges[1:])) / span


def in_system(requests: Sequence) -> tuple[list[float], list[int]]:
    """Requests in the system over time, as a step function: (event times, count from each time on).

    A request is in the system from its arrival to its last token (a failed one, never). Its time
    average is the L of Little's law, L = arrival rate x mean E2E latency.
    """
    events = []
    for i, r in enumerate(requests):
        arrival, times = _times(r, i)
        if times:
            events += [(arrival, 1), (times[-1], -1)]
    if not events:
        raise ValueError("no request produced a token: nothing was in the system")
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times, departures first
    times_out, counts, n = [], [], 0
    for t, step in events:
        n += step
        if times_out and times_out[-1] == t:
            counts[-1] = n
        else:
            times_out.append(t)
            counts.append(n)
    return times_out, counts




def mean_in_system(requests: Sequence, start: float | None = None, end: float | None = None) -> float:
    """Time-averaged number of requests in the system between ``start`` and ``end`` (s): Little's L.

    By default over the whole run, from the first arrival to the last token.
    """
    times, counts = in_system(requests)
    start = times[0] if start is None else float(start)
    end = times[-1] if end is None else float(end)
    if not end > start:
        raise ValueError(f"the window {start}..{end} s is empty")
    before = [n for t, n in zip(times, counts) if t <= start]  # the count holding at `start`
    inside = [(t, n) for t, n in zip(times, counts) if start < t < end]
    return time_average([start] + [t for t, _ in inside],
                        [before[-1] if before else 0] + [n for _, n in inside], end)


@dataclass(frozen=True)
class SteadyWindow:
    """The part of a run between its start-up and its drain (seconds on the run's clock)."""

    start: float  # the first completion: before it the run was filling up
    end: float  # the last first token: after it no request waits or starts, and the batch only empties
    completions: int  # requests whose last token falls in (start, end]
    good: int | None = None  # of those, the ones that meet every objective of the SLO given

    @property
    def rate(self) -> float:
        """Requests completed per second inside the window: the run's steady throughput."""
        return self.completions / (self.end - self.start)

    @property
    def goodput(self) -> float | None:
        """Requests completed within the SLO per second inside the window (``None`` without an SLO)."""
        return None if self.good is None else self.good / (self.end - self.start)


def steady_window(requests: Sequence, slo: SLO | None = None) -> SteadyWindow:
    """A run's steady window: from its first completion to its last first token.

    A whole-run rate divides by a duration that includes the start-up (nothing has finished yet) and the
    drain (nothing is left to start, and the batch empties); inside this window neither happens. Below
    capacity the window ends one TTFT after the last arrival; past capacity it also holds the time the
    queue took to empty, when the engine still ran full: that is where an overloaded run's completions
    measure the engine, so a run of n requests holds about n of them, however short its arrivals were.
    A run whose last request starts before its first one finishes has no steady window: a ValueError.
    """
    requests = list(requests)
    checked = [_times(r, i) for i, r in enumerate(requests)]
    served = [times for _, times in checked if times]
    if not served:
        raise ValueError(f"{len(checked)} request(s), none with a token: the run has no steady window")
    start, end = min(times[-1] for times in served), max(times[0] for times in served)
    if not end > start:
        raise ValueError(f"the last first token ({end} s) is not after the first completion ({start} s): "
                         "the run has no steady window; send more requests")
    inside = [r for r, (_, times) in zip(requests, checked) if times and start < times[-1] <= end]
    good = None if slo is None else sum(slo.met_by(r) for r in inside)
    return SteadyWindow(start, end, len(inside), good)
