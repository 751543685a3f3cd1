"""Self-tests of the CUDA emulator (cupykv.backends.emulator).

The kernels live in tests/emulator_kernels/: good.cu (correct kernels, each with a
NumPy model here) and bugs.cu (planted bugs, each of which must be reported with a
clear error, after which the emulator must still run a good launch correctly). Both
files also compile with NVRTC when libnvrtc is installed: same source, two targets.
"""

import functools
import gc
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E
from cupykv.backends.emulator import build
from cupykv.kernels import KERNEL_DIR
from source_lines import line_number, source_site

KERNELS = Path(__file__).parent / "emulator_kernels"
GOOD = KERNELS / "good.cu"
BUGS = KERNELS / "bugs.cu"
bug_site = functools.partial(source_site, BUGS)   # "bugs.cu:LINE" of the only line holding a needle
GOOD_NAMES = ["block_sum", "shuffles", "warp_votes", "half_warp", "atomics", "reverse_chunks",
              "reverse_float4", "indices3d", "axpy<float>", "axpy<__half>",
              "axpy<__nv_bfloat16>", "convert", "barrier_preds", "scalars", "maybe_null",
              "math", "hello", "busy", "intrinsics", "fp16_ops<__half>",
              "fp16_ops<__nv_bfloat16>", "match_in_halves", "warp_reductions", "record_block_order",
              "activemask_in_two_arms", "shuffles_per_lane_width"]
BUG_NAMES = ["barrier_in_branch", "early_return", "split_barriers", "read_past_end",
             "write_past_end", "write_before_start", "smem_past_end", "small_blocks",
             "takes_int", "failing_assert", "trap_at", "shuffle_exited_lane", "shuffle_outside_mask",
             "shuffle_split_sites", "shuffle_width_and_mask", "huge_local", "null_deref", "divide_by_zero",
             "illegal_instruction",
             "static_smem_past_end", "static_smem_before_start", "static_smem_unwritten",
             "misaligned_vector_load", "misaligned_float4_components", "misaligned_atomic",
             "dyn_smem_half_written", "uncleared_counter", "dyn_smem_vector_unwritten",
             "read_before_start", "scale_restricted", "copy_past_end", "constant_copies_past_end",
             "max_one_too_far",
             "vector_tail_past_end", "packed_tail_past_end", "static_smem_into_neighbour",
             "local_array_past_end", "row_index_past_row", "local_array_before_start", "local_array_at_a_64_bit_index",
             "barrier_kinds_differ", "shuffle_after_lanes_exited", "shuffle_after_first_and_last_lanes_exited",
             "shuffle_waiting_for_the_last_lane", "shuffle_masks_differ_past_lane_0", "packed_head_before_start",
             "atomic_past_end", "atomic_past_end_last", "smem_written_when_asked", "shuffle_value_sizes_differ",
             "shuffle_sparse_masks_differ", "shuffle_sites_and_masks_differ",
             "barrier_after_odd_threads_return"]


def load_good():
    """good.cu's kernels, built (or taken from the cache) as one module."""
    return E.Module(GOOD.read_text(), GOOD_NAMES, include_dirs=[KERNELS], filename=str(GOOD))


@pytest.fixture(scope="module")
def good():
    return load_good()


@pytest.fixture(scope="module")
def bugs():
    return E.Module(BUGS.read_text(), BUG_NAMES, filename=str(BUGS))


def assert_still_works(good):
    """A good launch after a caught bug gives the right answer."""
    x = E.asarray(np.arange(1000, dtype=np.float32))
    out = E.zeros(3, np.float32)
    good.get_function("block_sum")((3,), (128,), (x, out, np.int32(1000)))
    assert out.sum() == np.arange(1000).sum()


# ---- correct kernels -------------------------------------------------------------------
@pytest.mark.parametrize("n, blocks, threads", [(1, 1, 32), (1000, 3, 128), (4099, 5, 1024),
                                                 (77, 2, 64)])
