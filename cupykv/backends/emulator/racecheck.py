"""The race checker's Python side: the launch's memory regions in, a readable report out.

Before a launch, :func:`regions` turns the array arguments into the runtime's region table:
overlapping arguments merge into one region, which is *writable* (its races are checked)
when any of them is passed to a non-const pointer parameter. After the launch,
:func:`hazards` reads what the runtime found (racecheck.cpp) and :func:`race_error` words it:
the kernel, both threads, both source lines, the memory and the byte offset, the count.

``CUPYKV_EMULATOR_RACECHECK=0`` turns the checker off (read at every launch).
"""

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from . import build, memory, sites
from .errors import RaceError, UninitializedReadError

ENV = "CUPYKV_EMULATOR_RACECHECK"
CHECK_RACES = 1             # CUEMU_CHECK_RACES
_KINDS = ("read-after-write", "write-after-read", "write-after-write", "uninitialized read")
UNINITIALIZED = _KINDS[3]   # CUEMU_UNINIT: one access, no race
_MAX_SHOWN = 8              # hazard groups written out in one message


def enabled():
    """Whether launches check races (default yes; ``CUPYKV_EMULATOR_RACECHECK=0``: no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class Region:
    """One region of the launch's table: bytes [lo, hi) and the arguments over them."""

    lo: int
    hi: int
    writable: bool
    members: list   # [(argument index, array, data pointer, writable)]


def regions(bindings, writable):
    """``(ctypes array, [Region])`` for the bound array arguments.

    Args:
        bindings: ``[(index, array, pointer, allocation)]`` as launch.py binds them.
        writable: per parameter, whether it is a non-const pointer.
    """
    spans = []
    for i, a, ptr, _ in bindings:
        lo, hi = memory.byte_extent(a)
        lo, hi = ptr + (lo - memory.data_ptr(a)), ptr + (hi - memory.data_ptr(a))
        if hi > lo:
            spans.append((lo, hi, i, a, ptr, writable[i]))
    spans.sort(key=lambda s: s[0])
    merged = []
    for lo, hi, i, a, ptr, w in spans:
        if merged and lo < merged[-1].hi:
            r = merged[-1]
            r.hi, r.writable = max(r.hi, hi), r.writable or w
            r.members.append((i, a, ptr, w))
        else:
            merged.append(Region(lo, hi, w, [(i, a, ptr, w)]))
    table = (build._Region * max(len(merged), 1))()
    for k, r in enumerate(merged):
        table[k].lo, table[k].hi, table[k].writable = r.lo, r.hi, int(r.writable)
    return table, merged


@dataclass(frozen=True)
class Access:
    """One side of a hazard."""

    kind: str       # "read", "write" or "atomic"
    block: tuple    # (x, y, z)
    thread: tuple   # (x, y, z)
    site: str       # "file.cu:LINE"


@dataclass(frozen=True)
class Hazard:
    """Two unordered accesses to one byte: the first example of ``count`` between two sites."""

    kind: str       # "read-after-write", "write-after-read", "write-after-write" or UNINITIALIZED
    memory: str     # "shared" or "global"
    where: str      # the memory (dynamic shared memory, a static __shared__ variable, an argument)
    offset: int     # and the byte offset in it
    first: Access
    second: Access
    count: int


def hazards(lib):
    """``(raw hazards, dropped, same_value_writes)`` of the last launch."""
    ptr = ctypes.POINTER(build._Hazard)()
    dropped, same = ctypes.c_uint64(), ctypes.c_uint64()
    n = lib.cuemu_race_hazards(ctypes.byref(ptr), ctypes.byref(dropped), ctypes.byref(same))
    found = [build._Hazard.from_buffer_copy(ptr[i]) for i in range(n)]
    return found, dropped.value, same.value


