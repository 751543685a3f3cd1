"""Guarded "device" memory for the emulator: numpy arrays whose end touches a guard page.

Layout of one allocation of ``nbytes`` (``span`` = ``nbytes`` rounded up to 16)::

    [guard page][slack (canary) | buffer (nbytes) | pad (canary)][guard page]
                ^ page start     ^ start, 16-aligned           ^ end of span

Reads or writes from ``start + span`` on, or below the first data page, fault at
once (the launch reports the thread). Writes into the slack or the pad (at most
``pad`` bytes past the end, or before the start) are found by checking the canaries
after each launch; reads there are not detected. :func:`protected` makes whole pages
inside a buffer fault too, for a while (a cache's tail past its live rows).
"""

import bisect
import contextlib
import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
CANARY = 0xCD   # slack and padding around each buffer
POISON = 0xFF   # default contents of empty() arrays and of shared memory before it is written
POISON_ENV = "CUPYKV_EMULATOR_POISON"
_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_mmap.restype = ctypes.c_void_p
_mprotect = _libc.mprotect
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_lock = threading.RLock()
_bases = []    # sorted map addresses of live allocations
_live = {}     # map address -> weakref to Allocation (arrays own their allocation)


class Allocation:
    """One guarded mapping; frees itself when the last array viewing it is collected."""

    __slots__ = ("map_addr", "map_len", "start", "nbytes", "span", "what", "freed",
                 "protected", "__weakref__")

    def __init__(self, nbytes, what="buffer"):
        nbytes = int(nbytes)
        span = -(-nbytes // 16) * 16
        data_pages = -(-span // PAGE)
        map_len = (data_pages + 2) * PAGE
        addr = _mmap(None, map_len, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                     -1, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise MemoryError(f"emulator: cannot map {map_len} bytes")
        if data_pages and _mprotect(addr + PAGE, data_pages * PAGE, _PROT_RW) != 0:
            _munmap(addr, map_len)
            raise MemoryError(f"emulator: mprotect failed (errno {ctypes.get_errno()})")
        self.map_addr, self.map_len, self.freed = addr, map_len, False
        self.protected = []  # [(lo, hi)] addresses made PROT_NONE by protected()
        self.span, self.nbytes, self.what = span, nbytes, what
        self.start = addr + PAGE + data_pages * PAGE - span
        if self.start > addr + PAGE:
            ctypes.memset(addr + PAGE, CANARY, self.start - addr - PAGE)
        if span > nbytes:
            ctypes.memset(self.start + nbytes, CANARY, span - nbytes)
        with _lock:
            i = bisect.bisect(_bases, addr)
            _bases.insert(i, addr)
            _live[addr] = weakref.ref(self)

    @property
    def __array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.start, False),
                "version": 3}

    def padding_spans(self):
        """``[(lo, hi)]`` addresses of the mapping's readable bytes outside the buffer: the slack
        before ``start`` and the alignment padding after its end (both hold canary bytes)."""
        data_lo, end = self.map_addr + PAGE, self.start + self.nbytes
        return [(lo, hi) for lo, hi in ((data_lo, self.start), (end, self.start + self.span)) if hi > lo]

    @property
    def slack(self):
        """Bytes between the first data page and ``start``."""
        return self.start - self.map_addr - PAGE

    def check_canaries(self):
        """Returns a description of overwritten canary bytes, or None when intact."""
        bad = []
        pre = self.slack
        if pre:
            data = ctypes.string_at(self.map_addr + PAGE, pre)
            if data.count(CANARY) != pre:
                first = next(i for i, b in enumerate(data) if b != CANARY)
                bad.append(f"{pre - first} bytes before the start")
        pad = self.span - self.nbytes
        if pad:
            data = ctypes.string_at(self.start + self.nbytes, pad)
            if data.count(CANARY) != pad:
                last = max(i for i, b in enumerate(data) if b != CANARY)
                bad.append(f"{last + 1} bytes past the end")
        return " and ".join(bad) or None

    def restore_canaries(self):
        if self.slack:
            ctypes.memset(self.map_addr + PAGE, CANARY, self.slack)
        if self.span > self.nbytes:
            ctypes.memset(self.start + self.nbytes, CANARY, self.span - self.nbytes)

    def free(self):
        with _lock:
            if self.freed:
                return
            self.freed = True
            del _live[self.map_addr]
            del _bases[bisect.bisect_left(_bases, self.map_addr)]
        _munmap(self.map_addr, self.map_len)

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown
            pass


def find(addr):
    """The live allocation whose mapping (guard pages included) holds ``addr``."""
    with _lock:
        i = bisect.bisect(_bases, addr) - 1
        if i >= 0:
            a = _live[_bases[i]]()
            if a is not None and addr < a.map_addr + a.map_len:
                return a
    return None


def _owner(array):
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, Allocation) else None


def data_ptr(array):
    return array.__array_interface__["data"][0]


