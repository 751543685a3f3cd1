"""The CUDA-event timer's window guard: on a simulated GPU, on the emulator, and on a real GPU (``gpu``).

The fake below stands in for CuPy: one in-order stream on a virtual timeline
shared with a virtual host clock. Device work starts once the host has
enqueued it and the stream has finished what came before; an event completes
when the stream reaches it; ``done`` compares that moment with the host clock.
That is all the guard relies on, and it is enough to reproduce the bug
(:func:`test_fake_gpu_reproduces_the_unguarded_bug`).
"""
import math
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cupykv.bench import timing
from cupykv.bench.timing import (GUARD_MARGIN_S, GUARD_RETRIES, MAX_GUARD_DELAY_S, CudaEventTimer, HostTimer,
                                 Timing, TimingWindowError, WindowGuard, first_delay_s, longer_delay_s)

SM_CLOCK_HZ = 1.5e9
FLUSH_S = 60e-6       # device time of one L2 flush
FAST_HOST_S = 20e-6   # Python of a well-behaved call
DEVICE_S = 100e-6     # its kernels


# -- a simulated GPU -------------------------------------------------------------
class FakeGpu:
    """A virtual host clock and one in-order stream on the same timeline (seconds)."""

    def __init__(self):
        self.host_now = 0.0
        self.stream_free_at = 0.0   # when the stream finishes everything enqueued so far

    def clock(self) -> float:
        return self.host_now

    def host_work(self, seconds: float) -> None:
        self.host_now += seconds

    def enqueue(self, seconds: float) -> float:
        """Enqueue ``seconds`` of device work now; returns when it ends."""
        self.stream_free_at = max(self.host_now, self.stream_free_at) + seconds
        return self.stream_free_at

    def synchronize(self) -> None:
        self.host_now = max(self.host_now, self.stream_free_at)


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self._gpu = gpu
        self.at = None   # when the stream reaches the event

    def record(self, stream=None) -> None:
        self.at = self._gpu.enqueue(0.0)

    @property
    def done(self) -> bool:
        return self.at <= self._gpu.host_now

    def synchronize(self) -> None:
        self._gpu.host_now = max(self._gpu.host_now, self.at)


class FakeRuntime:
    cudaDevAttrClockRate = 13

    class CUDARuntimeError(RuntimeError):
        pass

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def deviceGetAttribute(attribute, device) -> int:
        assert attribute == FakeRuntime.cudaDevAttrClockRate and device == 0
        return int(SM_CLOCK_HZ / 1e3)   # kHz, as CUDA reports it


def fake_cupy(gpu: FakeGpu):
    """The part of the ``cupy`` module the timer uses."""
    flush_buffer = SimpleNamespace(fill=lambda value: gpu.enqueue(FLUSH_S))
    stream = SimpleNamespace(synchronize=gpu.synchronize)
    cuda = SimpleNamespace(Event=lambda: FakeEvent(gpu), get_current_stream=lambda: stream,
                           get_elapsed_time=lambda start, end: (end.at - start.at) * 1e3, runtime=FakeRuntime())
    return SimpleNamespace(cuda=cuda, uint8=np.uint8, empty=lambda n, dtype: flush_buffer)


class FakeBackend:
    """A ``cupy``-named backend whose only kernel is the delay: it occupies the stream for cycles / SM clock."""

    name = "cupy"

    def __init__(self, gpu: FakeGpu):
        self.gpu = gpu
        self.xp = fake_cupy(gpu)
        self.delays_s = []

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def launch(self, op, instance, grid, block, args, shared_mem=0):
        assert (op, instance, grid, block) == ("delay", "cupykv_delay", (1,), (1,))
        spun, cycles = args
        assert spun.dtype == np.int64 and spun.shape == (1,) and isinstance(cycles, np.int64)   # it writes spun[0]
        self.delays_s.append(cycles / SM_CLOCK_HZ)
        self.gpu.enqueue(cycles / SM_CLOCK_HZ)


