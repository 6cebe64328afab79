"""Speculative decoding against plain decode on SmolLM2-135M-Instruct, measured side by side in one run.

Target: the float32 model (``minillm.load_pretrained``; ``--target float32-matvec``: the same weights with
``minillm.fast.quant.MatVecLinear`` layers, whose products of a few rows go weight-first where that is faster);
its plain cached decode is the baseline. Drafts: the
GGUF file's own int4 weights (``minillm.fast.int4.load_int4``: the block kernel where the CPU has AVX2) and
prompt lookup (``minillm.speculative.PromptLookup``: no model), each at k = 2, 4 and 8 guesses per round.

Workload: two chat prompts, greedy, at most 128 new tokens, stopping at <|im_end|>: "edit" asks for a Python
function with two variables renamed (the reply copies the prompt's code), "explain" asks how a rainbow forms
(the reply copies nothing). Every round runs the baseline and each speculative contender once per prompt,
alternating, after one untimed warm-up round; speculative output must equal the baseline's token for token
(else FAIL). Decode time runs from the first new token to the last (the prefill is the same call in both);
speed-up = baseline decode time / speculative decode time, the median of the rounds' ratios with their range.
Acceptance a = accepted / judged guesses; tokens per target call against (1 - a^(k+1)) / (1 - a).

The profile then times what decides the speed-up (process CPU time, medians): the target's call with 1 and
k + 1 new positions, the draft's step, and predicts the speed-up as tokens per call x t_target(1) /
(t_target(k + 1) + draft steps per round x t_draft). Target: int4, k = 4, one thread: >= 1.8x.

    python benchmarks/bench_speculative.py [--threads N] [--rounds R] [--new-tokens N] [--target T]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from minillm import KVCache, load_pretrained, stream_generate
from minillm.book.data import SPECULATIVE_PROMPTS as PROMPTS
from minillm.fast.int4 import kernels_used, load_int4
from minillm.fast.quant import make_variant
from minillm.speculative import PromptLookup, SpeculativeStats, speculative_generate

KS = (2, 4, 8)
TARGETS = ("float32", "float32-matvec")
TARGET = 1.8  # int4 draft, k = 4, one thread
TARGET_K = 4
PROFILE_REPEATS = 15


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--new-tokens", type=int, default=128, help="most new tokens per reply (default 128)")
    parser.add_argument("--target", choices=TARGETS, default="float32",
                        help="the target's float32 layers: nn.Linear (default) or MatVecLinear")
    args = parser.parse_args()
    for name in ("threads", "rounds", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def decode_run(events) -> tuple[list[int], float, float]:
    """Consume a run's TokenEvents: its tokens, and the decode's wall and CPU seconds (first token to last)."""
    tokens, first, last = [], None, None
    for event in events:
        if first is None:
            first = (event.time, time.process_time())
        tokens.append(event.token_id)
        last = event.time
    return tokens, last - first[0], time.process_time() - first[1]


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def expected_tokens_per_call(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): the mean tokens a round emits when each guess is kept with probability a."""
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def compare(target, drafts: dict, prompts: dict[str, list[int]], eos: int, n: int, rounds: int) -> dict:
    """Every round: the baseline, then each (draft, k), per prompt. -> per (prompt, contender): the decode
    wall times, CPU times and the last run's stats; exits with FAIL when a reply differs from the baseline's."""
    contenders = {"plain": None} | {(name, k): (draft, k) for name, draft in drafts.items() for k in KS}
    results = {(p, c): {"wall": [], "cpu": [], "stats": None} for p in prompts for c in contenders}
    reference = {}
    for r in range(rounds + 1):  # round 0 warms up
        for prompt_name, ids in prompts.items():
            for contender, spec in contenders.items():
                stats = SpeculativeStats()
                if spec is None:
                    events = stream_generate(target, ids, n, eos_token_id=eos)
                else:
                    events = speculative_generate(target, spec[0], ids, spec[1], n, eos_token_id=eos, stats=stats)
                tokens, wall, cpu = decode_run(events)
                if reference.setdefault(prompt_name, tokens) != tokens:
                    sys.exit(f"FAIL: {contender} on {prompt_name!r} differs from plain decode")
                if r:
                    entry = results[prompt_name, contender]
                    entry["wall"].append(wall)
                    entry["cpu"].append(cpu)
                    entry["stats"] = stats
    return {"results": results, "reference": reference}


