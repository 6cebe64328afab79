"""Time each lab: executing it, grading it, and an estimate of the learner's work.

    python instructor/time_labs.py                        # execute every lab, stubs and solved
    python instructor/time_labs.py --grading              # grade every lab, stubs and solved
    python instructor/time_labs.py --learner              # the learner estimate from each lab's size
    python instructor/time_labs.py book/labs/lab2_5_precision.ipynb

Execution: ``jupyter execute`` on a temporary copy (the committed file is not touched); grading:
``python -m minillm.book.labs grade`` on the same copies. Each row gives the wall time, the CPU time of the
child processes and the load average when the run started (2 on a 2-core machine: both cores busy).

The learner estimate is a model, not an observation of learners: reading the lab's instructions (its
markdown up to "Going further") at READ_WPM words a minute, plus MINUTES_PER_LINE for each line of the
reference solutions (writing, running the checks, fixing), plus MINUTES_PER_TASK for each task (reading its
report). Its constants reproduce what an experienced teacher estimated for earlier, shorter versions of the
labs (30 to 45 minutes for labs 2.2 and 2.3, with 11 and 19 lines of solution; about an hour for labs 2.1
and 2.4). Calibrate it with your own class.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "instructor"))
from apply_solutions import apply, solution_module  # noqa: E402

from minillm.book.labs import function_names  # noqa: E402
from minillm.book.labs.checker import lab_tasks  # noqa: E402

READ_WPM = 200  # words a minute for technical prose read with the code beside it
MINUTES_PER_LINE = 1.5  # a line of a reference solution: written, checked, fixed
MINUTES_PER_TASK = 2  # reading a task's report and hints


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(command: list[str]) -> tuple[float, float, float]:
    """(wall s, CPU s of the children, load average at the start) of ``command``."""
    load, cpu, start = os.getloadavg()[0], _cpu_children(), time.perf_counter()
    subprocess.run(command, check=False, capture_output=True)
    return time.perf_counter() - start, _cpu_children() - cpu, load


def execute(notebook: Path) -> tuple[float, float, float]:
    return _timed([str(Path(sys.executable).with_name("jupyter")), "execute", "--inplace", str(notebook)])


def grade(notebook: Path) -> tuple[float, float, float]:
    return _timed([sys.executable, "-m", "minillm.book.labs", "grade", str(notebook)])


def _lab(path: Path) -> str:
    return path.name[3:6].replace("_", ".")  # lab2_3_scheduler -> 2.3


def solution_lines(path: Path) -> int:
    """Lines of the reference solutions' function bodies: no docstrings, comments or blank lines."""
    module = solution_module(path)
    total = 0
    for name in function_names(_lab(path)):
        tree = ast.parse(inspect.getsource(getattr(module, name)))
        body = tree.body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        lines = "\n".join(ast.get_source_segment(inspect.getsource(getattr(module, name)), node) for node in body)
        total += sum(1 for line in lines.splitlines() if line.strip() and not line.strip().startswith("#"))
    return total


def instruction_words(path: Path) -> int:
    """Words of the lab's markdown before its "Going further" section."""
    words = 0
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown":
            continue
        if text.startswith("## Going further"):
            break
        words += len(text.split())
    return words


def learner_minutes(path: Path) -> tuple[int, int, int, float]:
    """(words, solution lines, tasks, estimated minutes) of one lab."""
    words, lines, tasks = instruction_words(path), solution_lines(path), len(lab_tasks(_lab(path)))
    return words, lines, tasks, words / READ_WPM + lines * MINUTES_PER_LINE + tasks * MINUTES_PER_TASK


def main(argv: list[str]) -> None:
    mode = next((a for a in argv if a.startswith("--")), "--execute")
    notebooks = [Path(p) for p in argv if not p.startswith("--")] or sorted((ROOT / "book" / "labs").glob("lab*.ipynb"))
    if mode == "--learner":
        print(f"{'notebook':<28}{'words':>7}{'lines':>7}{'tasks':>7}{'minutes':>9}")
        for path in notebooks:
            words, lines, tasks, minutes = learner_minutes(path)
            print(f"{path.stem:<28}{words:>7}{lines:>7}{tasks:>7}{minutes:>9.0f}")
        print(f"(reading at {READ_WPM} words a minute, {MINUTES_PER_LINE:g} minutes a line of the reference "
              f"solutions, {MINUTES_PER_TASK:g} a task)")
        return
    run = grade if mode == "--grading" else execute
    print(f"{'notebook':<28}{'state':>10}{'wall':>9}{'CPU':>9}{'load':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for path in notebooks:
            stubs, solved = Path(folder) / path.name, Path(folder) / f"solved_{path.name}"
            stubs.write_bytes(path.read_bytes())
            apply(path, solved)
            for state, copy in (("stubs", stubs), ("solved", solved)):
                wall, cpu, load = run(copy)
                print(f"{path.stem:<28}{state:>10}{wall:>8.1f}s{cpu:>8.1f}s{load:>7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
