"""Synthetic serving workloads: arrival schedules and random requests (as vLLM's benchmark draws them). No
tensors and no engine: a load generator draws the same workload for any server."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

from ..request import Request
from ..sampling import SamplingParams
from ..validate import check_int, check_number, check_seed

LENGTH_DISTS = ("uniform", "loguniform")


def poisson_arrivals(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Arrival times in seconds for ``n`` requests, the first at 0.

    Gaps between arrivals are gamma-distributed with shape ``burstiness`` and mean ``1/rate``
    (vLLM's benchmark_serving): burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular.
    ``rate=math.inf`` means all at once.
    """
    check_int("n", n, minimum=0)
    if not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"rate={rate!r} requests/s must be > 0 (math.inf for all at once)")
    check_number("burstiness", burstiness)
    check_seed("seed", seed)
    if rate == math.inf:
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))  # mean shape x scale = 1/rate
    return times


def _draw_length(rng: random.Random, bounds: tuple[int, int], dist: str) -> int:
    lo, hi = bounds
    if dist == "uniform":
        return rng.randint(lo, hi)
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))  # log-uniform on [lo, hi]


def _check_range(name: str, bounds) -> tuple[int, int]:
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
        raise TypeError(f"{name}={bounds!r} must be a (low, high) pair of ints")
    lo, hi = bounds
    check_int(f"{name}[0]", lo)
    check_int(f"{name}[1]", hi)
    if lo > hi:
        raise ValueError(f"{name}={tuple(bounds)}: low {lo} > high {hi}")
    return lo, hi


def random_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                    vocab_size: int = 256, arrival_times: Sequence[float] | None = None,
                    length_dist: str = "uniform", sampling: SamplingParams | None = None,
                    ignore_eos: bool = True) -> list[Request]:
    """``n`` requests with random prompt ids in [0, vocab_size) and lengths drawn in the closed ranges.

    ``length_dist``: "uniform" (every length equally likely) or "loguniform" (short ones common, long
    ones rare: a long tail, closer to chat traffic). ``arrival_times``: one per request (default all 0).
    ``max_tokens`` is the drawn output length; with ``ignore_eos`` (default, as vLLM's random
    benchmark) each request produces exactly that many tokens. Request ids are 0..n-1; each request
    gets its own sampling seed.
    """
    check_int("n", n, minimum=0)
    p_range, o_range = _check_range("prompt_len", prompt_len), _check_range("output_len", output_len)
    check_int("vocab_size", vocab_size)
    if length_dist not in LENGTH_DISTS:
        raise ValueError(f"unknown length_dist {length_dist!r}; choose one of {LENGTH_DISTS}")
    check_seed("seed", seed)
    arrival_times = [0.0] * n if arrival_times is None else list(arrival_times)
    if len(arrival_times) != n:
        raise ValueError(f"{len(arrival_times)} arrival times given for n={n} requests")
    rng = random.Random(seed)
    requests = []
    for i, arrival in enumerate(arrival_times):
        prompt = [rng.randrange(vocab_size) for _ in range(_draw_length(rng, p_range, length_dist))]
        requests.append(Request(i, prompt, _draw_length(rng, o_range, length_dist),
                                sampling=sampling or SamplingParams(), ignore_eos=ignore_eos,
                                arrival_time=arrival, seed=rng.randrange(2**31)))
    return requests
