"""minillm against llama.cpp on the same GGUF file: decode tokens/s at 1 and 2 threads, and bandwidth shares.

SmolLM2-135M-Instruct (the packaged Q4_1 file). minillm decodes the file's own 4-bit weights
(``load_precision(precision="int4")``: the block kernel, int8 activations, where the CPU has AVX2) the way
``python -m minillm --precision int4 --threads N`` does (``minillm.fast.compiled.command_line_decoder``: the
compiled static step where it can be, else the model's eager step), and its eager step as well; llama.cpp
(llama-cpp-python's ``Llama``, its defaults) runs the same file in a child process of the Python that has it
(``--llama-python``; ``llama_peer.py``). The prompt "Once upon a time, in a small village," (minillm's token
ids, fed to both), greedy, EOS off, 128 new tokens. In every round each contender runs once at each thread
count, alternating, so a noisy neighbour slows them alike; a row is the median of the rounds and the range
of their tokens/s. Decode only: the time from the first new token to the last, over its n - 1 steps.

A peer is measured at its best: the script prints llama.cpp's own feature banner and says which of this
CPU's instruction sets the build left out; it prints no verdict against a build without a feature minillm's
kernel uses (``llama_peer.build_problem``). "met" means minillm's command-line step reached at least
llama.cpp's tokens/s at every thread count measured.

Each row's share of the measured read bandwidth: the bytes one decode step reads (weights as stored, plus
the KV cache at the mean context) x tokens/s, over a read (a sum over a working set >= 4x the last-level
cache) measured in the same run at the same thread count. At 1 thread that is one core's figure. It is not
MBU, which divides by the memory's datasheet peak.

    python benchmarks/bench_peers.py [--threads 1,2] [--rounds 7] [--new-tokens 128] [--llama-python PY]
                                     [--step auto|compiled|eager] [--all-precisions]
"""
from __future__ import annotations

import argparse
import sys
import time

from llama_peer import (
    LlamaChild,
    build_problem,
    features_not_built,
    gguf_tensor_bytes,
    install_hint,
    llama_problem,
)

from minillm.fast.blockdot import cpu_flags
from minillm.fast.compiled import STEPS

PROMPT = "Once upon a time, in a small village,"
TARGET = 1.0  # minillm's command-line int4 step over llama.cpp, tokens/s, at every thread count
CLI = "int4 compiled"  # what `python -m minillm --precision int4` runs where the step compiles


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (every contender once each; default 7)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens a run (default 128)")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python that has llama_cpp (default: this one); llama.cpp runs in its child")
    parser.add_argument("--step", choices=STEPS, default="auto",
                        help="the command line's --step: auto (default: the compiled static step where it can be), "
                             "compiled, eager")
    parser.add_argument("--all-precisions", action="store_true",
                        help="also float32, bfloat16, int8 and int4 through PyTorch's int4 kernel (eager)")
    args = parser.parse_args(argv)
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads={args.threads!r}: give thread counts such as 1,2")
    if min(args.thread_counts) < 1 or args.rounds < 1 or args.new_tokens < 2:
        parser.error("thread counts and --rounds must be >= 1, --new-tokens >= 2")
    return args


def waiting_note(speed: dict, cpu_speed: dict) -> str:
    """Whether the one-thread runs had their core: a run's wall time over its CPU time is 1.00 when nothing
    else ran on the core, more when it waited. ``speed`` and ``cpu_speed``: (name, threads) -> steps a wall
    second and steps a CPU second."""
    waited = {name: cpu_speed[name, t] / speed[name, t] for name, t in speed if t == 1}  # wall s / CPU s
    if not waited:
        return "no 1-thread runs: nothing to say about waiting"
    name = max(waited, key=waited.get)
    note = f"1-thread runs: wall time / CPU time at most {waited[name]:.2f} ({name})"
    if waited[name] > 1.05:
        return note + ": other programs took the core part of the time; the tok/CPU-s columns are steadier"
    return note + ": each run had its core"


