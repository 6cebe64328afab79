"""``python -m minillm.book.labs grade NOTEBOOK.ipynb ...``: the score of each saved lab notebook.

It runs the cells that define the lab's functions (the learner's code: grade only notebooks you would
run anyway), then the hidden cases. ``--details`` prints every property's outcome and hint.
"""
from __future__ import annotations

import argparse
import sys

from .checker import score_table
from .notebooks import grade_notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.book.labs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grade = sub.add_parser("grade", help="score saved lab notebooks")
    grade.add_argument("notebooks", nargs="+")
    grade.add_argument("--details", action="store_true", help="every property, with hints")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        reports, problems = grade_notebook(path)
        if not reports:
            print(f"{path}: defines none of the labs' functions")
            continue
        print(score_table(reports, path))
        for problem in problems:
            print(f"  note: {problem}")
        if args.details:
            print("\n\n".join(r.text() for r in reports))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
