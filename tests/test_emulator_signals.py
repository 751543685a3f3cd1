"""Signals during an emulator launch: Ctrl-C and the launch's CPU time limit stop a hung kernel,
and a fault is reported only where that is well defined (kernel code, the kernels' memcpy), else
the process stops loudly."""

import ctypes
import ctypes.util
import os
import queue
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cupykv.backends import emulator as E

KERNELS = Path(__file__).parent / "emulator_kernels"
SIGNALS = KERNELS / "signals.cu"
NAMES = ["spin", "spin_after_libm", "wait_for_flag", "wait_at_barriers", "print_string", "fill", "shift",
         "copy_floats"]

# Launches one kernel of signals.cu with 2 warps; prints "launching" first. On KeyboardInterrupt
# it checks that Python's SIGINT handler is back and that the emulator still runs kernels (with
# catch=False it lets the kernel's KeyboardInterrupt end the process). A Ctrl-C that lands before
# the launch began (a slow start on a busy machine) prints "early", and the launch starts again.
# Once the launch's Ctrl-C is caught, further ones (the parent's resends) are ignored. The child
# first installs Python's default SIGINT handler, as an interactive Python has it: a process started
# as a shell's background job (`cmd &`) inherits SIGINT ignored, Python then installs no handler,
# and the emulator rightly leaves Ctrl-C alone, so the kernel would spin on.
CHILD = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
            handler_back = signal.getsignal(signal.SIGINT) is signal.default_int_handler
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if "stopped by Ctrl-C" not in str(error):
                print("early", flush=True)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                continue
            if not catch:
                raise
            assert handler_back
            mod.get_function("fill")(1, 64, (out,))
            assert out.tolist() == [7] * 64
            print("interrupted:", error, flush=True)
            sys.exit(0)
        sys.exit(3)
    sys.exit(4)
""").format(names=NAMES)


def _lines(child):
    """A queue of the child's stdout lines (stripped; "" at its end), filled by a thread, so that
    the parent can wait for one with a timeout."""
    lines = queue.Queue()

    def read():
        for line in child.stdout:
            lines.put(line.strip())
        lines.put("")
    threading.Thread(target=read, daemon=True).start()
    return lines


def _interrupt_the_launch(child):
    """Sends Ctrl-C half a second after the child says "launching", again while it answers "early".
    A Ctrl-C that arrives as the launch begins, after Python last looked for signals and before the
    runtime took SIGINT, trips Python's handler, which runs only when the launch returns, so such a
    Ctrl-C is lost to a hung kernel, as for a user who must press Ctrl-C again: Ctrl-C is sent again
    every 5 s until the child answers. Returns the answer ("" when the child ended)."""
    lines = _lines(child)
    for _ in range(5):
        line = lines.get(timeout=60)
        if line != "launching":
            return line
        time.sleep(0.5)                        # the launch is spinning by now, or the child says "early"
        for _ in range(12):
            child.send_signal(signal.SIGINT)
            try:
                line = lines.get(timeout=5)
                break
            except queue.Empty:
                continue
        if line != "early":
            return line
    return line


def _wait_for_stderr(child, timeout=20):
    """Waits for the child to end while a thread drains its stderr, and returns that. A pipe holds
    64 KB: read only after the wait, a child writing more would block and never end."""
    text = []
    reader = threading.Thread(target=lambda: text.append(child.stderr.read()), daemon=True)
    reader.start()
    child.wait(timeout=timeout)
    reader.join(timeout=timeout)
    return "".join(text)


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
    ("wait_for_flag", "0"),   # nothing watched: the hook returns at once, the signal lands in it or the kernel
])
def test_ctrl_c_stops_a_hung_kernel(kernels, kernel, racecheck):
    env = dict(os.environ, CUPYKV_EMULATOR_RACECHECK=racecheck)
    child = _start(CHILD, SIGNALS, kernel, "catch", env=env)
    try:
        reply = _interrupt_the_launch(child)
        err = _wait_for_stderr(child)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert reply.startswith(f"interrupted: kernel '{kernel}' stopped by Ctrl-C in block (0,0,0)"), (reply, err)


def test_uncaught_ctrl_c_ends_the_process_with_keyboard_interrupt(kernels):
    child = _start(CHILD, SIGNALS, "spin", "let-go")
    try:
        reply = _interrupt_the_launch(child)
        err = _wait_for_stderr(child)
    finally:
        child.kill()
    assert reply == "" and child.returncode != 0, (reply, err)   # no line after the interrupt: it ended the process
    assert "KeyboardInterrupt: kernel 'spin' stopped by Ctrl-C" in err, err


def test_fault_inside_libc_stops_the_process_with_a_clear_message(kernels):
    """printf faults in libc, which may hold its stdout lock: the launch cannot be left safely. The
    report names the faulting block and thread (indices of two digits, printed by hand)."""
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        from cupykv.backends import emulator as E
        mod = E.Module(open(sys.argv[1]).read(), {NAMES!r}, filename=sys.argv[1])
        mod.get_function("print_string")(12, 32, (np.uint64(16), np.int32(11 * 32 + 17)))
    """)
    child = _start(code, SIGNALS)
    _, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGSEGV, err
    # the whole report, a line of its own from its first byte (the runtime writes it byte by byte)
    assert re.search(r"^cupykv emulator: SIGSEGV \(address 0x10\) in block \(11,0,0\) thread \(17,0,0\) inside a "
                     r"library function the kernel called \(pc 0x[0-9a-f]+; printf with a bad pointer, for "
                     r"example\)\. That code may hold locks or be halfway through updating its state, so the "
                     r"launch cannot be abandoned safely: the process stops here\.$", err, re.M), err


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
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever this process inherited
    try:
        seen = []
        out = E.zeros(64, np.int32)
        thread = threading.Thread(target=lambda: seen.append(kernels.get_function("fill")(1, 64, (out,))))
        thread.start()
        thread.join()
        assert seen == [None] and out.tolist() == [7] * 64
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)



