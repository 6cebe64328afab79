"""Faster variants of the same model: lower-precision weights (bfloat16, int8 weight-only) and a static-shape
decode step that a compiler can trace once."""
