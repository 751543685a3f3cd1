"""Exceptions raised by the CUDA emulator.

Every error names the kernel instance (``'cupykv_append<float>'``) and, when one is
to blame, the block and thread, so a failing test points at the bug directly.
"""


class EmulatorError(RuntimeError):
    """Base class of every emulator error."""


class CompileError(EmulatorError):
    """g++ rejected the kernel source; ``log`` holds the compiler's output."""

    def __init__(self, message, log=""):
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


class LaunchError(EmulatorError):
    """The launch was refused before running: geometry, shared memory, launch bounds
    or arguments do not fit the kernel."""


class EmulatorFault(EmulatorError):
    """A thread touched memory outside any buffer (out of bounds, stack overflow)."""


class BarrierError(EmulatorError):
    """Divergent ``__syncthreads``, a bad warp-intrinsic mask, or a deadlock."""


class DeviceAssertError(EmulatorError):
    """A device-side ``assert`` failed, or the kernel trapped."""
