"""Timed greedy runs shared by the generation benchmarks: minillm and transformers, alternated."""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from minillm import now, stream_generate
from minillm.checkpoints.hf import to_transformers


class Run(NamedTuple):
    """One timed generation."""

    tokens: list[int]
    wall: float  # seconds, prefill + decode (minillm.timing.now: device synchronized)
    cpu: float  # this process's CPU seconds over the same span (time.process_time)
    steps: list[float]  # wall seconds of decode step i = 1, 2, ... (minillm only; [] for transformers)


def run_minillm(model, prompt: list[int], n: int, use_cache: bool) -> Run:
    """One greedy minillm run with EOS disabled, timed token by token."""
    cpu, start = time.process_time(), now(model.device)
    events = list(stream_generate(model, prompt, n, use_cache=use_cache, eos_token_id=None))
    cpu = time.process_time() - cpu
    steps = [b.time - a.time for a, b in zip(events, events[1:])]
    return Run([e.token_id for e in events], events[-1].time - start, cpu, steps)


def timed(fn: Callable[[], list[int]], device: torch.device | str | None = None) -> Run:
    """``fn()``, which returns tokens, timed as a whole (no per-step times)."""
    cpu, start = time.process_time(), now(device)
    tokens = fn()
    return Run(tokens, now(device) - start, time.process_time() - cpu, [])


def run_transformers(hf_model, prompt: list[int], n: int) -> Run:
    """``generate``, greedy, for n tokens (the model's config has no EOS)."""
    ids = torch.tensor([prompt], device=hf_model.device)  # (1, T)

    def generate() -> list[int]:
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    return timed(generate, hf_model.device)


def interleaved(repeats: int | dict[str, int], runs: dict[str, Callable[[], Run]]) -> dict[str, list[Run]]:
    """Contenders alternate, so a busy machine slows them alike; ``repeats`` timed runs each (one
    number for all, or one per contender)."""
    counts = repeats if isinstance(repeats, dict) else {name: repeats for name in runs}
    results: dict[str, list[Run]] = {name: [] for name in runs}
    for i in range(max(counts.values())):
        for name, fn in runs.items():
            if i < counts[name]:
                results[name].append(fn())
    return results


def tokens_per_s(n: int, runs: list[Run], clock: str = "wall") -> float:
    """n / the median seconds of ``clock`` ("wall" or "cpu")."""
    return n / statistics.median(getattr(r, clock) for r in runs)


def check_identical(results: dict[str, list[Run]], what: str) -> bool:
    """Every run of every contender produced the same tokens; exits with FAIL otherwise."""
    outputs = {tuple(r.tokens) for runs in results.values() for r in runs}
    if len(outputs) != 1:
        sys.exit(f"FAIL: {' and '.join(results)} tokens differ ({what})")
    return True


def compare_with_transformers(model, prompt: list[int], n: int, repeats: int,
                              target: float) -> dict[str, list[Run]]:
    """minillm's cached decode against transformers' ``generate`` on the same weights (copied with
    ``minillm.checkpoints.hf.to_transformers``, sdpa attention in both): one warm-up each, then ``repeats`` timed
    runs each, alternating; prints tokens/s and their ratio against ``target``. Exits with FAIL
    when the tokens differ."""
    hf_model = to_transformers(model, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                               pad_token_id=0)
    runs = {"minillm": lambda: run_minillm(model, prompt, n, True),
            "transformers": lambda: run_transformers(hf_model, prompt, n)}
    interleaved(1, runs)  # warm-up
    results = interleaved(repeats, runs)
    same = check_identical(results, f"{n} new tokens")
    print(f"{'':>12} | {'tok/s':>8} | {'ms/token':>8} | {'tok/CPU-s':>9}")
    for name, rs in results.items():
        wall = tokens_per_s(n, rs, "wall")
        print(f"{name:>12} | {wall:>8.1f} | {1e3 / wall:>8.2f} | {tokens_per_s(n, rs, 'cpu'):>9.1f}")
    ratio, cpu_ratio = (tokens_per_s(n, results["minillm"], c) / tokens_per_s(n, results["transformers"], c)
                        for c in ("wall", "cpu"))
    verdict = "met" if ratio >= target else "NOT met"
    print(f"minillm / transformers tokens/s: {ratio:.2f}x (target >= {target}x: {verdict}); "
          f"by CPU time: {cpu_ratio:.2f}x; identical tokens: {same}")
    return results
