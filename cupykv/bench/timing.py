"""Timers for the bench: CUDA events on CuPy, the host clock on the emulator.

Both take the same arguments and return the same :class:`Timing`: warm-up
calls first (module load and compilation stay out of the numbers), then
``repeat`` timed calls, each one alone between two synchronisations, and the
median. Before each timed call the timer can overwrite a buffer larger than
the GPU's L2 cache, outside the timed region, so that data a kernel read on
the previous call is not still in L2 (a 2 MiB KV cache would otherwise be
timed at L2 speed, not memory speed).

The CUDA-event window holds device work only. A timed call first runs Python
(argument checks, launch setup) and only then enqueues its kernels; if the GPU
reached the start event before that, it would sit idle inside the window and
the figure would count host time. So the timer keeps the GPU busy with a
device-side delay (``kernels/delay.cu``) enqueued before the start event,
sized from the call's host time in warm-up, and checks every timed call: the
start event must still be pending once the call and the end event are
enqueued. A call that fails the check is redone behind a longer delay
(:class:`WindowGuard` records what was used).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

MIN_FLUSH_BYTES = 256 * 2**20

#: The first delay is GUARD_FACTOR x the slowest warm-up host time of one call, plus GUARD_MARGIN_S.
GUARD_FACTOR = 3.0
GUARD_MARGIN_S = 50e-6
#: No delay is longer than this (it is idle time of the bench, not timed).
MAX_GUARD_DELAY_S = 0.25
#: Times one timed call is redone behind a longer delay before the timer gives up.
GUARD_RETRIES = 3
#: SM clock assumed when the device does not report one: above every current GPU's boost clock, so
#: the delay comes out longer than asked, never shorter.
FALLBACK_SM_CLOCK_HZ = 2.5e9


class TimingWindowError(RuntimeError):
    """The GPU reached the start event before the timed call was enqueued, even behind the longest delay."""


@dataclass(frozen=True)
class WindowGuard:
    """How the CUDA-event windows of one :class:`Timing` were kept free of host time.

    Attributes
    ----------
    delay_s : float
        Device-side delay enqueued before each start event; the last one used,
        after any lengthening.
    host_s : float
        Slowest host time of one warm-up call (compilation excluded), which
        sized the first delay.
    retries : int
        Timed calls redone because their start event had completed before the
        call's work was enqueued.
    """

    delay_s: float
    host_s: float
    retries: int


@dataclass(frozen=True)
class Timing:
    """Seconds of ``repeat`` timed calls: median, fastest and slowest; ``guard`` on CUDA events only."""

    median_s: float
    min_s: float
    max_s: float
    repeat: int
    guard: Optional[WindowGuard] = None

    def as_ms(self, prefix: str = "time") -> dict:
        """The figures a result row stores.

        ``{prefix}_ms``, ``{prefix}_ms_min``, ``{prefix}_ms_max``; with a
        guard also ``{prefix}_guard_delay_ms`` and ``{prefix}_guard_retries``.
        """
        figures = {f"{prefix}_ms": self.median_s * 1e3, f"{prefix}_ms_min": self.min_s * 1e3,
                   f"{prefix}_ms_max": self.max_s * 1e3}
        if self.guard is not None:
            figures[f"{prefix}_guard_delay_ms"] = self.guard.delay_s * 1e3
            figures[f"{prefix}_guard_retries"] = self.guard.retries
        return figures


def _summary(samples: list[float], guard: Optional[WindowGuard] = None) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples), guard)


def first_delay_s(host_s: float) -> float:
    """The delay before the first timed call, from the slowest warm-up host time of one call."""
    return min(MAX_GUARD_DELAY_S, GUARD_FACTOR * host_s + GUARD_MARGIN_S)


def longer_delay_s(delay_s: float, host_s: float) -> float:
    """The delay after a failed check: at least double, and enough for the host time just seen."""
    return min(MAX_GUARD_DELAY_S, max(2.0 * delay_s, first_delay_s(host_s)))


class HostTimer:
    """Wall-clock timer (``time.perf_counter``) around ``fn(); backend.synchronize()``.

    The emulator's timer: its figures measure CPU emulation, never a GPU.
    Warm-up lasts ``warmup`` calls and at least ``min_warmup_s`` seconds: the
    host BLAS (the emulator's full-axis stand-in) can run its first calls of a
    process tens of times slower while its threads start on a busy machine.
    It needs no window guard: the emulator runs each kernel synchronously on
    the host, inside ``fn()``, so there is no device running ahead of or
    behind the host, and host time is the very quantity measured.
    """

    method = "time.perf_counter around each call, after backend.synchronize()"

    def __init__(self, backend, warmup: int, repeat: int, min_warmup_s: float = 0.25):
        self.backend = backend
        self.warmup = warmup
        self.repeat = repeat
        self.min_warmup_s = min_warmup_s
        self.flush_bytes = 0

    @property
    def window_guard(self) -> dict:
        """The JSON's ``timing.window_guard``: none is needed (see the class docstring)."""
        return {"method": "none: the emulator runs each kernel synchronously on the host inside the timed call, "
                          "so host time is what is measured"}

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


def _sm_clock_hz(xp) -> float:
    """The current device's maximum SM clock (``cudaDevAttrClockRate``, reported in kHz), in Hz."""
    runtime = xp.cuda.runtime
    try:
        khz = runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, runtime.getDevice())
    except runtime.CUDARuntimeError:
        khz = 0
    return khz * 1e3 if khz > 0 else FALLBACK_SM_CLOCK_HZ


