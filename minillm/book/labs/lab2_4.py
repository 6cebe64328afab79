"""Lab 2.4: serving metrics from timestamps (vLLM's definitions), a capacity plan, and the knee of a sweep.

The learner writes ``ttft``, ``tpot``, ``itls``, ``e2e``, ``throughput``, ``goodput``, ``devices_needed``
and ``knee``; :mod:`minillm.analysis.metrics` and :mod:`minillm.analysis.capacity` are the reference.
``compare_metrics``, ``compare_plan`` and ``compare_knee`` are the lab's payoff, on timestamps the lab
measures. Each function's catalogue (:mod:`.diagnosis`) holds the bugs learners write, as code.
"""
from __future__ import annotations

import math
import statistics
import time

from ...analysis.capacity import plan_capacity, plan_for_slo
from ...analysis.metrics import SLO, RequestTiming, e2e_latency, serving_metrics, steady_window
from ...analysis.metrics import itls as reference_itls
from ...analysis.metrics import tpot as reference_tpot
from ...analysis.metrics import ttft as reference_ttft
from ...analysis.roofline import time_decode_step
from ...analysis.workload import poisson_arrivals, random_requests
from ...engine import Engine, EngineConfig, blocks_for
from . import wire
from .cases import show_text
from .checker import LearnerError, Mismatch, Property, Task, call, expect_number, register, wrong_value
from .diagnosis import Bug, Catalogue

wire.register_class(RequestTiming)


def _r(arrival: float, *times: float, prompt_len: int = 10) -> RequestTiming:
    return RequestTiming(arrival, list(times), prompt_len)


# Hidden requests: arrival, token times (s). Times are multiples of 1/64 so sums are exact.
QUEUED = _r(1.0, 1.75, 1.8125, 1.875, 2.0)  # waited, then four tokens with uneven gaps
PROMPT = _r(0.0, 0.25, 0.3125, 0.375, 0.4375, 0.5)
SLOW_START = _r(0.0, 2.25, 2.3125, 2.375, 2.4375, 2.5)  # same gaps as PROMPT, later first token
ONE = _r(0.5, 0.875)
NONE = _r(0.25)


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(
        a, b, rel_tol=1e-9, abs_tol=1e-12)


def _same_numbers(a, b) -> bool:
    """Outcomes of numbers (or lists of them, or None) equal to rounding."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_numbers(x, y) for x, y in zip(a, b))
    return _close(a, b) or (a is None and b is None) or (type(a) is type(b) and a == b)


def _value(fns, name, request):
    return expect_number(name, call(fns[name], request))


def _per_request(name, reference, requests, what, catalogue=None):
    """Each request's value against the reference."""
    def run(fns):
        for request in requests:
            got, expected = _value(fns, name, request), reference(request)
            if not _close(got, expected):
                raise Mismatch(f"{what} of a request arriving at {request.arrival_time} s with tokens at "
                               f"{list(request.token_times)} s: got {got:.6g}; expected {expected:.6g}",
                               **(catalogue.hint(fns, request) if catalogue else {}))
    return run


def _one_request_probes():
    return [(QUEUED,), (PROMPT,), (SLOW_START,), (ONE,)]


TTFT_BUGS = Catalogue("ttft", reference_ttft, (
    Bug("ttft.no_arrival", "the first token's time alone", "TTFT runs from the request's arrival.",
        lambda r: r.token_times[0]),
    Bug("ttft.last_token", "the last token's time minus the arrival (that is E2E)",
        "TTFT ends at the first token.", lambda r: r.token_times[-1] - r.arrival_time),
), _one_request_probes, same=_same_numbers)

TTFT = Task("ttft", "2.4", ("ttft",), (
    Property("returns a number of seconds", "What does your function return?",
             _per_request("ttft", reference_ttft, [PROMPT], "TTFT", TTFT_BUGS)),
    Property("first token time - arrival time, the wait in the queue included",
             "When does the clock start for TTFT, and when does it stop?",
             _per_request("ttft", reference_ttft, [QUEUED, ONE, SLOW_START], "TTFT", TTFT_BUGS), central=True),
))


