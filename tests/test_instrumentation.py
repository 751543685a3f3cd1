"""The emulator's instrumentation: every load and store of a kernel reaches the race checker
and the traffic counter, the two halves of a read-modify-write included.

Kernel modules are compiled with GCC's ThreadSanitizer pass and linked without its runtime
(cupykv/backends/emulator/access.cpp defines the hooks). Under the address sanitizer used
before, GCC checked one address once per basic block, so the store of ``x[i] += v`` never
reached the checkers: two threads doing it raced unreported, and advance's update of
``lengths`` counted as a load only. The planted kernels are tests/emulator_kernels/instrumentation.cu.
"""

import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv import testing
from cupykv.backends import emulator as E
from cupykv.backends.emulator import build, host
from source_lines import source_site

SOURCE = Path(__file__).parent / "emulator_kernels" / "instrumentation.cu"
NAMES = ["add_one", "add_one_half", "grow", "copy_row", "every_access"]


line_of = functools.partial(source_site, SOURCE)   # 'instrumentation.cu:LINE' of a needle


@pytest.fixture(scope="module")
def kernels():
    return E.Module(SOURCE.read_text(), NAMES, filename=str(SOURCE))


def only_launch(t):
    assert len(t.launches) == 1, t.report()
    return t.launches[0]


# ---- read-modify-writes -------------------------------------------------------------------
def test_a_read_modify_write_race_is_reported(kernels):
    """64 threads of one block do ``out[0] += 1``: each load reads another thread's store and
    each store overwrites another's with a different value, nothing ordering them."""
    with pytest.raises(E.RaceError) as caught:
        kernels.get_function("add_one")(1, 64, (E.zeros(1, np.int32), np.int32(0)))
    message, hazards = str(caught.value), caught.value.hazards
    assert message.startswith("kernel 'add_one': data race in global memory")
    assert "argument 0 (int32 array of shape (1,)) element 0, byte offset 0" in message
    site = line_of("out[0] += 1;")
    assert all(h.first.site == h.second.site == site for h in hazards), message
    assert all(h.first.thread != h.second.thread for h in hazards), message
    kinds = {h.kind for h in hazards}
    assert {"read-after-write", "write-after-write"} <= kinds, message   # the store is seen


def test_the_same_update_with_atomic_add_is_not_a_race_and_counts_as_atomics(kernels):
    out = E.zeros(1, np.int32)
    with E.traffic() as t:
        kernels.get_function("add_one")(2, 64, (out, np.int32(1)))
    assert out[0] == 128
    arg = only_launch(t).of(out)
    atomic = arg.counts("atomic")
    assert (atomic.bytes, atomic.accesses, atomic.requests, atomic.sectors) == (512, 128, 4, 1)
    assert arg.bytes_loaded == arg.bytes_stored == 0   # once each, as an atomic


def test_half_atomics_are_one_atomic_access_each(kernels):
    out, pair = E.zeros(1, np.float16), E.zeros(2, np.float16)
    with E.traffic() as t:
        kernels.get_function("add_one_half")(1, 64, (out, pair))
    assert out.tolist() == [64.0] and pair.tolist() == [64.0, 128.0]
    for array, size in ((out, 2), (pair, 4)):
        arg = only_launch(t).of(array)
        assert (arg.counts("atomic").accesses, arg.counts("atomic").bytes) == (64, 64 * size)
        assert arg.bytes_loaded == arg.bytes_stored == 0


def test_the_store_of_a_length_update_is_counted(kernels):
    lengths = E.asarray(np.array([3, 0, 7, 1, 5], np.int32))
    with E.traffic() as t:
        kernels.get_function("grow")(1, 32, (lengths, np.int32(2), np.int32(5)))
    assert lengths.tolist() == [5, 2, 9, 3, 7]
    arg = only_launch(t).of(lengths)
    for kind in ("load", "store"):
        counts = arg.counts(kind)
        assert (counts.bytes, counts.accesses, counts.requests) == (20, 5, 1), kind
        assert arg.touched(kind).all(), kind


def test_advance_loads_and_stores_each_length():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=16, batch=3)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance([4, 15, 0])
    with testing.traffic(cache) as t:
        cache.advance(2)
    assert np.asarray(cache.lengths).tolist() == [6, 16, 2]
    lengths = only_launch(t).of(cache.lengths)
    assert lengths.bytes_loaded == lengths.bytes_stored == 12
    assert lengths.touched("load").all() and lengths.touched("store").all()


def test_a_copy_is_judged_same_value_after_its_store_completes(kernels):
    """Four blocks write a 16-byte row to out[0]: different rows race, equal rows are benign.
    The store's value is read after the store, not at the load the hooks report after it."""
    fn = kernels.get_function("copy_row")
    rows = np.arange(16, dtype=np.uint32).reshape(4, 4)
    with pytest.raises(E.RaceError) as caught:
        fn(4, 32, (E.asarray(rows), E.zeros((1, 4), np.uint32)))
    hazard = caught.value.hazards[0]
    assert len(caught.value.hazards) == 1 and hazard.kind == "write-after-write", str(caught.value)
    assert hazard.first.block != hazard.second.block
    assert hazard.first.site == hazard.second.site == line_of("out[0] = rows[blockIdx.x];")
    out = E.zeros((1, 4), np.uint32)
    fn(4, 32, (E.asarray(np.tile(rows[2], (4, 1))), out))
    assert out.tolist() == [rows[2].tolist()]


