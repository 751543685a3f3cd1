"""What a KVCache shows of itself: layer and live views, capacity queries, footprint.

The functions here are methods of :class:`cupykv.KVCache`: its class body
binds them, so they are documented there and this module stays small. They
read the cache's ``spec``, ``k``, ``v`` and ``lengths`` and launch nothing.
Views share memory with the cache (no copy). The calls that read lengths on
the host synchronise and are refused inside a captured step; on the device,
``cache.overflow`` is the answer to "did anything not fit" (see
``docs/contract.md``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt

from cupykv import _args
from cupykv._typing import DeviceArray, IntLike
from cupykv.backends.capture import refuse_in_capture

if TYPE_CHECKING:
    from cupykv.cache import KVCache

_AXES = {"NHD": "[n_layers, batch, max_seq, n_kv_heads, head_dim]",
         "HND": "[n_layers, batch, n_kv_heads, max_seq, head_dim]"}


# -- views -----------------------------------------------------------------------------------------
def layer(self: KVCache, layer: IntLike, layout: str | None = None) -> tuple[DeviceArray, DeviceArray]:
    """Full-capacity ``(k, v)`` views of one layer, sharing memory with the cache (GraphSafeKV's ``attn``).

    Graph-safe: yes — views only: no launch, allocation or host read.

    Parameters
    ----------
    layer : int
        Layer index in ``0..n_layers-1``.
    layout : {None, "NHD", "HND"}
        ``None``: the cache's layout. The other layout is a transposed view
        (free, no copy; not C-contiguous, so cupykv ops refuse it as input).

    Returns
    -------
    (k, v) : device array views
        ``[batch, max_seq, n_kv_heads, head_dim]`` (NHD) or
        ``[batch, n_kv_heads, max_seq, head_dim]`` (HND). Every position is
        there, live or not: mask by the device lengths, or use
        :func:`cupykv.attention`, which skips the tail. Writing through the
        views writes the cache. No host read: usable inside a captured step.

    Raises
    ------
    TypeError, ValueError
        ``layer`` is not an int in ``0..n_layers-1``, or ``layout`` not one of the choices.
    """
    index = _args.check_layer(layer, self.spec)
    layout = _args.check_view_layout(layout, self.spec)
    k, v = self.k[index], self.v[index]   # the cache's layout, [batch, ...]
    if layout != self.spec.layout:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    return k, v


def live(self: KVCache, layer: IntLike, seq: IntLike | None = None, *, pending: IntLike = 0,
         layout: str | None = None) -> tuple[DeviceArray, DeviceArray]:
    """Views of the live rows of one sequence of one layer (abaddon's ``get_kv``, GraphSafeKV's ``view``).

    Graph-safe: no — refused inside a captured step (CaptureError): it reads
    the lengths on the host (a synchronisation); inside a step use :meth:`layer`.

    Parameters
    ----------
    layer : int
        Layer index in ``0..n_layers-1``.
    seq : int or None
        Sequence index in ``0..batch-1``; ``None`` for a cache of batch 1.
    pending : int, default 0
        Rows appended since the last :meth:`advance` to include (the
        ``n_new`` of the append): the cache does not count pending rows
        itself, since a replayed graph appends without the host knowing.
        ``0..2**30-1``; the view stops at ``max_seq``.
    layout : {None, "NHD", "HND"}
        As for :meth:`layer`.

    Returns
    -------
    (k, v) : device array views, sharing memory with the cache
        ``[n, n_kv_heads, head_dim]`` (NHD) or ``[n_kv_heads, n, head_dim]``
        (HND), ``n = min(lengths[seq] + pending, max_seq)``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments. ``CaptureError`` inside a captured step.
    """
    refuse_in_capture("cache.live() (it reads the lengths on the host)",
                      "use cache.layer() views inside the step and read live rows after replay()")
    spec = self.spec
    index = _args.check_layer(layer, spec)
    b = _args.check_seq(seq, spec)
    rows_pending = _args.check_pending(pending)
    layout = _args.check_view_layout(layout, spec)
    n = min(int(self.lengths_host()[b]) + rows_pending, spec.max_seq)
    k, v = self.layer(index, layout)
    rows = (b, slice(0, n)) if layout == "NHD" else (b, slice(None), slice(0, n))
    return k[rows], v[rows]


# -- capacity --------------------------------------------------------------------------------------
def remaining_capacity(self: KVCache) -> npt.NDArray[np.int64]:
    """Positions left per sequence, ``max_seq - lengths``, as NumPy int64 ``[batch]`` (synchronises).

    Refused inside a captured step; there, ``cache.overflow`` (device int32
    ``[batch]``) is the answer, read after replay or by a kernel.

    Graph-safe: no — refused inside a captured step (CaptureError): it synchronises and reads the lengths.

    Raises
    ------
    CaptureError
        Inside a captured step.
    """
    refuse_in_capture("cache.remaining_capacity() (it reads the lengths on the host)",
                      "check cache.overflow after replay(), or call it outside the step")
    remaining: npt.NDArray[np.int64] = self.spec.max_seq - self.lengths_host().astype(np.int64)
    return remaining


def has_capacity(self: KVCache, n: IntLike | Sequence[IntLike] | npt.NDArray[np.integer[Any]] = 1
                 ) -> npt.NDArray[np.bool_]:
    """Whether each sequence has room for ``n`` more rows: ``lengths + n <= max_seq``, NumPy bool ``[batch]``.

    Graph-safe: no — refused inside a captured step (CaptureError): it synchronises and reads the lengths;
    see :meth:`remaining_capacity`.

    Parameters
    ----------
    n : int or int sequence ``[batch]``
        Rows, each in ``0..2**31-1``. Pending rows are not counted: ask for
        them too.

    Returns
    -------
    numpy.ndarray, bool, shape ``[batch]``

    Raises
    ------
    TypeError, ValueError
        Bad ``n``.
    CaptureError
        Inside a captured step.
    """
    refuse_in_capture("cache.has_capacity() (it reads the lengths on the host)",
                      "check cache.overflow after replay(), or call it outside the step")
    fits: npt.NDArray[np.bool_] = self.remaining_capacity() >= _args.check_capacity_request(n, self.spec)
    return fits


# -- footprint -------------------------------------------------------------------------------------
def nbytes(self: KVCache) -> int:
    """Device bytes this cache allocated: K, V, its scales, overflow flags and staging, and its lengths unless shared."""
    owned = [self.k, self.v, self.k_scales, self.v_scales, self.overflow, self._per_seq] + \
        ([] if self.shares_lengths else [self.lengths])
    return int(sum(a.nbytes for a in owned))


def kv_cache_repr(self: KVCache) -> str:
    """``KVCache(shape=... [axes], dtype=..., layout=..., backend=..., <size> MiB)``."""
    spec = self.spec
    shared = ", shared lengths" if self.shares_lengths else ""
    io = f", io_dtype={spec.io_dtype}" if spec.io_dtype != spec.dtype else ""
    return (f"KVCache(shape={spec.shape} {_AXES[spec.layout]}, dtype={spec.dtype}{io}, layout={spec.layout}, "
            f"backend={self.backend}, {self.nbytes / 2**20:.3g} MiB{shared})")
