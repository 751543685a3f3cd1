"""Module / Function: CuPy's RawModule / RawKernel interface, run on the CPU.

``Module(code, name_expressions).get_function(name)(grid, block, args, shared_mem)``
checks the launch (geometry, launch bounds, shared memory, argument count and sizes),
packs the arguments the way CUDA does (one pointer per argument value), runs every
block on the emulator runtime (in the order ``CUPYKV_EMULATOR_SEED`` picks, with the race
checker on unless ``CUPYKV_EMULATOR_RACECHECK=0``), then checks canaries, maps faults to
arguments and reports data races.
"""

import ctypes
import re
import signal
import struct
import threading

import numpy as np

from . import accounting, build, compile_options, host, memory, racecheck, schedule, sites, source
from .errors import (AsyncCopyError, BarrierError, DeviceAssertError, EmulatorError, EmulatorFault,
                     FragmentError, LaunchError, LaunchTimeoutError)

MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_DYNAMIC_SMEM = 49152  # without cudaFuncAttributeMaxDynamicSharedMemorySize
MAX_OPT_IN_SMEM = 232448  # with it: sm_90's 227 KiB per block (sm_80: 163 KiB; sm_86 and sm_89: 99 KiB)

STOP_ON_SIGINT = 1        # cuemu_launch_params.options: the runtime takes Ctrl-C during the launch
ERR_INTERRUPTED = 7       # cuemu_launch's status when it did
ERR_TIME_LIMIT = 11       # cuemu_launch's status when the launch ran past its CPU time limit
ERR_LAUNCH_BOUNDS = 12    # cuemu_launch's status when a block is larger than the instance's __launch_bounds__
LAUNCH_TIMEOUT_ENV = "CUPYKV_EMULATOR_LAUNCH_TIMEOUT"
# CPU seconds one launch may take (its kernel and the checkers); the suite's slowest takes about 8
DEFAULT_LAUNCH_TIMEOUT = 600.0
STACK_KIB_ENV = "CUPYKV_EMULATOR_STACK_KIB"
# Each fiber's stack: 64 KiB holds every cupykv kernel; from 16 KiB (the runtime's own calls from a
# thread run on it too) to 64 MiB (1024 fibers of it are 64 GiB of address space, mapped unreserved)
DEFAULT_STACK_KIB, MIN_STACK_KIB, MAX_STACK_KIB = 64, 16, 65536
# The runtime's messages name places it cannot describe itself: a call site (an offset into the
# module, named file:line here), a static shared memory offset, an argument region's byte.
_TOKEN = re.compile(r"@site\(0x([0-9a-f]+)\)|@static\(0x([0-9a-f]+)\)|@arg\((\d+),0x([0-9a-f]+)\)")

_launch_lock = threading.Lock()
_smem_pool = {}  # bytes mapped (the gaps' room included) -> Allocation (reused; poisoned per block)
# CUEMU_SHARED_ARRAY_GAP * CUEMU_SHARED_ARRAYS_MAX (cuemu_abi.h): a gap after each shared array
SHARED_ARRAY_GAP, SHARED_ARRAYS_MAX = 4096, 8
SHARED_ARRAY_ROOM = SHARED_ARRAY_GAP * SHARED_ARRAYS_MAX
_KIND_WORDS = {"p": "pointer", "f": "floating-point", "i": "signed integer",
               "u": "unsigned integer", "b": "bool", "o": "struct/other"}


