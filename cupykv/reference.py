"""The NumPy oracle: the executable form of docs/contract.md.

Plain and slow on purpose. All arithmetic is float64; each stored value is
rounded to the storage dtype exactly once (round to nearest even), except in
an fp8 cache, which quantizes as the kernels do (:func:`cupykv.fp8.quantize_e4m3`:
through float32, divided by the head's scale, saturated, rounded to E4M3)
and whose attention reads ``code * scale``. The fast
path never imports this module; tests, notebooks and the demo compare
against it.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._args.cache_args import (
    check_advance,
    check_kv_scale,
    check_capacity_request,
    check_layer,
    check_lengths_shape,
    check_lengths_values,
    check_new_lengths,
    check_pending,
    check_positions,
    check_positions_shape,
    check_q,
    check_q_len,
    check_rope,
    check_rows,
    check_same_shape,
    check_scale,
    check_seq,
    check_set_lengths,
    check_slots,
    check_softcap,
    check_view_layout,
    check_window,
)
from ._args.scalars import check_bool, check_int, got
from ._typing import FloatLike, HostArray, IntLike
from .errors import CacheOverflowError
from .fp8 import dequantize_e4m3, quantize_e4m3
from .ftz import flush_float32_subnormals
from .rope import Rope, rope_angles
from .spec import MASK_VALUE, CacheSpec

__all__ = ["KVCache", "attention", "attention_weights", "CacheSpec", "CacheOverflowError", "Rope", "MASK_VALUE", "FLOAT_DTYPES"]

# Input dtypes the reference accepts for k, v and q.
FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
)


def _rotate(x: npt.NDArray[np.float64], positions: npt.ArrayLike, theta: float) -> npt.NDArray[np.float64]:
    """Half-split rotary embedding in float64.

    x: [..., hd] float64; positions broadcast against x's leading axes
    minus the head axis, e.g. x [n, n_kv, hd] with positions [n, 1].
    """
    half = x.shape[-1] // 2
    angles = rope_angles(positions, x.shape[-1], theta)  # [..., half]
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def round_to_storage(x: npt.NDArray[np.float64], dtype: npt.DTypeLike) -> HostArray:
    """Round float64 ``x`` to ``dtype`` once, to nearest even.

    NumPy rounds float64 to float32/float16 correctly. ml_dtypes goes
    float64 -> float32 -> bfloat16, which can round twice, so for bfloat16
    the first step rounds to odd (truncate, then set the last bit when
    inexact); round-to-odd followed by round-to-nearest-even equals a single
    correct rounding.
    """
    with np.errstate(over="ignore"):  # out of range rounds to inf, as it should
        rounded: HostArray
        if dtype != np.dtype(ml_dtypes.bfloat16):
            rounded = x.astype(dtype)
            return rounded
        x32 = x.astype(np.float32)
        away = np.abs(x32.astype(np.float64)) > np.abs(x)
        x32 = np.where(away, np.nextafter(x32, np.float32(0)), x32)  # truncated toward zero
        bits = x32.view(np.uint32) | (x32.astype(np.float64) != x).astype(np.uint32)
        rounded = bits.view(np.float32).astype(dtype)
        return rounded


class KVCache:
    """Host-memory KV cache implementing the cupykv contract.

    Parameters
    ----------
    spec : CacheSpec
        Shapes, dtype and layout.
    lengths : numpy.ndarray, int32, shape ``[batch]``, optional
        Share this array as the lengths (used in place, not copied): values in
        ``0..max_seq``, C-contiguous and writeable. Overflow flags stay per cache.
    k_scale, v_scale : float or array broadcastable to ``[n_layers, n_kv_heads]``, default 1.0
        The per-head scales of an fp8 cache (1 for any other cache), as for
        :class:`cupykv.KVCache`.

    Attributes
    ----------
    spec : CacheSpec
    k, v : numpy.ndarray, ``spec.np_dtype``, shape ``spec.shape``
        ``[n_layers, batch, max_seq, n_kv_heads, head_dim]`` (NHD) or
        ``[n_layers, batch, n_kv_heads, max_seq, head_dim]`` (HND),
        zero-initialised.
    lengths : numpy.ndarray, int32, shape ``[batch]``
        Committed length of each sequence.
    k_scales, v_scales : numpy.ndarray, float32, shape ``[n_layers, n_kv_heads]``
    overflow : numpy.ndarray, bool, shape ``[batch]``
        Set when a sequence was appended or advanced past ``max_seq``.
    shares_lengths : bool
        ``lengths`` was given to the constructor.

    Raises
    ------
    TypeError
        ``spec`` is not a CacheSpec; ``lengths`` is not a NumPy int32 array.
    ValueError
        ``lengths`` has the wrong shape or a value outside ``0..max_seq``, or is
        strided or read-only.
    """

    def __init__(self, spec: CacheSpec, *, lengths: npt.NDArray[np.int32] | None = None,
                 k_scale: float | npt.ArrayLike = 1.0, v_scale: float | npt.ArrayLike = 1.0) -> None:
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec: expected a cupykv.CacheSpec, got {spec!r} ({type(spec).__name__})")
        self.k_scales = check_kv_scale("k_scale", k_scale, spec)
        self.v_scales = check_kv_scale("v_scale", v_scale, spec)
        if lengths is not None:
            _check_int32_array("lengths", lengths)
            check_lengths_shape("lengths", lengths, spec)
            check_lengths_values("lengths", lengths, spec)
        self.spec = spec
        self.shares_lengths = lengths is not None
        self.k = np.zeros(spec.shape, dtype=spec.np_dtype)
        self.v = np.zeros(spec.shape, dtype=spec.np_dtype)
        self.lengths = np.zeros(spec.batch, dtype=np.int32) if lengths is None else lengths
        self.overflow = np.zeros(spec.batch, dtype=np.bool_)

    def set_scales(self, k_scale: float | npt.ArrayLike | None = None,
                   v_scale: float | npt.ArrayLike | None = None) -> None:
        """Replace the K and/or V scales (``None`` keeps one); stored codes are kept, as :meth:`cupykv.KVCache.set_scales`."""
        new_k = None if k_scale is None else check_kv_scale("k_scale", k_scale, self.spec)
        new_v = None if v_scale is None else check_kv_scale("v_scale", v_scale, self.spec)
        if new_k is not None:
            self.k_scales = new_k
        if new_v is not None:
            self.v_scales = new_v

    def _values(self, array: HostArray, layer: int, b: int) -> npt.NDArray[np.float64]:
        """The values one sequence of ``array`` (k or v) of ``layer`` stands for, float64 ``[max_seq, n_kv, hd]``."""
        stored = self._sequence(array, layer, b)
        if not self.spec.quantized:
            return stored.astype(np.float64)
        scales = (self.k_scales if array is self.k else self.v_scales)[layer]   # [n_kv]
        return dequantize_e4m3(stored, scales[:, None])

    def _rounded(self, x: npt.NDArray[np.float64], scales: npt.NDArray[np.float32]) -> HostArray:
        """float64 rows ``[n, n_kv, hd]`` as stored: rounded once, or quantized with ``scales`` ``[n_kv]``."""
        if self.spec.quantized:
            return quantize_e4m3(x, scales[:, None])
        return round_to_storage(x, self.spec.np_dtype)

    def _sequence(self, array: HostArray, layer: int, b: int) -> HostArray:
        """View of one sequence of one layer of ``array`` (k or v): [max_seq, n_kv, hd].

        The only place that knows the layout; reads and writes go through it.
        """
        seq: HostArray = array[layer, b]  # NHD: [max_seq, n_kv, hd]; HND: [n_kv, max_seq, hd]
        return seq if self.spec.layout == "NHD" else seq.swapaxes(0, 1)

    def append(self, layer: IntLike, k: HostArray, v: HostArray, rope: Rope | None = None, *,
               return_positions: bool = False, positions_out: npt.NDArray[np.int32] | None = None,
               run_if: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.int32] | None:
        """Write pending rows at ``lengths[b] + i``; ``lengths`` does not change.

        Parameters
        ----------
        layer : int
            Layer index in ``0..n_layers - 1``.
        k, v : numpy.ndarray, shape ``[batch, n_new, n_kv_heads, head_dim]``
            New rows, ``n_new >= 1``; float16, float32, float64 or bfloat16.
            Used as their float64 values and rounded once to the storage dtype.
        rope : Rope, optional
            Rotate each key row at its position before rounding, as the kernels do
            under CuPy's ``-ftz=true``: a key element whose float32 value is
            subnormal is read as a zero of its sign, and a rotated element that is
            below float32's smallest normal after rounding is stored as one
            (:mod:`cupykv.ftz`).
        return_positions : bool, default False
            Return where each row went.
        positions_out : numpy.ndarray, int32, shape ``[batch, n_new]``, optional
            Written with those positions and returned (implies ``return_positions``).
        run_if : numpy.ndarray, int32, shape ``[1]``, optional
            The gate: where ``run_if[0]`` is 0 the call changes nothing (no row,
            flag or ``positions_out`` is written), as the fast path's gated-off
            launch; ``None`` or any other value appends. It may not share
            memory with ``positions_out`` or the cache's arrays.

        Returns
        -------
        None, or numpy.ndarray int32 ``[batch, n_new]``
            ``lengths[b] + i`` where row ``i`` of sequence ``b`` was written, ``-1`` where it overflowed.
            With ``run_if`` holding 0, ``positions_out`` as it was (all ``-1``
            when the call made it: no row was written).

        Notes
        -----
        A row at position ``>= max_seq`` is not written and sets
        ``overflow[b]``; earlier rows of the same call are still written.

        Raises
        ------
        TypeError, ValueError
            Bad arguments; the cache is left unchanged.
        """
        spec = self.spec
        layer, n_new, rope = self._rows_args(layer, k, v, rope)
        out = self._positions_out(return_positions, positions_out, n_new, (spec.batch, n_new))
        if self._gated_off(run_if, out):
            return out
        positions = self.lengths.astype(np.int64)[:, None] + np.arange(n_new)  # [batch, n_new]
        self._store(layer, positions, k, v, rope, out)
        return out

    def write(self, layer: IntLike, positions: npt.ArrayLike, k: HostArray, v: HostArray,
              rope: Rope | None = None, *, return_positions: bool = False,
              positions_out: npt.NDArray[np.int32] | None = None,
              run_if: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.int32] | None:
        """Write rows at given positions: row ``i`` of sequence ``b`` at ``positions[b, i]``; ``lengths`` unchanged.

        Parameters
        ----------
        layer : int
            Layer index in ``0..n_layers - 1``.
        positions : array_like of int, shape ``[batch, n_new]`` (``[batch]`` when ``n_new`` is 1)
            Kernel ints; positions outside ``0..max_seq-1`` are not written and
            set ``overflow[b]``. Two rows of one sequence at one position in
            range are refused.
        k, v, rope, return_positions, positions_out, run_if
            As for :meth:`append`; ``positions_out`` has the shape of ``positions``.

        Returns
        -------
        None, or numpy.ndarray int32 of the shape of ``positions``
            The position of each written row, ``-1`` where a row was not written
            (every row, with ``run_if`` holding 0: ``positions_out`` as it was).

        Raises
        ------
        TypeError, ValueError
            Bad arguments; the cache is left unchanged.
        """
        layer, n_new, rope = self._rows_args(layer, k, v, rope)
        values = check_positions(positions, self.spec, n_new)  # int64 [batch, n_new]
        out = self._positions_out(return_positions, positions_out, n_new, np.shape(positions))
        if self._gated_off(run_if, out):
            return out
        self._store(layer, values, k, v, rope, out)
        return out

    def _rows_args(self, layer: object, k: object, v: object, rope: object) -> tuple[int, int, Rope | None]:
        """Checked ``(layer, n_new, rope)`` of append and write."""
        spec = self.spec
        layer = check_layer(layer, spec)
        n_new = check_rows("k", k, spec, dtypes=FLOAT_DTYPES)
        check_rows("v", v, spec, dtypes=FLOAT_DTYPES)
        check_same_shape("k", k, "v", v)
        return layer, n_new, check_rope(rope, spec)

    def _positions_out(self, return_positions: object, positions_out: npt.NDArray[np.int32] | None, n_new: int,
                       shape: tuple[int, ...]) -> npt.NDArray[np.int32] | None:
        """``positions_out`` checked, a new int32 array of ``shape`` when asked for, or None."""
        return_positions = check_bool("return_positions", return_positions)
        if positions_out is None:
            return np.full(shape, -1, np.int32) if return_positions else None
        _check_int32_array("positions_out", positions_out)
        check_positions_shape("positions_out", positions_out, self.spec, n_new)
        return positions_out

    def _gated_off(self, run_if: object, out: npt.NDArray[np.int32] | None) -> bool:
        """Whether ``run_if`` (``None`` or a NumPy int32 ``[1]``, checked here) holds 0: the call then changes nothing."""
        if run_if is None:
            return False
        if not isinstance(run_if, np.ndarray) or run_if.dtype != np.int32:
            what = f"{type(run_if).__name__} of dtype {run_if.dtype}" if isinstance(run_if, np.ndarray) else got(run_if)
            raise TypeError(f"run_if: expected a numpy int32 array, got {what}")
        if run_if.shape != (1,):
            raise ValueError(f"run_if: expected shape (1,), got {run_if.shape}")
        for what, array in (("positions_out", out), ("the cache's k", self.k), ("the cache's v", self.v),
                            ("the cache's lengths", self.lengths), ("the cache's overflow flags", self.overflow)):
            if array is not None and np.shares_memory(run_if, array):
                raise ValueError(f"run_if: expected an array that does not overlap {what}, got one that shares "
                                 f"memory with it")
        return int(run_if[0]) == 0

    def _store(self, layer: int, positions: npt.NDArray[np.int64], k: npt.ArrayLike, v: npt.ArrayLike,
               rope: Rope | None, out: npt.NDArray[np.int32] | None) -> None:
        """Round and store row ``i`` of sequence ``b`` at ``positions[b, i]`` (int64 ``[batch, n_new]``) if in range."""
        spec = self.spec
        k64 = np.asarray(k).astype(np.float64)  # [batch, n_new, n_kv, hd]
        v64 = np.asarray(v).astype(np.float64)
        written = np.full(positions.shape, -1, dtype=np.int32)  # [batch, n_new]
        for b in range(spec.batch):   # the positions of one sequence are distinct (checked by the callers)
            fits = (positions[b] >= 0) & (positions[b] < spec.max_seq)  # [n_new]
            if not fits.all():
                self.overflow[b] = True
            where = positions[b, fits]  # [n_fit]
            keys = k64[b, fits]  # [n_fit, n_kv, hd]
            if rope is not None:   # the kernels widen to double and narrow back to float32 with -ftz
                keys = flush_float32_subnormals(_rotate(flush_float32_subnormals(keys), where[:, None], rope.theta))
            self._sequence(self.k, layer, b)[where] = self._rounded(keys, self.k_scales[layer])
            self._sequence(self.v, layer, b)[where] = self._rounded(v64[b, fits], self.v_scales[layer])
            written[b, fits] = where
        if out is not None:
            out.reshape(-1)[:] = written.reshape(-1)

    def advance(self, n: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]]) -> None:
        """Commit ``n`` pending rows: ``lengths += n``, clamped to ``max_seq``.

        Parameters
        ----------
        n : int or array_like of int, shape ``[batch]``
            Each in ``0..2**31-1`` (the kernels' int). A length that would
            exceed ``max_seq`` is clamped and sets that sequence's overflow flag.

        Raises
        ------
        TypeError, ValueError
            Bad ``n``; the cache is left unchanged.
        """
        n = check_advance(n, self.spec)  # int64 [batch]
        total = self.lengths.astype(np.int64) + n
        self.overflow |= total > self.spec.max_seq
        self.lengths[:] = np.minimum(total, self.spec.max_seq)

    def truncate(self, new_lengths: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]]) -> None:
        """Shorten sequences (speculative-decoding rollback).

        Parameters
        ----------
        new_lengths : int or array_like of int, shape ``[batch]``
            Each ``0 <= new_lengths[b] <= lengths[b]``. Stored rows are kept
            but are no longer live. Overflow flags are not touched.

        Raises
        ------
        TypeError, ValueError
            Bad ``new_lengths`` (including any that would lengthen); the
            cache is left unchanged.
        """
        self.lengths[:] = check_new_lengths(new_lengths, self.lengths, self.spec)

    def set_lengths(self, new_lengths: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]]) -> None:
        """Set the lengths, growing or shrinking them; values past ``max_seq`` are clamped and flagged.

        Parameters
        ----------
        new_lengths : int or array_like of int, shape ``[batch]``
            Each in ``0..2**31-1`` (the kernels' int).

        Raises
        ------
        TypeError, ValueError
            Bad ``new_lengths``; the cache is left unchanged.
        """
        values = check_set_lengths(new_lengths, self.spec)  # int64 [batch]
        self.overflow |= values > self.spec.max_seq
        self.lengths[:] = np.minimum(values, self.spec.max_seq)

    def reset(self, slots: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]] | None = None) -> None:
        """Set ``lengths[slots] = 0`` and clear their overflow flags.

        Parameters
        ----------
        slots : None, int or sequence of int
            Distinct slot indices in ``0..batch - 1``; ``None`` means all.
            Stored rows are not cleared.

        Raises
        ------
        TypeError, ValueError
            Bad ``slots``; the cache is left unchanged.
        """
        slots = check_slots(slots, self.spec)
        self.lengths[slots] = 0
        self.overflow[slots] = False

    def additive_mask(self, q_len: IntLike = 1) -> npt.NDArray[np.float32]:
        """Additive attention mask for ``q_len`` queries per sequence.

        Parameters
        ----------
        q_len : int, default 1
            Queries per sequence (``1..2**30-1``); query ``i`` sits at ``lengths[b] + i``.

        Returns
        -------
        numpy.ndarray, float32, shape ``[batch, 1, q_len, max_seq]``
            ``0.0`` where ``j <= lengths[b] + i``, ``MASK_VALUE`` elsewhere.
        """
        q_len = check_q_len(q_len)
        last = self.lengths.astype(np.int64)[:, None] + np.arange(q_len)  # [batch, q_len]
        visible = np.arange(self.spec.max_seq) <= last[..., None]  # [batch, q_len, max_seq]
        mask = np.where(visible, 0.0, MASK_VALUE).astype(np.float32)
        return mask[:, None]

    def check(self) -> None:
        """Raise if any sequence overflowed; the flags are not cleared.

        Raises
        ------
        CacheOverflowError
            Names the overflowed sequences.
        """
        bad = np.flatnonzero(self.overflow).tolist()
        if bad:
            raise CacheOverflowError.for_sequences(bad, self.spec.max_seq)

    def layer(self, layer: IntLike, layout: str | None = None) -> tuple[HostArray, HostArray]:
        """Full-capacity ``(k, v)`` views of one layer, in the cache's layout or the one asked for.

        Returns ``[batch, max_seq, n_kv_heads, head_dim]`` (NHD) or
        ``[batch, n_kv_heads, max_seq, head_dim]`` (HND) views of ``k`` and ``v``.
        """
        layer = check_layer(layer, self.spec)
        layout = check_view_layout(layout, self.spec)
        k, v = self.k[layer], self.v[layer]
        return (k, v) if layout == self.spec.layout else (k.swapaxes(1, 2), v.swapaxes(1, 2))

    def live(self, layer: IntLike, seq: IntLike | None = None, *, pending: IntLike = 0,
             layout: str | None = None) -> tuple[HostArray, HostArray]:
        """Views of the first ``min(lengths[seq] + pending, max_seq)`` rows of one sequence of one layer.

        Returns ``[n, n_kv_heads, head_dim]`` (NHD) or ``[n_kv_heads, n, head_dim]``
        (HND) views; ``seq`` may be ``None`` for a cache of batch 1.
        """
        spec = self.spec
        layer = check_layer(layer, spec)
        seq = check_seq(seq, spec)
        pending = check_pending(pending)
        layout = check_view_layout(layout, spec)
        n = min(int(self.lengths[seq]) + pending, spec.max_seq)
        k, v = self.layer(layer, layout)
        rows = (seq, slice(0, n)) if layout == "NHD" else (seq, slice(None), slice(0, n))
        return k[rows], v[rows]

    def remaining_capacity(self) -> npt.NDArray[np.int64]:
        """Positions left per sequence, ``max_seq - lengths``, int64 ``[batch]``."""
        return self.spec.max_seq - self.lengths.astype(np.int64)

    def has_capacity(self, n: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]] = 1) -> npt.NDArray[np.bool_]:
        """Whether ``lengths + n <= max_seq``, bool ``[batch]``; ``n`` an int or ints ``[batch]`` in ``0..2**31-1``."""
        return self.remaining_capacity() >= check_capacity_request(n, self.spec)

    @property
    def nbytes(self) -> int:
        """Bytes of ``k``, ``v``, the scales, the overflow flags and, unless shared, the lengths."""
        own = [self.k, self.v, self.k_scales, self.v_scales, self.overflow] + \
            ([] if self.shares_lengths else [self.lengths])
        return int(sum(a.nbytes for a in own))

    def __repr__(self) -> str:
        spec = self.spec
        shared = ", shared lengths" if self.shares_lengths else ""
        return (f"reference.KVCache(shape={spec.shape}, dtype={spec.dtype}, layout={spec.layout}, "
                f"{self.nbytes / 2**20:.3g} MiB{shared})")

    def copy(self) -> KVCache:
        """Deep copy: a new KVCache with the same spec and copied arrays (the lengths are not shared)."""
        other = KVCache(self.spec, k_scale=self.k_scales, v_scale=self.v_scales)
        for name in ("k", "v", "lengths", "overflow"):
            getattr(other, name)[...] = getattr(self, name)
        return other

    def rows(self, layer: IntLike, b: IntLike) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Live rows of sequence ``b`` of ``layer`` as float64 (the values they stand for: ``code * scale`` when fp8).

        Parameters
        ----------
        layer : int
            Layer index.
        b : int
            Sequence index in ``0..batch - 1``.

        Returns
        -------
        (k, v) : tuple of numpy.ndarray, float64, shape ``[lengths[b], n_kv_heads, head_dim]``
        """
        index = check_layer(layer, self.spec)
        b = check_int("b", b, 0, self.spec.batch - 1)
        length = int(self.lengths[b])
        k, v = (self._values(arr, index, b)[:length] for arr in (self.k, self.v))
        return k, v


def _check_int32_array(name: str, array: object) -> None:
    """TypeError unless ``array`` is a NumPy int32 array; ValueError unless it is C-contiguous and writeable."""
    if not isinstance(array, np.ndarray) or array.dtype != np.int32:
        what = f"{type(array).__name__} of dtype {array.dtype}" if isinstance(array, np.ndarray) else got(array)
        raise TypeError(f"{name}: expected a numpy int32 array, got {what}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"{name}: expected a C-contiguous, writeable array, got strides {array.strides} "
                         f"(writeable={array.flags.writeable})")


def attention(q: HostArray, cache: KVCache, layer: IntLike, scale: FloatLike | None = None,
              window: IntLike | None = None, softcap: FloatLike | None = None,
              rope: Rope | None = None) -> npt.NDArray[np.float64]:
    """Exact attention of ``q`` over one layer of ``cache``, in float64.

    Parameters
    ----------
    q : numpy.ndarray, shape ``[batch, q_len, n_heads, head_dim]``
        Queries (float16, float32, float64 or bfloat16), ``q_len >= 1``,
        ``n_heads`` a multiple of ``n_kv_heads``. Query ``i`` of sequence
        ``b`` sits at ``p = lengths[b] + i`` (pending rows count as present).
    cache : KVCache
    layer : int
        Layer index.
    scale : float, optional
        Logit scale, a normal float32 > 0 (as the kernels receive it); default
        ``1 / sqrt(head_dim)``.
    window : int, optional
        Sliding window (``1..2**31-1``): attend only to ``j > p - window``.
    softcap : float, optional
        Logit soft cap, a normal float32 in ``(0, 2**64]``: ``s = softcap * tanh(s / softcap)``.
    rope : Rope, optional
        Rotate each query at its position ``p`` first.

    Returns
    -------
    numpy.ndarray, float64, shape ``[batch, q_len, n_heads, head_dim]``
        Softmax-weighted sum of values over positions ``j <= p``,
        ``j < max_seq`` (and inside the window). Zeros for a query with no
        such position. Head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments.
    """
    layer, scale, window, softcap, rope = _attention_arguments(q, cache, layer, scale, window, softcap, rope)
    spec = cache.spec
    n_heads = q.shape[2]
    kv_head = np.arange(n_heads) // (n_heads // spec.n_kv_heads)  # [n_heads]
    out = np.zeros((spec.batch, q.shape[1], n_heads, spec.head_dim))
    for b, i, first, last, weights in _attended(q, cache, layer, scale, window, softcap, rope):
        values = cache._values(cache.v, layer, b)[first : last + 1, kv_head]
        out[b, i] = np.einsum("hj,jhd->hd", weights, values)   # unattended rows are never read
    return out


def attention_weights(q: HostArray, cache: KVCache, layer: IntLike, scale: FloatLike | None = None,
                      window: IntLike | None = None, softcap: FloatLike | None = None,
                      rope: Rope | None = None) -> npt.NDArray[np.float64]:
    """The softmax weights of :func:`attention`, in float64: which positions each query reads, and how much.

    Same parameters as :func:`attention`.

    Returns
    -------
    numpy.ndarray, float64, shape ``[batch, q_len, n_heads, max_seq]``
        Each query's weights over the cache positions; 0 at positions it does
        not attend to. A row sums to 1, or is all zeros when nothing is attended.
    """
    layer, scale, window, softcap, rope = _attention_arguments(q, cache, layer, scale, window, softcap, rope)
    spec = cache.spec
    out = np.zeros((spec.batch, q.shape[1], q.shape[2], spec.max_seq))
    for b, i, first, last, weights in _attended(q, cache, layer, scale, window, softcap, rope):
        out[b, i, :, first : last + 1] = weights
    return out


def _attention_arguments(q: object, cache: object, layer: object, scale: object, window: object, softcap: object,
                         rope: object) -> tuple[int, float, int | None, float | None, Rope | None]:
    """The checked ``(layer, scale, window, softcap, rope)`` of an attention call (raises on bad ones)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a cupykv.reference.KVCache, got {type(cache).__name__}")
    spec = cache.spec
    layer = check_layer(layer, spec)
    check_q(q, spec, dtypes=FLOAT_DTYPES)
    return (layer, check_scale(scale, spec), check_window(window), check_softcap(softcap), check_rope(rope, spec))


def _attended(q: HostArray, cache: KVCache, layer: int, scale: float, window: int | None, softcap: float | None,
              rope: Rope | None) -> Iterator[tuple[int, int, int, int, npt.NDArray[np.float64]]]:
    """For every query with something to attend to: ``(b, i, first, last, weights [n_heads, last - first + 1])``.

    Query ``i`` of sequence ``b`` sits at ``p = lengths[b] + i`` and attends to
    positions ``first..last``: ``j <= p``, ``j < max_seq``, inside the window.
    """
    spec = cache.spec
    n_heads = q.shape[2]
    kv_head = np.arange(n_heads) // (n_heads // spec.n_kv_heads)  # [n_heads]
    q64 = np.asarray(q).astype(np.float64)
    for b in range(spec.batch):
        keys = cache._values(cache.k, layer, b)[:, kv_head]  # [max_seq, n_heads, hd]
        for i in range(q.shape[1]):
            p = int(cache.lengths[b]) + i
            first = 0 if window is None else max(0, p - window + 1)
            last = min(p, spec.max_seq - 1)
            if first > last:
                continue  # nothing to attend to
            query = q64[b, i]  # [n_heads, hd]
            if rope is not None:
                query = _rotate(query, p, rope.theta)
            logits = scale * np.einsum("hd,jhd->hj", query, keys[first : last + 1])
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            yield b, i, first, last, weights / weights.sum(axis=1, keepdims=True)