def _tpot_slip(over_n=False, from_arrival=False, zero=False):
    def tpot(r):
        n = len(r.token_times)
        if n < 2:
            return 0.0 if zero else None
        start = r.arrival_time if from_arrival else r.token_times[0]
        return (r.token_times[-1] - start) / (n if over_n else n - 1)
    return tpot


TPOT_BUGS = Catalogue("tpot", reference_tpot, (
    Bug("tpot.over_n", "dividing by the number of tokens", "TPOT averages the gaps between tokens: n tokens "
        "have n - 1 gaps.", _tpot_slip(over_n=True)),
    Bug("tpot.from_arrival", "timing from the arrival", "TPOT starts at the first token: it leaves out the "
        "wait and the prefill.", _tpot_slip(from_arrival=True)),
    Bug("tpot.from_arrival_over_n", "timing from the arrival over n tokens", "TPOT starts at the first token "
        "and averages the n - 1 gaps after it.", _tpot_slip(from_arrival=True, over_n=True)),
    Bug("tpot.zero", "0 for a request with one token", "One token has no gap: TPOT is undefined (None), "
        "and 0 would count as meeting any objective.", _tpot_slip(zero=True)),
), _one_request_probes, same=_same_numbers)


def _tpot_one(fns):
    value = call(fns["tpot"], ONE)
    if value is not None:
        raise Mismatch(f"for a request with one token, tpot returned {value!r}; expected None",
                       **TPOT_BUGS.hint(fns, ONE))


TPOT_HINT = "Which two times does your TPOT subtract, and by what does it divide? Work PROMPT out by hand."
TPOT = Task("tpot", "2.4", ("tpot",), (
    Property("(last token - first token) / (tokens - 1), one value per request", TPOT_HINT,
             _per_request("tpot", reference_tpot, [PROMPT, QUEUED], "TPOT", TPOT_BUGS), central=True),
    Property("excludes the first token: a late first token does not change it", TPOT_HINT,
             _per_request("tpot", reference_tpot, [SLOW_START], "TPOT", TPOT_BUGS)),
    Property("is None (undefined) for a request with one token, not 0",
             "How many gaps does one token have?", _tpot_one),
))


def _itls(fns, request):
    gaps = call(fns["itls"], request)
    if not isinstance(gaps, (list, tuple)):
        raise wrong_value("itls", gaps, "a list of gaps in seconds")
    return [expect_number("itls", g) for g in gaps]


ITL_BUGS = Catalogue("itls", reference_itls, (
    Bug("itls.from_arrival", "a first gap from the arrival", "An ITL is a gap between two tokens: the "
        "arrival plays no part.", lambda r: [b - a for a, b in zip([r.arrival_time] + r.token_times[:-1],
                                                                   r.token_times)]),
    Bug("itls.since_first", "each token's time since the first token", "Each gap is between two "
        "consecutive tokens, not back to the first.", lambda r: [t - r.token_times[0] for t in r.token_times[1:]]),
), _one_request_probes, observe=lambda f, r: list(f(r)), same=_same_numbers)


def _itls_count(fns):
    for request in (PROMPT, QUEUED, ONE):
        gaps = _itls(fns, request)
        if len(gaps) != len(request.token_times) - 1:
            raise Mismatch(f"{len(request.token_times)} tokens gave {len(gaps)} gaps; expected "
                           f"{len(request.token_times) - 1}", **ITL_BUGS.hint(fns, request))


def _itls_values(fns):
    for request in (QUEUED, SLOW_START):
        got, expected = _itls(fns, request), reference_itls(request)
        if not _same_numbers(got, expected):
            raise Mismatch(f"tokens at {list(request.token_times)} s gave gaps {[round(g, 4) for g in got]}; "
                           f"expected {[round(g, 4) for g in expected]}", **ITL_BUGS.hint(fns, request))


ITL = Task("itls", "2.4", ("itls",), (
    Property("one gap per pair of consecutive tokens (n tokens, n - 1 gaps; none for one token)",
             "Which pairs of times does your code subtract?", _itls_count),
    Property("each gap is the time between two consecutive tokens",
             "Which pairs of times does your code subtract?", _itls_values, central=True),
))


