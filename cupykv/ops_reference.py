"""The NumPy oracle of :mod:`cupykv.ops`: same names, same signatures, host arrays.

Plain on purpose: all arithmetic is float64 and each result is rounded once
to the storage dtype of the inputs (round to nearest even), so it is the
exact answer as that dtype can hold it. The fast path never imports this
module. Inputs are NumPy arrays of float32, float16 or ``ml_dtypes.bfloat16``
(ids int32); a rejected argument raises ``TypeError`` or ``ValueError`` naming it.

The kernels compute in fp32 under CuPy's ``-ftz=true``: a float32 (or bfloat16)
operand, product or result that is subnormal counts as a zero of its sign
(:mod:`cupykv.ftz`). This exact answer keeps them, so the ops' stated tolerances
(``tests/test_ops.py``) hold where those values are normal; stored cache rows,
whose contract is exact, are modelled with the flush instead (:mod:`cupykv.reference`).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

from cupykv._args.scalars import check_positive_float32
from cupykv._typing import FloatLike, HostArray
from cupykv.reference import round_to_storage

__all__ = ["linear", "embedding", "rmsnorm", "silu_mul", "add", "argmax"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _float(name: str, array: npt.ArrayLike, ndim: int | None = None, like: HostArray | None = None) -> HostArray:
    """``array`` as a NumPy float array of a storage dtype (that of ``like`` when given)."""
    array = np.asarray(array)
    if array.dtype not in _FLOAT_DTYPES or (like is not None and array.dtype != like.dtype):
        expected = f"{like.dtype}" if like is not None else "float32, float16 or bfloat16"
        raise TypeError(f"{name}: expected dtype {expected}, got {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} axes, got shape {array.shape}")
    return array


def linear(x: npt.ArrayLike, weight: npt.ArrayLike) -> HostArray:
    """``x @ weight.T``: x ``[rows, in_features]``, weight ``[out_features, in_features]``.

    Returns ``[rows, out_features]`` in the dtype of x.
    """
    x = _float("x", x, 2)
    weight = _float("weight", weight, 2, like=x)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: expected shape (out_features, {x.shape[1]}) [out_features, in_features], "
                         f"got {weight.shape}")
    return round_to_storage(x.astype(np.float64) @ weight.astype(np.float64).T, x.dtype)


def embedding(ids: npt.ArrayLike, table: npt.ArrayLike, *, error_flag: HostArray | None = None) -> HostArray:
    """``table[ids]``; ids int32 ``[rows]``, table ``[vocab, hidden]`` -> ``[rows, hidden]``.

    Rows of ids outside ``0..vocab-1`` are zeros, and ``error_flag[0]`` (a
    NumPy int32 ``[1]``, when given) is set to 1.
    """
    ids = np.asarray(ids)
    if ids.dtype != np.int32:
        raise TypeError(f"ids: expected dtype int32, got {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"ids: expected shape (rows,), got {ids.shape}")
    table = _float("table", table, 2)
    valid = (ids >= 0) & (ids < table.shape[0])
    out = np.zeros((ids.shape[0], table.shape[1]), table.dtype)
    out[valid] = table[ids[valid]]
    if error_flag is not None and not valid.all():
        error_flag[0] = 1
    return out


def rmsnorm(x: npt.ArrayLike, weight: npt.ArrayLike, eps: FloatLike) -> HostArray:
    """``x / sqrt(mean(x**2) + eps) * weight`` per row; x ``[rows, hidden]``, weight ``[hidden]``.

    ``eps`` is a normal float32 > 0, as the kernel receives it.
    """
    x = _float("x", x, 2)
    weight = _float("weight", weight, 1, like=x)
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight: expected shape ({x.shape[1]},) [hidden], got {weight.shape}")
    eps = check_positive_float32("eps", eps)
    x64 = x.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)  # [rows, 1]
    return round_to_storage(x64 * inv_rms * weight.astype(np.float64), x.dtype)


def _same_shape(name_a: str, a: npt.ArrayLike, name_b: str, b: npt.ArrayLike) -> tuple[HostArray, HostArray]:
    a = _float(name_a, a)
    b = _float(name_b, b, like=a)
    if a.shape != b.shape:
        raise ValueError(f"{name_b}: expected the shape of {name_a} {a.shape}, got {b.shape}")
    return a, b


def silu_mul(gate: npt.ArrayLike, up: npt.ArrayLike) -> HostArray:
    """``gate / (1 + exp(-gate)) * up``, elementwise (same shape and dtype)."""
    gate, up = _same_shape("gate", gate, "up", up)
    g = gate.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g: silu -> -0
        return round_to_storage(g / (1.0 + np.exp(-g)) * up.astype(np.float64), gate.dtype)


def add(a: npt.ArrayLike, b: npt.ArrayLike) -> HostArray:
    """``a + b``, elementwise (same shape and dtype)."""
    a, b = _same_shape("a", a, "b", b)
    return round_to_storage(a.astype(np.float64) + b.astype(np.float64), a.dtype)


def argmax(logits: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """Index of each row's maximum of logits ``[rows, vocab]`` as int32 ``[rows]``, the lowest on ties.

    NaN ranks above every number (NumPy's rule): a row holding a NaN gives its first NaN.
    """
    logits = _float("logits", logits, 2)
    ids: npt.NDArray[np.int32] = np.argmax(logits.astype(np.float64), axis=-1).astype(np.int32)
    return ids
