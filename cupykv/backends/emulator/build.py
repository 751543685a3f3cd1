"""Compiling kernels for the emulator: g++ into shared libraries, cached on disk.

The runtime (runtime.cpp, access.cpp, racecheck.cpp, traffic.cpp, banks.cpp, schedule.cpp,
async_copy.cpp, fragments.cpp) is one library
loaded once with RTLD_GLOBAL; each module is the kernel source (rewritten) plus a registry, linked
against nothing and resolving the runtime's symbols at load time. Modules are compiled with
GCC's ThreadSanitizer instrumentation (every load and store of memory calls a hook, which the
runtime defines, see access.cpp) and linked in a second g++ run without its runtime library,
memcpy/memmove/memset wrapped, with line tables (-g1 -gdwarf-4) so that race reports can name source
lines. Libraries are cached under
``$CUPYKV_CACHE_DIR/emulator`` (default ``~/.cache/cupykv/emulator``), keyed by the
sha256 of everything that can change the binary; diskcache.py lets concurrent processes
share the cache (one build per library, under a lock; temporaries of killed builds swept).
host.py checks the platform before anything is compiled and runs g++ under a time limit
(``CUPYKV_EMULATOR_COMPILE_TIMEOUT`` seconds, default 600).
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from . import compile_options, diskcache, host, source
from .errors import CompileError

HERE = Path(__file__).resolve().parent
INCLUDE_DIR = HERE / "include"
RUNTIME_SOURCE = HERE / "runtime.cpp"
RUNTIME_SOURCES = (RUNTIME_SOURCE, HERE / "access.cpp", HERE / "racecheck.cpp", HERE / "traffic.cpp",
                   HERE / "banks.cpp", HERE / "schedule.cpp", HERE / "async_copy.cpp", HERE / "fragments.cpp")
CXX = os.environ.get("CUPYKV_EMULATOR_CXX", "g++")
COMMON_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                "-fno-strict-aliasing", "-fno-math-errno", "-ffp-contract=off")
# Every read and write of memory in a kernel calls __tsan_read4(addr), __tsan_write_range(addr,
# size), ... (GCC's ThreadSanitizer pass; the load and the store of a read-modify-write each get
# a call), which access.cpp defines: no runtime library. Only the compile step gets
# -fsanitize=thread, since g++ would link libtsan otherwise; memcpy, memmove and memset stay
# library calls, wrapped at the link (cuemu.h's macros make the constant-size ones such calls
# too; -ftrack-macro-expansion=0 puts g++'s findings in them, COPY_SIZE_ERRORS, on the caller's
# line). g++ 11 and newer can leave out the calls at every function's entry and exit (g++ 9 and
# 10 make them; access.cpp defines them as no-ops).
# -fno-crossjumping: identical tails of two branches stay two copies, so that two call sites of
# the source keep two return addresses (warp-wide mma and ldmatrix tell their sites apart so).
# -fno-optimize-sibling-calls: a call in tail position (an atomicAdd that ends a kernel) returns
# into the kernel, not past it, so that the return address the callee reports is its call site.
INSTRUMENT_FLAGS = ("-fsanitize=thread", "-ftrack-macro-expansion=0")
# An index outside the stated bound of an array (a local array, a static __shared__ array through
# its reference, an array member; any dimension) calls __ubsan_handle_out_of_bounds_abort, which
# the runtime defines (access.cpp): the launch ends, naming the line, the index and the array's type.
# Without it such an index reads or writes the neighbouring variable silently, on the GPU as here.
BOUNDS_FLAGS = ("-fsanitize=bounds", "-fno-sanitize-recover=bounds")
NO_FUNC_ENTRY_EXIT = ("--param", "tsan-instrument-func-entry-exit=0")
# -fno-tree-sra: a vector copy (`float4 v = *p`, then v.x, v.y, ...) stays one 16-byte access, as
# nvcc's LDG.128 / LDS.128 is, instead of four 4-byte loads that g++'s scalar replacement makes. So
# the alignment check sees the vector's size (a float4 read at an odd float faults on the GPU with a
# misaligned address; four aligned 4-byte loads would pass here), and the traffic and bank counters
# see one access per lane.
KEEP_VECTORS_WHOLE = ("-fno-tree-sra",)
# g++'s own findings of a copy or fill that runs past an object (`memcpy(raw, &packed, 17)` into a
# 16-byte `raw`): errors, so that such a module does not build. On the GPU the bytes past the object
# are read or written silently, and -fsanitize=bounds sees indices, not copy sizes; the emulator's
# memcpy sees the addresses but not the objects (local memory is not watched). The overread check
# (a copy reading past its source) needs GCC 11.
COPY_SIZE_ERRORS = ("-Werror=stringop-overflow",)
COPY_OVERREAD_ERRORS = ("-Werror=stringop-overread",)
# Line tables in DWARF 4 (-g1 -gdwarf-4), which sites.py reads with addr2line. Under g++ 11's default,
# DWARF 5, a module whose first line entry names the user's file (the `#line 1 "many.cu"` at the top
# of the build's kernel.cpp) lists it as file 1, and binutils' addr2line (2.40) names file 1
# kernel.cpp: every site of such a module read "kernel.cpp:LINE", the build's temporary file.
LINE_TABLE_FLAGS = ("-g1", "-gdwarf-4")
BASE_MODULE_FLAGS = tuple(f for f in COMMON_FLAGS if f != "-shared") + (
    "-fstack-clash-protection", "-fno-crossjumping", "-fno-optimize-sibling-calls", "-Wno-attributes",
    "-include", "cuemu.h") + LINE_TABLE_FLAGS + BOUNDS_FLAGS + KEEP_VECTORS_WHOLE + COPY_SIZE_ERRORS
# timer_create (the launch's CPU-time limit) lives in librt before glibc 2.34, in libc after
RUNTIME_LIBS = ("-lrt",)
MODULE_LINK_FLAGS = ("-shared", "-Wl,--wrap=__assert_fail")
INSTRUMENT_LINK_FLAGS = ("-Wl,--wrap=memcpy", "-Wl,--wrap=memmove", "-Wl,--wrap=memset")
_HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".cuh", ".inc", ".inl", ".cu")

#: Counters for tests and curiosity: g++ runs, disk-cache hits, in-process hits.
stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0}
_lock = threading.Lock()
_modules = {}  # cache key -> (CDLL, path)


def cache_dir():
    root = os.environ.get("CUPYKV_CACHE_DIR", "~/.cache/cupykv")
    return Path(root).expanduser() / "emulator"


def check_platform():
    """Raise PlatformError unless this machine can run the emulator (x86-64 Linux, g++ 9 or newer)."""
    host.check_platform(CXX)


@functools.lru_cache(maxsize=None)
def compiler_version():
    check_platform()
    try:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(f"emulator: cannot run the host compiler {CXX!r}: {e}") from None
    return out.stdout


def _header_files(directory):
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(_HEADER_SUFFIXES):
                yield Path(root) / f


def _digest(parts):
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _dir_parts(directory):
    parts = [str(directory)]
    for f in _header_files(directory):
        parts += [str(f.relative_to(directory)), f.read_bytes()]
    return parts


def _compile(sources, flags, out_path, what, cwd=None, link_flags=None, libs=()):
    """Runs g++ on ``sources`` into ``out_path`` atomically (in ``cwd``, which debug info
    then names ``.``); with ``link_flags``, compiles to an object in ``cwd`` first and links
    that in a second g++ run. ``libs`` (``-l`` options) follow the sources. Call it through
    diskcache.build_once."""
    out_path = Path(out_path).resolve()
    fd, tmp = tempfile.mkstemp(prefix=diskcache.temporary_prefix(out_path), suffix=".tmp.so",
                               dir=out_path.parent)
    os.close(fd)
    if cwd is not None:
        flags = [*flags, f"-fdebug-prefix-map={cwd}=."]
    if link_flags is None:
        steps = [("compile", [CXX, *flags, *map(str, sources), *libs, "-o", tmp])]
    else:
        obj = str(Path(cwd) / "module.o")
        steps = [("compile", [CXX, *flags, "-c", *map(str, sources), "-o", obj]),
                 ("link", [CXX, *link_flags, obj, *libs, "-o", tmp])]
    stats["compiles"] += 1
    try:
        for verb, cmd in steps:
            returncode, output = host.run_compiler(cmd, what, cwd=cwd)
            if returncode != 0:
                raise CompileError(f"emulator: g++ failed to {verb} {what}", output)
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, out_path)


# ---- runtime -------------------------------------------------------------------------
class _LaunchParams(ctypes.Structure):
    _fields_ = [("invoke", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("dyn_smem", ctypes.c_void_p), ("dyn_smem_size", ctypes.c_uint64),
                ("poison", ctypes.c_uint32), ("checks", ctypes.c_uint32),
                ("seed", ctypes.c_uint64), ("regions", ctypes.c_void_p),
                ("nregions", ctypes.c_uint32), ("options", ctypes.c_uint32),
                ("tls_probe", ctypes.c_void_p), ("guards", ctypes.c_void_p),
                ("nguards", ctypes.c_uint32), ("dyn_smem_room", ctypes.c_uint64),
                ("time_limit_s", ctypes.c_double), ("text_lo", ctypes.c_uint64),
                ("text_hi", ctypes.c_uint64), ("stack_kib", ctypes.c_uint32)]


class _Region(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_uint64), ("hi", ctypes.c_uint64), ("writable", ctypes.c_uint32),
                ("sector_phase", ctypes.c_uint32)]


class _Hazard(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("region", ctypes.c_int32), ("offset", ctypes.c_uint64),
                ("block", ctypes.c_uint64 * 2), ("thread", ctypes.c_uint32 * 2),
                ("site", ctypes.c_uint32 * 2), ("atomic", ctypes.c_uint32 * 2),
                ("count", ctypes.c_uint64)]


class _Result(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("has_thread", ctypes.c_int32),
                ("block_idx", ctypes.c_uint32 * 3), ("thread_idx", ctypes.c_uint32 * 3),
                ("addr", ctypes.c_uint64), ("is_write", ctypes.c_int32),
                ("signo", ctypes.c_int32), ("fault_site", ctypes.c_uint32),
                ("has_fault_site", ctypes.c_int32), ("msg", ctypes.c_char * 8192)]


class _Entry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("invoke", ctypes.c_void_p),
                ("nparams", ctypes.c_uint), ("sizes", ctypes.POINTER(ctypes.c_ulonglong)),
                ("kinds", ctypes.c_char_p), ("type_names", ctypes.POINTER(ctypes.c_char_p))]


def _runtime_flags():
    return COMMON_FLAGS + ("-I", str(INCLUDE_DIR))


def runtime_key():
    """The runtime library's cache key: its sources, the headers it shares with modules, its flags and
    the compiler."""
    return _digest([*_runtime_parts(), *_dir_parts(INCLUDE_DIR), *_runtime_flags(), *RUNTIME_LIBS,
                    compiler_version()])


@functools.lru_cache(maxsize=None)
def runtime():
    """The loaded runtime library (built on first use; its key is :func:`loaded_runtime_key`)."""
    flags = _runtime_flags()
    key = runtime_key()
    path = cache_dir() / f"cuemu-runtime-{key[:32]}.so"
    if not diskcache.build_once(path, lambda: _compile(RUNTIME_SOURCES, flags, path, "the emulator runtime",
                                                       libs=RUNTIME_LIBS)):
        stats["disk_hits"] += 1
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.cuemu_launch.argtypes = [ctypes.POINTER(_LaunchParams), ctypes.POINTER(_Result)]
    lib.cuemu_launch.restype = ctypes.c_int
    lib.cuemu_race_hazards.argtypes = [ctypes.POINTER(ctypes.POINTER(_Hazard)),
                                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
    lib.cuemu_race_hazards.restype = ctypes.c_uint32
    lib.cuemu_shadow_ready.restype = ctypes.c_int
    lib.cuemu_race_jump_to_epoch_limit.restype = ctypes.c_uint32
    lib.cuemu_race_last_epoch.restype = ctypes.c_uint32
    lib.cuemu_dynamic_shared_place.argtypes = [ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_uint]
    lib.cuemu_dynamic_shared_place.restype = ctypes.c_ulonglong
    lib.cupykv_runtime_key = key
    return lib


def loaded_runtime_key():
    """The key of the runtime this process loaded (loading it first if need be)."""
    return runtime().cupykv_runtime_key


def check_runtime_current():
    """Refuse to build modules against runtime sources or emulator headers that changed since this
    process loaded its runtime: a module compiled from the new ones would disagree with the loaded
    library on structure layouts and constants (cuemu_abi.h), and fail in ways that point elsewhere.
    Returns the current runtime key."""
    loaded, current = loaded_runtime_key(), runtime_key()
    if current != loaded:
        raise CompileError(f"emulator: the runtime's sources or the headers in {INCLUDE_DIR} changed after "
                           f"this process loaded the runtime (key {loaded[:12]}, now {current[:12]}); a "
                           f"kernel built now would not match the loaded runtime. Restart the Python "
                           f"process to build and load the new runtime")
    return current


@functools.lru_cache(maxsize=None)
def instrumented():
    """Whether modules are built with the race checker's instrumentation: only when the
    runtime could map its shadow (the hooks of an instrumented module read it on every access)."""
    ready = bool(runtime().cuemu_shadow_ready())
    if not ready:
        warnings.warn("cupykv emulator: cannot reserve the race checker's shadow memory (16 TiB of "
                      "address space at 0x100000000000); kernels run without race checking",
                      RuntimeWarning, stacklevel=2)
    return ready


def module_flags():
    """The compile flags of a module (its link flags: :func:`module_link_flags`)."""
    gcc_11 = host.gcc_major(CXX) >= 11
    flags = BASE_MODULE_FLAGS + (COPY_OVERREAD_ERRORS if gcc_11 else ())
    if not instrumented():
        return flags
    return flags + INSTRUMENT_FLAGS + (NO_FUNC_ENTRY_EXIT if gcc_11 else ())


def module_link_flags():
    return MODULE_LINK_FLAGS + (INSTRUMENT_LINK_FLAGS if instrumented() else ())


def _runtime_parts():
    return [part for src in RUNTIME_SOURCES for part in (src.name, src.read_bytes())]


# ---- modules -------------------------------------------------------------------------
# How _mirror_includes copies a header: part of every module's key, since the copies are not hashed.
MIRROR_RECIPE = "mirrored header: #line 1 naming the original, then rewrite_kernel_source"


def _line_directive(path):
    """``#line 1 "path"``: the lines after it are those of ``path`` (quoted for a C string)."""
    quoted = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{quoted}"\n'


