"""Command-line demo: ``python -m minillm``.

Builds a small model with RANDOM weights (so the generated text is gibberish), generates greedily
with the naive path (the whole sequence recomputed every step) and the cached path (one prefill,
then one token per decode step with a KV cache), checks that both give the same tokens, and prints
TTFT, TPOT and tokens/s of both side by side.
Exit status: 0 when the paths agree, 1 when they disagree, 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .config import PRESETS
from .device import DEVICE_NAMES, DTYPES, resolve_device, resolve_dtype
from .generate import TokenEvent, check_lengths, stream_generate
from .metrics import RequestTiming, e2e_latency, tpot, ttft
from .model import build_model
from .timing import now
from .tokenizer import ByteTokenizer

EXAMPLE_PROMPT = "请介绍一下Transformer"  # the source documents' example request
BUILDABLE = [name for name, config in PRESETS.items() if config.n_params <= 100_000_000]
NEAR_TIE = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}  # logit gap rounding can flip
WARMUP_TOKENS = 8
PATHS = {"naive": "naive  (recompute all every step)", "cached": "cached (KV cache: prefill, decode)"}


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m minillm",
        description="Generate with and without a KV cache on a small random-weight model; compare speed "
                    "and check that both paths give the same tokens.")
    parser.add_argument("--prompt", default=EXAMPLE_PROMPT, help=f"default: {EXAMPLE_PROMPT!r}")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate (default 256)")
    parser.add_argument("--device", choices=DEVICE_NAMES, default="auto", help="default: auto (CUDA if present)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="default: float32")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--preset", choices=BUILDABLE, default="tiny",
                        help="model shape (the LLaMA presets are shapes only, too big to build here)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    return parser, parser.parse_args(argv)


def collect(events, label: str, total: int) -> list[TokenEvent]:
    """Gather a run's events; once it has taken 2 s, show a token counter on stderr."""
    start, out, shown = time.perf_counter(), [], False
    tty = sys.stderr.isatty()  # a terminal gets one updating line, a log a line every 64 tokens
    every, begin, end = (16, "\r", "") if tty else (64, "", "\n")
    for event in events:
        out.append(event)
        n = len(out)
        if time.perf_counter() - start > 2 and (n % every == 0 or n == total):
            print(f"{begin}  {label}: {n}/{total} tokens", end=end, file=sys.stderr, flush=True)
            shown = True
    if shown and tty:
        print(file=sys.stderr)
    return out


def timed_run(model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool, label: str):
    """Tokens and the timings of one greedy run: (tokens, TTFT s, TPOT s or None, tokens/s, total s)."""
    start = now(model.device)
    events = collect(stream_generate(model, prompt_ids, max_new_tokens, use_cache=use_cache), label, max_new_tokens)
    timing = RequestTiming(arrival_time=start, token_times=[e.time for e in events])
    total = e2e_latency(timing)
    return [e.token_id for e in events], ttft(timing), tpot(timing), len(events) / total, total


def near_tie_gap(model, prompt_ids: list[int], common: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| where the two paths first chose differently (naive recompute)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + common], device=model.device)  # (1, T)
        logits = model(ids)[0, -1].float()  # (V,)
    return abs(float(logits[a] - logits[b]))


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    tokenizer = ByteTokenizer()
    config = PRESETS[args.preset]
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads {args.threads} must be >= 1")
            torch.set_num_threads(args.threads)
        device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
        prompt_ids = tokenizer.encode(args.prompt)
        check_lengths(len(prompt_ids), args.max_new_tokens, config.max_seq_len)
    except (ValueError, TypeError) as error:
        parser.error(str(error))  # exits with status 2

    n_new = args.max_new_tokens
    model = build_model(config, device=device, dtype=dtype, seed=args.seed)
    threads = f", threads: {torch.get_num_threads()}" if device.type == "cpu" else ""
    print(f"minillm demo: the {args.preset!r} preset with RANDOM weights (seed {args.seed}), so the text is "
          "gibberish;\nwhat it shows: naive and cached generation give the same tokens, and the cache's speedup.")
    print(f"model: {config.n_params / 1e6:.2f}M parameters, {config.n_layers} layers, {config.n_heads} query heads "
          f"sharing {config.n_kv_heads} KV heads, head_dim {config.head_dim}")
    print(f"device: {device.type}, dtype: {args.dtype}{threads}")
    print(f"prompt: {args.prompt!r} = {len(prompt_ids)} tokens (BOS + {len(prompt_ids) - 1} UTF-8 bytes); "
          f"{n_new} new tokens, greedy; warm-up: {WARMUP_TOKENS} tokens a path, not timed")

    results = {}
    for name in PATHS:
        use_cache = name == "cached"
        for _ in stream_generate(model, prompt_ids, min(WARMUP_TOKENS, n_new), use_cache=use_cache):
            pass
        results[name] = timed_run(model, prompt_ids, n_new, use_cache, name)

    print(f"\n{'path':<36}{'TTFT (ms)':>11}{'TPOT (ms)':>11}{'tokens/s':>11}{'total (s)':>11}")
    for name, (_, ttft, tpot, rate, total) in results.items():
        tpot_text = f"{tpot * 1e3:.2f}" if tpot is not None else "n/a"
        print(f"{PATHS[name]:<36}{ttft * 1e3:>11.2f}{tpot_text:>11}{rate:>11.1f}{total:>11.3f}")
    print(f"speedup of the cache (tokens/s, cached / naive): {results['cached'][3] / results['naive'][3]:.2f}x")
    print(f"TTFT = first token - start of the request; TPOT = mean gap over the {n_new - 1} decode tokens; "
          f"tokens/s = {n_new} / total")

    naive, cached = results["naive"][0], results["cached"][0]
    status = 0
    if naive == cached:
        print(f"same tokens: yes, all {n_new} identical")
    else:
        i = next(i for i, (a, b) in enumerate(zip(naive, cached)) if a != b)
        gap, tie = near_tie_gap(model, prompt_ids, naive[:i], naive[i], cached[i]), NEAR_TIE[dtype]
        verdict = (f"< {tie}: a near tie that {args.dtype} rounding flips, not a bug" if gap < tie
                   else f">= {tie}: more than rounding explains, the paths disagree")
        print(f"same tokens: no, the first {i} agree; at token {i} the two candidates' logits differ by "
              f"{gap:.4f} {verdict}")
        status = 0 if gap < tie else 1
    print(f"text (cached path, random weights): {tokenizer.decode(cached)!r}")
    return status


if __name__ == "__main__":
    sys.exit(main())
