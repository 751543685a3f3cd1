"""The emulator's traffic counter, and the byte contracts of the kernels it proves.

The counter (cupykv/backends/emulator/traffic.cpp) sees every global access of a kernel. These
tests check it first on kernels whose traffic is known (tests/emulator_kernels/traffic.cu),
then hold cupykv's kernels to their contracts, exactly: attention reads the K/V bytes of the
attended rows and not one byte more, stores each output and each split's partials once, and (the
staged kernels) copies the steps of its own keys into shared memory and no more; append writes its
rows and reads nothing of the cache, the length ops touch only their arrays, linear reads its
weight once, and a graph replay moves the bytes of the eager step. Planted over-reads (a patched
attention.cu and a small kernel) show that the checks fail when they should, and a protected cache
tail makes a whole-axis read fault. The coalescing figures of the decode kernels are held at the end.
"""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cupykv
from cupykv import ops, testing
from cupykv.attention_plan import attention_kernel, max_splits
from cupykv.backends import emulator as E
from cupykv.backends.emulator import accounting, memory
from cupykv.backends.emulator_backend import EmulatorBackend
from cupykv.kernels import KERNEL_DIR, KERNELS, attention_f32_head_dim, attention_mma_head_dim
from cupykv.spec import host_dtype
from cupykv.step_instructions import StagedInstance

KERNELS_DIR = Path(__file__).parent / "emulator_kernels"
TRAFFIC_NAMES = ["strided_copy", "vector_copy", "sum_rows", "uneven_trips", "realigned_trips",
                 "count_and_copy", "realigned_by_barrier", "half_warp_collective", "add_pair", "one_site_two_places",
                 "copy_byte_spans", "gather_into_first", "move_byte"]
