"""The interface both backends implement."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from cupykv.kernels import KERNELS


class Backend:
    """Arrays and kernel launches for one execution target.

    Subclasses set ``name`` and ``xp`` and implement the array helpers and
    ``_compile``. Compiled modules are cached per op for the process.
    """

    name: str = ""
    xp: Any = None

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}

    # -- kernels -------------------------------------------------------------
    def kernel(self, op: str, instance: str) -> Callable:
        """The launchable kernel ``instance`` of ``kernels/<op>.cu``.

        The result is called as ``fn(grid, block, args, shared_mem=0)``.
        """
        if op not in self._modules:
            kernel_file = KERNELS[op]
            self._modules[op] = self._compile(kernel_file.source(), kernel_file.instances)
        return self._modules[op].get_function(instance)

    def _compile(self, source: str, instances: Sequence[str]) -> Any:
        raise NotImplementedError

    # -- arrays --------------------------------------------------------------
    def storage_dtype(self, dtype: str) -> np.dtype:
        """The array dtype that holds cache dtype ``dtype`` on this backend."""
        raise NotImplementedError

    def zeros(self, shape, dtype) -> Any:
        raise NotImplementedError

    def is_device_array(self, array) -> bool:
        """Whether ``array`` lives where this backend's kernels can read it."""
        raise NotImplementedError

    def asarray(self, host_array) -> Any:
        """A device copy of a NumPy array (bfloat16 as this backend stores it)."""
        raise NotImplementedError

    def to_host(self, array) -> np.ndarray:
        """A NumPy copy of a device array (synchronising)."""
        raise NotImplementedError

    def upload(self, device_array, host_values) -> None:
        """Copy host values into an existing device array (outside graph capture only)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError
