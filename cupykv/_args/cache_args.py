"""Arguments of the cache operations and of attention, shared by the fast path and the reference.

Array-module agnostic: arrays are inspected only through ``.shape``,
``.dtype`` and ``.ndim``, so NumPy and CuPy arrays pass through the same code.
Values are read only from host objects (Python ints, lists, tuples, NumPy
arrays); per-sequence values on the device are the fast path's business
(:mod:`cupykv.cache`). Errors: ``<name>: expected <what>, got <value>``,
``TypeError`` for a wrong type, ``ValueError`` for a wrong value or shape.
"""
from __future__ import annotations

import math

import numpy as np

from cupykv._args.limits import INT32_MAX, MAX_NEW

SOFTCAP_MAX = 2.0**64
from cupykv._args.scalars import (FLOAT64_MAX, check_float, check_int, check_int32, check_positive_float32, got,
                                  int_range, is_int, shown)


def _check_array(name, arr, what):
    if not all(hasattr(arr, attr) for attr in ("shape", "dtype", "ndim")):
        raise TypeError(f"{name}: expected an array {what}, got {got(arr)}")


def _check_dtype(name, arr, dtypes):
    if dtypes is not None and np.dtype(arr.dtype) not in dtypes:
        allowed = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected dtype one of ({allowed}), got {np.dtype(arr.dtype).name}")


def check_layer(layer, spec):
    """Return ``layer`` as an int in ``0..spec.n_layers - 1``."""
    return check_int("layer", layer, 0, spec.n_layers - 1)


def check_rows(name, arr, spec, dtypes=None):
    """Check new K or V rows ``[batch, n_new, n_kv_heads, head_dim]``; return ``n_new`` (1..MAX_NEW).

    ``dtypes``, when given, is the tuple of accepted dtypes (the caller's policy).
    """
    axes = "[batch, n_new, n_kv_heads, head_dim]"
    _check_array(name, arr, axes)
    _check_dtype(name, arr, dtypes)
    shape = tuple(arr.shape)
    n_new = shape[1] if arr.ndim == 4 and 1 <= shape[1] <= MAX_NEW else f"n_new in 1..{MAX_NEW}"
    expected = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    if shape != expected:
        shown_shape = "(" + ", ".join(str(s) for s in expected) + ")"
        raise ValueError(f"{name}: expected shape {shown_shape} {axes}, got {shape}")
    return n_new


