"""The capture state every layer consults: is a step being captured on this thread, and by whom.

This is the bottom of the stack: backends record launches into the
:class:`Recorder` of the capture in progress, and every call a CUDA graph
could not replay (an allocation, an upload, a host read) asks
:func:`refuse_in_capture` first. :mod:`cupykv.graph` builds the public
``capture()`` / ``Graph`` on top of it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence, Tuple

if TYPE_CHECKING:
    from cupykv.backends.base import Backend

_state = threading.local()


class Kernel(Protocol):
    """A launchable kernel, as ``Backend.kernel`` returns it (CuPy's ``RawKernel`` call form)."""

    def __call__(self, grid: Sequence[int], block: Sequence[int], args: Sequence[object], *,
                 shared_mem: int = 0) -> None: ...


#: one recorded launch: ``(kernel, grid, block, args, shared_mem)``
Launch = Tuple[Kernel, Sequence[int], Sequence[int], Tuple[object, ...], int]


class CaptureError(RuntimeError):
    """A captured step did something a CUDA graph cannot replay."""


def active_capture() -> "Recorder | None":
    """The capture in progress on this thread (warm-up run or recording), or ``None``."""
    return getattr(_state, "capture", None)


def refuse_in_capture(what: str, instead: str) -> None:
    """Raise CaptureError when called while a step is being recorded (not during its warm-up run)."""
    recorder = active_capture()
    if recorder is not None and recorder.capturing:
        raise CaptureError(f"{what} inside a captured step: {instead}")


class Recorder:
    """The launches of one run of a step: executed (warm-up, CUDA capture) or only frozen (emulator recording).

    Parameters
    ----------
    execute : bool
        Launch each kernel as it comes (on CuPy under stream capture, CUDA
        records it); otherwise only keep it for replay.
    capturing : bool
        False for the eager warm-up run, where allocations are still allowed.
    """

    def __init__(self, execute: bool, capturing: bool) -> None:
        self.execute = execute
        self.capturing = capturing
        self.backends: list[Backend] = []   # Backend objects that launched, in order of first launch
        self.launches: list[Launch] = []    # (fn, grid, block, args, shared_mem)

    def launch(self, backend: Backend, fn: Kernel, grid: Sequence[int], block: Sequence[int], args: Sequence[object],
               shared_mem: int) -> None:
        """Keep one launch (and run it, when this recorder executes)."""
        if not any(known is backend for known in self.backends):
            self.backends.append(backend)
        self.launches.append((fn, grid, block, tuple(args), shared_mem))
        if self.execute:
            fn(grid, block, args, shared_mem=shared_mem)


@contextlib.contextmanager
def capturing(recorder: Recorder) -> Iterator[Recorder]:
    """Make ``recorder`` this thread's capture for the duration of the block; captures do not nest."""
    if active_capture() is not None:
        raise CaptureError("capture() inside a captured step: captures do not nest")
    _state.capture = recorder
    try:
        yield recorder
    finally:
        _state.capture = None
