"""The CuPy backend: device arrays and RawModule kernels on the current stream.

bfloat16 caches and outputs are stored as uint16 arrays holding the bfloat16
bit patterns. Inputs may be those bit patterns or CuPy's own bfloat16 dtype
(``ml_dtypes.bfloat16``, as ``cupy.from_dlpack`` of a torch bfloat16 tensor
gives); ``cupykv._args.device_operand`` views either as uint16 without a copy.
"""
from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

from cupykv.backends.base import Backend
from cupykv.kernels import KERNEL_DIR, cuda_include_dirs

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(np.uint16)}


class CupyBackend(Backend):
    """Kernels compiled by NVRTC through ``cupy.RawModule``, once per process."""

    name = "cupy"
    xp = cupy

    def _compile(self, filename, source, instances):
        includes = tuple(f"-I{d}" for d in (KERNEL_DIR, *cuda_include_dirs()[:1]))
        return cupy.RawModule(code=source, options=("-std=c++17", *includes), name_expressions=list(instances))

    def storage_dtype(self, dtype):
        return _STORAGE[dtype]

    def _zeros(self, shape, dtype):
        return cupy.zeros(shape, dtype)

    def check_device(self, name, array):
        current = cupy.cuda.runtime.getDevice()
        if array.device.id != current:
            raise TypeError(f"{name}: expected an array on the current CUDA device {current}, got one on "
                            f"device {array.device.id}; launch under `with cupy.cuda.Device({array.device.id}):`")

    def available_memory(self):
        """Free device memory (cudaMemGetInfo) plus the free blocks CuPy's default pool holds for reuse."""
        free, _total = cupy.cuda.runtime.memGetInfo()
        return free + cupy.get_default_memory_pool().free_bytes(), \
            "cudaMemGetInfo free bytes plus CuPy's pool's free blocks"

    def is_device_array(self, array):
        return isinstance(array, cupy.ndarray)

    def _asarray(self, host_array):
        host_array = np.ascontiguousarray(host_array)
        if host_array.dtype == ml_dtypes.bfloat16:
            host_array = host_array.view(np.uint16)
        return cupy.asarray(host_array)

    def _to_host(self, array):
        return cupy.asnumpy(array)

    def _upload(self, device_array, host_values):
        device_array.set(np.ascontiguousarray(host_values, dtype=device_array.dtype))

    def _synchronize(self):
        cupy.cuda.get_current_stream().synchronize()