def check_same_shape(name_a, a, name_b, b):
    """Check that array ``b`` has the shape of array ``a``."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_b}: expected the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}")


def check_q(q, spec, dtypes=None):
    """Check queries ``[batch, q_len, n_heads, head_dim]``; return ``(q_len, n_heads)``.

    ``q_len`` in ``1..MAX_NEW``; ``n_heads`` a positive multiple of ``n_kv_heads``;
    ``batch * q_len * n_heads`` (the query rows, a kernel ``int``) at most ``INT32_MAX``.
    """
    axes = "[batch, q_len, n_heads, head_dim]"
    _check_array("q", q, axes)
    _check_dtype("q", q, dtypes)
    shape = tuple(q.shape)
    ok = (
        q.ndim == 4
        and shape[0] == spec.batch
        and 1 <= shape[1] <= MAX_NEW
        and shape[2] >= 1
        and shape[2] % spec.n_kv_heads == 0
        and shape[3] == spec.head_dim
    )
    if not ok:
        q_len = shape[1] if q.ndim == 4 and 1 <= shape[1] <= MAX_NEW else f"q_len in 1..{MAX_NEW}"
        raise ValueError(
            f"q: expected shape ({spec.batch}, {q_len}, n_heads, {spec.head_dim}) {axes} "
            f"with n_heads a multiple of n_kv_heads={spec.n_kv_heads}, got {shape}"
        )
    if math.prod(shape[:3]) > INT32_MAX:
        raise ValueError(f"q: expected batch * q_len * n_heads <= {INT32_MAX} query rows, got "
                         f"{shape[0]} * {shape[1]} * {shape[2]} = {math.prod(shape[:3])}")
    return shape[1], shape[2]


def check_scale(scale, spec):
    """Return the logit scale: ``1/sqrt(head_dim)`` for ``None``, else a normal float32 > 0."""
    if scale is None:
        return 1.0 / math.sqrt(spec.head_dim)
    return check_positive_float32("scale", scale)


def check_window(window):
    """Return ``None`` or the sliding-window size as an int in ``1..INT32_MAX``."""
    return None if window is None else check_int32("window", window, lo=1)


def check_softcap(softcap):
    """Return ``None`` or the logit soft cap: a normal float32 in ``(0, SOFTCAP_MAX]``.

    The kernel computes ``softcap * tanh(s / softcap)`` in float32; above
    ``2**64`` the quotient of every logit ``|s| < 2**-62`` would flush to zero
    (``-ftz``) where the reference keeps ``s``. (Any cap above the logits caps
    nothing: pass ``None`` for no cap.)
    """
    if softcap is None:
        return None
    return check_positive_float32("softcap", softcap, SOFTCAP_MAX,
                                  "normal and > 0 in float32, the kernel's type; larger caps flush s / softcap to 0")


def check_rope_theta(name, theta):
    """Return a rotary base as a float in ``1..FLOAT64_MAX`` (the kernels compute angles in double).

    ``theta >= 1`` keeps every inverse frequency ``theta ** (-2i / head_dim)``
    at most 1, so an angle is at most its position: finite, never NaN.
    """
    return check_float(name, theta, 1.0, FLOAT64_MAX, "finite and >= 1, so that every rotation angle "
                                                     "p * theta**(-2i/head_dim) is at most p")


def check_rope(rope, spec):
    """Return ``None`` or a ``Rope``; rope needs an even ``head_dim``."""
    from cupykv.rope import Rope  # deferred: rope.py imports this module

    if rope is None:
        return None
    if not isinstance(rope, Rope):
        raise TypeError(f"rope: expected None or a cupykv.Rope, got {got(rope)}")
    if spec.head_dim % 2:
        raise ValueError(f"rope: expected a cache with an even head_dim, got head_dim={spec.head_dim}")
    return rope


def check_q_len(q_len):
    """Return ``q_len`` as an int in ``1..MAX_NEW``."""
    return check_int("q_len", q_len, 1, MAX_NEW)


def _host_sequence(name, value, spec, expected):
    """Python ints ``[batch]`` from an int, a list or tuple of ints, or a NumPy int array ``[batch]``.

    Elements are read exactly (no wrap-around), for the caller to range-check.
    """
    if is_int(value):
        return [int(value)] * spec.batch
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise TypeError(f"{name}: expected {expected}, got {got(value)}")
    if isinstance(value, np.ndarray):
        arr = value
    else:
        if len(value) == spec.batch and all(is_int(v) for v in value):
            return [int(v) for v in value]
        try:
            arr = np.asarray(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{name}: expected {expected}, got a ragged sequence") from None
    if tuple(arr.shape) != (spec.batch,):
        raise ValueError(f"{name}: expected {expected}, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu" and not all(is_int(v) for v in arr.tolist()):
        raise TypeError(f"{name}: expected {expected}, got dtype {arr.dtype.name}")
    return [int(v) for v in arr.tolist()]


def _per_sequence(name, value, spec, lo, hi):
    """Check a per-sequence int argument; return int64 NumPy ``[batch]`` with every value in ``lo..hi``."""
    if is_int(value):
        return np.full(spec.batch, check_int(name, value, lo, hi), dtype=np.int64)
    values = _host_sequence(name, value, spec, f"{int_range(lo, hi)} or {spec.batch} such ints [batch]")
    for b, v in enumerate(values):
        if not lo <= v <= hi:
            raise ValueError(f"{name}: expected ints in {lo}..{hi}, got {name}[{b}] = {shown(v)}")
    return np.array(values, dtype=np.int64)


def check_advance(n, spec):
    """Check ``advance``'s ``n``: an int or ints ``[batch]``, each in ``0..INT32_MAX`` (the kernel's ``int``).

    Returns int64 NumPy ``[batch]``.
    """
    return _per_sequence("n", n, spec, 0, INT32_MAX)


def check_new_lengths(new_lengths, current_lengths, spec):
    """Check ``truncate``'s ``new_lengths`` against ``current_lengths`` (host ``[batch]``).

    Each ``0 <= new_lengths[b] <= current_lengths[b]``. Returns int64 NumPy ``[batch]``.
    """
    expected = f"an int or {spec.batch} ints [batch]"
    values = _host_sequence("new_lengths", new_lengths, spec, expected)
    current = [int(c) for c in np.asarray(current_lengths).tolist()]
    for b, (new, now) in enumerate(zip(values, current)):
        if not 0 <= new <= now:
            raise ValueError(
                f"new_lengths: expected 0 <= new_lengths[b] <= lengths[b] (truncate only shortens), "
                f"got new_lengths[{b}] = {shown(new)} with lengths[{b}] = {now}"
            )
    return np.array(values, dtype=np.int64)


def check_slots(slots, spec):
    """Check ``reset``'s ``slots``: ``None`` (all), an int, or distinct ints in ``0..batch-1``.

    Returns the sorted slot indices as int64 NumPy ``[n_slots]``.
    """
    expected = f"None, an int or distinct ints in 0..{spec.batch - 1}"
    if slots is None:
        return np.arange(spec.batch, dtype=np.int64)
    if is_int(slots):
        return np.array([check_int("slots", slots, 0, spec.batch - 1)], dtype=np.int64)
    if not isinstance(slots, (list, tuple, np.ndarray)):
        raise TypeError(f"slots: expected {expected}, got {got(slots)}")
    if isinstance(slots, (list, tuple)) and all(is_int(s) for s in slots):
        values = list(slots)
    else:
        try:
            arr = np.asarray(slots)
        except (ValueError, OverflowError):
            raise ValueError(f"slots: expected {expected}, got a ragged sequence") from None
        if arr.ndim > 1:
            raise ValueError(f"slots: expected {expected}, got shape {arr.shape}")
        values = arr.reshape(-1).tolist()
        if not all(is_int(s) for s in values):
            raise TypeError(f"slots: expected {expected}, got dtype {arr.dtype.name}")
    values = [int(s) for s in values]
    for s in values:
        if not 0 <= s < spec.batch:
            raise ValueError(f"slots: expected {expected}, got slot {shown(s)}")
    if len(set(values)) != len(values):
        raise ValueError(f"slots: expected {expected}, got repeated slots {values}")
    return np.array(sorted(values), dtype=np.int64)
