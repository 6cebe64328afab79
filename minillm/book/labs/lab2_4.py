"""Lab 2.4: serving metrics from timestamps (vLLM's definitions) and a capacity plan.

The learner writes ``ttft``, ``tpot``, ``itls``, ``e2e``, ``throughput``, ``goodput`` and
``devices_needed``; :mod:`minillm.analysis.metrics` and :mod:`minillm.analysis.arithmetic` are the reference.
``compare_metrics`` and ``compare_plan`` are the lab's payoff, on timestamps the lab measures.
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
from ...engine import Engine, blocks_for
from ...engine.workload import poisson_arrivals, random_requests
from .cases import show_text
from .checker import LearnerError, Mismatch, Property, Task, call, expect_number, register, wrong_value


def _r(arrival: float, *times: float, prompt_len: int = 10) -> RequestTiming:
    return RequestTiming(arrival, list(times), prompt_len)


# Hidden requests: arrival, token times (s). Times are multiples of 1/64 so sums are exact.
QUEUED = _r(1.0, 1.75, 1.8125, 1.875, 2.0)  # waited, then four tokens with uneven gaps
PROMPT = _r(0.0, 0.25, 0.3125, 0.375, 0.4375, 0.5)
SLOW_START = _r(0.0, 2.25, 2.3125, 2.375, 2.4375, 2.5)  # same gaps as PROMPT, later first token
ONE = _r(0.5, 0.875)
NONE = _r(0.25)


def _value(fns, name, request):
    return expect_number(name, call(fns[name], request))


def _same(got: float, expected: float, what: str) -> None:
    if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
        raise Mismatch(f"{what}: got {got:.6g}")


def _per_request(name, reference, requests, what, bugs=()):
    """Each request's value against the reference; ``bugs``: (hint, what that bug computes) for the hint."""
    def run(fns):
        for request in requests:
            got, expected = _value(fns, name, request), reference(request)
            if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
                hint = next((h for h, bug in bugs if math.isclose(got, bug(request), rel_tol=1e-9)), None)
                raise Mismatch(f"{what} of a request arriving at {request.arrival_time} s with tokens at "
                               f"{list(request.token_times)} s: got {got:.6g}", hint)
    return run


N_GAPS_HINT = "TPOT averages the time between tokens over one request; n tokens have n - 1 gaps."
ARRIVAL_HINT = "Start from the first token's time, not the arrival: TPOT leaves out the wait and the prefill."
TPOT_BUGS = ((N_GAPS_HINT, lambda r: (r.token_times[-1] - r.token_times[0]) / len(r.token_times)),
             (ARRIVAL_HINT, lambda r: (r.token_times[-1] - r.arrival_time) / (len(r.token_times) - 1)),
             (ARRIVAL_HINT, lambda r: (r.token_times[-1] - r.arrival_time) / len(r.token_times)))


TTFT = Task("ttft", "2.4", ("ttft",), (
    Property("returns a number of seconds", "Return a float.", _per_request("ttft", reference_ttft, [PROMPT],
                                                                            "TTFT")),
    Property("first token time - arrival time, the wait in the queue included",
             "TTFT starts when the request arrives, not when it starts running.",
             _per_request("ttft", reference_ttft, [QUEUED, ONE, SLOW_START], "TTFT")),
))


def _tpot_one(fns):
    value = call(fns["tpot"], ONE)
    if value is not None:
        raise Mismatch(f"for a request with one token, tpot returned {value!r}")


TPOT = Task("tpot", "2.4", ("tpot",), (
    Property("(last token - first token) / (tokens - 1), one value per request", N_GAPS_HINT,
             _per_request("tpot", reference_tpot, [PROMPT, QUEUED], "TPOT", TPOT_BUGS)),
    Property("excludes the first token: a late first token does not change it", ARRIVAL_HINT,
             _per_request("tpot", reference_tpot, [SLOW_START], "TPOT", TPOT_BUGS)),
    Property("is None (undefined) for a request with one token, not 0",
             "One token has no gap: return None.", _tpot_one),
))


def _itls(fns, request):
    gaps = call(fns["itls"], request)
    if not isinstance(gaps, (list, tuple)):
        raise wrong_value("itls", gaps, "a list of gaps in seconds")
    return [expect_number("itls", g) for g in gaps]


