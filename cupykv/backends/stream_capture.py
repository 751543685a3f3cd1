"""Ending a CUDA stream capture well, whether the captured step raised or not (CuPy backend).

Kept apart from :mod:`cupykv.backends.cupy_backend` so that it imports without CuPy:
the logic is tested on the CPU with a stand-in stream.
"""
from __future__ import annotations

from typing import Callable

from cupykv.backends.capture import CaptureError

INVALIDATED = ("the CUDA stream capture was invalidated although the step raised nothing: a call in the step "
               "was not permitted during capture (likely a host synchronisation such as a stream or device "
               "synchronize, a device-to-host copy such as .get() or cupy.asnumpy, or work on another stream "
               "joined to the capturing one) and its error was caught or never reported; a captured step "
               "should launch only cupykv ops into preallocated buffers")


def capture_on(stream, run: Callable[[], None]):
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
        raise CaptureError(f"{INVALIDATED} (end_capture raised {type(end_error).__name__}: {end_error})") \
            from end_error


def _abandon_capture(stream, step_error: BaseException) -> None:
    """End the capture on ``stream`` after the step raised ``step_error``; the graph is discarded."""
    try:
        stream.end_capture()
    except Exception as end_error:
        if hasattr(step_error, "add_note"):  # Python >= 3.11
            step_error.add_note(f"(cupykv: ending the abandoned CUDA stream capture then raised "
                                f"{type(end_error).__name__}: {end_error})")
