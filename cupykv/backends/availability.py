"""Whether a backend can run on this machine, asked before any work starts (the command line does)."""
from __future__ import annotations

from cupykv import backends
from cupykv.errors import BackendUnavailableError


def check_available(name: str | None = None) -> str:
    """Return the backend name ``name`` resolves to, or raise when it cannot run here.

    ``None`` resolves as :func:`cupykv.backends.default_backend_name` does. Nothing is
    compiled or allocated.

    Raises
    ------
    cupykv.errors.BackendUnavailableError
        ``CUPYKV_BACKEND`` names no backend; ``"cupy"`` without a usable CUDA device; the
        emulator on a machine it does not support (``PlatformError``: not x86-64 Linux, no g++ 9+).
    """
    try:
        name = name or backends.default_backend_name()
    except ValueError as error:   # a CUPYKV_BACKEND that names no backend
        raise BackendUnavailableError(str(error)) from None
    if name not in backends.BACKENDS:
        raise BackendUnavailableError(f"backend: expected one of {backends.BACKENDS}, got {name!r}")
    if name == "cupy":
        available, reason = backends.cuda_available()
        if not available:
            raise BackendUnavailableError(f"backend 'cupy' is not usable here: {reason}; "
                                          f"use --backend emulator to run on the CPU")
    else:
        from cupykv.backends.emulator.build import check_platform
        check_platform()
    return name
