"""Fewer bytes per decode step, measured side by side in one run on one machine.

1. SmolLM2-135M-Instruct in float32, bfloat16 (F.linear, and matrix-vector for one token), int8
   weight-only (the int8 kernel; also through the compiled static decode step) and int8 dequantized
   before every matmul: decode tokens/s, bytes per step, bandwidth utilisation against a read
   bandwidth measured in the same run (a working set above the reported last-level cache), mean NLL /
   perplexity on a fixed text, greedy agreement.
2. The kernels behind it, one token through SmolLM2's matmul shapes (30 layers, then the 49152 x 576
   head): float32 and bfloat16 F.linear, bfloat16 as a matrix-vector product, int8 with bfloat16 or
   float32 activations, dequantize-then-matmul; and the same probe in a child process limited to AVX2
   (no AVX-512, no bfloat16 instructions), as on a CPU without them.
3. The tiny model: minillm's generate (eager forward) against the static decode step, eager and
   compiled, against transformers' generate.

    python benchmarks/bench_precision.py [--quick] [--threads N] [--repeats R]
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from timed_runs import Run, check_identical, interleaved, run_transformers, timed, tokens_per_s

import minillm
from minillm import build_model, generate, get_config
from minillm.analysis.arithmetic import bandwidth_utilisation, kv_cache_bytes
from minillm.analysis.roofline import default_probe_bytes, last_level_cache, measure_bandwidth, median_time
from minillm.book.data import EVAL_TEXT
from minillm.checkpoints.hf import to_transformers
from minillm.checkpoints.pretrained import gguf_checkpoint
from minillm.fast.compiled import StaticDecoder
from minillm.fast.quant import dequantize_int8, greedy_match, make_variant, mean_nll, quantize_int8, streamed_bytes

VARIANTS = ("float32", "bfloat16-linear", "bfloat16", "int8", "int8-dequant")
PROMPT = "Explain in detail how a refrigerator keeps food cold."
TARGET_SPEEDUP = {"int8": 2.5, "bfloat16": 1.4}  # tokens/s over float32
TARGET_PPL_RISE = 0.02  # perplexity within 2% of float32
TARGET_UTILISATION = 0.60  # best variant, of the measured read bandwidth
TARGET_COMPILED_OVER_HF = 1.5
COMPILED = "int8 + compiled step"  # the int8 model through minillm.fast.compiled.StaticDecoder
NO_AVX512_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="32 new tokens instead of 128 (64 instead of 256 on the tiny model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender after a warm-up")
    parser.add_argument("--probe-mib", type=int, default=None,
                        help="working set of the read-bandwidth probe (MiB; default 4x the reported last-level "
                             "cache, at least 256)")
    parser.add_argument("--kernels-only", action="store_true", help=argparse.SUPPRESS)  # the child probe
    args = parser.parse_args()
    for name in ("threads", "repeats", "probe_mib"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


# --- 1. SmolLM2 variants -----------------------------------------------------------------------------

def decode_run(generate_n, n: int) -> Run:
    """An n-token run less its prefill: its tokens, and the wall and CPU seconds of its n - 1 decode
    steps (time of n tokens - time of 1 token)."""
    full, first = timed(lambda: generate_n(n)), timed(lambda: generate_n(1))
    return Run(full.tokens, full.wall - first.wall, full.cpu - first.cpu, [])


def variants(args, n: int) -> None:
    model, tokenizer = minillm.load_pretrained("smollm2-135m-instruct")
    models = {name: make_variant(model, name) for name in VARIANTS}
    del model
    prompt = tokenizer.encode_chat(PROMPT)
    eval_ids = torch.tensor([tokenizer.encode(EVAL_TEXT)])  # (1, 296)
    probe = default_probe_bytes() if args.probe_mib is None else args.probe_mib * 2**20
    bandwidth = measure_bandwidth(probe)
    start = time.perf_counter()
    decoder = StaticDecoder(models["int8"], len(prompt) + n)
    decoder.generate(prompt, 2)
    compile_s = time.perf_counter() - start
    contenders = {name: (lambda k, m=models[name]: generate(m, prompt, k, eos_token_id=None))
                  for name in VARIANTS}
    contenders[COMPILED] = lambda k: decoder.generate(prompt, k)
    print(f"\n1. SmolLM2-135M-Instruct variants: batch 1, greedy, EOS off, {len(prompt)}-token chat prompt, "
          f"{n} new tokens, {args.repeats} timed runs each (alternating), medians; decode step = (time of {n} "
          f"tokens - time of 1) / {n - 1}")
    print(f"read bandwidth (sum over {probe / 2**20:.0f} MiB; last-level cache {last_level_cache()[1]}): "
          f"{bandwidth / 1e9:.1f} GB/s at {torch.get_num_threads()} thread(s)")
    print(f"{COMPILED}: {decoder.reason}; first call {compile_s:.1f} s")
    for fn in contenders.values():
        fn(4)  # warm-up
    runs = interleaved(args.repeats, {name: (lambda fn=fn: decode_run(fn, n)) for name, fn in contenders.items()})
    reference = runs["float32"][0].tokens
    nll = {name: mean_nll(models[name], eval_ids) for name in VARIANTS}
    context = len(prompt) + n // 2
    speed = {name: tokens_per_s(n - 1, rs, "wall") for name, rs in runs.items()}  # decode steps/s
    cpu_speed = {name: tokens_per_s(n - 1, rs, "cpu") for name, rs in runs.items()}
    print(f"{'variant':>22} | {'MB/step':>7} | {'tok/s':>6} | {'vs f32':>6} | {'CPU-time':>8} | {'GB/s':>5} | "
          f"{'of read':>7} | {'NLL':>6} | {'ppl':>6} | {'ppl rise':>8} | {'greedy match':>12} | same until")
    utilisation = {}
    for name in contenders:
        model_name = "int8" if name == COMPILED else name
        m = models[model_name]
        step_bytes = streamed_bytes(m) + kv_cache_bytes(m.config, context, 1, m.dtype)
        utilisation[name] = bandwidth_utilisation(step_bytes, speed[name], bandwidth)
        tokens = runs[name][0].tokens
        same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), n)
        match = greedy_match(m, prompt, reference)
        rise = math.exp(nll[model_name] - nll["float32"]) - 1
        print(f"{name:>22} | {step_bytes / 1e6:>7.1f} | {speed[name]:>6.1f} | "
              f"{speed[name] / speed['float32']:>5.2f}x | {cpu_speed[name] / cpu_speed['float32']:>7.2f}x | "
              f"{step_bytes * speed[name] / 1e9:>5.1f} | {utilisation[name]:>6.0%} | {nll[model_name]:>6.3f} | "
              f"{math.exp(nll[model_name]):>6.2f} | {rise:>+8.2%} | {match:>12.1%} | {same}/{n}")
    print("(vs f32: tokens/s over float32's, wall clock; CPU-time: the same ratio by CPU seconds)")
    compiled, eager = runs[COMPILED][0].tokens, runs["int8"][0].tokens
    same = next((i for i, (a, b) in enumerate(zip(compiled, eager)) if a != b), n)
    print(f"{COMPILED} against eager int8: the same greedy tokens for {same} of {n} steps (fused bfloat16 "
          "kernels round differently; in float32 the two give identical tokens, part 3)")
    for name, target in TARGET_SPEEDUP.items():
        best = max((k for k in contenders if k.startswith(name) and k != f"{name}-dequant"
                    and k != "bfloat16-linear"), key=speed.get)
        ratio, cpu_ratio = speed[best] / speed["float32"], cpu_speed[best] / cpu_speed["float32"]
        print(f"target {name} >= {target}x float32 tokens/s: {best} {ratio:.2f}x, by CPU time "
              f"{cpu_ratio:.2f}x ({'met' if ratio >= target else 'NOT met'})")
    for name in ("bfloat16", "int8"):
        rise = math.exp(nll[name] - nll["float32"]) - 1
        verdict = "met" if abs(rise) <= TARGET_PPL_RISE else "NOT met"
        print(f"target {name} perplexity within {TARGET_PPL_RISE:.0%} of float32: {rise:+.2%} ({verdict})")
    best = max(utilisation, key=utilisation.get)
    verdict = "met" if utilisation[best] >= TARGET_UTILISATION else "NOT met"
    print(f"target best variant >= {TARGET_UTILISATION:.0%} of the read bandwidth: {best} at "
          f"{utilisation[best]:.0%} ({verdict})")
    print("sample (int8): " + repr(tokenizer.decode(runs["int8"][0].tokens[:40]))[:100])


# --- 2. kernels ----------------------------------------------------------------------------------------

def kernel_probe(repeats: int) -> None:
    """One token through SmolLM2's matmul shapes, random weights, each kernel on its own copy."""
    c = gguf_checkpoint().config  # SmolLM2-135M's shapes
    layer_shapes = [(c.n_heads * c.head_dim, c.d_model), (c.n_kv_heads * c.head_dim, c.d_model),
                    (c.n_kv_heads * c.head_dim, c.d_model), (c.d_model, c.n_heads * c.head_dim),
                    (c.d_ff, c.d_model), (c.d_ff, c.d_model), (c.d_model, c.d_ff)]
    generator = torch.Generator().manual_seed(0)
    groups = {"30 layers": [shape for _ in range(c.n_layers) for shape in layer_shapes],
              "head": [(c.vocab_size, c.d_model)]}
    print(f"{'kernel (one token)':>32} | " + " | ".join(f"{g:>18}" for g in groups))
    results = {}
    for group, shapes in groups.items():
        weights = [torch.randn(shape, generator=generator) / shape[1] ** 0.5 for shape in shapes]
        xs = {k: torch.randn(1, k, generator=generator) for k in {s[1] for s in shapes}}
        quantized = [quantize_int8(w) for w in weights]
        kernels = {
            "float32 F.linear": ([(w, xs[w.shape[1]]) for w in weights], lambda w, x: F.linear(x, w)),
            "bfloat16 F.linear": ([(w.bfloat16(), xs[w.shape[1]].bfloat16()) for w in weights],
                                  lambda w, x: F.linear(x, w)),
            "bfloat16 weight @ x (mv)": ([(w.bfloat16(), xs[w.shape[1]][0].bfloat16()) for w in weights],
                                         torch.mv),
            "int8pack, bfloat16 activations": ([((q, s.bfloat16()), xs[q.shape[1]].bfloat16()) for q, s in quantized],
                                               lambda qs, x: torch._weight_int8pack_mm(x, *qs)),
            "int8pack, float32 activations": ([((q, s), xs[q.shape[1]]) for q, s in quantized],
                                              lambda qs, x: torch._weight_int8pack_mm(x, *qs)),
            "int8 dequantize, then F.linear": ([((q, s.bfloat16()), xs[q.shape[1]].bfloat16()) for q, s in quantized],
                                               lambda qs, x: F.linear(x, dequantize_int8(*qs, x.dtype))),
        }
        for name, (pairs, op) in kernels.items():
            def run(pairs=pairs, op=op):
                for w, x in pairs:
                    op(w, x)
            with torch.inference_mode():
                results[name, group] = median_time(run, repeats)
            del pairs
    for name in kernels:
        cells = [f"{results[name, g] * 1e3:>8.2f} ms {results['float32 F.linear', g] / results[name, g]:>5.2f}x"
                 for g in groups]
        print(f"{name:>32} | " + " | ".join(cells))
    print("(x: speed against float32 F.linear on the same shapes)")