def test_block_sum(good, n, blocks, threads):
    x = E.asarray(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    out = E.zeros(blocks, np.float32)
    good.get_function("block_sum")(blocks, threads, (x, out, np.int32(n)))
    np.testing.assert_allclose(out.sum(dtype=np.float64), x.sum(dtype=np.float64), atol=1e-3)


def _shuffle_model(offset, width):
    """CUDA's documented results of the four shuffles of v = 100 + lane."""
    lane = np.arange(32)
    v = 100 + lane
    group = lane // width
    idx = v[group * width + offset % width]
    up = np.where(lane % width >= offset, v[(lane - offset) % 32], v)
    down = np.where(lane % width + offset < width, v[(lane + offset) % 32], v)
    j = lane ^ offset
    xor = np.where(j // width > group, v, v[j % 32])
    return np.stack([idx, up, down, xor])


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("offset", [0, 1, 3, 8, 17, 31])
def test_shuffle_widths(good, offset, width):
    out = E.zeros((4, 32), np.int32)
    good.get_function("shuffles")(1, 32, (out, np.int32(offset), np.int32(width)))
    np.testing.assert_array_equal(out, _shuffle_model(offset, width))


WIDTH_MIXES = {
    "halves": [8] * 16 + [32] * 16,          # a lane of width 32 reads across the other half's segments
    "alternate": [1, 32] * 16,
    "drawn": list(np.random.default_rng(5).choice([1, 2, 4, 8, 16, 32], 32)),
}


@pytest.mark.parametrize("widths", WIDTH_MIXES.values(), ids=WIDTH_MIXES.keys())
@pytest.mark.parametrize("offset", [1, 3, 17])
def test_lanes_of_one_shuffle_may_pass_different_widths(good, offset, widths):
    """PTX's shfl.sync takes the width operand per thread: each lane's result is the one the
    single-width model gives that lane at its own width (CUDA requires one mask, not one width)."""
    out = E.zeros((4, 32), np.int32)
    good.get_function("shuffles_per_lane_width")(1, 32, (out, np.int32(offset), E.asarray(np.int32(widths))))
    want = np.stack([_shuffle_model(offset, width)[:, lane] for lane, width in enumerate(widths)], axis=1)
    np.testing.assert_array_equal(out, want)


def test_lanes_shuffling_values_of_different_sizes_at_one_site_fail_naming_both(good, bugs):
    """One template instantiated for int and double: one call site, two intrinsics. The report says
    which lanes pass which size, not only that the warp cannot go on."""
    site = re.escape(bug_site("return __shfl_sync(0xffffffffu, v, 0);"))
    with pytest.raises(E.BarrierError, match=rf"__shfl_sync at .*{site} "
                                             r"\(mask 0xffffffff\) in warp 0: lane \d+ \(thread \d+\) shuffles a "
                                             r"(4|8)-byte value, but lane \d+ \(thread \d+\) a (?!\1)(4|8)-byte one"):
        bugs.get_function("shuffle_value_sizes_differ")(1, 32, (E.zeros(32, np.float64),))
    assert_still_works(good)


@pytest.mark.parametrize("lone", [0, 7, 31, 32])
def test_votes_and_8_byte_shuffles(good, lone):
    """Each vote sees every lane: a lone lane that votes apart (the first, a middle one, the last,
    or none: 32) decides __any_sync and __all_sync and is the one bit of its ballot."""
    d = E.zeros(32, np.float64)
    u = E.zeros((5, 32), np.uint32)
    good.get_function("warp_votes")(1, 32, (d, u, np.int32(lone)))
    lane = np.arange(32)
    np.testing.assert_array_equal(d, np.where(lane < 31, 0.5 * (lane + 1), 0.5 * lane))
    assert (u[0] == sum(1 << i for i in range(0, 32, 3))).all()
    assert (u[1] == (lone < 32)).all() and (u[2] == (lone == 32)).all()
    np.testing.assert_array_equal(u[3], [0xF << (4 * (i // 4)) for i in range(32)])
    assert (u[4] == (1 << lone if lone < 32 else 0)).all()


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0x7FFFFFFE, 0x0000FFFF, 0x80000000, 0x00000001])
def test_warp_reductions_over_the_lanes_of_their_mask(good, mask):
    """__reduce_*_sync over every lane, all but the first and last, a half warp, and one lane
    (the last or the first) alone: signed and unsigned min and max differ on negative values, and
    the sums wrap."""
    values = np.random.default_rng(mask).integers(-2**31, 2**31, 32).astype(np.int32)
    values[[0, 31]] = [-2**31, 2**31 - 1]   # the extremes on the edge lanes
    out_i, out_u = E.zeros((3, 32), np.int32), E.zeros((6, 32), np.uint32)
    good.get_function("warp_reductions")(1, 32, (E.asarray(values), out_i, out_u, np.uint32(mask)))
    lanes = np.array([mask >> lane & 1 for lane in range(32)], bool)
    signed, unsigned = values[lanes], values[lanes].view(np.uint32)
    want_i = [signed.sum(dtype=np.int64).astype(np.int32), signed.min(), signed.max()]
    want_u = [unsigned.sum(dtype=np.uint64).astype(np.uint32), unsigned.min(), unsigned.max(),
              np.bitwise_and.reduce(unsigned), np.bitwise_or.reduce(unsigned), np.bitwise_xor.reduce(unsigned)]
    np.testing.assert_array_equal(out_i, np.where(lanes, np.array(want_i, np.int32)[:, None], 0))
    np.testing.assert_array_equal(out_u, np.where(lanes, np.array(want_u, np.uint32)[:, None], 0))


def test_half_warp_mask(good):
    out = E.zeros(32, np.int32)
    good.get_function("half_warp")(1, 32, (out,))
    lane = np.arange(32)
    np.testing.assert_array_equal(out, np.where(lane < 8, lane + 8, lane))


def test_atomics_from_many_blocks(good):
    ints = E.asarray(np.array([0, -1, 0, 0, -1, 0, 0], np.int32))
    f = E.zeros(1, np.float32)
    u = E.zeros(1, np.uint64)
    good.get_function("atomics")(8, 128, (ints, f, u))
    t = np.arange(1024)
    expect_and = np.bitwise_and.reduce(~(1 << (t % 7)))
    np.testing.assert_array_equal(ints, [1024, 1023, -1023, 0x7FFFFFFF, expect_and, 2048, 7])
    assert f[0] == 512.0 and u[0] == 1024 << 32


def test_dynamic_shared_memory(good):
    x = E.asarray(np.arange(4 * 96, dtype=np.float32))
    y = E.zeros(4 * 96, np.float32)
    good.get_function("reverse_chunks")(4, 96, (x, y), shared_mem=96 * 4)
    np.testing.assert_array_equal(y.reshape(4, 96), x.reshape(4, 96)[:, ::-1])
    x4 = E.asarray(np.arange(3 * 64 * 4, dtype=np.float32))
    y4 = E.zeros(3 * 64 * 4, np.float32)
    good.get_function("reverse_float4")(3, 64, (x4, y4), shared_mem=64 * 16)
    np.testing.assert_array_equal(y4.reshape(3, 64, 4), x4.reshape(3, 64, 4)[:, ::-1])


def test_3d_grid_and_block(good):
    grid, block = (2, 3, 2), (4, 2, 3)
    out = E.zeros((12 * 24, 12), np.int32)
    good.get_function("indices3d")(grid, block, (out,))
    rows = []
    for bz in range(2):
        for by in range(3):
            for bx in range(2):
                for tz in range(3):
                    for ty in range(2):
                        for tx in range(4):
                            rows.append([bx, by, bz, tx, ty, tz, *block, *grid])
    np.testing.assert_array_equal(out, rows)


@pytest.mark.parametrize("name, dtype", [("axpy<float>", np.float32),
                                         ("axpy<__half>", np.float16),
                                         ("axpy<__nv_bfloat16>", ml_dtypes.bfloat16)])
def test_templates_over_storage_types(good, name, dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(300).astype(np.float32).astype(dtype)
    y = rng.standard_normal(300).astype(np.float32).astype(dtype)
    a = np.float32(0.37)
    expect = (a * x.astype(np.float32) + y.astype(np.float32)).astype(dtype)
    yd = E.asarray(y)
    good.get_function(name)(3, 128, (E.asarray(x), yd, a, np.int32(300)))
    np.testing.assert_array_equal(yd.view(np.uint16 if dtype != np.float32 else np.uint32),
                                  expect.view(np.uint16 if dtype != np.float32 else np.uint32))


@pytest.mark.parametrize("name, dtype", [("fp16_ops<__half>", np.float16),
                                         ("fp16_ops<__nv_bfloat16>", ml_dtypes.bfloat16)])
def test_fp16_operators_round_once(good, name, dtype):
    rng = np.random.default_rng(3)
    # bf16 operands in [0.5, 2): NumPy's reference then never rounds twice.
    draw = rng.standard_normal if dtype == np.float16 else lambda n: rng.uniform(0.5, 2, n)
    a, b = (draw(500).astype(np.float32).astype(dtype) for _ in range(2))
    out = E.zeros((4, 500), dtype)
    good.get_function(name)(4, 128, (E.asarray(a), E.asarray(b), out, np.int32(500)))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    expect = np.stack([a64 + b64, a64 - b64, a64 * b64, a64 / b64]).astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint16)[:3], expect.view(np.uint16)[:3])
    ulps = np.abs(out[3].view(np.uint16).astype(int) - expect[3].view(np.uint16).astype(int))
    assert ulps.max() <= (0 if dtype == np.float16 else 1)


def _conversion_inputs():
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    every_half = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    edges = np.array([
        0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, -65520.0, 1e30, 3.4e38,
        2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 3 * 2.0**-26, 2.0**-26, 1e-45,
        1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 255.5, 256.5,
        np.inf, -np.inf, np.nan, -np.nan], dtype=np.float32)
    tie_bits = np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x7F7FFFFF, 0x00008000,
                         0x00018000, 0x7FC00001, 0xFF800001, 0x7F800001], np.uint32)
    return np.concatenate([random_bits.view(np.float32), every_half.astype(np.float32), edges,
                           tie_bits.view(np.float32)])


def test_half_bf16_conversions_bit_exact(good):
    x = _conversion_inputs()
    n = x.size
    h, b = E.zeros(n, np.uint16), E.zeros(n, np.uint16)
    hf, bf = E.zeros(n, np.float32), E.zeros(n, np.float32)
    good.get_function("convert")((n + 255) // 256, 256, (E.asarray(x), h, b, hf, bf,
                                                        np.int32(n)))
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        h_ref = x.astype(np.float16).view(np.uint16)
        b_ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(h[~nan], h_ref[~nan])
    np.testing.assert_array_equal(b[~nan], b_ref[~nan])
    assert (h[nan] == 0x7FFF).all() and (b[nan] == 0x7FFF).all()  # CUDA's canonical NaN
    # 16-bit -> float is exact.
    np.testing.assert_array_equal(hf[~nan].view(np.uint32),
                                  h_ref[~nan].view(np.float16).astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(bf[~nan].view(np.uint32),
                                  b_ref[~nan].view(ml_dtypes.bfloat16).astype(np.float32)
                                  .view(np.uint32))
    assert np.isnan(hf[nan]).all() and np.isnan(bf[nan]).all()


def test_barrier_predicates_and_activemask(good):
    out = E.zeros(6, np.int32)
    good.get_function("barrier_preds")(2, 64, (out,))
    np.testing.assert_array_equal(out, [32, 1, 1, 0xFF, 0, 0])


def test_match_any_matches_only_lanes_of_its_mask(good):
    out = E.zeros(32, np.uint32)
    good.get_function("match_in_halves")(1, 32, (out,))
    sevens, nines = 0x1111, 0xEEEE   # lanes 0, 4, 8, 12 of a half hold 7, the others 9
    want = [(sevens if lane % 4 == 0 else nines) << (16 * (lane >= 16)) for lane in range(32)]
    np.testing.assert_array_equal(out, want)


def test_activemask_in_each_arm_of_a_branch_is_that_arms_lanes(good):
    # Lane 0 of each warp reaches its own __activemask() first; lanes 1..31 then meet at the
    # other, while lane 0 still waits. Neither arm's mask may count the other arm's lanes.
    out = E.zeros(64, np.uint32)
    good.get_function("activemask_in_two_arms")(1, 64, (out,))
    np.testing.assert_array_equal(out, [0x1 if t % 32 == 0 else 0xFFFFFFFE for t in range(64)])


def test_scalar_packing_rules(good):
    out = E.zeros(4, np.float64)
    good.get_function("scalars")(1, 1, (out, -(2**40), 2.5, True, np.float32(0.25)))
    np.testing.assert_array_equal(out, [-(2.0**40), 2.5, 1.0, 0.25])
    flag = E.zeros(1, np.float32)
    good.get_function("maybe_null")(1, 1, (None, flag))
    assert flag[0] == 1.0


def test_math_functions(good):
    x = np.linspace(0.05, 1.95, 100, dtype=np.float32)
    y = E.zeros((100, 8), np.float32)
    good.get_function("math")(1, 128, (E.asarray(x), y, np.int32(100)))
    expect = np.stack([np.exp(x), np.exp(x), np.log(x), 1 / np.sqrt(x), np.tanh(x), np.sin(x),
                       np.cos(x), np.maximum(np.minimum(x, 1.5), np.maximum(0.25, x * 0.5))], 1)
    np.testing.assert_allclose(y, expect, rtol=2e-6)


def test_intrinsics(good):
    x = np.array([0.5, 2.0, -3.0, 7.0], np.float32)
    out = E.zeros(32, np.float32)
    good.get_function("intrinsics")(1, 32, (E.asarray(x), out))
    a, b, c = (float(v) for v in x[:3])
    expect = [np.exp(a), 4.0, np.exp(a), np.log(b), np.log(b), np.tanh(a), np.sqrt(b),
              1 / np.sqrt(b), a, c, 3.0, a * b + c, b / a, 1 / b, -3.0, -2.0, 0.0, 0.0,
              np.exp(a) + 8 + 2 + 5, a + b, -4 + 4 + 5 + a + b, a + b + 7 - 1 + 5 + a + b,
              b + c + 1 + 2 + a + a + b + 1.5, 2 * a + 3, 32, 4 + 31, 0, 0, 0, 0, 0, 0]
    np.testing.assert_allclose(out, np.array(expect, np.float32), rtol=1e-6)


def test_printf(good, capfd):
    good.get_function("hello")(2, 4, (np.int32(42),))
    out = capfd.readouterr().out
    assert "hello from block 0 thread 1 tag 42" in out
    assert "hello from block 1 thread 1 tag 42" in out


def test_host_arrays_are_shadowed(good):
    x = np.arange(1000, dtype=np.float32)
    out = np.zeros(3, np.float32)
    good.get_function("block_sum")(3, 128, (x, out, np.int32(1000)))
    assert out.sum() == x.sum()
    # In place through overlapping host arguments: one shadow serves both.
    z = np.arange(2 * 32, dtype=np.float32)
    good.get_function("reverse_chunks")(2, 32, (z, z), shared_mem=32 * 4)
    np.testing.assert_array_equal(z.reshape(2, 32), np.arange(64).reshape(2, 32)[:, ::-1])



def test_adjacent_host_arrays_get_a_shadow_each_so_a_write_past_the_first_faults():
    """Host arrays that only touch (two halves of one numpy buffer) are shadowed apart, each ending at its
    own guard page: one element past the first half faults, naming it, where one shared shadow would
    have taken the write into the second half and copied it back."""
    src = "__global__ void put(float* a, const float* b, int i) { a[i] = b[0] + 1.f; }\n"
    put = E.Module(src, ["put"], filename="put.cu").get_function("put")
    host = np.arange(16, dtype=np.float32)
    put(1, 1, (host[:8], host[8:], np.int32(7)))
    assert host.tolist() == [*range(7), 9, *range(8, 16)]
    with pytest.raises(E.EmulatorFault, match=r"out-of-bounds write of argument 0 at element 8 \(byte offset 32, "
                                              r"the first byte past the end; float32 array of shape \(8,\).*\) at "
                                              r"put.cu:1"):
        put(1, 1, (host[:8], host[8:], np.int32(8)))
    assert host.tolist() == [*range(7), 9, *range(8, 16)]

def test_device_arrays():
    a = E.zeros((3, 5), ml_dtypes.bfloat16)
    assert E.is_device_array(a) and E.is_device_array(a[1:, 2:])
    assert not E.is_device_array(np.zeros(3))
    assert E.asarray(a) is a
    b = E.asarray(np.arange(6).reshape(2, 3))
    assert E.is_device_array(b) and b.dtype == np.int64 and b.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert E.empty(0).size == 0 and E.is_device_array(E.empty((0, 4)))
    E.synchronize()


def test_device_array_extents():
    """Views are device arrays by the bytes they can reach: a reversed view covers the same bytes as
    its base, a view stretched one element past the buffer (into the padding) is not one, and asarray
    with another dtype copies."""
    a = E.zeros(62, np.float32)   # 248 bytes: 8 bytes of padding up to the 16-byte span
    lo, hi = E.memory.byte_extent(a)
    assert hi - lo == 248 and E.memory.byte_extent(a[::-1]) == (lo, hi)
    assert E.memory.byte_extent(a[::-2]) == (lo + 4, hi)
    assert E.is_device_array(a[::-1]) and E.memory.guarded_allocation(a[::-1]) is E.memory.guarded_allocation(a)
    stretched = np.lib.stride_tricks.as_strided(a, shape=(63,))
    assert not E.is_device_array(stretched)
    half = E.asarray(a, dtype=np.float16)
    assert half.dtype == np.float16 and half is not a and E.is_device_array(half)
    alloc = E.memory.guarded_allocation(a)
    assert E.memory.find(alloc.map_addr + alloc.map_len - 1) is alloc   # its trailing guard page
    assert E.memory.find(alloc.map_addr + alloc.map_len) is not alloc   # the first byte past the mapping



def test_a_buffers_mapping_is_returned_when_its_last_view_goes():
    """A guarded buffer owns one mapping (its guard pages included), kept while any view of it lives and
    unmapped when the last one goes: a decode loop that allocates per step must not grow the process.

    The check looks for the buffer's own entries of ``/proc/self/maps`` (their spans and permissions), not
    for any mapping in its range: once the range is free, the next ``mmap`` of the process (an arena of
    Python's allocator, made while this very file is read) may well be placed over it."""
    def entries(lo, hi):
        with open("/proc/self/maps") as maps:
            fields = [line.split()[:2] for line in maps]
        spans = [(tuple(int(v, 16) for v in span.split("-")), perms) for span, perms in fields]
        return {(start, end, perms) for (start, end), perms in spans if start < hi and lo < end}
    a = E.zeros(5000, np.float32)
    alloc = E.memory.guarded_allocation(a)
    lo, hi = alloc.map_addr, alloc.map_addr + alloc.map_len
    own = entries(lo, hi)
    assert {perms for _, _, perms in own} == {"---p", "rw-p"}   # the guard pages and the buffer
    view = a[10:]
    del a, alloc
    gc.collect()
    assert entries(lo, hi) == own and E.memory.find(lo) is not None   # the view keeps it
    del view
    gc.collect()
    assert not entries(lo, hi) & own and E.memory.find(lo) is None


def test_an_alias_through_dlpack_is_the_same_device_array():
    """An array that reaches guarded memory by its address alone (``np.from_dlpack``, as torch hands a
    buffer back, has a DLPack capsule for a base, not the allocation) is found by address: a device
    array of the same allocation, passed to kernels as it is, not copied into a shadow."""
    a = E.zeros(16, np.float32)
    alias = np.from_dlpack(a)
    assert not isinstance(alias.base, np.ndarray)
    assert E.is_device_array(alias) and E.memory.guarded_allocation(alias) is E.memory.guarded_allocation(a)
    src = "__global__ void bump(float* x, const float* y) { x[threadIdx.x] = y[threadIdx.x] + 1.f; }\n"
    bump = E.Module(src, ["bump"], filename="bump.cu").get_function("bump")
    bump(1, 8, (alias[:8], alias[8:]))   # written through the alias, read through it too
    assert np.asarray(a).tolist() == [1.0] * 8 + [0.0] * 8

def test_a_numpy_scalar_of_another_size_is_refused(good):
    out = E.zeros(4, np.float64)
    with pytest.raises(E.LaunchError, match=r"argument 4 is a numpy float16 scalar \(2 bytes\).*'float' \(4 bytes"):
        good.get_function("scalars")(1, 1, (out, -(2**40), 2.5, True, np.float16(0.25)))
    with pytest.raises(E.LaunchError, match=r"argument 1 is a numpy int32 scalar \(4 bytes\).*'long long int' \(8 bytes"):
        good.get_function("scalars")(1, 1, (out, np.int32(3), 2.5, True, np.float32(0.25)))



def test_a_python_int_reaches_an_8_byte_parameter_bit_for_bit():
    """CuPy packs a Python int as the 8 bytes of a long long (two's complement, so an unsigned parameter
    sees a negative one modulo 2**64): every bit arrives, the lowest and the sign's included; an int
    outside 64 bits is refused by name."""
    src = ("__global__ void store(long long* s, unsigned long long* u, long long a, unsigned long long b) "
           "{ s[0] = a; u[0] = b; }\n")
    store = E.Module(src, ["store"], filename="store.cu").get_function("store")
    s, u = E.zeros(1, np.int64), E.zeros(1, np.uint64)
    for a, b in ((5, 5), (-1, 2**64 - 1), (2**63 - 1, 2**63), (-2**63, 1), (-7, -7)):
        store(1, 1, (s, u, a, b))
        assert (int(s[0]), int(u[0])) == (a, b % 2**64)
    with pytest.raises(E.LaunchError, match=r"argument 2 \(18446744073709551616\) does not fit in 64 bits$"):
        store(1, 1, (s, u, 2**64, 0))
    with pytest.raises(E.LaunchError, match=r"argument 3 \(-9223372036854775809\) does not fit in 64 bits$"):
        store(1, 1, (s, u, 0, -2**63 - 1))

@pytest.mark.parametrize("index, value, got", [
    (4, 0.25, r"a Python float, packed as an 8-byte double.*'float' \(4 bytes.*pass numpy\.float32"),
    (4, np.int32(1), r"a numpy int32 scalar \(4 bytes\).*'float' \(4 bytes"),   # the right size, the wrong kind
    (4, True, r"a bool \(1 byte\).*'float'"),
    (1, True, r"a bool \(1 byte\).*'long long int' \(8 bytes"),
    (3, np.float32(1.0), r"a numpy float32 scalar \(4 bytes\).*'bool' \(1 bytes"),
])
def test_a_scalar_cupy_would_pack_as_other_bytes_is_refused(good, index, value, got):
    """CuPy packs a Python float as a double, a NumPy scalar as its own bytes and a bool as one byte,
    whatever the parameter: each of these would hand the kernel other bits than the value."""
    args = [E.zeros(4, np.float64), np.int64(-3), 2.5, True, np.float32(0.25)]
    args[index] = value
    with pytest.raises(E.LaunchError, match=rf"argument {index} is {got}"):
        good.get_function("scalars")(1, 1, tuple(args))
    good.get_function("scalars")(1, 1, (args[0], np.int64(-3), 2.5, True, np.float32(0.25)))
    assert np.asarray(args[0]).tolist() == [-3.0, 2.5, 1.0, 0.25]


@pytest.fixture
def plain_bugs(monkeypatch):
    """bugs.cu built without instrumentation, as where the race checker's shadow memory cannot be
    mapped: out-of-bounds writes are then found only by the canary bytes around each buffer."""
    monkeypatch.setattr(build, "instrumented", lambda: False)
    module = E.Module(BUGS.read_text(), ["write_past_end", "write_before_start", "takes_int"], filename=str(BUGS))
    assert not module.instrumented
    return module


@pytest.mark.parametrize("kernel, threads, where", [("write_past_end", 62, "4 bytes past the end"),
                                                    ("write_before_start", 8, "4 bytes before the start")])
def test_uninstrumented_writes_outside_a_buffer_are_found_in_its_canaries(plain_bugs, kernel, threads, where):
    y = E.zeros(62, np.float32)   # 248 bytes: 8 bytes of padding after it, the page's slack before it
    with pytest.raises(E.EmulatorFault, match=rf"kernel '{kernel}': a write landed {where} of argument 0 "
                                              r"\(float32 array of shape \(62,\).*\(found in the canary bytes"):
        plain_bugs.get_function(kernel)(1, threads, (y,))
    # the canaries are restored: a launch that stays inside the buffer passes
    plain_bugs.get_function("takes_int")(1, 64, (y, np.int32(62)))
    assert (y == 4.0).all()


# ---- planted bugs ----------------------------------------------------------------------
def test_a_barrier_inside_branch(good, bugs):
    with pytest.raises(E.BarrierError) as e:
        bugs.get_function("barrier_in_branch")(1, 64, (E.zeros(64),))
    msg = str(e.value)
    assert "'barrier_in_branch'" in msg and "block (0,0,0)" in msg
    assert f"bugs.cu:{line_number(BUGS, '__syncthreads();', 0)}" in msg
    assert "threads 0-31" in msg and "threads 32-63" in msg and "exited" in msg
    assert "divergent __syncthreads(): 32 threads wait at a barrier that 32 exited threads never reach" in msg
    assert_still_works(good)


def test_b_early_return_before_barrier(good, bugs):
    with pytest.raises(E.BarrierError, match=r"divergent __syncthreads\(\): 40 threads wait at a barrier that 88 "
                                             r"exited threads never reach.*\n.*threads 0-39 .*waiting at "
                                             r"__syncthreads\(\) .*bugs\.cu:\d+.*\n.*threads 40-127.*exited"):
        bugs.get_function("early_return")(1, 128, (E.zeros(128), np.int32(40)))
    bugs.get_function("early_return")(1, 128, (E.zeros(128), np.int32(128)))  # no divergence
    assert_still_works(good)


def test_a_report_lists_the_first_24_ranges_of_thread_states(good, bugs):
    """64 threads alternate between waiting and exited: 64 ranges, of which the report lists the
    first 24 (threads 0-23, in order) and then an ellipsis."""
    with pytest.raises(E.BarrierError) as e:
        bugs.get_function("barrier_after_odd_threads_return")(1, 64, (E.zeros(64),))
    summary, *states = str(e.value).split("\n")
    assert "32 threads wait at a barrier that 32 exited threads never reach" in summary
    assert summary.endswith("; thread states (linear ids):"), summary
    site = f"bugs.cu:{line_number(BUGS, 'if (threadIdx.x % 2) return;') + 1}"
    want = [f"  thread {t} ({t},0,0): " + ("exited" if t % 2 else "waiting at __syncthreads() ") for t in range(24)]
    assert len(states) == 25 and states[-1].startswith("  ... ["), states   # then the schedule's seed
    for got, expected in zip(states, want):
        assert got.startswith(expected) and (expected.endswith("exited") or got.endswith(site)), (got, expected)
    assert_still_works(good)


def test_barriers_at_different_call_sites(good, bugs):
    with pytest.raises(E.BarrierError, match="different __syncthreads"):
        bugs.get_function("split_barriers")(1, 64, (E.zeros(64),))
    assert_still_works(good)


def test_barriers_of_different_kinds_at_one_call_site_never_meet(good, bugs):
    with pytest.raises(E.BarrierError, match=r"divergent barriers: threads wait at different __syncthreads\(\) "
                                             r"call sites or kinds of barrier") as e:
        bugs.get_function("barrier_kinds_differ")(1, 64, (E.zeros(1, np.int32),))
    site = f"{BUGS}:{line_number(BUGS, '__syncthreads_and(1) : __syncthreads_or(1)')}"
    message = str(e.value)
    assert f"waiting at __syncthreads_and() {site}" in message and f"waiting at __syncthreads_or() {site}" in message
    assert_still_works(good)


def test_c_read_past_end(good, bugs):
    with pytest.raises(E.EmulatorFault) as e:
        bugs.get_function("read_past_end")(1, 64, (E.zeros(64), E.zeros(64)))
    msg = str(e.value)
    assert "thread (63,0,0)" in msg and "read of argument 0 at element 64" in msg
    assert "first byte past the end" in msg and "float32 array of shape (64,)" in msg
    # the faulting instruction's line (a page fault: the signal's pc)
    assert f") at {bug_site('y[threadIdx.x] = x[threadIdx.x + 1];')} " in msg, msg
    assert_still_works(good)


def test_c_read_past_end_of_host_array(good, bugs):
    with pytest.raises(E.EmulatorFault, match="read of argument 0 at element 64"):
        bugs.get_function("read_past_end")(1, 64, (np.zeros(64, np.float32),
                                                   np.zeros(64, np.float32)))
    assert_still_works(good)


def test_d_write_past_end(good, bugs):
    with pytest.raises(E.EmulatorFault, match=r"thread \(63,0,0\): out-of-bounds write of "
                                              r"argument 0 at element 64"):
        bugs.get_function("write_past_end")(1, 64, (E.zeros(64),))
    assert_still_works(good)


def test_d_write_into_padding_is_caught_at_once(good, bugs):
    """248 bytes end 8 bytes before the guard page (16-byte aligned start): the write into that
    padding fails when it happens, naming the thread and the element, as past a page would."""
    y = E.zeros(62)
    line = line_number(BUGS, "__global__ void write_past_end(float* y) { y[threadIdx.x + 1] = 2.f; }")
    with pytest.raises(E.EmulatorFault, match=r"thread \(61,0,0\): out-of-bounds write of argument 0 at "
                                              r"element 62 \(byte offset 248, the first byte past the end.*\) "
                                              rf"at bugs.cu:{line}"):
        bugs.get_function("write_past_end")(1, 62, (y,))
    assert_still_works(good)


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("elements", [62, 63, 64])
def test_c_reads_just_outside_an_argument_fail_whatever_its_size(good, bugs, monkeypatch, racecheck, elements):
    """A read one element past the end, or one before the start, fails for every size: into the
    guard page, or into the padding and slack beside the buffer (which a CPU could read)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    x = E.asarray(np.arange(elements, dtype=np.float32))
    past, before = line_number(BUGS, "y[threadIdx.x] = x[threadIdx.x + 1];"), line_number(BUGS, "x[(int)threadIdx.x - 1]")
    with pytest.raises(E.EmulatorFault, match=rf"thread \({elements - 1},0,0\): out-of-bounds read of argument 0 "
                                              rf"at element {elements} \(byte offset {4 * elements}, the first byte"
                                              rf".*\) at bugs.cu:{past}"):
        bugs.get_function("read_past_end")(1, elements, (x, E.zeros(elements)))
    with pytest.raises(E.EmulatorFault, match=r"thread \(0,0,0\): out-of-bounds read 4 bytes before the start "
                                              rf"of argument 0 .* at bugs.cu:{before}"):
        bugs.get_function("read_before_start")(1, elements, (x, E.zeros(elements)))
    assert_still_works(good)


TAIL_LOADS = [("vector_tail_past_end", "const uint4 packed = reinterpret_cast<const uint4*>(x)[v];"),
              ("packed_tail_past_end", "const PackedEight eight = reinterpret_cast<const PackedEight*>(x)[v];")]


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("elements", [62, 63])
@pytest.mark.parametrize("kernel, needle", TAIL_LOADS, ids=[kernel for kernel, _ in TAIL_LOADS])
def test_x_y_a_load_that_starts_inside_and_ends_in_the_padding_fails(good, bugs, monkeypatch, racecheck, elements,
                                                                     kernel, needle):
    """The last 16 (or 32) bytes loaded from a 62- or 63-float array start inside it and end in the
    padding up to byte 256 (no guard page there): an access is judged by its last byte too, as a
    16-byte load (x) and as a range g++ instruments whole (y, a 32-byte packed struct)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    x = E.asarray(np.arange(elements, dtype=np.float32))
    with pytest.raises(E.EmulatorFault, match=rf"out-of-bounds read of argument 1 at element {elements} \(byte offset "
                                              rf"{4 * elements}, the first byte past the end.*{bug_site(needle)}"):
        bugs.get_function(kernel)(1, 1, (E.zeros(1), x, np.int32(elements)))
    y = E.zeros(1)
    bugs.get_function(kernel)(1, 1, (y, E.asarray(np.arange(64, dtype=np.float32)), np.int32(64)))
    assert y[0] == np.arange(64).sum()
    assert_still_works(good)


def test_a_range_that_starts_before_the_array_and_ends_inside_fails(good, bugs):
    # a 32-byte packed struct (a range g++ instruments whole) from 2 floats before the array
    line = line_number(BUGS, "const PackedEight eight = *reinterpret_cast<const PackedEight*>(x - shift);")
    with pytest.raises(E.EmulatorFault, match=rf"out-of-bounds read 8 bytes before the start of argument 1 .* at "
                                              rf"bugs\.cu:{line}(?!\d)"):
        bugs.get_function("packed_head_before_start")(1, 1, (E.zeros(1), E.asarray(np.arange(8, dtype=np.float32)),
                                                             np.int32(2)))
    y = E.zeros(1)
    bugs.get_function("packed_head_before_start")(1, 1, (y, E.asarray(np.arange(8, dtype=np.float32)), np.int32(0)))
    assert y[0] == 28.0
    assert_still_works(good)


@pytest.mark.parametrize("kernel, needle", [("atomic_past_end", "const int old = atomicAdd(&counter[n], 1);"),
                                            ("atomic_past_end_last", "atomicMax(&counter[n], 1);")])
@pytest.mark.parametrize("n", [4, 62, 64])
def test_an_atomic_past_the_end_fails_as_a_write_at_the_kernels_line(good, bugs, kernel, needle, n):
    # The atomic's own read and write run in the emulator's helper: the report still names the
    # kernel's line, and calls the access a write (a read-modify-write). Past 62 ints the next
    # byte is padding (a guard span the access hook checks); past 4 and 64 it is a guard page.
    with pytest.raises(E.EmulatorFault, match=rf"out-of-bounds write of argument 0 at element {n} \(byte offset "
                                              rf"{4 * n}, the first byte past the end.* at "
                                              rf"bugs\.cu:{line_number(BUGS, needle)}(?!\d)"):
        bugs.get_function(kernel)(1, 1, (E.zeros(n, np.int32), np.int32(n)))
    counter = E.zeros(n, np.int32)
    bugs.get_function(kernel)(1, 1, (counter, np.int32(n - 1)))
    assert counter[n - 1] == 1
    assert_still_works(good)


def test_e_write_before_start(good, bugs):
    with pytest.raises(E.EmulatorFault, match="4 bytes before the start of argument 0"):
        bugs.get_function("write_before_start")(1, 8, (E.zeros(8),))
    assert_still_works(good)


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("shared_mem", [256, 248])
def test_f_dynamic_shared_memory_out_of_bounds(good, bugs, monkeypatch, racecheck, shared_mem):
    """One float past the end of dynamic shared memory (only the last thread writes there): the
    guard page at 256 bytes, the padding before it at 248, with the race checker on or off."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    last = shared_mem // 4 - 1
    line = line_number(BUGS, "s[threadIdx.x + 1] = 1.f;")
    with pytest.raises(E.EmulatorFault, match=rf"thread \({last},0,0\): out-of-bounds dynamic shared "
                                              rf"memory write at byte offset {shared_mem} .*{shared_mem} bytes "
                                              rf"of dynamic shared memory\) at bugs.cu:{line}"):
        bugs.get_function("smem_past_end")(1, last + 1, (E.zeros(64),), shared_mem=shared_mem)
    assert_still_works(good)


STATIC_SHARED_BOUNDS = [
    # (kernel, threads, the bad line, what the error says): one past the end lands in the
    # variable's guard bytes, not in the next variable; so does index -1
    ("static_smem_past_end", 128, "slots[threadIdx.x / 32 + 1] = 1.f",
     r"thread \(96,0,0\): out-of-bounds write of 4 bytes at static __shared__ warp_totals \(in "
     r"static_smem_past_end\) byte offset 16 \(the first byte past the end of the variable's 16 bytes\)"),
    ("static_smem_before_start", 64, "slots[(int)(threadIdx.x / 32) - 1] = 1.f",
     r"thread \(0,0,0\): out-of-bounds write of 4 bytes at static __shared__ counts \(in "
     r"static_smem_before_start\) byte offset -4 \(4 bytes before the start of the variable's 32 bytes\)"),
]


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("kernel, threads, needle, message", STATIC_SHARED_BOUNDS,
                         ids=["m-past-the-end", "n-before-the-start"])
def test_static_shared_memory_out_of_bounds(good, bugs, monkeypatch, racecheck, kernel, threads, needle, message):
    """An access outside a static __shared__ variable fails, naming the variable, its kernel, the
    offset and the line, with the race checker on or off."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    with pytest.raises(E.EmulatorFault, match=message + rf" at {bug_site(needle)}"):
        bugs.get_function(kernel)(1, threads, (E.zeros(threads),))
    assert_still_works(good)


ARRAY_INDEX_BOUNDS = [
    # (kernel, threads, arguments, the bad line, what the error says): an index outside an array's
    # stated bound, whatever memory the element would be in
    ("static_smem_into_neighbour", 32, lambda: (E.zeros(32),), "sums[threadIdx.x + 11] = 1.f",
     r"kernel 'static_smem_into_neighbour' block \(0,0,0\) thread \(5,0,0\): out-of-bounds index 16 into an "
     r"array of type 'float \[8\]'"),
    ("local_array_past_end", 1, lambda: (E.zeros(8), np.int32(4)), "for (int i = 0; i <= n; ++i) acc[i] += y[i];",
     r"thread \(0,0,0\): out-of-bounds index 4 into an array of type 'float \[4\]'"),
    ("row_index_past_row", 64, lambda: (E.zeros(64),), "y[threadIdx.x] = tile[0][threadIdx.x % 16];",
     r"out-of-bounds index (8|9|1[0-5]) into an array of type 'float \[8\]'"),
    ("local_array_before_start", 2, lambda: (E.zeros(2), np.int32(0)), "window[first + (int)threadIdx.x - 1]",
     r"thread \(0,0,0\): out-of-bounds index -1 into an array of type 'float \[4\]'"),
    # indices far outside, which need every bit of the index's type to print
    ("local_array_before_start", 1, lambda: (E.zeros(1), np.int32(-99999)), "window[first + (int)threadIdx.x - 1]",
     r"thread \(0,0,0\): out-of-bounds index -100000 into an array of type 'float \[4\]'"),
    ("local_array_before_start", 1, lambda: (E.zeros(1), np.int32(100001)), "window[first + (int)threadIdx.x - 1]",
     r"thread \(0,0,0\): out-of-bounds index 100000 into an array of type 'float \[4\]'"),
    # 64-bit indices, signed and unsigned, printed whole
    ("local_array_at_a_64_bit_index", 1, lambda: (E.zeros(1), -(2**40) - 3, np.int32(0)),
     "as_unsigned ? window[(unsigned long long)index] : window[index]",
     r"thread \(0,0,0\): out-of-bounds index -1099511627779 into an array of type 'float \[4\]'"),
    ("local_array_at_a_64_bit_index", 1, lambda: (E.zeros(1), -1, np.int32(1)),
     "as_unsigned ? window[(unsigned long long)index] : window[index]",
     r"thread \(0,0,0\): out-of-bounds index 18446744073709551615 into an array of type 'float \[4\]'"),
]


@pytest.mark.parametrize("racecheck", ["1", "0"])
@pytest.mark.parametrize("kernel, threads, arguments, needle, message", ARRAY_INDEX_BOUNDS,
                         ids=["static-shared-into-neighbour", "local-array", "inner-dimension", "negative",
                              "far-negative", "far-positive", "64-bit-signed", "64-bit-unsigned"])
def test_an_index_outside_an_arrays_bound_fails(good, bugs, monkeypatch, racecheck, kernel, threads, arguments,
                                               needle, message):
    """An index outside the bound an array's type states ends the launch, naming the kernel, the
    thread, the index, the array's type and the line: past a static __shared__ array by more than
    its guard bytes (into the next variable), past a local array and before its start (a negative
    signed index), far outside it (32- and 64-bit indices, printed whole), and the inner index of a
    2-d array out of its row while the element is still inside the array. Memory checks cannot see these:
    the bytes belong to something else, or to the same array."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", racecheck)
    with pytest.raises(E.EmulatorFault, match=message + rf" at {bug_site(needle)} \(column \d+\)"):
        bugs.get_function(kernel)(1, threads, arguments())
    assert_still_works(good)


def test_o_static_shared_memory_is_poisoned_per_block(bugs, monkeypatch):
    """Static __shared__ bytes no thread of the block wrote read as poison (NaN here), also
    those an earlier block wrote: no value leaks from block to block (seen with the race
    checker off, which would stop the launch: test_reads_of_unwritten_shared_memory_fail)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    y = E.zeros(16)
    bugs.get_function("static_smem_unwritten")(2, 64, (y,))
    got = E.asnumpy(y).reshape(2, 8)
    for block in range(2):
        written = [2 * block, 2 * block + 1]
        np.testing.assert_array_equal(got[block, written], [block + 1, block + 1])
        others = np.delete(got[block], written)
        assert np.isnan(others).all(), got
        assert (others.view(np.uint32) == 0xFFFFFFFF).all()


def test_w_a_result_that_reads_unwritten_memory_changes_with_the_poison(bugs, monkeypatch):
    """fmaxf drops the NaN that the default poison puts in the one element nobody wrote, so the
    off-by-one gives the right maximum; under CUPYKV_EMULATOR_POISON=0x41 (12.07 in float32)
    empty() arrays hold that value instead and the answer changes."""
    values = np.array([0.25, 0.75, 0.5, 0.125], np.float32)

    def largest():
        x = E.empty(5)                    # room for one more than the kernel should read
        x[:4] = values
        y = E.zeros(1)
        bugs.get_function("max_one_too_far")(1, 1, (y, x, np.int32(4)))
        return float(y[0]), x[4:].copy()

    monkeypatch.delenv(E.memory.POISON_ENV, raising=False)
    got, tail = largest()
    assert np.isnan(tail).all() and got == 0.75          # the blind spot of a NaN poison
    monkeypatch.setenv(E.memory.POISON_ENV, "0x41")
    got, tail = largest()
    assert (tail.view(np.uint32) == 0x41414141).all()
    assert got == tail[0] != 0.75


@pytest.mark.parametrize("text, byte", [("", 0xFF), ("0", 0), ("0x41", 0x41), (" 255 ", 255)])
def test_the_poison_byte_comes_from_the_environment(monkeypatch, text, byte):
    monkeypatch.setenv(E.memory.POISON_ENV, text)
    assert E.memory.poison_byte() == byte
    assert (E.empty(3, np.float16).view(np.uint8) == byte).all()


@pytest.mark.parametrize("text", ["256", "-1", "red"])
def test_a_bad_poison_byte_is_refused_naming_the_variable(bugs, monkeypatch, text):
    monkeypatch.setenv(E.memory.POISON_ENV, text)
    expected = rf"CUPYKV_EMULATOR_POISON='{text}': expected a byte value from 0 to 255"
    with pytest.raises(ValueError, match=expected):
        E.empty(3)
    with pytest.raises(ValueError, match=expected):
        bugs.get_function("dyn_smem_half_written")(1, 64, (E.zeros(64),), shared_mem=256)


@pytest.mark.parametrize("poison", [0x00, 0x41, 0xFF])
def test_shared_memory_before_it_is_written_holds_the_poison(bugs, monkeypatch, poison):
    """Dynamic and static shared memory start each block as the launch's poison (race checker
    off: with it on, these reads fail, test_reads_of_unwritten_shared_memory_fail)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    monkeypatch.setenv(E.memory.POISON_ENV, str(poison))
    y = E.zeros(64)
    bugs.get_function("dyn_smem_half_written")(1, 64, (y,), shared_mem=256)
    got = E.asnumpy(y)
    np.testing.assert_array_equal(got[1::2], np.arange(0, 64, 2))
    assert (got[0::2].view(np.uint32) == poison * 0x01010101).all()
    y = E.zeros(16)
    bugs.get_function("static_smem_unwritten")(2, 64, (y,))
    unwritten = np.delete(E.asnumpy(y).reshape(2, 8), [0, 1], axis=1)[0]
    assert (unwritten.view(np.uint32) == poison * 0x01010101).all()


UNINITIALIZED_READS = [
    # (kernel, grid, threads, shared_mem, arguments, the reading line, the memory, reads)
    ("static_smem_unwritten", 2, 64, 0, lambda: (E.zeros(16),), "y[8 * blockIdx.x + threadIdx.x] = slots[threadIdx.x]",
     r"read of static __shared__ slots \(in static_smem_unwritten\), byte offset \d+", 12),
    ("dyn_smem_half_written", 1, 64, 256, lambda: (E.zeros(64),), "y[threadIdx.x] = slots[threadIdx.x ^ 1u]",
     r"read of dynamic shared memory, byte offset \d+", 32),
    ("uncleared_counter", 1, 32, 0, lambda: (E.zeros(32, np.int32),), "atomicAdd(&count, 1);",
     r"atomic of static __shared__ count \(in uncleared_counter\), byte offset 0", 1),
    ("dyn_smem_vector_unwritten", 1, 32, 512, lambda: (E.zeros(32),), "const uint4 quad = quads[threadIdx.x];",
     r"read of dynamic shared memory, byte offset \d+", 32),   # 16-byte reads: one each, not one per word
]


@pytest.mark.parametrize("kernel, grid, threads, shared_mem, args, needle, memory, reads", UNINITIALIZED_READS,
                         ids=[case[0] for case in UNINITIALIZED_READS])
def test_reads_of_unwritten_shared_memory_fail(good, bugs, kernel, grid, threads, shared_mem, args, needle,
                                               memory, reads):
    """A read or atomic of shared memory that no thread of the block wrote (a GPU returns what an
    earlier block left) is an UninitializedReadError naming the memory, the line and the count,
    whichever thread ran first; bytes an earlier block wrote count as unwritten."""
    with pytest.raises(E.UninitializedReadError) as caught:
        bugs.get_function(kernel)(grid, threads, args(), shared_mem=shared_mem)
    message = str(caught.value)
    assert f"no thread of its block wrote ({reads} read{'s' * (reads != 1)} at 1 call site)" in message, message
    assert re.search(memory + rf", at {bug_site(needle)} by block", message), message
    assert message.endswith("\n  A GPU returns whatever an earlier block or launch left in those bytes: write them "
                            "first (with a __syncthreads() before other threads read them)."), message
    assert sum(read.count for read in caught.value.reads) == reads
    for read in caught.value.reads:   # one access, both sides: a load or an atomic, never a write
        assert read.first == read.second and read.first.kind in ("read", "atomic"), read
    assert_still_works(good)


def test_shared_memory_written_before_the_epochs_restart_still_counts_as_unwritten(bugs):
    """The race checker numbers block starts and barriers (epochs) in 32 bits and restarts the
    count near its limit, clearing the shadows of shared memory. Records of an earlier launch are
    ignored because their epochs are older; after a restart they would look newer, so they must be
    gone: a read of static or dynamic shared memory that no thread of the launch wrote is still
    reported, as it is without a restart."""
    kernel = bugs.get_function("smem_written_when_asked")
    y = E.zeros(128)

    def read_unwritten():
        with pytest.raises(E.UninitializedReadError) as caught:
            kernel(1, 64, (y, np.int32(0)), shared_mem=256)
        assert "no thread of its block wrote (128 reads at 2 call sites)" in str(caught.value), caught.value

    kernel(1, 64, (y, np.int32(1)), shared_mem=256)
    assert (E.asnumpy(y) == np.repeat([1.0, 2.0], 64)).all()
    read_unwritten()                                    # no restart: the records are older than the launch
    runtime = build.runtime()
    limit = runtime.cuemu_race_jump_to_epoch_limit()
    assert limit > 2**31                                # a restart that a 32-bit count needs, not one per launch
    kernel(1, 64, (y, np.int32(1)), shared_mem=256)     # writes every slot, in epochs past the limit
    assert runtime.cuemu_race_last_epoch() > limit
    read_unwritten()                                    # this launch restarts the epochs at 1
    assert runtime.cuemu_race_last_epoch() < 16         # a block start and a barrier or two
    kernel(1, 64, (y, np.int32(1)), shared_mem=256)     # and the checker goes on: a clean launch passes
    read_unwritten()


def test_v_a_fault_inside_memcpy_names_the_kernel_line_that_called_it(good, bugs):
    line = line_number(BUGS, "memcpy(&v, x + n - 1, (size_t)bytes);")
    x = E.asarray(np.arange(64, dtype=np.float32))   # 256 bytes: the guard page follows at once
    with pytest.raises(E.EmulatorFault, match=r"out-of-bounds read of argument 1 at element 64 \(byte offset 256, "
                                              rf"the first byte past the end.*\) at bugs.cu:{line}"):
        bugs.get_function("copy_past_end")(1, 1, (E.zeros(1), x, np.int32(64), np.int32(16)))
    assert_still_works(good)


@pytest.mark.parametrize("which, line_text, access", [
    (0, "memcpy(three, x + 4, sizeof three);", "read of argument 1"),
    (1, "memcpy(y + 4, three, sizeof three);", "write of argument 0"),
    (2, "memset(y, 0, 28);", "write of argument 0"),
])
def test_v2_copies_of_a_constant_size_are_checked_like_any_other(good, bugs, which, line_text, access):
    """g++'s instrumentation never sees a memcpy of a constant size other than 1, 2, 4, 8 or 16
    bytes, nor a memset, which it expands into plain moves: cuemu.h sends those to the checked
    copies, so a byte past the end (in the padding, before any guard page) is caught. (memmove,
    treated alike, is not a CUDA device function: NVRTC refuses it.)"""
    y, x = E.zeros(6), E.asarray(np.arange(6, dtype=np.float32))
    with pytest.raises(E.EmulatorFault, match=rf"out-of-bounds {access} at element 6 \(byte offset 24, the "
                                              rf"first byte past the end.*\) at bugs.cu:{line_number(BUGS, line_text)}"):
        bugs.get_function("constant_copies_past_end")(1, 1, (y, x, np.int32(which)))
    assert_still_works(good)


def test_u_overlapping_arguments_of_a_restrict_parameter_are_refused(good, bugs):
    """An array passed for a __restrict__ parameter that overlaps another array argument, one of
    the two written, is refused before anything runs (on a GPU either may see stale data); two
    overlapping read-only arguments are fine, and so are arrays that only touch."""
    fn = bugs.get_function("scale_restricted")
    assert fn.param_restrict == (True, True, True)
    buffer = E.asarray(np.arange(1, 17, dtype=np.float32))
    with pytest.raises(E.LaunchError, match=r"kernel 'scale_restricted': arguments 0 \(float32 array of shape "
                                            r"\(8,\).*\) and 1 \(.*\) overlap in 28 bytes, but argument 0 is "
                                            r"declared __restrict__ and argument 0 is written"):
        fn(1, 8, (buffer[1:9], buffer[:8], buffer[8:]))
    assert E.asnumpy(buffer).tolist() == list(range(1, 17))   # nothing ran
    out, x = E.zeros(8), E.asarray(np.arange(8, dtype=np.float32))
    fn(1, 8, (out, x, x))                                      # both read-only: no promise broken
    fn(1, 8, (buffer[8:], buffer[:8], buffer[:8]))             # adjacent halves do not overlap
    assert E.asnumpy(buffer)[8:].tolist() == [2.0 * v * v for v in range(1, 9)]
    assert_still_works(good)


def test_restrict_parameters_are_read_from_the_source():
    """Which parameters a __global__ definition declares __restrict__, past comments,
    __launch_bounds__ and template argument lists."""
    from cupykv.backends.emulator import source
    src = ("// __global__ void commented(float* __restrict__ a);\n"
           "template <int N> __global__ void __launch_bounds__(N * 32, 2) k(\n"
           "    float* __restrict__ out,  // written\n    const Pair<int, float>* in, int n,\n"
           "    const float* __restrict__ w) {}\n"
           "extern \"C\" __global__ void plain(float* y) {}\n")
    assert source.parse_restrict_params(src) == {"k": (True, False, False, True), "plain": (False,)}


def test_p_misaligned_vector_load(good, bugs):
    """A 16-byte load one float past a 16-byte boundary runs on the CPU but ends the launch on
    a GPU (cudaErrorMisalignedAddress): the emulator fails it, naming the argument, the element,
    the offset and the line."""
    line = line_number(BUGS, "reinterpret_cast<const uint4*>(x + 1)[threadIdx.x]")
    x = E.asarray(np.arange(64, dtype=np.float32))
    with pytest.raises(E.EmulatorFault) as caught:
        bugs.get_function("misaligned_vector_load")(1, 8, (E.zeros(8), x))
    found = re.search(
        r"thread \((\d),0,0\): misaligned 16-byte read at argument 1 \(float32 array of shape "
        r"\(64,\)\) element (\d+) \(byte offset (\d+)\) \(4 bytes past a multiple of 16; a GPU ends "
        rf"the launch with cudaErrorMisalignedAddress\) at bugs.cu:{line}", str(caught.value))
    assert found, caught.value
    thread, element, offset = (int(g) for g in found.groups())
    assert (element, offset) == (4 * thread + 1, 16 * thread + 4)  # the thread's own load
    assert_still_works(good)


def test_p2_a_misaligned_float4_read_by_components_fails_as_one_16_byte_read(good, bugs):
    """``float4 v = p[i]`` then ``v.x + v.y + ...``: modules keep the copy one 16-byte access
    (build.KEEP_VECTORS_WHOLE), so its alignment is checked as the GPU checks it."""
    line = line_number(BUGS, "reinterpret_cast<const float4*>(x + 1)[threadIdx.x]")
    x = E.asarray(np.arange(64, dtype=np.float32))
    with pytest.raises(E.EmulatorFault, match=rf"misaligned 16-byte read at argument 1 \(float32 array of shape "
                                              rf"\(64,\)\) element \d+ .* at bugs.cu:{line}"):
        bugs.get_function("misaligned_float4_components")(1, 8, (E.zeros(8), x))
    assert_still_works(good)


def test_q_misaligned_atomic(good, bugs):
    """An atomic on an int at an address 2 bytes past a multiple of 4 fails the same way; the
    site is the atomic's line, also when it ends the kernel (no tail call past the kernel)."""
    line = line_number(BUGS, "atomicAdd(reinterpret_cast<int*>(reinterpret_cast<char*>(counts) + 2), 1)")
    with pytest.raises(E.EmulatorFault, match=(
            r"misaligned 4-byte atomic at argument 0 \(int32 array of shape \(4,\)\) element 0 "
            rf"\(byte offset 2\) \(2 bytes past a multiple of 4; .*\) at bugs.cu:{line}\b")):
        bugs.get_function("misaligned_atomic")(1, 4, (E.zeros(4, np.int32),))
    assert_still_works(good)


def test_a_block_of_1024_threads_runs_and_one_of_1025_is_refused():
    source = "__global__ void thread_ids(int* y) { y[threadIdx.z * blockDim.x + threadIdx.x] = threadIdx.x; }"
    fn = E.Module(source, ["thread_ids"], filename="thread_ids.cu").get_function("thread_ids")
    y = E.zeros(1025, np.int32)
    fn(1, 1024, (y,))
    assert np.asarray(y).tolist() == list(range(1024)) + [0]
    fn(1, (512, 1, 2), (y,))   # 1024 threads over two dimensions
    assert np.asarray(y).tolist() == list(range(512)) * 2 + [0]
    with pytest.raises(E.LaunchError, match=r"block dimension x is 1025, above CUDA's limit 1024"):
        fn(1, 1025, (y,))
    with pytest.raises(E.LaunchError, match=r"block \(205, 1, 5\) has 1025 threads, above CUDA's limit of 1024"):
        fn(1, (205, 1, 5), (y,))


def test_g_block_above_launch_bounds(good, bugs):
    fn = bugs.get_function("small_blocks")
    assert fn.max_threads == 64
    with pytest.raises(E.LaunchError, match=r"128 threads, above the kernel's "
                                            r"__launch_bounds__\(64\)"):
        fn(1, 128, (E.zeros(128),))
    fn(1, 64, (E.zeros(64),))
    assert_still_works(good)


TEMPLATE_BOUNDS = """
template <int WARPS> constexpr int threads_of() { return WARPS * 32; }
template <int WARPS>
__global__ void __launch_bounds__(threads_of<WARPS>(),  // one warp per
                                  2)                    // and two blocks an SM
    fill(int* out) {
    out[(threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x] = 7;
}
"""


@pytest.mark.parametrize("instance, largest, above", [
    ("fill<2>", (64, 1, 1), (65, 1, 1)),
    ("fill<3>", (8, 4, 3), (8, 4, 4)),   # every dimension counts: 96 threads, then 128
])
def test_g2_a_bound_that_depends_on_template_arguments_is_checked_per_instance(good, instance, largest, above):
    """A bound written over template parameters has no value in the source alone; the emulator
    checks it per instance as a GPU does (64 threads for fill<2>, 96 for fill<3>): a larger block
    fails, at the launch's first thread, before any thread wrote."""
    module = E.Module(TEMPLATE_BOUNDS, ["fill<2>", "fill<3>"], filename="template_bounds.cu")
    fn = module.get_function(instance)
    assert fn.max_threads is None   # what the source alone gives: nothing to check before the launch
    threads = int(np.prod(largest))
    out = E.zeros(threads, np.int32)
    fn(1, largest, (out,))
    assert E.asnumpy(out).tolist() == [7] * threads
    untouched = E.zeros(2 * threads, np.int32)
    with pytest.raises(E.LaunchError) as caught:
        fn(1, above, (untouched,))
    block = ", ".join(map(str, above))
    assert re.fullmatch(rf"kernel '{re.escape(instance)}': block \({block}\) has {int(np.prod(above))} threads, above the "
                        rf"kernel's __launch_bounds__\(threads_of<WARPS>\(\), 2\), whose first argument is {threads} "
                        rf"here( \[.*\])?", str(caught.value)), str(caught.value)
    assert not E.asnumpy(untouched).any()
    assert_still_works(good)


def test_g3_an_ill_formed_bound_fails_the_build_as_under_nvrtc():
    """__launch_bounds__' arguments are compiled in the kernel's scope, as NVRTC compiles them: a
    bound naming nothing declared fails the emulator's build too, naming the kernel's line."""
    source = "__global__ void __launch_bounds__(kThreadsPerBlock) k(int* out) { out[threadIdx.x] = 1; }\n"
    with pytest.raises(E.CompileError, match=r"ill_formed_bounds\.cu:1:.*kThreadsPerBlock"):
        E.Module(source, ["k"], filename="ill_formed_bounds.cu")


def test_h_dynamic_shared_memory_above_48k(good, bugs):
    with pytest.raises(E.LaunchError, match="49153 bytes of dynamic shared memory"):
        bugs.get_function("smem_past_end")(1, 64, (E.zeros(64),), shared_mem=49153)
    assert_still_works(good)


OPT_IN_SOURCE = """
__global__ void last_shared_float(float* y) {
  extern __shared__ float s[];
  const int last = 60000 / 4 - 64 + threadIdx.x;   // the top 64 floats of a 60000-byte block
  s[last] = 1.f + threadIdx.x;
  __syncthreads();
  y[threadIdx.x] = s[last];
}
"""


def test_h_dynamic_shared_memory_past_48k_after_the_kernels_opt_in():
    fn = E.Module(OPT_IN_SOURCE, ["last_shared_float"], filename="opt_in.cu").get_function("last_shared_float")
    y = E.zeros(64)
    with pytest.raises(E.LaunchError, match="60000 bytes of dynamic shared memory requested; the limit without "
                                            r"opting in is 49152 bytes"):
        fn(1, 64, (y,), shared_mem=60000)
    fn.opt_in_shared_memory(60000)   # cudaFuncSetAttribute(MaxDynamicSharedMemorySize)
    fn(1, 64, (y,), shared_mem=60000)
    assert np.array_equal(np.asarray(y), np.arange(1, 65, dtype=np.float32))
    with pytest.raises(E.LaunchError, match="60001 bytes of dynamic shared memory requested; the kernel opted "
                                            "in to 60000 bytes"):
        fn(1, 64, (y,), shared_mem=60001)
    with pytest.raises(E.EmulatorFault, match=r"out-of-bounds dynamic shared memory write at byte offset 599\d\d "
                                              r"\(past the end; the launch has 59904 bytes"):
        fn(1, 64, (y,), shared_mem=59904)   # opted in, but the block asks for less than it writes
    with pytest.raises(E.LaunchError, match="232449 bytes of dynamic shared memory; CUDA allows at most 232448"):
        fn.opt_in_shared_memory(232449)
    fn.opt_in_shared_memory(232448)   # sm_90's whole 227 KiB
    y[:] = 0
    fn(1, 64, (y,), shared_mem=232448)
    assert np.array_equal(np.asarray(y), np.arange(1, 65, dtype=np.float32))


def test_i_python_int_for_int_parameter(good, bugs):
    fn = bugs.get_function("takes_int")
    with pytest.raises(E.LaunchError, match=r"argument 1 is a Python int.*8-byte long long.*"
                                            r"parameter 1 is 'int' \(4 bytes.*numpy\.int32"):
        fn(1, 32, (E.zeros(32), 32))
    with pytest.raises(E.LaunchError, match=r"takes 2 arguments \(float\*, int\) but 3 were passed$"):
        fn(1, 32, (E.zeros(32), np.int32(3), np.int32(4)))
    with pytest.raises(E.LaunchError, match=r"takes 2 arguments \(float\*, int\) but 1 was passed$"):
        fn(1, 32, (E.zeros(32),))
    with pytest.raises(E.LaunchError, match="Python float"):
        fn(1, 32, (E.zeros(32), 3.0))
    with pytest.raises(E.LaunchError, match="float32 array"):
        fn(1, 32, (E.zeros(32), E.zeros(1)))
    assert_still_works(good)


def test_j_failing_device_assert(good, bugs):
    x = E.asarray(np.arange(8, dtype=np.int32))
    with pytest.raises(E.DeviceAssertError) as e:
        bugs.get_function("failing_assert")(1, 8, (x,))
    msg = str(e.value)
    assert "thread (5,0,0)" in msg and "x[threadIdx.x] != 5" in msg
    assert bug_site('assert(x[') in msg
    assert_still_works(good)


def test_a_trap_names_its_block_and_thread_and_says_only_what_it_said(good, bugs):
    """__trap() in thread (5,1,0) of block (3,1,2) of a 3D grid, launched after an assert failed:
    the report names that block and thread, and holds none of the earlier error's text."""
    with pytest.raises(E.DeviceAssertError, match="device assertion"):
        bugs.get_function("failing_assert")(1, 8, (E.asarray(np.arange(8, dtype=np.int32)),))
    with pytest.raises(E.DeviceAssertError) as e:
        bugs.get_function("trap_at")((4, 3, 3), (8, 2, 1), tuple(np.int32(v) for v in (3, 1, 2, 5, 1)))
    where = r"kernel 'trap_at' block \(3,1,2\) thread \(5,1,0\)"
    assert re.fullmatch(rf"{where}: __trap\(\) at \S*{re.escape(bug_site('ty) __trap()'))}( \[.*\])?", str(e.value))
    assert_still_works(good)


def test_k_shuffle_with_exited_lane(good, bugs):
    # Which lane notices first depends on the schedule (CUPYKV_EMULATOR_SEED): a waiting lane
    # sees lane 16 or above exit, or a lane arrives after some of them have exited.
    with pytest.raises(E.BarrierError, match=r"__shfl_xor_sync at .*bugs\.cu:\d+ \(mask "
                                             r"0xffffffff\).*(lane (1[6-9]|2\d|3[01]) \(thread \d+\), "
                                             r"which exited|the mask names lanes .* that have exited)"):
        bugs.get_function("shuffle_exited_lane")(1, 32, (E.zeros(32),))
    assert_still_works(good)


# Each kernel under index order (seed 0), and the error it must give. test_k_shuffle_with_exited_lane
# covers any order.
EXITED_LANES = [
    # lanes 0-15 run first and exit; then lane 16 reaches the shuffle, whose mask names them
    ("shuffle_after_lanes_exited", r"__shfl_xor_sync at .*bugs\.cu:\d+ \(mask 0xffffffff\) in warp 0: the mask names "
                                   r"lanes 0-15 \(threads 0-15\) that have exited"),
    # lanes 0 and 31 have exited: the list names both and stops at lane 31 (a list that ran on past
    # the warp's last lane would wrap round to lane 0)
    ("shuffle_after_first_and_last_lanes_exited", r"__shfl_xor_sync at .*bugs\.cu:\d+ \(mask 0xffffffff\) in warp 0: "
                                                  r"the mask names lanes 0 \(thread 0\), 31 \(thread 31\) that have "
                                                  r"exited$"),
    # lanes 1-30 wait when lane 31, which their mask names, exits (lane 0, in no mask, takes no part)
    ("shuffle_waiting_for_the_last_lane", r"__shfl_sync at .*bugs\.cu:\d+ \(mask 0xfffffffe\) in warp 0: lane 1 "
                                          r"\(thread 1\) waits for lane 31 \(thread 31\), which exited$"),
]


@pytest.mark.parametrize("kernel, match", EXITED_LANES, ids=[case[0] for case in EXITED_LANES])
def test_a_shuffle_whose_mask_names_exited_lanes_fails_naming_them(good, bugs, monkeypatch, kernel, match):
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    with pytest.raises(E.BarrierError, match=match):
        bugs.get_function(kernel)(1, 32, (E.zeros(32),))
    assert_still_works(good)


def test_masks_that_differ_among_lanes_past_lane_0_are_explained(good, bugs):
    """The deadlock report explains the two masks, though lane 0 is in neither."""
    fn = bugs.get_function("shuffle_masks_differ_past_lane_0")
    with pytest.raises(E.BarrierError, match=r"__shfl_sync at .*bugs\.cu:\d+ in warp 0: lane \d+ \(thread \d+\) "
                                             r"passes mask 0x(0000fffe|fffffffe), but lane \d+ \(thread \d+\), which "
                                             r"both masks name, waits at .*bugs\.cu:\d+ with mask "
                                             r"0x(fffffffe|0000fffe)"):
        fn(1, 32, (E.zeros(32), np.int32(0)))
    y = E.zeros(32)
    fn(1, 32, (y, np.int32(1)))
    np.testing.assert_array_equal(y, [0] + [2] * 31)


def test_sparse_masks_that_differ_are_explained_by_the_lanes_they_name(good, bugs):
    """Lane 0 (mask 0x5) and lane 2 (mask 0xd) name each other; lane 0 is the first waiting lane, so
    the report starts from it, whatever order the lanes arrived in."""
    site = re.escape(bug_site("y[lane] = __shfl_sync(mask, (float)lane, 0);"))
    with pytest.raises(E.BarrierError, match=rf"__shfl_sync at .*{site} in warp 0: lane 0 \(thread 0\) passes mask "
                                             rf"0x00000005, but lane 2 \(thread 2\), which both masks name, waits at "
                                             rf".*{site} with mask 0x0000000d"):
        bugs.get_function("shuffle_sparse_masks_differ")(1, 32, (E.zeros(32),))
    assert_still_works(good)


@pytest.mark.parametrize("threads", [32, 64, 128])
def test_a_lane_outside_its_own_mask_is_named_with_its_warp(good, bugs, threads):
    """The mask 0x7fffffff leaves out lane 31 of every warp; whichever warp's lane 31 calls first is
    named, as lane 31 of warp thread // 32."""
    with pytest.raises(E.BarrierError) as caught:
        bugs.get_function("shuffle_width_and_mask")(1, threads, (E.zeros(threads), np.int32(32),
                                                                 np.uint32(0x7FFFFFFF)))
    found = re.search(r"\(mask 0x7fffffff\) in warp (\d+): the calling lane 31 \(thread (\d+)\) is not in the mask",
                      str(caught.value))
    assert found, str(caught.value)
    warp, thread = int(found.group(1)), int(found.group(2))
    assert thread % 32 == 31 and warp == thread // 32 < threads // 32, str(caught.value)
    assert_still_works(good)


def test_shuffle_reading_outside_mask(good, bugs):
    # lanes 8-15 read lanes 16-23 (down by 8): each lane and thread number is the same in warp 0
    with pytest.raises(E.BarrierError, match=r"lane (8|9|1[0-5]) \(thread \1\) reads lane (1[6-9]|2[0-3]) "
                                             r"\(thread \2\), which is not in the mask"):
        bugs.get_function("shuffle_outside_mask")(1, 32, (E.zeros(32, np.int32),))
    assert_still_works(good)


@pytest.mark.parametrize("kernel", ["shuffle_split_sites", "shuffle_sites_and_masks_differ"])
def test_shuffle_lanes_at_different_sites(good, bugs, kernel):
    """Lanes of one mask at two call sites: the report says they must reach one site, also where their
    masks differ too (two masks at two sites are not a mask mismatch at one site)."""
    with pytest.raises(E.BarrierError, match=r": deadlock: warp-synchronous operations cannot complete \(lanes of a "
                                             r"mask must reach the same call site"):
        bugs.get_function(kernel)(1, 32, (E.zeros(32, np.int32),))
    assert_still_works(good)


SHUFFLE_WIDTH_AND_MASK = bug_site("y[threadIdx.x] = __shfl_sync(mask, (float)threadIdx.x, 0, width);")


@pytest.mark.parametrize("width", [0, 3, 24, 64])
def test_a_shuffle_width_must_be_a_power_of_two_up_to_32(good, bugs, width):
    with pytest.raises(E.BarrierError, match=rf"__shfl_sync at .*{SHUFFLE_WIDTH_AND_MASK} \(mask 0xffffffff\) in "
                                             rf"warp 0: width {width} is not a power of two in 1\.\.32"):
        bugs.get_function("shuffle_width_and_mask")(1, 32, (E.zeros(32), np.int32(width), np.uint32(0xFFFFFFFF)))
    for good_width in (1, 8, 32):   # each lane gets its segment's first lane
        y = E.zeros(32)
        bugs.get_function("shuffle_width_and_mask")(1, 32, (y, np.int32(good_width), np.uint32(0xFFFFFFFF)))
        np.testing.assert_array_equal(y, np.arange(32) // good_width * good_width)
    assert_still_works(good)


@pytest.mark.parametrize("threads, warp, missing", [(24, 0, r"24-31 \(threads 24-31\)"), (31, 0, r"31 \(thread 31\)"),
                                                    (63, 1, r"31 \(thread 63\)")])
def test_a_mask_naming_lanes_the_block_lacks_fails_naming_them(good, bugs, threads, warp, missing):
    with pytest.raises(E.BarrierError, match=rf"__shfl_sync at .*{SHUFFLE_WIDTH_AND_MASK} \(mask 0xffffffff\) in "
                                             rf"warp {warp}: the mask names lanes {missing} that do not exist "
                                             rf"\(the block has {threads} threads\)"):
        bugs.get_function("shuffle_width_and_mask")(1, threads, (E.zeros(threads), np.int32(32),
                                                                 np.uint32(0xFFFFFFFF)))
    if threads < 32:   # the mask of the lanes the block has
        y = E.zeros(threads)
        bugs.get_function("shuffle_width_and_mask")(1, threads, (y, np.int32(32), np.uint32((1 << threads) - 1)))
        np.testing.assert_array_equal(y, np.zeros(threads))
    assert_still_works(good)


def test_l_stack_overflow(good, bugs):
    """The report names the function whose frame overflowed (its first line: the frame is probed
    on entry) and the setting that enlarges the stack."""
    with pytest.raises(E.EmulatorFault) as e:
        bugs.get_function("huge_local")(1, 4, (E.zeros(4), np.int32(200000)))
    assert re.fullmatch(r"kernel 'huge_local' block \(0,0,0\) thread \([0-3],0,0\): stack overflow: the thread used "
                        r"more than its \d+ KiB fiber stack \(large local arrays\?\) "
                        rf"at \S*{re.escape(bug_site('void huge_local('))}; set CUPYKV_EMULATOR_STACK_KIB to enlarge "
                        r"it( \[.*\])?", str(e.value)), str(e.value)
    assert_still_works(good)


def test_the_stack_setting_takes_effect_at_the_next_launch(good, bugs, monkeypatch):
    """huge_local's frame holds an 800,000-byte array: past a 64 KiB stack, inside a 1 MiB one.
    CUPYKV_EMULATOR_STACK_KIB is read at every launch, as the overflow's message invites."""
    def run(kib):
        if kib is None:
            monkeypatch.delenv("CUPYKV_EMULATOR_STACK_KIB", raising=False)
        else:
            monkeypatch.setenv("CUPYKV_EMULATOR_STACK_KIB", str(kib))
        y = E.zeros(4)
        bugs.get_function("huge_local")(1, 4, (y, np.int32(1000)))
        return y

    for kib, shown in [(None, 64), (16, 16)]:
        with pytest.raises(E.EmulatorFault, match=rf"stack overflow: the thread used more than its {shown} KiB fiber "
                                                  r"stack .*set CUPYKV_EMULATOR_STACK_KIB to enlarge it"):
            run(kib)
        np.testing.assert_array_equal(run(1024), np.full(4, 999.0))   # after an overflow, in the same process
    assert_still_works(good)


@pytest.mark.parametrize("value", ["15", "0", "-64", "1.5", "ten", "65537"])
def test_the_stack_setting_is_checked_before_anything_runs(good, monkeypatch, value):
    monkeypatch.setenv("CUPYKV_EMULATOR_STACK_KIB", value)
    y = E.asarray(np.full(4, -1.0, np.float32))
    with pytest.raises(ValueError, match=rf"CUPYKV_EMULATOR_STACK_KIB: expected a whole number of KiB from 16 to "
                                         rf"65536, got '{re.escape(value)}'"):
        good.get_function("axpy<float>")(1, 4, (y, y, np.float32(2), np.int32(4)))
    assert (np.asarray(y) == -1).all()


def test_null_pointer_and_division_by_zero(good, bugs):
    with pytest.raises(E.EmulatorFault, match="null"):
        bugs.get_function("null_deref")(1, 4, (None,))
    with pytest.raises(E.DeviceAssertError) as e:
        bugs.get_function("divide_by_zero")(1, 4, (E.zeros(4, np.int32), np.int32(0)))
    assert re.fullmatch(r"kernel 'divide_by_zero' block \(0,0,0\) thread \([0-3],0,0\): arithmetic exception \(SIGFPE, "
                        r"e\.g\. integer division by zero; the GPU would return an unspecified value instead\) "
                        rf"at \S*{re.escape(bug_site('100 / d'))}( \[.*\])?", str(e.value)), str(e.value)
    assert_still_works(good)


def test_an_illegal_instruction_names_its_thread_and_line(good, bugs):
    x = np.zeros((2, 8), np.int32)
    x[1, 5] = 3   # block 1, thread 5: the only thread that reads 3
    with pytest.raises(E.DeviceAssertError) as e:
        bugs.get_function("illegal_instruction")(2, 8, (E.asarray(x),))
    assert re.fullmatch(r"kernel 'illegal_instruction' block \(1,0,0\) thread \(5,0,0\): illegal instruction "
                        r"\(SIGILL, e\.g\. __builtin_trap or reaching unreachable code\) "
                        rf"at \S*{re.escape(bug_site('__builtin_trap()'))}( \[.*\])?", str(e.value)), str(e.value)
    assert_still_works(good)


def test_read_only_host_array_written(good, bugs):
    y = np.zeros(32, np.float32)
    y.flags.writeable = False
    with pytest.raises(E.EmulatorFault, match="read-only"):
        bugs.get_function("takes_int")(1, 32, (y, np.int32(32)))
    assert (y == 0).all()
    assert_still_works(good)


@pytest.mark.parametrize("grid, block, match", [
    (1, 0, "block dimension x is 0"),
    (0, 32, "grid dimension x is 0"),
    (1, (33, 32), "1056 threads, above CUDA's limit of 1024"),
    (1, (1, 1, 65), "above CUDA's limit 64"),
    ((1, 70000), 32, "grid dimension y is 70000"),
    (1, (1, 2, 3, 4), "1 to 3 dimensions"),
])
def test_bad_geometry(good, grid, block, match):
    with pytest.raises(E.LaunchError, match=re.escape(match)):
        good.get_function("block_sum")(grid, block, (E.zeros(4), E.zeros(1), np.int32(4)))


@pytest.mark.parametrize("grid, block", [
    ((2**31 - 1, 1, 1), (1, 1, 1)), ((1, 65535, 1), (1, 1, 1)), ((1, 1, 65535), (1, 1, 1)),
    ((1, 1, 1), (1024, 1, 1)), ((1, 1, 1), (1, 1024, 1)), ((1, 1, 1), (1, 1, 64)),
])
def test_a_launch_at_each_of_cudas_limits_runs_and_one_past_it_is_refused(grid, block):
    """CUDA's grid limits (2**31 - 1, 65535, 65535) and block limits (1024, 1024, 64) are each allowed: a
    kernel that traps in every thread ends the launch in its first block, so even the largest grid runs
    (blocks in the schedule's order) and stops at once. One more on that axis is refused before anything runs."""
    stop = E.Module("__global__ void stop() { __trap(); }\n", ["stop"], filename="stop.cu").get_function("stop")
    with pytest.raises(E.DeviceAssertError) as trapped:
        stop(grid, block, ())
    bx, by, bz = (int(v) for v in re.search(r"block \((\d+),(\d+),(\d+)\)", str(trapped.value)).groups())
    assert bx < grid[0] and by < grid[1] and bz < grid[2], str(trapped.value)
    for axis in range(3):
        for what, dims, limit in (("grid", grid, (2**31 - 1, 65535, 65535)), ("block", block, (1024, 1024, 64))):
            if dims[axis] == limit[axis]:
                past = tuple(d + (a == axis) for a, d in enumerate(dims))
                with pytest.raises(E.LaunchError, match=rf"{what} dimension {'xyz'[axis]} is {limit[axis] + 1}, "
                                                        rf"above CUDA's limit {limit[axis]}$"):
                    stop(past if what == "grid" else grid, past if what == "block" else block, ())


# ---- build -----------------------------------------------------------------------------
def test_compile_error_shows_gcc_output(tmp_path):
    with pytest.raises(E.CompileError, match=r"broken\.cu:3.*error"):
        E.Module("__global__ void k(float* x) {\n  x[0] = 1.f;\n  undefined_thing(x);\n}\n",
                 ["k"], filename="broken.cu")


def test_disk_cache_hit(tmp_path, monkeypatch):
    build.runtime()  # built (or found) in the usual cache before switching
    monkeypatch.setenv("CUPYKV_CACHE_DIR", str(tmp_path))
    src = f"// {tmp_path}\n__global__ void k(int* x) {{ x[threadIdx.x] = threadIdx.x; }}\n"
    compiles = build.stats["compiles"]
    E.Module(src, ["k"])
    assert build.stats["compiles"] == compiles + 1
    assert len(list((tmp_path / "emulator").glob("mod-*.so"))) == 1
    memory_hits = build.stats["memory_hits"]
    E.Module(src, ["k"])  # in-process cache
    assert build.stats["memory_hits"] == memory_hits + 1 and build.stats["compiles"] == compiles + 1
    build.clear_memory_cache()
    hits = build.stats["disk_hits"]
    mod = E.Module(src, ["k"])      # the second build is a disk hit: g++ is not called again
    assert build.stats["compiles"] == compiles + 1 and build.stats["disk_hits"] == hits + 1
    x = E.zeros(8, np.int32)
    mod.get_function("k")(1, 8, (x,))
    assert x.tolist() == list(range(8))


def test_launch_bounds_parsing():
    from cupykv.backends.emulator import source
    src = ("#define NT 256\nconstexpr int W = NT / 32;\n"
           "__global__ void __launch_bounds__(NT) a() {}\n"
           "__launch_bounds__(W * 16, 2) __global__ void b() {}\n"
           "template <int B> __global__ void __launch_bounds__(B) c() {}\n")
    assert source.parse_launch_bounds(src) == {"a": ("NT", 256), "b": ("W * 16", 128),
                                               "c": ("B", None)}


def test_the_launch_bounds_move_into_the_body_on_the_same_line():
    from cupykv.backends.emulator import source
    src = ("template <int B> __global__ void __launch_bounds__(B * 32,  // warps\n"
           "    2) c(int* x)\n{\n  x[0] = 1;\n}\n"
           "__launch_bounds__(64) __global__ void declared(int* x);\n"
           "#define BOUNDED __launch_bounds__(32)\n")
    out = source.rewrite_launch_bounds(src)
    assert out.splitlines() == ["template <int B> __global__ void __launch_bounds__(B * 32,  // warps",
                                "    2) c(int* x)", "{ CUEMU_LAUNCH_BOUNDS(B * 32, 2);", "  x[0] = 1;", "}",
                                "__launch_bounds__(64) __global__ void declared(int* x);",
                                "#define BOUNDED __launch_bounds__(32)"]


def test_rewrite_keeps_line_numbers():
    from cupykv.backends.emulator import source
    src = ("// extern __shared__ float no[];\n__global__ void k() {\n"
           "  extern __shared__ alignas(16)\n    float s[];\n  s[0] = 1.f;\n}\n")
    out = source.rewrite_dynamic_shared(src)
    assert out.count("\n") == src.count("\n")
    assert "float* const s = reinterpret_cast<float*>(::cuemu::dynamic_shared());" in out
    assert out.startswith("// extern __shared__ float no[];")


@pytest.mark.parametrize("declaration", [
    "__global__ void k(float* out) {{\n    extern __shared__ {alignment} float tile[];\n",
    "__global__ void k(float* out);\nextern __shared__ {alignment} float tile[];\n__global__ void k(float* out) {{\n",
], ids=["in the kernel", "at file scope"])
@pytest.mark.parametrize("alignment, error", [
    ("__align__(15)", r"requested alignment .?15.? is not a positive power of 2"),   # NVRTC refuses it too
    ("alignas(128)", r"extern __shared__ alignment above 16 is not emulated"),
], ids=["__align__(15)", "alignas(128)"])
def test_an_extern_shared_alignment_is_compiled_and_held_to_what_the_emulator_gives(declaration, alignment, error):
    """The alignment of an ``extern __shared__`` array is compiled, as under NVRTC, and one the emulator
    does not give (its dynamic shared memory starts 16-byte aligned) fails the build, naming the line,
    where it would have been dropped without a word."""
    source = (declaration.format(alignment=alignment) +
              "    tile[threadIdx.x] = 1.0f; __syncthreads(); out[threadIdx.x] = tile[threadIdx.x];\n}\n")
    with pytest.raises(E.CompileError, match=rf"aligned_tile\.cu:2:(.|\n)*{error}"):
        E.Module(source, ["k"], filename="aligned_tile.cu")
    fine = source.replace(alignment, "__align__(16)")
    out = E.zeros(4, np.float32)
    E.Module(fine, ["k"], filename="aligned_tile.cu").get_function("k")(1, 4, (out,), shared_mem=16)
    assert E.asnumpy(out).tolist() == [1.0] * 4


def test_static_shared_rewrite_keeps_line_numbers():
    """A function's static __shared__ variables are boxed between guard bytes and reached
    through the reference cuemu::static_shared returns, file-scope ones keep their name; both
    are value-initialised (no initialisation guard, whose accesses the instrumentation would see
    as races); other declarations stay as they are."""
    from cupykv.backends.emulator import source
    src = ("__shared__ float at_file_scope[4];\n__global__ void k(float* y) {\n"
           "  __shared__ __align__(16) float tile[2][32];\n  __shared__ int count;\n"
           "  __shared__ float a[2], b[2];\n  extern __shared__ float dyn[];\n"
           "  // __shared__ float in_comment[3];\n  y[0] = tile[1][2] + count + a[0] + b[0] + dyn[0];\n"
           "  __shared__ __align__(128) float wide[32];\n}\n")
    out = source.rewrite_shared(src)
    assert out.count("\n") == src.count("\n")
    lines = out.splitlines()
    assert lines[0] == "thread_local float at_file_scope[4]{};"
    guard_lo = "unsigned char cuemu_guard_lo[16];"
    guard_hi = "unsigned char cuemu_guard_hi[16];"
    assert lines[2] == (f"  thread_local struct {{ {guard_lo} __align__(16) float value[2][32]; {guard_hi} }} "
                        "cuemu_shared_tile{}; auto& tile = *::cuemu::static_shared(&cuemu_shared_tile);")
    assert lines[3] == (f"  thread_local struct {{ {guard_lo} int value; {guard_hi} }} cuemu_shared_count{{}}; "
                        "auto& count = *::cuemu::static_shared(&cuemu_shared_count);")
    assert lines[4] == "  __shared__ float a[2], b[2];"
    # aligned past the guard: a box would move it off its alignment, so it is left unboxed
    assert lines[8] == "  thread_local __align__(128) float cuemu_unboxed_wide[32]{}; auto& wide = *::cuemu::opaque(&cuemu_unboxed_wide);"
    assert lines[5].startswith("  float* const dyn = ")
    assert lines[6] == "  // __shared__ float in_comment[3];"


def test_a_static_shared_array_aligned_past_the_guard_keeps_its_alignment():
    """``__shared__ __align__(128)`` compiles and runs with its alignment (it is left unboxed), and
    a race on it is still reported by its name."""
    src = ("__global__ void wide(unsigned long long* y) {\n"
           "  __shared__ __align__(128) float tile[32];\n"
           "  tile[threadIdx.x] = 1.f;\n  __syncthreads();\n"
           "  y[threadIdx.x] = reinterpret_cast<unsigned long long>(&tile[0]) % 128 + (unsigned long long)tile[31];\n"
           "}\n"
           "__global__ void wide_race(float* y) {\n"
           "  __shared__ __align__(64) float tile[32];\n"
           "  tile[threadIdx.x] = 1.f;\n  y[threadIdx.x] = tile[31 - threadIdx.x];\n}\n")
    module = E.Module(src, ["wide", "wide_race"])
    y = E.zeros(32, np.uint64)
    module.get_function("wide")(1, 32, (y,))
    assert E.asnumpy(y).tolist() == [1] * 32
    with pytest.raises(E.RaceError, match=r"static __shared__ tile \(in wide_race\)"):
        module.get_function("wide_race")(1, 32, (E.zeros(32),))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.cu")), ids=lambda path: path.name)
def test_same_source_compiles_with_nvrtc(path, arch):
    """The emulator's test kernels are real CUDA: NVRTC compiles each file unchanged, with the
    product's headers, for sm_80 and sm_90, as their header comments say."""
    nvrtc = nvrtc_check.load_nvrtc()
    include_dirs = (str(KERNELS), str(KERNEL_DIR))
    nvrtc_check.compile_file(nvrtc, path.name, path.read_text(), [], arch, include_dirs=include_dirs)


# ---- speed -----------------------------------------------------------------------------
def test_representative_launch_is_correct(good):
    """16 blocks x 128 threads, 256 iterations of 5 shuffles + 2 barriers (3.7 M fiber
    switches; about 0.1 s here, but speed is the bench's business, not a test's)."""
    x = E.asarray(np.random.default_rng(1).random(4096, dtype=np.float32))
    out = E.zeros(16, np.float32)
    fn = good.get_function("busy")
    fn(16, 128, (x, out, np.int32(256)))
    idx = (np.arange(16)[:, None, None] * 128 + np.arange(128)[None, None, :]
           + np.arange(256)[None, :, None]) & 4095
    np.testing.assert_allclose(out, x[idx].sum(axis=(1, 2), dtype=np.float64), rtol=1e-5)
