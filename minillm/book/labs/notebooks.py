"""A lab notebook's own functions: the cells that define them, run apart from the rest (for grading)."""
from __future__ import annotations

import ast
import json
import linecache
from pathlib import Path

from .checker import TASKS, Outcome, Report, function_names, lab_tasks, run_task


def defined_names(source: str) -> list[str]:
    """The functions a cell defines at its top level (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]


def lab_cells(path: str | Path) -> list[tuple[int, str]]:
    """(index, source) of every code cell that defines one of the labs' functions, in order."""
    known = set(function_names())
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    found = []
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and (known & set(defined_names(source)) or _broken(source, known)):
            found.append((index, source))
    return found


def _broken(source: str, known: set[str]) -> bool:
    """A cell that does not parse but plainly means to define a lab function."""
    try:
        ast.parse(source)
        return False
    except SyntaxError:
        return any(f"def {name}(" in source for name in known)


def functions_from_notebook(path: str | Path) -> tuple[dict, list[str]]:
    """Run the lab cells of a notebook in a fresh namespace: ({name: function}, notes for the grader)."""
    namespace, problems = {"__name__": "lab_notebook"}, []
    for index, source in lab_cells(path):
        if "minillm" in source:
            problems.append(f"cell {index} mentions minillm: check that the functions are the learner's own")
        filename = f"<{Path(path).name} cell {index}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), namespace)  # the learner's own cell
        except Exception as exc:  # reported to the grader, the others still graded
            problems.append(f"cell {index} could not run: {type(exc).__name__}: {exc}")
    known = set(function_names())
    return {k: v for k, v in namespace.items() if k in known and callable(v)}, problems


def grade_notebook(path: str | Path) -> tuple[list[Report], list[str]]:
    """Every task of the notebook's lab (a task whose functions are missing scores 0), and the problems
    met while running its cells."""
    functions, problems = functions_from_notebook(path)
    labs = {t.lab for t in TASKS.values() if set(t.needs) & set(functions)}
    reports = []
    for task in (t for name in sorted(labs) for t in lab_tasks(name)):
        missing = [n for n in task.needs if n not in functions]
        if missing:
            detail = f"{', '.join(missing)} not found in the notebook"
            reports.append(Report(task.name, task.lab, tuple(Outcome(p.name, False, detail, p.hint)
                                                             for p in task.properties)))
        else:
            reports.append(run_task(task, functions))
    return reports, problems
