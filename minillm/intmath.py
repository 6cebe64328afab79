"""Integer arithmetic shared across the library."""


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b, in exact integer arithmetic (no float rounding): for example the
    blocks of ``b`` tokens that hold ``a`` tokens."""
    return -(-a // b)
