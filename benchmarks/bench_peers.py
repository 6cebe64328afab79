"""minillm against llama.cpp on the same GGUF file: decode tokens/s and the bandwidth each one uses.

SmolLM2-135M-Instruct (the packaged Q4_1 file) through minillm in float32, bfloat16, int8 and int4 (the
file's own 4-bit weights, ``minillm.fast.quant.load_precision``: the block kernel, int8 activations, where the
CPU has AVX2; also through PyTorch's int4 kernel, "int4 torch kernel"), eager and through the compiled static step
(``minillm.fast.compiled.StaticDecoder``, where a C++ compiler exists), against llama.cpp (llama-cpp-python's
``Llama``) on the same file: the prompt "Once upon a time, in a small village," (minillm's token ids, fed to
both), greedy, EOS off, 128 new tokens, at each thread count; the contenders alternate in every round, and the
medians are reported. Decode only: the time from the first new token to the last, over its n - 1 steps.

Each contender's bandwidth use is the bytes one decode token reads (weights as stored, plus the KV cache at the
mean context) x tokens/s, against a read bandwidth (a sum over a working set >= 4x the last-level cache that
lscpu or sysfs reports) measured in the same run at the same thread count: at 1 thread it is one core's figure.

llama-cpp-python is optional and may live in another environment (``--llama-python``): it runs in a child
process of that Python, which answers one generation per request, so its runs interleave with minillm's.

    python benchmarks/bench_peers.py [--threads 1,2] [--rounds 3] [--new-tokens 128] [--llama-python PY]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Once upon a time, in a small village,"
LLAMA_VERSION = "0.3.36"
INSTALL_HINT = (f'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON" pip install '
                f"llama-cpp-python=={LLAMA_VERSION}  (a source build: several minutes; then pass this "
                "environment's python as --llama-python, or install it into minillm's)")
TARGET = 1.0  # minillm int4 tokens/s over llama.cpp's, at one thread
# The last-level cache and the read probe come from minillm.analysis.roofline, imported inside main(), so the
# llama.cpp worker (a child of a Python that may lack torch) never imports minillm.


# --- llama.cpp, in a child process of a Python that has it -------------------------------------------------

def llama_problem(python: str) -> str | None:
    """Why llama.cpp cannot run through ``python`` (None: it can)."""
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{python} cannot run: {error}"
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import llama_cpp` fails in {python}: {last}"
    return None


def llama_worker(args) -> None:
    """The child: one ``Llama`` per thread count; each request line '<threads> <ids as JSON>' answers a JSON
    line {"tokens", "decode_s", "cpu_s"}: greedy, EOS ignored, decode = first to last new token (wall and
    this process's CPU seconds)."""
    import llama_cpp

    llms = {t: llama_cpp.Llama(args.gguf, n_threads=t, n_threads_batch=t, n_ctx=512, verbose=False)
            for t in args.thread_counts}
    print(json.dumps({"ready": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode()}),
          flush=True)
    for line in sys.stdin:
        threads, ids = line.split(" ", 1)
        llm, ids = llms[int(threads)], json.loads(ids)
        tokens, times, cpu = [], [], []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            if len(tokens) == args.new_tokens:
                break
        print(json.dumps({"tokens": tokens, "decode_s": times[-1] - times[0], "cpu_s": cpu[-1] - cpu[0]}),
              flush=True)


class LlamaChild:
    """The parent's side: starts the worker and asks it for one timed generation at a time."""

    def __init__(self, python: str, gguf: Path, thread_counts: list[int], new_tokens: int):
        command = [python, __file__, "--llama-worker", "--gguf", str(gguf), "--new-tokens", str(new_tokens),
                   "--threads", ",".join(map(str, thread_counts))]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self._line())
        self.version, self.system = hello["ready"], hello["system"]

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"FAIL: the llama.cpp worker ended (exit code {self.process.wait()})")
        return line

    def run(self, threads: int, ids: list[int]):
        from timed_runs import Run

        self.process.stdin.write(f"{threads} {json.dumps(ids)}\n")
        self.process.stdin.flush()
        answer = json.loads(self._line())
        return Run(answer["tokens"], answer["decode_s"], answer["cpu_s"], [])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's tensors as stored: what llama.cpp reads a token (its tied head is the embedding)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


