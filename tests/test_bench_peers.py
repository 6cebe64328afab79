"""benchmarks/bench_peers.py's parts that need no timing: reading the last-level cache, sizing the read probe
from it, and skipping llama.cpp (with how to install it) where ``import llama_cpp`` fails."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_peers  # noqa: E402  (a script folder, not a package)

LSCPU = """Architecture:                            x86_64
L1d cache:                               64 KiB (2 instances)
L1i cache:                               64 KiB (2 instances)
L2 cache:                                2 MiB (2 instances)
L3 cache:                                32 MiB (1 instance)
"""


@pytest.mark.parametrize("text, expected", [("32768K", 32 * 2**20), ("32 MiB (1 instance)", 32 * 2**20),
                                            ("1.5 MiB", 3 * 2**19), ("512 KB", 512 * 2**10), ("64", 64)])
def test_cache_sizes_read_in_binary_units(text, expected):
    assert bench_peers.parse_size(text) == expected


def write_cache(root: Path, index: int, level: int, kind: str, size: str) -> None:
    folder = root / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in {"level": f"{level}\n", "type": f"{kind}\n", "size": f"{size}\n"}.items():
        (folder / name).write_text(value)


def test_sysfs_gives_the_highest_level_that_is_not_instructions(tmp_path):
    write_cache(tmp_path, 0, 1, "Data", "32K")
    write_cache(tmp_path, 1, 1, "Instruction", "32K")
    write_cache(tmp_path, 2, 2, "Unified", "1024K")
    write_cache(tmp_path, 3, 3, "Unified", "16384K")
    size, text = bench_peers.llc_from_sysfs(tmp_path)
    assert size == 16 * 2**20 and text.startswith("L3 16 MiB")
    assert bench_peers.llc_from_sysfs(tmp_path / "absent") is None


def test_lscpu_gives_the_last_level_and_the_probe_is_four_times_larger():
    size, text = bench_peers.llc_from_lscpu(LSCPU)
    assert size == 32 * 2**20 and "L3" in text and "lscpu" in text
    assert bench_peers.llc_from_lscpu("Architecture: x86_64\n") is None
    assert bench_peers.probe_bytes(size) >= 4 * size
    assert bench_peers.probe_bytes(256 * 2**20) == 1024 * 2**20
    assert bench_peers.probe_bytes(None) == bench_peers.UNKNOWN_LLC_PROBE_BYTES  # unknown: not assumed small


def test_this_machine_reports_its_cache_or_says_it_does_not():
    size, text = bench_peers.last_level_cache()
    assert (size is None) == text.startswith("unknown")


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
