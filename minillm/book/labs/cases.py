"""What the labs share: seeded tensors, comparisons that say what differs, the tiny model, text output."""
from __future__ import annotations

import functools
import textwrap

import torch

from ...model import build_model
from ..notebook import WIDTH
from .checker import Mismatch


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Reproducible standard-normal float32 values on the CPU."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def randint(high: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def diagnose(got, bugs=()) -> str | None:
    """The hint of the first known bug whose output ``got`` equals: ``bugs`` is a sequence of
    (hint, make) where ``make()`` computes what that bug gives on the same inputs."""
    if not isinstance(got, torch.Tensor):
        return None
    for hint, make in bugs:
        try:
            candidate = make()
        except Exception:  # a variant that cannot run on these inputs is not the one
            continue
        if isinstance(candidate, torch.Tensor) and candidate.shape == got.shape and bool(torch.allclose(
                got.detach().float(), candidate.float(), atol=1e-4, rtol=1e-4, equal_nan=True)):
            return hint
    return None


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-4,
                 dims: tuple[str, ...] = (), bugs=()) -> None:
    """Mismatch naming the largest difference and where it is (with ``dims`` naming each axis); its hint
    is that of the known bug in ``bugs`` (see :func:`diagnose`) that ``got`` equals, if any."""
    diff = (got.detach().float() - expected.float()).abs()
    if bool(torch.isnan(got).any()):
        raise Mismatch(f"{what}: some values are NaN (not a number)", diagnose(got, bugs))
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst <= atol:
        return
    index = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
    names = dims if len(dims) == len(index) else tuple(f"dim{i}" for i in range(len(index)))
    where = ", ".join(f"{n}={i}" for n, i in zip(names, index))
    raise Mismatch(f"{what}: off by up to {worst:.3g} (the largest at {where}); "
                   f"{int((diff > atol).sum())} of {diff.numel()} values differ", diagnose(got, bugs))


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