class Module:
    """Mirror of ``cupy.RawModule(code=..., name_expressions=[...])``.

    Args:
        code: CUDA C++ source, compiled unmodified by g++ through the emulation
            headers.
        name_expressions: kernel names to instantiate, e.g. ``'cupykv_append<float>'``.
            ``extern "C" __global__`` kernels are also found without one.
        include_dirs: directories for ``#include``; their headers are hashed into the
            cache key.
        options: NVRTC options: ``-D``, ``-U``, ``-I``, ``-std`` and ``-restrict`` are honoured,
            those that change what a kernel computes in a way the emulator does not model
            (``-use_fast_math``, ``-ftz=false``, ...) refused, the rest ignored
            (:mod:`.compile_options`).
        filename: the name used in ``__FILE__`` and error messages.

    Raises:
        CompileError: g++ failed (its output is in the message), or an option is refused.
    """

    def __init__(self, code, name_expressions=(), *, include_dirs=(), options=(),
                 filename="kernel.cu"):
        names = list(dict.fromkeys([*name_expressions, *source.extern_c_kernels(code)]))
        self.code = code
        self.name_expressions = names
        taken = compile_options.parse(options)
        self.launch_bounds = source.parse_launch_bounds(code)
        self.restrict_params = source.parse_restrict_params(code)
        self.all_restrict = taken.all_restrict   # -restrict: every pointer parameter is __restrict__
        self._lib, self._entries = build.load_module(code, names, include_dirs, taken, filename)
        self.path = self._lib._name  # the built .so: its line tables name race sites
        self.instrumented = build.instrumented()  # False: the race checker cannot run
        self._tls_probe = ctypes.cast(self._lib.cuemu_module_tls_probe, ctypes.c_void_p).value
        # kernels/shared_layout.cuh defines the marker: its kernels carve their dynamic shared memory
        self.carves_shared = hasattr(self._lib, "cuemu_module_carves_shared")
        self._functions = {}

    def get_function(self, name):
        """The kernel instance ``name`` (one of the name expressions) as a Function."""
        fn = self._functions.get(name)
        if fn is None:
            entry = self._entries.get(name)
            if entry is None:
                compact = {n.replace(" ", ""): n for n in self._entries}
                entry = self._entries.get(compact.get(name.replace(" ", "")))
            if entry is None:
                raise EmulatorError(f"emulator: no kernel {name!r} in this module; its name "
                                    f"expressions are {sorted(self._entries)}")
            base = source.base_name(name)
            fn = self._functions[name] = Function(self, name, entry, self.launch_bounds.get(base),
                                                  self.restrict_params.get(base, ()))
        return fn


def _type_name(pretty):
    s = pretty.decode() if isinstance(pretty, bytes) else pretty
    i = s.find("[with T = ")
    return s[i + 10:].rstrip("]").split(";")[0] if i >= 0 else s


def _points_to_const(type_name):
    """Whether a pointer parameter's type (``'const float*'``) points to const data."""
    pointee = type_name.strip()[:-1].strip() if type_name.strip().endswith("*") else ""
    if pointee.endswith("*"):
        return False
    return "const" in pointee.replace("*", " ").split()


def _dims(value, what, limits):
    if isinstance(value, (int, np.integer)):
        value = (int(value),)
    try:
        dims = tuple(int(v) for v in value)
    except TypeError:
        raise LaunchError(f"{what} must be an int or a tuple of up to 3 ints, got {value!r}") \
            from None
    if not 1 <= len(dims) <= 3:
        raise LaunchError(f"{what} must have 1 to 3 dimensions, got {value!r}")
    dims += (1,) * (3 - len(dims))
    for axis, (d, lim) in enumerate(zip(dims, limits)):
        if d < 1:
            raise LaunchError(f"{what} dimension {'xyz'[axis]} is {d}; it must be >= 1 (CuPy "
                              f"would silently clamp 0 to 1 and still run a block)")
        if d > lim:
            raise LaunchError(f"{what} dimension {'xyz'[axis]} is {d}, above CUDA's limit {lim}")
    return dims


