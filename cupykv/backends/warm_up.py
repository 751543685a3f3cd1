"""Compile kernel modules ahead of their first use, in parallel worker processes.

A backend compiles ``kernels/<op>.cu`` (every instance of it in one NVRTC or g++
call) the first time one of its kernels is asked for, and both compilers keep the
result in a disk cache shared by every process (CuPy's kernel cache; the
emulator's ``$CUPYKV_CACHE_DIR/emulator``). One process compiles the modules one
after another: for sm_90 about 36 s of NVRTC in all on the CPU of the dev
machine, 19 s of it for ``attention_mma.cu``. Worker processes compile them side
by side, so a cold start costs about as long as the largest module; afterwards
each first use, in this process or another, loads the module from the disk cache.

``python -m cupykv validate`` does this at the start of its first part, whose
time budget would otherwise pay for every compile in turn.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Sequence

from cupykv import _args
from cupykv.kernels import KERNELS


@dataclass(frozen=True)
class WarmUp:
    """What :func:`compile_in_parallel` did."""

    ops: tuple[str, ...]          # the modules compiled, in the order they were handed out
    processes: int                # worker processes used
    seconds: float                # wall time of the whole warm-up
    op_seconds: dict[str, float]  # each module's compile (or disk-cache load) time in its worker


def compile_order(ops: Sequence[str]) -> list[str]:
    """``ops`` largest first (instances x source length, a stand-in for compile time), so that the
    longest compile starts at once and the small ones fill the other workers meanwhile."""
    return sorted(ops, key=lambda op: -len(KERNELS[op].instances) * len(KERNELS[op].module_source()))


def _compile_one(backend_name: str, op: str) -> tuple[str, float]:
    """In a worker: compile ``kernels/<op>.cu`` on ``backend_name`` (through its disk cache)."""
    from cupykv.backends import get_backend   # a fresh process: the backend is made here

    started = time.monotonic()
    get_backend(backend_name).kernel(op, KERNELS[op].instances[0])   # the whole module is compiled
    return op, time.monotonic() - started


def compile_in_parallel(backend_name: str, ops: Sequence[str] | None = None,
                        processes: int | None = None) -> WarmUp:
    """Compile the modules of ``ops`` (every ``kernels/*.cu`` by default) in worker processes.

    Parameters
    ----------
    backend_name : {"cupy", "emulator"}
        The backend whose compiler and disk cache the workers use.
    ops : sequence of str, optional
        Keys of :data:`cupykv.kernels.KERNELS`.
    processes : int, optional
        Worker processes; by default one per module, at most one per core.
        The workers are spawned, not forked, so each makes its own CUDA
        context.

    Raises
    ------
    TypeError, ValueError
        An unknown op, or a process count that is not an int >= 1.
    CompileError, RuntimeError
        A worker's compile failed; its error is raised here.
    """
    ops = list(KERNELS) if ops is None else list(ops)
    unknown = [op for op in ops if op not in KERNELS]
    if unknown:
        raise ValueError(f"ops: expected keys of cupykv.kernels.KERNELS, got {unknown}")
    wanted = (os.cpu_count() or 1) if processes is None else _args.check_int("processes", processes, 1)
    ordered = compile_order(ops)
    workers = max(1, min(len(ordered), wanted))
    started = time.monotonic()
    op_seconds: dict[str, float] = {}
    if ordered:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for op, seconds in pool.starmap(_compile_one, [(backend_name, op) for op in ordered], chunksize=1):
                op_seconds[op] = seconds
    return WarmUp(tuple(ordered), workers, time.monotonic() - started, op_seconds)
