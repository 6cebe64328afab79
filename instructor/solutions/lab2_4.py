"""Reference solutions of lab 2.4 (book/labs/lab2_4_metrics.ipynb), for instructors."""
import math


def ttft(request):
    """Time to first token (s): first token time - arrival time."""
    return request.token_times[0] - request.arrival_time


def tpot(request):
    """Time per output token (s) after the first; None for a one-token request."""
    n = len(request.token_times)
    if n < 2:
        return None
    return (request.token_times[-1] - request.token_times[0]) / (n - 1)


def itls(request):
    """Every gap (s) between consecutive tokens of one request."""
    times = request.token_times
    return [b - a for a, b in zip(times, times[1:])]


def e2e(request):
    """End-to-end latency (s): last token time - arrival time."""
    return request.token_times[-1] - request.arrival_time


def throughput(requests, duration):
    """(completed requests per second, output tokens per second) over a run of ``duration`` s."""
    completed = [r for r in requests if len(r.token_times) > 0]
    return len(completed) / duration, sum(len(r.token_times) for r in completed) / duration


def goodput(requests, duration, ttft_slo, tpot_slo):
    """Requests per second that produced tokens and meet both objectives."""
    good = 0
    for r in requests:
        if not r.token_times:
            continue
        per_token = tpot(r)
        if ttft(r) <= ttft_slo and (per_token is None or per_token <= tpot_slo):
            good += 1
    return good / duration


def devices_needed(concurrency, tpot_slo, decode_tokens_per_s, kv_bytes_per_request, kv_bytes_per_device):
    """The fewest devices that keep ``concurrency`` streams within the TPOT objective and in memory."""
    by_memory = kv_bytes_per_device // kv_bytes_per_request
    if by_memory == 0:
        raise ValueError(f"one request needs {kv_bytes_per_request} B of KV cache; a device has "
                         f"{kv_bytes_per_device} B")
    by_rate = decode_tokens_per_s * tpot_slo
    return math.ceil(concurrency / min(by_rate, by_memory))


def knee(sweep, keep_up=0.9):
    """The highest offered rate the server keeps up with, at it and at every lower rate of the sweep."""
    best = None
    for offered, completed in sorted(sweep):
        if completed < keep_up * offered:
            break
        best = offered
    return best
