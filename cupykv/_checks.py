"""Argument checks shared by the reference and the fast path.

Array-module agnostic: arrays are inspected only through ``.shape``,
``.dtype`` and ``.ndim``, so NumPy and CuPy arrays pass through the same code.
Values are read only from host objects (python ints, lists, NumPy arrays).

Every check raises ``TypeError`` for a wrong type and ``ValueError`` for a
wrong value or shape, with a message of the form
``<name>: expected <what>, got <value>``.
"""

import math
import numbers

import numpy as np


def _got(value):
    """``repr`` of a rejected value plus its type, for TypeError messages."""
    return f"{value!r} ({type(value).__name__})"


def is_int(value):
    """Whether ``value`` is a python or NumPy integer (``bool`` is not)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name, value, lo=None, hi=None):
    """Return ``value`` as a python int, checking ``lo <= value <= hi``.

    ``bool`` is rejected; NumPy integer scalars are accepted.
    """
    if lo is not None and hi is not None:
        expected = f"an int in {lo}..{hi}"
    elif lo is not None:
        expected = f"an int >= {lo}"
    else:
        expected = "an int"
    if not is_int(value):
        raise TypeError(f"{name}: expected {expected}, got {_got(value)}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def check_positive_float(name, value):
    """Return ``value`` as a python float, checking that it is finite and > 0."""
    expected = "a finite float > 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name}: expected {expected}, got {_got(value)}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_choice(name, value, choices):
    """Return ``value``, checking that it is one of the strings ``choices``."""
    expected = "one of " + ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected {expected}, got {_got(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def _check_array(name, arr, what):
    if not all(hasattr(arr, attr) for attr in ("shape", "dtype", "ndim")):
        raise TypeError(f"{name}: expected an array {what}, got {_got(arr)}")


def _check_dtype(name, arr, dtypes):
    if dtypes is not None and np.dtype(arr.dtype) not in dtypes:
        allowed = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected dtype one of ({allowed}), got {np.dtype(arr.dtype).name}")


def check_layer(layer, spec):
    """Return ``layer`` as an int in ``0..spec.n_layers - 1``."""
    return check_int("layer", layer, 0, spec.n_layers - 1)


def check_rows(name, arr, spec, dtypes=None):
    """Check new K or V rows ``[batch, n_new, n_kv_heads, head_dim]``; return ``n_new``.

    ``dtypes``, when given, is the tuple of accepted dtypes (the caller's policy).
    """
    axes = "[batch, n_new, n_kv_heads, head_dim]"
    _check_array(name, arr, axes)
    _check_dtype(name, arr, dtypes)
    shape = tuple(arr.shape)
    n_new = shape[1] if arr.ndim == 4 and shape[1] >= 1 else "n_new>=1"
    expected = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    if shape != expected:
        shown = "(" + ", ".join(str(s) for s in expected) + ")"
        raise ValueError(f"{name}: expected shape {shown} {axes}, got {shape}")
    return n_new


def check_same_shape(name_a, a, name_b, b):
    """Check that array ``b`` has the shape of array ``a``."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_b}: expected the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}")


def check_q(q, spec, dtypes=None):
    """Check queries ``[batch, q_len, n_heads, head_dim]``; return ``(q_len, n_heads)``.

    ``q_len >= 1`` and ``n_heads`` must be a positive multiple of ``n_kv_heads``.
    """
    axes = "[batch, q_len, n_heads, head_dim]"
    _check_array("q", q, axes)
    _check_dtype("q", q, dtypes)
    shape = tuple(q.shape)
    ok = (
        q.ndim == 4
        and shape[0] == spec.batch
        and shape[1] >= 1
        and shape[2] >= 1
        and shape[2] % spec.n_kv_heads == 0
        and shape[3] == spec.head_dim
    )
    if not ok:
        q_len = shape[1] if q.ndim == 4 and shape[1] >= 1 else "q_len>=1"
        raise ValueError(
            f"q: expected shape ({spec.batch}, {q_len}, n_heads, {spec.head_dim}) {axes} "
            f"with n_heads a multiple of n_kv_heads={spec.n_kv_heads}, got {shape}"
        )
    return shape[1], shape[2]


def check_scale(scale, spec):
    """Return the logit scale: ``1/sqrt(head_dim)`` for ``None``, else a finite float > 0."""
    if scale is None:
        return 1.0 / math.sqrt(spec.head_dim)
    return check_positive_float("scale", scale)


def check_window(window):
    """Return ``None`` or the sliding-window size as an int >= 1."""
    return None if window is None else check_int("window", window, lo=1)


