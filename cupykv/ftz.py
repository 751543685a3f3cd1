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


def flush_float32_subnormals(x: npt.ArrayLike) -> npt.NDArray[Any]:
    """``x`` with every element whose float32 rounding is subnormal replaced by a zero of its sign.

    Parameters
    ----------
    x : array_like of float32 or float64, any shape
        A float64 element is judged by its float32 rounding (to nearest even), as
        ``cvt.rn.ftz.f32.f64`` rounds before it flushes; elements that are kept keep their value.

    Returns
    -------
    numpy.ndarray, the shape and dtype of ``x`` (float64 for other inputs)
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        subnormal = np.abs(x.astype(np.float32)) < FLOAT32_TINY
    return np.where(subnormal, np.copysign(x.dtype.type(0), x), x).astype(x.dtype)
