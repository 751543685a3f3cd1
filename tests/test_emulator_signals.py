"""Signals during an emulator launch: Ctrl-C stops a hung kernel, and a fault is reported only
where that is well defined (kernel code, the kernels' memcpy), else the process stops loudly."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cupykv.backends import emulator as E

KERNELS = Path(__file__).parent / "emulator_kernels"
SIGNALS = KERNELS / "signals.cu"
NAMES = ["spin", "wait_for_flag", "print_string", "fill", "shift", "copy_floats"]

# Launches one kernel of signals.cu with 2 warps; prints "launching" first. On KeyboardInterrupt
# it checks that Python's SIGINT handler is back and that the emulator still runs kernels (with
# catch=False it lets the kernel's KeyboardInterrupt end the process). A Ctrl-C that lands before
# the launch began (a slow start on a busy machine) prints "early", and the launch starts again.
CHILD = textwrap.dedent("""
    import signal, sys
    import numpy as np
    from cupykv.backends import emulator as E
    path, kernel, catch = sys.argv[1], sys.argv[2], sys.argv[3] == "catch"
    mod = E.Module(open(path).read(), {names!r}, filename=path)
    out = E.zeros(64, np.int32)
    for attempt in range(5):
        try:
            print("launching", flush=True)
            mod.get_function(kernel)(1, 64, (out,))
        except KeyboardInterrupt as error:
            if "stopped by Ctrl-C" not in str(error):
                print("early", flush=True)
                continue
            if not catch:
                raise
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            mod.get_function("fill")(1, 64, (out,))
            assert out.tolist() == [7] * 64
            print("interrupted:", error, flush=True)
            sys.exit(0)
        sys.exit(3)
    sys.exit(4)
""").format(names=NAMES)


def _interrupt_the_launch(child):
    """Sends Ctrl-C half a second after the child says "launching", again while it answers "early"."""
    for _ in range(5):
        line = child.stdout.readline().strip()
        if line != "launching":
            return line
        time.sleep(0.5)                        # the launch is spinning by now, or the child says "early"
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline().strip()
        if line != "early":
            return line
    return line


@pytest.fixture(scope="module")
def kernels():
    return E.Module(SIGNALS.read_text(), NAMES, filename=str(SIGNALS))


def _start(code, *args, env=None):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))


@pytest.mark.parametrize("kernel, racecheck", [
    ("spin", "1"),            # a loop in kernel code: the handler leaves the kernel at once
    ("wait_for_flag", "1"),   # reads call the access hook: the runtime's poll stops it
    ("wait_for_flag", "0"),   # no race checker, no hook: again a loop in kernel code
])
def test_ctrl_c_stops_a_hung_kernel(kernels, kernel, racecheck):
    env = dict(os.environ, CUPYKV_EMULATOR_RACECHECK=racecheck)
    child = _start(CHILD, SIGNALS, kernel, "catch", env=env)
    try:
        reply = _interrupt_the_launch(child)
        out, err = child.communicate(timeout=20)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert reply.startswith(f"interrupted: kernel '{kernel}' stopped by Ctrl-C in block (0,0,0)"), (reply, out, err)


def test_uncaught_ctrl_c_ends_the_process_with_keyboard_interrupt(kernels):
    child = _start(CHILD, SIGNALS, "spin", "let-go")
    try:
        reply = _interrupt_the_launch(child)
        _, err = child.communicate(timeout=20)
    finally:
        child.kill()
    assert reply == "" and child.returncode != 0, (reply, err)   # no line after the interrupt: it ended the process
    assert "KeyboardInterrupt: kernel 'spin' stopped by Ctrl-C" in err, err


def test_fault_inside_libc_stops_the_process_with_a_clear_message(kernels):
    """printf faults in libc, which may hold its stdout lock: the launch cannot be left safely."""
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        from cupykv.backends import emulator as E
        mod = E.Module(open(sys.argv[1]).read(), {NAMES!r}, filename=sys.argv[1])
        mod.get_function("print_string")(1, 32, (np.uint64(16),))
    """)
    child = _start(code, SIGNALS)
    _, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGSEGV, err
    assert "cupykv emulator: SIGSEGV (address 0x10) in block (0,0,0) thread (0,0,0) inside a library " \
           "function the kernel called" in err
    assert "cannot be abandoned safely: the process stops here" in err


