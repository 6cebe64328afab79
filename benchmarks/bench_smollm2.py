"""Generation speed on a trained model, SmolLM2-135M-Instruct, measured side by side in one run.

a. minillm cached decode vs ``transformers.LlamaForCausalLM.generate`` on the same weights (minillm's,
   copied with ``minillm.checkpoints.hf.to_transformers``, attention "sdpa" in both): tokens/s and their ratio.
b. minillm naive recompute vs KV-cached decode at 64, 128 and 256 new tokens.
c. The time of one decode step against batch size 1 ... 32 at a fixed context.
d. The share of the measured read bandwidth that decode reaches: (weight bytes + KV bytes read per step) x
   steps/s, over the read bandwidth ``minillm.analysis.roofline.measure_bandwidth`` measures in the same run
   (not MBU, which divides by the memory's datasheet peak).

Batch 1 (a, b), float32, greedy, a fixed prompt, EOS disabled; a and b check that the compared paths give
identical tokens and exit with FAIL otherwise. Targets: minillm >= 1.1x transformers; cached >= 10x naive
at 256 new tokens.

    python benchmarks/bench_smollm2.py [--threads N] [--repeats R] [--device auto|cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from timed_runs import Run, check_identical, compare_with_transformers, interleaved, run_minillm, tokens_per_s

from minillm import load_pretrained
from minillm.analysis.arithmetic import (
    bandwidth_bound_steps_per_s,
    bandwidth_utilisation,
    decode_bytes,
    kv_cache_bytes,
    streamed_weight_bytes,
)
from minillm.analysis.roofline import default_probe_bytes, measure_bandwidth, time_decode_step
from minillm.device import DEVICE_NAMES

MODEL = "smollm2-135m-instruct"
PROMPT = "Once upon a time, in a small village,"
HF_TOKENS = 128  # part a
LENGTHS = (64, 128, 256)  # part b
BATCHES = (1, 2, 4, 8, 16, 32)  # part c
BATCH_CONTEXT = 256  # tokens each row attends in part c
STEP_REPEATS = 5  # timed decode steps per batch size in part c
TARGET_MINILLM_OVER_HF = 1.1
TARGET_CACHED_OVER_NAIVE, TARGET_AT = 10.0, 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per contender in a and of the cached path in b (default 3); the naive "
                             "path in b runs once per length (its 256-token run takes minutes on one core)")
    parser.add_argument("--device", choices=DEVICE_NAMES, default="auto", help="default: auto (CUDA if present)")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    return args


def verdict(holds: bool) -> str:
    return "met" if holds else "NOT met"


def minillm_vs_transformers(model, prompt, repeats) -> list[Run]:
    """Part a; returns minillm's runs (part d reads their decode step time)."""
    n = HF_TOKENS
    print(f"\na. minillm cached decode vs transformers {transformers.__version__} LlamaForCausalLM.generate "
          f"(minillm's weights copied with minillm.checkpoints.hf.to_transformers, sdpa attention in both; "
          f"{n} new tokens, "
          f"{repeats} timed runs each after one warm-up, alternating)")
    return compare_with_transformers(model, prompt, n, repeats, TARGET_MINILLM_OVER_HF)["minillm"]


def naive_vs_cached(model, prompt, repeats) -> None:
    print(f"\nb. minillm naive recompute vs KV cache (greedy; cached: {repeats} timed runs per length, naive: 1, "
          "as its long runs take minutes on one core; one 8-token warm-up of each path first)")
    for use_cache in (False, True):
        run_minillm(model, prompt, 8, use_cache)
    print(f"{'new tokens':>10} | {'naive tok/s':>11} | {'cached tok/s':>12} | {'cached/naive':>12} | "
          f"{'CPU-time ratio':>14} | {'naive s':>7} | identical tokens")
    for n in LENGTHS:
        results = interleaved({"naive": 1, "cached": repeats},
                              {"naive": lambda n=n: run_minillm(model, prompt, n, False),
                               "cached": lambda n=n: run_minillm(model, prompt, n, True)})
        same = check_identical(results, f"{n} new tokens")
        naive, cached = (tokens_per_s(n, results[k]) for k in ("naive", "cached"))
        cpu_ratio = tokens_per_s(n, results["cached"], "cpu") / tokens_per_s(n, results["naive"], "cpu")
        print(f"{n:>10} | {naive:>11.2f} | {cached:>12.1f} | {cached / naive:>11.1f}x | {cpu_ratio:>13.1f}x | "
              f"{results['naive'][0].wall:>7.1f} | {same}")
    print(f"cached >= {TARGET_CACHED_OVER_NAIVE:.0f}x naive at {TARGET_AT} new tokens: {cached / naive:.1f}x "
          f"({verdict(cached / naive >= TARGET_CACHED_OVER_NAIVE)})")


