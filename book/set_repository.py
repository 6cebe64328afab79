"""Copy `repository.url` from _config.yml into the book: every notebook's Colab install cell, the README's
install line, and every link to the web book (GitHub Pages of that repository) in the notebooks (their
cells and the sentences they printed), the pages and the README.

A fork changes the URL in _config.yml once, then runs:  python book/set_repository.py
"""
from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
URL_IN_CELL = re.compile(r"git\+https://[^\"'\s]+")
# a link into the web book: GitHub Pages' address of some repository, then one of the book's pages
WEB_BOOK_URL = re.compile(r"https://[A-Za-z0-9-]+\.github\.io/[\w.-]+/(?=book/)")


def repository_url() -> str:
    """The `url:` under `repository:` in _config.yml."""
    text = (ROOT / "_config.yml").read_text(encoding="utf-8")
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", text, flags=re.M)
    if not match:
        raise SystemExit("_config.yml has no repository.url")
    return match.group(1)


def web_book_url(repository: str) -> str:
    """Where GitHub Pages publishes the book of a GitHub repository:
    https://github.com/Owner/name -> https://owner.github.io/name/."""
    match = re.fullmatch(r"https://github\.com/([A-Za-z0-9-]+)/([\w.-]+?)(?:\.git)?/?", repository)
    if not match:
        raise SystemExit(f"repository.url {repository!r} is not https://github.com/<owner>/<name>")
    owner, name = match.groups()
    return f"https://{owner.lower()}.github.io/{name}/"


def chapters() -> list[pathlib.Path]:
    """Every notebook under book/ (the chapters and the labs)."""
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                  if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def pages() -> list[pathlib.Path]:
    """Every Markdown page under book/."""
    return sorted(p for p in (ROOT / "book").rglob("*.md") if "_build" not in p.parts)


def rewrite(text: str, url: str, web: str) -> str:
    """``text`` with every install URL pointing at ``url`` and every web-book link at ``web``."""
    return WEB_BOOK_URL.sub(web, URL_IN_CELL.sub(f"git+{url}", text))


def main() -> None:
    url = repository_url()
    web = web_book_url(url)
    for path in chapters():
        nb = json.loads(path.read_text(encoding="utf-8"))
        changed = False
        for cell in nb["cells"]:
            # the cell's code or markdown, and the text it printed (a link in a computed sentence)
            texts = [(cell, "source")] + [(out, "text") for out in cell.get("outputs", []) if "text" in out]
            texts += [(out["data"], mime) for out in cell.get("outputs", []) for mime in out.get("data", {})
                      if mime.startswith("text/")]
            for holder, key in texts:
                old = "".join(holder[key])
                new = rewrite(old, url, web)
                if new != old:
                    holder[key], changed = new.splitlines(keepends=True), True
        if changed:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"updated {path.relative_to(ROOT)}")
    for path in [*pages(), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, url, web)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
