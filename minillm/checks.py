"""Argument checks shared by the library: errors name the value and the limit."""
from __future__ import annotations

import math
from numbers import Real


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; TypeError for a non-integer (bools included), else ValueError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return value


def check_number(name: str, value, minimum: float = 0, inclusive: bool = False):
    """``value`` if it is a finite real number > ``minimum`` (>= with ``inclusive``); TypeError for
    a non-number (bools included), else ValueError (nan and inf included)."""
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a number")
    limit = f"{'>=' if inclusive else '>'} {minimum}"
    if not math.isfinite(value) or not (value >= minimum if inclusive else value > minimum):
        raise ValueError(f"{name}={value!r} must be a finite number {limit}")
    return value
