"""The notebook helpers: checked claims, hardware-dependent cases, source excerpts, the figure style."""
from __future__ import annotations

import importlib.util
import inspect
import linecache
import sys
import textwrap

import matplotlib
import pytest

from minillm import KVCache, generate
from minillm.book.notebook import WIDTH, ClaimFailed, claim, say, show_source, use_book_style, which_case
from minillm.book.page_stats import claim_lines, page_stats


def test_a_claim_that_holds_is_one_line_with_its_evidence(capsys):
    claim("the cache is faster", 3.2 > 1.5, "cached/naive = 3.2x, median of 5")
    assert capsys.readouterr().out.splitlines() == [
        "PASS: the cache is faster (cached/naive = 3.2x, median of 5)"]


def test_a_failed_claim_raises_in_strict_mode(capsys, monkeypatch):
    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "1")
    with pytest.raises(ClaimFailed, match="the cache is faster -- not on this run: ratio 0.9x"):
        claim("the cache is faster", False, "ratio 0.9x")
    assert capsys.readouterr().out.startswith("DOES NOT HOLD: the cache is faster -- does not hold on this machine")


def test_on_a_readers_machine_a_failed_claim_says_so_and_the_chapter_goes_on(capsys, monkeypatch):
    monkeypatch.delenv("MINILLM_STRICT_CLAIMS", raising=False)
    claim("the cache is faster", False, "ratio 0.9x", why="a busy machine can invert a small ratio")
    out = capsys.readouterr().out
    assert "does not hold on this machine: ratio 0.9x." in out
    assert "Why this can happen: a busy machine can invert a small ratio" in out
    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "0")  # "0" is not strict either
    assert which_case("which?", {"a": False, "b": False}, "none measured") is None
    assert "expected exactly one case to hold" in capsys.readouterr().out


def test_check_wraps_long_lines_to_the_column(capsys):
    claim("x " * 100, True, "y " * 100)
    assert all(len(line) <= WIDTH for line in capsys.readouterr().out.splitlines())


def test_which_case_names_the_one_that_holds(capsys):
    case = which_case("is decode memory-bound here?", {"yes: weights stream from DRAM": True,
                                                      "no: weights sit in cache": False}, "5.1 ms/step")
    assert case == "yes: weights stream from DRAM"
    assert capsys.readouterr().out.splitlines()[-1] == "here:     yes: weights stream from DRAM (5.1 ms/step)"


@pytest.mark.parametrize("cases", [{"a": True, "b": True}, {"a": False, "b": False}])
def test_which_case_needs_exactly_one(cases, monkeypatch):
    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "1")
    with pytest.raises(ClaimFailed, match="exactly one case"):
        which_case("q", cases, "e")


def test_show_source_is_the_library_source_now():
    excerpt = show_source(KVCache.attend)
    markdown = excerpt._repr_markdown_()
    assert excerpt.source == textwrap.dedent(inspect.getsource(KVCache.attend))
    assert markdown.startswith("`KVCache.attend` from `minillm/cache.py, lines ")
    assert "```python\ndef attend(self, layer" in markdown


def test_show_source_follows_a_change_of_the_function(tmp_path, monkeypatch):
    """What a page shows is read from the library when the cell runs: edit the code, the excerpt changes."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("minillm._probe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "minillm._probe", module)
    spec.loader.exec_module(module)
    assert "return 1" in show_source(module.f)._repr_markdown_()
    path.write_text("def f():\n    return 2  # changed\n")
    linecache.checkcache(str(path))
    spec.loader.exec_module(module)
    assert "return 2  # changed" in show_source(module.f)._repr_markdown_()


def test_show_source_refuses_code_outside_minillm():
    with pytest.raises(ValueError, match="not part of minillm"):
        show_source(textwrap.dedent)
    assert "def generate(" in show_source(generate).source


def test_use_book_style_sets_readable_sizes():
    use_book_style()
    assert matplotlib.rcParams["font.size"] >= 10 and matplotlib.rcParams["legend.fontsize"] >= 9
    assert matplotlib.rcParams["figure.figsize"][0] <= 8


def test_say_renders_its_sentence_as_markdown():
    shown = say("""
        An 80 GiB GPU holds **66** requests.
    """)
    assert shown._repr_markdown_() == "An 80 GiB GPU holds **66** requests."


def test_page_stats_counts_wrapped_claim_lines_and_prose(tmp_path):
    import json

    printed = ["PASS: a claim that wraps", "      onto a second line", "an ordinary line",
               "question: which?", "here:     this one", "  indented but not a claim"]
    notebook = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "The documents say three words.\n\n```\nnot prose\n```"},
        {"cell_type": "markdown", "metadata": {}, "source": "<details>folded words here</details> two words"},
        {"cell_type": "code", "metadata": {}, "source": "", "outputs": [
            {"output_type": "stream", "name": "stdout", "text": "\n".join(printed) + "\n"},
            {"output_type": "display_data", "data": {"image/png": "", "text/plain": "<Figure>"}}]},
    ]}
    path = tmp_path / "ch.ipynb"
    path.write_text(json.dumps(notebook))
    stats = page_stats(path)
    assert claim_lines(printed) == 4
    assert stats.claim_line_share == round(4 / 6, 3)
    assert stats.prose_words == 5 + 5 and stats.longest_cell_words == 5
    assert stats.other_source_names == 1 and stats.figure_code_shown == 1
    assert set(stats.over_limits()) == {"claim_line_share", "figure_code_shown", "other_source_names"}
