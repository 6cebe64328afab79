"""benchmarks/gpu_report.py: without CUDA it says so and exits with code 2; every benchmark script is listed."""
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_report  # noqa: E402  (a script folder, not a package)


def test_without_cuda_it_exits_2_with_a_clear_message(tmp_path):
    out_file = tmp_path / "report.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_report.py"), "--out", str(out_file)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == gpu_report.NO_CUDA_EXIT == 2
    assert "no CUDA device" in out.stderr and "CUDA machine" in out.stderr
    assert not out_file.exists()


def test_every_benchmark_script_has_a_cuda_mode_or_a_reason():
    scripts = {path.name for path in BENCHMARKS.glob("bench_*.py")}
    assert scripts == set(gpu_report.BENCHMARKS)
    for extra, how in gpu_report.BENCHMARKS.values():
        assert how and (extra is None) == how.startswith("CPU only")


def test_headlines_keep_targets_and_verdicts():
    lines = ["| a | 1.0 |", "target x >= 2x: 2.1x (met)", "FAIL: tokens differ", "cached/naive ratio 12x"]
    assert gpu_report.headlines(lines) == lines[1:]
