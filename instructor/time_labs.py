"""Time each lab notebook as committed (stubs) and solved (the reference solutions applied).

    python instructor/time_labs.py                     # every lab in book/labs/
    python instructor/time_labs.py book/labs/lab2_5_precision.ipynb

Each notebook is executed with ``jupyter execute`` into a temporary copy (the committed file is not
touched); the table gives the wall time, the CPU time of jupyter and its kernel, and the load average
when the run started (2 on a 2-core machine: both cores were already busy).
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "instructor"))
from apply_solutions import apply  # noqa: E402


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_execution(notebook: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, load average at the start) of ``jupyter execute`` on ``notebook``."""
    load, cpu, start = os.getloadavg()[0], _cpu_children(), time.perf_counter()
    jupyter = Path(sys.executable).with_name("jupyter")
    subprocess.run([str(jupyter), "execute", "--inplace", str(notebook)], check=True, capture_output=True)
    return time.perf_counter() - start, _cpu_children() - cpu, load


def main(paths: list[str]) -> None:
    notebooks = [Path(p) for p in paths] or sorted((ROOT / "book" / "labs").glob("lab*.ipynb"))
    print(f"{'notebook':<28}{'state':>10}{'wall':>9}{'CPU':>9}{'load':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for path in notebooks:
            stubs, solved = Path(folder) / path.name, Path(folder) / f"solved_{path.name}"
            stubs.write_bytes(path.read_bytes())
            apply(path, solved)
            for state, copy in (("stubs", stubs), ("solved", solved)):
                wall, cpu, load = time_execution(copy)
                print(f"{path.stem:<28}{state:>10}{wall:>8.1f}s{cpu:>8.1f}s{load:>7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
