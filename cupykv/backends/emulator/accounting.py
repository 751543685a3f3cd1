"""Memory-traffic accounting of emulator launches: bytes, 32-byte sectors, sectors per request.

Inside ``with traffic() as t:`` every emulator launch also runs the traffic counter
(traffic.cpp, an observer of the same access path as the race checker) and appends a
:class:`LaunchTraffic` to ``t.launches``::

    with emulator.traffic() as t:
        cupykv.attention(q, cache, 0)
    k = t.launches[0].of(cache.k)         # ArgumentTraffic of the argument cache.k
    k.bytes_loaded, k.sectors_loaded      # bytes (repeats included), distinct 32-byte sectors
    k.touched("load")                     # bool [nbytes]: exactly which bytes were read
    t.launches[0].coalescing()            # sectors per request, sectors against the ideal
    print(t.report())

With ``traffic(banks=True)`` each launch also counts shared-memory bank wavefronts per call
site (banks.cpp has the model): ``t.launches[0].shared_sites`` lists :class:`SharedSite`
records (``file:line``, requests, wavefronts, the conflict-free ideal), and
``bank_conflicts()`` the sites whose requests take more wavefronts than they need.

Every traffic launch also counts, per source line, the outcomes of the run-time tests that the
kernels mark ``CUPYKV_COMMON_PATH`` (kernels/common.cuh; the instruction count of ``python -m
cupykv check --steps`` assumes their common outcome): ``t.launches[0].outcomes("attention_mma.cu:LINE")``
is ``{value: thread evaluations}``, so how often a hot loop leaves its common path (a masked step, a
rescale) can be held to what the design says.

Sectors are 32-byte pieces of an allocation counted from its start, as a GPU allocation
starts on a sector boundary (the emulator's start only on 16 bytes). A request is one
dynamic instance of one memory instruction across the lanes of a warp; the lanes' accesses
are grouped by call site and visit count (see traffic.cpp). Outside the block nothing is
counted and launches cost what they did.
"""

import contextlib
import ctypes
import dataclasses
import math
import os
from dataclasses import dataclass, field

import numpy as np

from . import build, memory, sites
from .errors import EmulatorError

CHECK_TRAFFIC = 2           # CUEMU_CHECK_TRAFFIC
CHECK_BANKS = 4             # CUEMU_CHECK_BANKS
SECTOR = 32                 # bytes per sector
KINDS = ("load", "store", "atomic")
SHARED_MEMORIES = ("dynamic", "static")   # cuemu_bank_site.region

_collectors = []            # the Traffic objects of the traffic() blocks now open


class _Result(ctypes.Structure):   # cuemu_traffic (cuemu_abi.h)
    _fields_ = [("bytes", ctypes.c_uint64 * 3), ("accesses", ctypes.c_uint64 * 3),
                ("requests", ctypes.c_uint64 * 3), ("request_sectors", ctypes.c_uint64 * 3),
                ("bits", ctypes.c_void_p * 3), ("nbits", ctypes.c_uint64)]


