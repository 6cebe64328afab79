"""Capacity planning: how many requests fit a device's memory, and how many devices meet a latency SLO."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..intmath import ceil_div
from ..validate import check_int, check_number


@dataclass(frozen=True)
class CapacityPlan:
    """How many requests fit on one device, and how many devices a target concurrency needs.

    Weights are replicated on every device (no tensor parallelism): each device holds
    ``weight_bytes`` + ``reserve_bytes`` + its requests' KV caches.
    """

    device_bytes: int
    weight_bytes: int
    reserve_bytes: int
    request_bytes: int
    free_bytes: int  # device - weights - reserve: what is left for KV caches
    requests_exact: float  # free / request, before rounding down
    requests_per_device: int  # floor(free / request): whole requests only
    target_concurrency: int | None
    devices_needed: int | None  # ceil(target / requests_per_device)

    @property
    def total_weight_bytes(self) -> int | None:
        """Weight bytes over all devices of the plan (one replica per device)."""
        return None if self.devices_needed is None else self.devices_needed * self.weight_bytes


def plan_capacity(device_bytes: int, weight_bytes: int, reserve_bytes: int,
                  request_bytes: int,
                  target_concurrency: int | None = None) -> CapacityPlan:
    """Requests per device = floor((device - weights - reserve) / request); devices for a
    target concurrency = ceil(target / requests per device). All arguments in bytes."""
    check_int("device_bytes", device_bytes)
    check_int("weight_bytes", weight_bytes, minimum=0)
    check_int("reserve_bytes", reserve_bytes, minimum=0)
    check_int("request_bytes", request_bytes)
    free = device_bytes - weight_bytes - reserve_bytes
    if free <= 0:
        raise ValueError(f"weights ({weight_bytes} B) + reserve ({reserve_bytes} B) "
                         f"leave no room on a device of {device_bytes} B")
    per_device = free // request_bytes
    devices = None
    if target_concurrency is not None:
        check_int("target_concurrency", target_concurrency)
        if per_device == 0:
            raise ValueError(f"one request needs {request_bytes} B but a device has only "
                             f"{free} B free; no number of devices serves "
                             f"target_concurrency={target_concurrency}")
        devices = ceil_div(target_concurrency, per_device)
    return CapacityPlan(device_bytes, weight_bytes, reserve_bytes, request_bytes, free,
                        free / request_bytes, per_device, target_concurrency, devices)


@dataclass(frozen=True)
class SLOPlan:
    """How many devices serve ``concurrency`` streams within the SLOs (see :func:`plan_for_slo`)."""

    request_time: float  # s a request takes at the SLO limits
    request_rate: float  # req/s the fleet completes at that concurrency (Little's law)
    decode_tokens_per_s_needed: float  # concurrency / tpot_slo, tokens/s over the fleet
    streams_per_device: float  # concurrent streams one device keeps within TPOT, its prefills included
    devices_for_tpot: int
    prefill_time: float | None  # s for one prompt, alone
    prompts_per_device_within_ttft: int | None  # prompts one device can prefill together within TTFT
    devices_for_ttft: int | None
    devices: int | None  # None: no number of devices meets the TTFT SLO (one prefill is too slow)
    prefill_share: float  # fraction of each device's time its prompts' prefill would take on its own
    ttft_estimate: float | None  # s: one decode step of waiting + the device's share of the burst's prefill
    limited_by: str  # "tpot", "ttft", or why there is no plan
    prefill_overlap: bool  # the step model: prompt tokens ride in decode steps (True) or stall them


def plan_for_slo(concurrency: int, output_tokens: int, tpot_slo: float, decode_tokens_per_s: float,
                 ttft_slo: float | None = None, prompt_tokens: int | None = None,
                 prefill_tokens_per_s: float | None = None, burst: int = 1,
                 prefill_overlap: bool = True) -> SLOPlan:
    """Devices needed for ``concurrency`` simultaneous streams under a TPOT (and optionally TTFT) SLO.

    Model (stated, simple, per device; every running stream gets one token per decode step):
      * a device keeps m streams within TPOT when a step of m rows takes at most ``tpot_slo``. Its memory
        time is ``m / decode_tokens_per_s`` (the sustained decode rate: weights and KV read once per step);
        its compute time covers the m decode tokens and the prompt tokens that arrive meanwhile,
        ``m / request_time * prompt_tokens * tpot_slo`` a step, at ``prefill_tokens_per_s``;
      * ``prefill_overlap=True`` (continuous batching with mixed steps, as minillm's engine and vLLM run:
        chapter 2.3's one step for both phases): prompt tokens ride in the decode steps, and a step takes
        the larger of its memory and its compute time. ``False``: prefills run as separate steps that stall
        decoding, and the two times add (prefill deducted from decode capacity, an upper bound on devices);
      * a request takes ``ttft_slo + (output_tokens - 1) * tpot_slo`` (or ``output_tokens * tpot_slo`` with
        no TTFT SLO, as the source does), so the fleet completes ``concurrency / request_time``
        requests/s (Little's law);
      * TTFT >= one decode step of waiting + the prefill of every prompt that arrives together on the
        device: ``burst`` prompts arriving at once, spread evenly, give ``ceil(burst / devices)`` each.
    ``decode_tokens_per_s`` must be what the device sustains at the resulting streams per device; the
    plan cannot check that (measure it). Queueing beyond one burst is not modelled: a lower bound on TTFT.
    """
    check_int("concurrency", concurrency)
    check_int("output_tokens", output_tokens)
    check_number("tpot_slo", tpot_slo)
    check_number("decode_tokens_per_s", decode_tokens_per_s)
    check_int("burst", burst)
    if not isinstance(prefill_overlap, bool):
        raise TypeError(f"prefill_overlap={prefill_overlap!r} must be True or False")
    prefill_args = (ttft_slo, prompt_tokens, prefill_tokens_per_s)
    if any(a is not None for a in prefill_args) and any(a is None for a in prefill_args):
        raise ValueError("give ttft_slo, prompt_tokens and prefill_tokens_per_s together (or none of them); "
                         f"got {prefill_args}")
    with_ttft = ttft_slo is not None
    if with_ttft:
        check_number("ttft_slo", ttft_slo)
        check_int("prompt_tokens", prompt_tokens)
        check_number("prefill_tokens_per_s", prefill_tokens_per_s)
    request_time = (ttft_slo + (output_tokens - 1) * tpot_slo) if with_ttft else output_tokens * tpot_slo
    streams = decode_tokens_per_s * tpot_slo  # memory time alone: m / decode rate <= tpot
    prefill_time = prompt_tokens / prefill_tokens_per_s if with_ttft else None
    if with_ttft:
        prompt_per_row = prompt_tokens * tpot_slo / request_time  # prompt tokens per step, per stream
        if prefill_overlap:  # compute time: m * (1 + prompt_per_row) / prefill rate <= tpot
            streams = min(streams, tpot_slo * prefill_tokens_per_s / (1 + prompt_per_row))
        else:  # m / decode rate + m * prompt_per_row / prefill rate <= tpot
            streams /= 1 + streams * prefill_time / request_time
    devices_tpot = math.ceil(concurrency / streams)
    devices, limited_by, k_max, devices_ttft, ttft_est = devices_tpot, "tpot", None, None, None
    if with_ttft:
        k_max = math.floor((ttft_slo - tpot_slo) / prefill_time) if ttft_slo > tpot_slo else 0
        if k_max < 1:
            devices, limited_by = None, (f"ttft: one prompt's prefill ({prefill_time * 1e3:.1f} ms) plus one decode "
                                         f"step ({tpot_slo * 1e3:.1f} ms) exceeds the TTFT SLO "
                                         f"({ttft_slo * 1e3:.1f} ms) on any number of devices")
        else:
            devices_ttft = ceil_div(burst, k_max)
            if devices_ttft > devices_tpot:
                devices, limited_by = devices_ttft, "ttft"
    n = devices or devices_tpot
    share = (concurrency / n / request_time * prefill_time) if with_ttft else 0.0
    if with_ttft:
        ttft_est = tpot_slo + ceil_div(burst, n) * prefill_time
    return SLOPlan(request_time=request_time, request_rate=concurrency / request_time,
                   decode_tokens_per_s_needed=concurrency / tpot_slo, streams_per_device=streams,
                   devices_for_tpot=devices_tpot, prefill_time=prefill_time,
                   prompts_per_device_within_ttft=k_max, devices_for_ttft=devices_ttft, devices=devices,
                   prefill_share=share, ttft_estimate=ttft_est, limited_by=limited_by,
                   prefill_overlap=prefill_overlap)


def poisson_burst(rate: float, window: float, quantile: float = 0.9) -> int:
    """Requests that arrive within ``window`` seconds at the ``quantile`` of a Poisson process of ``rate``
    requests/s: the smallest k with P(arrivals <= k) >= quantile, at least 1. The ``burst`` of
    :func:`plan_for_slo` for a TTFT percentile: at p90 the prompts one TTFT window holds 9 times in 10."""
    check_number("rate", rate)
    check_number("window", window)
    if not 0 < quantile < 1:
        raise ValueError(f"quantile={quantile} must be strictly between 0 and 1")
    mean, k = rate * window, 0
    term = total = math.exp(-mean)  # P(N = 0), then the running P(N <= k)
    while total < quantile:
        k += 1
        term *= mean / k
        total += term
    return max(k, 1)
