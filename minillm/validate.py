"""Argument checks shared by the library, one helper per rule: errors name the value and the limit."""
from __future__ import annotations

import json
import math
from numbers import Real
from pathlib import Path

import torch

SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed accepts (a 64-bit seed, signed or not)


def check_int(name: str, value, minimum: int = 1, hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum``; TypeError for a non-integer (bools included), else ValueError.
    ``hint`` (e.g. "0 disables top-k") ends the message."""
    note = f" ({hint})" if hint else ""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an integer{note}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}{note}")
    return value


def check_number(name: str, value, minimum: float = 0, inclusive: bool = False, maximum: float | None = None,
                 hint: str = ""):
    """``value`` if it is a finite real number > ``minimum`` (>= with ``inclusive``) and <= ``maximum``
    (if given); TypeError for a non-number (bools included), else ValueError (nan and inf included).
    ``hint`` ends the message."""
    note = f" ({hint})" if hint else ""
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a number{note}")
    limit = f"{'>=' if inclusive else '>'} {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    low_ok = value >= minimum if inclusive else value > minimum
    if not math.isfinite(value) or not low_ok or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be a finite number {limit}{note}")
    return value


def check_seed(name: str, seed) -> int | None:
    """None, or an int that a ``torch.Generator`` accepts as its seed (64 bits)."""
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"{name}={seed!r} must be an int or None")
    lo, hi = SEED_RANGE
    if not lo <= seed < hi:
        raise ValueError(f"{name}={seed} is outside the 64-bit seed range [{lo}, {hi})")
    return seed


def check_integer_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if its dtype holds integers (not float, complex or bool), else TypeError."""
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor


def check_token_ids(ids, vocab_size: int) -> None:
    """Every id (a tensor or a sequence of ints) must lie in [0, vocab_size); the ValueError names one that
    does not."""
    if isinstance(ids, torch.Tensor):
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        bad = lo if lo < 0 else hi if hi >= vocab_size else None
    else:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def read_json(path: Path) -> dict:
    """A JSON file as a dict; invalid JSON is a ValueError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
