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

import bisect
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


class _RangeIndex:
    """Every live owner's buffer ranges, sorted by start, rebuilt only when an owner comes or goes.

    A check then costs a binary search plus the ranges that reach its bytes, not a pass over every
    live cache and plan: a long-running process (a test session, a server) keeps many of them.
    """

    def __init__(self) -> None:
        self.stale = True
        self.starts: list[int] = []
        self.reach: list[int] = []   # reach[i]: the largest end of ranges 0..i (ranges may overlap)
        self.entries: list[tuple[int, int, str, weakref.ref[BufferOwner]]] = []

    def invalidate(self) -> None:
        self.stale = True

    def overlapping(self, first: int, last: int) -> list[tuple[BufferOwner, str, int]]:
        """``(owner, what, common bytes)`` of every live range that shares bytes with ``[first, last)``."""
        if self.stale:
            self._rebuild()
        found = []
        i = bisect.bisect_left(self.starts, last) - 1   # ranges 0..i start before `last`
        while i >= 0 and self.reach[i] > first:
            start, end, what, ref = self.entries[i]
            owner = ref()
            common = min(last, end) - max(first, start)
            if owner is not None and common > 0:
                found.append((owner, what, common))
            i -= 1
        return found

    def _rebuild(self) -> None:
        entries = sorted(((start, end, what, weakref.ref(owner)) for owner in tuple(_live_owners)
                          for what, start, end in owner.owned_ranges()), key=lambda entry: entry[:3])
        self.entries, self.starts, self.reach, reach = entries, [entry[0] for entry in entries], [], 0
        for _, end, _, _ in entries:
            reach = max(reach, end)
            self.reach.append(reach)
        self.stale = False


_index = _RangeIndex()


def register_buffers(owner: BufferOwner) -> None:
    """Remember ``owner`` while it lives: a KVCache or AttentionPlan, whose ``owned_ranges()`` gives
    ``(what, first, last)`` tuples."""
    _live_owners.add(owner)
    _index.invalidate()
    weakref.finalize(owner, _index.invalidate)


def check_apart_from_caches(name: str, array: DeviceArray, own: BufferOwner | None = None, *, others: bool = True,
                            shareable: tuple[str, ...] = ()) -> None:
    """ValueError, naming ``name``, when ``array`` shares memory with a cache's or a plan's buffers.

    ``own`` (the call's cache) is named "the cache's ..."; with ``others``,
    every other live KVCache and AttentionPlan is checked too ("a KVCache's
    ...", "an AttentionPlan's ..."). Buffers whose description is in
    ``shareable`` (``("lengths",)`` for a cache's shared lengths) may overlap.
    The ranges of every live owner are kept sorted (rebuilt when one is made
    or freed), so a check costs a binary search, whatever the number of live
    caches and plans.
    """
    first, last = byte_range(array)
    hits = []
    if own is not None and own not in _live_owners:   # not registered (yet): checked directly
        hits = [(own, what, min(last, end) - max(first, start)) for what, start, end in own.owned_ranges()
                if min(last, end) - max(first, start) > 0]
    hits += [hit for hit in _index.overlapping(first, last) if others or hit[0] is own]
    hits = [hit for hit in hits if hit[1] not in shareable]
    if not hits:
        return
    owner, what, common = next((hit for hit in hits if hit[0] is own), hits[0])   # the call's own cache first
    kind = type(owner).__name__
    whose = "the cache's" if owner is own else f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}'s"
    raise ValueError(f"{name}: expected an array that does not overlap {whose} {what}, "
                     f"got one that shares {common} bytes with it")
