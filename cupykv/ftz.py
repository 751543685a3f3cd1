"""What CuPy's ``-ftz=true`` does to float32 values, modelled on the host for the references.

CuPy compiles every RawModule with ``-ftz=true``. A kernel's float32 arithmetic then reads a
subnormal operand as a zero of its sign and writes a subnormal result as one, and so do its
conversions: widening a float32 to double (``cvt.ftz.f64.f32``) and narrowing a double to float32
(``cvt.rn.ftz.f32.f64``, rounded first). A copy of a float32 without arithmetic keeps it. The
emulator runs kernels with x86's denormals-are-zero and flush-to-zero modes, to the same effect
(``tests/test_subnormals.py``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

FLOAT32_TINY = np.float32(np.finfo(np.float32).tiny)
_LIFT = np.float32(2.0 ** 64)   # lifts float32's smallest normal far from its subnormals, exactly


def flush_float32_subnormals(x: npt.ArrayLike) -> npt.NDArray[Any]:
    """``x`` with every element that float32 arithmetic under ``-ftz`` turns into a zero of its sign.

    A float32 element is flushed when it is subnormal. A float64 element, as a narrowing
    conversion sees it, is flushed when it is tiny after rounding: rounded to float32's 24
    significant bits with no bound on the exponent, it is still below float32's smallest normal.
    So a value a hair below that normal that rounds up to it is kept, while the exact midpoint
    below it, which rounds to even, is flushed. x86 draws the line there, and the emulator runs
    on it (``tests/test_subnormals.py``); a GPU has not yet been compared within 2**-25 of it.

    Parameters
    ----------
    x : array_like of float32 or float64, any shape

    Returns
    -------
    numpy.ndarray, the shape and dtype of ``x`` (float64 for other inputs); elements kept keep
    their value
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        # times 2**64 (exact), float32's rounding near its smallest normal is that of 24 bits
        tiny_after_rounding = np.abs((x.astype(np.float64) * _LIFT).astype(np.float32)) < FLOAT32_TINY * _LIFT
    return np.where(tiny_after_rounding, np.copysign(x.dtype.type(0), x), x).astype(x.dtype)
