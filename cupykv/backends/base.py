"""The interface both backends implement."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from cupykv import graph
from cupykv.kernels import KERNELS


class Backend:
    """Arrays and kernel launches for one execution target.

    Subclasses set ``name`` and ``xp`` and implement the array helpers and
    ``_compile``. Compiled modules are cached per op, and launchable kernels
    per ``(op, instance)``, for the life of the backend.
    """

    name: str = ""
    xp: Any = None

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}
        self._kernels: dict[tuple[str, str], Callable] = {}

    # -- kernels -------------------------------------------------------------
    def launch(self, op: str, instance: str, grid, block, args, shared_mem: int = 0) -> None:
        """Launch ``instance`` of ``kernels/<op>.cu``, or hand it to the capture in progress."""
        fn = self.kernel(op, instance)
        recorder = graph.active_capture()
        if recorder is None:
            fn(grid, block, args, shared_mem=shared_mem)
        else:
            recorder.launch(self, fn, grid, block, args, shared_mem)

    def kernel(self, op: str, instance: str) -> Callable:
        """The launchable kernel ``instance`` of ``kernels/<op>.cu``.

        The result is called as ``fn(grid, block, args, shared_mem=0)``. It is
        looked up once per backend: CuPy's ``RawModule.get_function`` builds a
        new ``RawKernel`` and calls ``cuModuleGetFunction`` every time.
        """
        fn = self._kernels.get((op, instance))
        if fn is None:
            fn = self._kernels[op, instance] = self._module(op).get_function(instance)
        return fn

    def _module(self, op: str) -> Any:
        """The compiled module of ``kernels/<op>.cu``, compiled on first use."""
        if op not in self._modules:
            kernel_file = KERNELS[op]
            self._modules[op] = self._compile(kernel_file.filename, kernel_file.module_source(),
                                              kernel_file.instances)
        return self._modules[op]

    def _compile(self, filename: str, source: str, instances: Sequence[str]) -> Any:
        raise NotImplementedError

    # -- arrays --------------------------------------------------------------
    # Public array methods refuse to run inside a captured step; subclasses implement _zeros etc.
    def zeros(self, shape, dtype) -> Any:
        """A zero-filled device array."""
        graph.refuse_in_capture(f"allocating a {tuple(shape)} {np.dtype(dtype)} array",
                                "preallocate it outside the step and pass it in (out=...)")
        return self._zeros(shape, dtype)

    def asarray(self, host_array) -> Any:
        """A device copy of a NumPy array (bfloat16 as this backend stores it)."""
        graph.refuse_in_capture("copying a host array to the device", "upload it before capture")
        return self._asarray(host_array)

    def to_host(self, array) -> np.ndarray:
        """A NumPy copy of a device array (synchronising)."""
        graph.refuse_in_capture("reading a device array on the host (a synchronisation)",
                                "read it after replay()")
        return self._to_host(array)

    def upload(self, device_array, host_values) -> None:
        """Copy host values into an existing device array."""
        graph.refuse_in_capture("copying host values to the device",
                                "pass a device int32 array, filled before capture, instead of host values")
        self._upload(device_array, host_values)

    def storage_dtype(self, dtype: str) -> np.dtype:
        """The array dtype that holds cache dtype ``dtype`` on this backend."""
        raise NotImplementedError

    def check_device(self, name: str, array) -> None:
        """Raise TypeError unless ``array`` lives on the device kernels launch on now (one device here)."""

    def available_memory(self) -> tuple[int | None, str]:
        """Bytes this backend can allocate now, and where that figure comes from (``None``: unknown)."""
        return None, "unknown"

    def _zeros(self, shape, dtype) -> Any:
        raise NotImplementedError

    def is_device_array(self, array) -> bool:
        """Whether ``array`` lives where this backend's kernels can read it."""
        raise NotImplementedError

    def _asarray(self, host_array) -> Any:
        raise NotImplementedError

    def _to_host(self, array) -> np.ndarray:
        raise NotImplementedError

    def _upload(self, device_array, host_values) -> None:
        raise NotImplementedError

    # -- synchronisation -----------------------------------------------------
    def synchronize(self) -> None:
        """Wait on the host until the work launched so far has finished."""
        graph.refuse_in_capture("backend.synchronize() (a host synchronisation, which invalidates a CUDA "
                                "stream capture)", "synchronise after replay(), outside the step")
        self._synchronize()

    def _synchronize(self) -> None:
        raise NotImplementedError
