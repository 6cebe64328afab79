"""Argument checks shared by the library, one helper per rule: errors name the value and the limit.

torch is imported only by the checks of tensors, so the torch-free parts of minillm (the request types, the
workload generator, the bench client) can use the rest.
"""
from __future__ import annotations

import json
import math
import sys
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    import torch

    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor


def check_token_ids(ids, vocab_size: int) -> None:
    """Every id (a tensor or a sequence of ints) must lie in [0, vocab_size); the ValueError names one that
    does not."""
    torch = sys.modules.get("torch")  # without torch loaded, ``ids`` cannot be a tensor
    if torch is not None and isinstance(ids, torch.Tensor):
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        bad = lo if lo < 0 else hi if hi >= vocab_size else None
    else:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def as_prompt_tensor(prompt_ids, vocab_size: int, device) -> torch.Tensor:
    """A list/1-D tensor of integer ids -> (1, T) long tensor on ``device``, validated."""
    import torch

    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids is text ({prompt_ids[:40]!r}), not token ids; encode it first: "
                        "tokenizer.encode(text)")
    if prompt_ids is None:
        raise TypeError("prompt_ids is None; give the prompt's token ids (a list of ints or a 1-D tensor)")
    try:
        ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:  # torch's words name no argument
        _explain_bad_ids(prompt_ids, vocab_size, error)
    if ids.dim() != 1:
        raise ValueError(f"prompt_ids must be one sequence (1-D), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. BOS)")
    check_integer_tensor("prompt_ids", ids)
    check_token_ids(ids, vocab_size)
    return ids.to(device=device, dtype=torch.long)[None, :]


def _explain_bad_ids(prompt_ids, vocab_size: int, error: Exception):
    """Raise the error that says which of ``prompt_ids`` torch could not take (an id that is not an int,
    or one too large for 64 bits), naming the argument."""
    items = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else None
    for i, item in enumerate(items or ()):
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"prompt_ids[{i}]={item!r} is not a token id (an int)") from None
    if items is not None:
        check_token_ids(items, vocab_size)  # an int too large for torch is outside the vocabulary too
    raise TypeError(f"prompt_ids={str(prompt_ids)[:60]} is not a sequence of token ids: {error}") from error


def check_lengths(prompt_len: int, max_new_tokens: int, max_len: int, limit_name: str = "max_seq_len") -> None:
    """prompt + new tokens must fit in ``max_len`` (the context or a cache); nothing is cut silently."""
    check_int("max_new_tokens", max_new_tokens)
    if prompt_len + max_new_tokens > max_len:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = "
                         f"{prompt_len + max_new_tokens} exceeds {limit_name}={max_len}")


def read_json(path: Path) -> dict:
    """A JSON file as a dict; invalid JSON is a ValueError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
