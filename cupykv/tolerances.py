"""Stated tolerances: how close a backend's attention must be to the reference.

Cache writes have no tolerance: stored rows must equal the reference bit for
bit (with rope, within one unit in the last place of the storage dtype, since
the kernels rotate in double and round through fp32 while the reference
rounds once from float64).

Attention output is a convex combination of value rows, so its error scales
with ``value_scale = max |v|`` over the attended rows, not with ``|out|``.
The bound per element is::

    |got - want| <= value_scale * (2 * u(dtype) + 256 * u(float32))

where ``u`` is the unit roundoff (half an ulp at 1.0). ``u(dtype)`` is the
error of the reference itself once rounded to the storage dtype, the best a
kernel can return; twice that leaves room for the kernel's own fp32 result
landing on the other side of a rounding boundary. ``256 u(float32)``
(about 1.5e-5) bounds fp32 accumulation: dot products over head_dim <= 256
terms and softmax sums, relative to the value scale. For float32 storage the
second term dominates; for float16 and bfloat16 the first does.

That accumulation term assumes logits of moderate size. A large scale (or
large q and k) makes softmax ill-conditioned: the fp32 logit ``scale * dot(q, k)``
carries an absolute error up to ``eps = (head_dim + 4) u(float32) scale
norm(q) norm(k)`` (the dot product's rounding, bounded through
``sum_d abs(q_d k_d) <= norm(q) norm(k)``, which holds for q rotated by rope
too; the scaling; the rotation), and logits off by at most ``eps`` each move every softmax weight by a
factor within ``[e^(-2 eps), e^(2 eps)]``, so the output by at most
``value_scale * (e^(2 eps) - 1)`` (never more than ``2 * value_scale``: both
are convex combinations of the same rows). :func:`logit_error_bound` gives
``eps``; pass it as ``logit_error`` where a test draws such scales.

fp8 caches (``dtype="float8_e4m3"``). The kernels and the reference store the
same E4M3 codes (bit for bit) and both attend over ``code * scale``, so a
kernel's output is held to the bound above for its io dtype, with
``value_scale`` taken over the dequantized V rows. What quantization itself
costs, against attention over the K/V before they were stored, is a separate,
data-dependent bound (:func:`fp8_attention_bound`). E4M3 has 3 mantissa bits:
its relative step is ``2**-3``, so a value of normal range (``|x / scale| >=
2**-6``) is stored within a relative ``2**-4`` (half a step), and a smaller one
within an absolute ``2**-10 * scale`` (half the subnormal step ``2**-9``), as
long as ``|x| <= 448 scale`` (beyond, stores saturate and nothing is bounded).
So each logit moves by at most ``eps_q = scale * (2**-4 sum_d |q_d k_d| +
2**-10 k_scale sum_d |q_d|)``, which moves the weights as above (``value_scale
* min(2, e^(2 eps_q) - 1)``), and each value row by at most ``2**-4 |v| +
2**-10 v_scale``: in all::

    |attention(quantized) - attention(exact)| <= value_scale * (2**-4 + min(2, e^(2 eps_q) - 1))
                                                 + 2**-10 * max v_scale
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
FP32_ACCUMULATION = 256 * 2.0 ** -24
#: E4M3: largest relative error of a stored value of normal range (half its relative step 2**-3) ...
E4M3_RELATIVE = 2.0 ** -4
#: ... and largest absolute error, in units of the scale, of a smaller one (half the subnormal step 2**-9)
E4M3_ABSOLUTE = 2.0 ** -10


def fp8_attention_bound(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, scale: float,
                        k_scale: npt.ArrayLike, v_scale: npt.ArrayLike) -> float:
    """Largest error quantizing K and V to E4M3 can cause in one attention output element.

    Parameters
    ----------
    q : array_like ``[..., head_dim]``
        The queries (after rope, if any), every row bounded against every key row.
    k, v : array_like ``[..., head_dim]``
        The attended K and V rows before quantization, each within ``448 * scale`` of zero.
    scale : float
        The logit scale.
    k_scale, v_scale : array_like of float
        The cache's scales of the heads involved (their largest value is used).

    Returns
    -------
    float
        ``value_scale * (2**-4 + min(2, e^(2 eps_q) - 1)) + 2**-10 * max(v_scale)`` with
        ``value_scale = max |v|`` and ``eps_q = |scale| (2**-4 max_(q, k rows) sum |q_d k_d| +
        2**-10 max(k_scale) max_(q rows) sum |q_d|)`` (see the module; each maximum is taken
        on its own, which bounds the largest sum of the two).
    """
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    q_rows = np.abs(q64.reshape(-1, q64.shape[-1]))
    k_rows = np.abs(k64.reshape(-1, k64.shape[-1]))
    if q_rows.size == 0 or k_rows.size == 0:
        return 0.0
    largest_k_scale = float(np.max(k_scale))
    products = (q_rows @ k_rows.T).max()          # max over row pairs of sum |q_d k_d|
    logit_error = abs(float(scale)) * (E4M3_RELATIVE * products + E4M3_ABSOLUTE * largest_k_scale * q_rows.sum(1).max())
    value_scale = float(np.abs(v64).max()) if v64.size else 0.0
    weights_moved = min(2.0, math.expm1(min(2.0 * logit_error, 2.0)))
    return value_scale * (E4M3_RELATIVE + weights_moved) + E4M3_ABSOLUTE * float(np.max(v_scale))


def logit_error_bound(q: npt.ArrayLike, k: npt.ArrayLike, scale: float) -> float:
    """Largest absolute error of an fp32 logit ``scale * dot(q, k)`` over every query and key row.

    q ``[..., head_dim]`` and k ``[..., head_dim]`` (any leading shapes: every pair of rows is
    bounded), before or after rope: ``(head_dim + 4) u(float32) scale max norm(q) max norm(k)``
    with Euclidean row norms. Rows holding NaN or infinities are left out (they are not attended).
    """
    def largest_norm(rows: npt.ArrayLike) -> float:
        array = np.asarray(rows, np.float64)
        norms = np.sqrt((array.reshape(-1, array.shape[-1]) ** 2).sum(axis=1))
        finite = norms[np.isfinite(norms)]
        return float(finite.max()) if finite.size else 0.0

    head_dim = int(np.shape(q)[-1])
    return float((head_dim + 4) * UNIT_ROUNDOFF["float32"] * abs(float(scale)) * largest_norm(q) * largest_norm(k))


def attention_tolerance(dtype: str, value_scale: float, logit_error: float = 0.0) -> float:
    """Largest allowed absolute error of one attention output element (``logit_error``: see the module).

    ``dtype`` is the dtype the output is rounded to: the cache's io dtype (its dtype, but for fp8 caches).
    """
    scale = max(float(value_scale), float(np.finfo(np.float32).tiny))
    conditioning = math.expm1(min(2.0 * logit_error, 2.0)) if logit_error > 0 else 0.0   # e^2 - 1 > 2: capped below
    conditioning = min(2.0, conditioning)
    return scale * (2 * UNIT_ROUNDOFF[dtype] + FP32_ACCUMULATION + conditioning)


def attention_error(got: npt.ArrayLike, want: npt.ArrayLike, dtype: str, value_scale: float,
                    logit_error: float = 0.0) -> float:
    """Worst element error as a fraction of the tolerance (<= 1 passes; NaN counts as failing)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"got: expected shape {want.shape}, got {got.shape}")
    if got.size == 0:
        return 0.0
    error = np.abs(got - want)
    if np.isnan(error).any():
        return float("inf")
    return float(error.max() / attention_tolerance(dtype, value_scale, logit_error))