E2E_BUGS = Catalogue("e2e", e2e_latency, (
    Bug("e2e.from_first", "timing from the first token", "End to end runs from the arrival.",
        lambda r: r.token_times[-1] - r.token_times[0]),
), _one_request_probes, same=_same_numbers)

E2E = Task("e2e", "2.4", ("e2e",), (
    Property("last token time - arrival time", "When does the clock start and stop for E2E?",
             _per_request("e2e", e2e_latency, [PROMPT, QUEUED, SLOW_START], "E2E latency", E2E_BUGS),
             central=True),
    Property("for a one-token request it equals the TTFT",
             "With one token, which token is the last?", _per_request("e2e", e2e_latency, [ONE], "E2E latency",
                                                                      E2E_BUGS)),
))


# --- throughput and goodput --------------------------------------------------------------------------

RUN = [PROMPT, QUEUED, ONE, NONE, SLOW_START]  # NONE produced no token: a failed request


def _throughput_reference(requests, duration):
    metrics = serving_metrics(requests, duration=duration)
    return metrics.request_throughput, metrics.output_throughput


THROUGHPUT_BUGS = Catalogue("throughput", _throughput_reference, (
    Bug("throughput.failed_requests", "a request rate that counts failed requests",
        "A request that produced no token did not complete.",
        lambda rs, d: (len(rs) / d, sum(len(r.token_times) for r in rs) / d)),
    Bug("throughput.tokens_per_request", "output tokens per request instead of per second",
        "Throughput is a rate: divide by the duration.",
        lambda rs, d: (sum(bool(r.token_times) for r in rs) / d,
                       sum(len(r.token_times) for r in rs) / max(sum(bool(r.token_times) for r in rs), 1))),
), lambda: [(list(RUN), 4.0), ([PROMPT, NONE], 2.0)], observe=lambda f, rs, d: list(f(list(rs), d)),
    same=_same_numbers)


def _pair(fns, requests, duration):
    out = call(fns["throughput"], list(requests), duration)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("throughput", out, "a pair (requests per second, output tokens per second)")
    return expect_number("throughput", out[0]), expect_number("throughput", out[1])


def _throughput_part(index, what):
    def run(fns):
        got, expected = _pair(fns, RUN, 5.0)[index], _throughput_reference(RUN, 5.0)[index]
        if not _close(got, expected):
            raise Mismatch(f"{what}: got {got:.6g}; expected {expected:.6g}", **THROUGHPUT_BUGS.hint(fns, RUN, 5.0))
    return run


THROUGHPUT = Task("throughput", "2.4", ("throughput",), (
    Property("output tokens per second of the run",
             "Which tokens do you count, and what do you divide by?",
             _throughput_part(1, "output tokens per second over 5 s"), central=True),
    Property("completed requests per second: a request with no token is not completed",
             "Which requests count as completed?",
             _throughput_part(0, "completed requests per second over 5 s (one of the 5 requests produced no "
                                 "token)")),
))


def _goodput_slip(strict=False, slowest=False, failed=False, fraction=False):
    def goodput(requests, duration, ttft_slo, tpot_slo):
        good = 0
        for r in requests:
            if not r.token_times:
                good += failed
                continue
            gaps = reference_itls(r)
            per_token = (max(gaps) if slowest else reference_tpot(r)) if gaps else None
            meets = (lambda a, b: a < b) if strict else (lambda a, b: a <= b)
            good += meets(reference_ttft(r), ttft_slo) and (per_token is None or meets(per_token, tpot_slo))
        return good / (len(requests) if fraction else duration)
    return goodput


