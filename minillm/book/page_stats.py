"""How much a chapter asks of its reader: the figures the book holds each chapter to.

``python -m minillm.book.page_stats book/ch*.ipynb`` prints, for each executed chapter, the words of prose,
the longest markdown cell outside folded ``<details>``, the share of output lines that are claim printouts,
the sentences that point the reader at a printout, figure cells whose code shows on the web, other names
for the source than "the source", and the number of cells. ``LIMITS`` are the bars every chapter meets,
``CHAPTER_LIMITS`` a chapter's own tighter ones (``limits_for``); tests/test_book.py holds every chapter to them.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .notebook import FAIL, PASS

LIMITS = {"prose_words": 5500, "longest_cell_words": 450, "claim_line_share": 0.12, "printout_pointers": 3,
          "figure_code_shown": 0, "other_source_names": 0, "cells": None}  # None: no bar
CHAPTER_LIMITS = {  # notebook name -> the bars it meets instead of LIMITS'
    "ch2_1_transformer": {"prose_words": 4000, "cells": 70},
    "ch2_2_kv_cache": {"prose_words": 4000, "cells": 70},
    "ch2_3_prefill_decode": {"prose_words": 4500, "cells": 80},
    "ch2_4_metrics": {"prose_words": 4500, "cells": 80},
    "ch2_5_bandwidth": {"prose_words": 5000, "cells": 80},
    "ch2_6_speculative": {"prose_words": 4000, "cells": 70},
}
CLAIM_LABELS = (f"{PASS}: ", f"{FAIL}: ", "question: ", "here:     ")
HIDDEN_INPUT_TAGS = {"remove-input", "hide-input", "remove-cell"}
FENCED_CODE = re.compile(r"^```.*?^```", re.S | re.M)
DETAILS = re.compile(r"<details>.*?</details>", re.S)
HTML_TAG = re.compile(r"<[^>]+>")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
WORD = re.compile(r"[A-Za-z0-9][\w'’.,%-]*")
PRINTOUT_POINTER = re.compile(
    r"\b(printouts?|printed (above|below)|(line|lines|output|outputs) (above|below)|the (first|second|third|"
    r"last) (printed )?line|the cell (above|below) prints|as printed)\b", re.I)
OTHER_SOURCE_NAMES = re.compile(r"\bthe (seed|documents|source documents|source text|Chinese (text|source))\b",
                                re.I)


def words(markdown: str) -> int:
    """Words of prose in a Markdown text: code blocks, HTML tags and link targets do not count."""
    text = LINK_TARGET.sub("]", HTML_TAG.sub(" ", FENCED_CODE.sub(" ", markdown)))
    return len(WORD.findall(text))


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def _prose_outputs(cell: dict) -> list[str]:
    """The Markdown a code cell shows as prose (``say``); source excerpts are code blocks and count nothing."""
    return [_text(out["data"]["text/markdown"]) for out in cell.get("outputs", [])
            if "text/markdown" in out.get("data", {})]


def _output_lines(cell: dict) -> list[str]:
    lines = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            lines += _text(out["text"]).splitlines()
        elif out["output_type"] in ("execute_result", "display_data"):
            data = out["data"]
            if not any(kind in data for kind in ("text/markdown", "text/html", "image/png", "image/svg+xml")):
                lines += _text(data.get("text/plain", "")).splitlines()
    return lines


def claim_lines(lines: list[str]) -> int:
    """Lines printed by ``claim`` and ``which_case``: a labelled line and the indented lines that wrap it."""
    count, indent = 0, None  # indent: the wrap indent of the claim being read, None outside one
    for line in lines:
        label = next((label for label in CLAIM_LABELS if line.startswith(label)), None)
        if label:
            indent = " " * len(label)
        elif indent and not (line.startswith(indent) and line[len(indent):][:1] not in ("", " ")):
            indent = None
        count += indent is not None
    return count


def limits_for(path: str | Path) -> dict[str, float | None]:
    """The bars the notebook at ``path`` meets: ``LIMITS``, with its own ``CHAPTER_LIMITS`` entry over them."""
    return {**LIMITS, **CHAPTER_LIMITS.get(Path(path).stem, {})}


@dataclass
class PageStats:
    prose_words: int
    longest_cell_words: int
    claim_line_share: float
    printout_pointers: int
    figure_code_shown: int
    other_source_names: int
    cells: int
    limits: dict[str, float | None] = field(default_factory=lambda: dict(LIMITS), repr=False, compare=False)

    def figures(self) -> dict[str, float]:
        """The figures by name, in the order of ``LIMITS``."""
        return {name: value for name, value in asdict(self).items() if name != "limits"}

    def over_limits(self) -> dict[str, tuple[float, float]]:
        """Each figure above its limit, as (value, limit)."""
        return {name: (value, self.limits[name]) for name, value in self.figures().items()
                if self.limits[name] is not None and value > self.limits[name]}


def page_stats(path: str | Path) -> PageStats:
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    prose, longest, pointers, names, figure_code = 0, 0, 0, 0, 0
    output_lines: list[str] = []
    for cell in cells:
        source = _text(cell["source"])
        if cell["cell_type"] == "markdown":
            texts = [source]
            longest = max(longest, words(DETAILS.sub(" ", source)))
        elif cell["cell_type"] == "code":
            texts = _prose_outputs(cell)
            longest = max([longest] + [words(text) for text in texts])
            output_lines += _output_lines(cell)
            shows_figure = any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))
            figure_code += shows_figure and not HIDDEN_INPUT_TAGS & set(cell["metadata"].get("tags", []))
        else:
            continue
        for text in texts:
            prose += words(text)
            pointers += len(PRINTOUT_POINTER.findall(FENCED_CODE.sub(" ", text)))
            names += len(OTHER_SOURCE_NAMES.findall(text))
    share = claim_lines(output_lines) / max(len(output_lines), 1)
    return PageStats(prose, longest, round(share, 3), pointers, figure_code, names, len(cells), limits_for(path))


def main(paths: list[str]) -> int:
    """Print each chapter's figures, each under its limit; exit status 1 when one is over."""
    print("  ".join(f"{h:>18}" for h in ["chapter", *LIMITS]))
    over = False
    for path in paths:
        stats = page_stats(path)
        too_high = stats.over_limits()
        marks = [f"{v}{' OVER' if k in too_high else ''}" for k, v in stats.figures().items()]
        bars = ["-" if limit is None else str(limit) for limit in stats.limits.values()]
        print("  ".join(f"{m:>18}" for m in [Path(path).stem[:18], *marks]))
        print("  ".join(f"{m:>18}" for m in ["  limit", *bars]))
        over |= bool(too_high)
    return int(over)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or sorted(str(p) for p in Path("book").glob("ch*.ipynb"))))
