"""Timers for the bench: CUDA events on CuPy, the host clock on the emulator.

Both take the same arguments and return the same :class:`Timing`: warm-up
calls first (module load and compilation stay out of the numbers), then
``repeat`` timed calls, each one alone between two synchronisations, and the
median. Before each timed call the timer can overwrite a buffer larger than
the GPU's L2 cache, outside the timed region, so that data a kernel read on
the previous call is not still in L2 (a 2 MiB KV cache would otherwise be
timed at L2 speed, not memory speed).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

MIN_FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timing:
    """Seconds of ``repeat`` timed calls: median, fastest and slowest."""

    median_s: float
    min_s: float
    max_s: float
    repeat: int

    def as_ms(self, prefix: str = "time") -> dict:
        """``{prefix}_ms``, ``{prefix}_ms_min``, ``{prefix}_ms_max``: the figures a result row stores."""
        return {f"{prefix}_ms": self.median_s * 1e3, f"{prefix}_ms_min": self.min_s * 1e3,
                f"{prefix}_ms_max": self.max_s * 1e3}


def _summary(samples: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


class HostTimer:
    """Wall-clock timer (``time.perf_counter``) around ``fn(); backend.synchronize()``.

    The emulator's timer: its figures measure CPU emulation, never a GPU.
    Warm-up lasts ``warmup`` calls and at least ``min_warmup_s`` seconds: the
    host BLAS (the emulator's full-axis stand-in) can run its first calls of a
    process tens of times slower while its threads start on a busy machine.
    """

    method = "time.perf_counter around each call, after backend.synchronize()"

    def __init__(self, backend, warmup: int, repeat: int, min_warmup_s: float = 0.25):
        self.backend = backend
        self.warmup = warmup
        self.repeat = repeat
        self.min_warmup_s = min_warmup_s
        self.flush_bytes = 0

    def __call__(self, fn: Callable[[], object], flush: bool = True) -> Timing:
        calls, deadline = 0, time.perf_counter() + self.min_warmup_s
        while calls < self.warmup or time.perf_counter() < deadline:
            fn()
            calls += 1
        self.backend.synchronize()
        samples = []
        for _ in range(self.repeat):
            start = time.perf_counter()
            fn()
            self.backend.synchronize()
            samples.append(time.perf_counter() - start)
        return _summary(samples)


class CudaEventTimer:
    """CUDA-event timer on the current stream, with an L2 flush before each timed call.

    The flush writes ``flush_bytes`` (at least 256 MiB and four times the L2
    size) with a fill kernel enqueued before the start event, so it is not timed.
    """

    method = "cupy.cuda.Event pairs on the current stream, one timed call between them"

    def __init__(self, backend, warmup: int, repeat: int, l2_bytes: int):
        import cupy

        self._cupy = cupy
        self.backend = backend
        self.warmup = warmup
        self.repeat = repeat
        self.flush_bytes = max(MIN_FLUSH_BYTES, 4 * int(l2_bytes))
        self._flush_buffer = cupy.empty(self.flush_bytes, dtype=cupy.uint8)
        self._start = cupy.cuda.Event()
        self._end = cupy.cuda.Event()

    def _flush(self, value: int) -> None:
        self._flush_buffer.fill(value & 0x7F)

    def __call__(self, fn: Callable[[], object], flush: bool = True) -> Timing:
        cupy = self._cupy
        for _ in range(self.warmup):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        samples = []
        for i in range(self.repeat):
            if flush:
                self._flush(i)
            self._start.record()
            fn()
            self._end.record()
            self._end.synchronize()  # also surfaces an asynchronous launch error here
            samples.append(cupy.cuda.get_elapsed_time(self._start, self._end) * 1e-3)
        return _summary(samples)


def make_timer(backend, warmup: int, repeat: int, l2_bytes: int = 0):
    """The timer for ``backend``: CUDA events on CuPy, the host clock on the emulator."""
    if backend.name == "cupy":
        return CudaEventTimer(backend, warmup, repeat, l2_bytes)
    return HostTimer(backend, warmup, repeat)