GOODPUT_BUGS = Catalogue("goodput", _goodput_slip(), (
    Bug("goodput.strict", "objectives met only strictly (<)", "A request exactly at an objective meets it.",
        _goodput_slip(strict=True)),
    Bug("goodput.slowest_gap", "the slowest gap judged against the TPOT objective", "The TPOT objective "
        "applies to the request's mean gap, its TPOT; the slowest gap is an ITL objective.",
        _goodput_slip(slowest=True)),
    Bug("goodput.failed", "failed requests counted as good", "A request with no token failed: it meets no "
        "objective.", _goodput_slip(failed=True)),
    Bug("goodput.fraction", "a share of the requests instead of a rate", "Goodput is a rate: good requests "
        "per second of the run.", _goodput_slip(fraction=True)),
), lambda: [([PROMPT, QUEUED], 4.0, 0.75, 0.125), ([QUEUED], 4.0, 1.0, 0.09), ([NONE, PROMPT], 2.0, 1.0, 1.0),
            ([PROMPT, QUEUED, SLOW_START, ONE], 4.0, 1.0, 0.0625)],
    observe=lambda f, rs, d, t, p: f(list(rs), d, t, p), same=_same_numbers)


def _good(fns, requests, duration, ttft_slo, tpot_slo, what):
    got = expect_number("goodput", call(fns["goodput"], list(requests), duration, ttft_slo, tpot_slo))
    expected = serving_metrics(requests, duration=duration, slo=SLO(ttft=ttft_slo, tpot=tpot_slo)).goodput
    if not _close(got, expected):
        raise Mismatch(f"{what}: got {got:.6g} requests/s; expected {expected:.6g}",
                       **GOODPUT_BUGS.hint(fns, requests, duration, ttft_slo, tpot_slo))


def _goodput_case(requests, ttft_slo, tpot_slo, what):
    return lambda fns: _good(fns, requests, 4.0, ttft_slo, tpot_slo, what)


GOODPUT_HINT = ("For each request of this case, work out by hand its TTFT and its TPOT, and whether it meets "
                "both objectives; then compare with what your function decides for it.")
GOODPUT = Task("goodput", "2.4", ("goodput",), (
    Property("requests per second that meet both objectives", GOODPUT_HINT,
             _goodput_case([PROMPT, QUEUED, SLOW_START], 1.0, 0.0625,
                           "goodput with TTFT <= 1 s and TPOT <= 62.5 ms"), central=True),
    Property("a request exactly at an objective meets it", GOODPUT_HINT,
             _goodput_case([PROMPT, QUEUED], 0.75, 0.125, "goodput with TTFT <= 0.75 s and TPOT <= 125 ms")),
    Property("a one-token request has no TPOT, so it meets any TPOT objective",
             "Which objectives apply to a request whose TPOT is None?",
             _goodput_case([ONE, PROMPT], 0.5, 0.01, "goodput with TPOT <= 10 ms")),
    Property("a request with no token is never good", "What does your function do with a request that has "
             "no token?", _goodput_case([NONE, PROMPT], 1.0, 1.0, "goodput with loose objectives")),
    Property("TPOT is the request's mean gap, not its slowest ITL", GOODPUT_HINT,
             _goodput_case([QUEUED], 1.0, 0.09, "goodput of a request with gaps 62.5, 62.5, 125 ms against "
                                                "TPOT <= 90 ms")),
))


# --- devices_needed --------------------------------------------------------------------------------------

def _reference_devices(concurrency, tpot_slo, rate, request_bytes, device_bytes) -> int:
    by_rate = plan_for_slo(concurrency, 1, tpot_slo, rate).devices_for_tpot
    by_memory = plan_capacity(device_bytes, 0, 0, request_bytes, concurrency).devices_needed
    return max(by_rate, by_memory)


def _devices_slip(floor=False, plus_one=False, no_memory=False, divide=False):
    def devices(concurrency, tpot_slo, rate, request_bytes, device_bytes):
        by_memory = device_bytes // request_bytes
        if by_memory == 0:
            raise ValueError("no request fits")
        by_rate = rate / tpot_slo if divide else rate * tpot_slo
        per_device = by_rate if no_memory else min(by_rate, by_memory)
        if floor or plus_one:
            return int(concurrency / per_device) + plus_one
        return math.ceil(concurrency / per_device)
    return devices


PLAN_PROBES = [(100, 0.03125, 1920.0, 10**8, 40 * 10**9), (64, 0.03125, 100000.0, 32 * 10**8, 44 * 10**9),
               (120, 0.03125, 1920.0, 10**8, 40 * 10**9), (121, 0.03125, 1920.0, 10**8, 40 * 10**9),
               (50, 0.05, 400.0, 5 * 10**8, 4 * 10**9)]
