"""Grading a saved lab notebook: its cells run as a kernel runs them, then the hidden cases.

:func:`grade_notebook` runs the cells in a process of their own (:mod:`.sandbox`; how they run:
:mod:`.cells`), each with a time limit, and grades from this process: the checks send their cases to the
notebook's functions there and judge what comes back here, so nothing in the notebook can change the score,
the report or the clock. Before anything runs, the notebook's code is read for what can reach into an
interpreter (``reaching_cells``): a note for the grader.
"""
from __future__ import annotations

import ast
import contextlib
import io
import time
from pathlib import Path

from . import checker
from .cells import SKIP_TAG, notebook_cells, python_source
from .checker import TASKS, FunctionStopped, Outcome, Report, Run, lab_tasks, run_task
from .sandbox import NotGraded, Sandbox

CELL_SECONDS = 60.0  # a cell of the notebook must finish within this (the checks have their own limit)
NOTEBOOK_SECONDS = 600.0  # the whole notebook, cells and checks

__all__ = ["CELL_SECONDS", "NOTEBOOK_SECONDS", "NotGraded", "grade_notebook", "reaching_cells"]


# --- what the grader flags without running anything ----------------------------------------------------

# Names that let a notebook reach into the interpreter (and so hide what its functions call) or outlive
# its cells: each use is a note for the grader. ``sys.modules`` only outside an ``in`` test (the Colab
# install cell asks whether google.colab is loaded).
_MODULES = {"ctypes", "gc", "faulthandler", "atexit", "signal", "multiprocessing", "importlib", "builtins",
            "inspect", "minillm.book.labs.checker", "minillm.book.labs.notebooks", "minillm.book.labs.sandbox",
            "minillm.book.labs.wire", "minillm.book.labs.diagnosis"}
_ATTRIBUTES = {"setprofile", "settrace", "_getframe", "f_back", "f_globals", "f_locals", "setitimer",
               "pthread_sigmask", "fork", "forkpty", "setsid", "setpgid", "setpgrp", "killpg", "dup2", "_exit",
               "Popen", "__stdout__", "__stderr__", "__code__", "__globals__", "__builtins__"}
_OS_CALLS = {"kill", "write", "system", "popen", "execv", "execvp", "spawnv", "spawnl"}
_BUILTIN_CALLS = {"exec", "eval", "compile", "__import__", "breakpoint"}


def _reaches(tree: ast.AST) -> list[str]:
    found: list[str] = []
    in_tests = {id(c.comparators[0]) for c in ast.walk(tree) if isinstance(c, ast.Compare)
                and len(c.ops) == 1 and isinstance(c.ops[0], (ast.In, ast.NotIn))}

    def add(name: str) -> None:
        if name not in found:
            found.append(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in _MODULES or alias.name.split(".")[0] in _MODULES:
                    add(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in _MODULES or node.module.split(".")[0] in _MODULES or (
                    node.module == "minillm.book.labs"
                    and any(f"minillm.book.labs.{a.name}" in _MODULES for a in node.names)):
                add(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in _ATTRIBUTES:
                add(f"{base + '.' if base else ''}{node.attr}")
            elif base == "os" and node.attr in _OS_CALLS:
                add(f"os.{node.attr}")
            elif base == "sys" and node.attr == "modules" and id(node) not in in_tests:
                add("sys.modules")
            elif base == "signal" and node.attr == "signal":
                add("signal.signal")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILTIN_CALLS:
            add(f"{node.func.id}()")
    return found


def reaching_cells(path: str | Path) -> list[str]:
    """Notes for the cells whose code can reach into the interpreter or outlive them (read, not run)."""
    notes = []
    for index, cell in enumerate(notebook_cells(path)):
        if cell["cell_type"] != "code" or SKIP_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        try:
            tree = ast.parse(python_source("".join(cell["source"])))
        except SyntaxError:
            continue
        names = _reaches(tree)
        if names:
            notes.append(f"cell {index} uses {', '.join(names)}: such code can hide what a function calls or "
                         "outlive the cells; the grade is computed outside the notebook, but read the cell")
    return notes


# --- grading ------------------------------------------------------------------------------------------

class SandboxFunction:
    """A learner's function as the checks see it: calling it runs it in the notebook's process."""

    in_sandbox = True

    def __init__(self, sandbox: Sandbox, name: str):
        self.sandbox, self.__name__ = sandbox, name

    def __call__(self, *args, **kwargs):
        limit, left = checker.TIME_LIMIT, checker.seconds_left()
        if left <= 0:
            raise FunctionStopped(self.__name__, f"did not finish within {checker.property_seconds():g} s", True)
        start = time.monotonic()
        try:
            return self.sandbox.call(self.__name__, args, kwargs, left, checker.property_seconds() or limit)
        finally:
            checker.spend(time.monotonic() - start)
            checker.record_uses(self.sandbox.uses)
            self.sandbox.uses = []


def lab_of(functions) -> list[str]:
    """The labs whose functions appear among ``functions`` (names), in order."""
    return sorted({t.lab for t in TASKS.values() if set(t.needs) & set(functions)})


def grade_notebook(path: str | Path, cell_seconds: float = CELL_SECONDS,
                   notebook_seconds: float = NOTEBOOK_SECONDS, lab: str | None = None
                   ) -> tuple[list[Report], list[str]]:
    """Every task of the notebook's lab (``lab``: that lab only; a task whose functions are missing
    scores 0), and notes for the grader: cells that failed or ran out of time, checks that ran out of
    time, minillm code the functions called, code that reaches into the interpreter. NotGraded when
    the notebook cannot be graded within ``notebook_seconds``. Every process the notebook started has
    ended when this returns."""
    sandbox = Sandbox(path, cell_seconds, time.monotonic() + notebook_seconds, checker.describe)
    try:
        sandbox.start()
        functions = {name: SandboxFunction(sandbox, name) for name in sandbox.functions}
        found = lab_of(functions)
        labs = [lab] if lab is not None else found
        reports, run, quiet = [], Run(), io.StringIO()
        for task in (t for name in labs for t in lab_tasks(name)):
            missing = [n for n in task.needs if n not in functions]
            if missing:
                detail = f"{', '.join(missing)} not found in the notebook"
                reports.append(Report(task.name, task.lab, tuple(
                    Outcome(p.name, False, detail, p.hint, points=p.points, central=p.central)
                    for p in task.properties)))
            else:
                with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                    reports.append(run_task(task, functions, run))
    finally:
        sandbox.close()
    problems = [sandbox.problems[i] for i in sorted(sandbox.problems)]
    if lab is not None and set(found) - {lab}:
        others = sorted(set(found) - {lab})
        problems.append(f"it also defines functions of lab {', '.join(others)}, not graded (--lab {lab})")
    for report in reports:
        problems += [f"{report.task}: the check '{o.name}' ran out of time ({o.detail.split(' (')[0]})"
                     for o in report.outcomes if o.timed_out]
    uses = [use for report in reports for use in report.reference_uses]
    problems += [f"{use}: the checks compare with minillm, so these points prove nothing; read the cell"
                 for use in dict.fromkeys(uses)]
    return reports, problems + reaching_cells(path)
