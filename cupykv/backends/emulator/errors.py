"""Exceptions raised by the CUDA emulator.

Every error names the kernel instance (``'cupykv_append<float>'``) and, when one is
to blame, the block and thread, so a failing test points at the bug directly. Under a
perturbed schedule (``CUPYKV_EMULATOR_SEED``) the message ends with the seed that replays it.
"""

from cupykv.errors import BackendUnavailableError


class EmulatorError(RuntimeError):
    """Base class of every emulator error."""


class PlatformError(EmulatorError, BackendUnavailableError):
    """This machine cannot run the emulator, which needs x86-64 Linux and GCC's g++ (9 or newer)
    at run time (``g++`` on ``PATH``, or ``CUPYKV_EMULATOR_CXX``). Raised before anything is
    compiled; a :class:`cupykv.errors.UserError`."""


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


class LaunchTimeoutError(EmulatorError):
    """The launch used more CPU time than ``CUPYKV_EMULATOR_LAUNCH_TIMEOUT`` allows (600 s
    unless set): most likely a loop that never ends, or a thread waiting for another block's
    write, which the emulator, running one block at a time, never makes. The message names the
    block, the thread that was running and the kernel line it was stopped at. The kernel's
    outputs are incomplete."""


class AsyncCopyError(EmulatorError):
    """An asynchronous copy (``cp.async``, ``kernels/async_copy.cuh``) was misused: bytes it still
    writes were read or written before the wait that completes it, its size, alignment or
    addresses are ones the instruction does not allow, or a thread exited with copies in flight.
    The message names both call sites (the access and the copy) and both threads."""


class FragmentError(EmulatorError):
    """A tensor-core fragment instruction (``ldmatrix``, ``mma``; ``kernels/mma.cuh``) was given
    an operand the GPU would not accept: a row address outside shared memory or not 16-byte
    aligned. (Lanes missing from the warp are a :class:`BarrierError`, as for every warp
    collective.)"""


class RaceError(EmulatorError):
    """A data race: two threads of one launch touched the same bytes, at least one of them
    writing, with nothing ordering them (no ``__syncthreads()``, no ``__syncwarp()`` or warp
    collective over both lanes, not both atomic). ``hazards`` lists them (see
    ``racecheck.Hazard``): kind, memory, where, both accesses and a count."""

    def __init__(self, message, hazards=()):
        super().__init__(message)
        self.hazards = list(hazards)


class UninitializedReadError(EmulatorError):
    """A read (or atomic) of shared memory that no thread of its block had written: on a GPU it
    returns whatever an earlier block or launch left there. ``reads`` lists them (see
    ``racecheck.Hazard``, whose two sides are the same access): where, the memory, the byte
    offset and a count per call site. Races in the same launch are reported first, as a
    :class:`RaceError`."""

    def __init__(self, message, reads=()):
        super().__init__(message)
        self.reads = list(reads)


class EmulatorOptionWarning(UserWarning):
    """``Module(..., options=...)`` was given an NVRTC option the emulator does not know; it was
    ignored (:mod:`cupykv.backends.emulator.compile_options`)."""