def batch_sweep(model, bandwidth: float) -> None:
    """Parts c and d by batch size: step time, tokens/s, and each step's share of the read bandwidth."""
    dtype = model.dtype
    print(f"\nc. One decode step against batch size (every row attends {BATCH_CONTEXT} cached positions; random "
          f"token ids; median of {STEP_REPEATS} steps after one warm-up, minillm.analysis.roofline.time_decode_step)")
    print(f"{'batch':>5} | {'ms/step':>8} | {'x batch 1':>9} | {'tok/s':>7} | {'MB read/step':>12} | read share")
    base = None
    for batch in BATCHES:
        seconds = time_decode_step(model, BATCH_CONTEXT, batch, repeats=STEP_REPEATS)
        base = base or seconds
        read = decode_bytes(model.config, BATCH_CONTEXT, batch, dtype)
        mbu = bandwidth_utilisation(read, 1 / seconds, bandwidth)
        print(f"{batch:>5} | {seconds * 1e3:>8.2f} | {seconds / base:>8.2f}x | {batch / seconds:>7.1f} | "
              f"{read / 1e6:>12.1f} | {mbu:>10.0%}")
    print(f"(a step at batch {BATCHES[-1]} does {BATCHES[-1]}x the work of batch 1; where it takes far less than "
          f"{BATCHES[-1]}x the time, decode is bound by reading the weights, which every row shares)")


def batch1_utilisation(model, prompt_len: int, runs: list[Run], bandwidth: float) -> None:
    """Part d for batch-1 generation: the runs of part a."""
    n, dtype = HF_TOKENS, model.dtype
    context = prompt_len + n // 2  # mean context of the decode steps
    weights, kv = streamed_weight_bytes(model.config, dtype), kv_cache_bytes(model.config, context, 1, dtype)
    step = statistics.median(statistics.mean(r.steps) for r in runs)
    achieved, mbu = (weights + kv) / step, bandwidth_utilisation(weights + kv, 1 / step, bandwidth)
    print("\nd. Batch-1 decode's share of the measured read bandwidth, from part a's minillm runs")
    print(f"bytes read per step: {weights / 1e6:.1f} MB of weights + {kv / 1e6:.1f} MB of KV cache (mean context "
          f"{context} tokens) = {(weights + kv) / 1e6:.1f} MB")
    print(f"decode step (TPOT, median of {len(runs)} runs): {step * 1e3:.2f} ms = {1 / step:.1f} steps/s "
          f"-> {achieved / 1e9:.2f} GB/s")
    print(f"read bandwidth measured in this run ({default_probe_bytes(model.device) / 2 ** 20:.0f} MiB read, "
          f"above the last-level cache, threads {torch.get_num_threads()}): {bandwidth / 1e9:.2f} GB/s")
    print(f"read share = {achieved / 1e9:.2f} / {bandwidth / 1e9:.2f} = {mbu:.0%} (the rest of each "
          f"step: compute and per-step overhead; the floor, all bytes at read speed, is "
          f"{1e3 / bandwidth_bound_steps_per_s(weights + kv, bandwidth):.2f} ms/step)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_pretrained(MODEL, device=args.device, dtype="float32")
    loaded = time.perf_counter() - start
    prompt = tokenizer.encode(PROMPT)
    c = model.config
    threads = f", threads {torch.get_num_threads()}" if model.device.type == "cpu" else ""
    print(f"bench_smollm2: torch {torch.__version__}, device {model.device}, dtype float32{threads}")
    print(f"model: SmolLM2-135M-Instruct (trained; minillm.load_pretrained, loaded in {loaded:.1f} s), "
          f"{c.n_params / 1e6:.1f}M parameters, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads / "
          f"{c.n_kv_heads} kv heads, sdpa attention")
    print(f"workload: batch 1 (a, b), prompt {PROMPT!r} = {len(prompt)} tokens, greedy, EOS disabled (exactly "
          "the asked new tokens); medians")
    print("tokens/s = new tokens / wall seconds of prefill + all decode steps; the CPU-time ratio uses this "
          "process's CPU seconds instead (steadier than wall time on a busy machine, with --threads 1)")
    bandwidth = measure_bandwidth(device=model.device)
    runs = minillm_vs_transformers(model, prompt, args.repeats)
    naive_vs_cached(model, prompt, args.repeats)
    batch_sweep(model, bandwidth)
    batch1_utilisation(model, len(prompt), runs, bandwidth)
    print(f"\ntotal time of the benchmark: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
