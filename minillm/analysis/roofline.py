"""Machine probes and the roofline: how fast can this device compute, and how fast read?

The roofline model says a kernel that does ``flops`` of work while moving ``bytes`` of
memory can run at most at ``min(peak_flops, intensity x peak_bandwidth)`` FLOP/s, where
intensity = flops / bytes. The two peaks are measured here with small probes (a square
matmul, a read of a buffer larger than the last-level cache) instead of taken from a
datasheet, so the chapter compares the model with the machine it actually runs on.
"""
from __future__ import annotations

import functools
import re
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cache import KVCache
from ..device import resolve_device, resolve_dtype
from ..timing import now
from ..validate import check_int, check_number
from .arithmetic import bandwidth_utilisation, decode_bytes, decode_flops, prefill_bytes, prefill_flops

Clock = Callable[[torch.device], float]
SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
LLC_FACTOR = 4  # the read probe's working set: at least this many times the last-level cache
MIN_PROBE_BYTES = 256 * 2**20
UNKNOWN_LLC_PROBE_BYTES = 2**30  # when neither sysfs nor lscpu reports the cache
GPU_PROBE_BYTES = 2**30  # a GPU's L2 is tens of MiB


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                device: torch.device | str | None = None, clock: Clock = now) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls, after ``warmup`` untimed.

    ``clock(device)`` must synchronize the device before reading the time
    (``minillm.timing.now`` does); tests pass a fake clock.
    """
    check_int("repeats", repeats)
    check_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = clock(device)
        fn()
        seconds.append(clock(device) - start)
    return statistics.median(seconds)


def matmul_flops(n: int) -> int:
    """FLOPs of an (n, n) @ (n, n) matmul: n^2 outputs, each n multiplies and n adds."""
    check_int("n", n)
    return 2 * n ** 3


def measure_matmul_flops(n: int = 512, dtype: str | torch.dtype = "float32",
                         device: str | torch.device = "cpu", repeats: int = 5,
                         clock: Clock = now) -> float:
    """Achieved FLOP/s (median of ``repeats``) of one square ``n x n`` matmul.

    Pick ``n`` so one call takes a few milliseconds: 512 on a laptop CPU, 4096 or more on
    a GPU (a small matmul cannot fill a GPU and reports far below its peak).
    """
    check_int("n", n)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)  # (n, n)
    b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)  # (n, n)
    seconds = median_time(lambda: a @ b, repeats=repeats, device=device, clock=clock)
    return matmul_flops(n) / seconds


def parse_size(text: str) -> int:
    """'32768K', '32 MiB', '1.5 MiB (2 instances)', '512 KB' -> bytes (binary units, as the kernel means)."""
    match = re.match(r"\s*([\d.]+)\s*([KMGT]?)(?:i?B)?", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read a cache size from {text!r}")
    return int(float(match[1]) * 1024 ** " KMGT".index(match[2].upper() or " "))


def llc_from_sysfs(cpu_dir: Path = SYSFS_CACHE) -> tuple[int, str] | None:
    """(bytes, description) of the highest-level data or unified cache sysfs lists for cpu0."""
    best = None
    for index in sorted(cpu_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size)
    if best is None:
        return None
    return best[1], f"L{best[0]} {best[1] / 2**20:g} MiB ({cpu_dir}/index*)"


def llc_from_lscpu(text: str) -> tuple[int, str] | None:
    """(bytes, description) of the highest 'Ln cache:' line of lscpu's output (the total over instances)."""
    levels = {int(m[1]): m[2].strip()
              for m in re.finditer(r"^L(\d)d? cache:\s*(.+)$", text, re.MULTILINE)}
    if not levels:
        return None
    level = max(levels)
    return parse_size(levels[level]), f"L{level} {levels[level]} (lscpu)"


@functools.cache
def last_level_cache() -> tuple[int | None, str]:
    """The CPU's last-level cache as the system reports it: sysfs first, then lscpu; never
    assumed. (None, why) when neither says."""
    found = llc_from_sysfs()
    if found is None:
        try:
            lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10)
            found = llc_from_lscpu(lscpu.stdout)
        except (OSError, subprocess.SubprocessError):
            found = None
    return found if found else (None, "unknown (neither sysfs nor lscpu reports it)")