EXAMPLES = max(8, settings.default.max_examples // 4)   # each example runs kernels on the emulator


@pytest.fixture(scope="module")
def kernels():
    path = KERNELS_DIR / "traffic.cu"
    return E.Module(path.read_text(), TRAFFIC_NAMES, filename=str(path))


def only_launch(t):
    assert len(t.launches) == 1, t.report()
    return t.launches[0]


# ---- the counter on known kernels -------------------------------------------------------
@pytest.mark.parametrize("stride, sectors_per_request", [(1, 4), (8, 32), (0, 1)])
def test_sectors_per_request_of_strided_loads(kernels, stride, sectors_per_request):
    x, out = E.zeros(64 * max(stride, 1), np.float32), E.zeros(64, np.float32)
    with E.traffic() as t:
        kernels.get_function("strided_copy")(1, 64, (x, out, np.int32(stride), np.int32(64)))
    launch = only_launch(t)
    load, store = launch.of(x).counts("load"), launch.of(out).counts("store")
    assert (load.bytes, load.accesses, load.requests) == (256, 64, 2)
    assert load.sectors_per_request == sectors_per_request
    assert launch.of(x).sectors_loaded == {1: 8, 8: 64, 0: 1}[stride]
    assert (store.bytes, store.requests, store.sectors_per_request, store.sectors) == (256, 2, 4, 8)
    assert launch.of(x).bytes_stored == 0 and launch.of(out).bytes_loaded == 0
    touched = launch.of(x).touched("load")
    assert np.array_equal(np.flatnonzero(touched[::4]), np.arange(64) * stride if stride else [0])
    assert launch.kernel == "strided_copy" and launch.grid == (1, 1, 1) and launch.block == (64, 1, 1)


def test_16_byte_vectors_are_16_sectors_per_warp(kernels):
    x, out = E.zeros((96, 4), np.uint32), E.zeros((96, 4), np.uint32)
    with E.traffic() as t:
        kernels.get_function("vector_copy")(3, 32, (x, out, np.int32(96)))
    load = only_launch(t).of(x).counts("load")
    assert (load.bytes, load.accesses, load.requests, load.sectors) == (x.nbytes, 96, 3, x.nbytes // 32)
    assert load.sectors_per_request == 16


def test_lanes_pair_by_visits_of_a_call_site(kernels):
    x, out = E.zeros(96, np.float32), E.zeros(32, np.float32)
    with E.traffic() as t:
        kernels.get_function("uneven_trips")(1, 32, (x, out))
    load = only_launch(t).of(x).counts("load")
    assert (load.accesses, load.requests, load.request_sectors) == (48, 2, 8)
    with E.traffic() as t:
        kernels.get_function("realigned_trips")(1, 32, (x, out, np.int32(1)))
    load = only_launch(t).of(x).counts("load")
    assert (load.accesses, load.requests, load.request_sectors) == (65, 3, 9)


def test_a_block_barrier_realigns_the_lanes_visits(kernels):
    x, out = E.zeros(192, np.float32), E.zeros(64, np.float32)
    with E.traffic() as t:
        kernels.get_function("realigned_by_barrier")(1, 64, (x, out, np.int32(1)))
    load = only_launch(t).of(x).counts("load")
    assert (load.accesses, load.requests, load.request_sectors) == (129, 5, 17)


def test_requests_do_not_depend_on_the_order_threads_run_in(kernels, monkeypatch):
    """A collective of half a warp moves only its own lanes on: the requests after it are the same
    under every schedule (a lane outside it may run before or after it completes)."""
    x, out = E.zeros(32, np.float32), E.zeros(32, np.float32)
    counts = set()
    for seed in range(12):
        monkeypatch.setenv("CUPYKV_EMULATOR_SEED", str(seed))
        with E.traffic() as t:
            kernels.get_function("half_warp_collective")(1, 32, (x, out))
        load = only_launch(t).of(x).counts("load")
        counts.add((load.accesses, load.requests, load.request_sectors))
    assert counts == {(32, 2, 4)}


def test_a_request_is_counted_in_each_array_and_each_kind_it_touches(kernels):
    """One warp's load over two arrays is a request of each array, with that array's sectors; a
    memcpy that loads and stores one array at one call site is a load request and a store request."""
    a, b, out = E.zeros(16, np.float32), E.zeros(16, np.float32), E.zeros(32, np.float32)
    buf = E.zeros(256, np.float32)
    with E.traffic() as t:
        kernels.get_function("one_site_two_places")(1, 32, (a, b, buf, out, np.int32(16)))
    launch = only_launch(t)
    for half in (a, b):
        load = launch.of(half).counts("load")
        assert (load.bytes, load.accesses, load.requests, load.request_sectors, load.sectors) == (64, 16, 1, 2, 2)
    load, store = launch.of(buf).counts("load"), launch.of(buf).counts("store")
    assert (load.bytes, load.accesses, load.requests, load.request_sectors) == (512, 32, 1, 16)
    assert (store.bytes, store.accesses, store.requests, store.request_sectors) == (512, 32, 1, 16)
    assert launch.of(buf).ranges("load").tolist() == [[0, 512]]
    assert launch.of(buf).ranges("store").tolist() == [[512, 1024]]


def test_coalescing_counts_the_ideal_in_whole_sectors(kernels):
    x, out = E.zeros(64, np.float32), E.zeros(64, np.float32)
    with E.traffic() as t:
        kernels.get_function("strided_copy")(1, 64, (x, out, np.int32(1), np.int32(36)))   # 144 bytes: 4.5 sectors
    launch = only_launch(t)
    assert launch.coalescing("load", [x]) == accounting.Coalescing(2.5, 5, 5, 1.0, 1.0)
    assert launch.coalescing("load", [x], needed_bytes=100) == accounting.Coalescing(2.5, 5, 4, 1.25, 1.25)


def test_arguments_over_the_same_bytes_share_one_region_counted_once(kernels):
    """One array and its prefix passed as two arguments: each is found by its own bytes, both
    name the other as sharing their region, and totals count the region once."""
    base, out = E.zeros(64, np.float32), E.zeros(32, np.float32)
    prefix = base[:32]
    with E.traffic() as t:
        kernels.get_function("add_pair")(1, 32, (base, prefix, out, np.int32(32)))
    launch = only_launch(t)
    whole, part = launch.of(base), launch.of(prefix)
    assert (whole.index, whole.nbytes, whole.shares_region) == (0, 256, (1,))
    assert (part.index, part.nbytes, part.shares_region) == (1, 128, (0,))
    assert launch.total("load", [base, prefix]).bytes == launch.total("load").bytes == 256   # 2 x 32 floats
    assert launch.total("load", [base, prefix]).sectors == 4
    # a second argument 16 bytes into the region: its own phase, sectors and bytes
    suffix = base[4:36]
    with E.traffic() as t:
        kernels.get_function("add_pair")(1, 32, (base, suffix, out, np.int32(32)))
    launch = only_launch(t)
    whole, part = launch.of(base), launch.of(suffix)
    assert memory.find(memory.data_ptr(base)).start % 32 == 0 and (whole.phase, part.phase) == (0, 16)
    assert list(part.sectors("load")) == list(range(5)) and part.touched("load").all()
    assert whole.ranges("load").tolist() == [[0, 144]] and list(whole.sectors("load")) == list(range(5))


def test_atomics_and_memcpy_are_counted(kernels):
    """The atomics touch count[0] only: its map holds those 4 bytes of count's 32, and no map of an
    array holds a kind of access the kernel does not make to it."""
    count, x, out = E.zeros(8, np.int32), E.zeros((64, 4), np.float32), E.zeros((64, 4), np.float32)
    with E.traffic() as t:
        kernels.get_function("count_and_copy")(2, 32, (count, x, out))
    assert count.tolist() == [64] + [0] * 7
    launch = only_launch(t)
    atomic = launch.of(count).counts("atomic")
    assert (atomic.bytes, atomic.accesses, atomic.requests, atomic.sectors) == (256, 64, 2, 1)
    np.testing.assert_array_equal(launch.of(count).touched("atomic"), np.arange(32) < 4)
    for array, untouched in ((count, ("load", "store")), (x, ("store", "atomic")), (out, ("load", "atomic"))):
        for kind in untouched:
            assert not launch.of(array).touched(kind).any(), kind
    assert launch.of(count).bytes_loaded == launch.of(count).bytes_stored == 0
    assert launch.of(x).bytes_loaded == launch.of(out).bytes_stored == x.nbytes
    assert launch.of(x).touched("load").all() and launch.of(out).touched("store").all()


def test_each_array_keeps_its_own_load_store_and_atomic_maps(kernels):
    """Two arrays, each loaded at bytes 4..31 and updated atomically at bytes 0..3: each map holds
    its own bytes, whichever array the counter's one mapping places first (a map overlapping its
    neighbour's would show the other kind's bytes too)."""
    a, b = E.asarray(np.arange(8, dtype=np.int32)), E.asarray(np.arange(8, dtype=np.int32) * 10)
    with E.traffic() as t:
        kernels.get_function("gather_into_first")(1, 8, (a, b))
    assert a.tolist()[0] == 28 and b.tolist()[0] == 280
    launch = only_launch(t)
    for array in (a, b):
        arg = launch.of(array)
        np.testing.assert_array_equal(arg.touched("atomic"), np.arange(32) < 4)
        np.testing.assert_array_equal(arg.touched("load"), np.arange(32) >= 4)
        assert not arg.touched("store").any()
        assert (arg.counts("atomic").bytes, arg.counts("load").bytes, arg.counts("store").bytes) == (28, 28, 0)


# Spans (first byte, length) in bytes from the sector boundary at or before the array's start, the
# counter's own coordinates: its byte map is 64-bit words from there, so these are a lone byte at a
# word's first bit and at an odd one, spans crossing one word edge and three, one ending on a word's
# last bit, whole words, and the array's last byte.
BYTE_SPANS = [(64, 1), (67, 1), (126, 4), (140, 52), (192, 192), (401, 128), (575, 1), (577, 62), (703, 1)]


@pytest.mark.parametrize("shift", [0, 20, 36, 63])
def test_the_byte_map_holds_spans_of_any_length_and_alignment(kernels, shift):
    """Each span marks exactly its bytes and sectors, and its one request counts the sectors of
    every span, whichever bit of a map word the span starts and ends on; the arrays start
    ``shift`` bytes into their allocations (phase 0, 20, 4, and 31: a sector's last byte)."""
    phase = shift % 32
    src_base, dst_base = E.zeros(704 + shift - phase, np.uint8), E.zeros(704 + shift - phase, np.uint8)
    src_base[...] = np.random.default_rng(shift).integers(1, 256, src_base.size)
    src, dst = src_base[shift:], dst_base[shift:]
    starts = np.array([first - phase for first, _ in BYTE_SPANS], np.int32)
    lengths = np.array([length for _, length in BYTE_SPANS], np.int32)
    want = np.zeros(src.size, bool)
    for start, length in zip(starts, lengths):
        want[start:start + length] = True
    assert want[-1] and src.size == 704 - phase
    with E.traffic() as t:
        kernels.get_function("copy_byte_spans")(1, len(BYTE_SPANS), (src, dst, E.asarray(starts), E.asarray(lengths)))
    np.testing.assert_array_equal(dst, np.where(want, src, 0))
    sectors = np.unique((np.flatnonzero(want) + phase) // 32)
    for arg, kind in ((only_launch(t).of(src), "load"), (only_launch(t).of(dst), "store")):
        assert arg.phase == phase
        np.testing.assert_array_equal(arg.touched(kind), want)
        np.testing.assert_array_equal(arg.sectors(kind), sectors)
        counts = arg.counts(kind)
        assert (counts.bytes, counts.accesses, counts.requests) == (lengths.sum(), len(BYTE_SPANS), 1)
        assert counts.sectors_per_request == len(sectors) and counts.sectors == len(sectors)


@pytest.mark.parametrize("phase", [0, 5])
@pytest.mark.parametrize("map_bits", [63, 64, 65, 128, 129])
def test_a_byte_map_ending_just_past_a_word_keeps_each_kind_to_its_own_map(kernels, phase, map_bits):
    """The counter's maps (load, store, atomic; side by side in one mapping) are whole 64-bit words
    of phase + nbytes bits each. A load of the array's last byte, the first bit of a word when that
    sum is 65 or 129, lands in the load map and not in the store map after it. (A map a word short
    would put it on the store map's bit 0: inside the array at phase 0, on the padding before it at
    phase 5.)"""
    base = E.zeros(map_bits, np.uint8)
    base[...] = np.arange(1, map_bits + 1, dtype=np.uint8)
    x = base[phase:]
    last = x.size - 1
    with E.traffic() as t:
        kernels.get_function("move_byte")(1, 1, (x, np.int32(last), np.int32(1)))
    assert x.tolist()[1] == map_bits   # the last byte's value, moved
    arg = only_launch(t).of(x)
    assert arg.phase == phase and arg.nbytes == map_bits - phase
    np.testing.assert_array_equal(np.flatnonzero(arg.touched("load")), [last])
    np.testing.assert_array_equal(np.flatnonzero(arg.touched("store")), [1])
    assert (arg.counts("load").bytes, arg.counts("store").bytes, arg.counts("atomic").bytes) == (1, 1, 0)


@pytest.mark.parametrize("base_floats, start_phase", [(72, 0), (76, 16)])
def test_sectors_are_counted_from_the_allocation_start(kernels, base_floats, start_phase):
    """A view that starts 16 bytes into its allocation: its first row shares a sector with the
    bytes before it, as on a GPU, where allocations start on a sector boundary. The emulator
    starts an allocation on 16 bytes only: the view sits on a 32-byte address in one case and
    not in the other, and its phase is 16 in both."""
    base, out = E.zeros(base_floats, np.float32), E.zeros(64, np.float32)
    assert memory.find(memory.data_ptr(base)).start % 32 == start_phase   # the case the parameters name
    x = base[4:68]
    with E.traffic() as t:
        kernels.get_function("strided_copy")(1, 64, (x, out, np.int32(1), np.int32(64)))
    arg = only_launch(t).of(x)
    assert arg.phase == 16 and arg.nbytes == 256
    assert arg.sectors_loaded == 9 and list(arg.sectors("load")) == list(range(9))
    # each warp's 128 bytes straddle 5 sectors; sector 4 is in both warps' requests
    assert arg.counts("load").sectors_per_request == 5 and arg.counts("load").touched_bytes == 256


def test_a_read_one_row_too_far_is_caught(kernels):
    """The planted over-read: one row past the live ones changes the touched bytes exactly."""
    live, row_len = 5, 40
    m, out = E.zeros((16, row_len), np.float32), E.zeros(row_len, np.float32)
    want = np.zeros(m.nbytes, bool)
    want[:live * row_len * 4] = True
    fn = kernels.get_function("sum_rows")
    for rows, caught in ((live, False), (live + 1, True)):
        with E.traffic() as t:
            fn(1, 64, (m, out, np.int32(rows), np.int32(row_len)))
        arg = only_launch(t).of(m)
        assert (not np.array_equal(arg.touched("load"), want)) == caught
        assert arg.ranges("load").tolist() == [[0, rows * row_len * 4]]


def test_both_checkers_run_together_and_traffic_runs_without_the_race_checker(kernels, monkeypatch):
    races = KERNELS_DIR / "races.cu"
    module = E.Module(races.read_text(), ["warp_exchange"], filename=str(races))
    with E.traffic() as t:
        with pytest.raises(E.RaceError):
            module.get_function("warp_exchange")(1, 64, (E.zeros(64, np.int32), np.int32(0)))
    assert only_launch(t).argument(0).bytes_stored == 256   # counted, and the race reported
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    x, out = E.zeros(64, np.float32), E.zeros(64, np.float32)
    with E.traffic() as t:
        kernels.get_function("strided_copy")(1, 64, (x, out, np.int32(1), np.int32(64)))
    assert only_launch(t).of(x).counts("load").sectors_per_request == 4


def test_nothing_is_counted_outside_the_block_and_blocks_nest(kernels):
    x, out = E.zeros(64, np.float32), E.zeros(64, np.float32)
    fn = kernels.get_function("strided_copy")
    args = (x, out, np.int32(1), np.int32(64))
    with E.traffic() as outer:
        fn(1, 64, args)
        with E.traffic() as inner:
            fn(1, 64, args)
    fn(1, 64, args)
    assert len(outer.launches) == 2 and len(inner.launches) == 1
    assert "strided_copy" in outer.report() and "sec/req" in outer.report()


def test_host_arrays_are_counted_as_their_guarded_copies(kernels):
    x, out = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    with E.traffic() as t:
        kernels.get_function("strided_copy")(1, 64, (x, out, np.int32(1), np.int32(64)))
    assert only_launch(t).of(x).bytes_loaded == 256 and only_launch(t).of(out).bytes_stored == 256


def test_same_source_compiles_with_nvrtc():
    from cupykv import nvrtc_check
    nvrtc = nvrtc_check.load_nvrtc()
    path = KERNELS_DIR / "traffic.cu"
    nvrtc_check.compile_file(nvrtc, path.name, path.read_text(), [], "sm_80")


def test_testing_wrapper_refuses_other_backends():
    from cupykv.backends.base import Backend

    class Other(Backend):   # any backend but the emulator (CuPy's needs a GPU to exist)
        name = "other"

    with pytest.raises(ValueError, match="^traffic: counts emulator launches only, got the backend 'other'"):
        testing.traffic(Other())
    with testing.traffic("emulator") as t:
        assert t.launches == []


# ---- cupykv's kernels: attention ----------------------------------------------------------
def row_bytes(spec, layer, rows):
    """bool mask over the bytes of cache.k (or cache.v): rows ``rows[b] = (lo, hi)`` of every
    kv head of sequence ``b`` in ``layer``, from ``spec.strides``."""
    strides, item = spec.strides, spec.itemsize
    head_axis = 3 if spec.seq_axis == 2 else 2
    mask = np.zeros(int(np.prod(spec.shape)) * item, bool)
    for b, (lo, hi) in enumerate(rows):
        for j in range(lo, hi):
            for g in range(spec.n_kv_heads):
                first = (layer * strides[0] + b * strides[1] + j * strides[spec.seq_axis] +
                         g * strides[head_axis]) * item
                mask[first:first + spec.head_dim * item] = True
    return mask


def attended_rows(spec, lengths, q_len, window):
    """Per sequence, the positions ``[lo, hi)`` some query attends to."""
    rows = []
    for length in lengths:
        hi = min(spec.max_seq, length + q_len)
        rows.append((min(hi, max(0, length - window + 1)) if window else 0, hi))
    return rows


def tile_rows_read(spec, lengths, q_len, group, window):
    """K rows the blocks read in all: each block of query rows (query x head: 16, or 32 for the
    tensor-core kernel past 16 rows) reads each row of its key range once; blocks of one sequence
    overlap."""
    rows_per_block = attention_kernel(spec.dtype, spec.head_dim, spec.io_dtype, q_len * group).rows_per_block
    total = 0
    for length in lengths:
        for first in range(0, q_len * group, rows_per_block):
            first_query, last_query = first // group, (min(first + rows_per_block, q_len * group) - 1) // group
            hi = min(spec.max_seq, length + last_query + 1)
            total += hi - (min(hi, max(0, length + first_query - window + 1)) if window else 0)
    return total * spec.n_kv_heads




def assert_reads_exactly_the_attended_rows(launch, cache, layer, lengths, q_len, group, window):
    spec = cache.spec
    want = row_bytes(spec, layer, attended_rows(spec, lengths, q_len, window))
    row = spec.head_dim * spec.itemsize
    loads = tile_rows_read(spec, lengths, q_len, group, window) * row
    for array in (cache.k, cache.v):   # every kernel reads each K and V row of a block's keys once
        arg = launch.of(array)
        got = arg.touched("load")
        extra, missing = np.flatnonzero(got & ~want), np.flatnonzero(want & ~got)
        assert extra.size == 0, f"read {extra.size} bytes outside the attended rows, from byte {extra[:1]}"
        assert missing.size == 0, f"{missing.size} bytes of attended rows unread, from byte {missing[:1]}"
        assert arg.bytes_loaded == loads
        assert arg.bytes_stored == 0 and arg.counts("atomic").accesses == 0


@st.composite
def attention_cases(draw):
    spec = draw(testing.specs(max_layers=2, kv_heads=(1, 2), head_dims=(8, 24, 64, 128),
                              max_seqs=st.integers(1, 300), max_batch=2))
    lengths = draw(testing.lengths(spec))
    q_len = draw(st.integers(1, 5))
    group = draw(st.sampled_from((1, 4)))
    window = draw(st.none() | st.integers(1, spec.max_seq + 2))
    # the splits: a factor (even shares of the attended keys) or fixed positions s * split_keys
    splits = draw(st.one_of(st.builds(dict, num_splits=st.integers(1, min(3, max_splits(spec.max_seq)))),
                            st.builds(dict, split_keys=st.sampled_from(range(128, spec.max_seq + 128, 128)))))
    return spec, lengths, q_len, group, window, splits, draw(st.integers(0, spec.n_layers - 1))


def cache_and_zero_queries(spec, lengths, q_len, group):
    """An emulator cache of ``spec`` advanced to ``lengths`` and zero queries ``[batch, q_len, group *
    n_kv_heads, head_dim]`` in its io dtype: what the byte counts below need (the values do not matter)."""
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance(lengths)
    q = cache._backend.zeros((spec.batch, q_len, group * spec.n_kv_heads, spec.head_dim),
                             cache._backend.storage_dtype(spec.io_dtype))
    return cache, q


def read_attended_rows(spec, lengths, q_len, group, window, splits, layer):
    """One attention call under the traffic counter, checked by :func:`assert_reads_exactly_the_attended_rows`."""
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, layer, window=window, **splits)
    assert len(t.launches) == 1   # split or not: the splits are merged inside the launch
    assert_reads_exactly_the_attended_rows(t.launches[0], cache, layer, lengths, q_len, group, window)


@settings(max_examples=EXAMPLES)
@given(case=attention_cases())
def test_attention_reads_exactly_the_attended_rows(case):
    read_attended_rows(*case)


@pytest.mark.parametrize("dtype, head_dim", [("float32", 8), ("float32", 64), ("float16", 64), ("bfloat16", 128)])
def test_a_window_of_one_reads_only_each_querys_own_row(dtype, head_dim):
    """The narrowest window, which the property above draws only by chance: three queries at 17..19
    read rows 17..19 and nothing below (the mask alone would keep the output right)."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=40, batch=2, dtype=dtype)
    read_attended_rows(spec, [17, 0], q_len=3, group=1, window=1, splits={"num_splits": 1}, layer=0)


@pytest.mark.parametrize("dtype, head_dim", [("float32", 64), ("bfloat16", 128)])
@pytest.mark.parametrize("splits", [{"split_keys": 128}, {"num_splits": 3}], ids=["split_keys", "num_splits"])
def test_a_sliding_window_reads_no_key_before_it_in_any_split(dtype, head_dim, splits):
    """Keys before the window fill whole splits here (window 20 at length 290: keys 271..291 of
    300): the splits that hold only such keys read nothing, and the one the window starts in
    begins its reads at the window."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=300, batch=2, dtype=dtype)
    read_attended_rows(spec, [290, 150], 2, 4, 20, splits, 0)


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 64)])
@pytest.mark.parametrize("q_len, group", [(8, 4), (4, 8), (16, 2), (9, 4), (5, 8), (8, 8), (16, 8)])
def test_speculative_verification_reads_k_and_v_once_per_64_query_rows(dtype, head_dim, q_len, group):
    """q_len x group rows past 16 run two m16 tiles per block, and past 32 four (two row groups of
    warps sharing each K/V step): a block of 32 or 64 rows reads each K/V row of its keys once (so
    q_len 8 reads the live rows once at GQA 4 and at GQA 8), where one tile per block read them once
    per 16 rows."""
    lengths = [200, 37]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=256, batch=2, dtype=dtype)
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0, num_splits=2)
    rows = q_len * group
    block_rows = 32 if rows <= 32 else 64
    # each block reads keys [0, its last query's position]
    per_block = [min(spec.max_seq, n + (min(first + block_rows, rows) - 1) // group + 1)
                 for n in lengths for first in range(0, rows, block_rows)]
    for array in (cache.k, cache.v):
        loaded = t.launches[0].of(array).bytes_loaded
        assert loaded == sum(per_block) * spec.n_kv_heads * head_dim * spec.itemsize
        if rows <= 64:   # one block: each live row once
            assert loaded == sum(n + q_len for n in lengths) * spec.n_kv_heads * head_dim * spec.itemsize


# (dtype, io_dtype, head_dim): attention.cu (float32 at 8), attention_f32.cu at each instance,
# attention_mma.cu for float16 and bfloat16, and its fp8 form
STORE_CASES = [("float32", "", 8), ("float32", "", 32), ("float32", "", 64), ("float32", "", 128),
               ("float32", "", 256), ("float16", "", 64), ("bfloat16", "", 128), ("float8_e4m3", "float16", 64)]


@pytest.mark.parametrize("dtype, io_dtype, head_dim", STORE_CASES, ids=lambda v: str(v) or "-")
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_stores_each_output_and_each_splits_partials_once(dtype, io_dtype, head_dim, q_len, num_splits):
    """Each query row's output is stored once (by the merge, when split), and each split stores each
    row's partial output, max and sum once, empty splits included (sequence 1 has a single key):
    one lane per row, not every thread that holds its value. Each block counts once on its tile's
    counter and never stores to it."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=300, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    cache, q = cache_and_zero_queries(spec, [290, 0], q_len, 4)
    with testing.traffic(cache) as t:
        out = cupykv.attention(q, cache, 0, num_splits=num_splits)
    launch, = t.launches
    rows = 2 * q_len * 8
    written = launch.of(out)
    assert written.bytes_stored == out.nbytes == rows * head_dim * out.itemsize
    assert written.touched("store").all()
    if num_splits == 1:
        return
    for index, floats_per_row in ((1, head_dim), (2, 1), (3, 1)):   # partial_out, partial_max, partial_sum
        partial = launch.argument(index)
        assert partial.bytes_stored == num_splits * rows * floats_per_row * 4, (index, partial.bytes_stored)
        assert partial.touched("store").sum() == num_splits * rows * floats_per_row * 4, index
    counters = launch.argument(4)
    assert counters.counts("atomic").accesses == launch.grid[0] * launch.grid[1]
    assert counters.bytes_stored == 0


# (dtype, io_dtype, head_dim) of the staged kernels: attention_f32.cu at each instance and padded (24 on
# 32), attention_mma.cu at each instance and padded (40 on 64), and its fp8 form
STAGED_CASES = [("float32", "", 32), ("float32", "", 64), ("float32", "", 128), ("float32", "", 256),
                ("float32", "", 24), ("float16", "", 64), ("bfloat16", "", 96), ("float16", "", 128),
                ("bfloat16", "", 256), ("float16", "", 40), ("float8_e4m3", "bfloat16", 64)]


@pytest.mark.parametrize("dtype, io_dtype, head_dim", STAGED_CASES, ids=lambda v: str(v) or "-")
@pytest.mark.parametrize("window, splits, keys_per_block", [
    (40, dict(num_splits=1), [40]),                 # keys [260, 300): a range far from key 0
    (None, dict(split_keys=128), [128, 128, 44]),   # [0, 128), [128, 256), [256, 300)
    (200, dict(split_keys=128), [28, 128, 44]),     # the window starts inside the first split
], ids=["window", "split_keys", "window-split_keys"])
def test_each_block_copies_the_steps_of_its_own_keys_and_no_more(dtype, io_dtype, head_dim, window, splits,
                                                                 keys_per_block):
    """A staged kernel's block copies ceil(keys / step keys) steps of K and V into its stages, whole
    (zero-filled past its keys and past a padded head's dims), and none beyond them. A step count
    taken from where the range ends instead of how long it is would copy and score empty steps: the
    output and the global traffic would not change, so only the shared-memory stores show it. The
    copies that fill with zeros read nothing: the global loads are the attended rows' bytes, once.
    One tile (q_len 1, GQA 4) at position 299 of 300."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=300, batch=1, dtype=dtype,
                            io_dtype=io_dtype)
    cache, q = cache_and_zero_queries(spec, [299], 1, 4)
    with testing.traffic(cache, banks=True) as t:
        cupykv.attention(q, cache, 0, window=window, **splits)
    launch, = t.launches
    assert launch.grid[1] == len(keys_per_block)
    if dtype == "float32":
        instance = attention_f32_head_dim(dtype, head_dim)
        step_keys = StagedInstance(instance).step_keys
    else:
        instance = attention_mma_head_dim(dtype, head_dim)
        step_keys = KERNELS["attention_mma"].constants("attention_mma_tiling")["kStepKeys"]
    assert launch.kernel.startswith("cupykv_attention_f32" if dtype == "float32" else "cupykv_attention_mma")
    steps = sum(-(-keys // step_keys) for keys in keys_per_block)
    copied = sum(s.bytes for s in launch.shared_sites if s.kind == "store" and s.site.startswith("async_copy.cuh"))
    assert copied == steps * 2 * step_keys * instance * spec.itemsize
    assert_reads_exactly_the_attended_rows(launch, cache, 0, [299], 1, 4, window)


class PatchedBackend(EmulatorBackend):
    """The emulator backend with one line of one kernel file replaced before it is compiled.

    ``target`` is an op (its ``.cu`` file) or a header in cupykv/kernels: a patched header is
    written in place of its ``#include`` line in every source that includes it. ``only``: the
    instances a patched source is compiled for (all of its file's by default; the tensor-core file
    has 55, which take the emulator's compiler half a minute).
    """

    def __init__(self, target, old, new, only=None):
        super().__init__()
        self.filename = target if target.endswith(".cuh") else KERNELS[target].filename
        self.old, self.new, self.only = old, new, only

    def _patched(self, text, where):
        assert text.count(self.old) == 1, f"{self.old!r} moved in {where}; update the patch"
        return text.replace(self.old, self.new)

    def _compile(self, filename, source, instances):
        include = f'#include "{self.filename}"'
        if filename == self.filename:
            source = self._patched(source, filename)
        elif include in source:
            header = (Path(KERNEL_DIR) / self.filename).read_text().replace("#pragma once", "")
            source = source.replace(include, self._patched(header, self.filename))
        else:
            return super()._compile(filename, source, instances)
        if self.only is not None:
            instances = [instance for instance in instances if instance in self.only]
        return super()._compile(filename, source, instances)


# the end of a tile's keys, in the header both attention kernels include
KV_END = "const int kv_end = min(max_seq, length + last_query + 1);"


@pytest.mark.parametrize("dtype", ["float16", "float32"], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("new", ["const int kv_end = max_seq;",
                                 "const int kv_end = min(max_seq, length + last_query + 2);"],
                         ids=["whole-axis", "one-row-too-far"])
def test_a_planted_over_read_in_attention_is_caught(new, dtype):
    """A kernel that reads past the live rows computes the same output (the scores of rows
    past a query are masked), so only the accounting sees it."""
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, max_seq=40, batch=2, dtype=dtype)
    outputs = []
    launched = attention_kernel(dtype, 64, query_rows=2).instance   # q_len 1 at GQA 2
    for backend in (EmulatorBackend(), PatchedBackend("attention_keys.cuh", KV_END, new, only=(launched,))):
        rng = np.random.default_rng(3)
        cache = cupykv.KVCache(spec, backend=backend)
        k = backend.asarray(rng.standard_normal((2, 9, 2, 64)).astype(dtype))
        cache.append(1, k, k)
        cache.advance([9, 4])
        q = backend.asarray(rng.standard_normal((2, 1, 4, 64)).astype(dtype))
        with testing.traffic(cache) as t:
            outputs.append(np.asarray(cupykv.attention(q, cache, 1)))
        check = lambda: assert_reads_exactly_the_attended_rows(  # noqa: E731
            only_launch(t), cache, 1, [9, 4], 1, 2, None)
        if isinstance(backend, PatchedBackend):
            with pytest.raises(AssertionError, match="read .* bytes outside the attended rows"):
                check()
        else:
            check()
    assert np.array_equal(outputs[0], outputs[1])


# ---- a tail that faults -----------------------------------------------------------------
def test_a_protected_tail_makes_a_whole_axis_read_fault():
    """K and V rows past the live ones on PROT_NONE pages: the real kernel runs, a whole-axis
    read stops at the first row past them with a report naming the kernel and the element."""
    # one row of K is 64 float32 = 256 bytes; 32 rows (31 committed + 1 pending) fill 2 pages
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=64, max_seq=64, batch=1, dtype="float32")
    live = 32
    results = []
    for backend in (EmulatorBackend(), PatchedBackend("attention_keys.cuh", KV_END, "const int kv_end = max_seq;")):
        rng = np.random.default_rng(5)
        cache = cupykv.KVCache(spec, backend=backend)
        k = backend.asarray(rng.standard_normal((1, live, 1, 64)).astype(np.float32))
        cache.append(0, k, k)
        cache.advance(live - 1)
        q = backend.asarray(rng.standard_normal((1, 1, 2, 64)).astype(np.float32))
        tail = live * 64 * 4
        with E.protected(cache.k, tail), E.protected(cache.v, tail):
            if isinstance(backend, PatchedBackend):
                with pytest.raises(E.EmulatorFault) as caught:
                    cupykv.attention(q, cache, 0)
            else:
                results.append(np.asarray(cupykv.attention(q, cache, 0)))
    message = str(caught.value)
    assert message.startswith("kernel 'cupykv_attention_f32<64>' block (0,0,0) thread (")
    # the staged kernel reads K and V rows by cp.async: the fault is one lane's 16-byte copy, reported
    # at the copy's call site
    found = re.search(r"read of protected bytes of argument \d+ at element (\d+) \(0, 0, (\d+), 0, (\d+)\) "
                      r"\(byte offset \d+; bytes \[8192, 16384\) are protected by emulator.protected\(\); "
                      r"float32 array of shape \(1, 1, 64, 1, 64\).* at async_copy.cuh:\d+ \(inlined into "
                      r"attention_f32.cu:\d+\)", message)
    assert found, message
    row, column = int(found.group(2)), int(found.group(3))
    assert int(found.group(1)) == row * 64 + column and column % 4 == 0
    assert row >= live
    assert np.isfinite(results[0]).all()


@pytest.mark.parametrize("start", [0, 5, 8, 13])
def test_the_bytes_touched_of_a_view_are_its_own_at_any_offset_in_its_buffer(start):
    """A view starting ``start`` floats into its buffer (a sector phase of 0 or 20 bytes, from the bit
    ``8 * phase`` of the counter's mask on): ``touched`` gives exactly the bytes of the even elements the
    kernel read, and ``sectors_loaded`` the 32-byte sectors of the buffer they lie in."""
    src = ("__global__ void evens(const float* x, float* y, int n) {\n"
           "  for (int i = 2 * threadIdx.x; i < n; i += 2 * blockDim.x) y[i / 2] = x[i];\n}\n")
    evens = E.Module(src, ["evens"], filename="evens.cu").get_function("evens")
    base = E.asarray(np.arange(64, dtype=np.float32))
    view, y = base[start:start + 40], E.zeros(20, np.float32)
    with E.traffic() as t:
        evens(1, 32, (view, y, np.int32(40)))
    read = t.launches[0].of(view)
    want = np.repeat(np.arange(40) % 2 == 0, 4)
    assert np.array_equal(read.touched("load"), want) and not read.touched("store").any()
    in_buffer = 4 * start + np.flatnonzero(want)
    assert read.sectors_loaded == len(np.unique(in_buffer // 32))
    assert np.asarray(y).tolist() == np.asarray(view)[::2].tolist()


def peek_kernel():
    """``peek(x, y, i)``: y[0] = x[i] (float32), from peek.cu, whose line 1 is the read."""
    src = "__global__ void peek(const float* x, float* y, int i) { y[0] = x[i]; }\n"
    return E.Module(src, ["peek"], filename="peek.cu").get_function("peek")


def test_protected_checks_its_range():
    a = E.zeros((4, 1024), np.float32)   # 16 KiB: 4 pages, page-aligned
    with pytest.raises(ValueError, match="not on a page boundary.* 4096 and 8192"):
        with E.protected(a, 5000):
            pass
    with pytest.raises(ValueError, match="not inside"):
        with E.protected(a, 0, 20480):
            pass
    b = E.zeros(2046, np.float32)   # 8184 bytes: the buffer starts on a page, its 8 bytes of padding end on one
    with pytest.raises(ValueError, match="not inside"):
        with E.protected(b, 4096, 8192):
            pass
    with E.protected(a, 8192):
        a[0, 0] = 1.0   # the live part stays usable
    a[3, 0] = 2.0       # and the tail again after the block
    assert a[3, 0] == 2.0
    with pytest.raises(ValueError, match="not in guarded emulator memory"):
        with E.protected(np.zeros(4096, np.float32), 0):
            pass
    with E.protected(a, 0), E.protected(a, 4096, 4096):   # the whole buffer; an empty range
        pass
    view = a.reshape(-1)[256:]   # 1024 bytes into its buffer: offsets count from the view's own start
    with E.protected(view, 3072, 7168):
        view[0] = 3.0
    with pytest.raises(ValueError, match="start = 1024 is not on a page boundary.* -1024 and 3072"):
        with E.protected(view, 1024):
            pass
    assert a[0, 256] == 3.0


def test_a_fault_names_the_protected_range_of_its_own_block():
    """Ranges protected one after the other: a fault in the second names the second's bytes, not
    the first's (whose block has ended)."""
    peek = peek_kernel()
    a, y = E.zeros((4, 1024), np.float32), E.zeros(1, np.float32)
    with E.protected(a, 8192):
        pass
    with E.protected(a, 4096):
        with pytest.raises(E.EmulatorFault, match=re.escape("bytes [4096, 16384) are protected")):
            peek(1, 1, (a, y, np.int32(3000)))



@pytest.mark.parametrize("shape, index", [((4, 1024), " (2, 5)"), ((4096,), ""), ((2, 2, 1024), " (1, 0, 5)")])
def test_a_read_of_protected_bytes_names_the_element_and_its_index(shape, index):
    """The report gives the flat element and, for an array of two dimensions or more, its index."""
    peek = peek_kernel()
    a, y = E.zeros(shape, np.float32), E.zeros(1, np.float32)
    with E.protected(a, 8192):
        peek(1, 1, (a, y, np.int32(2047)))   # the last float before the protected pages
        reported = re.escape(f"read of protected bytes of argument 0 at element 2053{index} (byte offset 8212; "
                             f"bytes [8192, 16384) are protected by emulator.protected(); float32 array of "
                             f"shape {shape}")
        with pytest.raises(E.EmulatorFault, match=reported + ".* at peek.cu:1"):
            peek(1, 1, (a, y, np.int32(2053)))

# ---- append and the length ops ----------------------------------------------------------
@st.composite
def append_cases(draw):
    spec = draw(testing.specs(max_layers=2, kv_heads=(1, 2), head_dims=(8, 64), max_seqs=(4, 16)))
    return (spec, draw(testing.lengths(spec)), draw(st.integers(1, 6)), draw(st.integers(0, spec.n_layers - 1)),
            draw(st.booleans()), draw(st.booleans()))


def assert_flags_and_positions_stored_once(launch, cache, positions_out, out_of_range):
    """One thread per row stores its sequence's overflow flag (rows out of range only) and its
    returned position: each such word exactly once, not once per thread of the row's block.
    ``out_of_range``: bool ``[batch, n_new]``."""
    flags = launch.of(cache.overflow)
    assert flags.touched("store").reshape(-1, 4).any(axis=1).tolist() == out_of_range.any(axis=1).tolist()
    assert flags.bytes_stored == 4 * int(out_of_range.sum())
    assert flags.bytes_loaded == 0
    if positions_out is not None:
        returned = launch.of(positions_out)
        assert returned.touched("store").all() and returned.bytes_stored == positions_out.nbytes


@settings(max_examples=EXAMPLES)
@given(case=append_cases())
def test_append_writes_exactly_its_rows_and_reads_nothing_of_the_cache(case):
    spec, lengths, n_new, layer, rope, return_positions = case
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance(lengths)
    k, v = (cache._backend.zeros((spec.batch, n_new, spec.n_kv_heads, spec.head_dim),
                                 cache._backend.storage_dtype(spec.dtype)) for _ in "kv")
    positions_out = cache._backend.zeros((spec.batch, n_new), np.int32) if return_positions else None
    with testing.traffic(cache) as t:
        cache.append(layer, k, v, rope=cupykv.Rope() if rope else None, positions_out=positions_out)
    launch = only_launch(t)
    written = [(min(n, spec.max_seq), min(n + n_new, spec.max_seq)) for n in lengths]
    want = row_bytes(spec, layer, written)
    for array in (cache.k, cache.v):
        arg = launch.of(array)
        assert arg.counts("load").accesses == 0
        assert np.array_equal(arg.touched("store"), want)
        assert arg.bytes_stored == want.sum()   # every byte once
    out_of_range = np.array([[n + i >= spec.max_seq for i in range(n_new)] for n in lengths])
    assert_flags_and_positions_stored_once(launch, cache, positions_out, out_of_range)
    assert launch.of(cache.lengths).bytes_stored == 0


@st.composite
def write_cases(draw):
    spec = draw(testing.specs(max_layers=2, kv_heads=(1, 2), head_dims=(8, 64), max_seqs=(4, 16)))
    n_new = draw(st.integers(1, 6))
    # positions from a narrow range around the capacity: twins, and rows past either end, are common
    positions = draw(st.lists(st.lists(st.integers(-2, spec.max_seq + 1), min_size=n_new, max_size=n_new),
                              min_size=spec.batch, max_size=spec.batch))
    return spec, np.array(positions, np.int32), draw(st.integers(0, spec.n_layers - 1)), draw(st.booleans())


@settings(max_examples=EXAMPLES)
@given(case=write_cases())
def test_write_stores_each_positions_last_row_once_and_each_flag_once(case):
    spec, positions, layer, return_positions = case
    cache = cupykv.KVCache(spec, backend="emulator")
    backend = cache._backend
    n_new = positions.shape[1]
    k, v = (backend.zeros((spec.batch, n_new, spec.n_kv_heads, spec.head_dim), backend.storage_dtype(spec.dtype))
            for _ in "kv")
    device_positions = backend.asarray(positions)
    positions_out = backend.zeros((spec.batch, n_new), np.int32) if return_positions else None
    with testing.traffic(cache) as t:
        cache.write(layer, device_positions, k, v, positions_out=positions_out)
    launch = only_launch(t)
    want = np.zeros(int(np.prod(spec.shape)) * spec.itemsize, bool)
    for b, row in enumerate(positions):
        for pos in {int(p) for p in row if 0 <= p < spec.max_seq}:
            want |= row_bytes(spec, layer, [(pos, pos + 1) if c == b else (0, 0) for c in range(spec.batch)])
    for array in (cache.k, cache.v):
        arg = launch.of(array)
        assert arg.counts("load").accesses == 0
        assert np.array_equal(arg.touched("store"), want)
        assert arg.bytes_stored == want.sum()   # a position's rows once, however many rows name it
    assert_flags_and_positions_stored_once(launch, cache, positions_out,
                                           (positions < 0) | (positions >= spec.max_seq))


@pytest.mark.parametrize("op", ["advance", "advance per sequence", "truncate", "reset", "reset slots"])
def test_length_ops_touch_only_lengths_flags_and_their_input(op):
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=16, batch=3)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance([5, 16, 2])
    device_steps = cache.to_device(np.array([1, 2, 3], np.int32))
    call = {"advance": lambda: cache.advance(2), "advance per sequence": lambda: cache.advance(device_steps),
            "truncate": lambda: cache.truncate([1, 3, 0]), "reset": lambda: cache.reset(),
            "reset slots": lambda: cache.reset([2])}[op]
    with testing.traffic(cache) as t:
        call()
    launch = only_launch(t)
    for array in (cache.k, cache.v):
        with pytest.raises(KeyError):
            launch.of(array)
    named = {memory.byte_extent(a) for a in (cache.lengths, cache.overflow, device_steps)}
    for arg, extent in zip(launch.arguments, launch.extents):   # the rest: the cache's [batch] staging
        assert extent in named or (arg.type.rstrip("*").split()[-1] == "int" and arg.nbytes == 4 * spec.batch)
    # advance and truncate read and then write lengths[b] (a read-modify-write): the counter sees
    # both the load and the store (before the emulator's ThreadSanitizer instrumentation it saw the
    # load only, and this test held 12 bytes loaded and none stored); reset only stores.
    lengths = launch.of(cache.lengths)
    loads, stores = lengths.touched("load").reshape(3, 4), lengths.touched("store").reshape(3, 4)
    if op.startswith("reset"):
        assert not loads.any() and stores.all(axis=1).tolist() == ([False, False, True] if op == "reset slots"
                                                                   else [True, True, True])
    else:
        assert loads.all() and stores.all()
        assert lengths.bytes_loaded == lengths.bytes_stored == 12   # each sequence's length once
    assert lengths.bytes_loaded + lengths.bytes_stored == {"reset": 12, "reset slots": 4}.get(op, 24)


# ---- linear -------------------------------------------------------------------------------
@st.composite
def linear_cases(draw):
    # out_features odd or not and not a multiple of the 4 a block owns; in_features odd, or not a
    # multiple of the 32 lanes x 4 vectors a warp loads ahead, or splitting unevenly between two warps
    return (draw(st.integers(1, 16)), draw(st.sampled_from((8, 64, 72, 13, 1000, 4104))), draw(st.integers(1, 25)),
            draw(st.sampled_from(("float32", "float16", "bfloat16"))))


def linear_launch(rows, in_features, out_features, dtype):
    """The traffic of one ``linear`` of zeros on the emulator: (launch, x, weight, out)."""
    backend = EmulatorBackend()
    storage = backend.storage_dtype(dtype)
    x = backend.zeros((rows, in_features), storage)
    weight = backend.zeros((out_features, in_features), storage)
    with testing.traffic("emulator") as t:
        out = ops.linear(x, weight, backend=backend)
    return only_launch(t), x, weight, out


def linear_traffic(rows, in_features, out_features, dtype):
    launch, _, weight, _ = linear_launch(rows, in_features, out_features, dtype)
    return launch.of(weight), weight


@settings(max_examples=EXAMPLES)
@given(case=linear_cases())
def test_linear_reads_the_weight_exactly_once(case):
    w, weight = linear_traffic(*case)
    assert w.touched("load").all()
    assert w.bytes_loaded == weight.nbytes
    assert w.sectors_loaded == -(-weight.nbytes // 32)


@pytest.mark.parametrize("out_features", [9, ops.LINEAR_SPLIT_K_BELOW_OUTS + 1], ids=["split-k", "whole-k"])
def test_linear_reads_the_weight_exactly_once_with_an_odd_out_features(out_features):
    """A pair of outputs past out_features loads nothing (it used to repeat the last row)."""
    w, weight = linear_traffic(3, 64, out_features, "float16")
    assert w.bytes_loaded == weight.nbytes


# (dtype, rows, in_features, out_features): the CUDA-core kernel (float32) on its vector path (64) and
# its scalar one (13), split-k (9 outputs: the last block's second pair owns none) and whole-k (16385:
# three of the last block's four warps own none); the tensor-core kernel (16-bit) at 72 outputs (the
# last block's second slot starts at out_features), 9, and 40 with 11 rows (fragment rows 8..15).
WHOLE_K = ops.LINEAR_SPLIT_K_BELOW_OUTS + 1
LINEAR_SLOT_CASES = [("float32", 3, 64, 9), ("float32", 3, 13, 9), ("float32", 3, 64, WHOLE_K),
                     ("float32", 3, 13, WHOLE_K), ("float16", 3, 64, 72), ("bfloat16", 3, 64, 72),
                     ("float16", 3, 64, 9), ("bfloat16", 11, 256, 40)]


@pytest.mark.parametrize("dtype, rows, in_features, out_features", LINEAR_SLOT_CASES, ids=str)
def test_linear_reads_x_once_per_slot_of_outputs_and_nothing_past_them(dtype, rows, in_features, out_features):
    """Each warp slot that owns outputs (2 on CUDA cores, 8 on tensor cores) reads x once (its split-k
    parts a piece each) and its weight rows once; a slot past out_features reads nothing, a slot with
    fewer outputs than it could own loads no missing row, and each output is stored once."""
    launch, x, weight, out = linear_launch(rows, in_features, out_features, dtype)
    tensor_cores = dtype != "float32"
    assert launch.kernel.startswith("cupykv_linear_mma<" if tensor_cores else "cupykv_linear<"), launch.kernel
    outs_per_slot = 8 if tensor_cores else 2
    assert launch.of(weight).bytes_loaded == weight.nbytes
    assert launch.of(x).bytes_loaded == -(-out_features // outs_per_slot) * x.nbytes
    assert launch.of(out).bytes_stored == out.nbytes and launch.of(out).bytes_loaded == 0


# ---- graphs -------------------------------------------------------------------------------
def traffic_signature(launch, arrays):
    """What a launch did, independent of where the buffers live."""
    return (launch.kernel, launch.grid, launch.block,
            [(a.index, a.nbytes, a.bytes_loaded, a.bytes_stored, a.counts("atomic").bytes,
              a.touched("load").tobytes(), a.touched("store").tobytes()) for a in launch.arguments],
            [launch.of(a).index for a in arrays if memory.byte_extent(a) in launch.extents])


def test_a_graph_replay_moves_exactly_the_bytes_of_the_eager_step():
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, max_seq=256, batch=2, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend="emulator")
    backend = cache._backend
    storage = backend.storage_dtype(spec.dtype)
    cache.advance([7, 30])
    new = [backend.zeros((2, 1, 2, 64), storage) for _ in range(spec.n_layers)]
    q = backend.zeros((2, 1, 4, 64), storage)
    out = backend.zeros((2, 1, 4, 64), storage)

    def step():
        for layer in range(spec.n_layers):
            cache.append(layer, new[layer], new[layer])
            cupykv.attention(q, cache, layer, out=out, num_splits=2)
        cache.advance(1)

    graph = cupykv.capture(step)          # runs the step once: lengths [8, 31]
    arrays = [cache.k, cache.v, cache.lengths, cache.overflow, q, out, *new]
    with testing.traffic(cache) as eager:
        step()
    cache.truncate([8, 31])
    with testing.traffic(cache) as replayed:
        graph.replay()
    assert len(eager.launches) == len(replayed.launches) == graph.num_launches == 5   # 2 x (append, attention), advance
    for a, b in zip(eager.launches, replayed.launches):
        assert traffic_signature(a, arrays) == traffic_signature(b, arrays)


# ---- coalescing figures (measured on the CPU; not GPU figures) ------------------------------
def decode_attention(dtype, head_dim, layout, length=300, group=4):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=512, batch=2, dtype=dtype,
                            layout=layout)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance(length)
    q = cache._backend.zeros((2, 1, group * 2, head_dim), cache._backend.storage_dtype(dtype))
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0)
    needed = 2 * (length + 1) * 2 * head_dim * spec.itemsize   # batch x rows x kv heads x row bytes
    return only_launch(t), cache, needed


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("bfloat16", 64), ("float32", 64),
                                             ("float16", 96), ("float16", 80)])
