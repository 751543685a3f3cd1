"""Dynamic shared memory carved into named arrays (kernels/shared_layout.cuh), and what the emulator
checks of them.

On a GPU an index run past one array of a block's dynamic shared memory lands in the next, which
no guard sees, and shows at best as a wrong value. In the emulator each array of a SharedLayout
lies a gap past the one before it, and an access outside the arrays of its thread's layout fails
with the array, the thread and the line. The planted kernels are in
emulator_kernels/shared_arrays.cu, each right with its argument at 0; the attention kernels carve
their memory this way too, and the last test plants an overrun in the tensor-core one.
"""
import re
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv.attention_plan import attention_kernel
from cupykv.backends import emulator as E
from cupykv.backends.emulator import launch
from cupykv.kernels import KERNEL_DIR
from source_lines import source_site
from test_traffic import PatchedBackend

SOURCE = Path(__file__).parent / "emulator_kernels" / "shared_arrays.cu"
KERNELS = ["write_past_first", "vector_runs_past_first", "read_before_second", "tile_past_the_launch", "two_phases",
           "stale_pointer", "disagreeing_threads", "misaligned_array", "race_on_array", "raw_before_layout",
           "tile_per_block", "layout_past_the_base", "nine_arrays"]
THREADS = 64
VALUES_AFTER_FLAGS = 'float* values = layout.take<float>(blockDim.x, "values");'
site = lambda needle: re.escape(source_site(SOURCE, needle))  # noqa: E731
# an array's take() is reported at the helper's line, inlined into the kernel's
taken_at = lambda needle: rf"shared_layout.cuh:\d+ \(inlined into {site(needle)}\)"  # noqa: E731


@pytest.fixture(scope="module")
def arrays():
    return E.Module(SOURCE.read_text(), KERNELS, include_dirs=[KERNEL_DIR], filename=str(SOURCE))


def run(module, kernel, argument, shared_mem=2 * 4 * THREADS, threads=THREADS):
    out = E.zeros(threads, np.float32)
    module.get_function(kernel)(1, threads, (out, np.int32(argument)), shared_mem=shared_mem)
    return np.asarray(out)


def test_the_emulators_gap_and_room_follow_its_header():
    header = (Path(E.__file__).parent / "include" / "cuemu_abi.h").read_text()
    gap, most = re.search(r"CUEMU_SHARED_ARRAY_GAP = (\d+), CUEMU_SHARED_ARRAYS_MAX = (\d+)", header).groups()
    assert (launch.SHARED_ARRAY_GAP, launch.SHARED_ARRAYS_MAX) == (int(gap), int(most))
    assert launch.SHARED_ARRAY_GAP % 128 == 0   # every byte keeps its bank


