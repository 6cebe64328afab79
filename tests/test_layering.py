"""The package's layers import only downward (the core imports nothing outside itself, the engine nothing of
serving, nothing in the library imports the book-only package ``minillm.book``), and no module imports itself
through others: the imports inside ``minillm`` form no cycle."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
CORE = {"config", "model", "cache", "sampling", "generate", "validate", "device", "timing", "intmath"}
# layer -> the layers it may import (the core is always allowed; a layer may import itself). A top-level module
# outside the core is a layer of its own.
ALLOWED = {
    "core": set(),
    "request": set(),  # the request vocabulary (Request, Status, RequestRecord) the engine, serving and bench share
    "speculative": set(),  # speculative decoding: a generation mode on the core
    "text": set(),
    "checkpoints": {"text"},
    "fast": {"checkpoints"},
    "analysis": {"request"},  # the workload generator returns Requests
    "engine": {"request"},
    "cli_common": {"text", "checkpoints", "fast"},  # the model flags and loading of the demo and the server
    "serving": {"request", "engine", "analysis", "text", "checkpoints", "fast", "cli_common"},
    "apps": {"request", "speculative", "text", "checkpoints", "fast", "analysis", "engine", "serving",
             "cli_common"},  # demo, __main__, __init__
    "book": {"request", "speculative", "text", "checkpoints", "fast", "analysis", "engine", "serving",
             "cli_common", "apps"},
}


def layer_of(module: str) -> str:
    """'minillm.engine.scheduler' -> 'engine'; a top-level module is the core, an application or its own layer."""
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
            # `from package import x`: x may be a module of that package (``resolve`` tells)
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def resolve(name: str, modules: set[str]) -> str:
    """The module an imported name is: itself if it is one of ``modules`` ('minillm.fast.int4'), else the module
    it is read from ('minillm.cache.KVCache' -> 'minillm.cache')."""
    return name if name in modules or "." not in name else name.rsplit(".", 1)[0]


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
MODULES = {module_name(p) for p in LIBRARY}


def violations(source: str, name: str, is_package: bool = False) -> list[str]:
    own = layer_of(name)
    targets = sorted({(line, resolve(t, MODULES)) for line, t in imported_modules(source, name, is_package)})
    return [f"line {line}: {target} ({layer_of(target)})" for line, target in targets
            if layer_of(target) not in ({own, "core"} | ALLOWED[own])]


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` it imports (at any depth, lazy imports in functions included);
    ``sources``: module name -> (its source, whether it is a package's __init__)."""
    modules = set(sources)
    return {name: {t for _, imported in imported_modules(source, name, is_package)
                   if (t := resolve(imported, modules)) in modules and t != name}
            for name, (source, is_package) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle (a -> b -> ... -> a) through each strongly connected group of modules (Tarjan's)."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                found.append(_cycle_through(graph, set(group), v))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_through(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside ``group`` (breadth first)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {start}")


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


def test_the_library_has_no_import_cycle():
    sources = {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in LIBRARY}
    found = cycles(import_graph(sources))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_a_cycle_is_found_and_named():
    sources = {"minillm.fast.quant": ("from .int4 import pack\nfrom ..model import CausalLM", False),
               "minillm.fast.int4": ("def load():\n    from .quant import make_variant", False),  # a lazy import
               "minillm.model": ("from .cache import KVCache", False), "minillm.cache": ("import torch", False),
               "minillm.fast": ("from . import quant", True)}
    assert cycles(import_graph(sources)) == [["minillm.fast.quant", "minillm.fast.int4", "minillm.fast.quant"]]
    del sources["minillm.fast.int4"]
    assert cycles(import_graph(sources)) == []

