"""The interface both backends implement.

Everything that differs between executing on a GPU and on the CPU emulator
is a method here: arrays (allocation, copies, what counts as a device array),
kernels (compile, launch), capture and replay of a step, and what the device
is (:class:`DeviceInfo`). Code above ``cupykv/backends/`` calls these methods
and never asks which backend it holds.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeGuard

import numpy as np
import numpy.typing as npt

from cupykv._typing import DeviceArray, DTypeLike, HostArray
from cupykv.backends.capture import (CaptureError, Kernel, Launch, Recorder, active_capture, capturing,
                                     refuse_in_capture)
from cupykv.kernels import KERNELS

if TYPE_CHECKING:
    from cupykv.backends.emulator.accounting import Traffic
    from cupykv.backends.warm_up import WarmUp


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend runs on, for launch planning and for reports.

    Attributes
    ----------
    name : str
        The device as a person would name it (``"NVIDIA H200"``, or the emulator and its CPU).
    emulated : bool
        Kernels run on the CPU emulator: timings are not GPU figures, and
        blocks run one after another.
    multiprocessor_count : int
        Streaming multiprocessors that run blocks at once (1 on the emulator).
    l2_bytes : int
        L2 cache size (0 when there is none to flush).
    details : dict
        Versions and properties for the bench's environment record (JSON values).
    """

    name: str
    emulated: bool
    multiprocessor_count: int
    l2_bytes: int = 0
    details: dict[str, Any] = field(default_factory=dict)