PLAN_BUGS = Catalogue("devices_needed", _reference_devices, (
    Bug("devices.floor", "a division rounded down", "Whole devices: round a fraction up.",
        _devices_slip(floor=True)),
    Bug("devices.plus_one", "one device added to the rounded-down division", "Round up with the ceiling: a "
        "division that comes out whole needs no extra device.", _devices_slip(plus_one=True)),
    Bug("devices.no_memory", "a plan from the decode rate alone", "Memory is a limit too: a device holds only "
        "whole requests' KV caches.", _devices_slip(no_memory=True)),
    Bug("devices.divide", "a decode rate divided by the TPOT objective", "A stream at the objective takes "
        "1 / tpot_slo tokens per second: how many such streams does a device's decode rate feed?",
        _devices_slip(divide=True)),
), lambda: list(PLAN_PROBES))


def _devices(fns, *args) -> int:
    return expect_number("devices_needed", call(fns["devices_needed"], *args), integer=True)


def _plan_case(args, what):
    def run(fns):
        got, expected = _devices(fns, *args), _reference_devices(*args)
        if got != expected:
            raise Mismatch(f"{what}: devices_needed says {got}; expected {expected}", **PLAN_BUGS.hint(fns, *args))
    return run


def _plan_int(fns):
    value = call(fns["devices_needed"], 100, 0.03125, 1920.0, 10**8, 40 * 10**9)
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_value("devices_needed", value, "an int (whole devices)")


def _plan_impossible(fns):
    try:
        value = call(fns["devices_needed"], 10, 0.03125, 1920.0, 50 * 10**9, 40 * 10**9)
    except LearnerError as exc:
        if isinstance(exc.__cause__, ValueError):
            return
        raise
    raise Mismatch(f"a request needing 50 GB of KV cache on a device with 40 GB for KV: devices_needed "
                   f"returned {value!r}; expected it to raise ValueError")


def _plan_rounding(fns):
    for concurrency in (120, 121):
        _plan_case((concurrency, 0.03125, 1920.0, 10**8, 40 * 10**9), f"{concurrency} streams, 60 a device")(fns)


PLAN_HINT = ("Work this case out by hand: how many streams does one device keep by its decode rate, how many "
             "by its memory, which limit binds, and how many devices does that make?")
PLAN = Task("devices_needed", "2.4", ("devices_needed",), (
    Property("returns an int (whole devices)", "What type does your function return?", _plan_int),
    Property("TPOT decides when memory is plentiful", PLAN_HINT,
             _plan_case((100, 0.03125, 1920.0, 10**8, 40 * 10**9),
                        "100 streams, TPOT <= 31.25 ms, 1920 tokens/s a device"), central=True),
    Property("memory decides when each request's KV cache is large", PLAN_HINT,
             _plan_case((64, 0.03125, 100000.0, 32 * 10**8, 44 * 10**9),
                        "64 requests of 3.2 GB on devices with 44 GB for KV"), central=True),
    Property("rounds up to whole devices, and not when it divides exactly", PLAN_HINT, _plan_rounding),
    Property("raises ValueError when one request does not fit on a device",
             "How many requests does a device hold when one request is larger than its memory?",
             _plan_impossible),
))


# --- knee ----------------------------------------------------------------------------------------------

def _walk(sweep, keep_up, strict=False):
    """The last offered rate of ``sweep`` (in its order) before the first that falls behind."""
    knee = None
    for offered, completed in sweep:
        if completed < keep_up * offered or (strict and completed == keep_up * offered):
            break
        knee = offered
    return knee


def _reference_knee(sweep, keep_up=0.9):
    return _walk(sorted(sweep), keep_up)


def _first_fall(sweep, keep_up):
    return next((offered for offered, completed in sorted(sweep) if completed < keep_up * offered), None)


def _completed_at_knee(sweep, keep_up):
    return dict(sweep).get(_reference_knee(sweep, keep_up))


def _any_rate_kept(sweep, keep_up):
    return max((offered for offered, completed in sweep if completed >= keep_up * offered), default=None)


