"""One command for a GPU: every chapter and lab notebook, and every benchmark's CUDA mode, into one report.

Each notebook (book/*.ipynb, book/labs/*.ipynb) is executed with nbclient into a temporary copy (the book's
files are not touched), with MINILLM_STRICT_CLAIMS=1, so a measured claim that does not hold on the GPU stops
it: its result is "ok", "failed claim" (the claim's first line) or "error" (the exception's first line and its
deepest frame in this repository), with its seconds. The notebooks pick CUDA themselves
(``minillm.book.notebook.pick_device``). Then each benchmark that has a CUDA mode runs in it with a time limit,
and the report keeps its header and its headline lines (targets, ratios, "met" / "NOT met", FAIL); the CPU-only
ones are listed as such. The report is rewritten after each notebook and benchmark, so a run stopped early
keeps what it measured, marked incomplete.

    python benchmarks/gpu_report.py [--out benchmarks/gpu_report.md] [--cell-timeout 600] [--bench-timeout 900]
                                    [--only NAME ...] [--skip-notebooks] [--skip-benchmarks]

Needs a CUDA machine: without one it says so and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ("book/*.ipynb", "book/labs/*.ipynb")
NO_CUDA_EXIT = 2
# script -> its CUDA-mode arguments, or None and why it has none (a test checks every bench_*.py is here)
BENCHMARKS: dict[str, tuple[list[str] | None, str]] = {
    "bench_smollm2.py": (["--device", "cuda"], "--device cuda"),
    "bench_batching.py": ([], "picks CUDA itself (pick_device)"),
    "bench_engine.py": ([], "picks CUDA itself (pick_device)"),
    "bench_generate.py": (None, "CPU only (the tiny model on the CPU against transformers)"),
    "bench_precision.py": (None, "CPU only (CPU kernels: int8pack, AVX-512 paths)"),
    "bench_peers.py": (None, "CPU only (llama.cpp on the CPU)"),
    "bench_speculative.py": (None, "CPU only (the int4 block kernel drafts for the float32 target at one thread)"),
}
HEADLINE = re.compile(r"target|\bmet\b|FAIL|ratio|speed-?up", re.IGNORECASE)
INCOMPLETE = "**Incomplete**: the run stopped before the entries below this point were measured."


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_report.md",
                        help="where the Markdown report goes (default benchmarks/gpu_report.md)")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds a notebook cell may take")
    parser.add_argument("--bench-timeout", type=int, default=900, help="seconds a benchmark may take")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only the notebooks and benchmarks whose file names contain one of these "
                             "(a rerun of what failed)")
    parser.add_argument("--skip-notebooks", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    return parser.parse_args(argv)


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# a traceback frame in this repository: 'File "/x/minillm/model.py", line 145' (Python) or
# 'File /x/minillm/model.py:145' (IPython)
FRAME = re.compile(r'File "?[^"\n]*?\b((?:minillm|benchmarks)/[\w/]+\.py)(?:", line |:)(\d+)')


def first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "?")[:200]


def last_line(text: str) -> str:
    return next((line.strip() for line in reversed(str(text).splitlines()) if line.strip()), "?")[:200]


def innermost_frame(traceback: str) -> str:
    """' (at minillm/model.py:145)': the deepest frame of a traceback in this repository, or ''."""
    frames = FRAME.findall(ANSI.sub("", str(traceback)))
    return f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""


def run_notebook(path: Path, workdir: Path, cell_timeout: int) -> tuple[str, float]:
    """(result, seconds) of executing ``path`` into a copy under ``workdir``, in the notebook's folder."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
        result = "ok"
    except CellExecutionError as error:
        kind = "failed claim" if error.ename == "ClaimFailed" else "error"
        where = "" if kind == "failed claim" else innermost_frame(error.traceback)
        result = f"{kind}: {error.ename}: {first_line(error.evalue)}{where}"
    except (CellTimeoutError, TimeoutError) as error:
        result = f"error: a cell ran past {cell_timeout} s ({first_line(error)})"
    except DeadKernelError as error:
        result = f"error: the kernel died ({first_line(error)})"
    seconds = time.perf_counter() - start
    nbformat.write(nb, workdir / path.name)
    return result, seconds


def run_benchmark(script: str, extra: list[str], timeout: int) -> tuple[str, float, list[str]]:
    """(result, seconds, header and headline lines) of one benchmark in a child process."""
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        text = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        lines = text.splitlines()
        return f"error: ran past {timeout} s", time.perf_counter() - start, lines[:1] + headlines(lines)
    lines = out.stdout.splitlines()
    result = ("ok" if out.returncode == 0 else
              f"error (exit {out.returncode}): {last_line(out.stderr)}{innermost_frame(out.stderr)}")
    return result, time.perf_counter() - start, lines[:1] + headlines(lines)


def headlines(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines if HEADLINE.search(line)]


def chosen(name: str, only: list[str] | None) -> bool:
    """Whether ``--only`` (None: everything) selects the file ``name``."""
    return only is None or any(part in name for part in only)


def save(report: list[str], out: Path, complete: bool) -> None:
    """Write the report so far; until it is complete it ends with a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report if complete else [*report, "", INCOMPLETE]) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_report: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False). "
              "This report runs the book and the benchmarks on a GPU: run it on a CUDA machine.", file=sys.stderr)
        return NO_CUDA_EXIT
    os.environ["MINILLM_STRICT_CLAIMS"] = "1"  # the kernels and the benchmarks inherit it
    device = torch.cuda.get_device_name(0)
    report = ["# GPU report", "",
              f"- device: {device} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)",
              f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}",
              f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; notebooks with MINILLM_STRICT_CLAIMS=1",
              *([f"- only the files whose names contain: {', '.join(args.only)}"] if args.only else []), ""]
    if not args.skip_notebooks:
        report += ["## Notebooks", "", "| notebook | result | seconds |", "|---|---|---:|"]
        with tempfile.TemporaryDirectory(prefix="gpu_report_") as workdir:
            for pattern in NOTEBOOKS:
                for path in sorted(ROOT.glob(pattern)):
                    if not chosen(path.name, args.only):
                        continue
                    result, seconds = run_notebook(path, Path(workdir), args.cell_timeout)
                    name = path.relative_to(ROOT)
                    print(f"{name}: {result} ({seconds:.0f} s)", flush=True)
                    report.append(f"| {name} | {result.replace('|', '/')} | {seconds:.0f} |")
                    save(report, args.out, complete=False)
        report.append("")
    if not args.skip_benchmarks:
        report += ["## Benchmarks", ""]
        for script, (extra, how) in BENCHMARKS.items():
            if not chosen(script, args.only):
                continue
            if extra is None:
                report += [f"### {script}: not run ({how})", ""]
                save(report, args.out, complete=False)
                continue
            result, seconds, lines = run_benchmark(script, extra, args.bench_timeout)
            print(f"{script} {' '.join(extra)}: {result} ({seconds:.0f} s)", flush=True)
            report += [f"### {script} {' '.join(extra)}".rstrip() + f": {result}, {seconds:.0f} s ({how})", "",
                       "```", *lines, "```", ""]
            save(report, args.out, complete=False)
    save(report, args.out, complete=True)
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
