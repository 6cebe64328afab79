"""benchmarks/bench_peers.py and llama_peer.py's parts that need no timing: the build command written from the
CPU's flags, llama.cpp's banner read for the features minillm's kernel uses, the verdict, skipping llama.cpp
(with how to build it) where ``import llama_cpp`` fails, and the arguments (the cache and probe it reads are
tested in test_roofline.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_peers  # noqa: E402  (a script folder, not a package)
import llama_peer  # noqa: E402

pytestmark = pytest.mark.slow  # the script test loads SmolLM2 and builds the block kernel

ZEN4 = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
        "avx512vbmi", "avx_vnni"}
# the banner of llama-cpp-python 0.3.36 built with -DGGML_AVX2=ON -DGGML_AVX512=ON only, and with the VNNI path
WITHOUT_VNNI = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | " \
               "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
WITH_VNNI = WITHOUT_VNNI.replace("AVX512 = 1 |", "AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 |")


def test_the_build_command_turns_on_every_instruction_set_the_cpu_has():
    args = llama_peer.cmake_args(ZEN4)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    assert "-DGGML_AVX512_VBMI=ON" in args and "-DGGML_AVX_VNNI=ON" in args and "-DGGML_AMX_INT8=OFF" in args
    laptop = llama_peer.cmake_args({"avx", "avx2", "fma", "f16c", "bmi2"})
    assert "-DGGML_AVX2=ON" in laptop and "-DGGML_AVX512=OFF" in laptop and "-DGGML_AVX512_VNNI=OFF" in laptop
    assert llama_peer.cmake_args(set()) == "-DGGML_NATIVE=ON"  # not Linux x86: llama.cpp's own default
    hint = llama_peer.install_hint(ZEN4)
    assert "pip install --no-cache-dir llama-cpp-python==0.3.36" in hint and f'CMAKE_ARGS="{args}"' in hint


def test_a_build_without_a_feature_of_the_kernel_gets_no_verdict():
    """The README once said "1.24x llama.cpp (met)" against a llama.cpp built without the VNNI path its x86 kernels
    use; built with it, llama.cpp was 1.8x faster."""
    assert llama_peer.banner_features(WITH_VNNI) >= {"AVX512", "AVX512_VNNI", "FMA", "F16C"}
    problem = llama_peer.build_problem(WITHOUT_VNNI, "avx512_vnni")
    assert "without AVX512_VNNI" in problem and "handicapped" in problem
    assert llama_peer.build_problem(WITH_VNNI, "avx512_vnni") is None
    assert llama_peer.build_problem(WITHOUT_VNNI, "avx2") is None  # what an AVX2 kernel uses is there
    assert bench_peers.verdict({1: 1.3, 2: 1.1}, problem).startswith("no verdict: llama.cpp was built without")
    assert llama_peer.features_not_built(WITHOUT_VNNI, ZEN4) == ["AVX_VNNI", "AVX512_VBMI", "AVX512_VNNI",
                                                                  "AVX512_BF16"]
    assert llama_peer.features_not_built(WITH_VNNI, {"avx", "avx2"}) == []


def test_met_needs_every_thread_count():
    assert bench_peers.verdict({1: 1.3, 2: 1.0}, None) == "met"
    assert bench_peers.verdict({1: 1.3, 2: 0.99}, None) == "NOT met"


def test_graph_nodes_are_sorted_into_the_parts_of_a_step():
    part = llama_peer.op_category
    assert part("MUL_MAT", "ffn_up-3") == part("MUL_MAT", "result_output") == "matmuls"
    assert part("MUL_MAT", "kq-3") == part("SOFT_MAX", "kq_soft_max-3") == "attention"
    assert part("RMS_NORM", "norm-0") == part("MUL", "attn_norm-0") == "norms"
    assert part("MUL", "ffn_gate_par-1") == part("SWIGLU", "ffn_swiglu-1") == "SwiGLU"
    assert part("ROPE", "Qcur-0") == "rotary" and part("ADD", "ffn_inp-0") == "residual adds"


def test_a_python_without_llama_cpp_is_named_with_the_reason(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import llama_cpp_absent_module'\n")
    fake.chmod(0o755)
    problem = bench_peers.llama_problem(str(fake))
    assert "import llama_cpp" in problem and "ModuleNotFoundError" in problem
    assert "cannot run" in bench_peers.llama_problem(str(tmp_path / "no-such-python"))


def test_the_script_skips_llama_cpp_clearly_and_exits_0(tmp_path):
    """The whole script with a Python that lacks llama_cpp: the skip line and the build command, exit 0.
    Short: one thread, one round, 4 new tokens, the eager step (no compiling)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_peers.py"), "--threads", "1", "--rounds", "1",
                          "--new-tokens", "4", "--step", "eager", "--llama-python", str(fake)],
                         capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama.cpp: SKIPPED" in out.stdout and "pip install --no-cache-dir llama-cpp-python==0.3.36" in out.stdout
    assert "not measured (llama.cpp skipped)" in out.stdout
    rows = [line.split("|")[0].strip() for line in out.stdout.splitlines() if "|" in line]
    assert "int4 eager" in rows and "llama.cpp" not in rows