SWEEP = [(10.0, 10.1), (20.0, 19.4), (30.0, 27.9), (40.0, 31.0), (50.0, 30.2)]  # offered, completed req/s
KNEE_BUGS = Catalogue("knee", _reference_knee, (
    Bug("knee.strict", "keeping up only strictly above keep_up x offered", "A run that completes exactly "
        "keep_up x offered keeps up: an objective is met at its bound.",
        lambda s, k=0.9: _walk(sorted(s), k, strict=True)),
    Bug("knee.unsorted", "a walk in the sweep's own order", "The sweep comes in any order: walk it from the "
        "lowest offered rate up.", lambda s, k=0.9: _walk(s, k)),
    Bug("knee.any_rate", "the highest rate that keeps up anywhere in the sweep", "Stop at the first rate the "
        "server falls behind: a higher rate that happens to keep up after it is noise, not capacity.",
        lambda s, k=0.9: _any_rate_kept(s, k)),
    Bug("knee.first_fall", "the first rate that falls behind", "The knee is a rate the server still serves: "
        "the last one before the first fall.", lambda s, k=0.9: _first_fall(s, k)),
    Bug("knee.completed", "the completion rate at the knee", "Return an offered rate, the load you can "
        "promise.", lambda s, k=0.9: _completed_at_knee(s, k)),
    Bug("knee.fixed_keep_up", "a keep_up fixed at 0.9", "Use the keep_up you are given.",
        lambda s, k=0.9: _reference_knee(s)),
    Bug("knee.zero", "0 when no rate keeps up", "When the server falls behind at the lowest rate, no rate of "
        "the sweep is safe: None says so, 0 would read as a rate.", lambda s, k=0.9: _reference_knee(s, k) or 0.0),
), lambda: [(SWEEP, 0.9), ([(10.0, 10.0), (20.0, 18.0), (30.0, 20.0)], 0.9),
            ([SWEEP[3], SWEEP[0], SWEEP[4], SWEEP[2], SWEEP[1]], 0.9),
            ([(10.0, 10.0), (20.0, 15.0), (30.0, 29.5), (40.0, 30.0)], 0.9), ([(10.0, 5.0), (20.0, 6.0)], 0.9),
            ([(10.0, 6.0), (20.0, 11.0), (40.0, 15.0), (80.0, 16.0)], 0.5)],
    observe=lambda f, sweep, keep_up: f(list(sweep), keep_up), same=_same_numbers)


def _knee_case(sweep, keep_up, what):
    def run(fns):
        k = 0.9 if keep_up is None else keep_up
        args = (list(sweep),) if keep_up is None else (list(sweep), keep_up)
        got, expected = call(fns["knee"], *args), _reference_knee(sweep, k)
        if got is not None and (isinstance(got, bool) or not isinstance(got, (int, float))):
            raise wrong_value("knee", got, "an offered rate (a number) or None")
        if not _same_numbers(got, expected):
            raise Mismatch(f"{what}: got {got!r}; expected {expected!r}", **KNEE_BUGS.hint(fns, list(sweep), k))
    return run


KNEE_HINT = ("Walk this sweep by hand from the lowest offered rate: where does it first fall behind "
             "(completed < keep_up x offered), and which rate comes just before?")
KNEE = Task("knee", "2.4", ("knee",), (
    Property("a sweep in order: the last offered rate the server keeps up with", KNEE_HINT,
             _knee_case(SWEEP, None, "the knee of a sweep at 10..50 req/s"), central=True),
    Property("a run completing exactly keep_up x offered keeps up",
             "Which comparison does your code use for keeping up?",
             _knee_case([(10.0, 10.0), (20.0, 18.0), (30.0, 20.0)], 0.9,
                        "the knee where 20 req/s completes exactly 18")),
    Property("the sweep in any order", "In which order does your code walk the sweep?",
             _knee_case([SWEEP[3], SWEEP[0], SWEEP[4], SWEEP[2], SWEEP[1]], None,
                        "the knee of the same sweep, shuffled")),
    Property("the last rate before the first fall, even if a higher rate keeps up again", KNEE_HINT,
             _knee_case([(10.0, 10.0), (20.0, 15.0), (30.0, 29.5), (40.0, 30.0)], 0.9,
                        "the knee of a sweep that falls at 20 and recovers at 30")),
    Property("None when the server falls behind at the lowest rate",
             "What does your function return when no rate keeps up?",
             _knee_case([(10.0, 5.0), (20.0, 6.0)], 0.9, "the knee of a sweep that never keeps up")),
    Property("uses the keep_up fraction it is given", "Where does keep_up enter your comparison?",
             _knee_case([(10.0, 6.0), (20.0, 11.0), (40.0, 15.0), (80.0, 16.0)], 0.5, "the knee at keep_up = 0.5")),
))

