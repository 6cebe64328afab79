"""Copy `repository.url` from _config.yml into every chapter's Colab install cell and the README.

A fork changes the URL in _config.yml once, then runs:  python book/set_repository.py
"""
from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
URL_IN_CELL = re.compile(r"git\+https://[^\"'\s]+")


def repository_url() -> str:
    """The `url:` under `repository:` in _config.yml."""
    text = (ROOT / "_config.yml").read_text(encoding="utf-8")
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", text, flags=re.M)
    if not match:
        raise SystemExit("_config.yml has no repository.url")
    return match.group(1)


def chapters() -> list[pathlib.Path]:
    """Every notebook under book/ (the chapters and the labs)."""
    return sorted(p for p in (ROOT / "book").rglob("*.ipynb")
                  if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def main() -> None:
    url = repository_url()
    for path in chapters():
        nb = json.loads(path.read_text(encoding="utf-8"))
        cell = nb["cells"][0]
        source = "".join(cell["source"])
        new = URL_IN_CELL.sub(f"git+{url}", source)
        if new != source:
            cell["source"] = new.splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"updated {path.relative_to(ROOT)}")
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = URL_IN_CELL.sub(f"git+{url}", text)
    if new != text:
        readme.write_text(new, encoding="utf-8")
        print("updated README.md")


if __name__ == "__main__":
    main()
