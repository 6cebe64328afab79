"""The book's frame: table of contents, configuration, and the shape every chapter shares."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("*.ipynb"))


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
    pages = {str(p.relative_to(ROOT).with_suffix("")) for p in BOOK.iterdir() if p.suffix in (".md", ".ipynb")}
    assert in_toc == pages, f"missing pages: {in_toc - pages}; pages not in the toc: {pages - in_toc}"
    assert len(CHAPTERS) == 4


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_install_cell_uses_the_configured_repository(path):
    url = _load_set_repository().repository_url()
    first = _cells(path)[0]
    source = "".join(first["source"])
    assert "remove-cell" in first["metadata"].get("tags", [])
    assert '"google.colab" in sys.modules' in source
    assert f"minillm @ git+{url}" in source, f"{path.name} installs from another URL than {url}"


def test_readme_installs_from_the_configured_repository():
    url = _load_set_repository().repository_url()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"minillm @ git+{url}" in readme
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
    assert ":class: dropdown" in markdown, "exercise solutions must be folded"