# Launches wait_for_flag (whose reads call the access hook, which polls for a stop) on another thread
# under a 2 s time limit while the main thread waits for it, and prints what each thread met.
WORKER_CHILD = textwrap.dedent("""
    import os, signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    from cupykv.backends import emulator as E
    os.environ["CUPYKV_EMULATOR_LAUNCH_TIMEOUT"] = "2"
    mod = E.Module(open(sys.argv[1]).read(), {names!r}, filename=sys.argv[1])
    out, met, done = E.zeros(64, np.int32), [], threading.Event()

    def launch():
        try:
            mod.get_function("wait_for_flag")(1, 64, (out,))
        except BaseException as error:
            met.append(type(error).__name__)
        done.set()
    print("launching", flush=True)
    threading.Thread(target=launch).start()
    try:
        while not done.wait(0.05):   # Python runs its handlers between turns, inside the try
            pass
    except KeyboardInterrupt:
        done.wait()   # (not Thread.join: after an interrupted join, Python 3.11's next one returned at once)
        print("main: KeyboardInterrupt; worker:", *met, flush=True)
        sys.exit(0)
    print("main: nothing; worker:", *met, flush=True)
""").format(names=NAMES)


def test_ctrl_c_during_a_launch_on_another_thread_is_pythons_on_the_main_thread(kernels):
    """The runtime takes Ctrl-C only for a launch on the main thread. Another thread's launch leaves it to
    Python's handler, which raises KeyboardInterrupt in the main thread as for any other work, while the
    launch goes on to its end (here the time limit stops the waiting kernel). Were the runtime to take it,
    the launch's next poll would end it with a KeyboardInterrupt in the worker, and the main thread would
    never hear of the Ctrl-C."""
    child = _start(WORKER_CHILD, SIGNALS, env=dict(os.environ, CUPYKV_EMULATOR_RACECHECK="1"))
    try:
        lines = _lines(child)
        assert lines.get(timeout=60) == "launching"
        time.sleep(0.5)                        # the kernel waits by now
        child.send_signal(signal.SIGINT)
        reply = lines.get(timeout=60)
        err = _wait_for_stderr(child)
    finally:
        child.kill()
    assert (reply, child.returncode) == ("main: KeyboardInterrupt; worker: LaunchTimeoutError", 0), (reply, err)

