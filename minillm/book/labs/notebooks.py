"""Grading a saved lab notebook: its cells run as a kernel runs them, then the hidden cases.

Every code cell runs in order in one namespace, as "Run all" does in Jupyter: helpers and constants of
any cell are visible to the lab's functions, and IPython's syntax works (``%%time``, ``%time``,
``%matplotlib``, ``!pip ...``; shell lines and ``%pip`` are not run). While the cells run, ``check`` and
``score`` print nothing and ``ready`` says False, so the payoff cells wait (the grader runs the checks
itself, once); each cell has a time limit, and a cell tagged ``skip-grading`` does not run.

:func:`grade_notebook` grades in this process; :func:`grade_in_subprocess` (what ``python -m
minillm.book.labs grade`` uses) grades each notebook in a process of its own with a time limit, so that
one submission that loops or crashes stops only itself.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import linecache
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from . import checker
from .checker import TASKS, Outcome, OutOfTime, Report, function_names, lab_tasks, run_task

CELL_SECONDS = 60.0  # a cell of the notebook must finish within this (the checks have their own limit)
NOTEBOOK_SECONDS = 600.0  # grade_in_subprocess: the whole notebook, cells and checks
SKIP_TAG = "skip-grading"

# Magics whose body is Python that the kernel runs (once, for the grader); every other magic is skipped.
_RUNNING_MAGICS = {"time", "timeit", "prun", "capture"}


# --- IPython's syntax -----------------------------------------------------------------------------

def _transform(source: str) -> str:
    """Plain Python for a cell's source: IPython's own transformer when it is installed."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # a small subset: whole-line magics and shell lines
        return re.sub(r"^(\s*)([%!])(%?)(\S*)(.*)$", lambda m: (
            f"{m[1]}get_ipython().system({(m[4] + m[5]).strip()!r})" if m[2] == "!" else
            f"{m[1]}get_ipython().run_line_magic({m[4]!r}, {m[5].strip()!r})"), source, flags=re.M)
    return TransformerManager().transform_cell(source)


def _strip_options(magic: str, line: str) -> str:
    """The statement of ``%timeit -n 3 -r 1 f()``: the options dropped."""
    if magic in ("timeit", "prun"):
        return re.sub(r"^(\s*-[nrpsTlD]\s*\S+|\s*-[tcqo])*\s*", "", line)
    return line


class Shell:
    """Enough of ``get_ipython()`` for the grader: magics that run Python run it in the namespace;
    shell commands, pip and display magics do nothing."""

    def __init__(self, namespace: dict, filename: str):
        self.user_ns, self.filename = namespace, filename

    def run_python(self, source: str, first_line: int = 1) -> None:
        code = _transform(source)
        exec(compile("\n" * (first_line - 1) + code, self.filename, "exec"), self.user_ns)

    def run_line_magic(self, magic: str, line: str, _stack_depth: int = 0):
        if magic in _RUNNING_MAGICS:
            self.run_python(_strip_options(magic, line))
        return None

    def run_cell_magic(self, magic: str, line: str, cell: str):
        if magic in _RUNNING_MAGICS:
            self.run_python(cell)
        return None

    def system(self, command: str) -> None:
        return None

    def getoutput(self, command: str, split: bool = True) -> list:
        return []

    def __getattr__(self, name):  # anything else a cell asks of its shell: a call that does nothing
        return lambda *args, **kwargs: None


def _split_cell_magic(source: str) -> tuple[str | None, str, int]:
    """(magic, body, line of the body) for a cell that starts with ``%%magic``; else (None, source, 1)."""
    lines = source.splitlines(True)
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None or not lines[first].lstrip().startswith("%%"):
        return None, source, 1
    magic = lines[first].strip()[2:].split(maxsplit=1)[0] if lines[first].strip()[2:] else ""
    return magic, "".join(lines[first + 1:]), first + 2


def python_source(source: str) -> str:
    """A cell's code as plain Python (cell magics unwrapped when they run Python, else nothing)."""
    magic, body, _ = _split_cell_magic(source)
    if magic is not None and magic not in _RUNNING_MAGICS:
        return ""
    return _transform(body)


# --- which cells define the lab's functions -----------------------------------------------------------

def defined_names(source: str) -> list[str]:
    """The functions a cell defines at its top level (none if it does not parse)."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]


def _cells(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["cells"]


def lab_cells(path: str | Path) -> list[tuple[int, str]]:
    """(index, source) of every code cell that defines one of the labs' functions, in order."""
    known = set(function_names())
    found = []
    for index, cell in enumerate(_cells(path)):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and (known & set(defined_names(source)) or _broken(source, known)):
            found.append((index, source))
    return found


def _broken(source: str, known: set[str]) -> bool:
    """A cell that does not parse but plainly means to define a lab function."""
    try:
        ast.parse(python_source(source))
        return False
    except SyntaxError:
        return any(f"def {name}(" in source for name in known)


# --- running the notebook ------------------------------------------------------------------------

def _where(exc: BaseException) -> str:
    where = checker._where(exc)
    return where.replace(" of your cell", "")


