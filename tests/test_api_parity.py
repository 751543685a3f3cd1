"""The calls of the two founding designs (issue 19), each against the reference.

GraphSafeKV gave shared lengths, writes at device positions, set lengths and
layer views; abaddon's KvCache gave capacity queries, live views, the
footprint and the position a write went to. Writes are compared with the
reference over the whole cache, bit for bit (within 1 ulp where rope rotated
the keys, as for append). Calls that take device arrays are replayed from a
captured graph; calls that read the host are refused inside one. Bad input
gets a named error and leaves the cache unchanged.
"""
import logging

import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupykv
from cupykv import reference, testing
from backends import BACKENDS

SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=6, batch=3, dtype="float16")


def pair(spec, backend, lengths=None, seed=0, rope=None):
    """A backend cache and its reference twin with the same committed rows (``lengths``, default none)."""
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    if lengths is not None:
        testing.fill(cache, oracle, lengths, np.random.default_rng(seed), rope=rope)
    return cache, oracle


def rows(spec, n_new, rng):
    """Random K and V rows ``[batch, n_new, n_kv_heads, head_dim]`` on the host."""
    shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    return testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)


def host(cache, array):
    return cache._backend.to_host(array)


def snapshot(cache):
    return [testing.bits(testing.to_numpy(a, cache.spec)).copy() for a in (cache.k, cache.v)] + \
        [host(cache, cache.lengths).copy(), host(cache, cache.overflow).copy()]


# -- write ------------------------------------------------------------------------------------------
@st.composite
def write_cases(draw):
    spec = draw(testing.specs(max_seqs=(1, 2, 5, 16)))
    lengths = draw(testing.lengths(spec))
    n_new = draw(st.integers(1, min(6, spec.max_seq + 4)))   # distinct values in -2..max_seq+1
    # distinct positions per sequence, some outside 0..max_seq-1 (those rows overflow)
    one = st.lists(st.integers(-2, spec.max_seq + 1), min_size=n_new, max_size=n_new, unique=True)
    positions = draw(st.lists(one, min_size=spec.batch, max_size=spec.batch))
    rope = draw(st.none() | st.just(cupykv.Rope(theta=10000.0))) if spec.head_dim % 2 == 0 else None
    one_row_form = n_new == 1 and draw(st.booleans())   # positions [batch] instead of [batch, 1]
    return spec, lengths, positions, one_row_form, rope, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=write_cases())