def _itls_count(fns):
    for request in (PROMPT, QUEUED, ONE):
        gaps = _itls(fns, request)
        if len(gaps) != len(request.token_times) - 1:
            raise Mismatch(f"{len(request.token_times)} tokens gave {len(gaps)} gaps")


def _itls_values(fns):
    for request in (QUEUED, SLOW_START):
        got = _itls(fns, request)
        if len(got) != len(request.token_times) - 1 or any(
                not math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, reference_itls(request))):
            raise Mismatch(f"tokens at {list(request.token_times)} s gave gaps {[round(g, 4) for g in got]}")


ITL = Task("itls", "2.4", ("itls",), (
    Property("one gap per pair of consecutive tokens (n tokens, n - 1 gaps; none for one token)",
             "Pair each token time with the next one.", _itls_count),
    Property("each gap is the time between two consecutive tokens",
             "The arrival time plays no part in an ITL.", _itls_values),
))


E2E = Task("e2e", "2.4", ("e2e",), (
    Property("last token time - arrival time",
             "End to end: from arrival to the last token.",
             _per_request("e2e", e2e_latency, [PROMPT, QUEUED, SLOW_START], "E2E latency")),
    Property("for a one-token request it equals the TTFT",
             "With one token, the first token is the last.", _per_request("e2e", e2e_latency, [ONE],
                                                                          "E2E latency")),
))


# --- throughput and goodput --------------------------------------------------------------------------

RUN = [PROMPT, QUEUED, ONE, NONE, SLOW_START]  # NONE produced no token: a failed request


def _pair(fns, requests, duration):
    out = call(fns["throughput"], list(requests), duration)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("throughput", out, "a pair (requests per second, "
                          "output tokens per second)")
    return expect_number("throughput", out[0]), expect_number("throughput", out[1])


def _throughput_tokens(fns):
    metrics = serving_metrics(RUN, duration=4.0)
    _same(_pair(fns, RUN, 4.0)[1], metrics.output_throughput, "output tokens per second over 4 s")


def _throughput_requests(fns):
    metrics = serving_metrics(RUN, duration=4.0)
    _same(_pair(fns, RUN, 4.0)[0], metrics.request_throughput,
          "completed requests per second over 4 s (one of the 5 requests produced no token)")


THROUGHPUT = Task("throughput", "2.4", ("throughput",), (
    Property("output tokens per second of the run",
             "Count every output token of every request and divide by the duration.", _throughput_tokens),
    Property("completed requests per second: a request with no token is not completed",
             "A request completes when it produced at least one token.", _throughput_requests),
))


STRICT_HINT = "Meeting an objective means <=, not <: a request exactly at it meets it."
SLOWEST_GAP_HINT = ("That is the slowest gap (an ITL objective): the TPOT objective applies to the request's "
                    "mean gap, (last - first) / (n - 1).")
FAILED_HINT = "A request with no token failed: it meets no objective, so it is never good."
RATE_OF_HINT = "Goodput is a rate: divide the number of good requests by the duration, not by the request count."


def _goodput_variant(requests, duration, ttft_slo, tpot_slo, strict=False, slowest=False, failed=False,
                     fraction=False) -> float:
    """The goodput a known bug computes."""
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


def _good(fns, requests, duration, ttft_slo, tpot_slo, what):
    got = expect_number("goodput", call(fns["goodput"], list(requests), duration, ttft_slo, tpot_slo))
    expected = serving_metrics(requests, duration=duration, slo=SLO(ttft=ttft_slo, tpot=tpot_slo)).goodput
    if math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
        return
    bugs = ((SLOWEST_GAP_HINT, {"slowest": True}), (STRICT_HINT, {"strict": True}), (FAILED_HINT, {"failed": True}),
            (RATE_OF_HINT, {"fraction": True}))
    values = {h: _goodput_variant(requests, duration, ttft_slo, tpot_slo, **bug) for h, bug in bugs}
    matches = [h for h, value in values.items() if math.isclose(got, value, rel_tol=1e-9)]
    hint = matches[0] if len(matches) == 1 else None  # two bugs that give the same value: say neither
    raise Mismatch(f"{what}: got {got:.6g}", hint)


def _goodput_case(requests, ttft_slo, tpot_slo, what):
    return lambda fns: _good(fns, requests, 4.0, ttft_slo, tpot_slo, what)


