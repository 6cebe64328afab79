"""llama.cpp as a peer: built for this CPU, its own feature banner, and a child process that runs it.

llama-cpp-python (the ``llama_cpp`` module, llama.cpp's C library with Python bindings) is no dependency of
minillm: it may live in another environment, whose Python this module starts as a child
(``LlamaChild``); the child imports nothing from minillm or torch and answers one request per line.

A peer is compared at its best, which for llama.cpp means built for the instruction sets of the CPU it
runs on. ``cmake_args`` writes ggml's build options from the CPU's flags (/proc/cpuinfo), and
``build_problem`` reads llama.cpp's own banner (``llama_print_system_info``) for the features minillm's
block kernel uses: a build without them is no fair peer, and the benchmarks then print no verdict.

    python benchmarks/llama_peer.py    # this CPU's build command for llama-cpp-python
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

LLAMA_VERSION = "0.3.36"
# ggml's CMake switches for x86 instruction sets -> the /proc/cpuinfo flag of a CPU that has the set
GGML_OPTIONS = {
    "GGML_AVX": "avx", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2", "GGML_FMA": "fma",
    "GGML_F16C": "f16c", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16", "GGML_AMX_TILE": "amx_tile",
    "GGML_AMX_INT8": "amx_int8", "GGML_AMX_BF16": "amx_bf16",
}
# the names in llama.cpp's banner ("AVX512_VNNI = 1") -> the CPU flag
BANNER_FLAGS = {option.removeprefix("GGML_"): flag for option, flag in GGML_OPTIONS.items()
                if option not in ("GGML_AMX_TILE", "GGML_AMX_BF16")}
# what minillm's block kernel uses, by the instruction set it was compiled for (minillm.fast.blockdot)
KERNEL_FEATURES = {"avx512_vnni": ("AVX512", "AVX512_VNNI", "FMA", "F16C"), "avx2": ("AVX2", "FMA", "F16C")}


def cmake_args(flags: set[str]) -> str:
    """ggml's options for a CPU with ``flags``: every x86 set it has on, the rest off; on a CPU that lists
    none (not Linux x86), llama.cpp's own default, a build for the machine it is built on."""
    if "avx2" not in flags:
        return "-DGGML_NATIVE=ON"
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}"
                                           for option, flag in GGML_OPTIONS.items())])


def install_hint(flags: set[str]) -> str:
    """The command that builds llama-cpp-python for this CPU, in its own environment."""
    return (f'python -m venv llama-venv && CMAKE_ARGS="{cmake_args(flags)}" llama-venv/bin/pip install '
            f"--no-cache-dir llama-cpp-python=={LLAMA_VERSION}  (a source build, several minutes; then pass "
            "--llama-python llama-venv/bin/python)")


def banner_features(system_info: str) -> set[str]:
    """The features llama.cpp's banner reports on: "CPU : SSE3 = 1 | AVX512_VNNI = 1 | ..." ->
    {"SSE3", "AVX512_VNNI", ...}."""
    fields = (part.split("=") for part in system_info.replace("CPU :", "|").split("|") if "=" in part)
    return {name.strip() for name, value in fields if value.strip() == "1"}


def build_problem(system_info: str, kernel_isa: str | None) -> str | None:
    """Why the build is no fair peer of minillm's block kernel compiled for ``kernel_isa`` (None: it is
    one): the features the kernel uses that llama.cpp's banner lacks."""
    lacking = [f for f in KERNEL_FEATURES.get(kernel_isa, ()) if f not in banner_features(system_info)]
    if lacking:
        return (f"llama.cpp was built without {', '.join(lacking)}, which this CPU has and minillm's kernel "
                "uses: no verdict against a handicapped peer")
    return None


def features_not_built(system_info: str, flags: set[str]) -> list[str]:
    """The banner's features that this CPU has and the build left out."""
    built = banner_features(system_info)
    return [name for name, flag in BANNER_FLAGS.items() if flag in flags and name not in built]


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


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's tensors as stored: what llama.cpp reads a token (its tied head is the embedding)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


# --- the child: runs in the Python that has llama_cpp --------------------------------------------------------

# ggml operations that compute nothing (a new view of the same bytes): timed together with the next one
VIEWS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


def op_category(op: str, name: str) -> str:
    """A ggml graph node (its operation and tensor name, e.g. "MUL_MAT", "ffn_up-3") -> a step part."""
    if op == "MUL_MAT":
        return "attention" if name.startswith("kq") else "matmuls"
    if op in ("RMS_NORM", "NORM") or (op == "MUL" and "norm" in name):
        return "norms"
    if op == "ROPE":
        return "rotary"
    if op in ("SOFT_MAX", "FLASH_ATTN_EXT", "SCALE"):
        return "attention"
    if op in ("CPY", "SET_ROWS", "CONT", "DUP"):
        return "cache writes, copies"
    if op in ("GLU", "SWIGLU", "GEGLU", "SILU", "UNARY") or (op == "MUL" and name.startswith("ffn")):
        return "SwiGLU"
    if op == "ADD":
        return "residual adds"
    if op == "GET_ROWS":
        return "embedding"
    return f"other ({op})"


