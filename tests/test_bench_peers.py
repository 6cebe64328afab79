"""benchmarks/bench_peers.py's parts that need no timing: skipping llama.cpp (with how to install it) where
``import llama_cpp`` fails, and its arguments (the cache and probe it reads are tested in test_roofline.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_peers  # noqa: E402  (a script folder, not a package)

pytestmark = pytest.mark.slow  # runs the benchmark script


def test_a_python_without_llama_cpp_is_named_with_the_reason(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import llama_cpp_absent_module'\n")
    fake.chmod(0o755)
    problem = bench_peers.llama_problem(str(fake))
    assert "import llama_cpp" in problem and "ModuleNotFoundError" in problem
    assert "cannot run" in bench_peers.llama_problem(str(tmp_path / "no-such-python"))
    assert "pip install llama-cpp-python==0.3.36" in bench_peers.INSTALL_HINT
    assert "CMAKE_ARGS=" in bench_peers.INSTALL_HINT


def test_the_script_skips_llama_cpp_clearly_and_exits_0(tmp_path):
    """The whole script with a Python that lacks llama_cpp: the skip line and the install hint, exit 0.
    Short: one thread, one round, 4 new tokens, no compiled step."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_peers.py"), "--threads", "1", "--rounds", "1",
                          "--new-tokens", "4", "--no-compiled", "--llama-python", str(fake)],
                         capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama.cpp: SKIPPED" in out.stdout and "pip install llama-cpp-python==0.3.36" in out.stdout
    assert "not measured (llama.cpp skipped)" in out.stdout
    rows = [line.split("|")[0].strip() for line in out.stdout.splitlines() if "|" in line]
    assert "int4" in rows and "llama.cpp" not in rows


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
