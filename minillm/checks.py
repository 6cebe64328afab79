"""Argument checks shared by the library: errors name the value and the limit."""
from __future__ import annotations


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; TypeError for a non-integer (bools included), else ValueError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return value