def test_bad_thread_counts_are_refused():
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--threads", "1,x"])
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--threads", "0"])


def test_the_waiting_note_reads_wall_over_cpu_time_of_the_one_thread_runs():
    """It used to blame other programs from the load average, which counts the benchmark's own threads."""
    alone = bench_peers.waiting_note({("int4", 1): 50.0, ("int4", 2): 60.0},
                                     {("int4", 1): 50.5, ("int4", 2): 30.0})
    assert "at most 1.01 (int4)" in alone and "each run had its core" in alone
    shared = bench_peers.waiting_note({("int4", 1): 50.0, ("llama.cpp", 1): 40.0},
                                      {("int4", 1): 51.0, ("llama.cpp", 1): 48.0})
    assert "at most 1.20 (llama.cpp)" in shared and "other programs took the core" in shared


README = BENCHMARKS.parent / "README.md"


def _readme_block(first_line: str) -> list[str]:
    """The lines of the README's code block that starts with ``first_line``."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n" + first_line) + 1
    return text[start:text.index("\n```", start)].splitlines()


def test_the_quoted_bench_peers_run_is_the_readme_s():
    """minillm.book.data.BENCH_PEERS_RUN, which chapter 2.5 quotes, holds the README's rows at 1 and 2 threads,
    and the README's run was measured against a fair llama.cpp build and met the target."""
    from minillm.book.data import BENCH_PEERS_RUN

    lines = _readme_block("bench_peers: ")
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 9 and cells[1].isdigit() and cells[0] != "read BW":
            tok, ms, ratio, _, _, mb = cells[2:8]
            rows[cells[0], int(cells[1])] = {"tokens/s": float(tok), "ms/token": float(ms),
                                             "vs llama.cpp": float(ratio.rstrip("x")), "MB/token": float(mb)}
    quoted = {(name, 1): BENCH_PEERS_RUN[name] for name in ("int4 compiled", "int4 eager", "llama.cpp")}
    quoted |= {(name, 2): row for name, row in BENCH_PEERS_RUN["2 threads"].items()}
    assert rows == quoted
    system = next(line for line in lines if line.strip().startswith("CPU :"))
    assert llama_peer.build_problem(system, "avx512_vnni") is None
    eager = (BENCH_PEERS_RUN["int4 eager"], BENCH_PEERS_RUN["2 threads"]["int4 eager"])
    assert lines[-1].endswith("(met); int4 eager " + ", ".join(f"{row['vs llama.cpp']:.2f}x" for row in eager))


def test_the_quoted_step_profile_is_the_readme_s():
    from minillm.book.data import PROFILE_STEP_RUN

    lines = _readme_block("profile_step: ")
    header = next(line for line in lines if line.strip().startswith("ms per decode step"))
    engines = [cell.strip() for cell in header.split("|")[1:]]
    table = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == len(engines) + 1 and cells[0] != "ms per decode step":
            table[cells[0]] = dict(zip(engines, cells[1:]))
    for engine, parts in PROFILE_STEP_RUN["parts"].items():
        shown = {part: float(row[engine]) for part, row in table.items()
                 if row[engine] != "-" and not part.startswith(("sum of", "step as"))}
        assert shown == parts, engine
        assert float(table["step as it runs (no instrument)"][engine]) == PROFILE_STEP_RUN["step ms"][engine]
