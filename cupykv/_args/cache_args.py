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
from typing import TYPE_CHECKING, Any, Protocol, Sequence, cast

import numpy as np
import numpy.typing as npt

from cupykv._args.limits import INT32_MAX, MAX_NEW
from cupykv._args.scalars import check_int, check_int32, check_positive_float32, got, int_range, is_int
from cupykv.errors import shown
from cupykv.rope import Rope
from cupykv.rope import check_rope_theta as check_rope_theta   # re-exported: Rope owns it

if TYPE_CHECKING:
    from cupykv.backends.base import Backend
    from cupykv.spec import CacheSpec

SOFTCAP_MAX = 2.0**64
Int64Array = npt.NDArray[np.int64]


class Shaped(Protocol):
    """What the checks here read of an array, NumPy's or CuPy's: its shape, dtype and rank."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def ndim(self) -> int: ...


def _check_array(name: str, arr: object, what: str) -> Shaped:
    """``arr``, once it has the shape, dtype and rank of an array (TypeError otherwise)."""
    if not all(hasattr(arr, attr) for attr in ("shape", "dtype", "ndim")):
        raise TypeError(f"{name}: expected an array {what}, got {got(arr)}")
    return cast(Shaped, arr)


def _check_dtype(name: str, arr: Shaped, dtypes: Sequence[npt.DTypeLike] | None) -> None:
    if dtypes is not None and np.dtype(arr.dtype) not in dtypes:
        allowed = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected dtype one of ({allowed}), got {np.dtype(arr.dtype).name}")


def check_layer(layer: object, spec: CacheSpec) -> int:
    """Return ``layer`` as an int in ``0..spec.n_layers - 1``."""
    return check_int("layer", layer, 0, spec.n_layers - 1)


def check_rows(name: str, arr: object, spec: CacheSpec, dtypes: Sequence[npt.DTypeLike] | None = None) -> int:
    """Check new K or V rows ``[batch, n_new, n_kv_heads, head_dim]``; return ``n_new`` (1..MAX_NEW).

    ``dtypes``, when given, is the tuple of accepted dtypes (the caller's policy).
    """
    axes = "[batch, n_new, n_kv_heads, head_dim]"
    arr = _check_array(name, arr, axes)
    _check_dtype(name, arr, dtypes)
    shape = tuple(arr.shape)
    n_new: int | str = shape[1] if arr.ndim == 4 and 1 <= shape[1] <= MAX_NEW else f"n_new in 1..{MAX_NEW}"
    expected = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    if shape != expected:
        shown_shape = "(" + ", ".join(str(s) for s in expected) + ")"
        raise ValueError(f"{name}: expected shape {shown_shape} {axes}, got {shape}")
    return shape[1]


def check_same_shape(name_a: str, a: object, name_b: str, b: object) -> None:
    """Check that array ``b`` has the shape of array ``a``."""
    a, b = _check_array(name_a, a, "[...]"), _check_array(name_b, b, "[...]")
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_b}: expected the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}")


def check_q(q: object, spec: CacheSpec, dtypes: Sequence[npt.DTypeLike] | None = None) -> tuple[int, int]:
    """Check queries ``[batch, q_len, n_heads, head_dim]``; return ``(q_len, n_heads)``.

    ``q_len`` in ``1..MAX_NEW``; ``n_heads`` a positive multiple of ``n_kv_heads``;
    ``batch * q_len * n_heads`` (the query rows, a kernel ``int``) at most ``INT32_MAX``.
    """
    axes = "[batch, q_len, n_heads, head_dim]"
    q = _check_array("q", q, axes)
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
        q_len: int | str = shape[1] if q.ndim == 4 and 1 <= shape[1] <= MAX_NEW else f"q_len in 1..{MAX_NEW}"
        raise ValueError(
            f"q: expected shape ({spec.batch}, {q_len}, n_heads, {spec.head_dim}) {axes} "
            f"with n_heads a multiple of n_kv_heads={spec.n_kv_heads}, got {shape}"
        )
    if math.prod(shape[:3]) > INT32_MAX:
        raise ValueError(f"q: expected batch * q_len * n_heads <= {INT32_MAX} query rows, got "
                         f"{shape[0]} * {shape[1]} * {shape[2]} = {math.prod(shape[:3])}")
    return shape[1], shape[2]


def check_scale(scale: object, spec: CacheSpec) -> float:
    """Return the logit scale: ``1/sqrt(head_dim)`` for ``None``, else a normal float32 > 0."""
    if scale is None:
        return 1.0 / math.sqrt(spec.head_dim)
    return check_positive_float32("scale", scale)


def check_window(window: object) -> int | None:
    """Return ``None`` or the sliding-window size as an int in ``1..INT32_MAX``."""
    return None if window is None else check_int32("window", window, lo=1)


def check_softcap(softcap: object) -> float | None:
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


def check_rope(rope: object, spec: CacheSpec) -> Rope | None:
    """Return ``None`` or a ``Rope``; rope needs an even ``head_dim``."""
    if rope is None:
        return None
    if not isinstance(rope, Rope):
        raise TypeError(f"rope: expected None or a cupykv.Rope, got {got(rope)}")
    if spec.head_dim % 2:
        raise ValueError(f"rope: expected a cache with an even head_dim, got head_dim={spec.head_dim}")
    return rope


def check_q_len(q_len: object) -> int:
    """Return ``q_len`` as an int in ``1..MAX_NEW``."""
    return check_int("q_len", q_len, 1, MAX_NEW)


def _host_sequence(name: str, value: object, spec: CacheSpec, expected: str) -> list[int]:
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


def _per_sequence(name: str, value: object, spec: CacheSpec, lo: int, hi: int) -> Int64Array:
    """Check a per-sequence int argument; return int64 NumPy ``[batch]`` with every value in ``lo..hi``."""
    if is_int(value):
        return np.full(spec.batch, check_int(name, value, lo, hi), dtype=np.int64)
    values = _host_sequence(name, value, spec, f"{int_range(lo, hi)} or {spec.batch} such ints [batch]")
    for b, v in enumerate(values):
        if not lo <= v <= hi:
            raise ValueError(f"{name}: expected ints in {lo}..{hi}, got {name}[{b}] = {shown(v)}")
    return np.array(values, dtype=np.int64)


def check_advance(n: object, spec: CacheSpec) -> Int64Array:
    """Check ``advance``'s ``n``: an int or ints ``[batch]``, each in ``0..INT32_MAX`` (the kernel's ``int``).

    Returns int64 NumPy ``[batch]``.
    """
    return _per_sequence("n", n, spec, 0, INT32_MAX)


def check_new_lengths(new_lengths: object, current_lengths: npt.ArrayLike, spec: CacheSpec) -> Int64Array:
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


def check_slots(slots: object, spec: CacheSpec) -> Int64Array:
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


# -- shared lengths, write, set_lengths, views, capacity (issue 19) ---------------------------------------
def check_lengths_values(name: str, values: npt.ArrayLike, spec: CacheSpec) -> Int64Array:
    """Check the values of a lengths array handed to a cache (host ``[batch]``): each in ``0..max_seq``.

    Returns them as int64 NumPy ``[batch]``.
    """
    values = np.asarray(values)
    for b, v in enumerate(values.tolist()):
        if not 0 <= v <= spec.max_seq:
            raise ValueError(f"{name}: expected lengths in 0..{spec.max_seq} (max_seq), got {name}[{b}] = {shown(v)}")
    return values.astype(np.int64)


def check_lengths_shape(name: str, arr: object, spec: CacheSpec) -> None:
    """Check the shape of a lengths array ``[batch]`` handed to a cache (its dtype is the caller's business)."""
    arr = _check_array(name, arr, "[batch]")
    if tuple(arr.shape) != (spec.batch,):
        raise ValueError(f"{name}: expected shape ({spec.batch},) [batch], got {tuple(arr.shape)}")


def positions_shapes(spec: CacheSpec, n_new: int) -> tuple[tuple[int, ...], ...]:
    """The shapes ``write`` accepts for ``positions``: ``[batch, n_new]``, and ``[batch]`` when ``n_new`` is 1."""
    return ((spec.batch, n_new), (spec.batch,)) if n_new == 1 else ((spec.batch, n_new),)


def check_positions_shape(name: str, arr: Shaped, spec: CacheSpec, n_new: int) -> None:
    """Check the shape of ``write``'s ``positions`` (or of a ``positions_out``) against ``n_new`` rows."""
    shapes = positions_shapes(spec, n_new)
    if tuple(arr.shape) not in shapes:
        wanted = f"({spec.batch}, {n_new}) [batch, n_new] (n_new from k)"
        if len(shapes) == 2 and name == "positions":
            wanted += f" or ({spec.batch},) [batch] (one row per sequence)"
        raise ValueError(f"{name}: expected shape {wanted}, got {tuple(arr.shape)}")


def check_positions(positions: object, spec: CacheSpec, n_new: int) -> Int64Array:
    """Check host ``positions`` of ``write``; return them as int64 NumPy ``[batch, n_new]``.

    ``positions`` is a NumPy int array or nested lists of ints ``[batch, n_new]``
    (``[batch]`` when ``n_new`` is 1). Each value must fit the kernel's int;
    values outside ``0..max_seq-1`` are allowed (those rows overflow). Two
    rows of one sequence at one position inside ``0..max_seq-1`` are refused:
    the later would silently replace the earlier.
    """
    expected = f"a device int32 array or host ints of shape ({spec.batch}, {n_new}) [batch, n_new]"
    if not isinstance(positions, (list, tuple, np.ndarray)):
        raise TypeError(f"positions: expected {expected}, got {got(positions)}")
    try:
        arr = np.asarray(positions) if isinstance(positions, np.ndarray) else np.array(positions, dtype=object)
    except (ValueError, OverflowError):
        raise ValueError(f"positions: expected {expected}, got a ragged sequence") from None
    check_positions_shape("positions", arr, spec, n_new)
    values = arr.reshape(spec.batch, n_new).tolist()
    flat = [v for row in values for v in row]
    if arr.dtype.kind not in "iu" and not all(is_int(v) for v in flat):
        bad = next(v for v in flat if not is_int(v))
        raise TypeError(f"positions: expected ints, got {got(bad)}")
    for b, row in enumerate(values):
        seen: dict[int, int] = {}
        for i, p in enumerate(row):
            p = int(p)
            if not -INT32_MAX - 1 <= p <= INT32_MAX:
                raise ValueError(f"positions: expected ints in {-INT32_MAX - 1}..{INT32_MAX} (the kernel's int), "
                                 f"got positions[{b}, {i}] = {shown(p)}")
            if 0 <= p < spec.max_seq and p in seen:
                raise ValueError(f"positions: expected distinct positions within a sequence, got "
                                 f"positions[{b}, {seen[p]}] = positions[{b}, {i}] = {p}")
            seen[p] = i
    return np.array(values, dtype=np.int64).reshape(spec.batch, n_new)


def check_set_lengths(new_lengths: object, spec: CacheSpec) -> Int64Array:
    """Check ``set_lengths``'s host values: an int or ints ``[batch]``, each in ``0..INT32_MAX``.

    Values past ``max_seq`` are allowed (clamped and flagged). Returns int64 NumPy ``[batch]``.
    """
    return _per_sequence("new_lengths", new_lengths, spec, 0, INT32_MAX)


def check_capacity_request(n: object, spec: CacheSpec) -> Int64Array:
    """Check ``has_capacity``'s ``n``: an int or ints ``[batch]``, each in ``0..INT32_MAX``. Returns int64 ``[batch]``."""
    return _per_sequence("n", n, spec, 0, INT32_MAX)


def check_view_layout(layout: object, spec: CacheSpec) -> str:
    """Return the layout a view is asked for: the cache's for ``None``, else ``"NHD"`` or ``"HND"``."""
    if layout is None:
        return spec.layout
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected None, 'NHD' or 'HND', got {got(layout)}")
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout: expected None, 'NHD' or 'HND', got {shown(layout)}")
    return layout


def check_seq(seq: object, spec: CacheSpec) -> int:
    """Return the sequence index of a one-sequence view: ``seq`` in ``0..batch-1``; ``None`` only when batch is 1."""
    if seq is None:
        if spec.batch != 1:
            raise ValueError(f"seq: expected an int in 0..{spec.batch - 1} (the cache holds {spec.batch} "
                             f"sequences; None only for batch 1), got None")
        return 0
    return check_int("seq", seq, 0, spec.batch - 1)


def check_pending(pending: object) -> int:
    """Return the pending rows a view includes: an int in ``0..MAX_NEW``."""
    return check_int("pending", pending, 0, MAX_NEW)


def check_kv_scale(name: str, value: object, spec: CacheSpec,
                   backend: Backend | None = None) -> npt.NDArray[np.float32]:
    """The K or V scales of a cache as float32 ``[n_layers, n_kv_heads]``.

    ``value`` is a float or a host array broadcastable to ``[n_layers, n_kv_heads]``,
    every element a normal float32 > 0 (the kernels divide by it); a cache that
    is not fp8 stores values unscaled, so its scales must be 1. ``backend``, when
    given, refuses its own device arrays too (the emulator's are NumPy arrays, which
    the host could read where a GPU's host could not).
    """
    expected = f"a float or an array broadcastable to [n_layers, n_kv_heads] = ({spec.n_layers}, {spec.n_kv_heads})"
    on_device = (hasattr(value, "__cuda_array_interface__") or (backend is not None and backend.is_device_array(value))
                 or hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray))
    if isinstance(value, (bool, np.bool_)) or on_device:
        raise TypeError(f"{name}: expected {expected} on the host, got {got(value)}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected {expected}, got {got(value)}") from None
    if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
        raise TypeError(f"{name}: expected {expected} of real numbers, got dtype {array.dtype}")
    try:
        shaped = np.broadcast_to(array.astype(np.float64), (spec.n_layers, spec.n_kv_heads))
    except ValueError:
        raise ValueError(f"{name}: expected {expected}, got shape {array.shape}") from None
    with np.errstate(over="ignore", under="ignore"):
        scales = shaped.astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    bad = ~(np.isfinite(scales) & (scales >= tiny))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: expected every scale finite, > 0 and normal in float32 (stores divide by it), "
                         f"got {float(shaped[where])!r} at [layer, kv_head] = {where}")
    if not spec.quantized and (scales != 1).any():
        where = tuple(int(i) for i in np.argwhere(scales != 1)[0])
        raise ValueError(f"{name}: expected 1.0 for a {spec.dtype} cache (only dtype='float8_e4m3' stores values "
                         f"scaled), got {float(shaped[where])!r} at [layer, kv_head] = {where}")
    return np.ascontiguousarray(scales)
