"""Generation speed, measured side by side in one run on one machine.

1. Naive recompute vs KV-cached decode on the ``tiny`` preset: tokens/s per output length, the cached/naive
   ratio, and the time of one step against context length (flat with the cache, growing without it).
2. minillm's cached decode vs ``transformers.LlamaForCausalLM.generate`` on the same config and weights.

Both parts check that the compared paths produce identical greedy tokens.

    python benchmarks/bench_generate.py [--quick] [--threads N] [--repeats R]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import transformers
from timed_runs import check_identical, compare_with_transformers, interleaved, run_minillm, tokens_per_s

from minillm import build_model, get_config
from minillm.analysis.arithmetic import bandwidth_bound_steps_per_s, streamed_weight_bytes
from minillm.analysis.roofline import last_level_cache, measure_bandwidth

PROMPT_LEN = 16
FULL = dict(lengths=(64, 128, 256, 512, 1024), bucket=128, hf_tokens=256)
QUICK = dict(lengths=(32, 64, 128, 256), bucket=32, hf_tokens=128)
TARGET_CACHED_OVER_NAIVE, TARGET_AT = 10.0, 1024  # cached/naive tokens/s at 1024 new tokens
TARGET_MINILLM_OVER_HF = 1.5
HF_REPEATS_FACTOR = 3  # part 2's runs are short (well under a second each): more of them steady the median


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter outputs (a few seconds to a minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement after one warm-up")
    args = parser.parse_args()
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    return args


def naive_vs_cached(model, prompt, lengths, bucket, repeats) -> None:
    print("\n1. Naive recompute vs KV cache (minillm, same model, greedy)")
    print(f"{'new tokens':>10} | {'naive tok/s':>11} | {'cached tok/s':>12} | {'cached/naive':>12} | "
          f"{'CPU-time ratio':>14} | identical tokens")
    for n in lengths:
        results = interleaved(repeats, {"naive": lambda n=n: run_minillm(model, prompt, n, False),
                                        "cached": lambda n=n: run_minillm(model, prompt, n, True)})
        same = check_identical(results, f"{n} new tokens")
        naive, cached = (tokens_per_s(n, results[k], "wall") for k in ("naive", "cached"))
        cpu_ratio = tokens_per_s(n, results["cached"], "cpu") / tokens_per_s(n, results["naive"], "cpu")
        print(f"{n:>10} | {naive:>11.1f} | {cached:>12.1f} | {cached / naive:>11.1f}x | {cpu_ratio:>13.1f}x | {same}")
    if n == TARGET_AT:
        verdict = "met" if cached / naive >= TARGET_CACHED_OVER_NAIVE else "NOT met"
        print(f"target cached >= {TARGET_CACHED_OVER_NAIVE:.0f}x naive at {n} new tokens: {cached / naive:.1f}x "
              f"({verdict})")
    else:
        print(f"(the target, cached >= {TARGET_CACHED_OVER_NAIVE:.0f}x naive, is for {TARGET_AT} new tokens: "
              "run without --quick)")

    print(f"\nTime of one decode step against context length (runs of {n} new tokens; median over the steps "
          f"in each bucket, all {repeats} repeats pooled)")
    print(f"{'context (tokens)':>16} | {'naive ms/step':>13} | {'cached ms/step':>14} | naive/cached")
    for lo in range(0, n, bucket):
        steps = range(max(lo, 1), min(lo + bucket, n))  # step i has context PROMPT_LEN + i; r.steps[i - 1]
        naive, cached = (1e3 * statistics.median(r.steps[i - 1] for r in results[k] for i in steps)
                         for k in ("naive", "cached"))
        span = f"{PROMPT_LEN + steps[0]}-{PROMPT_LEN + steps[-1]}"
        print(f"{span:>16} | {naive:>13.2f} | {cached:>14.2f} | {naive / cached:>11.1f}x")


def minillm_vs_transformers(model, prompt, n, repeats) -> None:
    print(f"\n2. minillm cached decode vs transformers {transformers.__version__} LlamaForCausalLM.generate "
          f"(same config and weights, attention sdpa in both, batch 1, greedy, {n} new tokens, "
          f"{repeats} timed runs each)")
    results = compare_with_transformers(model, prompt, n, repeats, TARGET_MINILLM_OVER_HF)
    bandwidth_floor(model, {name: 1 / tokens_per_s(n, rs, "wall") for name, rs in results.items()})


def bandwidth_floor(model, seconds_per_token: dict[str, float]) -> None:
    """What no implementation can beat: every decode step streams all weights from memory once. Weights that fit
    in the last-level cache are read from it, faster than main memory: then the floor is only a guide."""
    weights = streamed_weight_bytes(model.config, model.dtype)
    bandwidth = measure_bandwidth(device=model.device)  # bytes/s read, working set above the last-level cache
    floor = 1 / bandwidth_bound_steps_per_s(weights, bandwidth)  # seconds a step
    llc, llc_text = last_level_cache() if model.device.type == "cpu" else (None, "")
    print(f"bandwidth floor: {weights / 1e6:.1f} MB of weights a step / {bandwidth / 1e9:.1f} GB/s measured read "
          f"bandwidth = {floor * 1e3:.2f} ms/token; time above it (per-step overhead):")
    if llc is not None and weights <= llc:
        print(f"  (the weights fit in the {llc_text} last-level cache, which steps read faster than main memory: "
              "no memory floor binds, and the time above it is overhead and cache reads)")
    above = {name: s - floor for name, s in seconds_per_token.items()}
    for name, extra in above.items():
        print(f"{name:>12} | {seconds_per_token[name] * 1e3:.2f} ms/token = floor + {extra * 1e3:.2f} ms")
    if min(above.values()) > 0:
        print(f"transformers/minillm overhead above the floor: {above['transformers'] / above['minillm']:.2f}x")


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    config = get_config("tiny")
    model = build_model(config, seed=0)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"bench_generate{' --quick' if args.quick else ''}: torch {torch.__version__}, device {model.device}, "
          f"dtype {str(model.dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}")
    print(f"model: tiny preset, {config.n_params / 1e6:.2f}M parameters, {config.n_layers} layers, d_model "
          f"{config.d_model}, {config.n_heads} heads / {config.n_kv_heads} kv heads, sdpa attention")
    print(f"workload: batch 1, prompt {PROMPT_LEN} tokens, greedy, EOS disabled (exactly the asked new tokens); "
          f"warm-up runs first, then {args.repeats} timed runs per contender (part 2: "
          f"{HF_REPEATS_FACTOR * args.repeats}), alternating; medians")
    print("tokens/s = new tokens / wall seconds of prefill + all decode steps; the CPU-time ratio uses this "
          "process's CPU seconds instead (steadier than wall time on a busy machine, with --threads 1)")
    for use_cache in (False, True):
        run_minillm(model, prompt, 16, use_cache)  # warm-up
    naive_vs_cached(model, prompt, sizes["lengths"], sizes["bucket"], args.repeats)
    minillm_vs_transformers(model, prompt, sizes["hf_tokens"], HF_REPEATS_FACTOR * args.repeats)


if __name__ == "__main__":
    main()
