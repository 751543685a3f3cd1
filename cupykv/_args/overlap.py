"""Aliasing: an array a kernel writes must not share memory with anything the same launch reads or writes.

Overlap is decided on address ranges, so views, reshapes and dtype views of
one buffer are all caught, whichever array object the caller holds. Address
ranges of NumPy (emulator) and CuPy arrays live in one address space each
(CUDA's unified addressing), so comparing them is exact.

Every live :class:`~cupykv.KVCache` and :class:`~cupykv.AttentionPlan`
registers the address ranges of its buffers here, so that no op's output,
whatever call it comes from, can write into a cache or a plan's workspace
(:func:`check_apart_from_caches`).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Protocol

import numpy as np

from cupykv._typing import DeviceArray

try:
    from numpy.lib.array_utils import byte_bounds   # NumPy >= 2.0
except ImportError:                                  # pragma: no cover (NumPy 1.x)
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]


class BufferOwner(Protocol):
    """A KVCache or an AttentionPlan: something whose buffers no op's output may write into."""

    def owned_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(what, first, last)`` byte addresses of each buffer it owns."""
        ...


class _DeviceInterface:
    """A CuPy array's memory described as NumPy's ``__array_interface__`` describes host memory."""

    def __init__(self, array: DeviceArray) -> None:
        self.__array_interface__ = {"data": (_pointer(array), False), "shape": tuple(array.shape),
                                    "strides": tuple(array.strides), "typestr": array.dtype.str, "version": 3}


def byte_range(array: DeviceArray) -> tuple[int, int]:
    """``[first, last)`` byte addresses ``array`` can touch (any strides, negative ones included)."""
    if array.size == 0:
        start: int = array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else _pointer(array)
        return start, start
    if isinstance(array, np.ndarray):
        return byte_bounds(array)
    return byte_bounds(_DeviceInterface(array))  # type: ignore[arg-type]  # it reads only __array_interface__


def _pointer(array: Any) -> int:
    """The device address of a CuPy array's first element."""
    return int(array.data.ptr)


def shared_bytes(a: DeviceArray, b: DeviceArray) -> int:
    """How many bytes the address ranges of ``a`` and ``b`` have in common."""
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return max(0, min(a1, b1) - max(a0, b0))


def check_no_overlap(name: str, array: DeviceArray, others: Iterable[tuple[str, DeviceArray | None]], *,
                     in_place_ok: bool = False) -> None:
    """ValueError, naming ``name``, when ``array`` overlaps one of ``others``.

    Parameters
    ----------
    name : str
        The argument the kernel writes (``"out"``), or one that must not touch
        what it writes.
    array : backend array
    others : iterable of (str, array or None)
        What it must not overlap, each with its description for the message
        (``("q", q)``); ``None`` entries are skipped.
    in_place_ok : bool
        ``array`` may be one of ``others`` exactly (the same bytes: an
        elementwise op that reads each element before writing it).
    """
    first, last = byte_range(array)
    for what, other in others:
        if other is None:
            continue
        start, end = byte_range(other)
        common = min(last, end) - max(first, start)
        if common <= 0 or (in_place_ok and (first, last) == (start, end)):
            continue
        if in_place_ok:
            raise ValueError(f"{name}: expected the very array given as {what} (in place) or one that does not "
                             f"overlap it, got one that shares {common} bytes with it")
        raise ValueError(f"{name}: expected an array that does not overlap {what}, "
                         f"got one that shares {common} bytes with it")


_live_owners: weakref.WeakSet[BufferOwner] = weakref.WeakSet()


def register_buffers(owner: BufferOwner) -> None:
    """Remember ``owner`` while it lives: a KVCache or AttentionPlan, whose ``owned_ranges()`` gives
    ``(what, first, last)`` tuples."""
    _live_owners.add(owner)


def check_apart_from_caches(name: str, array: DeviceArray, own: BufferOwner | None = None, *, others: bool = True,
                            shareable: tuple[str, ...] = ()) -> None:
    """ValueError, naming ``name``, when ``array`` shares memory with a cache's or a plan's buffers.

    ``own`` (the call's cache) is named "the cache's ..."; with ``others``,
    every other live KVCache and AttentionPlan is checked too ("a KVCache's
    ...", "an AttentionPlan's ..."). Buffers whose description is in
    ``shareable`` (``("lengths",)`` for a cache's shared lengths) may overlap.
    The ranges were taken once per owner, so this costs one range and a few
    comparisons per owner.
    """
    first, last = byte_range(array)
    owners = [own] if own is not None else []
    if others:
        owners += [owner for owner in tuple(_live_owners) if owner is not own]
    for owner in owners:
        kind = type(owner).__name__
        whose = "the cache's" if owner is own else f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}'s"
        for what, start, end in owner.owned_ranges():
            if what in shareable:
                continue
            common = min(last, end) - max(first, start)
            if common > 0:
                raise ValueError(f"{name}: expected an array that does not overlap {whose} {what}, "
                                 f"got one that shares {common} bytes with it")