def test_decode_attention_touches_only_the_sectors_it_needs(dtype, head_dim, layout):
    launch, cache, needed = decode_attention(dtype, head_dim, layout)
    for array in (cache.k, cache.v):
        c = launch.coalescing(arrays=[array], needed_bytes=needed)
        assert c.ratio <= 1.1, c          # design target; every row here is whole sectors: 1.0
        assert c.sectors == c.ideal_sectors


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim, sectors_per_request", [(128, 2408 / 151), (64, 1204 / 76), (256, 16.0),
                                                           (96, 1806 / 113), (80, 1505 / 113)])
def test_decode_attention_sectors_per_request_bf16(head_dim, sectors_per_request, layout):
    """The design figures of the bf16 decode path (kernels/attention_mma.cu, 301 live rows per
    sequence), for K and V alike, in both layouts.

    A warp copies a 16-key step with 16-byte cp.async: sixteen lanes on each 256-byte row at
    head_dim 128 (eight on each 128-byte row at 64), so a full request covers two (four) whole
    rows, 16 sectors, each requested once. 301 rows are 18 full steps and a last step of 13 rows.
    head_dim 128: 8 requests a step; the last step has 6 full ones, one of a live and a zero-filled
    row (8 sectors) and one of two zero-filled rows, which reads nothing:
    (18 x 8 x 16 + 6 x 16 + 8) / (18 x 8 + 7) = 2408 / 151.
    head_dim 64: 4 requests a step; the last step has 3 full ones and one with one live row (4
    sectors): (18 x 4 x 16 + 3 x 16 + 4) / (18 x 4 + 4) = 1204 / 76.
    head_dim 256: the whole warp copies one 512-byte row, 16 sectors; the 3 zero-filled rows of the
    last step read nothing, so every request is full: 301 x 16 / 301 = 16.
    head_dim 96: a row is 12 copies (6 sectors), and a warp's 32 copies run on across row ends: 512
    contiguous bytes of a step, 16 sectors. 6 requests a step; the last step's 13 live rows are 156
    copies: 4 full requests and one of 28 live copies (14 sectors), and a sixth of zero-filled rows
    only, which reads nothing: (18 x 6 x 16 + 4 x 16 + 14) / (18 x 6 + 5) = 1806 / 113.
    head_dim 80, padded onto the 96 instance: a row is 10 copies (5 sectors) in 12 copy slots, whose
    last two read nothing, so a warp's 32 slots hold 28, 26 and 26 live copies in turn (14, 13 and
    13 sectors; 8 rows every 3 requests), each sector still requested once. The last step's 13 live
    rows: 3 requests of 40 sectors, then 14 (rows 8, 9 and half of 10) and 11:
    (18 x 2 x 40 + 40 + 14 + 11) / (18 x 6 + 5) = 1505 / 113. More requests per byte than at 96, not
    more sectors.
    """
    launch, cache, needed = decode_attention("bfloat16", head_dim, layout)
    for array in (cache.k, cache.v):
        c = launch.coalescing(arrays=[array], needed_bytes=needed)
        assert c.sectors_per_request == pytest.approx(sectors_per_request) and c.requested_ratio == 1.0, c


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim, sectors_per_request",
                         [(256, 16.0), (128, 16.0), (64, 2408 / 151), (32, 1204 / 76)])