def check_softcap(softcap):
    """Return ``None`` or the logit soft cap as a finite float > 0."""
    return None if softcap is None else check_positive_float("softcap", softcap)


def check_rope(rope, spec):
    """Return ``None`` or a ``Rope``; rope needs an even ``head_dim``."""
    from .rope import Rope  # deferred: rope.py imports this module

    if rope is None:
        return None
    if not isinstance(rope, Rope):
        raise TypeError(f"rope: expected None or a cupykv.Rope, got {_got(rope)}")
    if spec.head_dim % 2:
        raise ValueError(f"rope: expected a cache with an even head_dim, got head_dim={spec.head_dim}")
    return rope


def check_q_len(q_len):
    """Return ``q_len`` as an int >= 1."""
    return check_int("q_len", q_len, lo=1)


def _per_sequence_ints(name, value, spec):
    """Validate an int or int array ``[batch]``.

    Host values (int, list, tuple, NumPy array) come back as int64 NumPy
    ``[batch]``. Device arrays are checked for shape and dtype only and come
    back unchanged (``None`` is returned as the second item to say so).
    """
    expected = f"an int or an int array of shape ({spec.batch},) [batch]"
    if is_int(value):
        return np.full(spec.batch, int(value), dtype=np.int64), True
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(value)
        except ValueError:
            raise ValueError(f"{name}: expected {expected}, got a ragged sequence") from None
        host = True
    elif all(hasattr(value, attr) for attr in ("shape", "dtype", "ndim")):
        arr, host = value, False
    else:
        raise TypeError(f"{name}: expected {expected}, got {_got(value)}")
    if arr.size and np.dtype(arr.dtype).kind not in "iu":
        raise TypeError(f"{name}: expected {expected}, got dtype {np.dtype(arr.dtype).name}")
    if tuple(arr.shape) != (spec.batch,):
        raise ValueError(f"{name}: expected {expected}, got shape {tuple(arr.shape)}")
    return (arr.astype(np.int64) if host else arr), host


def check_advance(n, spec):
    """Check ``advance``'s ``n``: a non-negative int or int array ``[batch]``.

    Returns int64 NumPy ``[batch]`` for host values; a device array is
    checked for shape and dtype only and returned unchanged.
    """
    arr, host = _per_sequence_ints("n", n, spec)
    if host:
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"n: expected non-negative ints, got n[{b}] = {int(arr[b])}")
    return arr


def check_new_lengths(new_lengths, current_lengths, spec):
    """Check ``truncate``'s ``new_lengths`` against ``current_lengths`` (host ``[batch]``).

    Each ``0 <= new_lengths[b] <= current_lengths[b]``. Returns int64 NumPy
    ``[batch]`` for host values; a device array is checked for shape and
    dtype only and returned unchanged.
    """
    arr, host = _per_sequence_ints("new_lengths", new_lengths, spec)
    if host:
        current = np.asarray(current_lengths).astype(np.int64)
        bad = np.flatnonzero((arr < 0) | (arr > current))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"new_lengths: expected 0 <= new_lengths[b] <= lengths[b] (truncate only shortens), "
                f"got new_lengths[{b}] = {int(arr[b])} with lengths[{b}] = {int(current[b])}"
            )
    return arr


def check_slots(slots, spec):
    """Check ``reset``'s ``slots``: ``None`` (all), an int, or distinct ints.

    Returns the sorted slot indices as int64 NumPy ``[n_slots]``.
    """
    expected = f"None, an int or distinct ints in 0..{spec.batch - 1}"
    if slots is None:
        return np.arange(spec.batch, dtype=np.int64)
    if is_int(slots):
        return np.array([check_int("slots", slots, 0, spec.batch - 1)], dtype=np.int64)
    if not isinstance(slots, (list, tuple, np.ndarray)):
        raise TypeError(f"slots: expected {expected}, got {_got(slots)}")
    try:
        arr = np.asarray(slots)
    except ValueError:
        raise ValueError(f"slots: expected {expected}, got a ragged sequence") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"slots: expected {expected}, got dtype {arr.dtype.name}")
    if arr.ndim > 1:
        raise ValueError(f"slots: expected {expected}, got shape {arr.shape}")
    arr = arr.reshape(-1).astype(np.int64)  # [n_slots]
    for s in arr:
        if not 0 <= s < spec.batch:
            raise ValueError(f"slots: expected {expected}, got slot {int(s)}")
    if len(np.unique(arr)) != len(arr):
        raise ValueError(f"slots: expected {expected}, got repeated slots {arr.tolist()}")
    return np.sort(arr)