class TimedCall:
    """A call to time: ``host_s[i]`` seconds of Python (the last value repeats), then ``device_s`` of kernels."""

    def __init__(self, gpu: FakeGpu, host_s, device_s=DEVICE_S, synchronises=False):
        self.gpu, self.host_s, self.device_s, self.synchronises = gpu, list(host_s), device_s, synchronises
        self.calls = 0

    def __call__(self):
        self.gpu.host_work(self.host_s[min(self.calls, len(self.host_s) - 1)])
        self.calls += 1
        self.gpu.enqueue(self.device_s)
        if self.synchronises:   # e.g. .get() or a stream synchronize inside the call
            self.gpu.synchronize()


def _timer(gpu, warmup=3, repeat=5):
    return CudaEventTimer(FakeBackend(gpu), warmup, repeat, l2_bytes=0, clock=gpu.clock)


# -- the guard on the simulated GPU -------------------------------------------------
def test_fake_gpu_reproduces_the_unguarded_bug():
    """The old sequence (flush, start, call, end) times 2 ms of Python on this fake: the fake models the bug."""
    gpu = FakeGpu()
    cupy = fake_cupy(gpu)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    call = TimedCall(gpu, host_s=[2e-3])
    cupy.empty(1, cupy.uint8).fill(0)
    start.record()
    call()
    end.record()
    end.synchronize()
    measured_s = cupy.cuda.get_elapsed_time(start, end) * 1e-3
    assert measured_s > 2e-3 - FLUSH_S   # host time leaked into the window
    assert start.done


def test_well_behaved_call_takes_one_pass():
    gpu = FakeGpu()
    timer = _timer(gpu, warmup=3, repeat=5)
    result = timer(TimedCall(gpu, host_s=[FAST_HOST_S]))
    assert result.guard.retries == 0
    assert len(timer.backend.delays_s) == 5   # one delay per timed call, none redone
    assert all(math.isclose(d, first_delay_s(FAST_HOST_S), rel_tol=1e-6) for d in timer.backend.delays_s)
    assert math.isclose(result.guard.host_s, FAST_HOST_S, rel_tol=1e-9)
    assert math.isclose(result.min_s, DEVICE_S, rel_tol=1e-9) and math.isclose(result.max_s, DEVICE_S, rel_tol=1e-9)


def test_host_slower_than_the_delay_redoes_the_sample_behind_a_longer_delay():
    """Warm-up calls take 20 us of Python, timed ones 2 ms: the first delay (110 us) is too short once."""
    gpu = FakeGpu()
    slow_host_s = 2e-3
    timer = _timer(gpu, warmup=3, repeat=5)
    result = timer(TimedCall(gpu, host_s=[FAST_HOST_S] * 3 + [slow_host_s]))
    first, longer = first_delay_s(FAST_HOST_S), longer_delay_s(first_delay_s(FAST_HOST_S), slow_host_s)
    assert first < slow_host_s < longer
    assert result.guard.retries == 1
    assert np.allclose(timer.backend.delays_s, [first] + [longer] * 5, rtol=1e-6)
    assert math.isclose(result.guard.delay_s, longer, rel_tol=1e-9)
    # every kept sample is device time only, though the host spent 2 ms in each call
    assert math.isclose(result.min_s, DEVICE_S, rel_tol=1e-9) and math.isclose(result.max_s, DEVICE_S, rel_tol=1e-9)


def test_call_that_synchronises_raises_after_bounded_retries():
    gpu = FakeGpu()
    timer = _timer(gpu, warmup=2, repeat=3)
    with pytest.raises(TimingWindowError, match="synchronises the host"):
        timer(TimedCall(gpu, host_s=[FAST_HOST_S], synchronises=True))
    delays = timer.backend.delays_s
    assert len(delays) == GUARD_RETRIES + 1                    # the first timed call, redone GUARD_RETRIES times
    assert all(b >= 2 * a * (1 - 1e-6) for a, b in zip(delays, delays[1:]))   # each retry at least doubles
    assert timer.guards == []                                  # nothing recorded for a failed timing


def test_first_warm_up_call_does_not_size_the_delay():
    """The first warm-up call compiles (1 s here); the delay comes from the calls after it."""
    gpu = FakeGpu()
    timer = _timer(gpu, warmup=3, repeat=2)
    result = timer(TimedCall(gpu, host_s=[1.0, FAST_HOST_S]))
    assert math.isclose(result.guard.host_s, FAST_HOST_S, rel_tol=1e-9)
    assert result.guard.delay_s < 1e-3