def verdict(ratios: dict[int, float], problem: str | None) -> str:
    """The target line's verdict: "met" only when every thread count's ratio reaches TARGET and the peer is
    a fair one."""
    if problem:
        return f"no verdict: {problem}"
    return "met" if min(ratios.values()) >= TARGET else "NOT met"


def stepped(fn, threads: int):
    """``fn`` run with torch at ``threads`` threads."""
    import torch

    def run():
        torch.set_num_threads(threads)
        return fn()
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from bench_precision import decode_run
    from timed_runs import Run, interleaved, tokens_per_s

    from minillm import generate
    from minillm.analysis.arithmetic import kv_cache_bytes
    from minillm.analysis.roofline import last_level_cache, measure_bandwidth
    from minillm.analysis.roofline import read_probe_bytes as probe_bytes
    from minillm.checkpoints.pretrained import gguf_path
    from minillm.fast.blockdot import kernel_isa
    from minillm.fast.compiled import command_line_decoder
    from minillm.fast.int4 import kernels_used, load_int4
    from minillm.fast.precision import load_precision
    from minillm.fast.quant import streamed_bytes

    n, path, flags = args.new_tokens, gguf_path(), cpu_flags()
    llc, llc_text = last_level_cache()
    print(f"bench_peers: torch {torch.__version__}, CPU ({torch.backends.cpu.get_cpu_capability()}), threads "
          f"{args.threads}, {args.rounds} rounds; {path.name}; prompt {PROMPT!r}, greedy, EOS off, {n} new tokens")
    print(f"last-level cache: {llc_text}; read probe working set {probe_bytes(llc) / 2**20:.0f} MiB")
    int4, tokenizer = load_precision(precision="int4")
    models = {"int4 eager": int4}
    if args.all_precisions:
        models |= {name: load_precision(precision=name)[0] for name in ("float32", "bfloat16", "int8")}
        models["int4 torch kernel"] = load_int4(kernel="int4pack")[0]  # the same blocks, PyTorch's kernel
    print(f"int4: {kernels_used(int4)}; block kernel built for {kernel_isa()}")
    prompt = tokenizer.encode(PROMPT)
    context = len(prompt) + n // 2  # the mean context of the decode steps
    step_bytes = {name: streamed_bytes(m) + kv_cache_bytes(m.config, context, 1, m.dtype) for name, m in models.items()}
    contenders = {name: (lambda m=m: decode_run(lambda k: generate(m, prompt, k, eos_token_id=None), n))
                  for name, m in models.items()}

    torch.set_num_threads(args.thread_counts[0])
    start = time.perf_counter()
    decoder, step_text = command_line_decoder(int4, len(prompt), n, args.step)
    if decoder is not None:
        decoder.generate(prompt, 2)
        contenders = {CLI: lambda: decode_run(lambda k: decoder.generate(prompt, k), n), **contenders}
        step_bytes[CLI] = step_bytes["int4 eager"]
        step_text += f"; first call {time.perf_counter() - start:.0f} s"
    print(f"python -m minillm --precision int4 decodes with: {step_text}")
    cli = CLI if decoder is not None else "int4 eager"  # what the command line runs here

    problem, llama = llama_problem(args.llama_python), None
    if problem:
        print(f"llama.cpp: SKIPPED: {problem}.\n  To compare, build it for this CPU: {install_hint(flags)}")
    else:
        llama = LlamaChild(args.llama_python, path, args.thread_counts, n)
        step_bytes["llama.cpp"] = gguf_tensor_bytes(path) + kv_cache_bytes(int4.config, context, 1, "float16")
        print(f"llama.cpp: llama-cpp-python {llama.version} via {args.llama_python}\n  {llama.system}")
        problem = build_problem(llama.system, kernel_isa())
        left_out = features_not_built(llama.system, flags)
        print("  built with every instruction set of this CPU that ggml has a switch for" if not left_out else
              f"  this CPU's {', '.join(left_out)} are not in the build; for this CPU: {install_hint(flags)}")

    bandwidth = {}
    for threads in args.thread_counts:
        torch.set_num_threads(threads)
        bandwidth[threads] = measure_bandwidth(probe_bytes(llc))
    runs = {}
    for threads in args.thread_counts:
        for name, fn in contenders.items():
            runs[name, threads] = stepped(fn, threads)
        if llama:
            def peer(t=threads):
                answer = llama.generate(t, prompt)
                return Run(answer["tokens"], answer["decode_s"], answer["cpu_s"], [])
            runs["llama.cpp", threads] = peer
    interleaved(1, runs)  # warm-up
    results = interleaved(args.rounds, runs)
    if llama:
        llama.close()

    names = [*contenders, *(["llama.cpp"] if llama else [])]
    speed = {key: tokens_per_s(n - 1, rs, "wall") for key, rs in results.items()}  # decode steps/s
    cpu_speed = {key: tokens_per_s(n - 1, rs, "cpu") for key, rs in results.items()}  # per CPU second
    spread = {key: [(n - 1) / r.wall for r in rs] for key, rs in results.items()}
    print("\n" + waiting_note(speed, cpu_speed))
    print(f"{'':>17} | threads | {'tok/s':>6} | ms/token | vs llama.cpp | tok/CPU-s | vs llama.cpp | MB/token | "
          f"{'GB/s':>5} | of read BW | {'range of rounds':>15} | same tokens as llama.cpp")
    for threads in args.thread_counts:
        print(f"{'read BW':>17} | {threads:>7} | sum over {probe_bytes(llc) / 2**20:.0f} MiB: "
              f"{bandwidth[threads] / 1e9:.1f} GB/s" + (" (one core's figure)" if threads == 1 else ""))
        for name in names:
            key = (name, threads)
            s, peer = speed[key], speed.get(("llama.cpp", threads))
            cpu_peer = cpu_speed.get(("llama.cpp", threads))
            low, high = min(spread[key]), max(spread[key])
            same = "" if not llama else next((f"{i}/{n}" for i, (a, b) in enumerate(
                zip(results[key][0].tokens, results["llama.cpp", threads][0].tokens)) if a != b), f"{n}/{n}")
            used = step_bytes[name] * s
            print(f"{name:>17} | {threads:>7} | {s:>6.1f} | {1e3 / s:>8.2f} | "
                  f"{(f'{s / peer:.2f}x' if peer else '-'):>12} | {cpu_speed[key]:>9.1f} | "
                  f"{(f'{cpu_speed[key] / cpu_peer:.2f}x' if cpu_peer else '-'):>12} | "
                  f"{step_bytes[name] / 1e6:>8.1f} | {used / 1e9:>5.1f} | {used / bandwidth[threads]:>10.0%} | "
                  f"{f'{low:.1f}-{high:.1f}':>15} | {same}")
    print(f"(decode only: the {n - 1} steps from the first new token to the last (minillm: T({n}) - T(1)); median "
          f"and range of {args.rounds} alternating rounds; tok/CPU-s: the same steps per CPU second of the process "
          "that ran them, and its ratio; MB/token: weights as stored + KV cache at the mean context; of read BW: "
          "GB/s over the read measured at that thread count; same tokens: steps until the first difference)")
    target = (f"target: minillm's command-line int4 step ({cli}) >= {TARGET}x llama.cpp tokens/s at threads "
              f"{args.threads}")
    if not llama:
        print(f"{target}: not measured (llama.cpp skipped)")
        return 0
    ratios = {t: speed[cli, t] / speed["llama.cpp", t] for t in args.thread_counts}
    others = "".join(f"; {name} " + ", ".join(f"{speed[name, t] / speed['llama.cpp', t]:.2f}x"
                                              for t in args.thread_counts) for name in contenders if name != cli)
    print(f"{target}: {', '.join(f'{r:.2f}x' for r in ratios.values())} ({verdict(ratios, problem)}){others}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
