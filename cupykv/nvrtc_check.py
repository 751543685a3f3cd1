"""Offline compile check: every kernel instance through NVRTC for real GPU targets.

``python -m cupykv check`` compiles each ``.cu`` file with all its template
instances for ``sm_80`` and ``sm_90`` and reads ptxas's report (registers,
stack, spills) from the program log, and each instance's ``__launch_bounds__``
(``.maxntid``, ``.minnctapersm``) from the PTX. No GPU is needed: NVRTC is a
library, loaded here with ctypes from the ``nvidia-cuda-nvrtc`` wheel, CuPy's
environment, or a CUDA toolkit. For the attention and ``linear`` instances it
prints the occupancy their registers, threads and shared memory imply
(:mod:`cupykv.occupancy`). The check fails on any compile error, on any
register spill, on a ``__launch_bounds__`` above the 1024 threads a block may
have (which NVRTC accepts), and on an instance resident at fewer blocks per SM
than its ``__launch_bounds__`` minimum (the occupancy its design assumes), so
code that only compiles for the emulator, or only performs as designed on
paper, never lands.
"""
from __future__ import annotations

import ctypes
import glob
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, replace

from cupykv import occupancy
from cupykv.kernels import KERNEL_DIR, KERNELS, cuda_include_dirs, cuda_paths

ARCHS = ("sm_80", "sm_90")
#: What CuPy 14 passes to NVRTC for a RawModule (cupy/cuda/compiler.py adds ``-ftz=true`` and
#: ``--device-as-default-execution-space`` to the caller's ``-std=c++17``), plus ptxas's report.
OPTIONS = ("-std=c++17", "-ftz=true", "--device-as-default-execution-space", "-Xptxas=-v")
#: The NVRTC the ``test`` extra installs (setup.cfg pins it), and a second, older 13.x that CI
#: checks too, so that the no-spill verdict holds with margin rather than for one allocator.
PINNED_NVRTC = "13.5.37"
SECOND_NVRTC = "13.0.88"


class NvrtcError(RuntimeError):
    """NVRTC could not be loaded, or a kernel did not compile."""


def _candidate_libraries() -> list[str]:
    found = cuda_paths(("cu*/lib/libnvrtc.so*", "cuda_nvrtc/lib/libnvrtc.so*"), "lib64/libnvrtc.so*")
    return [path for path in found if "builtins" not in os.path.basename(path)]


def _preload_builtins(library_path: str) -> None:
    """NVRTC dlopens libnvrtc-builtins by soname; load it from beside libnvrtc first."""
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(library_path), "libnvrtc-builtins.so*"))):
        try:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:  # pragma: no cover - try the next candidate
            continue


def _wheel_version(library_path: str) -> str | None:
    """Version of the ``nvidia-cuda-nvrtc`` wheel that holds ``library_path``, if it came from one."""
    folder = os.path.dirname(os.path.realpath(library_path))
    while os.path.basename(folder) != "nvidia":
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    site = os.path.dirname(folder)
    for dist_info in glob.glob(os.path.join(site, "nvidia_cuda_nvrtc*.dist-info")):
        name = os.path.basename(dist_info)[: -len(".dist-info")]
        return name.rsplit("-", 1)[-1]
    return None


@dataclass(frozen=True)
class Nvrtc:
    """A loaded libnvrtc: the library, where it came from and which version it is."""

    lib: ctypes.CDLL
    path: str
    version: tuple[int, int]       # nvrtcVersion()
    wheel_version: str | None      # nvidia-cuda-nvrtc's version, when loaded from that wheel

    def describe(self) -> str:
        wheel = f" (nvidia-cuda-nvrtc {self.wheel_version})" if self.wheel_version else ""
        return f"NVRTC {self.version[0]}.{self.version[1]}{wheel} from {self.path}"


def _open(path: str) -> Nvrtc:
    _preload_builtins(path)
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return Nvrtc(lib, path, (major.value, minor.value), _wheel_version(path))


def find_library(root: str) -> str:
    """The libnvrtc.so under ``root`` (a wheel unpacked with ``pip install --target``, or a toolkit)."""
    found = sorted(p for p in glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True)
                   if "builtins" not in os.path.basename(p))
    if not found:
        raise NvrtcError(f"no libnvrtc.so under {root}")
    return found[0]


