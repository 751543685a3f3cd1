"""CUDA-on-CPU emulator: runs cupykv's unmodified .cu kernels with g++ and checks them.

Every CUDA thread is a fiber, so ``__syncthreads`` and the warp intrinsics have their
real semantics; the emulator raises on divergent barriers, bad warp masks, deadlocks,
data races in shared memory and in written arguments, out-of-bounds global or dynamic
shared memory accesses, reads of an asynchronous copy's destination before its wait, bad
tensor-core fragment operands, failed device asserts, launches that break CUDA's limits or
the kernel's signature, and launches that never end (``CUPYKV_EMULATOR_LAUNCH_TIMEOUT``). ``CUPYKV_EMULATOR_SEED`` shuffles the order of blocks and threads.

    mod = Module(code, ["cupykv_append<float>"])
    fn = mod.get_function("cupykv_append<float>")
    fn((blocks,), (128,), (k_cache, k_new, np.int32(n)), shared_mem=0)

Arrays are numpy arrays; ``empty``/``zeros``/``asarray`` put them in guarded memory
(other numpy arrays are copied into guarded memory for the launch and back).
``with traffic() as t:`` counts every launch's memory traffic (bytes, 32-byte sectors,
sectors per warp request); ``with protected(array, start):`` makes bytes of an array fault.
"""

from .errors import (AsyncCopyError, BarrierError, CompileError, DeviceAssertError, EmulatorError,
                     EmulatorFault, EmulatorOptionWarning, FragmentError, LaunchError, LaunchTimeoutError,
                     PlatformError, RaceError, UninitializedReadError)
from .accounting import traffic
from .launch import Function, Module, synchronize
from .memory import asarray, asnumpy, empty, is_device_array, protected, zeros

__all__ = [
    "Module", "Function", "empty", "zeros", "asarray", "asnumpy", "is_device_array",
    "synchronize", "traffic", "protected", "EmulatorError", "CompileError", "LaunchError",
    "EmulatorFault", "BarrierError", "DeviceAssertError", "RaceError", "UninitializedReadError", "PlatformError",
    "AsyncCopyError", "FragmentError", "LaunchTimeoutError", "EmulatorOptionWarning",
]
