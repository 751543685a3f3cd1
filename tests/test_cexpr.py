"""eval_int: the integer constant expressions Python reads out of .cu sources, evaluated as C does."""
import pytest

from cupykv.kernels.cexpr import eval_int


@pytest.mark.parametrize("expr, value", [
    ("7 / 2", 3), ("-7 / 2", -3), ("7 / -2", -3), ("-7 / -2", 3), ("-8 / 2", -4),      # truncated toward zero
    ("7 % 3", 1), ("-7 % 3", -1), ("7 % -3", 1), ("-7 % -3", -1), ("-6 % 3", 0),       # the dividend's sign
    ("(0 - 9) / 4 * 4 + (0 - 9) % 4", -9),                                             # (a / b) * b + a % b == a
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("256 / 32 / 2", 4), ("1 << 4 | 1", 17), ("0xF0 & 0x3C", 0x30),
    ("-(4 - 6)", 2), ("+5", 5), ("1024 >> 3", 128),
])
def test_integer_arithmetic_follows_c(expr, value):
    assert eval_int(expr) == value


@pytest.mark.parametrize("expr", ["kThreads * 2", "1.5 * 2", "f(3)", "2 ** 3", "~1", "1 < 2"])
def test_anything_but_integer_literals_and_arithmetic_is_refused(expr):
    with pytest.raises(ValueError):
        eval_int(expr)


def test_a_division_by_zero_raises():
    for expr in ("1 / 0", "1 % 0"):
        with pytest.raises(ZeroDivisionError):
            eval_int(expr)