def byte_extent(array):
    """(lowest address, highest address + 1) that ``array`` can touch."""
    ptr = data_ptr(array)
    if array.size == 0:
        return ptr, ptr
    lo = hi = ptr
    for n, s in zip(array.shape, array.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + array.itemsize


def guarded_allocation(array):
    """The Allocation that ``array``'s bytes lie in entirely, else None."""
    owner = _owner(array)
    lo, hi = byte_extent(array)
    if owner is None:
        owner = find(lo)
    if owner is not None and owner.start <= lo and hi <= owner.start + owner.nbytes:
        return owner
    return None


def is_device_array(a):
    """True when ``a`` is a numpy array living in emulator device memory."""
    return isinstance(a, np.ndarray) and guarded_allocation(a) is not None


def _shape(shape):
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def poison_byte():
    """The byte that fills memory nobody has written: :func:`empty` arrays, shared memory
    before each block, the destination of an asynchronous copy before its wait.

    ``CUPYKV_EMULATOR_POISON`` (0 to 255, read at every call; ``0x7f`` style accepted)
    chooses it; unset or empty, 0xFF (a NaN in every float type, -1 in signed integers).
    A result that changes with the poison read memory nobody wrote, even where a NaN would
    have vanished (``fmaxf``, a comparison, a product with zero).

    Raises
    ------
    ValueError
        The variable is not an integer from 0 to 255.
    """
    text = os.environ.get(POISON_ENV, "").strip()
    if not text:
        return POISON
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if not 0 <= value <= 255:
        raise ValueError(f"{POISON_ENV}={text!r}: expected a byte value from 0 to 255 (such as 0xff or 0)")
    return value


def empty(shape, dtype=np.float32):
    """An uninitialised array in guarded memory. Every byte is :func:`poison_byte` (0xFF
    by default: NaN for float types, -1 for signed integers) so that reading unwritten
    elements shows.

    Args:
        shape: int or tuple of ints.
        dtype: any numpy dtype, ``ml_dtypes.bfloat16`` included.
    """
    return _fresh(shape, dtype, fill=poison_byte())


def zeros(shape, dtype=np.float32):
    """A zero-filled array in guarded memory. A fresh anonymous mapping is already
    zero, so no page is written (committed) until the array is used."""
    return _fresh(shape, dtype)


def _fresh(shape, dtype, fill=None):
    """An array over a new Allocation: every byte ``fill``, or as mapped (zero) for None."""
    dtype = np.dtype(dtype)
    shape = _shape(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    alloc = Allocation(nbytes, f"{dtype.name} array of shape {shape}")
    flat = np.asarray(alloc)
    if fill is not None:
        flat[...] = fill
    return flat.view(dtype).reshape(shape)


def asarray(a, dtype=None):
    """``a`` as an array in guarded memory: returned as is when it already lives
    there (and has ``dtype``), copied otherwise."""
    if isinstance(a, np.ndarray) and (dtype is None or a.dtype == np.dtype(dtype)) \
            and is_device_array(a):
        return a
    host = np.asarray(a, dtype=dtype)
    out = empty(host.shape, host.dtype)
    out[...] = host
    return out


def asnumpy(a):
    """A plain numpy copy of ``a`` (an emulator or host array)."""
    return np.array(a, copy=True)


def protected_range(alloc, addr):
    """The ``(lo, hi)`` addresses of a :func:`protected` range of ``alloc`` holding ``addr``."""
    return next(((lo, hi) for lo, hi in alloc.protected if lo <= addr < hi), None)


@contextlib.contextmanager
def protected(array, start, stop=None):
    """Inside the block, any access to bytes ``[start, stop)`` of ``array`` faults.

    The bytes are put on ``PROT_NONE`` pages, so a kernel that touches them stops at once
    with an :class:`EmulatorFault` naming the kernel, the thread, the argument and the
    element, even for a read whose value would have been ignored. Host code must not
    touch them either inside the block: Python itself would crash.

    Args:
        array: an array in guarded memory (``empty``, ``zeros``, ``asarray``, a cache's ``k``).
        start, stop: byte offsets from the array's data pointer (``stop``: by default its
            last byte + 1). Both must fall on page boundaries (4096 bytes here): choose
            the sizes so, e.g. a cache row of 256 bytes and 16 live rows.

    Raises:
        ValueError: not a guarded array, a range outside it, or a boundary that is not
            on a page boundary (the message gives the nearest ones).
    """
    alloc = guarded_allocation(array)
    if alloc is None:
        raise ValueError("protected: the array is not in guarded emulator memory")
    ptr = data_ptr(array)
    stop = byte_extent(array)[1] - ptr if stop is None else int(stop)
    start = int(start)
    if not (alloc.start <= ptr + start <= ptr + stop <= alloc.start + alloc.nbytes):
        raise ValueError(f"protected: bytes [{start}, {stop}) are not inside the array's buffer")
    for what, offset in (("start", start), ("stop", stop)):
        if (ptr + offset) % PAGE:
            below = offset - (ptr + offset) % PAGE
            raise ValueError(f"protected: {what} = {offset} is not on a page boundary ({PAGE} bytes); "
                             f"the nearest ones are {below} and {below + PAGE}")
    if stop == start:
        yield
        return
    if _mprotect(ptr + start, stop - start, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "protected: mprotect failed")
    alloc.protected.append((ptr + start, ptr + stop))
    try:
        yield
    finally:
        alloc.protected.remove((ptr + start, ptr + stop))
        _mprotect(ptr + start, stop - start, _PROT_RW)
