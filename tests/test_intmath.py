"""ceil_div: the exact ceiling of an integer division, where a float division would round."""
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from minillm.intmath import ceil_div


@given(a=st.integers(-10**30, 10**30), b=st.integers(1, 10**12))
def test_ceil_div_is_the_ceiling_of_the_exact_quotient(a, b):
    q = ceil_div(a, b)
    assert q - 1 < Fraction(a, b) <= q


def test_ceil_div_is_exact_where_floats_round():
    a = 2**60 + 1  # a float holds 53 bits: (2**60 + 1) / 2 rounds to 2**59
    assert ceil_div(a, 2) == 2**59 + 1 and int(a / 2) == 2**59
    assert [ceil_div(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]  # blocks of 16 tokens