def test_out_of_bounds_memcpy_is_reported(kernels):
    x = E.asarray(np.arange(64, dtype=np.float32))
    y = E.zeros(65, np.float32)
    with pytest.raises(E.EmulatorFault, match=r"thread \(0,0,0\): out-of-bounds read of argument 1 at "
                                              r"element 64"):
        kernels.get_function("copy_floats")(1, 32, (y, x, np.int32(65)))
    kernels.get_function("copy_floats")(1, 32, (y, x, np.int32(64)))
    assert y[:64].tolist() == list(range(64))


# Maps 64 floats so that the guard page after them lies within 64 KiB below the fiber stacks (CI's
# host once put a buffer there by chance), copies one float past their end and prints the error, or
# "no room" when every such place is taken. A fresh process, so that little is mapped below them.
BELOW_THE_STACKS = textwrap.dedent(f"""
    import ctypes, sys
    import numpy as np
    from cupykv.backends import emulator as E
    from cupykv.backends.emulator import build, memory
    copy = E.Module(open(sys.argv[1]).read(), {NAMES!r}, filename=sys.argv[1]).get_function("copy_floats")
    y = E.zeros(65, np.float32)
    copy(1, 32, (y, E.asarray(np.arange(64, dtype=np.float32)), np.int32(64)))   # the stacks exist
    lo, hi = ctypes.c_uint64(), ctypes.c_uint64()
    build.runtime().cuemu_fiber_stacks(ctypes.byref(lo), ctypes.byref(hi))
    assert 0 < lo.value < hi.value
    any_place, map_fixed_noreplace, below = memory._mmap, 0x100000, None
    for pages_below in range(3, 17):   # guard, one data page, guard: the last guard page is in the 64 KiB
        hint = lo.value - pages_below * memory.PAGE
        memory._mmap = lambda _, length, prot, flags, fd, offset: any_place(
            hint, length, prot, flags | map_fixed_noreplace, fd, offset)
        try:
            placed = E.asarray(np.arange(64, dtype=np.float32))
        except MemoryError:   # something else is mapped there
            continue
        finally:
            memory._mmap = any_place
        if memory._owner(placed).map_addr == hint:
            below = placed
            break
    if below is None:
        print("no room")
    else:
        try:
            copy(1, 32, (y, below, np.int32(65)))
            print("no error")
        except E.EmulatorFault as error:
            print(error)
""")


def test_a_fault_just_below_the_fiber_stacks_is_out_of_bounds_not_a_stack_overflow(kernels):
    """The guard page after a buffer mapped right below the first fiber's stack is not that
    stack's guard: there is no fiber below fiber 0 whose stack could have run into it."""
    child = _start(BELOW_THE_STACKS, SIGNALS)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() != "no room", "every page in the 64 KiB below the fiber stacks was taken"
    assert "thread (0,0,0): out-of-bounds read of argument 1 at element 64" in out, out


def test_memmove_and_memset(kernels):
    a = E.asarray(np.arange(10, dtype=np.int32))
    kernels.get_function("shift")(1, 32, (a, np.int32(8)))
    want = np.arange(10)
    want[1:9] = want[0:8].copy()
    want[0:8] = want[2:10].copy()
    want[8:10] = 0
    assert a.tolist() == want.tolist()


def test_launch_off_the_main_thread_leaves_sigint_to_python(kernels):
    import threading
    seen = []
    out = E.zeros(64, np.int32)
    thread = threading.Thread(target=lambda: seen.append(kernels.get_function("fill")(1, 64, (out,))))
    thread.start()
    thread.join()
    assert seen == [None] and out.tolist() == [7] * 64
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