# ---- every kind of access, counted once -----------------------------------------------------
# Per copy of every_access (its parameters inN, outN in this order): the arrays' dtype, the bytes
# of the load and of the store, and their byte offset.
ACCESSES = [(np.uint8, 1, 0), (np.uint16, 2, 0), (np.uint32, 4, 0), (np.uint64, 8, 0),
            (np.uint32, 16, 0),   # a uint4: 4 uint32 per element
            (np.float32, 12, 0),  # a float3: 3 float32 per element
            (np.uint8, 4, 1)]     # unaligned_in, unaligned_out
COPY_BYTES = 40


def every_access_arrays():
    rng = np.random.default_rng(7)
    arrays = []
    for dtype, nbytes, offset in ACCESSES:
        count = 2 * max(1, (nbytes + offset) // np.dtype(dtype).itemsize)
        arrays.append(E.asarray(rng.integers(1, 100, count).astype(dtype)))
        arrays.append(E.zeros(count, dtype))
    arrays += [E.asarray(rng.integers(1, 100, 64).astype(np.uint8)), E.zeros(64, np.uint8)]
    return arrays


def test_every_kind_of_access_is_counted_exactly_once(kernels):
    arrays = every_access_arrays()
    with E.traffic() as t:
        kernels.get_function("every_access")(1, 1, (*arrays, np.int32(COPY_BYTES)))
    launch = only_launch(t)
    copies = [(nbytes, offset, arrays[2 * i], arrays[2 * i + 1])
              for i, (_, nbytes, offset) in enumerate(ACCESSES)]
    copies.append((COPY_BYTES, 0, arrays[-2], arrays[-1]))   # the memcpy of a run-time length
    for nbytes, offset, source, target in copies:
        for array, kind, other in ((source, "load", "store"), (target, "store", "load")):
            arg = launch.of(array)
            counts = arg.counts(kind)
            assert (counts.bytes, counts.accesses, counts.requests) == (nbytes, 1, 1), (arg, kind)
            assert arg.ranges(kind).tolist() == [[offset, offset + nbytes]], (arg, kind)
            assert arg.counts(other).accesses == arg.counts("atomic").accesses == 0, (arg, kind)
        got = np.asarray(target).view(np.uint8)[offset:offset + nbytes]
        assert np.array_equal(got, np.asarray(source).view(np.uint8)[offset:offset + nbytes])


def undefined_symbols(module):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    return set(subprocess.run([nm, "-u", module.path], capture_output=True, text=True, check=True).stdout.split())


def test_the_planted_kernels_call_every_hook_g_plus_plus_emits(kernels):
    """The planted module calls each sized hook, both range hooks and the memcpy wrapper
    (every_access does, on g++ 12): the kernels above cover every kind of access."""
    undefined = undefined_symbols(kernels)
    hooks = {f"__tsan_{kind}{n}" for kind in ("read", "write") for n in (1, 2, 4, 8, 16)}
    hooks |= {"__tsan_read_range", "__tsan_write_range", "__wrap_memcpy"}
    assert hooks <= undefined, sorted(hooks - undefined)
    assert not {s for s in undefined if s.startswith("__asan")}


def test_function_entry_and_exit_hooks_for_gcc_9_and_10(monkeypatch):
    """g++ before 11 cannot leave out __tsan_func_entry/__tsan_func_exit: with the flags it gets,
    this g++ calls them too, and the runtime's no-op hooks keep the checks working."""
    monkeypatch.setattr(host, "gcc_major", lambda cxx: 10)
    assert "tsan-instrument-func-entry-exit=0" not in build.module_flags()
    module = E.Module(SOURCE.read_text(), NAMES, filename=str(SOURCE))
    assert {"__tsan_func_entry", "__tsan_func_exit"} <= undefined_symbols(module)
    with pytest.raises(E.RaceError, match="^kernel 'add_one': data race in global memory"):
        module.get_function("add_one")(1, 64, (E.zeros(1, np.int32), np.int32(0)))
    lengths = E.asarray(np.array([1, 2], np.int32))
    with E.traffic() as t:
        module.get_function("grow")(1, 32, (lengths, np.int32(3), np.int32(2)))
    assert lengths.tolist() == [4, 5] and only_launch(t).of(lengths).bytes_stored == 8


def test_an_unsupported_hook_is_a_compile_error():
    """GCC's __atomic builtins become __tsan_atomic* calls, which the emulator does not define."""
    source = "__global__ void k(int* x) { __atomic_fetch_add(x, 1, __ATOMIC_RELAXED); }\n"
    with pytest.raises(E.CompileError, match=r"builtin\.cu needs the instrumentation hook "
                                             r"__tsan_atomic32_fetch_add, .* use CUDA's atomicAdd"):
        E.Module(source, ["k"], filename="builtin.cu")


def test_same_source_compiles_with_nvrtc():
    from cupykv import nvrtc_check
    nvrtc = nvrtc_check.load_nvrtc()
    nvrtc_check.compile_file(nvrtc, SOURCE.name, SOURCE.read_text(), [], "sm_80")