def test_window_guard_summary_and_row_fields():
    gpu = FakeGpu()
    timer = _timer(gpu, warmup=2, repeat=2)
    fast = timer(TimedCall(gpu, host_s=[FAST_HOST_S]))
    slow = timer(TimedCall(gpu, host_s=[FAST_HOST_S] * 2 + [2e-3]))
    summary = timer.window_guard
    assert summary["timings"] == 2 and summary["retries"] == fast.guard.retries + slow.guard.retries == 1
    assert math.isclose(summary["max_delay_ms"], slow.guard.delay_s * 1e3)
    assert summary["sm_clock_hz"] == SM_CLOCK_HZ
    row = slow.as_ms("eager_time")
    assert row["eager_time_guard_retries"] == 1
    assert math.isclose(row["eager_time_guard_delay_ms"], slow.guard.delay_s * 1e3)


def test_host_timer_rows_carry_no_guard():
    assert HostTimer(backend=None, warmup=1, repeat=1).window_guard["method"].startswith("none")
    assert set(Timing(1.0, 1.0, 1.0, 1).as_ms()) == {"time_ms", "time_ms_min", "time_ms_max"}
    guarded = Timing(1.0, 1.0, 1.0, 1, WindowGuard(delay_s=2e-3, host_s=5e-4, retries=0)).as_ms()
    assert guarded["time_guard_delay_ms"] == 2.0 and guarded["time_guard_retries"] == 0


def test_a_rows_figures_are_the_timings_seconds_in_milliseconds():
    row = Timing(median_s=0.5, min_s=0.25, max_s=2.0, repeat=3).as_ms("decode")
    assert row == {"decode_ms": 500.0, "decode_ms_min": 250.0, "decode_ms_max": 2000.0}


class HostClockBackend:
    """The emulator's part in HostTimer: synchronize(), counted; calls advance a virtual perf_counter,
    and a timer that reads it past ``max_reads`` times (waiting for time that never passes) fails."""

    def __init__(self, max_reads=1000):
        self.now = 100.0
        self.synchronized = 0
        self.reads_left = max_reads

    def synchronize(self):
        self.synchronized += 1

    def perf_counter(self):
        self.reads_left -= 1
        assert self.reads_left >= 0, "the timer keeps reading a clock that no call advances"
        return self.now


def test_host_timer_times_each_call_alone_after_a_warm_up_of_calls_and_of_seconds(monkeypatch):
    """Warm-up runs at least ``warmup`` calls and at least ``min_warmup_s`` seconds (0.25 s here: 16
    calls of 1/64 s), then a synchronize; each of ``repeat`` calls is timed alone up to its own
    synchronize, on the host clock (steps that are powers of two keep the virtual clock exact)."""
    backend = HostClockBackend()
    monkeypatch.setattr(timing.time, "perf_counter", backend.perf_counter)
    warm_up_s, timed_s = 1 / 64, 1 / 256
    for warmup, calls_warming_up in ((3, 16), (40, 40)):   # the seconds bound, then the count bound
        calls = []

        def call():
            calls.append(backend.now)
            backend.now += warm_up_s if len(calls) <= calls_warming_up else timed_s
        backend.synchronized = 0
        result = HostTimer(backend, warmup=warmup, repeat=5, min_warmup_s=0.25)(call)
        assert len(calls) == calls_warming_up + 5
        assert backend.synchronized == 1 + 5
        assert result.repeat == 5 and result.guard is None
        assert result.median_s == result.min_s == result.max_s == timed_s


def test_delay_sizing():
    assert first_delay_s(0.0) == GUARD_MARGIN_S
    assert math.isclose(first_delay_s(1e-3), timing.GUARD_FACTOR * 1e-3 + GUARD_MARGIN_S)
    assert first_delay_s(10.0) == MAX_GUARD_DELAY_S
    assert longer_delay_s(1e-3, 0.0) == 2e-3                   # at least double
    assert math.isclose(longer_delay_s(1e-4, 1e-2), first_delay_s(1e-2))   # covers the host time just seen
    assert longer_delay_s(MAX_GUARD_DELAY_S, 1.0) == MAX_GUARD_DELAY_S