def run_notebook(path: str | Path, cell_seconds: float = CELL_SECONDS) -> tuple[dict, list[str]]:
    """Run every code cell of a notebook in order in one fresh namespace (what it prints is dropped):
    (the namespace, notes for the grader about cells that failed or ran out of time)."""
    namespace = {"__name__": "__main__", "__builtins__": builtins, "display": lambda *a, **k: None}
    problems = []
    threads = torch.get_num_threads()
    quiet = io.StringIO()
    with checker.running_notebook(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        for index, cell in enumerate(_cells(path)):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell["cell_type"] != "code" or SKIP_TAG in tags:
                continue
            source = "".join(cell["source"])
            filename = f"<{Path(path).name} cell {index}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            shell = Shell(namespace, filename)
            namespace["get_ipython"] = lambda shell=shell: shell
            magic, body, first_line = _split_cell_magic(source)
            if magic is not None and magic not in _RUNNING_MAGICS:
                continue  # %%bash, %%writefile, %%html...: not Python
            try:
                with checker.time_limit(cell_seconds):
                    shell.run_python(body, first_line)
            except OutOfTime as exc:
                where = _where(exc).replace(" (line", " (stopped at line", 1)
                problems.append(f"cell {index} did not finish within {cell_seconds:g} s{where}: "
                                "it was stopped, the cells after it still ran")
            except (Exception, SystemExit) as exc:  # reported to the grader, the other cells still run
                message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                problems.append(f"cell {index} could not run: {type(exc).__name__}"
                                f"{': ' + message if message else ''}{_where(exc)}")
    torch.set_num_threads(threads)
    return namespace, problems


def functions_from_notebook(path: str | Path, cell_seconds: float = CELL_SECONDS) -> tuple[dict, list[str]]:
    """The notebook's lab functions, after running its cells as a kernel does: ({name: function},
    notes for the grader)."""
    namespace, problems = run_notebook(path, cell_seconds)
    known = set(function_names())
    return {k: v for k, v in namespace.items() if k in known and callable(v)}, problems


def grade_notebook(path: str | Path, cell_seconds: float = CELL_SECONDS) -> tuple[list[Report], list[str]]:
    """Every task of the notebook's lab (a task whose functions are missing scores 0), and notes for the
    grader: cells that failed, checks that ran out of time, minillm code the functions called."""
    functions, problems = functions_from_notebook(path, cell_seconds)
    labs = {t.lab for t in TASKS.values() if set(t.needs) & set(functions)}
    reports = []
    quiet = io.StringIO()
    for task in (t for name in sorted(labs) for t in lab_tasks(name)):
        missing = [n for n in task.needs if n not in functions]
        if missing:
            detail = f"{', '.join(missing)} not found in the notebook"
            reports.append(Report(task.name, task.lab, tuple(Outcome(p.name, False, detail, p.hint)
                                                             for p in task.properties)))
        else:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                reports.append(run_task(task, functions))
    for report in reports:
        problems += [f"{report.task}: the check '{o.name}' ran out of time ({o.detail.split(' (')[0]})"
                     for o in report.outcomes if o.timed_out]
    uses = [use for report in reports for use in report.reference_uses]
    problems += [f"{use}: the checks compare with minillm, so these points prove nothing; read the cell"
                 for use in dict.fromkeys(uses)]
    return reports, problems


# --- one process per notebook -----------------------------------------------------------------------

def reports_to_json(reports: list[Report], problems: list[str]) -> str:
    return json.dumps({"reports": [asdict(r) for r in reports], "problems": problems})


def reports_from_json(text: str) -> tuple[list[Report], list[str]]:
    data = json.loads(text)
    reports = [Report(r["task"], r["lab"], tuple(Outcome(**o) for o in r["outcomes"]),
                      tuple(r["reference_uses"])) for r in data["reports"]]
    return reports, list(data["problems"])


class NotGraded(Exception):
    """The notebook could not be graded (it ran out of time, or its process died); the message says so."""


def grade_in_subprocess(path: str | Path, timeout: float = NOTEBOOK_SECONDS,
                        check_seconds: float | None = None,
                        cell_seconds: float = CELL_SECONDS) -> tuple[list[Report], list[str]]:
    """:func:`grade_notebook` in a fresh Python process that gets ``timeout`` seconds in all; NotGraded
    when it runs out of time or dies."""
    command = [sys.executable, "-m", "minillm.book.labs", "grade-one", str(path), "--cell-timeout",
               str(cell_seconds)]
    if check_seconds is not None:
        command += ["--timeout", str(check_seconds)]
    env = dict(os.environ, MPLBACKEND="Agg")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise NotGraded(f"grading stopped after {timeout:g} s (a cell or a check that never ends?)") from None
    marker = "\n" + _MARKER
    if done.returncode != 0 or marker not in "\n" + done.stdout:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise NotGraded(f"the grading process ended with exit code {done.returncode}: {last}")
    return reports_from_json(("\n" + done.stdout).rsplit(marker, 1)[1])


_MARKER = "MINILLM-GRADE-JSON "


def grade_one_main(path: str, cell_seconds: float) -> int:
    """The child's side of grade_in_subprocess: the reports as JSON after a marker, on stdout."""
    out = sys.stdout
    reports, problems = grade_notebook(path, cell_seconds)
    out.write(_MARKER + reports_to_json(reports, problems) + "\n")
    out.flush()
    return 0
