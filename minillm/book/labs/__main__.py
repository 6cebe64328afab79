"""``python -m minillm.book.labs grade NOTEBOOK.ipynb ...``: the score of each saved lab notebook.

Each notebook's cells run in a process of their own, in order, as a kernel runs them (the learner's
code: grade only notebooks you would run anyway); then the hidden cases call the notebook's functions in
that process and are judged in this one. Every cell and every check has a time limit, and the grader
keeps the clock itself. A notebook that loops or crashes is reported and the next one is graded.
``--details`` prints every property's outcome and hint; ``--csv`` and ``--json`` write the class's
results; ``--lab`` grades the assigned lab only and says when a notebook is another.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

from . import checker
from .checker import lab_tasks, score_table
from .notebooks import CELL_SECONDS, NOTEBOOK_SECONDS, NotGraded, grade_notebook


def _row(path: str, lab: str | None, reports, problems, status: str) -> dict:
    """One notebook's result, as the JSON and CSV outputs give it."""
    return {"notebook": path, "lab": lab or ", ".join(sorted({r.lab for r in reports})), "status": status,
            "points": sum(r.points for r in reports), "max_points": sum(r.max_points for r in reports),
            "reports": [dict(asdict(r), points=r.points, max_points=r.max_points) for r in reports],
            "notes": problems}


def _csv(rows: list[dict]) -> str:
    """One line per notebook: its points, its percentage, each task's points, its status and notes."""
    tasks = list(dict.fromkeys(r["task"] for row in rows for r in row["reports"]))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["notebook", "lab", "status", "points", "max_points", "percent", *tasks, "notes"])
    for row in rows:
        by_task = {r["task"]: r["points"] for r in row["reports"]}
        percent = f"{100 * row['points'] / row['max_points']:.1f}" if row["max_points"] else ""
        writer.writerow([row["notebook"], row["lab"], row["status"], row["points"], row["max_points"], percent,
                         *(by_task.get(t, "") for t in tasks), " | ".join(row["notes"])])
    return out.getvalue()


def _write(target: str, text: str) -> None:
    if target == "-":
        sys.stdout.write(text)
    else:
        Path(target).write_text(text, encoding="utf-8")


def grade(args) -> int:
    """Grade ``args.notebooks``; ``--timeout`` holds for this call only (the checker's limit is restored)."""
    before = checker.TIME_LIMIT
    if args.timeout is not None:
        checker.set_time_limit(args.timeout)
    try:
        return _grade(args)
    finally:
        checker.set_time_limit(before)


def _grade(args) -> int:
    if args.lab is not None and not lab_tasks(args.lab):
        labs = sorted({t.lab for t in checker.TASKS.values()})
        print(f"--lab {args.lab}: no such lab; the labs are {', '.join(labs)}", file=sys.stderr)
        return 2
    status, rows = 0, []
    show = sys.stderr if "-" in (args.csv, args.json) else sys.stdout  # the tables, beside a CSV on stdout
    for path in args.notebooks:
        try:
            reports, problems = grade_notebook(path, args.cell_timeout, args.notebook_timeout, args.lab)
        except NotGraded as exc:
            print(f"{path}: NOT GRADED: {exc}; the other notebooks are graded\n", file=show)
            rows.append(_row(path, args.lab, [], [f"not graded: {exc}"], "not graded"))
            status = 1
            continue
        if not reports:
            print(f"{path}: defines none of the labs' functions", file=show)
            rows.append(_row(path, args.lab, [], problems, "no lab functions"))
        else:
            print(score_table(reports, path), file=show)
            rows.append(_row(path, args.lab, reports, problems, "graded"))
        for problem in problems:
            print(f"  note: {problem}", file=show)
        if args.details and reports:
            print("\n\n".join(r.text() for r in reports), file=show)
        print(file=show)
    if args.csv:
        _write(args.csv, _csv(rows))
    if args.json:
        _write(args.json, json.dumps(rows, indent=1) + "\n")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.book.labs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("grade", help="score saved lab notebooks")
    one.add_argument("notebooks", nargs="+")
    one.add_argument("--details", action="store_true", help="every property, with hints")
    one.add_argument("--lab", metavar="2.N", help="the lab assigned: grade it only, note any other")
    one.add_argument("--csv", metavar="PATH", help="write one line per notebook to PATH (- for stdout)")
    one.add_argument("--json", metavar="PATH", help="write every outcome and hint to PATH (- for stdout)")
    one.add_argument("--timeout", type=float, default=None, metavar="S",
                     help=f"seconds each function may take in one check (default {checker.TIME_LIMIT:g})")
    one.add_argument("--cell-timeout", type=float, default=CELL_SECONDS, metavar="S",
                     help=f"seconds each cell of a notebook may take (default {CELL_SECONDS:g})")
    one.add_argument("--notebook-timeout", type=float, default=NOTEBOOK_SECONDS, metavar="S",
                     help=f"seconds to grade one notebook in all (default {NOTEBOOK_SECONDS:g})")
    run = sub.add_parser("run-notebook", help=argparse.SUPPRESS)  # the notebook's own process
    run.add_argument("notebook")
    run.add_argument("--fd", type=int, required=True)
    run.add_argument("--trace", required=True)
    run.add_argument("--skip", default="")
    args = parser.parse_args(argv)
    if args.command == "run-notebook":
        from .sandbox import serve

        return serve(args.notebook, args.fd, args.trace, {int(i) for i in args.skip.split(",") if i})
    return grade(args)


if __name__ == "__main__":
    sys.exit(main())
