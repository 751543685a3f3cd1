"""Scalar arguments: ints inside their kernel type's range, floats the kernel's type holds, choices.

Shared by the fast path and the reference (``cupykv.reference``), so both
refuse the same values with the same messages. Every check raises
``TypeError`` for a wrong type and ``ValueError`` for a value out of range,
with a message ``<name>: expected <what>, got <value>``; NumPy scalars of any
width and signedness are read as the exact Python number they hold, so nothing
wraps before it is checked.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence, TypeGuard

import numpy as np

from cupykv._args.limits import INT32_MAX
from cupykv.errors import shown

FLOAT32_TINY = float(np.finfo(np.float32).smallest_normal)   # 2**-126
FLOAT32_MAX = float(np.finfo(np.float32).max)


def got(value: object) -> str:
    """``repr`` of a rejected value plus its type, for TypeError messages."""
    return f"{shown(value)} ({type(value).__name__})"


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """Whether ``value`` is a Python or NumPy integer (``bool`` is not)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_range(lo: int | None = None, hi: int | None = None) -> str:
    """``"an int in lo..hi"``, ``"an int >= lo"`` or ``"an int"``."""
    if lo is not None and hi is not None:
        return f"an int in {lo}..{hi}"
    return f"an int >= {lo}" if lo is not None else "an int"


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as a Python int, checking ``lo <= value <= hi``.

    ``bool`` is refused; NumPy integer scalars are read exactly (``np.uint64(2**64 - 1)``
    is 18446744073709551615, not -1).
    """
    expected = int_range(lo, hi)
    if not is_int(value):
        raise TypeError(f"{name}: expected {expected}, got {got(value)}")
    number = int(value)
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        raise ValueError(f"{name}: expected {expected}, got {shown(number)}")
    return number


def check_int32(name: str, value: object, lo: int = 0) -> int:
    """Return ``value`` as a Python int in ``lo..INT32_MAX`` (a kernel ``int``)."""
    return check_int(name, value, lo, INT32_MAX)


def _real(name: str, value: object, expected: str) -> float:
    """``value`` as a Python float (``inf`` for an int too large for one); TypeError if not a real number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name}: expected {expected}, got {got(value)}")
    try:
        return float(value)
    except OverflowError:   # an int beyond float64
        return -math.inf if value < 0 else math.inf


def check_positive_float32(name: str, value: object, hi: float = FLOAT32_MAX,
                           why: str = "normal and > 0 in float32, the kernel's type") -> float:
    """Return ``value`` as a Python float that a kernel's ``float`` holds as a normal number in ``(0, hi]``.

    The value is checked as the kernel receives it, rounded to float32: 1e39
    would be inf there, 1e-50 zero, and a subnormal is flushed to zero on the
    GPU (CuPy compiles with ``-ftz=true``). ``why`` explains the range in the message.
    """
    expected = f"a float in {FLOAT32_TINY:.8g}..{hi:.8g} ({why})"
    number = _real(name, value, expected)
    with np.errstate(over="ignore", under="ignore"):
        in_kernel = float(np.float32(number))
    if not FLOAT32_TINY <= in_kernel <= hi:
        raise ValueError(f"{name}: expected {expected}, got {shown(value)}")
    return number


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """Return ``value``, checking that it is one of the strings ``choices``."""
    expected = "one of " + ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected {expected}, got {got(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected {expected}, got {shown(value)}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` as a Python bool (``bool`` or ``numpy.bool_`` only)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {got(value)}")
    return bool(value)