def report(results: dict, reference: dict, drafts: dict, rounds: int) -> float:
    """Print the table; -> the median wall-clock speed-up of the int4 draft at TARGET_K on the explain prompt."""
    print(f"\n{'prompt':>8} | {'draft':>6} | {'k':>2} | {'accept a':>8} | {'tok/call':>8} | {'(1-a^(k+1))/(1-a)':>17}"
          f" | {'speed-up (wall), median (range)':>31} | {'by CPU time':>11}")
    headline = float("nan")
    for prompt_name, tokens in reference.items():
        base = results[prompt_name, "plain"]
        print(f"{prompt_name:>8} | {'plain':>6} | {'':>2} | {'':>8} | {'1.00':>8} | {'':>17} | "
              f"{len(tokens) - 1} decode tokens in {statistics.median(base['wall']) * 1e3:.0f} ms (median)")
        for name in drafts:
            for k in KS:
                entry = results[prompt_name, (name, k)]
                stats = entry["stats"]
                ratios = [b / s for b, s in zip(base["wall"], entry["wall"])]
                cpu_ratio = statistics.median(base["cpu"]) / statistics.median(entry["cpu"])
                a = stats.acceptance_rate
                print(f"{prompt_name:>8} | {name:>6} | {k:>2} | {a:>8.3f} | {stats.tokens_per_call:>8.2f} | "
                      f"{expected_tokens_per_call(a, k):>17.2f} | {median_range(ratios):>31} | {cpu_ratio:>10.2f}x")
                if (prompt_name, name, k) == ("explain", "int4", TARGET_K):
                    headline = statistics.median(ratios)
    return headline


def call_time(model, context: list[int], new: int) -> float:
    """Median CPU seconds of one cached call with ``new`` positions after ``context``."""
    cache = KVCache(model.config, 1, len(context) + new, model.device, model.dtype)
    times = []
    with torch.inference_mode():
        model(torch.tensor([context]), cache=cache)
        ids = torch.tensor([context[-new:]])  # (1, new): any tokens; the cost does not depend on them
        for _ in range(PROFILE_REPEATS):
            cache.truncate(len(context))
            start = time.process_time()
            model(ids, cache=cache)
            times.append(time.process_time() - start)
    return statistics.median(times)


def profile(target, draft, context: list[int], stats_by_k: dict[int, SpeculativeStats]) -> None:
    """The costs that decide the speed-up, and the speed-up they predict."""
    t1 = call_time(target, context, 1)
    d1, d2 = call_time(draft, context, 1), call_time(draft, context, 2)
    print(f"\nprofile (CPU time, medians of {PROFILE_REPEATS}, after the explain prompt): target call with 1 new "
          f"position {t1 * 1e3:.1f} ms; int4 draft step {d1 * 1e3:.1f} ms ({d1 / t1:.2f} of the target's), "
          f"with 2 positions {d2 * 1e3:.1f} ms")
    for k, stats in stats_by_k.items():
        tk = call_time(target, context, k + 1)
        steps = stats.draft_calls / len(stats.rounds)
        round_time = tk + steps * d1
        predicted = stats.tokens_per_call * t1 / round_time
        print(f"  k={k}: target call with {k + 1} positions {tk * 1e3:.1f} ms = {tk / t1:.2f} steps; "
              f"{steps:.2f} draft steps per round = {steps * d1 * 1e3:.1f} ms; {stats.tokens_per_call:.2f} tokens "
              f"per call -> predicted speed-up {predicted:.2f}x (round: {tk / round_time:.0%} verifying, "
              f"{steps * d1 / round_time:.0%} drafting)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_pretrained("smollm2-135m-instruct")  # float32
    if args.target != "float32":
        target = make_variant(target, args.target)
    int4, _ = load_int4("smollm2-135m-instruct")
    drafts = {"int4": int4, "ngram": PromptLookup()}
    prompts = {name: tokenizer.encode_chat(text) for name, text in PROMPTS.items()}
    eos = tokenizer.eos_token_id
    print(f"bench_speculative: torch {torch.__version__}, {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}),"
          f" threads {args.threads}; target SmolLM2-135M-Instruct {args.target}; int4 draft: {kernels_used(int4)}; "
          f"prompt lookup: n-grams {PromptLookup().max_ngram}..{PromptLookup().min_ngram}")
    print(f"workload: chat prompts {', '.join(f'{n!r} ({len(p)} tokens)' for n, p in prompts.items())}; greedy, "
          f"<= {args.new_tokens} new tokens, stop at <|im_end|>; {args.rounds} timed rounds after a warm-up, "
          "baseline and contenders alternating")
    run = compare(target, drafts, prompts, eos, args.new_tokens, args.rounds)
    print("every speculative reply equals the plain decode's, token for token")
    headline = report(run["results"], run["reference"], drafts, args.rounds)
    explain = prompts["explain"] + run["reference"]["explain"]
    profile(target, int4, explain, {k: run["results"]["explain", ("int4", k)]["stats"] for k in KS})
    verdict = "met" if headline >= TARGET else "NOT met"
    print(f"\nint4 draft, k={TARGET_K}, {args.threads} thread(s), explain prompt: {headline:.2f}x plain "
          f"{args.target} decode (target >= {TARGET}x at one thread: {verdict})")


if __name__ == "__main__":
    main()