register(TTFT, TPOT, ITL, E2E, THROUGHPUT, GOODPUT, PLAN, KNEE)


# --- the payoff ------------------------------------------------------------------------------------------

def compare_metrics(records, duration: float, ttft_slo: float, tpot_slo: float, ttft, tpot, itls, e2e,
                    throughput, goodput) -> dict[str, float]:
    """The learner's metrics of a measured run next to minillm.analysis.metrics (ms and per second); the learner's
    numbers by name. Call it once ``ready`` passes for the six functions."""
    ref = serving_metrics(records, duration=duration, slo=SLO(ttft=ttft_slo, tpot=tpot_slo))
    done = [r for r in records if r.token_times]
    tpots = [v for v in (call(tpot, r) for r in done) if v is not None]
    requests_s, tokens_s = call(throughput, list(records), duration)
    yours = {
        "TTFT mean (ms)": 1e3 * statistics.fmean(call(ttft, r) for r in done),
        "TPOT mean (ms)": 1e3 * statistics.fmean(tpots) if tpots else math.nan,
        "ITL mean (ms)": 1e3 * statistics.fmean(g for r in done for g in call(itls, r)),
        "E2E mean (ms)": 1e3 * statistics.fmean(call(e2e, r) for r in done),
        "requests / s": requests_s, "output tokens / s": tokens_s,
        "goodput (requests / s)": call(goodput, list(records), duration, ttft_slo, tpot_slo),
    }
    theirs = [1e3 * ref.ttft.mean, 1e3 * ref.tpot.mean if ref.tpot.n else math.nan, 1e3 * ref.itl.mean,
              1e3 * ref.e2e.mean, ref.request_throughput, ref.output_throughput, ref.goodput]
    print(f"{len(records)} requests, {ref.output_tokens} output tokens in {duration:.2f} s; "
          f"SLO: TTFT <= {ttft_slo * 1e3:.0f} ms, TPOT <= {tpot_slo * 1e3:.0f} ms")
    print(f"{'':<26}{'yours':>12}{'minillm.analysis.metrics':>26}")
    for (name, value), reference in zip(yours.items(), theirs):
        print(f"{name:<26}{value:>12.2f}{reference:>26.2f}")
    agree = all(math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
                for a, b in zip(yours.values(), theirs))
    print("your metrics agree with minillm.analysis.metrics" if agree else "some of your metrics DIFFER from the "
          "reference on this run")
    return yours


def _cpu_clock(device=None) -> float:
    return time.process_time()  # one thread: the time this process computed, even on a shared machine