def test_missing_clock_rate_falls_back_to_a_fast_clock():
    """An unknown SM clock is taken as fast, so the delay in cycles comes out longer, not shorter."""
    runtime = FakeRuntime()
    runtime.deviceGetAttribute = lambda attribute, device: 0
    assert timing._sm_clock_hz(SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))) == \
        timing.FALLBACK_SM_CLOCK_HZ >= 2.5e9


# -- the delay kernel on the emulator ------------------------------------------------
_EMULATOR_DELAY = textwrap.dedent("""
    import time
    import numpy as np
    from cupykv.backends import get_backend
    backend = get_backend("emulator")
    spun = backend.zeros((1,), np.int64)
    for cycles in (0, 5_000_000, 20_000_000):
        started = time.perf_counter()
        backend.launch("delay", "cupykv_delay", (1,), (1,), (spun, np.int64(cycles)))
        backend.synchronize()
        print(cycles, int(spun[0]), time.perf_counter() - started)
""")


def test_delay_kernel_runs_and_terminates_on_the_emulator():
    """clock64() is the CPU's time-stamp counter there: the spin counts at least the cycles asked, then ends.

    Run in a child process so that a spin that never ends fails the test (timeout) instead of hanging it.
    """
    done = subprocess.run([sys.executable, "-c", _EMULATOR_DELAY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == [0, 5_000_000, 20_000_000]
    for cycles, spun, _ in rows:
        assert int(cycles) <= int(spun) < int(cycles) + 10**9, rows   # counted the cycles, and did write spun
    assert int(rows[0][1]) == 0


# -- a real GPU ------------------------------------------------------------------
SLEEP_S = 0.02


@pytest.mark.gpu
def test_gpu_window_excludes_a_slow_python_prologue():
    """fn sleeps 20 ms, then fills 4 MiB: the unguarded sequence times the sleep, the timer does not."""
    import cupy

    from cupykv.backends import get_backend

    x = cupy.zeros(1 << 20, cupy.float32)

    def fn():
        time.sleep(SLEEP_S)   # a deliberately slow Python prologue
        x.fill(1.0)

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    start.record()
    fn()
    end.record()
    end.synchronize()
    assert cupy.cuda.get_elapsed_time(start, end) * 1e-3 > 0.9 * SLEEP_S   # the bug, unguarded
    result = CudaEventTimer(get_backend("cupy"), warmup=3, repeat=5, l2_bytes=0)(fn)
    assert result.max_s < SLEEP_S / 20, result
    assert result.guard.delay_s > SLEEP_S


@pytest.mark.gpu
def test_gpu_call_that_synchronises_raises():
    import cupy

    from cupykv.backends import get_backend

    x = cupy.zeros(1 << 20, cupy.float32)

    def fn():
        x.fill(1.0)
        cupy.cuda.get_current_stream().synchronize()

    with pytest.raises(TimingWindowError, match="synchronises the host"):
        CudaEventTimer(get_backend("cupy"), warmup=2, repeat=2, l2_bytes=0)(fn)


@pytest.mark.gpu
def test_gpu_delay_kernel_lasts_at_least_the_cycles_asked():
    """At most the maximum SM clock: the delay lasts >= cycles / max clock (a slower clock only lengthens it)."""
    import cupy

    from cupykv.backends import get_backend

    backend = get_backend("cupy")
    clock_hz = timing._sm_clock_hz(cupy)
    spun = backend.zeros((1,), np.int64)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    backend.launch("delay", "cupykv_delay", (1,), (1,), (spun, np.int64(10)))   # load the module first
    start.record()
    backend.launch("delay", "cupykv_delay", (1,), (1,), (spun, np.int64(round(1e-3 * clock_hz))))
    end.record()
    end.synchronize()
    assert int(spun.get()[0]) >= round(1e-3 * clock_hz)
    assert cupy.cuda.get_elapsed_time(start, end) * 1e-3 >= 0.95e-3
