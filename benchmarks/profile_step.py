"""Where a decode step's time goes: minillm's int4 step and llama.cpp's, the same file, prompt and threads.

Both decode SmolLM2-135M-Instruct from the packaged Q4_1 GGUF file, greedily, after the prompt "Once upon a
time, in a small village," (minillm's token ids, fed to both). Each engine's step is timed twice:

* **as it runs** (no instrument): the median wall time of a step, from the first new token to the last;
* **by part**, in a second, instrumented run over the same tokens:
  - minillm: ``torch.profiler``. In the eager step, forward hooks label each module's operations (norms,
    block-kernel matmuls, attention with its rotary and cache writes, SwiGLU, the residual adds and
    embedding in between); in the compiled step the parts are the kernels Inductor generated (each
    ``cpp_fused_*`` loop, named with ``cpp.enable_kernel_profile``) and the ops it calls. The operations'
    own CPU time is summed by part; what is left of the step as it runs is Python and dispatch between
    them.
  - llama.cpp: its eval callback (``cb_eval``): every graph node is computed on its own and timed
    (``llama_peer.OpTimer``); ``llama_perf_context`` gives the time spent in ``llama_decode``, the rest of
    the step is sampling and llama-cpp-python's Python.

Instruments add their own cost (a profiler event, a graph run per node), so the parts of an instrumented
run add up to more than the step as it runs; the table prints both.

    python benchmarks/profile_step.py [--threads 1] [--steps 64] [--llama-python PY] [--no-compiled]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from llama_peer import LlamaChild, llama_problem

PROMPT = "Once upon a time, in a small village,"
PARTS = ("matmuls", "attention", "rotary", "cache writes, copies", "norms", "SwiGLU", "residual adds",
         "embedding", "fused element-wise", "sampling", "wrapper (Python)", "guards (dynamo)", "Python in the loop",
         "outside llama_decode")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="threads of both engines (default 1)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a Python that has llama_cpp (default: this one)")
    parser.add_argument("--no-compiled", action="store_true", help="skip minillm's compiled step")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.steps < 2:
        parser.error("--threads must be >= 1 and --steps >= 2")
    return args


# --- minillm -----------------------------------------------------------------------------------------------

MODULE_PARTS = {"RMSNorm": "norms", "BlockLinear": "matmuls", "Int4Linear": "matmuls", "MLP": "SwiGLU",
                "Attention": "attention", "RotaryEmbedding": "rotary", "CausalLM": "residual adds"}


def label_modules(model):
    """Forward hooks that open a profiler range "part:<name>" around each labelled module (MODULE_PARTS);
    returns the hook handles."""
    import torch

    handles, open_ranges = [], []

    def enter(part):
        def hook(module, args):
            open_ranges.append(torch.profiler.record_function(f"part:{part}").__enter__())
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        part = MODULE_PARTS.get(type(module).__name__)
        if part:
            handles += [module.register_forward_pre_hook(enter(part)), module.register_forward_hook(leave)]
    return handles


def eager_part(event) -> str | None:
    """The part of an eager profiler event: the innermost labelled module around it (attention refined by
    the operator's name); None for a label itself (its own time is the hooks' and Python's)."""
    if event.name.startswith("part:"):
        return None
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("part:"):
        parent = parent.cpu_parent
    if parent is None:
        return "sampling" if "argmax" in event.name else "Python in the loop"
    part = parent.name.removeprefix("part:")
    if part == "attention":
        if "scaled_dot_product" in event.name:
            return "attention"
        if "index_put" in event.name or "copy_" in event.name:
            return "cache writes, copies"
        return "rotary"  # q, k rotated; the views around the kernel
    if part == "residual adds" and "embedding" in event.name:
        return "embedding"
    return part


COMPILED_PARTS = {"minillm::": "matmuls", "scaled_dot_product": "attention", "cpp_fused": "fused element-wise",
                  "TorchDynamo Cache Lookup": "guards (dynamo)", "argmax": "sampling"}


def compiled_part(event) -> str:
    """The part of a compiled-step profiler event: by its own name or the nearest named one around it; the
    compiled region's own time is its generated Python wrapper."""
    e = event
    while e is not None:
        part = next((p for key, p in COMPILED_PARTS.items() if key in e.name), None)
        if part:
            return part
        e = e.cpu_parent
    region = event
    while region is not None and not region.name.startswith("Torch-Compiled Region"):
        region = region.cpu_parent
    return "wrapper (Python)" if region is not None else "Python in the loop"


def time_steps(step_fn, steps: int) -> float:
    """The median wall seconds of ``step_fn()`` (one decode step and its sampling), after a warm-up."""
    for _ in range(4):
        step_fn()
    stamps = [time.perf_counter()]
    for _ in range(steps):
        step_fn()
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def profile_steps(step_fn, steps: int, part_of) -> tuple[dict, int]:
    """``steps`` calls of ``step_fn`` under torch.profiler -> ({part: seconds per step}, events per
    step): every event's own CPU time (its children's excluded), summed by ``part_of(event)``."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step_fn()
    seconds, ops = {}, 0
    for event in prof.events():
        part = part_of(event)
        if part is not None:
            seconds[part] = seconds.get(part, 0.0) + event.self_cpu_time_total / 1e6 / steps
            ops += 1
    return seconds, ops // steps


def minillm_runs(args, model, prompt: list[int]) -> dict[str, tuple]:
    """{"int4 eager": (step s, {part: s}, operators), "int4 compiled": ...}: the steps the CLI can run,
    each timed as it runs and then profiled."""
    import torch

    from minillm.cache import KVCache
    from minillm.fast.compiled import StaticDecoder

    max_len = len(prompt) + 16 + 2 * args.steps
    ids = torch.tensor([prompt])  # (1, T)
    cache = KVCache(model.config, 1, max_len, model.device, model.dtype)
    state = {}

    def prefill():
        cache.reset()
        state["token"] = model(ids, cache=cache)[:, -1].argmax(-1)  # (1,)

    def eager_step():  # what generate() does a step: the model on one token, greedy sampling
        if int(cache.lengths.max()) >= max_len - 1:
            prefill()
        state["token"] = model(state["token"][:, None], cache=cache)[:, -1].argmax(-1)

    with torch.inference_mode():
        prefill()
        step = time_steps(eager_step, args.steps)
        handles = label_modules(model)
        seconds, ops = profile_steps(eager_step, args.steps, eager_part)
        for handle in handles:
            handle.remove()
    results = {"int4 eager": (step, seconds, ops)}
    if args.no_compiled:
        return results
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # each generated loop is a profiler event
    decoder = StaticDecoder(model, max_len)
    if decoder.backend != "compile":
        print(f"int4 compiled: skipped ({decoder.reason})")
        return results
    start = time.perf_counter()
    decoder.generate(prompt, 2)
    print(f"int4 compiled: {decoder.reason}; first call {time.perf_counter() - start:.0f} s")
    cache = decoder.cache

    def compiled_step():
        if int(state["position"][0]) >= max_len - 1:
            prefill()
            state["position"] = cache.lengths.clone()
        logits = decoder.step(model, cache.k, cache.v, state["token"][:, None], state["position"])
        state["token"], state["position"] = logits.argmax(-1), state["position"] + 1

    with torch.inference_mode():
        prefill()
        state["position"] = cache.lengths.clone()  # (1,) where the next token goes
        step = time_steps(compiled_step, args.steps)
        seconds, ops = profile_steps(compiled_step, args.steps, compiled_part)
    results["int4 compiled"] = (step, seconds, ops)
    return results


# --- the table ---------------------------------------------------------------------------------------------

def print_table(columns: dict[str, dict]) -> None:
    """columns: engine -> {"parts": {part: s}, "step": s as it runs, "note": ...}."""
    parts = [p for p in PARTS if any(p in c["parts"] for c in columns.values())]
    parts += sorted({p for c in columns.values() for p in c["parts"]} - set(parts))
    names = list(columns)
    print(f"{'ms per decode step':>34} | " + " | ".join(f"{n:>15}" for n in names))
    for part in parts:
        cells = [columns[n]["parts"].get(part) for n in names]
        print(f"{part:>34} | " + " | ".join(f"{c * 1e3:>15.3f}" if c is not None else f"{'-':>15}" for c in cells))
    sums = [sum(columns[n]["parts"].values()) for n in names]
    print(f"{'sum of the parts (instrumented)':>34} | " + " | ".join(f"{s * 1e3:>15.3f}" for s in sums))
    print(f"{'step as it runs (no instrument)':>34} | " +
          " | ".join(f"{columns[n]['step'] * 1e3:>15.3f}" for n in names))
    rest = [columns[n]["step"] - s for n, s in zip(names, sums)]
    print(f"{'step as it runs - parts':>34} | " + " | ".join(f"{r * 1e3:>15.3f}" for r in rest))
    for name in names:
        print(f"{name}: {columns[name]['note']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from minillm.checkpoints.pretrained import gguf_path
    from minillm.fast.precision import load_precision

    torch.set_num_threads(args.threads)
    model, tokenizer = load_precision(precision="int4")
    prompt = tokenizer.encode(PROMPT)
    print(f"profile_step: torch {torch.__version__}, CPU ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s); {gguf_path().name}; prompt {PROMPT!r} ({len(prompt)} tokens), greedy, "
          f"{args.steps} decode steps timed per run")
    columns = {}
    for name, (step, seconds, ops) in minillm_runs(args, model, prompt).items():
        note = (f"{ops} profiler events a step, each adding its own cost; step as it runs - parts: Python and "
                "dispatch outside the events, less the events' own cost (< 0: the events cost more)")
        columns[name] = {"parts": seconds, "step": step, "note": note}
    problem = llama_problem(args.llama_python)
    if problem:
        print(f"llama.cpp: SKIPPED: {problem}")
    else:
        llama = LlamaChild(args.llama_python, gguf_path(), [args.threads], args.steps + 1)
        print(f"llama.cpp: llama-cpp-python {llama.version} via {args.llama_python}\n  {llama.system}")
        runs = [llama.generate(args.threads, prompt) for _ in range(3)]
        run = sorted(runs, key=lambda r: r["decode_s"])[1]  # the median of three
        steps = len(run["tokens"]) - 1
        parts = llama.profile(args.threads, prompt, run["tokens"])
        llama.close()
        step, in_decode = run["decode_s"] / steps, run["eval_s"] / run["evals"]
        seconds = dict(parts["seconds"])
        seconds["outside llama_decode"] = step - in_decode  # generate()'s sampling and Python
        columns["llama.cpp"] = {"parts": seconds, "step": step, "note": (
            f"{parts['nodes']:.0f} graph nodes a step, each run on its own (at 2+ threads each start costs its "
            f"threads' wake-up); llama_decode {in_decode * 1e3:.2f} ms a step (llama_perf_context); outside it "
            "(sampling, llama-cpp-python's Python) the step as it runs less that")}
    print()
    print_table(columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
