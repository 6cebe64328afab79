"""Static vs continuous batching on the same engine, model and requests, measured side by side.

    python benchmarks/bench_batching.py [--requests 64] [--max-batch-size 16] [--threads 1]

Workloads (random token ids, ``ignore_eos``, so every request produces exactly its drawn length):
  1. long-tailed lengths (log-uniform prompts 16-256, outputs 8-512), all arriving at once;
  2. uniform lengths (prompts 16-256, outputs 16-256), all arriving at once;
  3. workload 1 again under Poisson arrivals at 80% of the rate continuous batching sustained in 1.
Throughput = output tokens / wall time of the run (idle gaps between arrivals included: the engine
jumps over them instead of sleeping, and adds them to the clock). TTFT and TPOT are per request
(minillm.analysis.metrics, vLLM's definitions); p50 = median. One run each, on one machine, in one process.
Both policies run the engine's default steps: mixed (decode rows and prefill chunks in one model call)
under a budget of 2048 tokens, which splits prompts only when one step's admissions exceed it
(bench_engine.py compares budgets).

Why two length distributions: a static batch lasts as long as its longest request. With uniform
output lengths the longest of 16 is under twice the mean, so continuous batching cannot save even
half of the decode steps there; with long-tailed lengths (as in real chat traffic) it saves most.
On a CPU a decode step also costs more with more rows, which static batching's emptier steps enjoy
and a GPU's (nearly flat, memory-bound) decode step would not.
"""
from __future__ import annotations

import argparse

import torch

from minillm import build_model
from minillm.analysis.metrics import serving_metrics
from minillm.analysis.workload import poisson_arrivals, random_requests
from minillm.book.notebook import pick_device
from minillm.engine import Engine, EngineConfig


def measure(model, requests, policy, max_batch_size):
    result = Engine(model, EngineConfig(policy=policy, max_batch_size=max_batch_size)).run(requests)
    return result, serving_metrics(result.requests, duration=result.wall_time)


def compare(name, model, requests, max_batch_size, target=False):
    """Run both policies on ``requests``; print one row each and the ratios; return continuous's metrics."""
    print(f"\n== {name} ==")
    print(f"{'policy':<11}{'out tok/s':>10}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TPOT p50 ms':>13}"
          f"{'TPOT p90 ms':>13}{'steps':>7}{'wall s':>8}{'idle s':>8}")
    rows = {}
    for policy in ("static", "continuous"):
        result, m = measure(model, requests, policy, max_batch_size)
        rows[policy] = m
        print(f"{policy:<11}{m.output_throughput:>10.1f}{m.ttft.median:>12.2f}{m.ttft.p90:>12.2f}"
              f"{m.tpot.median * 1e3:>13.1f}{m.tpot.p90 * 1e3:>13.1f}{len(result.steps):>7}"
              f"{result.wall_time:>8.1f}{result.idle_skipped:>8.1f}")
    s, c = rows["static"], rows["continuous"]
    speedup, ttft_ratio = c.output_throughput / s.output_throughput, s.ttft.median / c.ttft.median
    print(f"continuous / static throughput: {speedup:.2f}x; static / continuous median TTFT: {ttft_ratio:.2f}x")
    if target:
        print(f"target (continuous >= 2x static throughput, lower median TTFT): "
              f"{'met' if speedup >= 2 and ttft_ratio > 1 else 'NOT met'}")
    return c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = pick_device()
    model = build_model("tiny", device=device, dtype=dtype)
    n, B = args.requests, args.max_batch_size
    print(f"model: tiny preset, {model.config.n_params / 1e6:.1f}M parameters; {n} requests; max_batch_size {B}; "
          f"KV pool for {B} x max_seq_len tokens, block_size 16; torch threads {torch.get_num_threads()}")
    measure(model, random_requests(2 * B, (8, 32), (4, 16), seed=args.seed + 1), "continuous", B)  # warm-up

    long_tail = dict(prompt_len=(16, 256), output_len=(8, 512), length_dist="loguniform")
    requests = random_requests(n, seed=args.seed, **long_tail)
    cont = compare("1. long-tailed lengths (log-uniform prompts 16-256, outputs 8-512), all at once", model,
                   requests, B, target=True)
    compare("2. uniform lengths (prompts 16-256, outputs 16-256), all at once", model,
            random_requests(n, (16, 256), (16, 256), seed=args.seed), B)
    rate = 0.8 * cont.request_throughput
    arrivals = poisson_arrivals(n, rate, seed=args.seed)
    compare(f"3. workload 1 under Poisson arrivals, {rate:.2f} requests/s (80% of continuous's rate in 1)", model,
            random_requests(n, seed=args.seed, arrival_times=arrivals, **long_tail), B)


if __name__ == "__main__":
    main()