def sustained_decode(model, tpot_slo: float, context_len: int,
                     batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> tuple[int, float, int | None]:
    """The steady decode rate at the load a plan assigns a device: (the largest batch whose decode step
    meets ``tpot_slo``, the tokens/s the device sustains there, the next batch, which missed; None if
    none did). Each batch is a median of steady decode steps (no prefill, no idle time) of rows that
    attend ``context_len`` positions; each row gets one token a step, so a step <= tpot_slo meets the
    objective. Prints one line per batch."""
    print(f"steady decode steps at a context of {context_len} tokens (median of 3, CPU time):")
    best, missed = None, None
    for batch in batches:
        step = time_decode_step(model, context_len, batch, repeats=3, clock=_cpu_clock)
        meets = step <= tpot_slo
        print(f"    batch {batch:>3}: {step * 1e3:7.1f} ms a step, {batch / step:7.1f} tokens/s, "
              f"{'meets' if meets else 'misses'} TPOT <= {tpot_slo * 1e3:.0f} ms")
        if not meets:
            missed = batch
            break
        best = (batch, batch / step)
    if best is None:  # not even one stream meets the objective: the plan will say so
        best = (batches[0], batches[0] / step)
    return best[0], best[1], missed


def compare_plan(devices_needed, concurrency: int, tpot_slo: float, decode_tokens_per_s: float,
                 kv_bytes_per_request: int, kv_bytes_per_device: int) -> int:
    """The learner's capacity plan next to minillm's (plan_for_slo and plan_capacity). Call it once
    ``ready(devices_needed)`` passes."""
    args = (concurrency, tpot_slo, decode_tokens_per_s, kv_bytes_per_request, kv_bytes_per_device)
    yours, reference = call(devices_needed, *args), _reference_devices(*args)
    by_rate = decode_tokens_per_s * tpot_slo
    by_memory = kv_bytes_per_device // kv_bytes_per_request
    print(f"{concurrency} streams at TPOT <= {tpot_slo * 1e3:.0f} ms; a device decodes "
          f"{decode_tokens_per_s:.1f} tokens/s and keeps {kv_bytes_per_device / 1e9:.1f} GB for KV caches")
    print(f"    streams a device keeps: {by_rate:.1f} by its decode rate, {by_memory} by its memory "
          f"({kv_bytes_per_request / 1e6:.1f} MB a request)")
    print(f"    devices: yours {yours}, minillm's {reference}; "
          f"{'memory' if by_memory < by_rate else 'the decode rate'} decides")
    if by_rate < 1:
        show_text("    ", "but a device that keeps less than one stream cannot meet the TPOT objective even "
                  "for one stream, so no number of such devices can: the plan needs faster devices")
    return yours


CHAT = dict(prompt_len=(16, 64), output_len=(8, 16))  # chapter 2.4's chat workload


def _engine_run(model, requests, concurrency=None):
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    engine = Engine(model, EngineConfig(max_batch_size=8, num_blocks=8 * blocks_for(longest, 16)))
    return engine.run(requests, concurrency)


def rate_sweep(model, loads=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0), n=64) -> tuple[float, list]:
    """Chapter 2.4's load sweep on ``model``: (the capacity, a list of (offered, completed) req/s). The
    capacity is a closed loop's steady-window rate (160 requests, 8 users); each load is an open-loop run of
    ``n`` Poisson arrivals at that fraction of it, whose completions are counted in its steady window."""
    requests = dict(vocab_size=model.config.vocab_size, **CHAT)
    closed = _engine_run(model, random_requests(160, seed=11, **requests), concurrency=8)
    capacity = steady_window(closed.requests).rate
    sweep = []
    for i, load in enumerate(loads):
        arrivals = poisson_arrivals(n, load * capacity, seed=7 + i)
        run = _engine_run(model, random_requests(n, seed=6, arrival_times=arrivals, **requests))
        sweep.append(((n - 1) / arrivals[-1], steady_window(run.requests).rate))
    return capacity, sweep


def compare_knee(knee, capacity: float, sweep: list, keep_up: float = 0.9):
    """The measured sweep, the learner's knee and minillm's. Call it once ``ready(knee)`` passes."""
    print(f"capacity (closed loop, steady window): {capacity:.1f} req/s")
    print(f"{'offered':>10}{'completed':>11}{'ratio':>8}")
    for offered, completed in sorted(sweep):
        print(f"{offered:10.1f}{completed:11.1f}{completed / offered:8.2f}")
    yours, reference = call(knee, list(sweep), keep_up), _reference_knee(sweep, keep_up)
    mark = "same" if yours == reference else "DIFFERENT"
    def rate(value):
        return "None" if value is None else f"{value:.1f} req/s"

    print(f"knee (completed >= {keep_up:g} x offered): yours {rate(yours)}, minillm's {rate(reference)} ({mark})")
    if reference is not None:
        print(f"    the knee is {reference / capacity:.2f}x the closed loop's capacity")
    return yours
