"""What the labs share: seeded tensors, comparisons that say what differs, the tiny model, text output."""
from __future__ import annotations

import functools
import textwrap

import torch

from ...model import build_model
from ..notebook import WIDTH
from . import wire
from .checker import Mismatch


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Reproducible standard-normal float32 values on the CPU."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def randint(high: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _number(value: float) -> str:
    return f"{value:.4g}"


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-4,
                 dims: tuple[str, ...] = (), explain=None) -> None:
    """Mismatch saying where ``got`` differs most from ``expected`` (``dims`` names each axis), with the
    expected and the returned value there. ``explain()``, called only on a failure, gives the Mismatch's
    hint and bug (a ``Catalogue.hint``), or nothing."""
    diff = (got.detach().float() - expected.float()).abs()
    if bool(torch.isnan(got).any()):
        count = int(torch.isnan(got).sum())
        raise Mismatch(f"{what}: {count} of {got.numel()} values are NaN (not a number); expected none",
                       **(explain() if explain else {}))
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst <= atol:
        return
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    names = dims if len(dims) == len(index) else tuple(f"dim{i}" for i in range(len(index)))
    where = ", ".join(f"{n}={i}" for n, i in zip(names, index))
    raise Mismatch(f"{what}: at {where} expected {_number(float(expected[index]))}, got "
                   f"{_number(float(got[index]))}; {int((diff > atol).sum())} of {diff.numel()} values "
                   f"differ by more than {atol:g}", **(explain() if explain else {}))


@wire.shared("tiny_model")
@functools.lru_cache(maxsize=1)
def tiny_model():
    """minillm's tiny random model (GQA 8:2, head_dim 32), built once per process."""
    return build_model("tiny")


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """A chat prompt for a chat model's tokenizer (SmolLM2), else the plain text's ids."""
    use_chat = chat and hasattr(tokenizer, "encode_chat")
    return tokenizer.encode_chat(prompt) if use_chat else tokenizer.encode(prompt)


def show_text(label: str, text: str) -> None:
    """Print ``label`` and ``text`` (its whitespace collapsed) wrapped to the column."""
    print(textwrap.fill(" ".join(text.split()), WIDTH, initial_indent=label, subsequent_indent="    "))