def test_decode_attention_sectors_per_request_float32(head_dim, sectors_per_request, layout):
    """The design figures of the float32 decode path (kernels/attention_f32.cu, 301 live rows per
    sequence), for K and V alike, in both layouts.

    The block copies a step with 16-byte cp.async, a warp instruction covering 512 contiguous bytes of
    rows: half a 1024-byte row at head_dim 256 (16-key steps), one 512-byte row at 128, two 256-byte
    rows at 64, four 128-byte rows at 32 (32-key steps). 301 rows are 9 full 32-key steps and a last
    step of 13 rows (18 and 13 at 256); zero-filled rows read nothing.
    head_dim 256 and 128: every request is all live: 16.
    head_dim 64: 16 requests a step; the last step has 6 full ones and one with one live row (8
    sectors): (9 x 16 x 16 + 6 x 16 + 8) / (9 x 16 + 7) = 2408 / 151.
    head_dim 32: 8 requests a step; the last step has 3 full ones and one with one live row (4
    sectors): (9 x 8 x 16 + 3 x 16 + 4) / (9 x 8 + 4) = 1204 / 76. (The kernel they replaced read
    K a 16-byte piece of its own row per lane, 30.1 sectors a request, each sector requested twice,
    and V 4 bytes a lane.)
    """
    launch, cache, needed = decode_attention("float32", head_dim, layout)
    for array in (cache.k, cache.v):
        c = launch.coalescing(arrays=[array], needed_bytes=needed)
        assert c.sectors_per_request == pytest.approx(sectors_per_request) and c.requested_ratio == 1.0, c


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_weight_loads_are_coalesced(dtype):
    """16-byte vectors, 32 lanes on 512 contiguous bytes of a row: 16 sectors per request,
    each weight sector touched once."""
    w, weight = linear_traffic(4, 1024, 64, dtype)
    assert w.sectors_loaded <= 1.05 * weight.nbytes / 32
    assert w.counts("load").sectors_per_request == 16.0
    assert w.counts("load").request_sectors == weight.nbytes // 32