def read_probe_bytes(llc: int | None) -> int:
    """The read probe's working set: at least ``LLC_FACTOR`` x the last-level cache and
    ``MIN_PROBE_BYTES``; ``UNKNOWN_LLC_PROBE_BYTES`` when the cache size is unknown."""
    if llc is None:
        return UNKNOWN_LLC_PROBE_BYTES
    check_int("llc", llc)
    return max(MIN_PROBE_BYTES, LLC_FACTOR * llc)


def default_probe_bytes(device: str | torch.device = "cpu") -> int:
    """The working set ``measure_bandwidth`` reads by default on ``device``: above the CPU's
    reported last-level cache (``read_probe_bytes``), or ``GPU_PROBE_BYTES`` (far above any
    GPU's L2) on a GPU."""
    if resolve_device(device).type != "cpu":
        return GPU_PROBE_BYTES
    return read_probe_bytes(last_level_cache()[0])


def measure_bandwidth(n_bytes: int | None = None, device: str | torch.device = "cpu",
                      repeats: int = 5, clock: Clock = now) -> float:
    """Achieved read bandwidth (bytes/s, median of ``repeats``): the time to sum ``n_bytes``
    of float32, each byte read once and nothing written, as a decode step reads its weights.

    ``n_bytes`` defaults to ``default_probe_bytes(device)``: a working set larger than the
    last-level cache, so the probe reads main memory, not the cache. On a CPU it runs on
    the threads torch uses (``torch.get_num_threads()``): at one thread it is one core's
    figure, not the machine's.
    """
    device = resolve_device(device)
    n_bytes = default_probe_bytes(device) if n_bytes is None else n_bytes
    check_int("n_bytes", n_bytes, minimum=4)
    src = torch.ones(n_bytes // 4, device=device, dtype=torch.float32)  # (n_bytes/4,)
    seconds = median_time(src.sum, repeats=repeats, warmup=1, device=device, clock=clock)
    return src.numel() * src.element_size() / seconds


def _random_ids(model, batch_size: int, length: int) -> torch.Tensor:
    """Reproducible random token ids on the model's device: (batch_size, length)."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, length)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=generator)
    return ids.to(model.device)


def time_prefill(model, prompt_len: int, batch_size: int = 1, repeats: int = 3,
                 clock: Clock = now) -> float:
    """Median seconds of one prefill: a forward over ``batch_size`` prompts of
    ``prompt_len`` random tokens into an empty KV cache (reset between calls)."""
    check_int("prompt_len", prompt_len)
    check_int("batch_size", batch_size)
    ids = _random_ids(model, batch_size, prompt_len)  # (B, T)
    cache = KVCache(model.config, batch_size, prompt_len, model.device, model.dtype)

    def step():
        cache.reset()
        with torch.inference_mode():
            model(ids, cache=cache)

    return median_time(step, repeats=repeats, device=model.device, clock=clock)


def time_decode_step(model, context_len: int, batch_size: int = 1, repeats: int = 5,
                     clock: Clock = now) -> float:
    """Median seconds of one decode step: ``batch_size`` rows each feed one token that
    attends ``context_len`` positions (itself included), as in ``memory.decode_flops``.

    The earlier ``context_len - 1`` positions of the cache are left as zeros instead of
    being prefilled: attention does the same work whatever the keys hold, and skipping the
    prefill keeps the probe cheap at long contexts and large batches. Every timed call
    writes the same last position, so all calls do identical work.
    """
    check_int("context_len", context_len)
    check_int("batch_size", batch_size)
    cache = KVCache(model.config, batch_size, context_len, model.device, model.dtype)
    token = _random_ids(model, batch_size, 1)  # (B, 1)
    last = context_len - 1
    positions = torch.full((batch_size, 1), last, device=model.device)  # (B, 1)

    def step():
        with torch.inference_mode():
            model(token, positions=positions, cache=cache)

    return median_time(step, repeats=repeats, device=model.device, clock=clock)


def ridge_point(peak_flops: float, peak_bw: float) -> float:
    """The intensity (FLOP/byte) where the roofline bends: memory limits below it, compute
    above it."""
    check_number("peak_flops", peak_flops)
    check_number("peak_bw", peak_bw)
    return peak_flops / peak_bw


def roofline(intensity, peak_flops: float, peak_bw: float):
    """Attainable FLOP/s at ``intensity``: ``min(peak_flops, intensity * peak_bw)``.

    ``intensity`` (FLOP/byte) may be a number (returns a float) or an array (returns an
    array, to plot).
    """
    check_number("peak_flops", peak_flops)
    check_number("peak_bw", peak_bw)
    values = np.asarray(intensity, dtype=float)
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"intensity={intensity!r} must be finite and >= 0 (FLOP/byte)")
    attainable = np.minimum(peak_flops, values * peak_bw)
    return float(attainable) if attainable.ndim == 0 else attainable


def roofline_time(flops: float, bytes_moved: float, peak_flops: float,
                  peak_bw: float) -> float:
    """Least seconds a call can take: the larger of compute time and memory time,
    ``max(flops / peak_flops, bytes_moved / peak_bw)`` (= flops / roofline(intensity))."""
    check_number("peak_flops", peak_flops)
    check_number("peak_bw", peak_bw)
    check_number("flops", flops, inclusive=True)
    check_number("bytes_moved", bytes_moved, inclusive=True)
    return max(flops / peak_flops, bytes_moved / peak_bw)


@dataclass(frozen=True)
class RooflinePoint:
    """One measured call on the roofline of a machine: its FLOPs, bytes and seconds."""

    flops: float
    bytes_moved: float
    seconds: float
    peak_flops: float  # FLOP/s
    peak_bw: float  # bytes/s

    def __post_init__(self) -> None:
        check_number("bytes_moved", self.bytes_moved)
        check_number("seconds", self.seconds)
        _ = self.roofline_time  # validates flops and the peaks

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes_moved

    @property
    def bound(self) -> str:
        """The lower roof here: "memory" left of the ridge point, else "compute"."""
        ridge = ridge_point(self.peak_flops, self.peak_bw)
        return "memory" if self.intensity < ridge else "compute"

    @property
    def roofline_time(self) -> float:
        """The least seconds the roofline allows for this work."""
        return roofline_time(self.flops, self.bytes_moved, self.peak_flops, self.peak_bw)

    @property
    def slowdown(self) -> float:
        """Measured seconds / roofline seconds: 1 on the roof, larger below it."""
        return self.seconds / self.roofline_time

    @property
    def mfu(self) -> float:
        """Achieved FLOP/s over the peak FLOP/s (FLOPs utilization)."""
        return self.flops / self.seconds / self.peak_flops

    @property
    def mbu(self) -> float:
        """Achieved bytes/s over the peak bytes/s (bandwidth utilization)."""
        return bandwidth_utilisation(self.bytes_moved, 1 / self.seconds, self.peak_bw)


def prefill_share(config, prompt_len: int, output_len: int, peak_flops: float,
                  peak_bw: float, dtype="float16", batch_size: int = 1) -> float:
    """Roofline prediction of prefill's share of one request's time.

    One prefill of ``prompt_len`` tokens, then ``output_len - 1`` decode steps (the j-th
    attends ``prompt_len + j`` positions), each shared by ``batch_size`` requests of the
    same lengths: at batch 1 the share of the request's own latency, at batch B the share
    of the machine time the request costs. Weights and KV cache in ``dtype``.
    """
    check_int("output_len", output_len)
    check_int("batch_size", batch_size)
    t_prefill = roofline_time(prefill_flops(config, prompt_len),
                              prefill_bytes(config, prompt_len, dtype=dtype),
                              peak_flops, peak_bw)
    t_decode = sum(roofline_time(batch_size * decode_flops(config, prompt_len + j),
                                 decode_bytes(config, prompt_len + j, batch_size, dtype),
                                 peak_flops, peak_bw) for j in range(1, output_len))
    return t_prefill / (t_prefill + t_decode / batch_size)