class Function:
    """One kernel instance; call as ``fn(grid, block, args, shared_mem=0)``."""

    def __init__(self, module, name, entry, launch_bound, restrict=()):
        self.module = module
        self.name = name
        self._invoke = entry.invoke
        n = entry.nparams
        self.param_sizes = tuple(entry.sizes[i] for i in range(n))
        self.param_kinds = entry.kinds.decode()[:n]
        self.param_types = tuple(_type_name(entry.type_names[i]) for i in range(n))
        # Non-const pointer parameters: the race checker tracks the bytes of their arrays.
        self.param_writable = tuple(k == "p" and not _points_to_const(t)
                                    for k, t in zip(self.param_kinds, self.param_types))
        # Parameters declared __restrict__ (source.parse_restrict_params; all False when the
        # source's parameter list was not found or does not match the instance's), or every pointer
        # parameter when the module was compiled with -restrict.
        if module.all_restrict:
            self.param_restrict = tuple(k == "p" for k in self.param_kinds)
        else:
            self.param_restrict = tuple(restrict) if len(restrict) == n else (False,) * n
        self.launch_bound = launch_bound  # (expression, int or None) or None
        self.max_threads = launch_bound[1] if launch_bound else None
        self.max_dynamic_smem = MAX_DYNAMIC_SMEM   # raised by opt_in_shared_memory
        offsets, off = [], 0
        for size in self.param_sizes:
            offsets.append(off)
            off += -(-max(size, 1) // 16) * 16
        self._offsets = tuple(offsets)
        self._argbuf = ctypes.create_string_buffer(max(off, 16) + 16)
        base = -(-ctypes.addressof(self._argbuf) // 16) * 16
        self._argbase = base
        self._argv = (ctypes.c_void_p * max(n, 1))(*[base + o for o in offsets])
        self._view = (ctypes.c_char * off).from_address(base) if off else None
        self._params = build._LaunchParams()
        self._params.invoke = self._invoke
        self._params.args = ctypes.addressof(self._argv)
        self._params.tls_probe = module._tls_probe
        self._params.text_lo, self._params.text_hi = sites.text_section(module.path)
        self._result = build._Result()

    def __repr__(self):
        return f"<emulator Function {self.name!r}({', '.join(self.param_types)})>"

    def opt_in_shared_memory(self, nbytes):
        """cudaFuncSetAttribute(MaxDynamicSharedMemorySize, nbytes): later launches may ask for up to
        ``nbytes`` of dynamic shared memory (the limit only grows). LaunchError past sm_90's limit."""
        nbytes = int(nbytes)
        if not 0 <= nbytes <= MAX_OPT_IN_SMEM:
            raise self._err(f"an opt-in to {nbytes} bytes of dynamic shared memory; CUDA allows at most "
                            f"{MAX_OPT_IN_SMEM} (sm_90)")
        self.max_dynamic_smem = max(self.max_dynamic_smem, nbytes)

    # ---- checks and packing ----------------------------------------------------------
    def _err(self, msg):
        return LaunchError(f"kernel {self.name!r}: {msg}")

    def _check_geometry(self, grid, block, shared_mem):
        grid = _dims(grid, "grid", MAX_GRID)
        block = _dims(block, "block", MAX_BLOCK)
        threads = block[0] * block[1] * block[2]
        if threads > MAX_THREADS:
            raise self._err(f"block {block} has {threads} threads, above CUDA's limit of "
                            f"{MAX_THREADS}")
        if self.max_threads is not None and threads > self.max_threads:
            raise self._err(f"block {block} has {threads} threads, above the kernel's "
                            f"__launch_bounds__({self.launch_bound[0]}) = {self.max_threads}")
        shared_mem = int(shared_mem)
        if shared_mem < 0:
            raise self._err(f"shared_mem is negative ({shared_mem})")
        if shared_mem > self.max_dynamic_smem:
            limit = (f"the limit without opting in is {MAX_DYNAMIC_SMEM} bytes (48 KiB)"
                     if self.max_dynamic_smem == MAX_DYNAMIC_SMEM
                     else f"the kernel opted in to {self.max_dynamic_smem} bytes")
            raise self._err(f"{shared_mem} bytes of dynamic shared memory requested; {limit}")
        return grid, block, shared_mem

    def _arg_error(self, i, got, hint=""):
        return self._err(f"argument {i} is {got}, but parameter {i} is "
                         f"'{self.param_types[i]}' ({self.param_sizes[i]} bytes, "
                         f"{_KIND_WORDS[self.param_kinds[i]]})" + (f"; {hint}" if hint else ""))

    def _pack(self, args):
        """Writes the argument values; returns [(index, array)] of the array arguments."""
        n = len(self.param_sizes)
        if not isinstance(args, (tuple, list)):
            raise self._err(f"args must be a tuple or list, got {type(args).__name__}")
        if len(args) != n:
            raise self._err(f"takes {n} argument{'s' * (n != 1)} "
                            f"({', '.join(self.param_types) or 'none'}) but {len(args)} "
                            f"{'was' if len(args) == 1 else 'were'} passed")
        view, arrays = self._view, []
        for i, a in enumerate(args):
            size, kind, off = self.param_sizes[i], self.param_kinds[i], self._offsets[i]
            if isinstance(a, np.ndarray):
                if kind != "p":
                    raise self._arg_error(i, f"a {a.dtype} array (passed as a pointer)")
                arrays.append((i, a))
                continue
            if a is None:
                if kind != "p":
                    raise self._arg_error(i, "None (a null pointer)")
                struct.pack_into("<Q", view, off, 0)
                continue
            if isinstance(a, (bool, np.bool_)):
                data, desc = bytes([bool(a)]), "a bool (1 byte)"
                if kind not in "bui" or size != 1:
                    raise self._arg_error(i, desc)
            elif isinstance(a, int):
                if not -2**63 <= a < 2**64:
                    raise self._err(f"argument {i} ({a}) does not fit in 64 bits")
                data = (a & (2**64 - 1)).to_bytes(8, "little")
                desc = "a Python int, which CuPy packs as an 8-byte long long"
                if kind in "fbo":
                    raise self._arg_error(i, desc)
                if size != 8:
                    np_type = f"numpy.{'u' * (kind == 'u')}int{8 * size}"
                    raise self._arg_error(i, desc, f"pass {np_type}(...)")
            elif isinstance(a, float):
                data, desc = struct.pack("<d", a), "a Python float, packed as an 8-byte double"
                if kind != "f":
                    raise self._arg_error(i, desc)
                if size != 8:
                    raise self._arg_error(i, desc, "pass numpy.float32(...)")
            elif isinstance(a, np.generic):
                data = a.tobytes()
                dk = a.dtype.kind
                if kind == "f" and dk not in "f" or kind in "iu" and dk not in "iub" \
                        or kind == "p" and dk not in "iu" or kind == "b" and dk != "b" \
                        or len(data) != size:
                    raise self._arg_error(i, f"a numpy {a.dtype} scalar ({len(data)} bytes)")
            else:
                raise self._arg_error(i, f"a {type(a).__name__}, which cannot be passed to a "
                                      f"kernel")
            view[off:off + len(data)] = data
        return arrays

    # ---- launch ----------------------------------------------------------------------
    def __call__(self, grid, block, args, shared_mem=0):
        """Runs the kernel on ``grid`` x ``block`` threads (ints or tuples of up to 3
        ints) with ``args`` packed as CuPy packs them, and ``shared_mem`` bytes of
        dynamic shared memory.

        Raises:
            LaunchError: bad geometry, shared memory size or arguments (nothing ran).
            ValueError: ``CUPYKV_EMULATOR_POISON`` is not a byte value,
                ``CUPYKV_EMULATOR_LAUNCH_TIMEOUT`` not a number of seconds > 0, or
                ``CUPYKV_EMULATOR_STACK_KIB`` not a whole number from 16 to 65536 (nothing ran).
            EmulatorFault: out-of-bounds access or stack overflow.
            BarrierError: divergent barrier, bad warp-intrinsic mask, deadlock.
            DeviceAssertError: failed device assert or trap.
            RaceError: two threads touched the same bytes without ordering (see racecheck).
            UninitializedReadError: a thread read shared memory that no thread of its block
                had written (checked with the race checker).
            LaunchTimeoutError: the launch used more CPU time than :func:`launch_timeout`
                (a loop that never ends). Outputs are incomplete.
            KeyboardInterrupt: Ctrl-C stopped the launch (on the main thread, with Python's
                default SIGINT handler; a hung kernel included). Outputs are incomplete.
        Every error message ends with the schedule seed when ``CUPYKV_EMULATOR_SEED`` is set.
        """
        grid, block, shared_mem = self._check_geometry(grid, block, shared_mem)
        seed, poison, time_limit = schedule.session_seed(), memory.poison_byte(), launch_timeout()
        stack_kib = fiber_stack_kib()
        with _launch_lock:  # one launch at a time: the runtime and the buffers are shared
            self._launch(grid, block, args, shared_mem, seed, poison, time_limit, stack_kib)

    def _launch(self, grid, block, args, shared_mem, seed, poison, time_limit, stack_kib):
        array_args = self._pack(args)
        self._check_restrict(array_args)
        bindings, shadows = self._bind_arrays(array_args)
        check_races = racecheck.enabled() and self.module.instrumented
        count_traffic = accounting.active() and self.module.instrumented
        count_banks = count_traffic and accounting.banks_active()
        # The region table goes to every launch: the runtime checks asynchronous copies' sources
        # against it; observers (races, traffic) watch its regions only when they run.
        region_table, regions = racecheck.regions(bindings, self.param_writable)
        if count_traffic:
            accounting.set_phases(region_table, regions)
        hint = schedule.replay_hint(seed)
        # a module that carves its dynamic shared memory into arrays (shared_layout.cuh) gets room
        # for a gap after each, where an index past an array's end fails (access.cpp)
        room = shared_mem + (SHARED_ARRAY_ROOM if self.module.carves_shared else 0)
        smem = _smem_pool.get(room)
        if smem is None:
            if len(_smem_pool) >= 32:
                _smem_pool.pop(next(iter(_smem_pool)))
            smem = _smem_pool[room] = memory.Allocation(room, "dynamic shared memory")
        p, r = self._params, self._result
        p.grid[0], p.grid[1], p.grid[2] = grid
        p.block[0], p.block[1], p.block[2] = block
        p.dyn_smem = smem.start
        p.dyn_smem_size = shared_mem
        p.dyn_smem_room = room
        p.checks = (racecheck.CHECK_RACES if check_races else 0) | \
            (accounting.CHECK_TRAFFIC if count_traffic else 0) | (accounting.CHECK_BANKS if count_banks else 0)
        p.seed = schedule.launch_seed(seed, self.name, grid, block, shared_mem)
        p.poison = poison
        p.regions = ctypes.addressof(region_table)
        p.nregions = len(regions)
        guard_table = _guard_table([alloc for _, _, _, alloc in bindings] + [smem])
        p.guards = ctypes.addressof(guard_table)
        p.nguards = len(guard_table) if guard_table[0].hi else 0
        p.options = STOP_ON_SIGINT if _takes_sigint() else 0
        p.time_limit_s = time_limit
        p.stack_kib = stack_kib
        lib = build.runtime()
        try:
            rc = lib.cuemu_launch(ctypes.byref(p), ctypes.byref(r))
            found = racecheck.hazards(lib) if check_races and not rc else ([], 0, 0)
            if count_traffic and not rc:
                accounting.collect(lib, self, grid, block, shared_mem, regions, bindings, banks=count_banks)
        finally:
            canary_errors = self._check_canaries(bindings, shadows, smem)
            for sh in shadows:
                sh.copy_back()
        if rc == ERR_INTERRUPTED:
            where = f"block ({r.block_idx[0]},{r.block_idx[1]},{r.block_idx[2]})"
            raise KeyboardInterrupt(f"kernel {self.name!r} stopped by Ctrl-C in {where}; its outputs are "
                                    f"incomplete")
        if rc:
            error = self._launch_error(r, bindings, smem, shared_mem, regions)
            raise type(error)(f"{error}{hint}")
        if canary_errors:
            raise EmulatorFault(f"kernel {self.name!r}: " + "; ".join(canary_errors) +
                                " (found in the canary bytes after the launch; the thread "
                                "is unknown)" + hint)
        raw, dropped, _ = found
        if raw or dropped:
            described = racecheck.describe(raw, regions, self.module.path, grid, block)
            raise racecheck.launch_error(self.name, described, dropped, hint)
        for sh in shadows:
            sh.check_read_only(self.name)

    def _check_restrict(self, array_args):
        """Refuses two array arguments whose bytes overlap when one is a ``__restrict__`` parameter
        and one is written (a non-const pointer): the GPU compiler may keep or reorder either
        one's accesses (a const ``__restrict__`` input may be read through the read-only cache)
        as if no other pointer reached those bytes."""
        if not any(self.param_restrict):
            return
        extents = [(i, a, *memory.byte_extent(a)) for i, a in array_args if a.size]
        for k, (i, a, lo, hi) in enumerate(extents):
            for j, b, lo2, hi2 in extents[k + 1:]:
                restricted = [p for p in (i, j) if self.param_restrict[p]]
                if not restricted or not (self.param_writable[i] or self.param_writable[j]):
                    continue
                if lo < hi2 and lo2 < hi:
                    how = "__restrict__ (the module's -restrict option)" if self.module.all_restrict \
                        else "declared __restrict__"
                    raise LaunchError(
                        f"kernel {self.name!r}: arguments {i} ({_describe(a)}) and {j} ({_describe(b)}) "
                        f"overlap in {min(hi, hi2) - max(lo, lo2)} bytes, but argument {restricted[0]} "
                        f"is {how} and argument {i if self.param_writable[i] else j} is "
                        f"written: on a GPU either may see stale data (pass arrays that do not overlap)")

    def _bind_arrays(self, array_args):
        """Passes guarded arrays directly and shadows the others in guarded copies
        (overlapping host arrays share one shadow). Returns (bindings, shadows) where
        bindings are (index, array, pointer, allocation)."""
        bindings, host = [], []
        for i, a in array_args:
            alloc = memory.guarded_allocation(a)
            if alloc is None:
                host.append((i, a))
            else:
                ptr = memory.data_ptr(a)
                struct.pack_into("<Q", self._view, self._offsets[i], ptr)
                bindings.append((i, a, ptr, alloc))
        shadows = []
        if host:
            spans = sorted((memory.byte_extent(a), i, a) for i, a in host)
            groups = []
            for (lo, hi), i, a in spans:
                if groups and lo < groups[-1][1]:
                    groups[-1][1] = max(groups[-1][1], hi)
                    groups[-1][2].append((i, a, lo))
                else:
                    groups.append([lo, hi, [(i, a, lo)]])
            for lo, hi, members in groups:
                sh = _Shadow(lo, hi, members)
                shadows.append(sh)
                for i, a, _ in members:
                    ptr = sh.alloc.start + (memory.data_ptr(a) - lo)
                    struct.pack_into("<Q", self._view, self._offsets[i], ptr)
                    bindings.append((i, a, ptr, sh.alloc))
        return bindings, shadows

    def _check_canaries(self, bindings, shadows, smem):
        errors, seen = [], set()
        for i, a, ptr, alloc in bindings:
            if id(alloc) in seen:
                continue
            seen.add(id(alloc))
            bad = alloc.check_canaries()
            if bad:
                alloc.restore_canaries()
                errors.append(f"a write landed {bad} of argument {i} ({_describe(a)})")
        bad = smem.check_canaries()
        if bad:
            smem.restore_canaries()
            errors.append(f"a write landed {bad} of dynamic shared memory ({smem.nbytes} bytes)")
        return errors

    def _launch_error(self, r, bindings, smem, shared_mem, regions):
        where = f"kernel {self.name!r} block ({r.block_idx[0]},{r.block_idx[1]},{r.block_idx[2]})"
        if r.has_thread:
            where += f" thread ({r.thread_idx[0]},{r.thread_idx[1]},{r.thread_idx[2]})"
        msg = _expand_places(r.msg.decode(errors="replace"), self.module.path, regions)
        kind = r.kind
        if kind == ERR_LAUNCH_BOUNDS:   # found by the first thread to start: nothing ran, as _check_geometry's
            return self._err(msg)
        if kind == 1:
            line = ""
            if r.has_fault_site:
                line = " at " + sites.describe_sites(self.module.path, {r.fault_site})[r.fault_site]
            return EmulatorFault(f"{where}: " + _describe_fault(r, bindings, smem, shared_mem) + line)
        if kind in (5, 10):  # a fiber's stack overflowed; an access a GPU faults on (misaligned,
            #                   or outside a static __shared__ variable)
            return EmulatorFault(f"{where}: {msg}")
        if kind == 2:
            return BarrierError(f"{where}: {msg}")
        if kind in (3, 4):
            return DeviceAssertError(f"{where}: {msg}")
        if kind == 8:
            return AsyncCopyError(f"{where}: {msg}")
        if kind == 9:
            return FragmentError(f"{where}: {msg}")
        if kind == ERR_TIME_LIMIT:
            return LaunchTimeoutError(
                f"{where}: {msg}; its outputs are incomplete. A loop that never ends? Blocks run here one "
                f"at a time, so a thread that waits for another block's write waits forever")
        return EmulatorError(f"{where}: {msg or 'launch failed'}")


def _guard_table(allocations):
    """The runtime's table of guard spans (memory.Allocation.padding_spans) of ``allocations``:
    an instrumented access there fails as a fault at that address, which _describe_fault words."""
    unique = {id(alloc): alloc for alloc in allocations}.values()
    spans = sorted({span for alloc in unique for span in alloc.padding_spans()})
    table = (build._Region * max(len(spans), 1))()
    for k, (lo, hi) in enumerate(spans):
        table[k].lo, table[k].hi = lo, hi
    return table


def _expand_places(msg, module_path, regions):
    """``msg`` with the runtime's place tokens spelled out: ``@site(0x..)`` as ``file:line``,
    ``@static(0x..)`` as the static ``__shared__`` variable, ``@arg(i,0x..)`` as the argument
    and element (regions are the launch's argument regions; empty when nothing was checked)."""
    if "@" not in msg:
        return msg
    found = list(_TOKEN.finditer(msg))
    names = sites.describe_sites(module_path, {int(m.group(1), 16) for m in found if m.group(1)})

    def spell(m):
        if m.group(1):
            return names[int(m.group(1), 16)]
        if m.group(2):
            offset = int(m.group(2), 16)
            variable = sites.static_shared_variable(module_path, offset)
            if variable:
                return f"static __shared__ {variable[0]} byte offset {variable[1]}"
            return f"static shared memory byte offset {offset}"
        index, offset = int(m.group(3)), int(m.group(4), 16)
        if index < len(regions):
            what, byte = racecheck.describe_global(regions[index], offset)
            return f"{what} (byte offset {byte})"
        return f"an array argument (byte offset {offset} of its region)"
    return _TOKEN.sub(spell, msg)


class _Shadow:
    """A guarded copy of a host memory range for one launch."""

    def __init__(self, lo, hi, members):
        self.lo, self.hi, self.members = lo, hi, members
        self.alloc = memory.Allocation(hi - lo, "shadow of a host array")
        if hi > lo:
            ctypes.memmove(self.alloc.start, lo, hi - lo)
        self.writeable = all(a.flags.writeable for _, a, _ in members)
        self.original = None if self.writeable else ctypes.string_at(lo, hi - lo)

    def copy_back(self):
        if self.writeable and self.hi > self.lo:
            ctypes.memmove(self.lo, self.alloc.start, self.hi - self.lo)

    def check_read_only(self, name):
        if not self.writeable and ctypes.string_at(self.alloc.start, self.hi - self.lo) \
                != self.original:
            idx = ", ".join(str(i) for i, _, _ in self.members)
            raise EmulatorFault(f"kernel {name!r} wrote to argument {idx}, a read-only "
                                f"numpy array (the changes were discarded)")


def _describe(a):
    return (f"{a.dtype} array of shape {a.shape}: {a.size} elements, "
            f"{a.size * a.itemsize} bytes")


def _describe_protected(access, i, a, off, lo, hi):
    element = off // a.itemsize
    index = f" {tuple(int(v) for v in np.unravel_index(element, a.shape))}" \
        if a.flags.c_contiguous and a.ndim > 1 else ""
    return (f"{access} of protected bytes of argument {i} at element {element}{index} (byte offset "
            f"{off}; bytes [{lo}, {hi}) are protected by emulator.protected(); {_describe(a)})")


def _describe_fault(r, bindings, smem, shared_mem):
    addr = r.addr
    access = {1: "write", 0: "read"}.get(r.is_write, "access")
    for i, a, ptr, alloc in bindings:
        if alloc.map_addr <= addr < alloc.map_addr + alloc.map_len:
            nbytes = a.size * a.itemsize
            if addr >= ptr + nbytes:
                off, past = addr - ptr, addr - ptr - nbytes
                where = "the first byte past the end" if not past else \
                    f"{past} bytes past the end"
                return (f"out-of-bounds {access} of argument {i} at element "
                        f"{off // a.itemsize} (byte offset {off}, {where}; {_describe(a)})")
            if addr < ptr:
                return (f"out-of-bounds {access} {ptr - addr} bytes before the start of "
                        f"argument {i} ({_describe(a)})")
            guarded = memory.protected_range(alloc, addr)
            if guarded is not None:
                return _describe_protected(access, i, a, addr - ptr, guarded[0] - ptr, guarded[1] - ptr)
            return f"invalid {access} inside argument {i} ({_describe(a)}) at 0x{addr:x}"
    if smem.map_addr <= addr < smem.map_addr + smem.map_len:
        off = addr - smem.start
        side = "past the end" if off >= shared_mem else "before the start"
        return (f"out-of-bounds dynamic shared memory {access} at byte offset {off} "
                f"({side}; the launch has {shared_mem} bytes of dynamic shared memory)")
    other = memory.find(addr)
    if other is not None:
        off = addr - other.start
        return (f"out-of-bounds {access} at byte offset {off} of a guarded allocation "
                f"({other.what}, {other.nbytes} bytes) that is not an argument")
    if addr < 65536:
        return f"{access} through a null (or nearly null) pointer: address 0x{addr:x}"
    return f"invalid {access} at address 0x{addr:x}, outside every emulator buffer"


def launch_timeout():
    """CPU seconds one launch may use (its kernel, the scheduler and the checkers, on the launching
    thread) before it stops with :class:`LaunchTimeoutError`: ``$CUPYKV_EMULATOR_LAUNCH_TIMEOUT``,
    read at every launch, default 600."""
    return host.seconds_setting(LAUNCH_TIMEOUT_ENV, DEFAULT_LAUNCH_TIMEOUT)


def fiber_stack_kib():
    """KiB of stack each thread of a launch runs on: ``$CUPYKV_EMULATOR_STACK_KIB``, read at every
    launch (a change remaps the stacks at the next one), default 64."""
    return host.kib_setting(STACK_KIB_ENV, DEFAULT_STACK_KIB, MIN_STACK_KIB, MAX_STACK_KIB)


def _takes_sigint():
    """Whether Ctrl-C may stop this launch: Python's default SIGINT handler is installed (so
    Ctrl-C means KeyboardInterrupt) and the launch runs on the main thread, which receives it.
    Otherwise Python's handler keeps SIGINT, and runs when the launch returns."""
    return threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler


def synchronize():
    """No-op: emulated kernels run synchronously."""
