"""Random device arrays and float32 views for the bench, on either backend.

Timing runs on random data, never zeros: zeros hide unwritten outputs and can
run faster than real data. bfloat16 is ``ml_dtypes.bfloat16`` on the
emulator and uint16 bit patterns on CuPy; the helpers here convert both ways
with ``xp`` operations only, so they run on the device.
"""
from __future__ import annotations

import math

import numpy as np

_CHUNK = 2**26  # elements generated at once: bounds the float32 scratch at 256 MiB


def bf16_bits_from_f32(xp, x):
    """uint16 bfloat16 bit patterns of float32 ``x``, rounded to nearest even (finite inputs)."""
    bits = x.view(xp.uint32)
    rounding = xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))
    return ((bits + rounding) >> xp.uint32(16)).astype(xp.uint16)


def f32_from_bf16_bits(xp, bits):
    """float32 values of uint16 bfloat16 bit patterns (exact)."""
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def to_f32(backend, array):
    """A float32 device copy of a float32, float16 or bfloat16 backend array (exact)."""
    xp = backend.xp
    if array.dtype == np.uint16:  # bfloat16 bits on CuPy
        return f32_from_bf16_bits(xp, array)
    return xp.asarray(array).astype(xp.float32)


def _standard_normal(backend, n: int, seed: int):
    """float32 standard normal values, generated where the backend's arrays live (``xp``)."""
    return backend.xp.random.default_rng(seed).standard_normal(n, dtype=backend.xp.float32)


def _cast(backend, x, dtype: str):
    """float32 ``x`` as the backend stores ``dtype`` (bfloat16: rounded bit patterns where stored as uint16)."""
    storage = backend.storage_dtype(dtype)
    if storage == np.uint16:
        return bf16_bits_from_f32(backend.xp, x)
    return x.astype(storage)


def fill_random(backend, array, dtype: str, seed: int, scale: float = 1.0) -> None:
    """Overwrite a contiguous device array with standard normal values times ``scale`` in ``dtype``."""
    flat = array.reshape(-1)  # a view: the array is contiguous
    for chunk, start in enumerate(range(0, flat.size, _CHUNK)):
        stop = min(flat.size, start + _CHUNK)
        values = _standard_normal(backend, stop - start, seed * 7919 + chunk)
        if scale != 1.0:
            values *= values.dtype.type(scale)
        backend.copy(flat[start:stop], _cast(backend, values, dtype))


def random_array(backend, shape, dtype: str, seed: int, scale: float = 1.0):
    """A new device array ``shape`` of standard normal values times ``scale`` in ``dtype``."""
    array = backend.zeros(tuple(shape), backend.storage_dtype(dtype))
    fill_random(backend, array, dtype, seed, scale)
    return array


def relative_error(backend, got, want) -> float:
    """``||got - want|| / ||want||`` in float64 on the host (the METHOD.md correctness measure)."""
    got = np.asarray(backend.to_host(to_f32(backend, got)), dtype=np.float64)
    want = np.asarray(backend.to_host(want), dtype=np.float64)
    denominator = float(np.linalg.norm(want))
    error = float(np.linalg.norm(got - want))
    if not math.isfinite(error):
        return math.inf
    return error / denominator if denominator > 0 else error
