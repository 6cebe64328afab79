"""A saved lab notebook's cells: which define the lab's functions, and running them as a kernel does.

Every code cell runs in order in one namespace, as "Run all" does in Jupyter: helpers and constants of
any cell are visible to the lab's functions, and IPython's syntax works (``%%time``, ``%time``,
``%matplotlib``, ``!pip ...``; shell lines and ``%pip`` are not run). While the cells run, ``check`` and
``score`` print nothing and ``ready`` says False, so the payoff cells wait (the grader runs the checks
itself, once); a cell tagged ``skip-grading`` does not run. The grader runs them in the notebook's own
process (:mod:`.sandbox`), never in its own.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import linecache
import re
from collections.abc import Callable
from pathlib import Path

import torch

from . import checker
from .checker import function_names

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


def notebook_cells(path: str | Path) -> list[dict]:
    """The cells of a saved notebook (its JSON's ``cells``)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))["cells"]


def lab_cells(path: str | Path) -> list[tuple[int, str]]:
    """(index, source) of every code cell that defines one of the labs' functions, in order."""
    known = set(function_names())
    found = []
    for index, cell in enumerate(notebook_cells(path)):
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


# --- running the notebook's cells (in the process that runs the learner's code) ------------------------

def _where(exc: BaseException) -> str:
    where = checker._where(exc)
    return where.replace(" of your cell", "")


def run_cells(path: str | Path, skip=(), started: Callable[[int], None] | None = None,
              done: Callable[[int, str | None], None] | None = None) -> dict:
    """Run every code cell of a notebook in order in one fresh namespace (what it prints is dropped),
    except those in ``skip`` and those tagged skip-grading; ``started(index)`` before each cell and
    ``done(index, problem)`` after it (``problem``: why it failed, or None). Returns the namespace.

    It runs the learner's code in this process: the grader calls it in the notebook's own process."""
    namespace = {"__name__": "__main__", "__builtins__": builtins, "display": lambda *a, **k: None}
    threads = torch.get_num_threads()
    quiet = io.StringIO()
    with checker.running_notebook(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        for index, cell in enumerate(notebook_cells(path)):
            tags = cell.get("metadata", {}).get("tags", [])
            if cell["cell_type"] != "code" or SKIP_TAG in tags or index in skip:
                continue
            source = "".join(cell["source"])
            filename = f"<{Path(path).name} cell {index}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            shell = Shell(namespace, filename)
            namespace["get_ipython"] = lambda shell=shell: shell
            magic, body, first_line = _split_cell_magic(source)
            if magic is not None and magic not in _RUNNING_MAGICS:
                continue  # %%bash, %%writefile, %%html...: not Python
            if started is not None:
                started(index)
            problem = None
            try:
                shell.run_python(body, first_line)
            except BaseException as exc:
                message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                problem = (f"cell {index} could not run: {type(exc).__name__}"
                           f"{': ' + message if message else ''}{_where(exc)}")
            quiet.seek(0)
            quiet.truncate()
            if done is not None:
                done(index, problem)
    torch.set_num_threads(threads)
    return namespace


def functions_from_notebook(path: str | Path) -> tuple[dict, list[str]]:
    """The lab functions of a notebook you trust (the book's own), after running its cells in this
    process as a kernel does: ({name: function}, notes about cells that failed)."""
    problems: list[str] = []
    namespace = run_cells(path, done=lambda index, problem: problem and problems.append(problem))
    known = set(function_names())
    return {k: v for k, v in namespace.items() if k in known and callable(v)}, problems