class CudaEventTimer:
    """CUDA-event timer on the current stream: L2 flush, device delay, start event, call, end event.

    The flush writes ``flush_bytes`` (at least 256 MiB and four times the L2
    size) with a fill kernel enqueued before the start event, so it is not
    timed. The delay kernel behind it keeps the GPU busy while the host runs
    the call's Python and enqueues its kernels (see the module docstring);
    ``guards`` lists the :class:`WindowGuard` of every timing, for the run's
    summary. ``clock`` is the host clock that measures the call's host time.
    """

    method = ("cupy.cuda.Event pairs on the current stream, one timed call between them; a device-side delay "
              "kernel before the start event covers the call's host time")

    def __init__(self, backend, warmup: int, repeat: int, l2_bytes: int, clock=time.perf_counter):
        xp = backend.xp
        self._xp = xp
        self._clock = clock
        self.backend = backend
        self.warmup = warmup
        self.repeat = repeat
        self.flush_bytes = max(MIN_FLUSH_BYTES, 4 * int(l2_bytes))
        self._flush_buffer = xp.empty(self.flush_bytes, dtype=xp.uint8)
        self._start = xp.cuda.Event()
        self._end = xp.cuda.Event()
        self.sm_clock_hz = _sm_clock_hz(xp)
        self._spun = backend.zeros((1,), np.int64)   # [1] cycles the last delay counted
        self.guards: list[WindowGuard] = []

    @property
    def window_guard(self) -> dict:
        """How the windows were guarded, over every timing so far: the JSON's ``timing.window_guard``."""
        return {
            "method": "kernels/delay.cu spins on clock64() before each start event; after each timed call and "
                      "its end event are enqueued, the start event must still be pending, else the call is "
                      "redone behind a longer delay",
            "first_delay": f"min({MAX_GUARD_DELAY_S * 1e3:g} ms, {GUARD_FACTOR:g} x slowest warm-up host time "
                           f"of one call + {GUARD_MARGIN_S * 1e3:g} ms)",
            "longer_delay": "min(cap, max(2 x delay, first_delay of the failed call's host time))",
            "max_retries_per_call": GUARD_RETRIES,
            "row_fields": "every result row's *_guard_delay_ms (the last delay used) and *_guard_retries "
                          "(timed calls redone)",
            "sm_clock_hz": self.sm_clock_hz,
            "timings": len(self.guards),
            "max_delay_ms": max((g.delay_s for g in self.guards), default=0.0) * 1e3,
            "retries": sum(g.retries for g in self.guards),
        }

    def _flush(self, value: int) -> None:
        self._flush_buffer.fill(value & 0x7F)

    def _delay(self, seconds: float) -> None:
        cycles = np.int64(round(seconds * self.sm_clock_hz))
        self.backend.launch("delay", "cupykv_delay", (1,), (1,), (self._spun, cycles))

    def __call__(self, fn: Callable[[], object], flush: bool = True) -> Timing:
        host_s = self._warm_up(fn)
        delay_s = first_delay_s(host_s)
        samples, retries = [], 0
        for i in range(self.repeat):
            seconds, delay_s, redone = self._guarded_sample(fn, flush, i, delay_s)
            samples.append(seconds)
            retries += redone
        guard = WindowGuard(delay_s=delay_s, host_s=host_s, retries=retries)
        self.guards.append(guard)
        return _summary(samples, guard)

    def _warm_up(self, fn) -> float:
        """Run the warm-up calls; the slowest host time of one, the first (compiling) call excluded if others ran."""
        host_times = []
        for _ in range(self.warmup):
            started = self._clock()
            fn()
            host_times.append(self._clock() - started)
        self._xp.cuda.get_current_stream().synchronize()
        return max(host_times[1:] or host_times or [0.0])

    def _guarded_sample(self, fn, flush: bool, index: int, delay_s: float) -> tuple[float, float, int]:
        """One timed call, redone behind longer delays while its window may hold host time.

        Returns the call's seconds, the delay that guarded it, and how many times it was redone.
        """
        for retry in range(GUARD_RETRIES + 1):
            seconds, host_s, clean = self._sample(fn, flush, index, delay_s)
            if clean:
                return seconds, delay_s, retry
            delay_s = longer_delay_s(delay_s, host_s)
        raise TimingWindowError(
            f"CUDA-event timing: the GPU reached the start event before the timed call's work was enqueued, "
            f"{GUARD_RETRIES + 1} times, the last behind a {delay_s * 1e3:.3g} ms device delay (last host time "
            f"of the call {host_s * 1e3:.3g} ms). The call probably synchronises the host with the GPU (a "
            f"device-to-host copy, .get(), stream or device synchronize), so its window would count host time; "
            f"time only calls that enqueue work")

    def _sample(self, fn, flush: bool, index: int, delay_s: float) -> tuple[float, float, bool]:
        """Flush, delay, then time one call; returns (device seconds, host seconds of the call, window clean).

        The window is clean when the start event is still pending after the
        call and the end event are enqueued: the GPU was then still busy
        before the start event while the host enqueued everything between
        the two events, so nothing in between waited for the host.
        """
        stream = self._xp.cuda.get_current_stream()
        if flush:
            self._flush(index)
        self._delay(delay_s)
        self._start.record(stream)
        started = self._clock()
        fn()
        self._end.record(stream)
        host_s = self._clock() - started
        clean = not self._start.done
        self._end.synchronize()  # also surfaces an asynchronous launch error here
        return self._xp.cuda.get_elapsed_time(self._start, self._end) * 1e-3, host_s, clean


def make_timer(backend, warmup: int, repeat: int, l2_bytes: int = 0):
    """The timer for ``backend``: CUDA events on CuPy, the host clock on the emulator."""
    if backend.device_info().emulated:
        return HostTimer(backend, warmup, repeat)
    return CudaEventTimer(backend, warmup, repeat, l2_bytes)
