"""KVCache: the device-resident cache, its lengths, and the ops that change them.

Every length-dependent value lives in device memory (``lengths``,
``overflow``) and is read by the kernels at run time, so a captured decode
step stays valid as sequences grow, roll back or restart. Host work (argument
checks, launch geometry, allocation) happens before any launch.
"""
from __future__ import annotations

import numpy as np

from cupykv import _checks
from cupykv._inputs import device_input
from cupykv.backends import get_backend
from cupykv.errors import CacheOverflowError
from cupykv.kernels import CUDA_TYPES
from cupykv.spec import MASK_VALUE, CacheSpec

_APPEND_THREADS = 128
_SMALL_THREADS = 256   # advance / truncate / reset / additive_mask


def _blocks(n: int, threads: int) -> int:
    return max(1, (n + threads - 1) // threads)


class KVCache:
    """A static-capacity K/V cache on a backend (CuPy on a GPU, or the CPU emulator).

    Parameters
    ----------
    spec : CacheSpec
        Shapes, dtype and layout.
    backend : {"cupy", "emulator"} or None
        ``None`` picks CuPy when a CUDA device is usable, else the emulator;
        the ``CUPYKV_BACKEND`` environment variable overrides the choice.

    Attributes
    ----------
    k, v : device array ``spec.shape``
        ``[n_layers, batch, max_seq, n_kv_heads, head_dim]`` (NHD) or
        ``[n_layers, batch, n_kv_heads, max_seq, head_dim]`` (HND), in the
        storage dtype (bfloat16 is uint16 bit patterns on CuPy).
    lengths : device int32 ``[batch]``
        Committed length of each sequence.
    overflow : device int32 ``[batch]``
        1 where a write or advance went past ``max_seq``; see :meth:`check`.
    """

    def __init__(self, spec: CacheSpec, backend=None):
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec: expected a cupykv.CacheSpec, got {type(spec).__name__}")
        self.spec = spec
        self._backend = get_backend(backend)
        storage = self._backend.storage_dtype(spec.dtype)
        self.k = self._backend.zeros(spec.shape, storage)
        self.v = self._backend.zeros(spec.shape, storage)
        self.lengths = self._backend.zeros((spec.batch,), np.int32)
        self.overflow = self._backend.zeros((spec.batch,), np.int32)
        # [batch] int32 staging for host-given per-sequence values (advance, truncate, reset).
        self._per_seq = self._backend.zeros((spec.batch,), np.int32)
        # attention's split-KV partial results, by shape (see cupykv.attention).
        self._workspaces: dict = {}

    # -- introspection -------------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend: ``"cupy"`` or ``"emulator"``."""
        return self._backend.name

    @property
    def xp(self):
        """The array module of this cache's arrays (``cupy`` or ``numpy``)."""
        return self._backend.xp

    def lengths_host(self) -> np.ndarray:
        """Committed lengths as a NumPy int32 ``[batch]`` (synchronises)."""
        return self._backend.to_host(self.lengths)

    def _kernel(self, op: str, instance: str):
        return self._backend.kernel(op, instance)

    def _layout_args(self, layer: int):
        strides = self.spec.strides
        seq_axis = self.spec.seq_axis
        head_axis = 3 if seq_axis == 2 else 2
        return (np.int64(layer * strides[0]), np.int64(strides[1]), np.int64(strides[seq_axis]),
                np.int64(strides[head_axis]))

    # -- writes --------------------------------------------------------------
    def append(self, layer, k, v, rope=None) -> None:
        """Write new rows at each sequence's pending positions of one layer.

        Row ``i`` of sequence ``b`` goes to position ``lengths[b] + i``. The rows
        stay pending (``lengths`` is unchanged) until :meth:`advance`. A row
        whose position is ``>= max_seq`` is not written and sets
        ``overflow[b]``; see :meth:`check`.

        Parameters
        ----------
        layer : int
            Layer index in ``0..n_layers-1``.
        k, v : device array ``[batch, n_new, n_kv_heads, head_dim]``
            New rows in the cache's storage dtype, C-contiguous.
        rope : Rope, optional
            Rotate each key row at its position before storing it.

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before anything is launched.
        """
        spec = self.spec
        layer = _checks.check_layer(layer, spec)
        n_new = _checks.check_rows("k", k, spec)
        _checks.check_rows("v", v, spec)
        _checks.check_same_shape("k", k, "v", v)
        rope = _checks.check_rope(rope, spec)
        k = device_input("k", k, self._backend, spec.dtype)
        v = device_input("v", v, self._backend, spec.dtype)
        kernel = self._kernel("append", f"cupykv_append<{CUDA_TYPES[spec.dtype]}>")
        kernel((n_new, spec.batch), (_APPEND_THREADS,),
               (self.k, self.v, k, v, self.lengths, self.overflow, *self._layout_args(layer),
                np.int32(n_new), np.int32(spec.n_kv_heads), np.int32(spec.head_dim), np.int32(spec.max_seq),
                np.int32(rope is not None), np.float64(rope.theta if rope else 0.0)))

    # -- lengths -------------------------------------------------------------
    def advance(self, n=1) -> None:
        """Commit pending rows: ``lengths += n``, clamped to ``max_seq``.

        Parameters
        ----------
        n : int or int array ``[batch]``
            Non-negative steps, one for all sequences or one per sequence (a
            device int32 array is read on the device, which is graph-safe).
            A sequence that would pass ``max_seq`` is clamped and flagged.
        """
        spec = self.spec
        steps = _checks.check_advance(n, spec)
        per_seq = not (isinstance(n, (int, np.integer)) and not isinstance(n, bool))
        args_steps = self._device_ints("n", steps) if per_seq else self._per_seq
        self._kernel("advance", "cupykv_advance")(
            (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, self.overflow, args_steps, np.int32(per_seq),
             np.int32(0 if per_seq else int(n)), np.int32(spec.batch), np.int32(spec.max_seq)))

    def truncate(self, new_lengths) -> None:
        """Roll sequences back to shorter lengths (speculative-decoding rollback).

        Parameters
        ----------
        new_lengths : int or int array ``[batch]``
            ``0 <= new_lengths[b] <= lengths[b]``. Host values are checked
            against the current lengths (a synchronising read); a device int32
            array is clamped on the device so it can only shorten.
        """
        spec = self.spec
        if self._is_device_int_array(new_lengths):
            values = _checks.check_new_lengths(new_lengths, None, spec)
        else:
            values = _checks.check_new_lengths(new_lengths, self.lengths_host(), spec)
        self._kernel("truncate", "cupykv_truncate")(
            (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, self._device_ints("new_lengths", values), np.int32(spec.batch)))

    def reset(self, slots=None) -> None:
        """Empty sequence slots: ``lengths[slots] = 0`` and their overflow flags cleared.

        Parameters
        ----------
        slots : None, int or sequence of int
            Slots to reset; ``None`` resets all of them.
        """
        spec = self.spec
        chosen = _checks.check_slots(slots, spec)
        mask = np.zeros(spec.batch, dtype=np.int64)
        mask[chosen] = 1
        use_mask = slots is not None
        self._kernel("reset", "cupykv_reset")(
            (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, self.overflow, self._device_ints("slots", mask) if use_mask else self._per_seq,
             np.int32(use_mask), np.int32(spec.batch)))

    def _is_device_int_array(self, values) -> bool:
        """Device arrays are read by the kernels; host values are checked and uploaded."""
        return not isinstance(values, np.ndarray) and self._backend.is_device_array(values)

    def _device_ints(self, name: str, values):
        """A device int32 ``[batch]`` for checked per-sequence ``values``."""
        if not isinstance(values, np.ndarray):
            if values.dtype != np.int32:
                raise TypeError(f"{name}: expected a device int32 array, got dtype {values.dtype}")
            return values
        self._backend.upload(self._per_seq, values.astype(np.int32))
        return self._per_seq

    # -- reads ---------------------------------------------------------------
    def additive_mask(self, q_len=1, out=None):
        """Float32 additive mask ``[batch, 1, q_len, max_seq]`` from the device lengths.

        ``out[b, 0, i, j]`` is 0 where query ``i`` of sequence ``b`` (position
        ``lengths[b] + i``) may attend to position ``j`` (``j <= lengths[b] + i``)
        and ``MASK_VALUE`` (-1e30) elsewhere.

        Parameters
        ----------
        q_len : int, default 1
        out : device float32 array ``[batch, 1, q_len, max_seq]``, optional
            Written in place and returned (the graph-safe form).
        """
        spec = self.spec
        q_len = _checks.check_q_len(q_len)
        shape = (spec.batch, 1, q_len, spec.max_seq)
        if out is None:
            out = self._backend.zeros(shape, np.float32)
        else:
            out = device_input("out", out, self._backend, "float32", shape)
        self._kernel("additive_mask", "cupykv_additive_mask")(
            (_blocks(spec.max_seq, _SMALL_THREADS), q_len, spec.batch), (_SMALL_THREADS,),
            (out, self.lengths, np.int32(q_len), np.int32(spec.max_seq), np.float32(MASK_VALUE)))
        return out

    def check(self) -> None:
        """Raise :class:`CacheOverflowError` if any sequence overflowed (synchronises).

        The flags stay set until :meth:`reset` clears those slots.
        """
        flags = self._backend.to_host(self.overflow)
        overflowed = np.flatnonzero(flags).tolist()
        if overflowed:
            raise CacheOverflowError.for_sequences(overflowed, self.spec.max_seq)