class _BankSite(ctypes.Structure):   # cuemu_bank_site (cuemu_abi.h)
    _fields_ = [("site", ctypes.c_uint32), ("kind", ctypes.c_uint32), ("region", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32), ("accesses", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("requests", ctypes.c_uint64), ("wavefronts", ctypes.c_uint64), ("ideal", ctypes.c_uint64),
                ("extent", ctypes.c_uint64)]


class _PathOutcome(ctypes.Structure):   # cuemu_path_outcome (cuemu_abi.h)
    _fields_ = [("file", ctypes.c_char_p), ("line", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("value", ctypes.c_int64), ("count", ctypes.c_uint64)]


class _WarpMma(ctypes.Structure):   # cuemu_warp_mma (cuemu_abi.h)
    _fields_ = [("block", ctypes.c_uint64), ("warp", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("count", ctypes.c_uint64)]


def active():
    """Whether a :func:`traffic` block is open (launches then count their traffic)."""
    return bool(_collectors)


def banks_active():
    """Whether an open :func:`traffic` block counts shared-memory bank wavefronts."""
    return any(c.banks for c in _collectors)


@dataclass(frozen=True)
class Counts:
    """One kind of access (load, store or atomic) to some memory in one launch."""

    bytes: int = 0            # bytes accessed, repeats included
    accesses: int = 0         # accesses of single threads
    requests: int = 0         # warp-level requests (global memory only)
    request_sectors: int = 0  # distinct sectors of each request, summed
    sectors: int = 0          # distinct sectors touched (global memory only)
    touched_bytes: int = 0    # distinct bytes touched (global memory only)

    @property
    def sectors_per_request(self):
        """Average distinct 32-byte sectors of one warp-level request (0.0 without requests)."""
        return self.request_sectors / self.requests if self.requests else 0.0

    def __add__(self, other):
        return Counts(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self):
        return (self.bytes, self.accesses, self.requests, self.request_sectors, self.sectors,
                self.touched_bytes)


@dataclass(frozen=True, eq=False)
class _Region:
    """One region of the launch's table: its counts and touched-byte bitmaps."""

    nbytes: int
    phase: int                # (start - allocation start) % 32
    counts: tuple             # Counts per kind
    bits: tuple               # per kind: packed little-endian bits from (start - phase), or None

    def mask(self, kind, offset, nbytes):
        bits = self.bits[KINDS.index(kind)]
        if bits is None:
            return np.zeros(nbytes, bool)
        start = self.phase + offset
        first = start // 8
        raw = np.unpackbits(bits[first:(start + nbytes + 7) // 8], bitorder="little")
        return raw[start - 8 * first:start - 8 * first + nbytes].astype(bool)


@dataclass(frozen=True)
class ArgumentTraffic:
    """What one launch did to the bytes of one array argument.

    Counts cover the argument's region; arguments whose bytes overlap share one region
    (``shares_region`` lists the others) and then share its counts. Byte offsets are
    from the argument's lowest byte.
    """

    index: int                # position in the kernel's parameter list
    type: str                 # the parameter's C++ type
    nbytes: int
    shares_region: tuple      # indices of other arguments over the same bytes
    _region: _Region = field(repr=False)
    _offset: int = field(repr=False)   # bytes from the region's start

    def counts(self, kind="load"):
        """:class:`Counts` of ``kind`` ("load", "store" or "atomic")."""
        return self._region.counts[KINDS.index(kind)]

    @property
    def bytes_loaded(self):
        return self.counts("load").bytes

    @property
    def bytes_stored(self):
        return self.counts("store").bytes

    @property
    def sectors_loaded(self):
        return self.counts("load").sectors

    @property
    def sectors_stored(self):
        return self.counts("store").sectors

    @property
    def phase(self):
        """Where byte 0 sits in its 32-byte sector: sector ``s`` holds bytes
        ``[32 s - phase, 32 s + 32 - phase)``."""
        return (self._region.phase + self._offset) % SECTOR

    def touched(self, kind="load"):
        """bool ``[nbytes]``: the bytes accessed by ``kind`` at least once."""
        return self._region.mask(kind, self._offset, self.nbytes)

    def sectors(self, kind="load"):
        """Sorted ids of the sectors accessed by ``kind`` (see :attr:`phase`)."""
        return self.sectors_of(self.touched(kind))

    def sectors_of(self, mask):
        """Sorted ids of the sectors that hold a ``True`` byte of a bool mask ``[nbytes]``."""
        offsets = np.flatnonzero(np.asarray(mask, bool)) + self.phase
        return np.unique(offsets // SECTOR)

    def ranges(self, kind="load"):
        """int64 ``[n, 2]``: the maximal byte ranges ``[lo, hi)`` accessed by ``kind``."""
        edges = np.diff(np.concatenate(([0], self.touched(kind).view(np.int8), [0])))
        return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


@dataclass(frozen=True)
class Coalescing:
    """How a launch's accesses of one kind pack into sectors (CPU-measured, not GPU figures)."""

    sectors_per_request: float   # average distinct sectors of one warp-level request
    sectors: int                 # distinct sectors touched
    ideal_sectors: int           # ceil(bytes needed / 32)
    ratio: float                 # sectors / ideal_sectors: 1.0 reads nothing it does not need
    requested_ratio: float       # sectors of all requests / ideal_sectors: > 1 when re-requested


@dataclass(frozen=True)
class SharedSite:
    """The shared-memory accesses of one call site and kind in one launch, in bank wavefronts.

    CPU-measured under the model of banks.cpp (32 banks of 4-byte words; a warp request of
    4-byte accesses is one phase of 32 lanes, of 8-byte ones two of 16, of wider ones four of 8;
    a phase takes as many wavefronts as the most distinct words in one bank), not GPU figures.
    """

    site: str                 # file:line of the access (a header line names the kernel line too)
    kind: str                 # "load", "store" or "atomic"
    memory: str               # "dynamic" or "static" shared memory
    accesses: int             # accesses of single threads
    bytes: int                # bytes accessed, repeats included
    requests: int             # warp-level requests
    wavefronts: int           # bank wavefronts of the requests, summed
    ideal: int                # the wavefronts the same requests need without bank conflicts
    extent: int = 0           # the highest byte offset + 1 that an access of the site reached

    @property
    def wavefronts_per_request(self):
        return self.wavefronts / self.requests if self.requests else 0.0

    @property
    def conflict_ratio(self):
        """wavefronts / ideal: 1.0 without bank conflicts, 32.0 for a 32-way conflict."""
        return self.wavefronts / self.ideal if self.ideal else 0.0


@dataclass(frozen=True)
class CopyWaits:
    """The asynchronous-copy waits (``cp_async_wait<N>``) of one launch, summed over threads: how much
    a pipeline overlapped its copies with its compute."""

    waits: int             # waits by single threads
    in_flight: int         # waits after which the thread still had copies in flight
    bytes_in_flight: int   # the bytes of those copies, summed over the waits


@dataclass(frozen=True)
class LaunchTraffic:
    """The memory traffic of one kernel launch."""

    kernel: str
    grid: tuple
    block: tuple
    shared_mem: int
    arguments: tuple             # ArgumentTraffic of the array arguments, by index
    extents: tuple = field(repr=False)   # per argument: its (lo, hi) byte addresses as passed
    shared_sites: tuple = ()     # SharedSite per call site and kind (inside traffic(banks=True))
    path_outcomes: tuple = ()    # (site, value, thread evaluations) of each CUPYKV_COMMON_PATH test
    copy_waits: CopyWaits = field(default_factory=lambda: CopyWaits(0, 0, 0))
    warp_mma: tuple = ()         # ((block, warp), mma.sync instructions) of each warp that issued one

    def mma_per_warp(self):
        """``{(block, warp): mma.sync instructions}`` of every warp that issued one: ``block`` the
        linear block index (x fastest), ``warp`` the thread index in the block over 32."""
        return dict(self.warp_mma)

    def outcomes(self, site):
        """``{value: thread evaluations}`` of the ``CUPYKV_COMMON_PATH`` test at ``site``
        (``'name.cu:LINE'``, where the macro stands), empty where no thread reached it."""
        return {value: count for where, value, count in self.path_outcomes if where == site}

    def argument(self, index):
        """The :class:`ArgumentTraffic` of argument ``index``."""
        for a in self.arguments:
            if a.index == index:
                return a
        raise KeyError(f"kernel {self.kernel!r}: argument {index} is not a non-empty array")

    def of(self, array):
        """The :class:`ArgumentTraffic` of the argument that is ``array`` (same bytes)."""
        extent = memory.byte_extent(array)
        for a, e in zip(self.arguments, self.extents):
            if e == extent:
                return a
        raise KeyError(f"kernel {self.kernel!r}: no argument covers exactly the bytes of that array")

    def total(self, kind="load", arrays=None):
        """:class:`Counts` of ``kind`` over global memory (or over the arguments ``arrays``)."""
        args = self.arguments if arrays is None else [self.of(a) for a in arrays]
        regions = {id(a._region): a._region for a in args}
        return sum((r.counts[KINDS.index(kind)] for r in regions.values()), Counts())

    def coalescing(self, kind="load", arrays=None, needed_bytes=None):
        """:class:`Coalescing` of ``kind`` over global memory (or the arguments ``arrays``).

        ``needed_bytes``: what the op must access; by default the distinct bytes it did.
        """
        c = self.total(kind, arrays)
        ideal = math.ceil((c.touched_bytes if needed_bytes is None else needed_bytes) / SECTOR)
        return Coalescing(c.sectors_per_request, c.sectors, ideal, c.sectors / ideal if ideal else 0.0,
                          c.request_sectors / ideal if ideal else 0.0)

    def shared_total(self, kind=None):
        """(requests, wavefronts, ideal) of the shared-memory accesses of ``kind`` (all kinds when
        None), summed over call sites; zeros outside ``traffic(banks=True)``."""
        chosen = [s for s in self.shared_sites if kind is None or s.kind == kind]
        return tuple(sum(getattr(s, f) for s in chosen) for f in ("requests", "wavefronts", "ideal"))

    def bank_conflicts(self):
        """The :class:`SharedSite` records whose requests take more wavefronts than their ideal,
        most excess wavefronts first."""
        return sorted((s for s in self.shared_sites if s.wavefronts > s.ideal),
                      key=lambda s: (s.ideal - s.wavefronts, s.site, s.kind))

    def shared_extent(self, memory="dynamic"):
        """Bytes of ``memory`` ("dynamic" or "static" shared memory) that the launch's accesses
        reached: the highest offset accessed + 1, in any block (0 outside ``traffic(banks=True)``).
        Beside ``shared_mem``, what the launch declared, it shows dynamic shared memory declared
        and never used, which costs occupancy on a GPU and nothing on the emulator."""
        return max((s.extent for s in self.shared_sites if s.memory == memory), default=0)

    def report(self):
        """A few lines: per argument, bytes, distinct sectors and sectors per request; with bank
        counting, per shared-memory call site, requests and wavefronts against the ideal."""
        dims = "x".join(str(d) for d in self.grid), "x".join(str(d) for d in self.block)
        lines = [f"{self.kernel}  grid {dims[0]}  block {dims[1]}"]
        lines.append(f"  {'arg':>3} {'type':<24}{'':>2}{'bytes':>12} {'sectors':>9} {'ideal':>8} "
                     f"{'requests':>9} {'sec/req':>7}")
        for a in self.arguments:
            for kind in KINDS:
                c = a.counts(kind)
                if c.accesses:
                    lines.append(f"  {a.index:>3} {a.type[:24]:<24}{kind[0].upper():>2}{c.bytes:>12} {c.sectors:>9} "
                                 f"{math.ceil(c.touched_bytes / SECTOR):>8} {c.requests:>9} "
                                 f"{c.sectors_per_request:>7.2f}")
        if self.shared_sites:
            lines.append(f"  {'shared memory site':<64}{'':>2}{'requests':>9} {'wavefronts':>10} {'ideal':>8} "
                         f"{'ratio':>6}")
            for s in self.shared_sites:
                where = f"{s.memory[:3]} {s.site}"
                lines.append(f"  {where[:64]:<64}{s.kind[0].upper():>2}{s.requests:>9} "
                             f"{s.wavefronts:>10} {s.ideal:>8} {s.conflict_ratio:>6.2f}")
        return "\n".join(lines)


class Traffic:
    """The launches of one :func:`traffic` block, in order (``launches``); ``banks``: whether
    they count shared-memory bank wavefronts."""

    def __init__(self, banks=False):
        self.launches = []
        self.banks = banks

    def kernels(self, prefix):
        """The launches whose kernel name starts with ``prefix``."""
        return [t for t in self.launches if t.kernel.startswith(prefix)]

    def report(self):
        """Every launch's :meth:`LaunchTraffic.report`, one after another."""
        return "\n".join(t.report() for t in self.launches) or "(no launches)"

    def clear(self):
        self.launches.clear()


@contextlib.contextmanager
def traffic(banks=False):
    """Counts the memory traffic of every emulator launch while the block runs.

    Yields a :class:`Traffic`. Blocks may nest (each sees the launches inside it). The race
    checker keeps running; both observe the same accesses. ``banks=True`` also counts the
    shared-memory bank wavefronts of every call site (``LaunchTraffic.shared_sites``), which
    makes launches slower; a launch counts them while any open block asks for them.

    Raises:
        EmulatorError: modules are built without instrumentation here (no shadow memory),
            so accesses cannot be seen.
    """
    if not build.instrumented():
        raise EmulatorError("emulator: traffic accounting needs instrumented modules, and this "
                            "process could not map their shadow memory")
    collector = Traffic(banks=bool(banks))
    _collectors.append(collector)
    try:
        yield collector
    finally:
        _collectors.remove(collector)


# ---- called by launch.py ----------------------------------------------------------------
def _phase(region):
    """Where a region starts in a 32-byte sector of its allocation."""
    alloc = memory.find(region.lo)
    return (region.lo - (alloc.start if alloc is not None else 0)) % SECTOR


def set_phases(table, regions):
    """Writes each region's sector phase into the runtime's region table."""
    for k, r in enumerate(regions):
        table[k].sector_phase = _phase(r)


def _results(lib, name, record):
    """The runtime's export ``name`` (``uint32_t name(const record** out)``), its types declared once."""
    function = getattr(lib, name)
    if function.restype is not ctypes.c_uint32:
        function.argtypes = [ctypes.POINTER(ctypes.POINTER(record))]
        function.restype = ctypes.c_uint32
    return function


def _shared_sites(lib, module_path):
    ptr = ctypes.POINTER(_BankSite)()
    n = _results(lib, "cuemu_bank_results", _BankSite)(ctypes.byref(ptr))
    raw = [ptr[i] for i in range(n)]
    names = sites.describe_sites(module_path, {r.site for r in raw})
    # Call sites of one source line (g++ copies a line's access into unrolled or inlined code) are
    # one record, in the order first seen.
    merged, extents = {}, {}
    for r in raw:
        key = (names[r.site], KINDS[r.kind], SHARED_MEMORIES[r.region])
        counts = (int(r.accesses), int(r.bytes), int(r.requests), int(r.wavefronts), int(r.ideal))
        merged[key] = tuple(a + b for a, b in zip(merged.get(key, (0,) * 5), counts))
        extents[key] = max(extents.get(key, 0), int(r.extent))
    return tuple(SharedSite(*key, *counts, extents[key]) for key, counts in merged.items())


def _path_outcomes(lib):
    ptr = ctypes.POINTER(_PathOutcome)()
    n = _results(lib, "cuemu_path_outcome_results", _PathOutcome)(ctypes.byref(ptr))
    # one (site, value) may come as several entries: copies of one __FILE__ string (template instances
    # of one line) that the compiler did not merge
    counts: dict = {}
    for i in range(n):
        key = (f"{os.path.basename(ptr[i].file.decode())}:{ptr[i].line}", int(ptr[i].value))
        counts[key] = counts.get(key, 0) + int(ptr[i].count)
    return tuple(sorted((site, value, count) for (site, value), count in counts.items()))


def _warp_mma(lib):
    ptr = ctypes.POINTER(_WarpMma)()
    n = _results(lib, "cuemu_warp_mma_results", _WarpMma)(ctypes.byref(ptr))
    return tuple(((int(ptr[i].block), int(ptr[i].warp)), int(ptr[i].count)) for i in range(n))


def _copy_waits(lib):
    counts = (ctypes.c_uint64 * 3)()
    lib.cuemu_copy_wait_counts(counts)
    return CopyWaits(*(int(c) for c in counts))


def _popcount(words):
    if hasattr(np, "bitwise_count"):   # NumPy >= 2.0
        return int(np.bitwise_count(words).sum())
    return int(np.unpackbits(words.view(np.uint8)).sum())


def _region(raw, nbytes, phase):
    counts, bits = [], []
    for k in range(3):
        packed = None
        distinct = touched = 0
        if raw.bits[k] and raw.bytes[k]:
            words = -(-raw.nbits // 64)
            packed = np.frombuffer(ctypes.string_at(raw.bits[k], 8 * words), np.uint8)
            distinct = int(np.count_nonzero(packed.view(np.uint32)))
            touched = _popcount(packed.view(np.uint64))
        counts.append(Counts(int(raw.bytes[k]), int(raw.accesses[k]), int(raw.requests[k]),
                             int(raw.request_sectors[k]), distinct, touched))
        bits.append(packed)
    return _Region(nbytes, phase, tuple(counts), tuple(bits))


def collect(lib, fn, grid, block, shared_mem, regions, bindings, banks=False):
    """Hands the last launch's traffic (``regions`` as racecheck.regions made them) to every
    open :func:`traffic` block; with ``banks``, the launch's shared-memory bank wavefronts to
    the blocks that asked for them."""
    ptr = ctypes.POINTER(_Result)()
    n = _results(lib, "cuemu_traffic_results", _Result)(ctypes.byref(ptr))
    if n != len(regions) + 2:
        raise EmulatorError(f"emulator: traffic of {n} regions for a launch of {len(regions) + 2}")
    table = [_region(ptr[2 + k], r.hi - r.lo, _phase(r)) for k, r in enumerate(regions)]
    arguments, extents = [], []
    for i, a, ptr_i, _ in sorted(bindings, key=lambda b: b[0]):
        lo, hi = memory.byte_extent(a)
        dev_lo = ptr_i + (lo - memory.data_ptr(a))
        k = next((k for k, r in enumerate(regions) if r.lo <= dev_lo < r.hi), None)
        if k is None:
            continue   # an empty array
        others = tuple(sorted(m[0] for m in regions[k].members if m[0] != i))
        arguments.append(ArgumentTraffic(i, fn.param_types[i], hi - lo, others, table[k], dev_lo - regions[k].lo))
        extents.append((lo, hi))
    record = LaunchTraffic(fn.name, tuple(grid), tuple(block), shared_mem, tuple(arguments),
                           tuple(extents), path_outcomes=_path_outcomes(lib), copy_waits=_copy_waits(lib),
                           warp_mma=_warp_mma(lib))
    with_banks = dataclasses.replace(record, shared_sites=_shared_sites(lib, fn.module.path)) if banks else record
    for c in _collectors:
        c.launches.append(with_banks if c.banks else record)