def _mirror_includes(include_dirs, work):
    """Include dirs whose headers declare ``__shared__`` variables or give a kernel ``__launch_bounds__``
    are copied, rewritten (:func:`source.rewrite_kernel_source`), under ``work``; returns the -I list to
    use. Every copied header starts with a ``#line`` naming its original, so that ``__FILE__`` (an
    assert's, a trap's) and the line tables name the header the user has, not the build's temporary copy."""
    result = []
    for n, d in enumerate(include_dirs):
        headers = [(f, f.read_text(errors="replace")) for f in _header_files(d)]
        rewrites = [source.needs_rewrite(text) for _, text in headers]   # each header read and judged once
        if not any(rewrites):
            result.append(str(d))
            continue
        mirror = work / f"include{n}"
        for (f, text), rewrite in zip(headers, rewrites):
            dst = mirror / f.relative_to(d)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(_line_directive(f) + (source.rewrite_kernel_source(text) if rewrite else text))
        result.append(str(mirror))
    return result


def module_key(text, host_opts, include_dirs, runtime_digest):
    """A module's cache key: its rewritten source, its -D/-U/-I options, its compile and link flags (which
    say whether it is instrumented), ``runtime_digest``, the runtime's key (its sources, the emulator's headers,
    the compiler; :func:`runtime_key`) and every header it may include."""
    key_parts = [MIRROR_RECIPE, text, *host_opts, *module_flags(), *module_link_flags(), runtime_digest]
    for d in include_dirs:
        key_parts += _dir_parts(d)
    return _digest(key_parts)


