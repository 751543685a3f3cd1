"""Bounds that keep every kernel argument inside its C type and every launch inside CUDA's limits.

The kernels index with ``int`` (positions, rows, heads) and ``long long``
(element offsets). These bounds make the ``int`` arithmetic exact:

- ``max_seq <= MAX_SEQ = 2**30`` and ``q_len, n_new <= MAX_NEW = 2**30 - 1``,
  so a position ``lengths[b] + i`` (at most ``max_seq + q_len - 1``) and the
  end of a key range (at most ``max_seq + q_len``) stay below ``2**31``;
- every other count passed as ``int`` is at most ``INT32_MAX``.

CUDA's launch limits (every GPU since compute capability 3.0): grid
``x <= 2**31 - 1``, ``y, z <= 65535``; at most 1024 threads a block, block
``x, y <= 1024``, ``z <= 64``; 48 KiB of dynamic shared memory without an
opt-in. :func:`check_launch` checks a launch against them before it is made,
naming the argument whose shape set it.
"""
from __future__ import annotations

import math
from typing import Sequence

INT32_MAX = 2**31 - 1
MAX_SEQ = 2**30
MAX_NEW = 2**30 - 1       # q_len, n_new: max_seq + MAX_NEW = INT32_MAX
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_BLOCK_THREADS = 1024
MAX_DYNAMIC_SHARED_MEMORY = 48 * 1024


def check_launch(name: str, shape: str, grid: Sequence[int], block: Sequence[int], shared_mem: int = 0,
                 opted_in_shared: int | None = None) -> None:
    """Raise ValueError, naming ``name``, when a launch breaks one of CUDA's limits.

    Parameters
    ----------
    name : str
        The argument whose shape set the launch geometry (``"q"``, ``"k"``, ...).
    shape : str
        How the geometry follows from it, e.g. ``"batch * n_new = 2 * 70000"``.
    grid, block : tuple of int
        Up to three sizes each, as passed to the kernel.
    shared_mem : int
        Bytes of dynamic shared memory.
    opted_in_shared : int, optional
        For a kernel that opts in past 48 KiB (``Backend.opt_in_shared_memory``): the most it may
        opt in to. Without it, 48 KiB, CUDA's limit without an opt-in.
    """
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    for axis, (size, limit) in enumerate(zip(grid, MAX_GRID)):
        if not 1 <= size <= limit:
            raise ValueError(f"{name}: expected a shape whose launch has 1..{limit} blocks on grid "
                             f"{'xyz'[axis]} (CUDA's limit), got {shape}: grid {grid}")
    threads = math.prod(block)
    if any(not 1 <= size <= limit for size, limit in zip(block, MAX_BLOCK)) or threads > MAX_BLOCK_THREADS:
        raise ValueError(f"{name}: expected a shape whose launch has blocks of at most {MAX_BLOCK} and "
                         f"{MAX_BLOCK_THREADS} threads (CUDA's limits), got {shape}: block {block}")
    limit = MAX_DYNAMIC_SHARED_MEMORY if opted_in_shared is None else opted_in_shared
    if not 0 <= shared_mem <= limit:
        why = "CUDA's limit without an opt-in" if opted_in_shared is None else "the kernel's opt-in"
        raise ValueError(f"{name}: expected a shape whose launch needs at most {limit} bytes "
                         f"of dynamic shared memory ({why}), got {shape}: {shared_mem} bytes")


def check_memory(name: str, needed: int, available: int | None, backend: str, source: str) -> None:
    """Raise MemoryError, naming ``name``, when ``needed`` bytes exceed ``available`` (``None``: unknown).

    Parameters
    ----------
    name : str
        What asks for the memory (``"spec"``).
    needed, available : int
        Bytes; ``available=None`` skips the check.
    backend : str
        The backend's name, for the message.
    source : str
        Where ``available`` was read (``"MemAvailable in /proc/meminfo"``).
    """
    if available is not None and needed > available:
        raise MemoryError(f"{name}: expected a cache of at most {_bytes(available)}, what the {backend} "
                          f"backend can give ({source}), got one that needs {_bytes(needed)}")


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"
