"""Chunked prefill, prefix caching and the mixed step, measured side by side in one run on one machine.

    python benchmarks/bench_engine.py [--threads 1] [--repeats 3] [--skip-smollm]

1. Stall (tiny model): short chats with an occasional long prompt, a closed loop of 16 users. Steps whose
   budget takes a whole long prompt at once against steps under a small token budget (chunked prefill).
   Target: p99 ITL at least 2x lower with chunking, output throughput within 10%.
2. Shared system prompt (tiny model): every request starts with the same long system prompt, a closed
   loop of 8 users; mixed steps with and without prefix caching. Target: p50 TTFT at least 3x lower with
   caching. Also prints the prefill tokens each run computed.
3. The mixed step (SmolLM2-135M-Instruct, the real model): a decode batch alone, a prefill chunk alone,
   and both fused in one call (one mixed step), on the same KV blocks. The documents' claim (section
   2.3) that compute-bound prefill and memory-bound decode complement each other, as one number: how
   much of the separate calls' time the fused call saves, and what the decode rows add to the chunk.

Runs of 1 and 2 alternate between the compared settings (A, B, A, B, ...), so a busy machine slows
both alike; each metric is the median over the repeats. Greedy tokens must be identical between the
compared settings (exit status 1 otherwise); in 3 the fused call's logits must match the separate
calls'. Metrics are minillm.analysis.metrics (vLLM's definitions); ITL percentiles pool every gap of every request.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from minillm import build_model, load_pretrained, now
from minillm.analysis.metrics import serving_metrics
from minillm.book.instruments import mixed_step_calls
from minillm.book.notebook import pick_device
from minillm.engine import Engine, EngineConfig, Request
from minillm.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

STALL = dict(n=64, users=16, every=8, short_prompt=(16, 64), short_output=(32, 96), long_prompt=(1024, 1536),
             long_output=(8, 16), budget=256, chunk=128)
SHARED = dict(n=48, users=8, system=768, user=(16, 64), output=(16, 48))
MIXED = dict(decode_rows=16, context=256, chunks=(32, 128, 512))


def stall_requests(seed: int) -> list[Request]:
    """Short chats; every ``every``-th request is a long prompt (random ids, EOS ignored)."""
    rng, c = random.Random(seed), STALL
    requests = []
    for i in range(c["n"]):
        long = i % c["every"] == c["every"] - 1
        prompt_len = rng.randint(*c["long_prompt" if long else "short_prompt"])
        output = rng.randint(*c["long_output" if long else "short_output"])
        requests.append(Request(i, [rng.randrange(256) for _ in range(prompt_len)], output, ignore_eos=True))
    return requests


def shared_requests(seed: int) -> list[Request]:
    """The same system prompt, then a user part of its own."""
    rng, c = random.Random(seed), SHARED
    system = [rng.randrange(256) for _ in range(c["system"])]
    return [Request(i, system + [rng.randrange(256) for _ in range(rng.randint(*c["user"]))],
                    rng.randint(*c["output"]), ignore_eos=True) for i in range(c["n"])]


def compare(model, requests, users, settings: dict[str, dict], repeats: int):
    """Run every setting ``repeats`` times, alternating; medians of the metrics; tokens must agree."""
    samples = {name: [] for name in settings}
    tokens = {}
    for _ in range(repeats):
        for name, kwargs in settings.items():
            cpu = time.process_time()
            result = Engine(model, EngineConfig(max_batch_size=users, **kwargs)).run(requests, concurrency=users)
            cpu = time.process_time() - cpu
            m = serving_metrics(result.requests, duration=result.wall_time)
            samples[name].append(dict(tput=m.output_throughput, cpu_tput=m.output_tokens / cpu,
                                      ttft50=m.ttft.median, ttft99=m.ttft.p99,
                                      itl50=m.itl.median, itl99=m.itl.p99, steps=len(result.steps),
                                      prefill=sum(s.prefill_tokens for s in result.steps),
                                      cached=sum(s.cached_tokens for s in result.steps),
                                      max_step=max(s.prefill_tokens + s.decode_tokens for s in result.steps)))
            tokens.setdefault(name, [r.output_ids for r in result.requests])
    first = next(iter(tokens.values()))
    identical = all(t == first for t in tokens.values())
    medians = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for name, runs in samples.items()}
    print(f"{'setting':<40}{'out tok/s':>10}{'tok/CPU-s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'steps':>7}{'max tok':>8}{'prefill tok':>12}{'cached':>8}")
    for name, m in medians.items():
        print(f"{name:<40}{m['tput']:>10.0f}{m['cpu_tput']:>10.0f}"
              f"{m['ttft50'] * 1e3:>8.1f}ms{m['ttft99'] * 1e3:>8.1f}ms"
              f"{m['itl50'] * 1e3:>7.1f}ms{m['itl99'] * 1e3:>7.1f}ms{m['steps']:>7.0f}{m['max_step']:>8.0f}"
              f"{m['prefill']:>12.0f}{m['cached']:>8.0f}")
    print(f"identical greedy tokens in every setting: {identical}")
    return medians, identical


def stall(model, repeats: int) -> bool:
    c = STALL
    print(f"\n== 1. Stall: {c['n']} requests, closed loop of {c['users']} users, batch limit {c['users']}; "
          f"short chats (prompt {c['short_prompt'][0]}-{c['short_prompt'][1]}, output {c['short_output'][0]}-"
          f"{c['short_output'][1]}), every {c['every']}th a long prompt ({c['long_prompt'][0]}-{c['long_prompt'][1]} "
          f"tokens, output {c['long_output'][0]}-{c['long_output'][1]}) ==")
    settings = {f"budget {DEFAULT_MAX_NUM_BATCHED_TOKENS} (whole prompts)": dict(),
                f"budget {c['budget']}, chunk <= {c['chunk']}": dict(max_num_batched_tokens=c["budget"],
                                                                   max_prefill_chunk=c["chunk"])}
    m, identical = compare(model, stall_requests(seed=0), c["users"], settings, repeats)
    whole, chunked = (m[name] for name in settings)
    itl_ratio, tput_ratio = whole["itl99"] / chunked["itl99"], chunked["tput"] / whole["tput"]
    ttft_ratio = whole["ttft50"] / chunked["ttft50"]
    met = itl_ratio >= 2 and tput_ratio >= 0.9
    print(f"p99 ITL whole / chunked: {itl_ratio:.2f}x; throughput chunked / whole: {tput_ratio:.2f} (by CPU time "
          f"{chunked['cpu_tput'] / whole['cpu_tput']:.2f}); p50 TTFT whole / chunked: {ttft_ratio:.2f}x")
    print(f"target (p99 ITL >= 2x lower with chunking, throughput within 10%): {'met' if met else 'NOT met'}")
    return identical


def shared_prefix(model, repeats: int) -> bool:
    c = SHARED
    print(f"\n== 2. Shared system prompt: {c['n']} requests, closed loop of {c['users']} users, batch limit "
          f"{c['users']}; a {c['system']}-token system prompt + a user part of {c['user'][0]}-{c['user'][1]} tokens, "
          f"output {c['output'][0]}-{c['output'][1]}; mixed steps (budget {DEFAULT_MAX_NUM_BATCHED_TOKENS}), blocks of "
          "16 tokens ==")
    settings = {"no prefix caching": {}, "prefix caching": dict(enable_prefix_caching=True)}
    m, identical = compare(model, shared_requests(seed=1), c["users"], settings, repeats)
    off, on = m["no prefix caching"], m["prefix caching"]
    ratio = off["ttft50"] / on["ttft50"]
    print(f"p50 TTFT without / with caching: {ratio:.2f}x; prefill tokens computed without / with: "
          f"{off['prefill'] / on['prefill']:.2f}x; throughput with / without: {on['tput'] / off['tput']:.2f}")
    print(f"target (p50 TTFT >= 3x lower with prefix caching): {'met' if ratio >= 3 else 'NOT met'}")
    return identical


def mixed_step(device, dtype, repeats: int) -> bool:
    """Time a decode batch, a prefill chunk, and both in one call, on SmolLM2; return whether the fused
    call's logits match the separate calls'."""
    model, _ = load_pretrained("smollm2-135m-instruct", device, dtype)
    c, config = MIXED, model.config
    B, L = c["decode_rows"], c["context"]
    print(f"\n== 3. The mixed step: SmolLM2-135M-Instruct ({config.n_layers} layers, d_model {config.d_model}), "
          f"a decode batch of {B} rows at context {L}, prefill chunks of {', '.join(map(str, c['chunks']))} tokens "
          f"at position 0; median of {2 * repeats + 1} timed calls each, alternating ==")
    calls = mixed_step_calls(model, B, L, c["chunks"])  # blocks of 16 tokens, earlier positions zeros
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    ok = True
    print(f"{'chunk':>6}{'decode ms':>11}{'prefill ms':>12}{'sum ms':>9}{'mixed ms':>10}{'sum/mixed':>11}"
          f"{'by CPU s':>11}{'decode rows add':>17}{'share':>11}{'by CPU s':>10}")
    for C in c["chunks"]:
        fns = {"decode": calls["decode"], "prefill": calls[f"chunk {C}"], "mixed": calls[f"fused {C}"]}
        wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
        for fn in fns.values():  # warm-up
            fn()
        for _ in range(2 * repeats + 1):
            for name, fn in fns.items():
                t0, c0 = now(device), time.process_time()
                fn()
                wall[name].append(now(device) - t0)
                cpu[name].append(time.process_time() - c0)
        d, p, m = (statistics.median(wall[k]) for k in fns)
        cd, cp, cm = (statistics.median(cpu[k]) for k in fns)
        separate = torch.cat([fns["decode"](), fns["prefill"]()]).float()  # (B + C, vocab)
        ok &= bool(torch.allclose(fns["mixed"]().float(), separate, rtol=tol, atol=tol))
        print(f"{C:>6}{d * 1e3:>11.1f}{p * 1e3:>12.1f}{(d + p) * 1e3:>9.1f}{m * 1e3:>10.1f}{(d + p) / m:>10.2f}x"
              f"{(cd + cp) / cm:>10.2f}x{(m - p) * 1e3:>14.1f} ms{(m - p) / d:>11.0%}{(cm - cp) / cd:>10.0%}")
    print("sum/mixed: the separate calls' time over the fused call's (by wall time, and by this process's CPU "
          "time);\n'decode rows add': fused - prefill alone, what the decode tokens cost when they ride on the "
          "chunk's\nweight reads; 'share': that over the decode call alone (by wall time, and by CPU time)")
    print(f"fused logits match the separate calls' (every row, within {tol:g}): {ok}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (part 3: 2R+1 calls)")
    parser.add_argument("--skip-smollm", action="store_true", help="parts 1 and 2 only (no SmolLM2 load)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = pick_device()
    print(f"bench_engine: torch {torch.__version__}, device {device}, dtype {str(dtype).removeprefix('torch.')}, "
          f"threads {torch.get_num_threads()}, {args.repeats} runs per setting (medians)")
    model = build_model("tiny", device=device, dtype=dtype)
    print(f"parts 1-2: the tiny preset ({model.config.n_params / 1e6:.1f}M parameters, random weights), fast "
          f"enough for whole workloads on a CPU; KV pool for batch limit x max_seq_len tokens (no preemption)")
    Engine(model, EngineConfig(max_batch_size=4)).run(stall_requests(seed=9)[:8], concurrency=4)  # warm-up
    ok = stall(model, args.repeats)
    ok &= shared_prefix(model, args.repeats)
    if not args.skip_smollm:
        ok &= mixed_step(device, dtype, args.repeats)
    if not ok:
        sys.exit("correctness check failed: the compared settings disagree")


if __name__ == "__main__":
    main()
