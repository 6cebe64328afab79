"""``python -m minillm.book.labs grade NOTEBOOK.ipynb ...``: the score of each saved lab notebook.

Each notebook is graded in a process of its own: its cells run in order as a kernel runs them (the
learner's code: grade only notebooks you would run anyway), then the hidden cases, each with a time
limit. A notebook that loops or crashes is reported and the next one is graded. ``--details`` prints
every property's outcome and hint.
"""
from __future__ import annotations

import argparse
import sys

from . import checker
from .checker import score_table
from .notebooks import CELL_SECONDS, NOTEBOOK_SECONDS, NotGraded, grade_in_subprocess, grade_one_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.book.labs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grade = sub.add_parser("grade", help="score saved lab notebooks")
    grade.add_argument("notebooks", nargs="+")
    grade.add_argument("--details", action="store_true", help="every property, with hints")
    grade.add_argument("--timeout", type=float, default=None, metavar="S",
                       help=f"seconds each check may take (default {checker.TIME_LIMIT:g})")
    grade.add_argument("--cell-timeout", type=float, default=CELL_SECONDS, metavar="S",
                       help=f"seconds each cell of a notebook may take (default {CELL_SECONDS:g})")
    grade.add_argument("--notebook-timeout", type=float, default=NOTEBOOK_SECONDS, metavar="S",
                       help=f"seconds to grade one notebook in all (default {NOTEBOOK_SECONDS:g})")
    one = sub.add_parser("grade-one", help=argparse.SUPPRESS)  # the per-notebook process
    one.add_argument("notebook")
    one.add_argument("--timeout", type=float, default=None)
    one.add_argument("--cell-timeout", type=float, default=CELL_SECONDS)
    args = parser.parse_args(argv)
    if args.command == "grade-one":  # this process grades one notebook, then ends
        if args.timeout is not None:
            checker.set_time_limit(args.timeout)
        return grade_one_main(args.notebook, args.cell_timeout)
    status = 0
    for path in args.notebooks:
        try:
            reports, problems = grade_in_subprocess(path, args.notebook_timeout, args.timeout, args.cell_timeout)
        except NotGraded as exc:
            print(f"{path}: NOT GRADED: {exc}; the other notebooks are graded\n")
            status = 1
            continue
        if not reports:
            print(f"{path}: defines none of the labs' functions")
            for problem in problems:
                print(f"  note: {problem}")
            print()
            continue
        print(score_table(reports, path))
        for problem in problems:
            print(f"  note: {problem}")
        if args.details:
            print("\n\n".join(r.text() for r in reports))
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
