"""capture() / Graph.replay(): record a decode step once, replay it with device-side state.

A captured step may only launch cupykv kernels into preallocated buffers.
Everything that changes between replays (positions, lengths, token ids) must
live in device memory, where the kernels read it at replay time; the launch
arguments themselves (pointers, shapes, a layer index, ``advance(1)``'s 1) are
frozen at capture, exactly as CUDA freezes a graph's kernel parameters.

On CuPy the step is captured with ``cupy.cuda.Graph`` on a private
non-blocking stream and replayed on the current stream. On the emulator a
recorder does what CUDA does: it freezes each launch's arguments at capture
and runs the recorded launches at replay, reading buffer contents then.

On both backends these are errors inside a captured step, raised at capture
with a message that says what to do instead: an allocation (pass ``out=``),
a host synchronisation or device read (``check()``, ``lengths_host()``,
``backend.synchronize()``), a host-to-device upload (host values for
``advance``/``truncate``/``reset``: pass a device int32 array), and, on the
emulator, NumPy computation on device arrays (it would run once, at capture,
not at every replay); views of device arrays are allowed, as on CuPy.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

_state = threading.local()


class CaptureError(RuntimeError):
    """A captured step did something a CUDA graph cannot replay."""


def active_capture():
    """The capture in progress on this thread, or ``None``."""
    return getattr(_state, "capture", None)


def refuse_in_capture(what: str, instead: str) -> None:
    """Raise CaptureError when called while a step is being captured (not during its warm-up)."""
    recorder = active_capture()
    if recorder is not None and recorder.capturing:
        raise CaptureError(f"{what} inside a captured step: {instead}")


class _Recorder:
    """Collects the launches of one step: run them (observing) or freeze them (recording)."""

    def __init__(self, execute: bool, capturing: bool):
        self.execute = execute
        self.capturing = capturing      # False for the eager warm-up run
        self.backends: set[str] = set()
        self.launches: list[tuple] = []

    def launch(self, backend, fn, grid, block, args, shared_mem) -> None:
        self.backends.add(backend.name)
        self.launches.append((fn, grid, block, tuple(args), shared_mem))
        if self.execute:
            fn(grid, block, args, shared_mem=shared_mem)


@contextlib.contextmanager
def _capturing(recorder: _Recorder):
    if active_capture() is not None:
        raise CaptureError("capture() inside a captured step: captures do not nest")
    _state.capture = recorder
    try:
        yield recorder
    finally:
        _state.capture = None


class Graph:
    """A captured step. Replay it with :meth:`replay`; it keeps every buffer it uses alive."""

    def __init__(self, backend: str, launches: list[tuple], cuda_graph=None, keepalive: Any = None):
        self.backend = backend
        self._launches = launches        # emulator: replayed; cupy: kept for their buffers
        self._cuda_graph = cuda_graph
        self._keepalive = keepalive

    @property
    def num_launches(self) -> int:
        """Kernel launches in one replay."""
        return len(self._launches)

    def replay(self, n: int = 1) -> None:
        """Run the captured step ``n`` times on the current stream (no host synchronisation)."""
        from cupykv._args.scalars import check_int
        n = check_int("n", n, lo=0)
        refuse_in_capture("Graph.replay()", "replay graphs outside capture")
        for _ in range(n):
            if self._cuda_graph is not None:
                import cupy
                self._cuda_graph.launch(stream=cupy.cuda.get_current_stream())
            else:
                for fn, grid, block, args, shared_mem in self._launches:
                    fn(grid, block, args, shared_mem=shared_mem)


def _refuse_allocation(size: int):
    raise CaptureError(f"allocation of {size} bytes inside a captured step: preallocate the buffer "
                       f"outside the step and pass it in (for example attention(..., out=buffer))")


def capture(step: Callable, *args, **kwargs) -> Graph:
    """Capture ``step(*args, **kwargs)`` as a replayable graph.

    The step is first run once eagerly, as a real step (this compiles and
    loads every kernel module and lets cupykv allocate its workspaces), then
    recorded without running. Each :meth:`Graph.replay` runs it again, so
    ``capture`` followed by ``replay(n)`` performs ``n + 1`` steps.

    Parameters
    ----------
    step : callable
        Launches cupykv ops only, into preallocated buffers.
    *args, **kwargs
        Passed to ``step`` on the warm-up run and at capture.

    Returns
    -------
    Graph

    Raises
    ------
    CaptureError
        The step launched no cupykv kernel, mixed backends, or did something a
        graph cannot replay (see the module docstring), or, on CuPy, the CUDA
        capture was invalidated by something the step did.
    Exception
        Whatever the step itself raised, as it raised it.
    """
    if not callable(step):
        raise TypeError(f"step: expected a callable, got {type(step).__name__}")
    with _capturing(_Recorder(execute=True, capturing=False)) as warmup:
        step(*args, **kwargs)
    if not warmup.backends:
        raise CaptureError("step launched no cupykv kernel during its warm-up run: nothing to capture")
    if len(warmup.backends) > 1:
        raise CaptureError(f"step launched kernels on several backends {sorted(warmup.backends)}: "
                           f"a graph belongs to one backend")
    (backend,) = warmup.backends
    if backend == "emulator":
        with _capturing(_Recorder(execute=False, capturing=True)) as recorder:
            step(*args, **kwargs)
        return Graph("emulator", recorder.launches, keepalive=(step, args, kwargs))
    return _capture_cupy(step, args, kwargs)


def _capture_cupy(step, args, kwargs) -> Graph:
    import cupy

    caller = cupy.cuda.get_current_stream()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(caller.record())
    recorder = _Recorder(execute=True, capturing=True)   # launched on the capturing stream: recorded by CUDA
    with stream, cupy.cuda.using_allocator(_refuse_allocation), _capturing(recorder):
        cuda_graph = _capture_on(stream, lambda: step(*args, **kwargs))
    cuda_graph.upload()
    return Graph("cupy", recorder.launches, cuda_graph=cuda_graph, keepalive=(step, args, kwargs, stream))


_INVALIDATED = ("the CUDA stream capture was invalidated although the step raised nothing: a call in the step "
                "was not permitted during capture (likely a host synchronisation such as a stream or device "
                "synchronize, a device-to-host copy such as .get() or cupy.asnumpy, or work on another stream "
                "joined to the capturing one) and its error was caught or never reported; a captured step "
                "should launch only cupykv ops into preallocated buffers")


def _capture_on(stream, run: Callable[[], None]):
    """Record ``run()`` between ``stream.begin_capture()`` and ``stream.end_capture()``; return the graph.

    If ``run`` raises, the capture is ended, its graph discarded and ``run``'s
    own exception propagates; ``end_capture`` failing then (as it does for an
    invalidated capture) is only added to that exception as a note. If ``run``
    returns but ``end_capture`` fails, the capture was invalidated without an
    error at the call that caused it, and CaptureError says what usually does.
    """
    stream.begin_capture()
    try:
        run()
    except BaseException as step_error:
        _abandon_capture(stream, step_error)
        raise
    try:
        return stream.end_capture()
    except Exception as end_error:
        raise CaptureError(f"{_INVALIDATED} (end_capture raised {type(end_error).__name__}: {end_error})") \
            from end_error


def _abandon_capture(stream, step_error: BaseException) -> None:
    """End the capture on ``stream`` after the step raised ``step_error``; the graph is discarded."""
    try:
        stream.end_capture()
    except Exception as end_error:
        if hasattr(step_error, "add_note"):  # Python >= 3.11
            step_error.add_note(f"(cupykv: ending the abandoned CUDA stream capture then raised "
                                f"{type(end_error).__name__}: {end_error})")
