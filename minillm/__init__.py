"""minillm: a small LLaMA-style decoder for learning how LLM inference works.

The names below are imported on first use (PEP 562), so ``import minillm`` alone loads no torch: the bench
client (``python -m minillm bench``) runs on a machine without it.
"""
from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"
_HOME = {  # public name -> the module that defines it
    "KVCache": "cache", "load_pretrained": "checkpoints.pretrained", "PRESETS": "config", "ModelConfig": "config",
    "get_config": "config", "resolve_device": "device", "resolve_dtype": "device", "TokenEvent": "generate",
    "generate": "generate", "stream_generate": "generate", "CausalLM": "model", "build_model": "model",
    "SamplingParams": "sampling", "filtered_probs": "sampling", "sample": "sampling", "BPETokenizer": "text.bpe",
    "ByteTokenizer": "text.byte", "now": "timing", "synchronize": "timing",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


class _Package(types.ModuleType):
    """Keeps each public name bound to what it names: the import system sets a submodule on its package when
    it first loads it, and ``minillm.generate`` is the function, not the module ``minillm/generate.py``."""

    def __setattr__(self, name: str, value) -> None:
        if not (name in _HOME and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
