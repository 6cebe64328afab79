"""Helpers the book's notebooks share: the device (``minillm.device.pick_device``), checked claims, source
excerpts, the figure style.

Everything here prints plain text or returns Markdown that renders the same on the web book, on Colab and
in plain Jupyter (no MyST roles).
"""
from __future__ import annotations

import inspect
import os
import textwrap
from pathlib import Path

from ..device import pick_device as pick_device  # re-exported: the chapters' set-up cells import it from here

WIDTH = 90  # characters: the text column of the web book; notebook code and outputs stay within it
PASS, FAIL = "PASS", "DOES NOT HOLD"
STRICT_ENV = "MINILLM_STRICT_CLAIMS"
GENERIC_WHY = ("a measured relation depends on the machine that runs it (its CPU or GPU, caches, threads and "
               "what else it is running); the prose describes the machine the book was built on.")


class ClaimFailed(AssertionError):
    """A measured claim did not hold on this run."""


def _wrap(label: str, text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=label, subsequent_indent=" " * len(label))


def strict_claims() -> bool:
    """True when a claim that does not hold must stop the run: ``MINILLM_STRICT_CLAIMS=1`` (the tests, the
    book build and CI set it). Unset, on a reader's machine, the chapter says so and goes on."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def claim(statement: str, holds: bool, evidence: str, why: str = "") -> None:
    """Print a measured claim with its evidence in one line: ``PASS`` if it holds on this run.

    A chapter states each measured relation (faster, flat, grows, memory-bound, a ratio) through this call in
    the cell that measures it, so a re-executed book cannot say what its own run contradicts. When it does not
    hold: with ``MINILLM_STRICT_CLAIMS=1`` it raises ClaimFailed; otherwise it prints that the claim does not
    hold on this machine, the evidence and ``why`` that can happen, and the chapter goes on.
    """
    if holds:
        print(_wrap(f"{PASS}: ", f"{statement} ({evidence})"))
        return
    print(_wrap(f"{FAIL}: ", f"{statement} -- does not hold on this machine: {evidence}."))
    print(_wrap("      ", f"Why this can happen: {why or GENERIC_WHY}"))
    if strict_claims():
        raise ClaimFailed(f"{statement} -- not on this run: {evidence}")


def which_case(question: str, cases: dict[str, bool], evidence: str) -> str | None:
    """For an outcome the hardware decides: print the one case of ``cases`` that holds on this run.

    ``cases`` maps each possible answer to whether it holds; exactly one should. When none or several do,
    ClaimFailed under ``MINILLM_STRICT_CLAIMS=1``; otherwise it says so and returns None.
    """
    holding = [name for name, holds in cases.items() if holds]
    if len(holding) != 1:
        message = f"{question}: expected exactly one case to hold, got {holding or 'none'} ({evidence})"
        if strict_claims():
            raise ClaimFailed(message)
        print(_wrap(f"{FAIL}: ", message))
        return None
    print(_wrap("question: ", question))
    print(_wrap("here:     ", f"{holding[0]} ({evidence})"))
    return holding[0]


def say(text: str):
    """A sentence with computed numbers, as Markdown that every renderer shows as prose.

    The chapters never type a measured or derived number into a markdown cell: a cell computes it and ends
    with ``say(f"... {value:,} ...")``. Such a cell is marked so that only its sentence shows: the tag
    ``remove-input`` on the web book, ``cellView: form`` with a ``#@title`` first line on Colab and
    ``jupyter.source_hidden`` in plain Jupyter (tests/test_book.py checks all three).
    """
    from IPython.display import Markdown

    return Markdown(textwrap.dedent(text).strip())


class SourceExcerpt:
    """A function or class of minillm as it is in the library right now, rendered as a code block."""

    def __init__(self, obj):
        self.obj = obj
        self.source = textwrap.dedent(inspect.getsource(obj))
        lines, first = inspect.getsourcelines(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        package_root = Path(__file__).resolve().parents[2]  # the folder that holds minillm/
        shown = path.relative_to(package_root) if path.is_relative_to(package_root) else path.name
        self.location = f"{shown}, lines {first}-{first + len(lines) - 1}"
        self.name = obj.__qualname__

    def _repr_markdown_(self) -> str:
        return f"`{self.name}` from `{self.location}`\n\n```python\n{self.source.rstrip()}\n```\n"

    def __repr__(self) -> str:
        return f"{self.name} ({self.location})\n{self.source.rstrip()}"


def show_source(obj) -> SourceExcerpt:
    """The current source of a minillm function, method or class, to display as the cell's result."""
    obj = inspect.unwrap(obj)  # a decorated function shows its own code, not the decorator's
    module = inspect.getmodule(obj)
    if module is None or not (module.__name__ == "minillm" or module.__name__.startswith("minillm.")):
        raise ValueError(f"{obj!r} is not part of minillm; show_source shows the library's own code")
    return SourceExcerpt(obj)


def use_book_style() -> None:
    """Figures sized for the book's text column, with labels at body-text size, drawn sharp (2x PNG)."""
    import matplotlib as mpl
    from matplotlib_inline.backend_inline import set_matplotlib_formats

    mpl.rcParams.update({
        "figure.figsize": (7.5, 3.8), "figure.dpi": 100, "figure.constrained_layout.use": True,
        "font.size": 11, "axes.titlesize": 11.5, "axes.labelsize": 11, "xtick.labelsize": 10,
        "ytick.labelsize": 10, "legend.fontsize": 10, "legend.title_fontsize": 10, "lines.linewidth": 1.8,
        "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        "axes.formatter.min_exponent": 4,  # log axes read 1, 10, 300, not 10^0, 3x10^2
    })
    set_matplotlib_formats("retina")