@pytest.mark.parametrize("dtype, vocab, vector_bytes", [("float32", 1000, 16), ("float16", 1000, 16), ("float32", 999, 4)])
def test_argmax_reads_aligned_rows_in_16_byte_loads(dtype, vocab, vector_bytes):
    """A row whose length is whole 16-byte vectors is read one uint4 a lane (a quarter, or an eighth, of the
    loads); another row, element by element. The result does not show which path ran: the count does."""
    backend = EmulatorBackend()
    logits = backend.asarray(np.random.default_rng(0).standard_normal((2, vocab)).astype(dtype))
    with testing.traffic(backend) as t:
        ops.argmax(logits)
    (launch,) = t.launches
    loads = launch.of(logits).counts("load")
    assert (loads.bytes, loads.accesses) == (logits.nbytes, logits.nbytes // vector_bytes), t.report()


@pytest.mark.parametrize("dtype, hidden, vector_bytes", [("float32", 1024, 16), ("bfloat16", 576, 16),
                                                          ("float32", 1023, 4), ("bfloat16", 577, 2)])
def test_rmsnorm_reads_and_writes_aligned_rows_in_16_byte_accesses(dtype, hidden, vector_bytes):
    """Both passes over x, the weight and the output move whole uint4 vectors when the row is whole
    16-byte vectors (and every array 16-byte aligned); element by element otherwise. x is read twice
    (the sum of squares, then the scaled write), the weight once per row."""
    backend, rows = EmulatorBackend(), 3
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((rows, hidden)).astype(host_dtype(dtype)))
    weight = backend.asarray(rng.standard_normal(hidden).astype(host_dtype(dtype)))
    out = backend.zeros((rows, hidden), x.dtype)
    with testing.traffic(backend) as t:
        ops.rmsnorm(x, weight, 1e-5, out=out)
    (launch,) = t.launches
    x_loads, weight_loads = launch.of(x).counts("load"), launch.of(weight).counts("load")
    stores = launch.of(out).counts("store")
    assert (x_loads.bytes, x_loads.accesses) == (2 * x.nbytes, 2 * x.nbytes // vector_bytes), t.report()
    assert (weight_loads.bytes, weight_loads.accesses) == (rows * weight.nbytes, rows * weight.nbytes // vector_bytes)
    assert (stores.bytes, stores.accesses) == (out.nbytes, out.nbytes // vector_bytes), t.report()


def _aligned_or_shifted(backend, host, shift):
    """``host`` on the device, 16-byte aligned, or ``shift`` elements into a fresh allocation (misaligned)."""
    buffer = backend.zeros((host.size + shift,), host.dtype)
    view = buffer[shift:].reshape(host.shape)
    view[...] = host
    return view


@pytest.mark.parametrize("op", ["add", "silu_mul"])
@pytest.mark.parametrize("dtype, n, shift, vector_bytes", [
    ("float32", 1024, 0, 16), ("float16", 1000, 0, 16), ("float32", 1023, 0, 4), ("float16", 1001, 0, 2),
    ("float32", 1024, 1, 4),   # whole vectors, but b starts 4 bytes past a 16-byte boundary
], ids=["f32-aligned", "f16-aligned", "f32-odd", "f16-odd", "f32-misaligned"])
def test_the_elementwise_ops_move_aligned_arrays_in_16_byte_accesses(op, dtype, n, shift, vector_bytes):
    backend = EmulatorBackend()
    rng = np.random.default_rng(1)
    a = backend.asarray(rng.standard_normal(n).astype(host_dtype(dtype)))
    b = _aligned_or_shifted(backend, rng.standard_normal(n).astype(host_dtype(dtype)), shift)
    out = backend.zeros((n,), a.dtype)
    with testing.traffic(backend) as t:
        getattr(ops, op)(a, b, out=out)
    (launch,) = t.launches
    for array, kind in ((a, "load"), (b, "load"), (out, "store")):
        counts = launch.of(array).counts(kind)
        assert (counts.bytes, counts.accesses) == (array.nbytes, array.nbytes // vector_bytes), t.report()


@pytest.mark.parametrize("dtype, hidden, shift, vector_bytes", [
    ("float32", 64, 0, 16), ("bfloat16", 72, 0, 16), ("float32", 63, 0, 4), ("float32", 64, 2, 4)],
    ids=["f32-aligned", "bf16-aligned", "f32-odd", "f32-misaligned-table"])
def test_embedding_copies_aligned_rows_in_16_byte_accesses(dtype, hidden, shift, vector_bytes):
    backend, vocab = EmulatorBackend(), 5
    rng = np.random.default_rng(2)
    table = _aligned_or_shifted(backend, rng.standard_normal((vocab, hidden)).astype(host_dtype(dtype)), shift)
    ids = backend.asarray(np.array([4, 0, -1, 4, 5], np.int32))   # two ids out of range: zero rows, no reads
    out = backend.zeros((5, hidden), table.dtype)
    error_flag = backend.zeros(1, np.int32)
    with testing.traffic(backend) as t:
        ops.embedding(ids, table, out=out, error_flag=error_flag)
    (launch,) = t.launches
    row_bytes = hidden * table.dtype.itemsize
    loads, stores = launch.of(table).counts("load"), launch.of(out).counts("store")
    assert (loads.bytes, loads.accesses) == (3 * row_bytes, 3 * row_bytes // vector_bytes), t.report()
    assert (stores.bytes, stores.accesses) == (out.nbytes, out.nbytes // vector_bytes), t.report()
    flag = launch.of(error_flag)   # one thread of each bad row's block sets it: two stores, not one a thread
    assert (flag.bytes_stored, flag.bytes_loaded) == (8, 0), t.report()