# --- the benchmark -----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (every contender once each)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens a run (default 128)")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python that has llama_cpp (default: this one); llama.cpp runs in its child")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled int4 step (~1-2 min)")
    parser.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
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


def stepped(fn, threads: int):
    """``fn`` run with torch at ``threads`` threads."""
    import torch

    def run():
        torch.set_num_threads(threads)
        return fn()
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.llama_worker:
        llama_worker(args)
        return 0
    import torch
    from bench_precision import decode_run
    from timed_runs import interleaved, tokens_per_s

    from minillm import generate
    from minillm.analysis.arithmetic import kv_cache_bytes
    from minillm.analysis.roofline import last_level_cache, measure_bandwidth
    from minillm.analysis.roofline import read_probe_bytes as probe_bytes
    from minillm.checkpoints.pretrained import gguf_path
    from minillm.fast.compiled import StaticDecoder
    from minillm.fast.int4 import kernels_used, load_int4
    from minillm.fast.quant import PRECISIONS, load_precision, streamed_bytes

    n, path = args.new_tokens, gguf_path()
    llc, llc_text = last_level_cache()
    print(f"bench_peers: torch {torch.__version__}, CPU ({torch.backends.cpu.get_cpu_capability()}), threads "
          f"{args.threads}, {args.rounds} rounds; {path.name}; prompt {PROMPT!r}, greedy, EOS off, {n} new tokens")
    print(f"last-level cache: {llc_text}; read probe working set {probe_bytes(llc) / 2**20:.0f} MiB")
    models = {name: load_precision(precision=name)[0] for name in PRECISIONS}
    if kernels_used(models["int4"]) != kernels_used(torch_kernel := load_int4(kernel="int4pack")[0]):
        models["int4 torch kernel"] = torch_kernel  # the same blocks through PyTorch's int4 kernel
    print(f"int4: {kernels_used(models['int4'])}")
    tokenizer = load_precision(precision="int4")[1]
    prompt = tokenizer.encode(PROMPT)
    context = len(prompt) + n // 2  # the mean context of the decode steps
    step_bytes = {name: streamed_bytes(m) + kv_cache_bytes(m.config, context, 1, m.dtype) for name, m in models.items()}

    contenders = {name: (lambda m=m: decode_run(lambda k: generate(m, prompt, k, eos_token_id=None), n))
                  for name, m in models.items()}
    if not args.no_compiled:
        torch.set_num_threads(args.thread_counts[0])
        start = time.perf_counter()
        decoder = StaticDecoder(models["int4"], len(prompt) + n)
        decoder.generate(prompt, 2)
        print(f"int4 compiled: {decoder.reason}; first call {time.perf_counter() - start:.0f} s (compiled at "
              f"{args.thread_counts[0]} thread(s))")
        if decoder.backend == "compile":
            contenders["int4 compiled"] = lambda: decode_run(lambda k: decoder.generate(prompt, k), n)
            step_bytes["int4 compiled"] = step_bytes["int4"]

    problem = llama_problem(args.llama_python)
    llama = None
    if problem:
        print(f"llama.cpp: SKIPPED: {problem}.\n  To compare: {INSTALL_HINT}")
    else:
        llama = LlamaChild(args.llama_python, path, args.thread_counts, n)
        c = models["float32"].config
        step_bytes["llama.cpp"] = gguf_tensor_bytes(path) + kv_cache_bytes(c, context, 1, "float16")
        print(f"llama.cpp: llama-cpp-python {llama.version} via {args.llama_python}")
        print(f"  {llama.system.strip()}")

    results, bandwidth = {}, {}
    for threads in args.thread_counts:
        torch.set_num_threads(threads)
        bandwidth[threads] = measure_bandwidth(probe_bytes(llc))
    runs = {}
    for threads in args.thread_counts:
        for name, fn in contenders.items():
            runs[name, threads] = stepped(fn, threads)
        if llama:
            runs["llama.cpp", threads] = lambda t=threads: llama.run(t, prompt)
    interleaved(1, runs)  # warm-up
    results = interleaved(args.rounds, runs)
    if llama:
        llama.close()

    speed = {key: tokens_per_s(n - 1, rs, "wall") for key, rs in results.items()}  # decode steps/s
    cpu_speed = {key: tokens_per_s(n - 1, rs, "cpu") for key, rs in results.items()}  # per CPU second
    print("\n" + waiting_note(speed, cpu_speed))
    print(f"{'':>17} | threads | {'tok/s':>6} | ms/token | vs llama.cpp | tok/CPU-s | vs llama.cpp | MB/token | "
          f"{'GB/s':>5} | of read BW | same tokens as llama.cpp")
    for threads in args.thread_counts:
        print(f"{'read BW':>17} | {threads:>7} | sum over {probe_bytes(llc) / 2**20:.0f} MiB: "
              f"{bandwidth[threads] / 1e9:.1f} GB/s" + (" (one core's figure)" if threads == 1 else ""))
        for name in [*contenders, *(["llama.cpp"] if llama else [])]:
            s, cs, key = speed[name, threads], cpu_speed[name, threads], (name, threads)
            peer, cpu_peer = speed.get(("llama.cpp", threads)), cpu_speed.get(("llama.cpp", threads))
            tokens = results[key][0].tokens
            same = "" if not llama else next((f"{i}/{n}" for i, (a, b) in enumerate(
                zip(tokens, results["llama.cpp", threads][0].tokens)) if a != b), f"{n}/{n}")
            used = step_bytes[name] * s
            print(f"{name:>17} | {threads:>7} | {s:>6.1f} | {1e3 / s:>8.2f} | "
                  f"{(f'{s / peer:.2f}x' if peer else '-'):>12} | {cs:>9.1f} | "
                  f"{(f'{cs / cpu_peer:.2f}x' if cpu_peer else '-'):>12} | {step_bytes[name] / 1e6:>8.1f} | "
                  f"{used / 1e9:>5.1f} | {used / bandwidth[threads]:>10.0%} | {same}")
    print(f"(decode only: the {n - 1} steps from the first new token to the last (minillm: T({n}) - T(1)), median "
          f"of {args.rounds} alternating rounds; tok/CPU-s: the same steps per CPU second of the process that ran "
          "them; MB/token: weights as stored + KV cache at the mean context; same tokens: steps until the first "
          "difference)")
    if not llama:
        print(f"target minillm int4 >= {TARGET}x llama.cpp tokens/s at 1 thread: not measured (llama.cpp skipped)")
        return 0
    for threads in args.thread_counts:
        int4 = [k for k in contenders if k.startswith("int4")]
        best = max(int4, key=lambda k: speed[k, threads])
        ratio = speed[best, threads] / speed["llama.cpp", threads]
        cpu_ratio = cpu_speed[best, threads] / cpu_speed["llama.cpp", threads]
        others = "".join(f"; {k} {speed[k, threads] / speed['llama.cpp', threads]:.2f}x" for k in int4 if k != best)
        if threads == 1:
            print(f"target minillm int4 >= {TARGET}x llama.cpp tokens/s at 1 thread: {best} {ratio:.2f}x "
                  f"({'met' if ratio >= TARGET else 'NOT met'}), by CPU time {cpu_ratio:.2f}x{others}")
        else:
            print(f"at {threads} threads (reported, no target): {best} {ratio:.2f}x llama.cpp, by CPU time "
                  f"{cpu_ratio:.2f}x{others}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
