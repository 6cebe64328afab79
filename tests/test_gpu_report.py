"""benchmarks/gpu_report.py: without CUDA it says so and exits with code 2; every benchmark script is listed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_report  # noqa: E402  (a script folder, not a package)


@pytest.mark.slow  # the script in a subprocess
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


def test_a_run_stopped_early_keeps_what_it_measured(tmp_path, monkeypatch):
    """A run cut short keeps every finished notebook in the report, marked incomplete."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: types.SimpleNamespace(total_memory=2**34))
    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "1")  # main() sets it; monkeypatch restores it afterwards
    runs = []

    def run_notebook(path, workdir, cell_timeout):
        if runs:
            raise KeyboardInterrupt  # the run stops during the second notebook
        runs.append(path)
        return "ok", 12.0

    monkeypatch.setattr(gpu_report, "run_notebook", run_notebook)
    out_file = tmp_path / "report.md"
    try:
        gpu_report.main(["--out", str(out_file), "--skip-benchmarks"])
    except KeyboardInterrupt:
        pass
    text = out_file.read_text()
    assert "- device: Fake GPU (16 GiB)" in text
    assert f"| {runs[0].relative_to(gpu_report.ROOT)} | ok | 12 |" in text
    assert text.rstrip().endswith(gpu_report.INCOMPLETE)
    assert text.count("| ok |") == 1


@pytest.mark.slow  # a notebook kernel and a subprocess
def test_an_error_names_its_exception_and_the_deepest_frame_in_this_repository(tmp_path):
    """A notebook's error (through a real kernel) and a benchmark's (its stderr) say what failed and where."""
    import nbformat

    import minillm.config

    source = Path(minillm.config.__file__).read_text().splitlines()
    line = next(n for n, text in enumerate(source, 1) if "unknown preset" in text)
    notebook = tmp_path / "bad.ipynb"
    cell = nbformat.v4.new_code_cell("from minillm import build_model\nbuild_model('no-such-preset')")
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), notebook)
    result, _ = gpu_report.run_notebook(notebook, tmp_path, cell_timeout=120)
    assert result.startswith("error: ValueError: unknown preset 'no-such-preset'")
    assert result.endswith(f"(at minillm/config.py:{line})")

    out = subprocess.run([sys.executable, "-c", "from minillm import build_model; build_model('no-such-preset')"],
                         capture_output=True, text=True, timeout=120)
    assert gpu_report.last_line(out.stderr).startswith("ValueError: unknown preset 'no-such-preset'")
    assert gpu_report.innermost_frame(out.stderr) == f" (at minillm/config.py:{line})"
    assert gpu_report.innermost_frame("Traceback: nothing of ours") == ""


def test_only_selects_files_by_part_of_their_name():
    assert gpu_report.chosen("ch2_1_transformer.ipynb", None)
    assert gpu_report.chosen("ch2_1_transformer.ipynb", ["ch2_5", "ch2_1"])
    assert not gpu_report.chosen("ch2_2_kv_cache.ipynb", ["ch2_5", "ch2_1"])
    assert gpu_report.chosen("bench_engine.py", ["bench_engine"])