def load_nvrtc(path: str | None = None) -> Nvrtc:
    """Load libnvrtc: ``path`` when given, else the pip wheel, else a system toolkit.

    ``path`` may be the library itself or a folder holding it (see :func:`find_library`).
    """
    if path is not None:
        library = find_library(path) if os.path.isdir(path) else path
        try:
            return _open(library)
        except OSError as exc:
            raise NvrtcError(f"cannot load {library}: {exc}") from None
    errors = []
    for candidate in _candidate_libraries():
        try:
            return _open(candidate)
        except OSError as exc:  # pragma: no cover - depends on the machine
            errors.append(f"{candidate}: {exc}")
    raise NvrtcError(
        f"libnvrtc not found: install the test extra (pip install 'nvidia-cuda-nvrtc=={PINNED_NVRTC}') "
        "or point CUDA_PATH at a CUDA toolkit" + ("; tried " + "; ".join(errors) if errors else "")
    )


@dataclass(frozen=True)
class InstanceReport:
    """ptxas's resource report for one kernel instance on one architecture."""

    arch: str
    instance: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int                # static shared memory
    max_threads: int | None = None   # __launch_bounds__ (PTX .maxntid), when declared
    min_blocks: int | None = None    # its minimum resident blocks per SM (PTX .minnctapersm)

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def _call(lib, name: str, *args) -> None:
    status = getattr(lib, name)(*args)
    if status != 0:
        raise NvrtcError(f"{name} failed: {lib.nvrtcGetErrorString(status).decode()}")