def assert_attention_close(got: npt.ArrayLike, want: npt.ArrayLike, dtype: str, value_scale: float,
                           context: str = "", logit_error: float = 0.0) -> None:
    """Raise AssertionError with max and mean error when ``got`` is outside the tolerance."""
    ratio = attention_error(got, want, dtype, value_scale, logit_error)
    if ratio <= 1.0:
        return
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.abs(got - want)
    worst = tuple(int(i) for i in np.unravel_index(np.nanargmax(np.where(np.isnan(error), np.inf, error)), error.shape))
    raise AssertionError(
        f"attention outside tolerance{' ' + context if context else ''}: max error {np.nanmax(error):.3g} "
        f"(tolerance {attention_tolerance(dtype, value_scale, logit_error):.3g}, {dtype}, value scale "
        f"{value_scale:.3g}, logit error {logit_error:.3g}), "
        f"mean error {np.nanmean(error):.3g}, NaNs {int(np.isnan(error).sum())}, worst at index {worst}: "
        f"got {float(got[worst])!r}, want {float(want[worst])!r}")


def ulp_distance(a: npt.ArrayLike, b: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Elementwise distance in units in the last place between two arrays of one float dtype.

    Works on the bit patterns, so it applies to float16, bfloat16 and float32
    alike; equal values (including +0 and -0) are 0 apart, NaN against
    anything is reported as the largest distance.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"b: expected dtype {a.dtype} and shape {a.shape}, got {b.dtype} and {b.shape}")
    bits = 8 * a.dtype.itemsize
    signed = np.dtype(f"i{a.dtype.itemsize}")

    def ordered(x: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
        raw = x.view(signed).astype(np.int64)
        return np.where(raw < 0, -(raw & ((1 << (bits - 1)) - 1)), raw)

    distance = np.abs(ordered(a) - ordered(b))
    nan = np.isnan(a.astype(np.float32)) | np.isnan(b.astype(np.float32))
    return np.where(nan, np.iinfo(np.int64).max, distance)


def logits_tolerance(dtype: str, logit_scale: float, n_layers: int) -> float:
    """Largest allowed absolute difference between model logits and the reference model's.

    Both models round every op's output to the storage dtype at the same
    points; where their fp32 and float64 values straddle a rounding boundary
    they differ by one unit there, and that difference travels through the
    rest of the network. Per layer there are eight rounding points on the
    residual path (norm, q/k/v, attention, o, add, MLP); allowing each of them
    one unit (2u relative) plus fp32 accumulation gives
    ``logit_scale * n_layers * (8 * 2 u(dtype) + FP32_ACCUMULATION)``, with
    ``logit_scale = max |logit|``.
    """
    return float(logit_scale) * max(1, n_layers) * (16 * UNIT_ROUNDOFF[dtype] + FP32_ACCUMULATION)
