"""The package's layers import only downward: the core imports nothing outside itself, the engine nothing
of serving, and nothing in the library imports the book-only package ``minillm.book``."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
CORE = {"config", "model", "cache", "sampling", "generate", "validate", "device", "timing", "intmath"}
# layer -> the layers it may import (the core is always allowed; a layer may import itself)
ALLOWED = {
    "core": set(),
    "text": set(),
    "checkpoints": {"text"},
    "fast": {"checkpoints"},
    "analysis": set(),
    "engine": set(),
    "serving": {"engine", "analysis", "text", "checkpoints", "fast"},  # serve --precision loads fast's weights
    "apps": {"text", "checkpoints", "fast", "analysis", "engine", "serving"},  # demo, __main__, __init__
    "book": {"text", "checkpoints", "fast", "analysis", "engine", "serving", "apps"},
}


def layer_of(module: str) -> str:
    """'minillm.engine.scheduler' -> 'engine'; the top-level modules are the core or the applications."""
    parts = module.split(".")
    if len(parts) == 1:
        return "apps"  # minillm/__init__.py: the public API gathers every layer
    if parts[1] in CORE:
        return "core"
    if parts[1] in ("demo", "__main__"):
        return "apps"
    return parts[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute name) of every minillm module that the module ``name`` imports, at any depth."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "minillm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target.split(".")[0] != "minillm":
                continue
            if node.module is None:  # `from . import x`: x is a module of that package
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(source: str, name: str, is_package: bool = False) -> list[str]:
    own = layer_of(name)
    return [f"line {line}: {target} ({layer_of(target)})" for line, target in imported_modules(source, name, is_package)
            if layer_of(target) not in ({own, "core"} | ALLOWED[own])]


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_layers_are_the_folders_we_name():
    layers = {layer_of(module_name(p)) for p in LIBRARY}
    assert layers == set(ALLOWED), f"a module outside the known layers: {layers - set(ALLOWED)}"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_go_only_downward(path):
    name = module_name(path)
    bad = violations(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
    own = layer_of(name)
    assert not bad, f"{own} may import only core, itself and {sorted(ALLOWED[own])}; found {bad}"


@pytest.mark.parametrize("name, source", [
    ("minillm.model", "from .engine import Engine"),  # the core reaching up into the engine
    ("minillm.cache", "import minillm.serving.app"),
    ("minillm.engine.scheduler", "from ..book.labs import check"),  # the library importing the book
    ("minillm.engine.paged_cache", "from ..serving import protocol"),
    ("minillm.analysis.roofline", "from .. import engine"),
    ("minillm.text.bpe", "from ..checkpoints.hf import read_json"),
])
def test_an_upward_import_is_caught(name, source):
    assert violations(source, name), f"{source!r} in {name} should break the layering"


def test_allowed_imports_pass():
    assert not violations("from .config import ModelConfig\nfrom .validate import check_int", "minillm.model")
    assert not violations("from ..engine import Engine\nfrom ..analysis.metrics import ttft", "minillm.serving.app")
    assert layer_of("minillm") == "apps" and layer_of("minillm.book.labs.checker") == "book"