def _program_log(lib, program) -> str:
    size = ctypes.c_size_t()
    _call(lib, "nvrtcGetProgramLogSize", program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    _call(lib, "nvrtcGetProgramLog", program, log)
    return log.value.decode(errors="replace")


@dataclass(frozen=True)
class Program:
    """One source compiled for one arch: its instances' mangled names, ptxas's log, the PTX and the cubin."""

    lowered: dict[str, str]   # mangled name -> instance
    log: str
    ptx: str
    cubin: bytes


def compile_file(nvrtc: Nvrtc, filename: str, source: str, instances, arch: str,
                 include_dirs=(KERNEL_DIR,)) -> tuple[dict[str, str], str]:
    """Compile one source for one arch; returns (mangled name -> instance, program log).

    ``include_dirs`` are searched for ``#include "..."``; the CUDA headers
    (cuda_fp16.h, cuda_bf16.h) come from :func:`cuda_include_dirs`.
    """
    program = compile_program(nvrtc, filename, source, instances, arch, include_dirs)
    return program.lowered, program.log


def compile_program(nvrtc: Nvrtc, filename: str, source: str, instances, arch: str,
                    include_dirs=(KERNEL_DIR,), extra_options=()) -> Program:
    """:func:`compile_file`, keeping the PTX and the cubin too; ``extra_options`` follow :data:`OPTIONS`
    (for example ``-DNAME=1``)."""
    lib = nvrtc.lib
    program = ctypes.c_void_p()
    _call(lib, "nvrtcCreateProgram", ctypes.byref(program), source.encode(), filename.encode(), 0, None, None)
    try:
        for instance in instances:
            _call(lib, "nvrtcAddNameExpression", program, instance.encode())
        includes = tuple(f"-I{d}" for d in (*include_dirs, *cuda_include_dirs()[:1]))
        options = [opt.encode() for opt in OPTIONS + tuple(extra_options) + includes + (f"-arch={arch}",)]
        status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        log = _program_log(lib, program)
        if status != 0:
            raise NvrtcError(f"{filename} ({arch}) failed to compile:\n{log}")
        lowered = {}
        for instance in instances:
            name = ctypes.c_char_p()
            _call(lib, "nvrtcGetLoweredName", program, instance.encode(), ctypes.byref(name))
            lowered[(name.value or b"").decode()] = instance
        size = ctypes.c_size_t()
        _call(lib, "nvrtcGetPTXSize", program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _call(lib, "nvrtcGetPTX", program, ptx)
        _call(lib, "nvrtcGetCUBINSize", program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        _call(lib, "nvrtcGetCUBIN", program, cubin)
        return Program(lowered, log, ptx.value.decode(errors="replace"), cubin.raw)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


_FUNCTION = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Compiling entry function '(\S+)'|Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str, lowered: dict[str, str], arch: str) -> list[InstanceReport]:
    """Turn ptxas -v lines into one report per kernel instance."""
    stack: dict[str, tuple[int, int, int]] = {}
    usage: dict[str, tuple[int, int]] = {}
    current_function = current_entry = None
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            current_function = m.group(1)
        elif (m := _STACK.search(line)) and current_function:
            frame, spill_stores, spill_loads = (int(g) for g in m.groups())
            stack[current_function] = (frame, spill_stores, spill_loads)
        elif m := _USAGE.search(line):
            if m.group(1):
                current_entry = m.group(1)
            elif current_entry:
                usage[current_entry] = (int(m.group(2)), int(m.group(3) or 0))
    reports = []
    for mangled, instance in lowered.items():
        if mangled not in usage or mangled not in stack:
            raise NvrtcError(f"no ptxas report for {instance} ({mangled}) on {arch}:\n{log}")
        registers, smem = usage[mangled]
        frame, spill_stores, spill_loads = stack[mangled]
        reports.append(InstanceReport(arch, instance, registers, frame, spill_stores, spill_loads, smem))
    return reports


_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_MAXNTID = re.compile(r"\.maxntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")
_MINNCTAPERSM = re.compile(r"\.minnctapersm\s+(\d+)")


def parse_launch_bounds(ptx: str, lowered: dict[str, str]) -> dict[str, tuple[int | None, int | None]]:
    """``{instance: (max threads, min blocks per SM)}`` from the PTX directives of each entry.

    NVRTC turns ``__launch_bounds__(max, min)`` into ``.maxntid max, 1, 1`` and ``.minnctapersm min``
    between an entry's parameters and its body; either is None when not declared. Reading them from
    the compiler's output evaluates whatever expression the source wrote (a template's
    ``attention_min_blocks()`` included).
    """
    found = {}
    for m in _ENTRY.finditer(ptx):
        if m.group(1) not in lowered:
            continue
        directives = ptx[m.end():ptx.find("{", m.end())]
        threads, blocks = _MAXNTID.search(directives), _MINNCTAPERSM.search(directives)
        found[lowered[m.group(1)]] = (
            int(threads.group(1)) * int(threads.group(2)) * int(threads.group(3)) if threads else None,
            int(blocks.group(1)) if blocks else None)
    return found


def _serve_chunk() -> None:
    """A worker of :func:`map_in_processes`: reads ``(nvrtc path, function, items)`` pickled from stdin,
    writes ``("ok", results)`` or ``("error", exception)`` pickled to stdout."""
    path, function, items = pickle.load(sys.stdin.buffer)
    reply: tuple[str, object]
    try:
        nvrtc = load_nvrtc(path)
        reply = ("ok", [function(nvrtc, item) for item in items])
    except BaseException as exc:   # handed to the parent, which raises it
        reply = ("error", exc)
    sys.stdout.buffer.write(pickle.dumps(reply))
    sys.stdout.buffer.flush()


def map_in_processes(function, items, nvrtc: Nvrtc) -> list:
    """``function(nvrtc, item)`` for each item, in order, in worker processes, up to one per core, each
    loading the NVRTC at ``nvrtc.path``; ``function`` (a module-level function or a partial of one) and
    the items must pickle. A lone item runs here.

    Processes, not threads: NVRTC compiles that ran at the same time in threads of one process came
    out different from run to run under CPU load (the staged attention_f32<256> step at 8 rows:
    3988 instructions once in ten runs against 3956; never in nine runs that compiled one program at
    a time in a process), likely the drift the documented register and instruction tables met in CI
    (tests/compiler_drift.py). The workers are plain ``python -c`` processes, so that a caller's
    script need not guard its top level as multiprocessing's spawn would require.
    """
    items = list(items)
    workers = max(1, min(len(items), os.cpu_count() or 1))
    if workers == 1:
        return [function(nvrtc, item) for item in items]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-c", "from cupykv.nvrtc_check import _serve_chunk; _serve_chunk()"]
    procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
             for _ in range(workers)]
    try:
        for w, proc in enumerate(procs):   # each worker reads all of its input before it computes
            assert proc.stdin is not None and proc.stdout is not None   # both are pipes
            proc.stdin.write(pickle.dumps((nvrtc.path, function, items[w::workers])))
            proc.stdin.close()
        replies = []
        for proc in procs:
            assert proc.stdout is not None
            out = proc.stdout.read()
            if proc.wait() != 0 or not out:
                raise NvrtcError(f"an NVRTC worker process failed (exit status {proc.returncode})")
            replies.append(pickle.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = [None] * len(items)
    for w, (status, value) in enumerate(replies):
        if status == "error":
            raise value
        results[w::workers] = value
    return results


def _compile_job(nvrtc: Nvrtc, job) -> tuple[str, Program]:
    filename, source, instances, arch, kernel_dir = job
    return arch, compile_program(nvrtc, filename, source, instances, arch, (kernel_dir,))


def check_all(archs=ARCHS, nvrtc: Nvrtc | None = None, kernels=None, kernel_dir: str = KERNEL_DIR
              ) -> list[InstanceReport]:
    """Compile every instance of every kernel file for each arch and collect ptxas's reports.

    ``nvrtc`` defaults to :func:`load_nvrtc`'s choice; ``kernels`` (KernelFile objects) to
    every file of :data:`cupykv.kernels.KERNELS`, read from ``kernel_dir``.
    """
    nvrtc = nvrtc or load_nvrtc()
    jobs = [(kernel.filename, kernel.source(kernel_dir), tuple(kernel.instances), arch, kernel_dir)
            for kernel in (KERNELS.values() if kernels is None else kernels) for arch in archs]
    programs = map_in_processes(_compile_job, jobs, nvrtc)   # one program per core, in the jobs' order
    reports = []
    for arch, program in programs:
        bounds = parse_launch_bounds(program.ptx, program.lowered)
        for r in parse_ptxas_log(program.log, program.lowered, arch):
            max_threads, min_blocks = bounds.get(r.instance, (None, None))
            reports.append(replace(r, max_threads=max_threads, min_blocks=min_blocks))
    return reports


def format_table(reports) -> str:
    width = max(len(r.instance) for r in reports)
    lines = [f"{'arch':6} {'instance':{width}} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9} {'smem':>6}"]
    for r in reports:
        lines.append(f"{r.arch:6} {r.instance:{width}} {r.registers:5d} {r.stack_bytes:6d} "
                     f"{r.spill_store_bytes:9d} {r.spill_load_bytes:9d} {r.shared_bytes:6d}")
    return "\n".join(lines)


def main(nvrtc_path: str | None = None) -> int:
    """Entry point of ``python -m cupykv check [--nvrtc PATH]``; returns the process exit code."""
    try:
        nvrtc = load_nvrtc(nvrtc_path)
        reports = check_all(nvrtc=nvrtc)
    except NvrtcError as exc:
        print(f"cupykv check: FAILED\n{exc}", file=sys.stderr)
        return 1
    return report(reports, nvrtc)


def report(reports, nvrtc: Nvrtc | None = None) -> int:
    """Print the NVRTC used, the tables and the verdict; 1 when any instance spills, declares more
    threads per block than a block may have, or is resident at fewer blocks per SM than its
    ``__launch_bounds__`` minimum."""
    if nvrtc is not None:
        print(f"{nvrtc.describe()}; options {' '.join(OPTIONS)}")
    print(format_table(reports))
    rows = occupancy.rows(reports)
    if rows:
        print("\nOccupancy per SM (registers in units of 256 per warp of 65536, 2048 threads, 32 blocks, shared "
              "memory 164 KB on sm_80 and 228 KB on sm_90 plus 1 KB per block; smem = static + dynamic bytes; "
              "min = the __launch_bounds__ minimum):")
        print(occupancy.format_rows(rows))
    failed = 0
    spilled = [r for r in reports if r.spills]
    if spilled:
        print(f"cupykv check: FAILED, register spills in {len(spilled)} instance(s): "
              + ", ".join(f"{r.instance} ({r.arch})" for r in spilled), file=sys.stderr)
        failed = 1
    # NVRTC and ptxas accept any __launch_bounds__ (1025 and 2048 included) and emit it as .maxntid: only
    # a launch on the GPU would fail
    too_wide = [r for r in reports
                if r.max_threads is not None and r.max_threads > occupancy.LIMITS[r.arch].max_block_threads]
    if too_wide:
        print(f"cupykv check: FAILED, __launch_bounds__ above the threads a block may have in {len(too_wide)} "
              "instance(s): " + ", ".join(f"{r.instance} ({r.arch}): {r.max_threads} threads, at most "
                                         f"{occupancy.LIMITS[r.arch].max_block_threads}" for r in too_wide),
              file=sys.stderr)
        failed = 1
    low = [row for row in rows if row.below_minimum]
    if low:
        print(f"cupykv check: FAILED, occupancy below the design minimum in {len(low)} instance(s): "
              + "; ".join(f"{row.report.instance} ({row.report.arch}): {row.occupancy.blocks} blocks/SM, limited by "
                          f"{row.occupancy.limiter} ({row.report.registers} registers, {row.shared_bytes} bytes of "
                          f"shared memory), but __launch_bounds__ declares {row.report.min_blocks or 1}"
                          for row in low), file=sys.stderr)
        failed = 1
    if failed:
        return 1
    print(f"cupykv check: OK, {len(reports)} instances compiled for {', '.join(ARCHS)}, no spills, "
          f"every block within the threads a block may have, occupancy at or above every declared minimum")
    return 0