class OpTimer:
    """llama.cpp's eval callback: asked about each graph node, it asks for every node that computes, so
    the scheduler runs them one at a time and calls back after each; the time from the answer to the
    call back is that node's (its view nodes included). ``seconds`` sums them by ``op_category``."""

    def __init__(self, llama_cpp):
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        lib.ggml_op_desc.restype = lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_op_desc.argtypes = lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        self.lib, self.on, self.seconds, self.nodes, self._start = lib, False, {}, 0, 0.0
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._called)  # kept alive here

    def _called(self, tensor, ask, _user_data) -> bool:
        now = time.perf_counter()
        if not self.on:
            return False
        op = self.lib.ggml_op_desc(tensor).decode()
        if ask:
            if op in VIEWS:
                return False
            self._start = time.perf_counter()
            return True
        part = op_category(op, self.lib.ggml_get_name(tensor).decode())
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._start
        self.nodes += 1
        return True


def worker(gguf: str, thread_counts: list[int], new_tokens: int) -> None:
    """The child's loop. It prints {"ready": version, "system": banner}, then answers each request line:
    ``generate <threads> <prompt ids>``: greedy, EOS ignored -> {"tokens", "decode_s", "cpu_s",
    "eval_s"}: wall and CPU seconds from the first new token to the last, and llama.cpp's own time in
    llama_decode over those steps (``llama_perf_context``);
    ``profile <threads> <prompt ids> <tokens>``: the tokens fed one by one after the prompt, each graph node
    timed (``OpTimer``) -> {"seconds": {part: s per step}, "nodes": nodes per step}."""
    import llama_cpp

    llms = {t: llama_cpp.Llama(gguf, n_threads=t, n_threads_batch=t, n_ctx=512, verbose=False)
            for t in thread_counts}
    timer = OpTimer(llama_cpp)
    profiled = {}
    print(json.dumps({"ready": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode()}),
          flush=True)
    for line in sys.stdin:
        kind, threads, rest = line.split(" ", 2)
        llm, threads = llms[int(threads)], int(threads)
        if kind == "generate":
            print(json.dumps(generate(llama_cpp, llm, json.loads(rest), new_tokens)), flush=True)
            continue
        if threads not in profiled:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_threads, params.n_threads_batch = 512, threads, threads
            params.cb_eval = timer.callback
            profiled[threads] = llama_cpp.llama_init_from_model(llm.model, params)
        prompt, tokens = json.loads(rest)
        print(json.dumps(profile(llama_cpp, profiled[threads], timer, prompt, tokens)), flush=True)


def generate(llama_cpp, llm, ids: list[int], new_tokens: int) -> dict:
    tokens, times, cpu = [], [], []
    llama_cpp.llama_perf_context_reset(llm.ctx)
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        times.append(time.perf_counter())
        cpu.append(time.process_time())
        if len(tokens) == 1:
            first = llama_cpp.llama_perf_context(llm.ctx)
        if len(tokens) == new_tokens:
            break
    last = llama_cpp.llama_perf_context(llm.ctx)
    # the prompt's decode is t_p_eval; each later token is one eval (the last token's is never run)
    eval_s = (last.t_eval_ms - first.t_eval_ms) / 1e3
    return {"tokens": tokens, "decode_s": times[-1] - times[0], "cpu_s": cpu[-1] - cpu[0], "eval_s": eval_s,
            "evals": last.n_eval - first.n_eval}


def profile(llama_cpp, ctx, timer: OpTimer, prompt: list[int], tokens: list[int]) -> dict:
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(memory, True)

    def decode(ids: list[int]) -> None:
        array = (llama_cpp.llama_token * len(ids))(*ids)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(ids))):
            sys.exit("llama_decode failed")

    decode(prompt)
    timer.seconds, timer.nodes, timer.on = {}, 0, True
    for token in tokens[:-1]:
        decode([token])
    timer.on = False
    steps = len(tokens) - 1
    return {"seconds": {part: s / steps for part, s in timer.seconds.items()}, "nodes": timer.nodes / steps}


class LlamaChild:
    """The parent's side: starts the worker in ``python`` and asks it for one run at a time."""

    def __init__(self, python: str, gguf: Path, thread_counts: list[int], new_tokens: int):
        command = [python, __file__, "--worker", str(gguf), ",".join(map(str, thread_counts)), str(new_tokens)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._ask(None)
        self.version, self.system = hello["ready"], hello["system"].strip()

    def _ask(self, request: str | None) -> dict:
        if request is not None:
            self.process.stdin.write(request + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"FAIL: the llama.cpp worker ended (exit code {self.process.wait()})")
        return json.loads(line)

    def generate(self, threads: int, ids: list[int]) -> dict:
        """One timed greedy generation (``worker``)."""
        return self._ask(f"generate {threads} {json.dumps(ids)}")

    def profile(self, threads: int, prompt: list[int], tokens: list[int]) -> dict:
        """Seconds per step by part, each graph node timed (``worker``)."""
        return self._ask(f"profile {threads} {json.dumps([prompt, tokens])}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4]))
    else:
        from minillm.fast.blockdot import cpu_flags  # here, not above: the worker runs where minillm is not

        print(install_hint(cpu_flags()))
