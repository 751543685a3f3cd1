"""The emulator backend: NumPy arrays in guarded memory, kernels run on the CPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from cupykv.backends import emulator
from cupykv.backends.base import Backend
from cupykv.kernels import KERNEL_DIR

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class EmulatorBackend(Backend):
    """Runs the same ``.cu`` sources through cupykv's CUDA emulator."""

    name = "emulator"
    xp = np

    def _compile(self, source, instances):
        return emulator.Module(source, instances, include_dirs=(KERNEL_DIR,))

    def storage_dtype(self, dtype):
        return _STORAGE[dtype]

    def zeros(self, shape, dtype):
        return emulator.zeros(shape, dtype)

    def is_device_array(self, array):
        return isinstance(array, np.ndarray)

    def asarray(self, host_array):
        return emulator.asarray(np.ascontiguousarray(host_array))

    def to_host(self, array):
        return np.array(array, copy=True)

    def upload(self, device_array, host_values):
        device_array[...] = host_values

    def synchronize(self):
        emulator.synchronize()