GOODPUT = Task("goodput", "2.4", ("goodput",), (
    Property("requests per second that meet both objectives",
             "Count the requests whose TTFT and TPOT are both within their objective; divide by the "
             "duration.", _goodput_case([PROMPT, QUEUED, SLOW_START], 1.0, 0.0625,
                                         "goodput with TTFT <= 1 s and TPOT <= 62.5 ms")),
    Property("a request exactly at an objective meets it", STRICT_HINT,
             _goodput_case([PROMPT, QUEUED], 0.75, 0.125, "goodput with TTFT <= 0.75 s and TPOT <= 125 ms")),
    Property("a one-token request has no TPOT, so it meets any TPOT objective",
             "Only the TTFT objective applies to it: tpot returns None for it.",
             _goodput_case([ONE, PROMPT], 0.5, 0.01, "goodput with TPOT <= 10 ms")),
    Property("a request with no token is never good", FAILED_HINT,
             _goodput_case([NONE, PROMPT], 1.0, 1.0, "goodput with loose objectives")),
    Property("TPOT is the request's mean gap, not its slowest ITL", SLOWEST_GAP_HINT,
             _goodput_case([QUEUED], 1.0, 0.09, "goodput of a request with gaps 62.5, 62.5, 125 ms "
                                                "against TPOT <= 90 ms")),
))


# --- devices_needed --------------------------------------------------------------------------------------

def _reference_devices(concurrency, tpot_slo, rate, request_bytes, device_bytes) -> int:
    by_rate = plan_for_slo(concurrency, 1, tpot_slo, rate).devices_for_tpot
    by_memory = plan_capacity(device_bytes, 0, 0, request_bytes, concurrency).devices_needed
    return max(by_rate, by_memory)


def _devices(fns, *args) -> int:
    return expect_number("devices_needed", call(fns["devices_needed"], *args), integer=True)


CEIL_HINT = "Use the ceiling of a division (math.ceil); a whole number needs no extra device."
PER_STREAM_HINT = ("A stream at the TPOT objective takes 1 / tpot_slo tokens per second, so a device keeps "
                   "decode_tokens_per_s * tpot_slo streams (multiply, do not divide).")
MEMORY_HINT = "A device holds kv_bytes_per_device // kv_bytes_per_request whole requests: memory can decide."


def _plan_bugs(concurrency, tpot_slo, rate, request_bytes, device_bytes):
    per_device = min(rate * tpot_slo, device_bytes // request_bytes)
    return ((CEIL_HINT, int(concurrency / per_device)), (CEIL_HINT, int(concurrency / per_device) + 1),
            (MEMORY_HINT, math.ceil(concurrency / (rate * tpot_slo))),
            (PER_STREAM_HINT, math.ceil(concurrency / min(rate / tpot_slo, device_bytes // request_bytes))))


def _plan_case(args, what):
    def run(fns):
        got, expected = _devices(fns, *args), _reference_devices(*args)
        if got != expected:
            hint = next((h for h, bug in _plan_bugs(*args) if bug == got and bug != expected), None)
            raise Mismatch(f"{what}: devices_needed says {got}", hint)
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
                   f"returned {value!r} instead of raising ValueError")


def _plan_rounding(fns):
    for concurrency in (120, 121):
        _plan_case((concurrency, 0.03125, 1920.0, 10**8, 40 * 10**9),
                   f"{concurrency} streams, 60 a device")(fns)


PLAN = Task("devices_needed", "2.4", ("devices_needed",), (
    Property("returns an int (whole devices)", "Round up with math.ceil and return an int.", _plan_int),
    Property("TPOT decides when memory is plentiful", PER_STREAM_HINT,
             _plan_case((100, 0.03125, 1920.0, 10**8, 40 * 10**9),
                        "100 streams, TPOT <= 31.25 ms, 1920 tokens/s a device")),
    Property("memory decides when each request's KV cache is large", MEMORY_HINT,
             _plan_case((64, 0.03125, 100000.0, 32 * 10**8, 44 * 10**9),
                        "64 requests of 3.2 GB on devices with 44 GB for KV")),
    Property("rounds up to whole devices, and not when it divides exactly", CEIL_HINT, _plan_rounding),
    Property("raises ValueError when one request does not fit on a device",
             "If a device holds 0 requests, no number of devices serves them: raise ValueError with a "
             "message.", _plan_impossible),
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


KNEE_STRICT_HINT = ("A run that completes exactly keep_up x offered keeps up: compare with >=, as an "
                    "objective is met at its bound.")
KNEE_SORT_HINT = "The sweep comes in any order: sort it by offered rate before walking up the loads."
KNEE_FIRST_FALL_HINT = ("Stop at the first rate the server falls behind: a higher rate that happens to keep "
                        "up after it is noise, not capacity. The knee is the last rate before the first fall.")
KNEE_FALLING_HINT = ("Return the last offered rate that kept up, not the first one that fell behind: the knee "
                     "is a rate the server still serves.")
KNEE_OFFERED_HINT = "Return an offered rate (the load you can promise), not the completion rate measured there."
KNEE_NONE_HINT = "When the server falls behind at the lowest rate already, no rate of the sweep is safe: return None."
KNEE_ARG_HINT = "Use the keep_up argument you are given; the default 0.9 is only a default."


def _first_fall(sweep, keep_up):
    return next((offered for offered, completed in sorted(sweep) if completed < keep_up * offered), None)


def _completed_at_knee(sweep, keep_up):
    return dict(sweep).get(_reference_knee(sweep, keep_up))


def _any_rate_kept(sweep, keep_up):
    return max((offered for offered, completed in sweep if completed >= keep_up * offered), default=None)


KNEE_BUGS = (  # (hint, what the bug returns)
    (KNEE_STRICT_HINT, lambda sweep, keep_up: _walk(sorted(sweep), keep_up, strict=True)),
    (KNEE_SORT_HINT, _walk),
    (KNEE_FIRST_FALL_HINT, _any_rate_kept),
    (KNEE_FALLING_HINT, _first_fall),
    (KNEE_OFFERED_HINT, _completed_at_knee),
    (KNEE_ARG_HINT, lambda sweep, keep_up: _reference_knee(sweep)),
)


def _knee_case(sweep, keep_up, what, hint=None):
    def run(fns):
        args = (list(sweep),) if keep_up is None else (list(sweep), keep_up)
        got = call(fns["knee"], *args)
        expected = _reference_knee(sweep, 0.9 if keep_up is None else keep_up)
        if got is None or expected is None:
            if got is not expected:
                raise Mismatch(f"{what}: got {got!r}, expected {expected!r}",
                               KNEE_NONE_HINT if expected is None else hint)
            return
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise wrong_value("knee", got, "an offered rate (a number) or None")
        if not math.isclose(got, expected):
            k = 0.9 if keep_up is None else keep_up
            found = next((h for h, bug in KNEE_BUGS
                          if (b := bug(list(sweep), k)) is not None and math.isclose(got, b)), None)
            raise Mismatch(f"{what}: got {got:g} req/s", found or hint)
    return run


KNEE_HINT = "Walk up the offered rates; the knee is the last one where completed >= keep_up x offered."
SWEEP = [(10.0, 10.1), (20.0, 19.4), (30.0, 27.9), (40.0, 31.0), (50.0, 30.2)]  # offered, completed req/s
KNEE = Task("knee", "2.4", ("knee",), (
    Property("a sweep in order: the last offered rate the server keeps up with", KNEE_HINT,
             _knee_case(SWEEP, None, "the knee of a sweep at 10..50 req/s")),
    Property("a run completing exactly keep_up x offered keeps up", KNEE_STRICT_HINT,
             _knee_case([(10.0, 10.0), (20.0, 18.0), (30.0, 20.0)], 0.9,
                        "the knee where 20 req/s completes exactly 18")),
    Property("the sweep in any order", KNEE_SORT_HINT,
             _knee_case([SWEEP[3], SWEEP[0], SWEEP[4], SWEEP[2], SWEEP[1]], None,
                        "the knee of the same sweep, shuffled")),
    Property("the last rate before the first fall, even if a higher rate keeps up again", KNEE_FIRST_FALL_HINT,
             _knee_case([(10.0, 10.0), (20.0, 15.0), (30.0, 29.5), (40.0, 30.0)], 0.9,
                        "the knee of a sweep that falls at 20 and recovers at 30")),
    Property("None when the server falls behind at the lowest rate", KNEE_NONE_HINT,
             _knee_case([(10.0, 5.0), (20.0, 6.0)], 0.9, "the knee of a sweep that never keeps up")),
    Property("uses the keep_up fraction it is given", KNEE_ARG_HINT,
             _knee_case([(10.0, 6.0), (20.0, 11.0), (40.0, 15.0), (80.0, 16.0)], 0.5,
                        "the knee at keep_up = 0.5")),
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
    engine = Engine(model, max_batch_size=8, num_blocks=8 * blocks_for(longest, 16))
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
