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

import numpy as np

from cupykv import _args
from cupykv.backends.capture import refuse_in_capture

_AXES = {"NHD": "[n_layers, batch, max_seq, n_kv_heads, head_dim]",
         "HND": "[n_layers, batch, n_kv_heads, max_seq, head_dim]"}


# -- views -----------------------------------------------------------------------------------------
def layer(self, layer, layout=None):
    """Full-capacity ``(k, v)`` views of one layer, sharing memory with the cache (GraphSafeKV's ``attn``).

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
    """
    layer = _args.check_layer(layer, self.spec)
    layout = _args.check_view_layout(layout, self.spec)
    k, v = self.k[layer], self.v[layer]   # the cache's layout, [batch, ...]
    if layout != self.spec.layout:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    return k, v


def live(self, layer, seq=None, *, pending=0, layout=None):
    """Views of the live rows of one sequence of one layer (abaddon's ``get_kv``, GraphSafeKV's ``view``).

    Reads the lengths on the host (a synchronisation), so it is refused
    inside a captured step; inside a step use :meth:`layer`.

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
    layer = _args.check_layer(layer, spec)
    seq = _args.check_seq(seq, spec)
    pending = _args.check_pending(pending)
    layout = _args.check_view_layout(layout, spec)
    n = min(int(self.lengths_host()[seq]) + pending, spec.max_seq)
    k, v = self.layer(layer, layout)
    rows = (seq, slice(0, n)) if layout == "NHD" else (seq, slice(None), slice(0, n))
    return k[rows], v[rows]


# -- capacity --------------------------------------------------------------------------------------
def remaining_capacity(self) -> np.ndarray:
    """Positions left per sequence, ``max_seq - lengths``, as NumPy int64 ``[batch]`` (synchronises).

    Refused inside a captured step; there, ``cache.overflow`` (device int32
    ``[batch]``) is the answer, read after replay or by a kernel.
    """
    refuse_in_capture("cache.remaining_capacity() (it reads the lengths on the host)",
                      "check cache.overflow after replay(), or call it outside the step")
    return self.spec.max_seq - self.lengths_host().astype(np.int64)


def has_capacity(self, n=1) -> np.ndarray:
    """Whether each sequence has room for ``n`` more rows: ``lengths + n <= max_seq``, NumPy bool ``[batch]``.

    Refused inside a captured step (it synchronises); see :meth:`remaining_capacity`.

    Parameters
    ----------
    n : int or int sequence ``[batch]``
        Rows, each in ``0..2**31-1``. Pending rows are not counted: ask for
        them too.

    Returns
    -------
    numpy.ndarray, bool, shape ``[batch]``
    """
    refuse_in_capture("cache.has_capacity() (it reads the lengths on the host)",
                      "check cache.overflow after replay(), or call it outside the step")
    n = _args.check_capacity_request(n, self.spec)
    return self.remaining_capacity() >= n


# -- footprint -------------------------------------------------------------------------------------
def nbytes(self) -> int:
    """Device bytes this cache allocated: K, V, its overflow flags and staging, and its lengths unless shared."""
    owned = [self.k, self.v, self.overflow, self._per_seq] + ([] if self.shares_lengths else [self.lengths])
    return int(sum(a.nbytes for a in owned))


def kv_cache_repr(self) -> str:
    """``KVCache(shape=... [axes], dtype=..., layout=..., backend=..., <size> MiB)``."""
    spec = self.spec
    shared = ", shared lengths" if self.shares_lengths else ""
    return (f"KVCache(shape={spec.shape} {_AXES[spec.layout]}, dtype={spec.dtype}, layout={spec.layout}, "
            f"backend={self.backend}, {self.nbytes / 2**20:.3g} MiB{shared})")