# (kernel, its argument, dynamic shared memory, what the fault says): the same kernel is right with
# its argument at 0 (test_each_planted_kernel_is_right_without_its_bug)
FAULTS = [
    # first[64] of a 64-float array: on a GPU second[0], here the gap after `first`
    ("write_past_first", 1, 2 * 4 * THREADS,
     r"kernel 'write_past_first' block \(0,0,0\) thread \(63,0,0\): out-of-bounds write of 4 bytes at the first byte "
     r"past the end of shared array 'first' \(256 bytes at \[0, 256\) of the dynamic shared memory\) at "
     + site("first[threadIdx.x + reach] = 1.0f;")),
    # a float4 from first[64] of a 66-float array: it starts inside and runs 8 bytes past the end
    ("vector_runs_past_first", 1, 2 * 4 * THREADS,
     r"thread \(0,0,0\): out-of-bounds read of 16 bytes at byte offset 256 of shared array 'first' \(264 bytes at "
     r"\[0, 264\) of the dynamic shared memory\), running 8 bytes past its end at "
     + site("const float4 v = *reinterpret_cast<const float4*>(&first[start]);")),
    # second[-1]: on a GPU the last float of `first`
    ("read_before_second", 1, 2 * 4 * THREADS,
     r"thread \(0,0,0\): out-of-bounds read of 4 bytes at 4 bytes before the start of shared array 'second' "
     r"\(256 bytes at \[256, 512\) of the dynamic shared memory\) at "
     + site("out[threadIdx.x] = second[(int)threadIdx.x - reach];")),
    # an array 4 bytes longer than the launch's shared memory fails when taken, before any access
    ("tile_past_the_launch", 1, 4 * THREADS,
     r"shared array 'tile' \(260 bytes at byte offset 0\) ends past the 256 bytes of dynamic shared memory "
     r"the launch asked for, at " + taken_at("layout.take<float>(blockDim.x + extra")),
    # the second phase's `sums` (over the bytes of both first-phase arrays) has bounds of its own
    ("two_phases", 1, 2 * 4 * THREADS,
     r"thread \(63,0,0\): out-of-bounds write of 4 bytes at the first byte past the end of shared array 'sums' "
     r"\(512 bytes at \[0, 512\) of the dynamic shared memory\) at " + site("sums[n + t + reach] = 1.0f;")),
    # a layout over any base but the extern __shared__ array's start
    ("layout_past_the_base", 1, 4 * THREADS + 16,
     r"shared array 'tile' carved from another address at " + taken_at('layout.take<float>(blockDim.x, "tile")')
     + r": a SharedLayout carves the dynamic shared memory \(extern __shared__\)"),
    # a ninth array
    ("nine_arrays", 1, 9 * 4 * THREADS,
     r"shared array 'slice' taken as array 8 of layout 1 \(8 taken; at most 8\) at "
     + taken_at('last = layout.take<float>(blockDim.x, "slice")')),
    # a thread that has taken no layout may use the bytes the launch asked for, and no more
    ("raw_before_layout", 1, 4 * THREADS,
     r"thread \(63,0,0\): out-of-bounds write of 4 bytes at dynamic shared memory byte offset 256 \(past the end "
     r"of the 256 bytes the launch asked for\) at " + site("raw[threadIdx.x + reach] = 1.0f;")),
    # weights[t] after the merge layout began: the bytes belong to `sums` now
    ("stale_pointer", 0, 2 * 4 * THREADS,
     r"out-of-bounds write of 4 bytes at \d+ bytes past the end of shared array 'sums' \(512 bytes at \[0, 512\) "
     r"of the dynamic shared memory\) at " + site("weights[t] = 3.0f;")),
    # warp 0 takes a tile twice as long as the other warps'
    ("disagreeing_threads", 0, 2 * 4 * THREADS,
     r"shared array 0 of layout 1 taken as 'tile' \((256|512) bytes at 0\) at "
     + taken_at("layout.take<float>(threadIdx.x < 32") + r", but another thread of the block took it as 'tile' "
     r"\((512|256) bytes at 0\)"),
    # floats after 3 bytes of flags
    ("misaligned_array", 0, 2 * 4 * THREADS,
     r"shared array 'values' starts at byte offset 3, not a multiple of its element's alignment \(4 bytes\), at "
     + taken_at(VALUES_AFTER_FLAGS)),
]


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("kernel, argument, shared_mem, message", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_misused_shared_array_fails_naming_it_and_the_line(arrays, monkeypatch, racecheck, kernel, argument,
                                                             shared_mem, message):
    """Each misuse is an EmulatorFault naming the array (its bytes as on a GPU), the thread and the
    line, with the race checker on or off."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    with pytest.raises(E.EmulatorFault, match=message):
        run(arrays, kernel, argument, shared_mem=shared_mem)


def test_each_planted_kernel_is_right_without_its_bug(arrays):
    """At argument 0 the kernels above run and compute what they should: in particular the second
    layout's `sums` spans the bytes of both first-layout arrays (and, here, the gap between them)."""
    t = np.arange(THREADS)
    assert np.array_equal(run(arrays, "write_past_first", 0), np.full(THREADS, 3.0))
    assert np.array_equal(run(arrays, "vector_runs_past_first", 0), np.full(THREADS, 4.0))
    assert np.array_equal(run(arrays, "read_before_second", 0), np.full(THREADS, 2.0))
    assert np.array_equal(run(arrays, "tile_past_the_launch", 0, shared_mem=4 * THREADS), np.ones(THREADS))
    assert np.array_equal(run(arrays, "two_phases", 0), ((THREADS - t) % THREADS) * 2.0 + 1.0)
    assert np.array_equal(run(arrays, "raw_before_layout", 0, shared_mem=4 * THREADS), np.ones(THREADS))
    assert np.array_equal(run(arrays, "layout_past_the_base", 0, shared_mem=4 * THREADS + 16), np.ones(THREADS))
    assert np.array_equal(run(arrays, "nine_arrays", 0, shared_mem=9 * 4 * THREADS), np.ones(THREADS))


def test_each_block_carves_its_own_layout(arrays):
    """Blocks take tiles of different sizes under one name: each block's layout is its own."""
    out = E.zeros(3 * THREADS, np.float32)
    arrays.get_function("tile_per_block")(3, THREADS, (out, np.int32(0)), shared_mem=3 * 4 * THREADS)
    np.testing.assert_array_equal(out, np.repeat(np.arange(3, dtype=np.float32), THREADS))


def test_the_bank_counters_extent_is_the_bytes_a_gpu_uses(arrays):
    """The arrays lie a gap apart here; the extent the bank counter reports (which a test holds
    each attention kernel's declared shared memory to) is where the last array ends on a GPU."""
    with E.traffic(banks=True) as t:
        run(arrays, "write_past_first", 0)
    (launch,) = t.launches
    assert launch.shared_extent() == launch.shared_mem == 2 * 4 * THREADS


def test_a_race_report_names_the_shared_array(arrays):
    """Two threads write totals[1]: the report names the array and gives the byte's offset as on a
    GPU (after the 256 bytes of `scratch`), not the emulator's, a gap further on."""
    with pytest.raises(E.RaceError, match=r"write-after-write.*dynamic shared memory \(shared array 'totals' byte "
                                          r"offset 4\), byte offset 260 "):
        run(arrays, "race_on_array", 0)


def test_a_planted_overrun_in_the_tensor_core_attention_names_the_array_and_line():
    """Each key warp publishes its rows' max one warp further on: on a GPU the last warp's land in
    warp_sum (whose values the merge then overwrites or reads wrongly); here they fail at once."""
    old = "warp_max[key_warp * kBlockRows + r] = row_max[t][half];"
    new = "warp_max[(key_warp + 1) * kBlockRows + r] = row_max[t][half];"
    instance = attention_kernel("float16", 64, query_rows=1).instance
    backend = PatchedBackend("attention_mma", old, new, only=(instance,))
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=64, max_seq=64, batch=1, dtype="float16")
    cache = cupykv.KVCache(spec, backend=backend)
    rows = np.random.default_rng(0).standard_normal((1, 40, 1, 64)).astype(np.float16)
    cache.append(0, backend.asarray(rows), backend.asarray(rows))
    cache.advance([40])
    q = backend.asarray(rows[:, :1])
    with pytest.raises(E.EmulatorFault, match=(
            r"out-of-bounds write of 4 bytes at (the first byte|\d+ bytes) past the end of shared array 'warp_max' \(\d+ bytes at "
            r"\[\d+, \d+\) of the dynamic shared memory\) at attention_mma.cu:\d+")) as caught:
        cupykv.attention(q, cache, 0)
    line = int(re.search(r"attention_mma.cu:(\d+)", str(caught.value)).group(1))
    assert (Path(KERNEL_DIR) / "attention_mma.cu").read_text().split("\n")[line - 1].strip() == old