def _unravel(linear, dims):
    x, rest = linear % dims[0], linear // dims[0]
    return (int(x), int(rest % dims[1]), int(rest // dims[1]))


def describe_global(region, offset):
    """(description, byte offset in the argument) of a byte of a global region."""
    addr = region.lo + offset
    for i, a, ptr, w in sorted(region.members, key=lambda m: not m[3]):
        nbytes = a.size * a.itemsize
        if ptr <= addr < ptr + nbytes:
            byte = addr - ptr
            element = byte // a.itemsize
            index = ""
            if a.flags.c_contiguous and a.ndim > 1:
                index = f" {tuple(int(v) for v in np.unravel_index(element, a.shape))}"
            return f"argument {i} ({a.dtype} array of shape {a.shape}) element {element}{index}", byte
    return "a region of arguments", offset


def dynamic_shared_place(offset):
    """``(words, offset as on a GPU)`` of byte ``offset`` of the dynamic shared memory (the
    emulator's, whose shared arrays lie gaps apart): the arrays (kernels/shared_layout.cuh) of the
    last block that hold it, "" where the kernel carved none there."""
    out = ctypes.create_string_buffer(512)
    gpu_offset = build.runtime().cuemu_dynamic_shared_place(offset, out, len(out))
    return out.value.decode(), int(gpu_offset)


def _where(h, table, module_path):
    """(memory, description, byte offset in what the description names)."""
    if h.region == 0:
        named, offset = dynamic_shared_place(h.offset)
        return "shared", f"dynamic shared memory ({named})" if named else "dynamic shared memory", offset
    if h.region == 1:
        found = sites.static_shared_variable(module_path, h.offset)
        if found:
            return "shared", f"static __shared__ {found[0]}", found[1]
        return "shared", "static shared memory", h.offset
    return ("global", *describe_global(table[h.region - 2], h.offset))


def _side(h, k):
    if h.atomic[k]:
        return "atomic"
    writes = {0: (True, False), 1: (False, True), 2: (True, True), 3: (False, False)}[h.kind]
    return "write" if writes[k] else "read"


def describe(raw, table, module_path, grid, block):
    """[Hazard] for the runtime's raw hazards (most frequent first)."""
    site_names = sites.describe_sites(module_path, {s for h in raw for s in h.site})
    out = []
    for h in raw:
        memory_kind, where, offset = _where(h, table, module_path)
        first, second = (Access(_side(h, k), _unravel(h.block[k], grid), _unravel(h.thread[k], block),
                                site_names[h.site[k]]) for k in (0, 1))
        out.append(Hazard(_KINDS[h.kind], memory_kind, where, int(offset), first, second, int(h.count)))
    out.sort(key=lambda z: -z.count)
    return out


def _triple(v):
    return f"({v[0]},{v[1]},{v[2]})"


def launch_error(kernel, found, dropped, hint=""):
    """The error for a launch's hazards ``found`` (a list of Hazard): a RaceError when there is a
    race (``dropped`` counts hazards past the table), else an UninitializedReadError."""
    races = [h for h in found if h.kind != UNINITIALIZED]
    if races or dropped:
        return race_error(kernel, races, dropped, hint)
    total = sum(h.count for h in found)
    lines = [f"kernel {kernel!r}: read of shared memory that no thread of its block wrote ({total} "
             f"read{'s' * (total != 1)} at {len(found)} call site{'s' * (len(found) != 1)}){hint}"]
    for h in found[:_MAX_SHOWN]:
        a = h.second
        lines.append(f"  {a.kind} of {h.where}, byte offset {h.offset}, at {a.site} by block "
                     f"{_triple(a.block)} thread {_triple(a.thread)} ({h.count} like it)")
    if len(found) > _MAX_SHOWN:
        lines.append(f"  ... and {len(found) - _MAX_SHOWN} more call sites")
    lines.append("  A GPU returns whatever an earlier block or launch left in those bytes: write them "
                 "first (with a __syncthreads() before other threads read them).")
    return UninitializedReadError("\n".join(lines), found)


def race_error(kernel, found, dropped, hint=""):
    """The RaceError for a launch's hazards ``found`` (a list of Hazard)."""
    total = sum(h.count for h in found) + dropped
    spaces = " and ".join(sorted({f"{h.memory} memory" for h in found}))
    lines = [f"kernel {kernel!r}: data race in {spaces} ({total} hazard{'s' * (total != 1)} "
             f"between {len(found)} pair{'s' * (len(found) != 1)} of call sites){hint}"]
    for h in found[:_MAX_SHOWN]:
        lines.append(f"  {h.kind} on {h.where}, byte offset {h.offset} ({h.count} "
                     f"hazard{'s' * (h.count != 1)} like it):")
        for a in (h.first, h.second):
            lines.append(f"    {a.kind:<6} at {a.site} by block {_triple(a.block)} thread "
                         f"{_triple(a.thread)}")
    if len(found) > _MAX_SHOWN:
        lines.append(f"  ... and {len(found) - _MAX_SHOWN} more pairs of call sites")
    if dropped:
        lines.append(f"  ({dropped} hazards beyond the first 64 pairs of call sites are counted only)")
    lines.append("  Nothing orders the two accesses: no __syncthreads() between them, no __syncwarp() "
                 "or warp collective over both lanes, and they are not both atomic. Accesses of "
                 "different blocks are ordered only by a hand-off: __threadfence() then an atomic "
                 "on some address in the writer's block, an atomic on that address then "
                 "__threadfence() in the reader's, possibly relayed through other blocks.")
    return RaceError("\n".join(lines), found)
