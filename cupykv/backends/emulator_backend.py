"""The emulator backend: NumPy arrays in guarded memory, kernels run on the CPU."""
from __future__ import annotations

import os
import platform

import ml_dtypes
import numpy as np

from cupykv.backends import emulator
from cupykv.backends.base import Backend, DeviceInfo
from cupykv.backends.capture import refuse_in_capture
from cupykv.kernels import KERNEL_DIR

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16), "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn)}
_HOST_MATH = "it would run once, at capture, not at every replay; use cupykv ops"


def _is_basic_index(index) -> bool:
    """Whether ``index`` is NumPy basic indexing (ints, slices, None, ...): a view or one element, no gather."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(part is None or part is Ellipsis or isinstance(part, slice)
               or (isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)))
               for part in parts)


class DeviceArray(np.ndarray):
    """A NumPy array in the emulator's guarded memory: the emulator's device array.

    It behaves as a NumPy array, except inside a captured step, where host-side
    NumPy computation on it raises (a GPU graph would not replay it either).
    Views (basic slicing) stay allowed there: as on CuPy, they touch no data.
    """

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        refuse_in_capture(f"numpy.{ufunc.__name__} on an emulator device array", _HOST_MATH)
        plain = tuple(x.view(np.ndarray) if isinstance(x, DeviceArray) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, DeviceArray) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        refuse_in_capture(f"numpy.{func.__name__} on an emulator device array", _HOST_MATH)
        return super().__array_function__(func, types, args, kwargs)

    def __getitem__(self, index):
        if not _is_basic_index(index):
            refuse_in_capture("indexing an emulator device array with an array (a gather on the host)",
                                    _HOST_MATH)
        item = super().__getitem__(index)
        if not isinstance(item, np.ndarray):
            refuse_in_capture("reading an emulator device array on the host", _HOST_MATH)
        return item

    def __setitem__(self, index, value):
        refuse_in_capture("writing an emulator device array from the host", _HOST_MATH)
        super().__setitem__(index, value)


def stated_multiprocessors() -> int:
    """The SM count the emulator reports: ``CUPYKV_EMULATOR_SMS`` (read at every call), else 1.

    The emulator runs one block at a time whatever this says; the number only feeds the plans made
    from :meth:`EmulatorBackend.device_info`, so that a stated device (``CUPYKV_EMULATOR_SMS=132``: an
    H200's SMs) gets the split-KV plan a GPU with that many SMs would make (at one resident block
    per SM, :meth:`EmulatorBackend.occupancy`), and the emulator runs and checks it.
    """
    text = os.environ.get("CUPYKV_EMULATOR_SMS", "").strip()
    if not text:
        return 1
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= 65535:
        raise ValueError(f"CUPYKV_EMULATOR_SMS: expected an int in 1..65535 (the SM count the emulator states), "
                         f"got {text!r}")
    return count


class EmulatorBackend(Backend):
    """Runs the same ``.cu`` sources through cupykv's CUDA emulator."""

    name = "emulator"
    xp = np
    host_array_hint = "an emulator device array, made by cache.to_device(array) or backend.asarray(array)"

    def _compile(self, filename, source, instances):
        return emulator.Module(source, instances, include_dirs=(KERNEL_DIR,), filename=filename)

    def occupancy(self, op, instance, threads, shared_mem):
        """One: the emulator runs one block at a time."""
        return 1

    def opt_in_shared_memory(self, op, instance, nbytes):
        """The emulated kernel's launch limit on dynamic shared memory becomes ``nbytes`` (at most sm_90's)."""
        self.kernel(op, instance).opt_in_shared_memory(nbytes)

    def capture(self, run):
        """Freeze each launch's arguments, as CUDA does; a replay runs the frozen launches."""
        launches = self._record(run, execute=False).launches

        def replay_once():
            for fn, grid, block, args, shared_mem in launches:
                fn(grid, block, args, shared_mem=shared_mem)
        return launches, replay_once, None

    def traffic(self, banks=False):
        return emulator.traffic(banks=banks)

    def device_info(self):
        cpu = f"{platform.machine()}, {os.cpu_count()} cores"
        details = {"cupy_version": None}
        try:
            import cupy
            details["cupy_version"] = cupy.__version__
        except Exception:  # not installed, or broken without a driver: the emulator does not need it
            pass
        return DeviceInfo(name=f"cupykv CUDA emulator on the CPU ({cpu})", emulated=True,
                          multiprocessor_count=stated_multiprocessors(), details=details)

    def storage_dtype(self, dtype):
        return _STORAGE[dtype]

    def available_memory(self):
        """Host memory the kernel can give without swapping: MemAvailable, else free physical pages."""
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages (os.sysconf)"
        except (AttributeError, OSError, ValueError):
            return None, "unknown"

    def _zeros(self, shape, dtype):
        return emulator.zeros(shape, dtype).view(DeviceArray)

    def is_device_array(self, array):
        return isinstance(array, DeviceArray)

    def _asarray(self, host_array):
        # np.asarray(order="C"), not np.ascontiguousarray, which turns a 0-d array into shape (1,)
        return emulator.asarray(np.asarray(host_array, order="C")).view(DeviceArray)

    def _to_host(self, array):
        return np.array(array, copy=True)

    def _upload(self, device_array, host_values):
        np.copyto(device_array.view(np.ndarray), host_values, casting="unsafe")

    def _copy(self, dst, src):
        np.copyto(dst.view(np.ndarray), np.asarray(src).view(np.ndarray))

    def _synchronize(self):
        emulator.synchronize()
