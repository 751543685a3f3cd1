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

from typing import Callable, ParamSpec, Sequence

from cupykv.backends.capture import (CaptureError, Launch, Recorder, active_capture, capturing,
                                     refuse_in_capture)

_P = ParamSpec("_P")

__all__ = ["CaptureError", "Graph", "active_capture", "capture", "refuse_in_capture"]


class Graph:
    """A captured step. Replay it with :meth:`replay`; it keeps every buffer it uses alive.

    Made by :func:`capture`; the backend that recorded it decides what a
    replay is (a CUDA graph launch, or the recorded emulator launches).
    """

    def __init__(self, backend: str, launches: Sequence[Launch], replay_once: Callable[[], None],
                 keepalive: object = None) -> None:
        self.backend = backend
        self._launches = launches        # kept for their buffers (and counted)
        self._replay_once = replay_once
        self._keepalive = keepalive

    @property
    def num_launches(self) -> int:
        """Kernel launches in one replay."""
        return len(self._launches)

    def replay(self, n: int = 1) -> None:
        """Run the captured step ``n`` times on the current stream (no host synchronisation).

        Graph-safe: no — refused inside a captured step (CaptureError): graphs are replayed outside
        capture.

        Parameters
        ----------
        n : int, default 1
            Replays, ``>= 0``.

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int ``>= 0``.
        CaptureError
            Inside a captured step.
        """
        from cupykv._args.scalars import check_int
        n = check_int("n", n, lo=0)
        refuse_in_capture("Graph.replay()", "replay graphs outside capture")
        for _ in range(n):
            self._replay_once()


def capture(step: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> Graph:
    """Capture ``step(*args, **kwargs)`` as a replayable graph.

    The step is first run once eagerly, as a real step (this compiles and
    loads every kernel module and lets cupykv make its plans and
    workspaces), then recorded by the backend it launched on. Each
    :meth:`Graph.replay` runs it again, so ``capture`` followed by
    ``replay(n)`` performs ``n + 1`` steps.

    Graph-safe: no — refused inside a captured step (CaptureError): captures do not nest.

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
    with capturing(Recorder(execute=True, capturing=False)) as warmup:
        step(*args, **kwargs)
    if not warmup.backends:
        raise CaptureError("step launched no cupykv kernel during its warm-up run: nothing to capture")
    if len(warmup.backends) > 1:
        raise CaptureError(f"step launched kernels on several backends {[b.name for b in warmup.backends]}: "
                           f"a graph belongs to one backend")
    (backend,) = warmup.backends
    launches, replay_once, resources = backend.capture(lambda: step(*args, **kwargs))
    return Graph(backend.name, launches, replay_once, keepalive=(step, args, kwargs, resources))
