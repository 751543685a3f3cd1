"""KVCache: the device-resident cache, its lengths, and the ops that change them.

Every length-dependent value lives in device memory (``lengths``,
``overflow``) and is read by the kernels at run time, so a captured decode
step stays valid as sequences grow, roll back or restart. Host work (argument
checks, launch geometry, allocation) happens before any launch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from cupykv import _args, cache_views
from cupykv._typing import ArrayLike, DeviceArray, HostArray, IntLike, PerSequence, Positions, Shape
from cupykv.backends import get_backend
from cupykv.backends.base import Backend, DeviceInfo
from cupykv.backends.capture import refuse_in_capture
from cupykv.errors import CacheOverflowError
from cupykv.kernels import cache_types
from cupykv.rope import Rope
from cupykv.spec import MASK_VALUE, CacheSpec

_APPEND_THREADS = 128
_SMALL_THREADS = 256   # advance / truncate / reset / additive_mask
_MASK_ROW_BLOCKS = 1024   # additive_mask: grid y strides over the batch * q_len rows
_log = logging.getLogger("cupykv")


@dataclass(frozen=True)
class KernelView:
    """What a kernel needs of one layer of a cache: its arrays, the layer's offset and the strides (read-only).

    Offsets and strides count elements of the storage dtype, for the
    ``layer_offset, stride_batch, stride_seq, stride_head`` kernel arguments
    every cache kernel takes (``k[layer_offset + b * stride_batch + s *
    stride_seq + h * stride_head + d]``, the same for ``v``). An fp8 cache's
    element stands for ``code * k_scales[layer, h]`` (``v_scales`` for V);
    the scales of other caches are 1.
    """

    backend: Backend           # the Backend the arrays live on (launch with it)
    k: DeviceArray             # the whole cache (all layers), spec.shape
    v: DeviceArray
    lengths: DeviceArray       # int32 [batch]
    overflow: DeviceArray      # int32 [batch]
    k_scales: DeviceArray      # float32 [n_layers, n_kv_heads]
    v_scales: DeviceArray      # float32 [n_layers, n_kv_heads]
    layer: int
    layer_offset: int
    stride_batch: int
    stride_seq: int
    stride_head: int

    def scale_args(self) -> tuple[DeviceArray, DeviceArray, np.int32]:
        """``k_scales, v_scales, layer``: the scale arguments of the cache kernels (kernels/kv_codec.cuh).

        Graph-safe: yes — device arrays (read at run time) and a host int.
        """
        return self.k_scales, self.v_scales, np.int32(self.layer)

    def layout_args(self) -> tuple[np.int64, np.int64, np.int64, np.int64]:
        """``layer_offset, stride_batch, stride_seq, stride_head`` as the kernels' ``long long`` arguments.

        Graph-safe: yes — host values only.
        """
        return (np.int64(self.layer_offset), np.int64(self.stride_batch), np.int64(self.stride_seq),
                np.int64(self.stride_head))


def _blocks(n: int, threads: int) -> int:
    return max(1, (n + threads - 1) // threads)


class KVCache:
    """A static-capacity K/V cache on a backend (CuPy on a GPU, or the CPU emulator).

    Graph-safe: no — refused inside a captured step (CaptureError): making a
    cache allocates its arrays. Make caches before capture; a step then uses
    the methods marked graph-safe.

    Parameters
    ----------
    spec : CacheSpec
        Shapes, dtype and layout.
    backend : {"cupy", "emulator"} or None
        ``None`` picks CuPy when a CUDA device is usable, else the emulator;
        the ``CUPYKV_BACKEND`` environment variable overrides the choice.
    lengths : device int32 array ``[batch]``, optional
        Use this array as the cache's lengths instead of allocating one, so
        that several caches share it (the caches of a draft and a target
        model that must stay in step): each sees the others' ``advance``,
        ``truncate``, ``reset`` and ``set_lengths``. It must be C-contiguous,
        writeable, on this backend's current device, hold values in
        ``0..max_seq`` (read once, here) and share no byte with another
        cache's buffers other than its lengths. Overflow flags stay per
        cache: a clamp sets the flag of the cache whose call clamped.
    k_scale, v_scale : float or host array broadcastable to ``[n_layers, n_kv_heads]``, default 1.0
        The scales of a ``"float8_e4m3"`` cache: a value ``x`` of kv head ``h``
        of layer ``l`` is stored as ``E4M3(clamp(x / k_scale[l, h], -448, 448))``
        and read as ``code * k_scale[l, h]`` (``v_scale`` for V). Each a normal
        float32 > 0; :func:`cupykv.calibrate_scales` derives them from sample
        rows. Other caches store values unscaled: their scales must be 1.

    Attributes
    ----------
    k, v : device array ``spec.shape``
        ``[n_layers, batch, max_seq, n_kv_heads, head_dim]`` (NHD) or
        ``[n_layers, batch, n_kv_heads, max_seq, head_dim]`` (HND), in the
        storage dtype (bfloat16 is uint16 bit patterns on CuPy).
    lengths : device int32 ``[batch]``
        Committed length of each sequence (the array given as ``lengths``, if any).
    k_scales, v_scales : device float32 ``[n_layers, n_kv_heads]``
        The scales (all 1 unless the cache is fp8), read by the kernels at run
        time: :meth:`set_scales` changes them in place.
    overflow : device int32 ``[batch]``
        1 where a write or advance went past ``max_seq``; see :meth:`check`.
        The device-side capacity answer: a graph step cannot ask
        :meth:`has_capacity`, but it can read these flags after replay.
    shares_lengths : bool
        ``lengths`` was given to the constructor (it is not this cache's own).

    Raises
    ------
    TypeError
        ``spec`` is not a CacheSpec; ``lengths`` is not a device int32 array
        of this backend.
    ValueError
        ``backend`` is not a backend name; ``lengths`` has the wrong shape,
        is strided, read-only, overlaps another cache's buffers or holds a
        value outside ``0..max_seq``.
    MemoryError
        The cache needs more bytes than the backend can give (free device
        memory on CuPy, available host memory on the emulator); raised before
        anything is allocated, with both numbers.
    CaptureError
        Made inside a captured step.
    """

    # views, capacity queries and footprint (cupykv/cache_views.py): no launches, no state of their own
    layer = cache_views.layer
    live = cache_views.live
    remaining_capacity = cache_views.remaining_capacity
    has_capacity = cache_views.has_capacity
    nbytes = property(cache_views.nbytes)
    __repr__ = cache_views.kv_cache_repr

    def __init__(self, spec: CacheSpec, backend: str | Backend | None = None, *,
                 lengths: ArrayLike | None = None, k_scale: float | npt.ArrayLike = 1.0,
                 v_scale: float | npt.ArrayLike = 1.0) -> None:
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec: expected a cupykv.CacheSpec, got {type(spec).__name__}")
        self.spec = spec
        self._backend = get_backend(backend)
        host_scales = (_args.check_kv_scale("k_scale", k_scale, spec, self._backend),
                       _args.check_kv_scale("v_scale", v_scale, spec, self._backend))
        shared = None if lengths is None else self._shared_lengths(lengths)
        self.shares_lengths = shared is not None
        available, source = self._backend.available_memory()
        _args.check_memory("spec", self._bytes_needed(spec, own_lengths=shared is None), available,
                           self._backend.name, source)
        storage = self._backend.storage_dtype(spec.dtype)
        self.k = self._backend.zeros(spec.shape, storage)
        self.v = self._backend.zeros(spec.shape, storage)
        self.lengths = self._backend.zeros((spec.batch,), np.int32) if shared is None else shared
        self.overflow = self._backend.zeros((spec.batch,), np.int32)
        self.k_scales, self.v_scales = (self._backend.asarray(scales) for scales in host_scales)
        # [batch] int32 staging for host-given per-sequence values (advance, truncate, reset).
        self._per_seq = self._backend.zeros((spec.batch,), np.int32)
        # (what, first, last) byte addresses of the buffers above: no op's output may write into them
        self._owned_ranges = tuple((what, *_args.byte_range(buffer)) for what, buffer in (
            ("k", self.k), ("v", self.v), ("lengths", self.lengths), ("overflow flags", self.overflow),
            ("k scales", self.k_scales), ("v scales", self.v_scales), ("per-sequence staging buffer", self._per_seq)))
        _args.register_buffers(self)
        _log.debug("created %r", self)

    @staticmethod
    def _bytes_needed(spec: CacheSpec, own_lengths: bool = True) -> int:
        """Bytes a cache of ``spec`` allocates: K and V, three int32 ``[batch]`` arrays (two with shared lengths)
        and the float32 scales ``[2, n_layers, n_kv_heads]``."""
        return spec.nbytes + (3 if own_lengths else 2) * 4 * spec.batch + 2 * 4 * spec.n_layers * spec.n_kv_heads

    def _shared_lengths(self, lengths: object) -> DeviceArray:
        """The caller's lengths array, checked (before anything is allocated) to serve as this cache's."""
        spec = self.spec
        lengths = _args.int32_operand("lengths", lengths, self._backend)
        _args.check_lengths_shape("lengths", lengths, spec)
        _args.check_writeable("lengths", lengths)
        _args.check_apart_from_caches("lengths", lengths, shareable=("lengths",))
        _args.check_lengths_values("lengths", self._backend.to_host(lengths), spec)
        return lengths

    # -- introspection -------------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend: ``"cupy"`` or ``"emulator"``."""
        return self._backend.name

    def device_info(self) -> DeviceInfo:
        """The device this cache lives on (a :class:`cupykv.backends.base.DeviceInfo`).

        Graph-safe: yes — a host query of the device's properties; it
        launches, allocates and reads nothing on the device.
        """
        return self._backend.device_info()

    @property
    def xp(self) -> Any:
        """The array module of this cache's arrays (``cupy`` or ``numpy``)."""
        return self._backend.xp

    def lengths_host(self) -> HostArray:
        """Committed lengths as a NumPy int32 ``[batch]`` (synchronises).

        Graph-safe: no — refused inside a captured step (CaptureError): it
        synchronises and reads the device. Read them after ``replay()``.

        Returns
        -------
        numpy.ndarray, int32, shape ``[batch]``
        """
        return self._backend.to_host(self.lengths)

    def set_scales(self, k_scale: float | npt.ArrayLike | None = None,
                   v_scale: float | npt.ArrayLike | None = None) -> None:
        """Replace the K and/or V scales of an fp8 cache (``None`` keeps one as it is).

        The scales are updated in place, so a captured step sees the new values
        at its next replay. Rows already stored keep their codes: they now
        stand for ``code * new_scale``.

        Graph-safe: no — refused inside a captured step (CaptureError): it
        uploads. Set scales between replays.

        Parameters
        ----------
        k_scale, v_scale : float or host array broadcastable to ``[n_layers, n_kv_heads]``, optional
            As for the constructor: normal float32 values > 0 (and 1 for a cache that is not fp8).

        Raises
        ------
        TypeError, ValueError
            A bad scale, before anything changes (neither scale is set then).
        CaptureError
            Inside a captured step.
        """
        self._check_device()
        refuse_in_capture("KVCache.set_scales (it uploads the scales)",
                          "set scales between replays: a captured step reads the new values at its next replay")
        scales = (("k_scale", k_scale, self.k_scales), ("v_scale", v_scale, self.v_scales))
        updates = [None if scale is None else (device, _args.check_kv_scale(name, scale, self.spec, self._backend))
                   for name, scale, device in scales]
        for update in updates:
            if update is not None:
                self._backend.upload(*update)

    def scales_host(self) -> tuple[HostArray, HostArray]:
        """``(k_scales, v_scales)`` as NumPy float32 ``[n_layers, n_kv_heads]`` (synchronises).

        Graph-safe: no — refused inside a captured step (CaptureError): it reads the device.
        """
        return self._backend.to_host(self.k_scales), self._backend.to_host(self.v_scales)

    def to_device(self, host_array: npt.ArrayLike) -> DeviceArray:
        """A copy of a NumPy array on this cache's backend, ready to pass to cupykv ops.

        bfloat16 (``ml_dtypes.bfloat16``) and E4M3 (``ml_dtypes.float8_e4m3fn``)
        become what the backend stores: uint16 and uint8 bit patterns on CuPy. Integer arrays made this way are device-resident
        per-sequence values for ``advance``/``truncate``/``reset`` (graph-safe).

        Graph-safe: no — refused inside a captured step (CaptureError): it
        allocates and uploads. Upload before capture.

        Parameters
        ----------
        host_array : array_like
            Any shape and dtype; C-contiguous on the device.

        Returns
        -------
        device array of the shape of ``host_array``, its dtype (bfloat16 as the backend stores it)
        """
        return self._backend.asarray(host_array)

    def kernel_view(self, layer: IntLike) -> KernelView:
        """The arrays, offset and strides a kernel needs to read or write ``layer`` (read-only).

        For code that launches its own kernels over the cache (as
        :class:`~cupykv.AttentionPlan` does). Checks that ``layer`` is in
        ``0..n_layers-1`` and that the cache lives on the device kernels
        launch on now.

        Graph-safe: yes — host bookkeeping only: no launch, allocation or
        device read.

        Raises
        ------
        TypeError, ValueError
            ``layer`` is not an int in ``0..n_layers-1``; TypeError when the
            cache lives on another device than the current one.
        """
        self._check_device()
        layer = _args.check_layer(layer, self.spec)
        return KernelView(self._backend, self.k, self.v, self.lengths, self.overflow, self.k_scales, self.v_scales,
                          layer, *self._layout(layer))

    def owned_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(what, first, last)`` byte addresses of every buffer the cache owns: no op's output may write there.

        Graph-safe: yes — host values, taken when the cache was made.
        """
        return self._owned_ranges

    def _launch(self, op: str, instance: str, grid: Sequence[int], block: Sequence[int], args: Sequence[object],
                shared_mem: int = 0) -> None:
        self._backend.launch(op, instance, grid, block, args, shared_mem)

    def _check_device(self) -> None:
        """The cache's arrays must live on the device kernels launch on now (checked before any launch)."""
        self._backend.check_device("cache", self.k)

    def _state(self) -> list[tuple[str, DeviceArray | None]]:
        """The buffers advance, truncate and reset write: lengths and overflow flags."""
        return [("the cache's lengths", self.lengths), ("the cache's overflow flags", self.overflow)]

    def _layout(self, layer: int) -> tuple[int, int, int, int]:
        """``layer_offset, stride_batch, stride_seq, stride_head`` in elements."""
        strides = self.spec.strides
        seq_axis = self.spec.seq_axis
        head_axis = 3 if seq_axis == 2 else 2
        return layer * strides[0], strides[1], strides[seq_axis], strides[head_axis]

    # -- writes --------------------------------------------------------------
    def append(self, layer: IntLike, k: ArrayLike, v: ArrayLike, rope: Rope | None = None, *,
               return_positions: bool = False, positions_out: ArrayLike | None = None,
               run_if: ArrayLike | None = None) -> DeviceArray | None:
        """Write new rows at each sequence's pending positions of one layer.

        Row ``i`` of sequence ``b`` goes to position ``lengths[b] + i``. The rows
        stay pending (``lengths`` is unchanged) until :meth:`advance`. A row
        whose position is ``>= max_seq`` is not written and sets
        ``overflow[b]``; see :meth:`check`.

        Graph-safe: yes, unless ``return_positions=True`` comes without ``positions_out`` — one
        launch, which reads the lengths on the device, so each replay appends at the current
        positions; ``return_positions=True`` alone allocates the positions array, which a captured
        step refuses (CaptureError).

        Parameters
        ----------
        layer : int
            Layer index in ``0..n_layers-1``.
        k, v : device array ``[batch, n_new, n_kv_heads, head_dim]``
            New rows in the cache's ``io_dtype`` (its storage dtype, except
            for an fp8 cache, which quantizes them with its scales),
            C-contiguous, ``n_new`` in ``1..2**30-1``. Neither may overlap the cache's own buffers (rows
            read from the cache itself would race with the writes: copy them first).
        rope : Rope, optional
            Rotate each key row at its position before storing it.
        return_positions : bool, default False
            Return where each row went (abaddon's offset), see Returns.
        positions_out : device int32 array ``[batch, n_new]``, optional
            Preallocated array for those positions (implies
            ``return_positions``): the graph-safe form, since a captured step
            may not allocate. C-contiguous, writeable, apart from ``k``, ``v``
            and every cache's buffers.
        run_if : device int32 array ``[1]``, optional
            The launch's gate, read on the device at run time (a captured step
            sees its value at every replay): 0 makes the launch return at once,
            reading nothing else and writing nothing (K, V, the overflow flags
            and ``positions_out`` keep their bytes); any other value, or
            ``None``, appends. The caller's word (or ``Backend.always_run()``),
            C-contiguous; it may not overlap ``positions_out`` or a buffer of
            any cache or plan (this cache's ``lengths`` included).

        Returns
        -------
        None, or device int32 ``[batch, n_new]`` with ``return_positions`` or ``positions_out``
            ``lengths[b] + i`` where row ``i`` of sequence ``b`` was written,
            ``-1`` where it overflowed; filled on the device, at run time. With
            ``run_if`` holding 0, ``positions_out`` as it was (all ``-1`` when
            the call allocated it: no row was written).

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before anything is launched.
        CaptureError
            ``return_positions=True`` without ``positions_out`` inside a captured step.
        """
        self._check_device()
        spec = self.spec
        layer, n_new, k, v, rope = self._rows_args(layer, k, v, rope)
        out = _args.positions_output(return_positions, positions_out, spec, n_new, self._backend,
                                     [("k", k), ("v", v)])
        word = _args.run_if_operand(run_if, self._backend, self)
        grid = (spec.batch * n_new,)
        _args.check_launch("k", f"batch * n_new = {spec.batch} * {n_new} rows", grid, (_APPEND_THREADS,))
        word = _args.run_if_word(word, self._backend, [("positions_out", out)])
        out = self._allocated_positions_out(out, return_positions, n_new)
        view = self.kernel_view(layer)
        self._launch(
            "append", f"cupykv_append<{cache_types(spec.dtype, spec.io_dtype)}>", grid, (_APPEND_THREADS,),
            (self.k, self.v, k, v, self.lengths, self.overflow, self._per_seq if out is None else out,
             np.int32(out is not None), *view.scale_args(), *view.layout_args(),
             np.int32(n_new), np.int32(spec.n_kv_heads), np.int32(spec.head_dim), np.int32(spec.max_seq),
             np.int32(rope is not None), np.float64(rope.theta if rope else 0.0), word))
        return out

    def write(self, layer: IntLike, positions: Positions, k: ArrayLike, v: ArrayLike, rope: Rope | None = None, *,
              return_positions: bool = False, positions_out: ArrayLike | None = None,
              run_if: ArrayLike | None = None) -> DeviceArray | None:
        """Write new rows of one layer at positions given per row (GraphSafeKV's ``write``).

        Row ``i`` of sequence ``b`` goes to position ``positions[b, i]``;
        ``lengths`` is neither read nor changed (commit with :meth:`advance`
        or :meth:`set_lengths`). As with :meth:`append`, a row whose position
        is outside ``0..max_seq-1`` is not written and sets ``overflow[b]``;
        the other rows of the call are still written.

        Graph-safe: yes, with device ``positions`` (and ``positions_out`` when positions are returned)
        — one launch, which reads the positions on the device at run time; host positions are uploaded
        and ``return_positions=True`` alone allocates: both are refused inside a captured step
        (CaptureError).

        Parameters
        ----------
        layer : int
            Layer index in ``0..n_layers-1``.
        positions : device int32 array ``[batch, n_new]``, or host ints
            Where each row goes; ``[batch]`` when ``n_new`` is 1. A device
            array is read at run time (graph-safe); it must be C-contiguous
            and apart from the cache's K, V and flags (the cache's own
            ``lengths`` is allowed: that is :meth:`append`'s position). Host
            values (a NumPy int array or nested lists, each a kernel int) are
            checked and uploaded, so not inside a captured step. Two rows of
            one sequence at one position in ``0..max_seq-1``: refused in host
            values; in a device array the later row wins (the earlier is not
            written), as if the rows were written one after another.
        k, v : device array ``[batch, n_new, n_kv_heads, head_dim]``
            As for :meth:`append`.
        rope : Rope, optional
            Rotate each key row at its own position before storing it.
        return_positions, positions_out
            As for :meth:`append`; a position is ``-1`` where the row was not
            written (out of range, or replaced by a later row at that position).
        run_if : device int32 array ``[1]``, optional
            As for :meth:`append`: 0 makes the launch read nothing but this
            word (not even ``positions``) and write nothing. It may not overlap
            ``positions_out`` or a buffer of any cache or plan.

        Returns
        -------
        None, or device int32 of the shape of ``positions`` (with ``return_positions`` or ``positions_out``)
            With ``run_if`` holding 0, ``positions_out`` as it was (all ``-1``
            when the call allocated it).

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before anything is uploaded, allocated or launched.
        CaptureError
            Host positions, or ``return_positions`` without ``positions_out``, inside a captured step.
        """
        self._check_device()
        spec = self.spec
        layer, n_new, k, v, rope = self._rows_args(layer, k, v, rope)
        device_positions, host_positions = _args.positions_operand(positions, spec, n_new, self._backend, [
            ("the cache's k", self.k), ("the cache's v", self.v), ("the cache's overflow flags", self.overflow),
            ("the cache's per-sequence staging buffer", self._per_seq)])   # what the launch writes
        # [batch, n_new], or [batch]: a new positions_out has the shape of positions
        shape = tuple(np.asarray(positions, dtype=object).shape if device_positions is None else device_positions.shape)
        inputs: list[tuple[str, DeviceArray | None]] = [("k", k), ("v", v)]
        if device_positions is not None:
            inputs.append(("positions", device_positions))
        out = _args.positions_output(return_positions, positions_out, spec, n_new, self._backend, inputs)
        word = _args.run_if_operand(run_if, self._backend, self)
        grid = (spec.batch * n_new,)
        _args.check_launch("k", f"batch * n_new = {spec.batch} * {n_new} rows", grid, (_APPEND_THREADS,))
        word = _args.run_if_word(word, self._backend, [("positions_out", out)])
        if host_positions is not None:   # every check passed: upload (refused inside a captured step)
            device_positions = self._backend.asarray(host_positions.astype(np.int32))
        out = self._allocated_positions_out(out, return_positions, n_new, shape)
        view = self.kernel_view(layer)
        self._launch(
            "write", f"cupykv_write<{cache_types(spec.dtype, spec.io_dtype)}>", grid, (_APPEND_THREADS,),
            (self.k, self.v, k, v, device_positions, self.overflow, self._per_seq if out is None else out,
             np.int32(out is not None), *view.scale_args(), *view.layout_args(),
             np.int32(n_new), np.int32(spec.n_kv_heads), np.int32(spec.head_dim), np.int32(spec.max_seq),
             np.int32(rope is not None), np.float64(rope.theta if rope else 0.0), word))
        return out

    def _rows_args(self, layer: object, k: object, v: object,
                   rope: object) -> tuple[int, int, DeviceArray, DeviceArray, Rope | None]:
        """Checked ``layer, n_new, k, v, rope`` of append and write (rows on this backend, apart from the cache)."""
        spec = self.spec
        layer = _args.check_layer(layer, spec)
        n_new = _args.check_rows("k", k, spec)
        _args.check_rows("v", v, spec)
        _args.check_same_shape("k", k, "v", v)
        checked_rope = _args.check_rope(rope, spec)
        k_rows = _args.device_operand("k", k, self._backend, spec.io_dtype)
        v_rows = _args.device_operand("v", v, self._backend, spec.io_dtype)
        _args.check_apart_from_caches("k", k_rows, self, others=False)
        _args.check_apart_from_caches("v", v_rows, self, others=False)
        return layer, n_new, k_rows, v_rows, checked_rope

    def _allocated_positions_out(self, out: DeviceArray | None, return_positions: bool, n_new: int,
                                 shape: Shape | None = None) -> DeviceArray | None:
        """``out``, or a new device int32 array ``shape`` (default ``[batch, n_new]``) of -1 (no row written, as a
        gated-off launch leaves it) when positions are asked for."""
        if out is None and return_positions:
            out = self._backend.asarray(np.full(shape or (self.spec.batch, n_new), -1, np.int32))
        return out

    # -- lengths -------------------------------------------------------------
    def advance(self, n: PerSequence = 1) -> None:
        """Commit pending rows: ``lengths += n``, clamped to ``max_seq``.

        Graph-safe: yes, with an int or a device array — an int is a launch constant and a device
        array is read at run time; a host sequence is uploaded, which a captured step refuses
        (CaptureError).

        Parameters
        ----------
        n : int, int sequence ``[batch]`` or device int32 array ``[batch]``
            Steps in ``0..2**31-1`` (the kernel's int), one for all sequences or
            one per sequence. An int is a launch constant and a device array is
            read at run time: both are graph-safe. A sequence that would pass
            ``max_seq`` is clamped and flagged. A negative device value counts
            as 0 (without a flag). A device array must be C-contiguous and must
            not overlap the cache's lengths or flags.

        Raises
        ------
        TypeError, ValueError
            Bad ``n``, before anything is uploaded or launched.
        CaptureError
            ``n`` is a host sequence inside a captured step.
        """
        self._check_device()
        spec = self.spec
        self._lengths_op("advance", "n", n, lambda host: _args.check_advance(host, spec))

    def truncate(self, new_lengths: PerSequence) -> None:
        """Roll sequences back to shorter lengths (speculative-decoding rollback).

        Graph-safe: yes, with a device array — it is clamped on the device at run time; host values
        (an int included) are checked against the current lengths, a synchronising read that a
        captured step refuses (CaptureError).

        Parameters
        ----------
        new_lengths : int, int sequence ``[batch]`` or device int32 array ``[batch]``
            ``0 <= new_lengths[b] <= lengths[b]``. Host values are checked
            against the current lengths (a synchronising read, so not inside a
            captured step); a device array is clamped on the device so that
            it can only shorten, a negative value to 0 (graph-safe). A device array must be
            C-contiguous and must not overlap the cache's lengths or flags.

        Raises
        ------
        TypeError, ValueError
            Bad ``new_lengths``, before anything is uploaded or launched.
        CaptureError
            ``new_lengths`` holds host values inside a captured step.
        """
        self._check_device()
        spec = self.spec
        targets = self._per_sequence_arg(
            "new_lengths", new_lengths, lambda host: _args.check_new_lengths(host, self.lengths_host(), spec))
        self._launch(
            "truncate", "cupykv_truncate", (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, targets, np.int32(spec.batch)))

    def set_lengths(self, new_lengths: PerSequence) -> None:
        """Set the committed lengths, growing or shrinking them (GraphSafeKV's ``mark_written``).

        Unlike :meth:`truncate` it may grow a sequence: the rows up to the new
        length become live as they are stored (write them first, with
        :meth:`write` or :meth:`append`). A value past ``max_seq`` is clamped
        to ``max_seq`` and sets that sequence's overflow flag.

        Graph-safe: yes, with an int or a device array — an int is a launch constant and a device
        array is read at run time; a host sequence is uploaded, which a captured step refuses
        (CaptureError).

        Parameters
        ----------
        new_lengths : int, int sequence ``[batch]`` or device int32 array ``[batch]``
            Host values are ints in ``0..2**31-1`` (the kernel's int). An int is
            a launch constant and a device array is read at run time: both are
            graph-safe; a host sequence is uploaded, so not inside a captured
            step. A negative device value is clamped to 0 (without a flag). A
            device array must be C-contiguous and must not overlap the cache's
            lengths or flags.

        Raises
        ------
        TypeError, ValueError
            Bad ``new_lengths``, before anything is uploaded or launched.
        CaptureError
            ``new_lengths`` is a host sequence inside a captured step.
        """
        self._check_device()
        spec = self.spec
        self._lengths_op("set_lengths", "new_lengths", new_lengths, lambda host: _args.check_set_lengths(host, spec))

    def _lengths_op(self, op: str, name: str, value: object, check_host: Callable[[object], npt.ArrayLike]) -> None:
        """Launch ``kernels/<op>.cu`` (advance or set_lengths) with one value for all sequences or one each.

        An int is a launch constant; anything else becomes a device int32 ``[batch]`` (see
        :meth:`_per_sequence_arg`). Both kernels clamp to ``max_seq`` and flag overflow.
        """
        spec = self.spec
        constant = _args.is_int(value)
        scalar = _args.check_int32(name, value, lo=0) if constant else 0
        values = self._per_seq if constant else self._per_sequence_arg(name, value, check_host)
        self._launch(
            op, f"cupykv_{op}", (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, self.overflow, values, np.int32(not constant), np.int32(scalar),
             np.int32(spec.batch), np.int32(spec.max_seq)))

    def reset(self, slots: IntLike | Sequence[IntLike] | ArrayLike | None = None) -> None:
        """Empty sequence slots: ``lengths[slots] = 0`` and their overflow flags cleared.

        Graph-safe: yes, with ``None`` or a device mask — the mask is read at run time; host slots are
        uploaded, which a captured step refuses (CaptureError).

        Parameters
        ----------
        slots : None, int, int sequence, or device int32 mask ``[batch]``
            Slots to reset; ``None`` resets all of them. A device mask (nonzero
            = reset) is read at run time (graph-safe); it must be C-contiguous
            and must not overlap the cache's lengths or flags.

        With shared lengths (``KVCache(..., lengths=...)``) the shared
        ``lengths[slots]`` become 0 for every cache that shares them; only this
        cache's overflow flags are cleared.

        Raises
        ------
        TypeError, ValueError
            Bad ``slots``, before anything is uploaded or launched.
        CaptureError
            ``slots`` holds host values inside a captured step.
        """
        self._check_device()
        spec = self.spec

        def host_mask(host: object) -> npt.NDArray[np.int64]:
            mask = np.zeros(spec.batch, dtype=np.int64)
            mask[_args.check_slots(host, spec)] = 1
            return mask

        mask = self._per_seq if slots is None else self._per_sequence_arg("slots", slots, host_mask)
        self._launch(
            "reset", "cupykv_reset", (_blocks(spec.batch, _SMALL_THREADS),), (_SMALL_THREADS,),
            (self.lengths, self.overflow, mask, np.int32(slots is not None), np.int32(spec.batch)))

    def _per_sequence_arg(self, name: str, values: object,
                          check_host: Callable[[object], npt.ArrayLike]) -> DeviceArray:
        """Device int32 ``[batch]`` for a per-sequence argument.

        A device array is checked for shape, dtype, layout and aliasing, and
        read by the kernel at run time. Host values go through ``check_host``
        (which returns them as an int array ``[batch]``, each value in int32
        range) and are copied into a staging buffer.
        """
        if self._backend.is_device_array(values):
            if tuple(values.shape) != (self.spec.batch,) or values.dtype != np.int32:
                raise ValueError(f"{name}: expected a device int32 array of shape ({self.spec.batch},) [batch], "
                                 f"got dtype {values.dtype} and shape {tuple(values.shape)}")
            _args.check_contiguous(name, values)
            _args.check_no_overlap(name, values, self._state())
            return values
        self._backend.upload(self._per_seq, np.asarray(check_host(values)).astype(np.int32))
        return self._per_seq

    # -- reads ---------------------------------------------------------------
    def additive_mask(self, q_len: IntLike = 1, out: ArrayLike | None = None) -> DeviceArray:
        """Float32 additive mask ``[batch, 1, q_len, max_seq]`` from the device lengths.

        ``out[b, 0, i, j]`` is 0 where query ``i`` of sequence ``b`` (position
        ``lengths[b] + i``) may attend to position ``j`` (``j <= lengths[b] + i``)
        and ``MASK_VALUE`` (-1e30) elsewhere.

        Graph-safe: yes, with ``out=`` — one launch into ``out``, which reads the lengths on the
        device; without ``out`` the mask is allocated, which a captured step refuses (CaptureError).

        Parameters
        ----------
        q_len : int, default 1
            In ``1..2**30-1``.
        out : device float32 array ``[batch, 1, q_len, max_seq]``, optional
            Written in place and returned (the graph-safe form); C-contiguous,
            writeable, and not overlapping any buffer of a cache.

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before anything is launched.
        CaptureError
            No ``out`` inside a captured step.
        """
        self._check_device()
        spec = self.spec
        q_len = _args.check_q_len(q_len)
        shape = (spec.batch, 1, q_len, spec.max_seq)
        if out is None:
            out = self._backend.zeros(shape, np.float32)
        else:
            out = _args.device_operand("out", out, self._backend, "float32", shape, written=True)
            _args.check_apart_from_caches("out", out, self)   # and every other cache
        grid = (_blocks(spec.max_seq, _SMALL_THREADS), min(spec.batch * q_len, _MASK_ROW_BLOCKS))
        _args.check_launch("q_len", f"max_seq = {spec.max_seq} positions a row", grid, (_SMALL_THREADS,))
        self._launch(
            "additive_mask", "cupykv_additive_mask", grid, (_SMALL_THREADS,),
            (out, self.lengths, np.int32(spec.batch), np.int32(q_len), np.int32(spec.max_seq),
             np.float32(MASK_VALUE)))
        return out

    def check(self) -> None:
        """Raise :class:`CacheOverflowError` if any sequence overflowed (synchronises).

        The flags stay set until :meth:`reset` clears those slots.

        Graph-safe: no — refused inside a captured step (CaptureError): it synchronises and reads the
        flags. Check after ``replay()``, or read ``cache.overflow`` with a kernel.

        Raises
        ------
        CacheOverflowError
            A sequence overflowed; the message names them.
        CaptureError
            Inside a captured step.
        """
        flags = self._backend.to_host(self.overflow)
        overflowed = np.flatnonzero(flags).tolist()
        if overflowed:
            raise CacheOverflowError.for_sequences(overflowed, self.spec.max_seq)