# Launches one kernel of signals.cu with 2 warps under the time limit CUPYKV_EMULATOR_LAUNCH_TIMEOUT
# sets, on the main thread or another one, with (out,) or (out, order) as its arguments, and prints
# the error and the CPU time the launching thread spent in the launch; then spends 0.3 s of CPU
# time (a timer left behind would signal again and end the process), checks that the emulator still
# runs kernels (under the default limit), and sends itself the time limit's signal, whose default
# action (the runtime's handler gone) ends the process. A child process: were the limit broken, the
# launch would never end, and the parent's timeout fails the test instead of hanging the suite.
TIME_LIMIT_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    from cupykv.backends import emulator as E
    path, kernel, on_thread = sys.argv[1], sys.argv[2], sys.argv[3] == "thread"
    args = tuple(np.int32(a) for a in sys.argv[4:])
    mod = E.Module(open(path).read(), {names!r}, filename=path)
    out = E.zeros(64, np.int32)
    errors, spent = [], []

    def launch():
        started = time.thread_time()
        try:
            mod.get_function(kernel)(1, 64, (out,) + args)
        except E.LaunchTimeoutError as error:
            errors.append(error)
        spent.append(time.thread_time() - started)
    if on_thread:
        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
    else:
        launch()
    print(*errors, flush=True)
    print(*spent, flush=True)
    busy_until = time.thread_time() + 0.3
    while time.thread_time() < busy_until:
        pass
    # under the default limit: a tick of the CPU clock inside even this short launch would end it
    # under one far below a nanosecond (2000 launches of fill met 6 such ticks on an idle core)
    del os.environ["CUPYKV_EMULATOR_LAUNCH_TIMEOUT"]
    mod.get_function("fill")(1, 64, (out,))
    assert out.tolist() == [7] * 64
    print("still runs", flush=True)
    signal.raise_signal(signal.SIGRTMIN + 2)
    print("the time limit's handler outlived the launch", flush=True)
""").format(names=NAMES)


def _line_of(text):
    """The line of signals.cu that holds ``text`` (1-based; it must be on exactly one)."""
    lines = [i for i, line in enumerate(SIGNALS.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


@pytest.mark.parametrize("kernel, racecheck, thread, stopped_at", [
    # a loop in kernel code: the timer's signal leaves the kernel at the instruction it lands on
    ("spin", "1", "main", ["while (go)"]),
    ("spin", "1", "thread", ["while (go)"]),   # the timer signals the launching thread
    # reads call the access hook: the poll there stops the thread and names the read's line
    ("wait_for_flag", "1", "main", ["while (((volatile int*)flag)[0] == 0)"]),
    # no regions watched: the hook returns at once, and the signal lands in the hook or the kernel
    ("wait_for_flag", "0", "main", ["while (((volatile int*)flag)[0] == 0)"]),
    # the scheduler switches threads at every barrier: the stop may also come between two of them
    ("wait_at_barriers", "1", "main", ["while (seen[0] == 0)", "__syncthreads();", None]),
])
def test_a_kernel_that_never_ends_stops_at_the_time_limit_naming_its_line(kernel, racecheck, thread, stopped_at):
    _check_stopped_at_the_time_limit(kernel, racecheck, thread, stopped_at, limit="0.5")


def test_a_limit_far_below_a_nanosecond_still_stops_the_launch():
    """The timer counts whole nanoseconds: a limit that rounds to 0 must still arm it (a zero
    expiry would disarm it, and the spin would never end)."""
    _check_stopped_at_the_time_limit("spin", "1", "main", None, limit="1e-12")


def test_the_time_limit_signal_repeats_until_one_lands_where_it_can_stop_the_thread():
    """The first signal lands in libm, where it only sets a flag, and nothing polls it afterwards.

    The kernel calls jnf of a large order and then spins on a local. A timer that signalled once
    would leave the launch spinning forever (the child's timeout fails the test); the repeating
    one stops it in the spin. The premise, that the call outlasts the limit, is measured here.
    """
    order, limit = 200_000_000, 0.2
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.jnf.restype, libm.jnf.argtypes = ctypes.c_float, [ctypes.c_int, ctypes.c_float]
    started = time.thread_time()
    libm.jnf(order, 1.0)
    spent = time.thread_time() - started
    assert spent > 2 * limit, f"jnf({order}, 1) took {spent:.3f} s of CPU time: too short to hold the first signal"
    _check_stopped_at_the_time_limit("spin_after_libm", "1", "main", ["while (spinning)"], limit=str(limit),
                                     args=(order,))


def _check_stopped_at_the_time_limit(kernel, racecheck, thread, stopped_at, limit, args=()):
    """Runs TIME_LIMIT_CHILD and checks its error, which names one of the places in `stopped_at`
    (a line of signals.cu holding the text, or None for between threads; any place when
    `stopped_at` is None), and that the launch ran for at least its limit, on the timer's clock."""
    env = dict(os.environ, CUPYKV_EMULATOR_RACECHECK=racecheck, CUPYKV_EMULATOR_LAUNCH_TIMEOUT=limit)
    child = _start(TIME_LIMIT_CHILD, SIGNALS, kernel, thread, *args, env=env)
    try:
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == -(signal.SIGRTMIN + 2), (child.returncode, out, err)
    error, cpu_seconds, still_runs = out.strip().splitlines()
    # A stop inside a thread (at a kernel line, or in the runtime) names the thread; a stop between
    # threads, in the scheduler, has none to name.
    stop = rf"the launch used more than its {re.escape(limit)} s of CPU time \(CUPYKV_EMULATOR_LAUNCH_TIMEOUT\) and " \
           "was stopped "
    named_thread = r" thread \(\d+,0,0\)"
    if stopped_at is None:
        after_block = rf"({named_thread})?: {stop}"
    else:
        after_block = "(?:" + "|".join(rf"{named_thread}: {stop}at \S*signals\.cu:{_line_of(text)}\b" if text else
                                       rf": {stop}between threads, in the scheduler" for text in stopped_at) + ")"
    assert re.match(rf"kernel '{kernel}' block \(0,0,0\){after_block}", error), error
    assert "its outputs are incomplete" in error and "waits forever" in error
    assert float(cpu_seconds) >= float(limit), (cpu_seconds, limit)
    assert still_runs == "still runs"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "ten"])
