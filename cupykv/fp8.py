"""E4M3 on the host: the quantization an fp8 cache applies, and help choosing its scales.

An fp8 cache (``CacheSpec(dtype="float8_e4m3")``) stores each K or V value
``x`` of kv head ``h`` as ``E4M3(clamp(x / scale[h], -448, 448))``, rounded to
nearest even, and reads it back as ``code * scale[h]``. :func:`quantize_e4m3`
is that store, bit for bit as the kernels compute it (``kernels/kv_codec.cuh``):

1. ``x`` as float32 (exact from the io dtypes; a float64 value, such as a key
   the reference rotated, is rounded once, as the kernels round their
   double-precision rotation), a float32 subnormal flushed to a zero of its
   sign (CuPy compiles with ``-ftz=true``);
2. ``x / scale`` in float32, correctly rounded;
3. saturated to +-448 (``__NV_SATFINITE``) and rounded to E4M3, nearest even;
   NaN becomes code 0x7F, as cuda_fp8.h makes it.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from cupykv.backends.capture import refuse_in_capture
from cupykv.ftz import FLOAT32_TINY, flush_float32_subnormals
from cupykv.spec import FP8_MAX

__all__ = ["E4M3", "FP8_MAX", "quantize_e4m3", "dequantize_e4m3", "calibrate_scales"]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_NAN_CODE = 0x7F


def quantize_e4m3(x: npt.ArrayLike, scale: npt.ArrayLike) -> npt.NDArray[Any]:
    """E4M3 codes of ``x / scale``, as an fp8 cache stores them.

    Parameters
    ----------
    x : array_like of float, any shape
        Values to store (float16, bfloat16, float32 or float64).
    scale : array_like of float32 > 0, broadcastable to ``x``
        The scale of each value's head.

    Returns
    -------
    numpy.ndarray of ``ml_dtypes.float8_e4m3fn``, the broadcast shape of ``x`` and ``scale``
    """
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        x32: npt.NDArray[np.float32] = flush_float32_subnormals(np.asarray(x).astype(np.float32))
        divisor: npt.NDArray[np.float32] = np.asarray(scale, dtype=np.float32)
        quotient = flush_float32_subnormals((x32 / divisor).astype(np.float32))
        clamped = np.clip(quotient, -FP8_MAX, FP8_MAX)   # NaN stays NaN
        bits = np.asarray(clamped.astype(E4M3)).view(np.uint8)
    bits = np.where(np.isnan(clamped), np.uint8(_NAN_CODE), bits).astype(np.uint8)
    codes: npt.NDArray[Any] = bits.view(E4M3)
    return codes


def dequantize_e4m3(codes: npt.ArrayLike, scale: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The values E4M3 ``codes`` stand for with ``scale``: ``code * scale``, exact in float64.

    Parameters
    ----------
    codes : array_like of ``ml_dtypes.float8_e4m3fn`` (or uint8 bit patterns)
    scale : array_like of float32, broadcastable to ``codes``

    Returns
    -------
    numpy.ndarray, float64, the broadcast shape
    """
    array = np.asarray(codes)
    if array.dtype == np.uint8:
        array = array.view(E4M3)
    values: npt.NDArray[np.float64] = array.astype(np.float64) * np.asarray(scale, dtype=np.float32).astype(np.float64)
    return values


def calibrate_scales(samples: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Per-layer, per-head scales that map the largest sampled magnitude to 448.

    Graph-safe: no — refused inside a captured step (CaptureError): it reads the samples on the
    host (a device array is copied back, which synchronises). Calibrate before capture.

    Parameters
    ----------
    samples : array_like ``[n_layers, ..., n_kv_heads, head_dim]``
        Sample K (or V) rows of each layer, any number of axes between (batch,
        tokens); a NumPy array, or a device array of either backend.

    Returns
    -------
    numpy.ndarray, float32, shape ``[n_layers, n_kv_heads]``
        ``max |x| / 448`` over each layer's head, rounded up to a float32 so
        that the largest sample is stored without saturating; 1.0 for a head
        whose samples are all zero. Pass it as ``k_scale`` or ``v_scale``.

    Raises
    ------
    TypeError
        ``samples`` is not a float array.
    ValueError
        Fewer than 3 axes, an empty axis, or a sample that is NaN or infinite.
    CaptureError
        Inside a captured step.
    """
    refuse_in_capture("cupykv.calibrate_scales (it reads the samples on the host)",
                      "calibrate before capture and pass the scales to the cache, or set_scales between replays")
    array = _host_array(samples)
    if array.dtype.kind != "f" and array.dtype not in (np.dtype(ml_dtypes.bfloat16),):
        raise TypeError(f"samples: expected a float array [n_layers, ..., n_kv_heads, head_dim], got dtype {array.dtype}")
    if array.ndim < 3 or 0 in array.shape:
        raise ValueError(f"samples: expected a non-empty array [n_layers, ..., n_kv_heads, head_dim] (3 or more "
                         f"axes), got shape {array.shape}")
    values = array.astype(np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"samples: expected finite values, got {int((~np.isfinite(values)).sum())} NaN or "
                         f"infinite ones")
    per_head = np.moveaxis(np.abs(values), -2, 1).reshape(values.shape[0], values.shape[-2], -1).max(axis=2)
    scales = (per_head / FP8_MAX).astype(np.float32)
    too_small = scales.astype(np.float64) * FP8_MAX < per_head
    scales = np.where(too_small, np.nextafter(scales, np.float32(np.inf)), scales)
    return np.where(per_head > 0, np.maximum(scales, FLOAT32_TINY), np.float32(1.0)).astype(np.float32)


def _host_array(samples: object) -> npt.NDArray[Any]:
    """``samples`` as a NumPy array (device arrays are copied to the host)."""
    if hasattr(samples, "get") and not isinstance(samples, np.ndarray):   # a CuPy array
        samples = samples.get()
    return np.asarray(samples)