def test_write_matches_reference_over_the_whole_cache(backend, case):
    spec, lengths, positions, one_row_form, rope, seed = case
    rng = np.random.default_rng(seed)
    cache, oracle = pair(spec, backend, lengths, seed)
    positions = np.array(positions, np.int32)
    if one_row_form:
        positions = positions[:, 0].copy()
    k, v = rows(spec, positions.shape[1] if positions.ndim == 2 else 1, rng)
    got = cache.write(1 % spec.n_layers, cache.to_device(positions), cache.to_device(k), cache.to_device(v),
                      rope=rope, return_positions=True)
    want = oracle.write(1 % spec.n_layers, positions, k, v, rope=rope, return_positions=True)
    testing.assert_matches_reference(cache, oracle, rope_used=rope is not None)
    assert got.shape == want.shape == positions.shape
    assert np.array_equal(host(cache, got), want)
    assert np.array_equal(want, np.where((positions >= 0) & (positions < spec.max_seq), positions, -1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_with_repeated_device_positions_keeps_the_last_row(backend, layout):
    # A device array cannot be checked on the host: the later row at a position wins, as if written one by one.
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=8, max_seq=6, batch=2, dtype="bfloat16",
                            layout=layout)
    rng = np.random.default_rng(3)
    cache, oracle = pair(spec, backend, [2, 6])
    positions = np.array([[4, 1, 4, 9, 4], [0, 0, 5, -1, 5]], np.int32)
    k, v = rows(spec, 5, rng)
    out = cache.to_device(np.full((2, 5), 77, np.int32))
    assert cache.write(0, cache.to_device(positions), cache.to_device(k), cache.to_device(v),
                       rope=cupykv.Rope(), positions_out=out) is out
    for i in range(5):                        # the reference, one row at a time
        oracle.write(0, positions[:, i], k[:, i : i + 1], v[:, i : i + 1], rope=cupykv.Rope())
    testing.assert_matches_reference(cache, oracle, rope_used=True)
    assert host(cache, out).tolist() == [[-1, 1, -1, -1, 4], [-1, 0, -1, -1, 5]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threads", [1, 3, 1024])
def test_append_and_write_store_the_same_rows_at_any_block_size(backend, threads, monkeypatch):
    """append.cu and write.cu take any block size (the host launches 128): one thread stores a whole
    row, sets the overflow flag and the position written, and scans every later row for a twin; 3
    threads stride over rows of 3 * 10 elements and over later rows unevenly; 1024 leave most threads
    idle. Rows with rope and HND strides, twins at one position, rows past capacity."""
    monkeypatch.setattr(cupykv.cache, "_APPEND_THREADS", threads)
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=3, head_dim=10, max_seq=7, batch=3, dtype="bfloat16",
                            layout="HND")
    rng = np.random.default_rng(threads)
    rope = cupykv.Rope(theta=500.0)
    cache, oracle = pair(spec, backend, [0, 2, 5])
    positions = np.array([[4, 1, 4, 9, 4], [0, 0, 5, -1, 5], [6, 2, 3, 6, 7]], np.int32)
    k, v = rows(spec, 5, rng)
    written = cache.write(0, cache.to_device(positions), cache.to_device(k), cache.to_device(v), rope=rope,
                          return_positions=True)
    for i in range(5):                        # the reference, one row at a time: the last twin wins
        oracle.write(0, positions[:, i], k[:, i : i + 1], v[:, i : i + 1], rope=rope)
    testing.assert_matches_reference(cache, oracle, rope_used=True)
    assert host(cache, written).tolist() == [[-1, 1, -1, -1, 4], [-1, 0, -1, -1, 5], [-1, 2, 3, 6, -1]]

    cache, oracle = pair(spec, backend, [0, 5, 6])
    k, v = rows(spec, 3, rng)
    appended = cache.append(0, cache.to_device(k), cache.to_device(v), rope=rope, return_positions=True)
    oracle.append(0, k, v, rope=rope)
    testing.assert_matches_reference(cache, oracle, rope_used=True)
    assert host(cache, appended).tolist() == [[0, 1, 2], [5, 6, -1], [6, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_positions_at_the_ends_of_their_ranges(backend):
    """Host positions may be any kernel int, -2**31..2**31-1 (out of 0..max_seq-1 they overflow), and may
    repeat outside 0..max_seq-1 only: a repeat at 0 or at max_seq - 1 would overwrite a row of the same
    step, so it is refused, as the reference refuses it."""
    m = SPEC.max_seq
    cache, oracle = pair(SPEC, backend, [1, 2, 3])
    k, v = rows(SPEC, 2, np.random.default_rng(2))
    for positions in ([[-2**31, 2**31 - 1], [m, m], [-1, -1]], [[0, m - 1], [m + 5, m + 5], [-7, -7]]):
        assert cache.write(0, positions, cache.to_device(k), cache.to_device(v)) is None   # no positions asked for
        oracle.write(0, positions, k, v)
        testing.assert_matches_reference(cache, oracle)
    for positions, message in [
            ([[0, 0], [1, 2], [3, 4]], r"got positions\[0, 0\] = positions\[0, 1\] = 0$"),
            ([[1, 2], [m - 1, m - 1], [3, 4]], rf"got positions\[1, 0\] = positions\[1, 1\] = {m - 1}$"),
            ([[1, 2], [3, 4], [-2**31 - 1, 0]], r"got positions\[2, 0\] = -2147483649$")]:
        for twin, (new_k, new_v) in ((cache, (cache.to_device(k), cache.to_device(v))), (oracle, (k, v))):
            with pytest.raises(ValueError, match=r"^positions: expected .*" + message):
                twin.write(0, positions, new_k, new_v)
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_may_be_read_from_another_cache(backend):
    """append and write refuse rows that overlap the cache they write, not rows read from another cache
    (copying a prefix from one cache into another)."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=8, max_seq=6, batch=1, dtype="float16")
    source, _ = pair(spec, backend, [4])
    target = cupykv.KVCache(spec, backend=backend)
    k, v = source.k[0, :, 1:3], source.v[0, :, 1:3]   # [1, 2, n_kv_heads, head_dim] views of source's rows
    target.append(0, k, v)
    target.write(0, [[2, 3]], k, v)
    for name in ("k", "v"):
        copied, original = (testing.bits(testing.to_numpy(getattr(c, name), spec)) for c in (target, source))
        for rows in (slice(0, 2), slice(2, 4)):   # appended at 0, 1; written at 2, 3
            assert np.array_equal(copied[0, 0, rows], original[0, 0, 1:3]), (name, rows)
    with pytest.raises(ValueError, match=r"^k: expected an array that does not overlap the cache's k"):
        source.append(0, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_at_the_cache_lengths_is_append(backend):
    # positions = the cache's own lengths: one row per sequence at lengths[b], which is what append does
    rng = np.random.default_rng(4)
    cache, oracle = pair(SPEC, backend, [0, 5, 6])
    twin, _ = pair(SPEC, backend, [0, 5, 6])
    k, v = rows(SPEC, 1, rng)
    written = cache.write(0, cache.lengths, cache.to_device(k), cache.to_device(v), return_positions=True)
    appended = twin.append(0, twin.to_device(k), twin.to_device(v), return_positions=True)
    oracle.append(0, k, v)
    testing.assert_matches_reference(cache, oracle)
    testing.assert_matches_reference(twin, oracle)
    assert host(cache, written).tolist() == [0, 5, -1] and host(twin, appended).tolist() == [[0], [5], [-1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_host_positions_match_device_positions(backend):
    rng = np.random.default_rng(5)
    by_host, oracle = pair(SPEC, backend, [1, 2, 3])
    by_device, _ = pair(SPEC, backend, [1, 2, 3])
    positions = [[5, 0], [3, 6], [-7, 2]]
    k, v = rows(SPEC, 2, rng)
    by_host.write(1, positions, by_host.to_device(k), by_host.to_device(v))
    by_device.write(1, by_device.to_device(np.array(positions, np.int32)), by_device.to_device(k),
                    by_device.to_device(v))
    oracle.write(1, positions, k, v)
    testing.assert_matches_reference(by_host, oracle)
    testing.assert_matches_reference(by_device, oracle)
    assert host(by_host, by_host.overflow).tolist() == [0, 1, 1]


# -- append's positions ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_append_returns_the_positions_it_wrote(backend):
    rng = np.random.default_rng(6)
    cache, oracle = pair(SPEC, backend, [0, 4, 6])
    k, v = rows(SPEC, 3, rng)
    got = cache.append(1, cache.to_device(k), cache.to_device(v), return_positions=True)
    want = oracle.append(1, k, v, return_positions=True)
    assert np.array_equal(host(cache, got), want)
    assert want.tolist() == [[0, 1, 2], [4, 5, -1], [-1, -1, -1]]
    assert cache.append(1, cache.to_device(k), cache.to_device(v)) is None
    testing.assert_matches_reference(cache, oracle)


# -- set_lengths ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_set_lengths_grows_shrinks_clamps_and_flags_as_the_reference(backend):
    cache, oracle = pair(SPEC, backend, [2, 5, 1])
    for values in ([4, 0, 6], 3, [7, 6, 2**31 - 1], np.array([0, 1, 2], np.uint64), 0):
        cache.set_lengths(values)
        oracle.set_lengths(values)
        testing.assert_matches_reference(cache, oracle)
    assert oracle.overflow.tolist() == [True, False, True]
    device = cache.to_device(np.array([-5, 6, 9], np.int32))   # a negative device value becomes 0, unflagged
    cache.reset()
    cache.set_lengths(device)
    assert cache.lengths_host().tolist() == [0, 6, 6]
    assert host(cache, cache.overflow).tolist() == [0, 0, 1]


# -- shared lengths -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_caches_sharing_lengths_see_each_others_length_changes(backend):
    rng = np.random.default_rng(8)
    draft_spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=6, batch=3, layout="HND")
    target = cupykv.KVCache(SPEC, backend=backend)
    draft = cupykv.KVCache(draft_spec, backend=backend, lengths=target.lengths)
    assert draft.lengths is target.lengths and draft.shares_lengths and not target.shares_lengths
    shared = np.zeros(3, np.int32)
    target_ref, draft_ref = reference.KVCache(SPEC, lengths=shared), reference.KVCache(draft_spec, lengths=shared)
    assert draft_ref.lengths is target_ref.lengths is shared

    def both(name, *args):
        for cache, oracle in ((target, target_ref), (draft, draft_ref)):
            if name in ("append", "write"):
                k, v = rows(cache.spec, 2, rng)
                device = [cache.to_device(x) if isinstance(x, np.ndarray) else x for x in args]
                getattr(cache, name)(0, *device, cache.to_device(k), cache.to_device(v))
                getattr(oracle, name)(0, *args, k, v)

    both("append")
    draft.advance(2)                          # the draft commits for both
    draft_ref.advance(2)
    both("write", np.array([[2, 3], [5, 4], [0, 1]], np.int32))
    target.set_lengths([4, 6, 2])
    target_ref.set_lengths([4, 6, 2])
    both("append")                            # sequence 1 overflows in both caches
    draft.truncate([3, 5, 2])
    draft_ref.truncate([3, 5, 2])
    target.advance([0, 1, 0])
    target_ref.advance([0, 1, 0])
    target.reset([1])                          # zeroes the shared length, clears only the target's flag
    target_ref.reset([1])
    for cache, oracle in ((target, target_ref), (draft, draft_ref)):
        testing.assert_matches_reference(cache, oracle)
    assert target.lengths_host().tolist() == draft.lengths_host().tolist() == [3, 0, 2]
    assert host(target, target.overflow).tolist() == [0, 0, 0]
    assert host(draft, draft.overflow).tolist() == [0, 1, 0]
    scales = lambda spec: 2 * 4 * spec.n_layers * spec.n_kv_heads   # float32 K and V scales [n_layers, n_kv_heads]
    assert draft.nbytes == target.nbytes - SPEC.nbytes - scales(SPEC) + draft_spec.nbytes + scales(draft_spec) - 4 * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_lengths_in_a_captured_step(backend):
    rng = np.random.default_rng(9)
    first = cupykv.KVCache(SPEC, backend=backend)
    second = cupykv.KVCache(SPEC, backend=backend, lengths=first.lengths)
    shared = np.zeros(3, np.int32)
    first_ref, second_ref = reference.KVCache(SPEC, lengths=shared), reference.KVCache(SPEC, lengths=shared)
    k, v = rows(SPEC, 1, rng)
    dk, dv = first.to_device(k), first.to_device(v)

    def step():
        first.append(0, dk, dv)
        second.append(1, dk, dv)
        second.advance(1)

    graph = cupykv.capture(step)
    graph.replay(6)                           # 7 steps in all: the last one overflows both caches
    for _ in range(7):
        first_ref.append(0, k, v)
        second_ref.append(1, k, v)
        second_ref.advance(1)
    testing.assert_matches_reference(first, first_ref)
    testing.assert_matches_reference(second, second_ref)


# -- graphs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_set_lengths_and_positions_replay_from_a_graph(backend):
    # GraphSafeKV's decode step: write at device positions, then mark them written, inside one graph.
    rng = np.random.default_rng(10)
    cache, oracle = pair(SPEC, backend, [1, 3, 0])
    positions = cache.to_device(np.array([[1], [3], [0]], np.int32))
    new_lengths = cache.to_device(np.array([2, 4, 1], np.int32))
    written = cache.to_device(np.zeros((3, 1), np.int32))
    appended = cache.to_device(np.zeros((3, 2), np.int32))
    k, v = rows(SPEC, 1, rng)
    k2, v2 = rows(SPEC, 2, rng)
    dk, dv, dk2, dv2 = (cache.to_device(x) for x in (k, v, k2, v2))

    def step():
        cache.write(0, positions, dk, dv, rope=cupykv.Rope(), positions_out=written)
        cache.append(1, dk2, dv2, positions_out=appended)
        cache.set_lengths(new_lengths)

    def reference_step(p, n):
        want_written = oracle.write(0, p, k, v, rope=cupykv.Rope(), return_positions=True)
        want_appended = oracle.append(1, k2, v2, return_positions=True)
        oracle.set_lengths(n)
        return want_written, want_appended

    graph = cupykv.capture(step)
    reference_step(np.array([[1], [3], [0]]), [2, 4, 1])
    for p, n in (([[2], [5], [1]], [3, 6, 2]), ([[3], [6], [2]], [4, 7, 3])):   # the second one overflows
        cache._backend.copy(positions, cache.to_device(np.array(p, np.int32)))
        cache._backend.copy(new_lengths, cache.to_device(np.array(n, np.int32)))
        graph.replay()
        want_written, want_appended = reference_step(np.array(p), n)
        testing.assert_matches_reference(cache, oracle, rope_used=True)
        assert np.array_equal(host(cache, written), want_written)
        assert np.array_equal(host(cache, appended), want_appended)


HOST_READS_IN_A_STEP = [
    ("live", lambda c: c.live(0, 0), r"cache\.live\(\)"),
    ("remaining_capacity", lambda c: c.remaining_capacity(), r"cache\.remaining_capacity\(\)"),
    ("has_capacity", lambda c: c.has_capacity(1), r"cache\.has_capacity\(\)"),
    ("append return_positions", lambda c: c.append(0, *c._rows, return_positions=True),
     r"return_positions=True without positions_out"),
    ("write return_positions", lambda c: c.write(0, c.lengths, *c._rows, return_positions=True),
     r"return_positions=True without positions_out"),
    ("write host positions", lambda c: c.write(0, [0, 1, 2], *c._rows), r"copying a host array to the device"),
    ("set_lengths host values", lambda c: c.set_lengths([1, 2, 3]), r"copying host values to the device"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, call, message", HOST_READS_IN_A_STEP, ids=[c[0] for c in HOST_READS_IN_A_STEP])
def test_calls_that_need_the_host_are_refused_inside_a_captured_step(backend, name, call, message):
    cache = cupykv.KVCache(SPEC, backend=backend)
    cache._rows = tuple(cache.to_device(x) for x in rows(SPEC, 1, np.random.default_rng(0)))

    def step():
        cache.advance(1)
        call(cache)

    with pytest.raises(cupykv.CaptureError, match=message):
        cupykv.capture(step)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_views_work_inside_a_captured_step(backend):
    cache = cupykv.KVCache(SPEC, backend=backend)
    seen = []
    graph = cupykv.capture(lambda: (seen.append(cache.layer(1, "HND")[0].shape), cache.advance(1)))
    graph.replay(2)
    assert seen == [(3, 2, 6, 8)] * 2 and cache.lengths_host().tolist() == [3, 3, 3]


# -- views ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_layout", ["NHD", "HND"])
@pytest.mark.parametrize("layout", [None, "NHD", "HND"])
def test_layer_and_live_views_match_the_reference_and_share_memory(backend, cache_layout, layout):
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=6, batch=3, dtype="bfloat16",
                            layout=cache_layout)
    cache, oracle = pair(spec, backend, [0, 2, 6], seed=11)
    k, v = rows(spec, 2, np.random.default_rng(12))
    cache.append(1, cache.to_device(k), cache.to_device(v))   # pending rows at 0..1, 2..3 and (overflowed) 6..7
    oracle.append(1, k, v)
    xp = cache.xp
    shown = layout or cache_layout
    for got, want in zip(cache.layer(1, layout), oracle.layer(1, layout)):
        assert got.shape == want.shape == ((3, 6, 2, 8) if shown == "NHD" else (3, 2, 6, 8))
        assert np.array_equal(testing.bits(testing.to_numpy(got, spec)), testing.bits(want))
        assert xp.shares_memory(got, cache.k) or xp.shares_memory(got, cache.v)
    for seq, pending in ((0, 0), (0, 2), (1, 2), (2, 0), (2, 2), (1, 10**6)):
        for got, want in zip(cache.live(1, seq, pending=pending, layout=layout),
                             oracle.live(1, seq, pending=pending, layout=layout)):
            n = min(oracle.lengths[seq] + pending, 6)
            assert got.shape == want.shape == ((n, 2, 8) if shown == "NHD" else (2, n, 8))
            assert np.array_equal(testing.bits(testing.to_numpy(got, spec)), testing.bits(want))
    live_k, _ = oracle.live(1, 1, layout="NHD")
    assert np.array_equal(live_k.astype(np.float64), oracle.rows(1, 1)[0])   # the committed rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_live_of_a_one_sequence_cache_needs_no_seq(backend):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=8, batch=1)
    cache, oracle = pair(spec, backend, [5])
    k, v = cache.live(0)
    assert k.shape == v.shape == (5, 1, 4)
    assert np.array_equal(testing.to_numpy(v, spec), oracle.live(0)[1])


# -- capacity and footprint -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_queries_match_the_reference(backend):
    cache, oracle = pair(SPEC, backend, [0, 5, 6])
    assert cache.remaining_capacity().tolist() == oracle.remaining_capacity().tolist() == [6, 1, 0]
    for n in (0, 1, 2, [6, 1, 0], [7, 0, 1], 2**31 - 1):
        got, want = cache.has_capacity(n), oracle.has_capacity(n)
        assert got.dtype == np.bool_ and np.array_equal(got, want)
    assert cache.has_capacity().tolist() == [True, True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_footprint_repr_and_creation_record(backend, caplog):
    spec = cupykv.CacheSpec(n_layers=4, n_kv_heads=2, head_dim=64, max_seq=512, batch=2, dtype="bfloat16")
    with caplog.at_level(logging.DEBUG, logger="cupykv"):
        cache = cupykv.KVCache(spec, backend=backend)
    assert cache.nbytes == spec.nbytes + 3 * 4 * spec.batch + 2 * 4 * spec.n_layers * spec.n_kv_heads   # and scales
    text = repr(cache)
    assert text == (f"KVCache(shape=(4, 2, 512, 2, 64) [n_layers, batch, max_seq, n_kv_heads, head_dim], "
                    f"dtype=bfloat16, layout=NHD, backend={backend}, {cache.nbytes / 2**20:.3g} MiB)")
    assert "2 MiB" in text                   # 4 * 2 * 512 * 2 * 64 * 2 bytes, twice
    records = [r for r in caplog.records if r.name == "cupykv" and r.levelno == logging.DEBUG]
    assert [r.getMessage() for r in records] == [f"created {text}"]
    shared = cupykv.KVCache(spec, backend=backend, lengths=cache.lengths)
    assert shared.nbytes == cache.nbytes - 4 * spec.batch and repr(shared).endswith("MiB, shared lengths)")
    # the reference leaves shared lengths out of its footprint alike (its own arrays: bool overflow flags,
    # no device scratch, so its total is not the device cache's)
    oracle = reference.KVCache(spec)
    oracle_shared = reference.KVCache(spec, lengths=oracle.lengths)
    assert (oracle.shares_lengths, oracle_shared.shares_lengths) == (False, True)
    assert oracle.nbytes == spec.nbytes + 4 * spec.batch + spec.batch + 2 * 4 * spec.n_layers * spec.n_kv_heads
    assert oracle_shared.nbytes == oracle.nbytes - 4 * spec.batch
    assert repr(oracle) == "reference.KVCache(shape=(4, 2, 512, 2, 64), dtype=bfloat16, layout=NHD, 2 MiB)"
    assert repr(oracle_shared) == repr(oracle)[:-1] + ", shared lengths)"
    # the memory check before allocating asks for exactly what a cache then holds
    assert cupykv.KVCache._bytes_needed(spec) == cache.nbytes
    assert cupykv.KVCache._bytes_needed(spec, own_lengths=False) == shared.nbytes


# -- bad input --------------------------------------------------------------------------------------
def ints(d, values, dtype=np.int32):
    return d(np.array(values, dtype))


def one(c, d):
    """One random row per sequence, on the device: (k, v)."""
    return tuple(d(x) for x in rows(SPEC, 1, np.random.default_rng(1)))


BAD_CALLS = [
    ("write layer past the end", lambda c, d: c.write(2, ints(d, [0, 1, 2]), *one(c, d)), ValueError, r"^layer: "),
    ("write positions int64", lambda c, d: c.write(0, ints(d, [0, 1, 2], np.int64), *one(c, d)),
     TypeError, r"^positions: expected dtype int32, got int64"),
    ("write positions wrong shape", lambda c, d: c.write(0, ints(d, [[0, 1], [1, 2], [2, 3]]), *one(c, d)),
     ValueError, r"^positions: expected shape \(3, 1\) \[batch, n_new\] \(n_new from k\) or \(3,\) \[batch\]"),
    ("write positions [batch] with two rows", lambda c, d: c.write(0, ints(d, [0, 1, 2]),
                                                                    *(d(x) for x in rows(SPEC, 2, np.random.default_rng(1)))),
     ValueError, r"^positions: expected shape \(3, 2\) \[batch, n_new\] \(n_new from k\), got \(3,\)"),
    ("write positions reversed", lambda c, d: c.write(0, ints(d, [0, 1, 2])[::-1], *one(c, d)),
     ValueError, r"^positions: expected a C-contiguous array"),
    ("write positions views the cache's k", lambda c, d: c.write(0, c.k.reshape(-1).view(np.int32)[:3], *one(c, d)),
     ValueError, r"^positions: expected an array that does not overlap the cache's k"),
    ("write positions is the overflow flags", lambda c, d: c.write(0, c.overflow, *one(c, d)),
     ValueError, r"^positions: expected an array that does not overlap the cache's overflow flags"),
    ("write host positions repeated", lambda c, d: c.write(0, [[1, 1], [0, 2], [3, 4]],
                                                           *(d(x) for x in rows(SPEC, 2, np.random.default_rng(1)))),
     ValueError, r"^positions: expected distinct positions within a sequence, got positions\[0, 0\] = "
                 r"positions\[0, 1\] = 1$"),
    ("write host positions past int32", lambda c, d: c.write(0, [0, 2**31, 1], *one(c, d)),
     ValueError, r"^positions: expected ints in -2147483648\.\.2147483647 \(the kernel's int\), got positions\[1, 0\] = 2147483648"),
    ("write host positions floats", lambda c, d: c.write(0, np.array([0.0, 1.0, 2.0]), *one(c, d)),
     TypeError, r"^positions: expected ints, got 0\.0"),
    ("write positions a string", lambda c, d: c.write(0, "0", *one(c, d)), TypeError, r"^positions: expected a device array"),
    ("write k wrong dtype", lambda c, d: c.write(0, ints(d, [0, 1, 2]), d(np.ones((3, 1, 2, 8), np.float32)), one(c, d)[1]),
     TypeError, r"^k: expected dtype float16"),
    ("write rope not a Rope", lambda c, d: c.write(0, ints(d, [0, 1, 2]), *one(c, d), rope=1.0), TypeError, r"^rope: "),
    ("write return_positions not a bool", lambda c, d: c.write(0, ints(d, [0, 1, 2]), *one(c, d), return_positions=1),
     TypeError, r"^return_positions: expected a bool, got 1 \(int\)"),
    ("write positions_out wrong shape", lambda c, d: c.write(0, ints(d, [0, 1, 2]), *one(c, d),
                                                             positions_out=ints(d, [[0, 0], [0, 0], [0, 0]])),
     ValueError, r"^positions_out: expected shape \(3, 1\) \[batch, n_new\] \(n_new from k\), got \(3, 2\)"),
    ("write positions_out is positions", lambda c, d: (lambda p: c.write(0, p, *one(c, d), positions_out=p))(ints(d, [0, 1, 2])),
     ValueError, r"^positions_out: expected an array that does not overlap positions"),
    ("write positions_out float32", lambda c, d: c.write(0, ints(d, [0, 1, 2]), *one(c, d),
                                                         positions_out=d(np.zeros(3, np.float32))),
     TypeError, r"^positions_out: expected dtype int32"),
    ("append positions_out is the cache's lengths", lambda c, d: c.append(0, *one(c, d), positions_out=c.lengths),
     ValueError, r"^positions_out: expected an array that does not overlap a KVCache's lengths"),
    ("append positions_out a host array", lambda c, d: c.append(0, *one(c, d), positions_out=np.zeros((3, 1), np.int32)),
     TypeError, r"^positions_out: expected a device array"),
    ("set_lengths negative", lambda c, d: c.set_lengths(-1), ValueError, r"^new_lengths: expected an int in 0\.\.2147483647, got -1$"),
    ("set_lengths past int32", lambda c, d: c.set_lengths([0, 2**31, 0]),
     ValueError, r"^new_lengths: expected ints in 0\.\.2147483647, got new_lengths\[1\] = 2147483648$"),
    ("set_lengths wrong length", lambda c, d: c.set_lengths([1, 2]), ValueError, r"^new_lengths: .*got shape \(2,\)"),
    ("set_lengths float", lambda c, d: c.set_lengths(1.5), TypeError, r"^new_lengths: "),
    ("set_lengths device int64", lambda c, d: c.set_lengths(ints(d, [1, 1, 1], np.int64)),
     ValueError, r"^new_lengths: expected a device int32 array of shape \(3,\)"),
    ("set_lengths device is the cache's lengths", lambda c, d: c.set_lengths(c.lengths),
     ValueError, r"^new_lengths: expected an array that does not overlap the cache's lengths"),
    ("layer past the end", lambda c, d: c.layer(2), ValueError, r"^layer: expected an int in 0\.\.1, got 2$"),
    ("layer unknown layout", lambda c, d: c.layer(0, "BHSD"), ValueError, r"^layout: expected None, 'NHD' or 'HND', got 'BHSD'$"),
    ("layer layout not a string", lambda c, d: c.layer(0, 1), TypeError, r"^layout: "),
    ("live seq None with batch 3", lambda c, d: c.live(0), ValueError, r"^seq: expected an int in 0\.\.2 \(the cache holds 3 sequences"),
    ("live seq past the end", lambda c, d: c.live(0, 3), ValueError, r"^seq: expected an int in 0\.\.2, got 3$"),
    ("live pending negative", lambda c, d: c.live(0, 0, pending=-1), ValueError, r"^pending: expected an int in 0\.\.1073741823, got -1$"),
    ("has_capacity negative", lambda c, d: c.has_capacity(-1), ValueError, r"^n: expected an int in 0\.\.2147483647, got -1$"),
    ("has_capacity wrong length", lambda c, d: c.has_capacity([1]), ValueError, r"^n: .*got shape \(1,\)"),
]


@pytest.fixture(params=BACKENDS)
def filled_cache(request):
    cache, _ = pair(SPEC, request.param, [3, 6, 0])
    cache.append(1, *(cache.to_device(x) for x in rows(SPEC, 2, np.random.default_rng(2))))   # pending rows too
    return cache


@pytest.mark.parametrize("name, call, error, message", BAD_CALLS, ids=[case[0] for case in BAD_CALLS])
def test_bad_call_raises_its_error_and_changes_nothing(filled_cache, name, call, error, message):
    before = snapshot(filled_cache)
    with pytest.raises(error, match=message):
        call(filled_cache, filled_cache.to_device)
    for a, b in zip(before, snapshot(filled_cache)):
        assert np.array_equal(a, b), f"{name} changed the cache"


# Host-value calls the reference makes too: it refuses them alike (same type, same message).
REFERENCE_TWINS = ["write host positions repeated", "write host positions past int32", "write host positions floats",
                   "set_lengths negative", "set_lengths past int32", "set_lengths wrong length", "set_lengths float",
                   "layer past the end", "layer unknown layout", "live seq None with batch 3", "live seq past the end",
                   "live pending negative", "has_capacity negative", "has_capacity wrong length",
                   "write return_positions not a bool"]


@pytest.mark.parametrize("name", REFERENCE_TWINS)
def test_the_reference_refuses_the_same_host_values_alike(name):
    _, call, error, message = next(case for case in BAD_CALLS if case[0] == name)
    oracle = reference.KVCache(SPEC)
    before = [a.copy() for a in (oracle.k, oracle.v, oracle.lengths, oracle.overflow)]
    with pytest.raises(error, match=message):
        call(oracle, lambda x: x)
    assert all(np.array_equal(a, b) for a, b in zip(before, (oracle.k, oracle.v, oracle.lengths, oracle.overflow)))


BAD_LENGTHS = [
    ("a host array", lambda other, d: np.zeros(3, np.int32), TypeError, r"^lengths: expected a device array"),
    ("int64", lambda other, d: d(np.zeros(3, np.int64)), TypeError, r"^lengths: expected dtype int32, got int64$"),
    ("wrong shape", lambda other, d: d(np.zeros(4, np.int32)), ValueError, r"^lengths: expected shape \(3,\) \[batch\], got \(4,\)$"),
    ("strided", lambda other, d: d(np.zeros(6, np.int32))[::2], ValueError, r"^lengths: expected a C-contiguous array"),
    ("a value past max_seq", lambda other, d: d(np.array([0, 7, 0], np.int32)),
     ValueError, r"^lengths: expected lengths in 0\.\.6 \(max_seq\), got lengths\[1\] = 7$"),
    ("a negative value", lambda other, d: d(np.array([-1, 0, 0], np.int32)), ValueError, r"^lengths: .*got lengths\[0\] = -1$"),
    ("another cache's overflow flags", lambda other, d: other.overflow,
     ValueError, r"^lengths: expected an array that does not overlap a KVCache's overflow flags"),
    ("another cache's k", lambda other, d: other.k.reshape(-1).view(np.int32)[:3],
     ValueError, r"^lengths: expected an array that does not overlap a KVCache's k"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, make, error, message", BAD_LENGTHS, ids=[case[0] for case in BAD_LENGTHS])
def test_bad_shared_lengths_are_refused_before_anything_is_allocated(backend, name, make, error, message):
    other, _ = pair(SPEC, backend, [1, 2, 3])
    before = snapshot(other)
    with pytest.raises(error, match=message):
        cupykv.KVCache(SPEC, backend=backend, lengths=make(other, other.to_device))
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(other)))


@pytest.mark.parametrize("name, lengths, error, message", [
    ("a list", [0, 0, 0], TypeError, r"^lengths: expected a numpy int32 array, got \[0, 0, 0\] \(list\)$"),
    ("int64", np.zeros(3, np.int64), TypeError, r"^lengths: expected a numpy int32 array, got ndarray of dtype int64$"),
    ("wrong shape", np.zeros(2, np.int32), ValueError, r"^lengths: expected shape \(3,\) \[batch\], got \(2,\)$"),
    ("a value past max_seq", np.array([0, 0, 9], np.int32), ValueError, r"^lengths: .*got lengths\[2\] = 9$"),
    # shared lengths are written in place: a strided view or a read-only array cannot be (either alone)
    ("strided", np.zeros(6, np.int32)[::2], ValueError,
     r"^lengths: expected a C-contiguous, writeable array, got strides \(8,\) \(writeable=True\)$"),
    ("read-only", np.frombuffer(bytes(12), np.int32),   # over immutable bytes: read-only
     ValueError, r"^lengths: expected a C-contiguous, writeable array, got strides \(4,\) \(writeable=False\)$"),
])
def test_the_reference_refuses_bad_shared_lengths_alike(name, lengths, error, message):
    with pytest.raises(error, match=message):
        reference.KVCache(SPEC, lengths=lengths)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_lengths_may_hold_every_length_from_0_to_max_seq(backend):
    """A full sequence (length max_seq) is a valid length to share; max_seq + 1 is not (above)."""
    full = np.array([SPEC.max_seq, 0, 3], np.int32)
    oracle = reference.KVCache(SPEC, lengths=full.copy())
    other = cupykv.KVCache(SPEC, backend=backend)
    lengths = other.to_device(full)
    cache = cupykv.KVCache(SPEC, backend=backend, lengths=lengths)
    assert cache.lengths_host().tolist() == np.asarray(oracle.lengths).tolist() == full.tolist()
    assert np.asarray(cache.remaining_capacity()).tolist() == oracle.remaining_capacity().tolist() == [0, SPEC.max_seq, 3]


@pytest.mark.parametrize("name", ["append", "write", "set_lengths", "layer", "live", "remaining_capacity",
                                  "has_capacity"])
def test_the_reference_has_the_same_signatures(name):
    import inspect

    def parameters(function):   # names, kinds and defaults; the annotations differ (device vs host arrays)
        return [p.replace(annotation=p.empty) for p in inspect.signature(function).parameters.values()]

    fast, ref = (parameters(getattr(cls, name)) for cls in (cupykv.KVCache, reference.KVCache))
    assert fast == ref
    assert isinstance(reference.KVCache.nbytes, property) and isinstance(cupykv.KVCache.nbytes, property)
    fast, ref = ({p.name: p for p in parameters(cls.__init__)} for cls in (cupykv.KVCache, reference.KVCache))
    assert fast["lengths"] == ref["lengths"] and fast["lengths"].kind is inspect.Parameter.KEYWORD_ONLY
