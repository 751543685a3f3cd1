"""The machine the emulator runs on: x86-64 Linux with GCC's g++ (9 or newer) at run time.

The runtime switches fibers with x86-64 assembly, reads Linux's signal context and maps its
shadow memory with Linux-only flags, and every module is compiled on first use with GCC-only
options (``-fsanitize=thread`` without its runtime library, ``--param tsan-*``,
``-fstack-clash-protection``). :func:`check_platform` says so in one clear error before
anything is compiled; :func:`run_compiler` runs g++ with a time limit.
"""

import functools
import os
import platform
import shutil
import signal
import subprocess

from cupykv.errors import InputError

from .errors import CompileError, PlatformError

MIN_GCC = 9
COMPILE_TIMEOUT_ENV = "CUPYKV_EMULATOR_COMPILE_TIMEOUT"
DEFAULT_COMPILE_TIMEOUT = 600.0   # seconds for one g++ run; the largest cupykv module takes well under a minute
_WHY = "the cupykv CPU emulator needs x86-64 Linux and GCC's g++ (9 or newer) at run time"


def check_platform(cxx):
    """Raise PlatformError unless this machine can run the emulator with the compiler ``cxx``.

    Checks the OS and architecture, that ``cxx`` is on ``PATH`` and that it is GCC 9 or newer
    (the compiler's own macros, read once per compiler path).
    """
    system, machine = platform.system(), platform.machine()
    if system != "Linux" or machine.lower() not in ("x86_64", "amd64"):
        raise PlatformError(f"{_WHY}; this machine is {system} {machine} (on a CUDA GPU use the 'cupy' backend)")
    path = shutil.which(cxx)
    if path is None:
        raise PlatformError(f"{_WHY}; {cxx!r} is not on PATH (install g++, or set CUPYKV_EMULATOR_CXX to a g++)")
    problem = _compiler_problem(path)
    if problem:
        raise PlatformError(f"{_WHY}; {problem}")


@functools.lru_cache(maxsize=None)
def _predefined_macros(path):
    """``(returncode, {name: value})`` of the compiler at ``path``'s predefined macros; raises
    OSError or TimeoutExpired when it does not run."""
    proc = subprocess.run([path, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                          timeout=60)
    macros = {}
    for line in proc.stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0] == "#define":
            macros[parts[1]] = parts[2]
    return proc.returncode, macros


@functools.lru_cache(maxsize=None)
def _compiler_problem(path):
    """What makes the compiler at ``path`` unusable, or ``""``."""
    try:
        returncode, macros = _predefined_macros(path)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{path} does not run ({error})"
    if returncode != 0 or "__GNUC__" not in macros or "__clang__" in macros:
        return f"{path} is not GCC (its predefined macros lack __GNUC__ or have __clang__)"
    version = f"{macros['__GNUC__']}.{macros.get('__GNUC_MINOR__', '0')}"
    if int(macros["__GNUC__"]) < MIN_GCC:
        return f"{path} is GCC {version}, older than {MIN_GCC}"
    return ""


def gcc_major(cxx):
    """The major version of the g++ ``cxx`` (after :func:`check_platform` accepted it)."""
    return int(_predefined_macros(shutil.which(cxx))[1]["__GNUC__"])


def compile_timeout():
    """Seconds one g++ run may take: ``$CUPYKV_EMULATOR_COMPILE_TIMEOUT``, default 600."""
    return seconds_setting(COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT)


def seconds_setting(name, default):
    """The number of seconds the environment variable ``name`` holds (read now), or ``default``
    when it is unset or blank; anything but a finite number > 0 raises InputError naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise InputError(f"{name}: expected a number of seconds > 0, got {text!r}")
    return seconds


def kib_setting(name, default, minimum, maximum):
    """The whole number of KiB the environment variable ``name`` holds (read now), or ``default``
    when it is unset or blank; anything outside ``minimum..maximum`` raises InputError naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not (text.isdigit() and minimum <= int(text) <= maximum):
        raise InputError(f"{name}: expected a whole number of KiB from {minimum} to {maximum}, got {text!r}")
    return int(text)


def run_compiler(cmd, what, cwd=None):
    """Run ``cmd`` (a g++ command line) in ``cwd``; returns ``(returncode, output)``.

    g++ runs in its own process group, so that on a timeout, or when this process is
    interrupted, the whole group (the driver, cc1plus, as, ld) is killed. A timeout raises
    CompileError naming ``what`` and the setting that lengthens it.
    """
    timeout = compile_timeout()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CompileError(f"emulator: g++ did not finish compiling {what} within {timeout:g} s "
                           f"(set {COMPILE_TIMEOUT_ENV} to allow longer)") from None
    except BaseException:   # KeyboardInterrupt: do not leave a compiler running
        _kill_group(proc)
        raise
    return proc.returncode, output


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()
