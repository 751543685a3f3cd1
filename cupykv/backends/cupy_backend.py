"""The CuPy backend: device arrays and RawModule kernels on the current stream.

bfloat16 caches and outputs are stored as uint16 arrays holding the bfloat16
bit patterns (float8_e4m3 caches as uint8 arrays of E4M3 codes). Inputs may be
those bit patterns or CuPy's own bfloat16 dtype (``ml_dtypes.bfloat16``, as
``cupy.from_dlpack`` of a torch bfloat16 tensor gives);
``cupykv._args.device_operand`` views either as uint16 without a copy.
"""
from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

from cupykv.backends.base import Backend, DeviceInfo
from cupykv.backends.capture import CaptureError, Recorder, capturing
from cupykv.backends.stream_capture import capture_on
from cupykv.kernels import KERNEL_DIR, cuda_include_dirs

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(np.uint16), "float8_e4m3": np.dtype(np.uint8)}


class CupyBackend(Backend):
    """Kernels compiled by NVRTC through ``cupy.RawModule``, once per process."""

    name = "cupy"
    xp = cupy
    host_array_hint = "cupy.ndarray, or an object with __cuda_array_interface__ or DLPack; move a host " \
                      "array with cupy.asarray first"

    def __init__(self) -> None:
        super().__init__()
        self._device_infos: dict[int, DeviceInfo] = {}

    def _compile(self, filename, source, instances):
        includes = tuple(f"-I{d}" for d in (KERNEL_DIR, *cuda_include_dirs()[:1]))
        return cupy.RawModule(code=source, options=("-std=c++17", *includes), name_expressions=list(instances))

    def occupancy(self, op, instance, threads, shared_mem):
        """cudaOccupancyMaxActiveBlocksPerMultiprocessor for the compiled kernel (registers, shared memory)."""
        from cupy.cuda import driver

        function = self.kernel(op, instance).kernel   # the RawKernel's loaded cupy.cuda.function.Function
        return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, threads, shared_mem)))

    def opt_in_shared_memory(self, op, instance, nbytes):
        """Raise the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize on the current device to ``nbytes``."""
        fn = self.kernel(op, instance)
        if fn.max_dynamic_shared_size_bytes < nbytes:
            fn.max_dynamic_shared_size_bytes = nbytes

    def capture(self, run):
        """Capture on a private non-blocking stream (ordered after the caller's); replay on the current stream."""
        caller = cupy.cuda.get_current_stream()
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(caller.record())
        recorder = Recorder(execute=True, capturing=True)   # launched on the capturing stream: recorded by CUDA
        with stream, cupy.cuda.using_allocator(_refuse_allocation), capturing(recorder):
            cuda_graph = capture_on(stream, run)
        cuda_graph.upload()

        def replay_once():
            cuda_graph.launch(stream=cupy.cuda.get_current_stream())
        return recorder.launches, replay_once, (cuda_graph, stream)

    def device_info(self):
        """The current device's properties, read once per device (every plan asks for them)."""
        device = cupy.cuda.Device().id
        known = self._device_infos.get(device)
        if known is None:
            known = self._device_infos[device] = self._read_device_info(device)
        return known

    def _read_device_info(self, device: int) -> DeviceInfo:
        from cupy.cuda import runtime

        props = runtime.getDeviceProperties(device)
        name = props["name"]
        driver, runtime_version = runtime.driverGetVersion(), runtime.runtimeGetVersion()
        details = {
            "device_index": device,
            "compute_capability": f"{props['major']}.{props['minor']}",
            "sm_count": int(props["multiProcessorCount"]),
            "memory_bytes": int(props["totalGlobalMem"]),
            "l2_bytes": int(props["l2CacheSize"]),
            "driver_version": _cuda_version(driver), "driver_version_code": int(driver),
            "cuda_runtime_version": _cuda_version(runtime_version), "cuda_runtime_version_code": int(runtime_version),
            "cupy_version": cupy.__version__,
        }
        return DeviceInfo(name=name.decode() if isinstance(name, bytes) else str(name), emulated=False,
                          multiprocessor_count=details["sm_count"], l2_bytes=details["l2_bytes"], details=details)

    def _foreign_device_array(self, array):
        # DLPack first: it carries bfloat16 as bfloat16, where torch's __cuda_array_interface__
        # gives bfloat16 an untyped "<V2" typestr (older torch versions raise instead).
        if hasattr(array, "__dlpack__") and not isinstance(array, np.ndarray):
            return cupy.from_dlpack(array)
        if hasattr(array, "__cuda_array_interface__"):
            return cupy.asarray(array)
        return None

    def use_exact_allocations(self):
        cupy.cuda.set_allocator(None)

    def storage_dtype(self, dtype):
        return _STORAGE[dtype]

    def _zeros(self, shape, dtype):
        return cupy.zeros(shape, dtype)

    def _device_index(self):
        return cupy.cuda.runtime.getDevice()

    def _stream_capturing(self):
        """cudaStreamIsCapturing on the current stream; a query CUDA refuses counts as a capture under way."""
        try:
            return bool(cupy.cuda.get_current_stream().is_capturing())
        except cupy.cuda.runtime.CUDARuntimeError:
            return True

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
        elif host_array.dtype == ml_dtypes.float8_e4m3fn:
            host_array = host_array.view(np.uint8)
        return cupy.asarray(host_array)

    def _to_host(self, array):
        return cupy.asnumpy(array)

    def _upload(self, device_array, host_values):
        device_array.set(np.ascontiguousarray(host_values, dtype=device_array.dtype))

    def _copy(self, dst, src):
        """cudaMemcpyAsync device to device on the current stream (a kernel for a strided view)."""
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            dst.data.copy_from_device_async(src.data, src.nbytes)
        else:
            cupy.copyto(dst, src)

    def _synchronize(self):
        cupy.cuda.get_current_stream().synchronize()


def _cuda_version(code: int) -> str:
    """CUDA's integer version (e.g. 13000) as text ("13.0")."""
    return f"{code // 1000}.{(code % 1000) // 10}"


def _refuse_allocation(size: int):
    raise CaptureError(f"allocation of {size} bytes inside a captured step: preallocate the buffer "
                       f"outside the step and pass it in (for example attention(..., out=buffer))")