def kernels(args) -> None:
    print("\n2. Kernels: one token through SmolLM2's matmul shapes (random weights, each kernel reads its own "
          f"copy; {args.repeats + 2} timed runs, median)")
    print(f"this CPU: {torch.backends.cpu.get_cpu_capability()}")
    kernel_probe(args.repeats + 2)
    env = {**os.environ, **NO_AVX512_ENV}
    print(f"\nthe same in a child process with {' '.join(f'{k}={v}' for k, v in NO_AVX512_ENV.items())} "
          "(the code paths of a CPU without AVX-512 and its bfloat16 instructions):")
    child = subprocess.run([sys.executable, __file__, "--kernels-only", "--threads", str(args.threads),
                            "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
    print(child.stdout.rstrip() or child.stderr.strip()[-500:])


# --- 3. tiny model: overhead and compilation -------------------------------------------------------------

def tiny(args, n: int) -> None:
    model = build_model("tiny", seed=0)
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = to_transformers(model, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=0)
    eager = StaticDecoder(model, 16 + n, backend="eager")
    start = time.perf_counter()
    compiled = StaticDecoder(model, 16 + n)
    compiled.generate(prompt, n)
    compile_s = time.perf_counter() - start
    contenders = {"minillm generate": lambda: timed(lambda: generate(model, prompt, n)),
                  "static step, eager": lambda: timed(lambda: eager.generate(prompt, n)),
                  "static step, compiled": lambda: timed(lambda: compiled.generate(prompt, n)),
                  f"transformers {transformers.__version__}": lambda: run_transformers(hf, prompt, n)}
    print(f"\n3. Tiny model ({get_config('tiny').n_params / 1e6:.1f}M parameters, random weights, float32): batch 1, "
          f"16-token prompt, {n} new tokens, greedy; tokens/s over the whole run (prefill included), "
          f"{3 * args.repeats} timed runs each, alternating, medians")
    print(f"compiled step: {compiled.reason}; first call (compile + run) {compile_s:.1f} s")
    interleaved(1, contenders)  # warm-up
    results = interleaved(3 * args.repeats, contenders)
    same = check_identical(results, f"tiny model, {n} new tokens")
    speed = {name: tokens_per_s(n, rs, "wall") for name, rs in results.items()}
    hf_name = list(contenders)[-1]
    print(f"{'':>26} | {'tok/s':>7} | {'ms/token':>8} | vs transformers")
    for name, s in speed.items():
        print(f"{name:>26} | {s:>7.1f} | {1e3 / s:>8.2f} | {s / speed[hf_name]:>6.2f}x")
    ratio = speed["static step, compiled"] / speed[hf_name]
    verdict = "met" if ratio >= TARGET_COMPILED_OVER_HF else "NOT met"
    print(f"target compiled >= {TARGET_COMPILED_OVER_HF}x transformers: {ratio:.2f}x ({verdict}); "
          f"identical tokens: {same}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels_only:
        print(f"capability: {torch.backends.cpu.get_cpu_capability()}")
        kernel_probe(args.repeats + 2)
        return
    n = 32 if args.quick else 128
    print(f"bench_precision{' --quick' if args.quick else ''}: torch {torch.__version__}, CPU, "
          f"threads {torch.get_num_threads()}")
    variants(args, n)
    kernels(args)
    tiny(args, 64 if args.quick else 256)


if __name__ == "__main__":
    main()
