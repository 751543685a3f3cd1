"""Backends: where cupykv's arrays live and how its kernels are launched.

Two backends share one launch interface (the one CuPy's ``RawKernel`` has):
``backend.kernel(op, instance)(grid, block, args, shared_mem=0)``, with the
arguments packed as CUDA packs them. Everything above that interface (argument
checks, launch geometry, the cache's protocol) is shared code.

- ``"cupy"``: CuPy arrays on the current device, kernels through ``RawModule``,
  launched on the current CuPy stream.
- ``"emulator"``: NumPy arrays in guarded host memory, the same ``.cu``
  sources compiled for the CPU by cupykv's CUDA emulator.

``get_backend(None)`` picks ``"cupy"`` when a CUDA device is usable and the
emulator otherwise; the ``CUPYKV_BACKEND`` environment variable overrides it.
"""
from __future__ import annotations

import os

from cupykv.backends.base import Backend

BACKENDS = ("cupy", "emulator")
GPU_BACKEND, CPU_BACKEND = BACKENDS   # the backend that runs on a CUDA GPU, and the CPU emulator


def runs_on_gpu(name: str) -> bool:
    """Whether backend ``name`` launches on a CUDA GPU (so GPU tools such as compute-sanitizer apply)."""
    return name == GPU_BACKEND
_instances: dict[str, Backend] = {}


def cuda_available() -> tuple[bool, str]:
    """Whether CuPy imports and sees a usable CUDA device, with the reason if not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return False, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver
        return False, f"cupy.cuda.runtime.getDeviceCount() failed ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device is visible"
    return True, f"{count} CUDA device(s)"


def default_backend_name() -> str:
    """The backend used when none is named: CUPYKV_BACKEND, else cupy if usable, else the emulator."""
    chosen = os.environ.get("CUPYKV_BACKEND", "").strip().lower()
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"CUPYKV_BACKEND: expected one of {BACKENDS}, got {chosen!r}")
        return chosen
    return "cupy" if cuda_available()[0] else "emulator"


def backend_of(array: object) -> Backend | None:
    """The backend whose kernels would take ``array``, or ``None`` for an object no backend knows.

    A ``numpy.ndarray`` belongs to the emulator (which accepts only its own
    device arrays, and says so); ``cupy.ndarray`` and objects with
    ``__cuda_array_interface__`` or (non-NumPy) DLPack belong to CuPy.
    """
    import numpy as np

    if isinstance(array, np.ndarray):
        return get_backend("emulator")
    if type(array).__module__.split(".")[0] == "cupy" or hasattr(array, "__cuda_array_interface__") \
            or hasattr(array, "__dlpack__"):
        return get_backend("cupy")
    return None


def get_backend(name: str | Backend | None = None) -> Backend:
    """Return the (shared) backend object for ``name``.

    Parameters
    ----------
    name : {"cupy", "emulator"}, Backend or None
        ``None`` picks the default (see :func:`default_backend_name`).
    """
    if isinstance(name, Backend):
        return name
    if name is None:
        name = default_backend_name()
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {name!r}")
    if name not in _instances:
        if name == "cupy":
            available, reason = cuda_available()
            if not available:
                from cupykv.errors import BackendUnavailableError   # a RuntimeError, and a UserError for the CLI
                raise BackendUnavailableError(f"backend 'cupy' is not usable here: {reason}")
            from cupykv.backends.cupy_backend import CupyBackend
            _instances[name] = CupyBackend()
        else:
            from cupykv.backends.emulator_backend import EmulatorBackend
            _instances[name] = EmulatorBackend()
    return _instances[name]