def load_module(code, name_expressions, include_dirs=(), options=compile_options.HostOptions(),
                filename="kernel.cu"):
    """Builds (or finds in a cache) and loads a module; returns ``(lib, entries)``
    where ``entries`` maps each name expression to its ``_Entry``. ``options``: what
    :func:`compile_options.parse` took from the module's NVRTC options."""
    check_platform()
    current_runtime = check_runtime_current()  # the module resolves the loaded runtime's symbols
    host_opts = list(options.flags)
    include_dirs = [Path(d).resolve() for d in (*include_dirs, *options.include_folders)]
    text = (_line_directive(filename) + source.rewrite_kernel_source(code)
            + source.registry_source(list(name_expressions)))
    key = module_key(text, host_opts, include_dirs, current_runtime)
    with _lock:
        if key in _modules:
            stats["memory_hits"] += 1
            return _modules[key]
        path = cache_dir() / f"mod-{key[:32]}.so"

        def build():
            work = Path(tempfile.mkdtemp(prefix=diskcache.temporary_prefix(path), suffix=".tmp",
                                         dir=path.parent))
            try:
                src = work / "kernel.cpp"
                src.write_text(text)
                incs = _mirror_includes(include_dirs, work)
                flags = [*module_flags(), "-I", str(INCLUDE_DIR)]
                for d in incs:
                    flags += ["-I", d]
                _compile([src], [*flags, *host_opts], path, filename, cwd=work,
                         link_flags=module_link_flags())
            finally:
                shutil.rmtree(work, ignore_errors=True)

        if not diskcache.build_once(path, build):
            stats["disk_hits"] += 1
        lib = _load(path, filename)
        lib.cuemu_module_entries.argtypes = [ctypes.POINTER(ctypes.c_uint)]
        lib.cuemu_module_entries.restype = ctypes.POINTER(_Entry)
        count = ctypes.c_uint()
        table = lib.cuemu_module_entries(ctypes.byref(count))
        entries = {}
        for i, name in enumerate(name_expressions):
            entries[name] = table[i]
        _modules[key] = (lib, entries)
        return _modules[key]


def _load(path, filename):
    """dlopen a module; a hook the runtime lacks (GCC's ThreadSanitizer pass calls
    __tsan_atomic32_fetch_add for an __atomic builtin, for example) is a CompileError."""
    try:
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError as error:
        hook = re.search(r"undefined symbol: (__tsan_\w+)", str(error))
        if not hook:
            raise
        raise CompileError(f"emulator: {filename} needs the instrumentation hook {hook.group(1)}, which the "
                           f"emulator does not define: kernels cannot use GCC's __atomic builtins or std::atomic, "
                           f"nor construct objects with virtual functions; use CUDA's atomicAdd() and "
                           f"friends (cuemu.h)") from None


def clear_memory_cache():
    """Forgets loaded modules (the disk cache stays); used by tests."""
    with _lock:
        _modules.clear()