def test_the_time_limit_setting_is_checked_before_anything_runs(kernels, monkeypatch, value):
    out = E.zeros(64, np.int32)
    monkeypatch.setenv("CUPYKV_EMULATOR_LAUNCH_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"CUPYKV_EMULATOR_LAUNCH_TIMEOUT: expected a number of seconds > 0, "
                                         f"got '{value}'"):
        kernels.get_function("fill")(1, 64, (out,))
    assert out.tolist() == [0] * 64


def test_the_time_limit_is_600_cpu_seconds_unless_set(kernels, monkeypatch):
    from cupykv.backends.emulator import launch
    monkeypatch.delenv("CUPYKV_EMULATOR_LAUNCH_TIMEOUT", raising=False)
    assert launch.launch_timeout() == 600
    monkeypatch.setenv("CUPYKV_EMULATOR_LAUNCH_TIMEOUT", " 2.5 ")
    assert launch.launch_timeout() == 2.5
    out = E.zeros(64, np.int32)
    kernels.get_function("fill")(1, 64, (out,))   # a launch well inside its limit is untouched
    assert out.tolist() == [7] * 64


def test_the_text_section_is_read_from_the_module_as_readelf_lists_it(kernels):
    """The range a stop signal may leave a kernel from: ``.text`` exactly, which the PLT's stubs
    (where a pc names no line) lie outside of."""
    from cupykv.backends.emulator import sites
    listing = subprocess.run(["readelf", "-SW", kernels.path], capture_output=True, text=True, check=True).stdout
    sections = {}   # [Nr] Name Type Address Off Size ...
    for name, address, size in re.findall(r"\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)",
                                          listing):
        sections[name] = (int(address, 16), int(address, 16) + int(size, 16))
    assert sites.text_section(kernels.path) == sections[".text"]
    lo, hi = sections[".text"]
    plt = [span for name, span in sections.items() if name.startswith(".plt")]
    assert plt and all(end <= lo or start >= hi for start, end in plt), (sections, lo, hi)