class Backend:
    """Arrays and kernel launches for one execution target.

    Subclasses set ``name`` and ``xp`` and implement the array helpers and
    ``_compile``. Compiled modules are cached per op, and launchable kernels
    per ``(op, instance)``, for the life of the backend.
    """

    name: str = ""
    xp: Any = None   # the array module, numpy or cupy (which has no type information)
    #: what a host array is called in messages, and how to move one to the device
    host_array_hint: str = ""

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._always_run: dict[int, DeviceArray] = {}   # device index -> its int32 [1] word holding 1
        self._always_run_ranges: tuple[tuple[str, int, int], ...] = ()

    # -- kernels -------------------------------------------------------------
    def launch(self, op: str, instance: str, grid: Sequence[int], block: Sequence[int], args: Sequence[object],
               shared_mem: int = 0) -> None:
        """Launch ``instance`` of ``kernels/<op>.cu``, or hand it to the capture in progress.

        Graph-safe: yes — inside a captured step the launch is recorded (on CuPy, by CUDA stream
        capture).
        """
        fn = self.kernel(op, instance)
        recorder = active_capture()
        if recorder is None:
            fn(grid, block, args, shared_mem=shared_mem)
        else:
            recorder.launch(self, fn, grid, block, args, shared_mem)

    def kernel(self, op: str, instance: str) -> Kernel:
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

    def warm_up(self, ops: Sequence[str] | None = None, processes: int | None = None) -> WarmUp:
        """Compile the kernel modules of ``ops`` (all by default) now, in parallel worker processes,
        into this backend's disk cache, so that their first use anywhere loads them instead
        (``cupykv.backends.warm_up``). Modules this backend already holds are left out.

        Graph-safe: no — refused inside a captured step (CaptureError).
        """
        from cupykv.backends.warm_up import compile_in_parallel

        refuse_in_capture("warm_up (it starts processes)", "warm up before capture")
        ops = [op for op in (KERNELS if ops is None else ops) if op not in self._modules]
        return compile_in_parallel(self.name, ops, processes)

    def occupancy(self, op: str, instance: str, threads: int, shared_mem: int) -> int:
        """Blocks of ``threads`` threads and ``shared_mem`` dynamic shared bytes resident per multiprocessor."""
        raise NotImplementedError

    def opt_in_shared_memory(self, op: str, instance: str, nbytes: int) -> None:
        """Let ``instance`` of ``kernels/<op>.cu`` launch with up to ``nbytes`` of dynamic shared memory.

        Past 48 KiB a CUDA launch fails unless the kernel opted in
        (``cudaFuncAttributeMaxDynamicSharedMemorySize``); both backends hold
        kernels to that. The opt-in only grows, and lasts for the life of the
        backend. Call it outside capture, before the occupancy query of such a
        launch (which counts the opt-in): a plan does, when it is made.
        """
        raise NotImplementedError

    def always_run(self) -> DeviceArray:
        """The ``run_if`` word of a launch that always runs: a device int32 array ``[1]`` holding 1.

        The op kernels take a trailing ``run_if`` pointer and return at once
        when it holds 0 (``kernels/common.cuh``); a call given ``run_if=None``
        passes this word. There is one per device, made on first use on the
        current device and kept for the life of the backend, so a captured
        graph may hold it. No launch writes it: every op refuses an output
        that overlaps it (it is registered with the buffers of caches and
        plans, as "the always-run word"); do not write it yourself.

        Graph-safe: yes, unless its first use on the current device comes inside a captured step — the
        first use allocates and uploads the word, which a captured step refuses (CaptureError); the
        warm-up run of :func:`cupykv.capture` runs the step eagerly first, so a step's own launches
        make it there.

        Returns
        -------
        device int32 array ``[1]`` holding 1, on the current device.

        Raises
        ------
        CaptureError
            The first use on this device inside a captured step.
        """
        device = self._device_index()
        word = self._always_run.get(device)
        if word is None:
            what = (f"allocating the always-run word of device {device} (Backend.always_run, the run_if of a "
                    f"launch given run_if=None)")
            instead = "launch one op with run_if=None, or call backend.always_run(), on this device before capture"
            refuse_in_capture(what, instead)
            if self._stream_capturing():   # a CUDA graph capture that cupykv.capture did not start
                raise CaptureError(f"{what} while the current stream is being captured: {instead}")
            word = self._always_run[device] = self._asarray(np.ones(1, np.int32))
            from cupykv._args import ALWAYS_RUN, byte_range, register_buffers   # deferred: _args imports backends
            self._always_run_ranges += ((ALWAYS_RUN, *byte_range(word)),)
            register_buffers(self)
        return word

    def owned_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(what, first, last)`` byte addresses of the always-run words: no op's output may write there.

        Graph-safe: yes — host values, taken when each word was made.
        """
        return self._always_run_ranges

    def _device_index(self) -> int:
        """The device kernels launch on now (0 where there is one)."""
        return 0

    def _stream_capturing(self) -> bool:
        """Whether the stream kernels launch on now is being captured into a graph by anyone (a GPU's business)."""
        return False

    # -- capture -------------------------------------------------------------
    def capture(self, run: Callable[[], object]) -> tuple[list[Launch], Callable[[], None], object]:
        """Record the launches of ``run()`` as one replayable step.

        Called by :func:`cupykv.capture` after the warm-up run. Returns
        the recorded launches, a function that replays them once on the
        current stream, and whatever must stay alive for replays.
        """
        raise NotImplementedError

    def _record(self, run: Callable[[], object], execute: bool) -> Recorder:
        """Run ``run()`` as a capture (refusing what a graph cannot replay) and return its recorder."""
        with capturing(Recorder(execute=execute, capturing=True)) as recorder:
            run()
        others = [backend.name for backend in recorder.backends if backend is not self]
        if others:
            raise CaptureError(f"step launched kernels on the {others} backend while capturing on "
                               f"{self.name}: a graph belongs to one backend")
        return recorder

    # -- the device ----------------------------------------------------------
    def device_info(self) -> DeviceInfo:
        """The device kernels launch on now."""
        raise NotImplementedError

    # -- arrays --------------------------------------------------------------
    # Public array methods refuse to run inside a captured step; subclasses implement _zeros etc.
    def zeros(self, shape: int | Sequence[int], dtype: DTypeLike) -> DeviceArray:
        """A zero-filled device array of ``shape`` (a tuple, or an int for one axis, as ``cupy.zeros``).

        Graph-safe: no — refused inside a captured step (CaptureError): it allocates. Preallocate, and
        pass ``out=``.
        """
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        refuse_in_capture(f"allocating a {shape} {np.dtype(dtype)} array",
                                "preallocate it outside the step and pass it in (out=...)")
        return self._zeros(shape, dtype)

    def asarray(self, host_array: npt.ArrayLike) -> DeviceArray:
        """A device copy of a NumPy array (bfloat16 as this backend stores it).

        Graph-safe: no — refused inside a captured step (CaptureError): it allocates and uploads.
        """
        refuse_in_capture("copying a host array to the device", "upload it before capture")
        return self._asarray(host_array)

    def to_host(self, array: DeviceArray) -> HostArray:
        """A NumPy copy of a device array (synchronising).

        Graph-safe: no — refused inside a captured step (CaptureError): it synchronises and reads the
        device.
        """
        refuse_in_capture("reading a device array on the host (a synchronisation)",
                                "read it after replay()")
        return self._to_host(array)

    def upload(self, device_array: DeviceArray, host_values: npt.ArrayLike) -> None:
        """Copy host values into an existing device array.

        Graph-safe: no — refused inside a captured step (CaptureError): a host-to-device upload.
        """
        refuse_in_capture("copying host values to the device",
                                "pass a device int32 array, filled before capture, instead of host values")
        self._upload(device_array, host_values)

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        """Copy ``src`` into ``dst`` on the device: contiguous arrays of equal size and dtype
        (``src`` may also be an array of ``xp`` that is not a device array, such as NumPy values on the emulator).

        Graph-safe: no — refused inside a captured step (CaptureError): copies are made outside the
        step.
        """
        refuse_in_capture("backend.copy()", "copy outside the captured step")
        if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
            raise ValueError(f"src: expected shape {tuple(dst.shape)} and dtype {dst.dtype} (dst's), got "
                             f"shape {tuple(src.shape)} and dtype {src.dtype}")
        self._copy(dst, src)

    def _copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        raise NotImplementedError

    def storage_dtype(self, dtype: str) -> np.dtype[Any]:
        """The array dtype that holds cache dtype ``dtype`` on this backend."""
        raise NotImplementedError

    def check_device(self, name: str, array: DeviceArray) -> None:
        """Raise TypeError unless ``array`` lives on the device kernels launch on now (one device here)."""

    def available_memory(self) -> tuple[int | None, str]:
        """Bytes this backend can allocate now, and where that figure comes from (``None``: unknown)."""
        return None, "unknown"

    def _zeros(self, shape: Sequence[int], dtype: DTypeLike) -> DeviceArray:
        raise NotImplementedError

    def is_device_array(self, array: object) -> TypeGuard[DeviceArray]:
        """Whether ``array`` lives where this backend's kernels can read it."""
        raise NotImplementedError

    def device_array(self, name: str, array: object) -> DeviceArray:
        """``array`` as this backend's device array, zero-copy, or TypeError naming ``name``.

        Host arrays are refused on every backend (the emulator's device arrays
        are made by :meth:`asarray`, as CuPy's are by ``cupy.asarray``), so
        code that runs on the emulator runs unchanged on a GPU.
        """
        if self.is_device_array(array):
            return array
        converted = self._foreign_device_array(array)
        if converted is not None:
            return converted
        from cupykv._args.arrays import describe
        if isinstance(array, np.ndarray):
            raise TypeError(f"{name}: expected a device array ({self.host_array_hint}), got a host "
                            f"{describe(array)}")
        raise TypeError(f"{name}: expected a device array of the {self.name} backend "
                        f"({self.host_array_hint}), got {describe(array)}")

    def _foreign_device_array(self, array: object) -> DeviceArray | None:
        """A zero-copy view of another library's device array (DLPack), or ``None``."""
        return None

    def traffic(self, banks: bool = False) -> AbstractContextManager[Traffic]:
        """A context manager that counts the global-memory traffic of the launches in its block
        (with ``banks``, also their shared-memory bank wavefronts per call site).

        Only the emulator sees every access (see :func:`cupykv.testing.traffic`); on a GPU,
        Nsight Compute measures it.

        Raises
        ------
        ValueError
            This backend cannot count.
        """
        raise ValueError(f"traffic: counts emulator launches only, got the backend {self.name!r}; "
                         f"on a GPU, profile with Nsight Compute (python -m cupykv validate runs it)")

    def use_exact_allocations(self) -> None:
        """Give every later allocation its own device block (no pooling), so memory checkers see real bounds."""

    def _asarray(self, host_array: npt.ArrayLike) -> DeviceArray:
        raise NotImplementedError

    def _to_host(self, array: DeviceArray) -> HostArray:
        raise NotImplementedError

    def _upload(self, device_array: DeviceArray, host_values: npt.ArrayLike) -> None:
        raise NotImplementedError

    # -- synchronisation -----------------------------------------------------
    def synchronize(self) -> None:
        """Wait on the host until the work launched so far has finished.

        Graph-safe: no — refused inside a captured step (CaptureError): a host synchronisation
        invalidates a CUDA stream capture.
        """
        refuse_in_capture("backend.synchronize() (a host synchronisation, which invalidates a CUDA "
                                "stream capture)", "synchronise after replay(), outside the step")
        self._synchronize()

    def _synchronize(self) -> None:
        raise NotImplementedError
