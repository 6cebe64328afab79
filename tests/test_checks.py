"""The shared argument checks: what they let through, and the errors that name the value and the limit."""
import math

import numpy as np
import pytest

from minillm.validate import check_int, check_number


def test_check_int_returns_the_value_and_refuses_the_rest():
    assert check_int("n", 3) == 3 and check_int("n", 0, minimum=0) == 0
    with pytest.raises(ValueError, match=r"^n=0 must be >= 1$"):
        check_int("n", 0)
    for bad in (2.0, True, "3"):
        with pytest.raises(TypeError, match=f"^n={bad!r} must be an integer$"):
            check_int("n", bad)


def test_check_number_accepts_finite_reals_above_the_limit():
    assert check_number("x", 2.5) == 2.5 and check_number("x", 7) == 7
    assert check_number("x", np.float32(0.5)) == np.float32(0.5)
    assert check_number("x", 0, inclusive=True) == 0
    assert check_number("x", 3.0, minimum=3, inclusive=True) == 3.0


@pytest.mark.parametrize("value, kwargs, message", [
    (0, {}, "x=0 must be a finite number > 0"),
    (-1.5, {"inclusive": True}, "x=-1.5 must be a finite number >= 0"),
    (2, {"minimum": 2}, "x=2 must be a finite number > 2"),
    (math.nan, {"inclusive": True}, "x=nan must be a finite number >= 0"),
    (math.inf, {}, "x=inf must be a finite number > 0"),
])
def test_check_number_names_the_value_and_the_limit(value, kwargs, message):
    with pytest.raises(ValueError) as error:
        check_number("x", value, **kwargs)
    assert str(error.value) == message


@pytest.mark.parametrize("bad", [True, "1.0", None, [1.0], 1j])
def test_check_number_refuses_what_is_not_a_real_number(bad):
    with pytest.raises(TypeError, match=r"must be a number$"):
        check_number("x", bad)
