"""Write a copy of a lab notebook with the reference solutions in place of its stubs.

    python instructor/apply_solutions.py book/labs/lab2_1_attention.ipynb /tmp/lab2_1_solved.ipynb

Each stub cell keeps its comments and imports; every lab function it defines is replaced by the one
of ``instructor/solutions/lab2_N.py``. Outputs are cleared: execute the copy to see the labs' payoff
(``jupyter execute --inplace /tmp/lab2_1_solved.ipynb``).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

from minillm.book.labs import function_names
from minillm.book.labs.cells import lab_cells

SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def solution_module(notebook: str | Path):
    """instructor/solutions/lab2_N.py for a notebook named lab2_N_*.ipynb."""
    match = re.match(r"(lab\d+_\d+)_", Path(notebook).name)
    if not match:
        raise ValueError(f"{notebook} is not named like a lab (lab2_1_attention.ipynb)")
    path = SOLUTIONS / f"{match.group(1)}.py"
    spec = importlib.util.spec_from_file_location(f"solutions_{match.group(1)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def solved_source(source: str, module) -> str:
    """``source`` with every top-level definition of a lab function replaced by the module's."""
    known = set(function_names())
    lines = source.splitlines(keepends=True)
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in known]
    for node in sorted(defs, key=lambda n: n.lineno, reverse=True):
        solution = inspect.getsource(getattr(module, node.name))
        lines[node.lineno - 1:node.end_lineno] = [solution if solution.endswith("\n") else solution + "\n"]
    return "".join(lines).rstrip("\n")


def apply(notebook: str | Path, out: str | Path) -> int:
    """Write the solved copy of ``notebook`` to ``out``; the number of cells changed."""
    module = solution_module(notebook)
    nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    stubs = lab_cells(notebook)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    for index, source in stubs:
        nb["cells"][index]["source"] = solved_source(source, module).splitlines(keepends=True)
    Path(out).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return len(stubs)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"{apply(sys.argv[1], sys.argv[2])} stub cells solved -> {sys.argv[2]}")
