"""Launch limits and memory: realistic shapes never reach a CUDA grid limit, and a cache too large is refused.

Before issue 17, ``batch * n_kv_heads > 65535`` (attention's grid y),
``batch > 65535`` (append's grid y) and ``batch * q_len`` rows of
``additive_mask`` past 65535 (its grid y and z) reached the emulator's
LaunchError, after the arguments were checked. Now sequences, heads and query
tiles share grid x (up to 2**31 - 1 blocks), the mask strides over its rows,
and every launch is checked against CUDA's limits before it is made.
"""
import math
import time

import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from cupykv.backends import get_backend
from cupykv.backends.emulator import memory
from backends import BACKENDS
from process_memory import resident_bytes

GRID_LIMITS = (2**31 - 1, 65535, 65535)


def assert_within_cuda_limits(launches):
    assert launches
    for op, grid, block, shared_mem in launches:
        grid = grid + (1,) * (3 - len(grid))
        assert all(1 <= size <= limit for size, limit in zip(grid, GRID_LIMITS)), (op, grid)
        assert math.prod(block) <= 1024 and shared_mem <= 48 * 1024, (op, block, shared_mem)


@pytest.mark.parametrize("batch, n_kv_heads, q_len, group", [
    (70000, 1, 1, 1),        # batch alone past 65535
    (2, 40000, 1, 1),        # batch * n_kv_heads past 65535
    (1, 1, 2**20, 8),        # a long prefill: 2**23 query rows, 2**19 tiles of 16
])
def test_large_batches_heads_and_prefills_fit_the_grid(recorded_launches, batch, n_kv_heads, q_len, group):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=n_kv_heads, head_dim=1, max_seq=300, batch=batch)
    cache = cupykv.KVCache(spec, backend="emulator")
    rows = cache.to_device(np.zeros((batch, q_len, n_kv_heads, 1), np.float32))
    cache.append(0, rows, rows)
    cupykv.attention(cache.to_device(np.zeros((batch, q_len, n_kv_heads * group, 1), np.float32)), cache, 0)
    cupykv.attention(cache.to_device(np.zeros((batch, 1, n_kv_heads, 1), np.float32)), cache, 0, num_splits=3)
    cache.additive_mask(q_len)
    assert_within_cuda_limits(recorded_launches)
    append_grid, attention_grid, split_grid, mask_grid = (grid for _, grid, _, _ in recorded_launches)
    assert append_grid == (batch * q_len,)
    assert attention_grid == (batch * n_kv_heads * math.ceil(q_len * group / 16), 1)
    assert split_grid == (batch * n_kv_heads, 3)   # the last block of each tile merges: no second launch
    assert mask_grid == (2, min(batch * q_len, 1024))   # 300 positions: two blocks of 256 a row


def test_append_to_70000_sequences_writes_every_row():
    # the reference's per-sequence loop is slow at this batch: the expected cache is built with NumPy indexing
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=2, max_seq=4, batch=70000)
    cache = cupykv.KVCache(spec, backend="emulator")
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, 70000)
    cache.advance(lengths)
    k, v = (rng.standard_normal((70000, 2, 1, 2)).astype(np.float32) for _ in range(2))
    cache.append(0, cache.to_device(k), cache.to_device(v))
    want_k, want_v = np.zeros(spec.shape, np.float32), np.zeros(spec.shape, np.float32)
    for i in range(2):
        fits = np.flatnonzero(lengths + i < 4)
        want_k[0, fits, lengths[fits] + i] = k[fits, i]
        want_v[0, fits, lengths[fits] + i] = v[fits, i]
    assert np.array_equal(testing.bits(cache.k), testing.bits(want_k))
    assert np.array_equal(testing.bits(cache.v), testing.bits(want_v))
    assert np.array_equal(cache._backend.to_host(cache.overflow), (lengths + 2 > 4).astype(np.int32))


def test_a_mask_of_70000_queries_matches_the_reference():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=2, max_seq=16, batch=2)
    cache, oracle = cupykv.KVCache(spec, backend="emulator"), reference.KVCache(spec)
    cache.advance([3, 9])
    oracle.advance([3, 9])
    assert np.array_equal(cache.additive_mask(70000), oracle.additive_mask(70000))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_block_of_the_one_axis_attention_grid_finds_its_sequence_head_tile_and_split(backend):
    # 3 sequences x 3 kv heads x 3 tiles (q_len 5 x group 8 = 40 rows) on grid x, 2 splits on y
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=3, head_dim=8, max_seq=160, batch=3)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(1)
    testing.fill(cache, oracle, [150, 7, 131], rng)
    q = testing.random_rows(rng, spec, (3, 5, 24, 8))
    got = cupykv.attention(cache.to_device(q), cache, 0, num_splits=2)
    testing.assert_attention_close(testing.to_numpy(got, spec), reference.attention(q, oracle, 0), spec.dtype,
                                   float(np.abs(oracle.v).max()))


def test_append_write_and_the_mask_check_their_grid_before_launching(monkeypatch, recorded_launches):
    """No realistic cache reaches grid x's 2**31 - 1 blocks (append and write: one per row, batch * n_new),
    nor the mask's 65535 on grid y (it stops at 1024 row blocks), so the limits are lowered to 7 and 1 here:
    2 sequences x 4 new rows, and a mask over 2 query rows, must be refused, naming the argument, before
    any launch, with the cache unchanged; 2 x 3 rows launch."""
    from cupykv._args import limits
    monkeypatch.setattr(limits, "MAX_GRID", (7, 1, 65535))
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=8, batch=2)
    cache = cupykv.KVCache(spec, backend="emulator")
    rows, fewer = (cache.to_device(np.ones((2, n_new, 1, 4), np.float32)) for n_new in (4, 3))
    positions = np.tile(np.arange(4, dtype=np.int32), (2, 1))
    message = (r"^k: expected a shape whose launch has 1\.\.7 blocks on grid x \(CUDA's limit\), got "
               r"batch \* n_new = 2 \* 4 rows: grid \(8, 1, 1\)$")
    for call in (lambda: cache.append(0, rows, rows), lambda: cache.write(0, positions, rows, rows)):
        with pytest.raises(ValueError, match=message):
            call()
        assert recorded_launches == [] and np.all(cache.lengths == 0)
    with pytest.raises(ValueError, match=r"^q_len: expected a shape whose launch has 1\.\.1 blocks on grid y \(CUDA's "
                                         r"limit\), got max_seq = 8 positions a row: grid \(1, 2, 1\)$"):
        cache.additive_mask(1)
    assert recorded_launches == []
    cache.append(0, fewer, fewer)
    assert [grid for _, grid, _, _ in recorded_launches] == [(6,)]


@pytest.mark.gpu
def test_attention_over_70000_sequence_heads_matches_the_reference_on_a_gpu():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=8, max_seq=4, batch=35000)
    cache, oracle = cupykv.KVCache(spec, backend="cupy"), reference.KVCache(spec)
    rng = np.random.default_rng(2)
    testing.fill(cache, oracle, rng.integers(0, 5, 35000), rng)
    q = testing.random_rows(rng, spec, (35000, 1, 4, 8))
    got = cupykv.attention(cache.to_device(q), cache, 0)
    testing.assert_attention_close(testing.to_numpy(got, spec), reference.attention(q, oracle, 0), spec.dtype,
                                   float(np.abs(oracle.v).max()))


# -- memory ---------------------------------------------------------------------------------------------
LLAMA_8B_64K = cupykv.CacheSpec(n_layers=32, n_kv_heads=8, head_dim=128, max_seq=65536, batch=8, dtype="bfloat16")


def test_a_cache_larger_than_the_machine_is_refused_at_once_with_both_sizes():
    available, _ = get_backend("emulator").available_memory()
    # K and V, then lengths, overflow and staging [batch], then the float32 K and V scales [n_layers, n_kv_heads]
    needed = LLAMA_8B_64K.nbytes + 3 * 4 * 8 + 2 * 4 * 32 * 8
    if available is None or available >= needed:
        pytest.skip(f"this machine can give {available} bytes: the 64 GiB cache would fit")
    start = time.monotonic()
    with pytest.raises(MemoryError, match=rf"^spec: expected a cache of at most \d+ bytes \(\d+\.\d\d GiB\), what the "
                                          rf"emulator backend can give \(MemAvailable in /proc/meminfo\), got one "
                                          rf"that needs {needed} bytes \(64\.00 GiB\)$"):
        cupykv.KVCache(LLAMA_8B_64K, backend="emulator")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_is_allocated_for_a_cache_the_backend_cannot_hold(monkeypatch, backend):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=8, batch=2)
    allocations = []
    target = get_backend(backend)
    monkeypatch.setattr(type(target), "available_memory", lambda self: (spec.nbytes, "a test's budget"))
    monkeypatch.setattr(type(target), "_zeros", lambda self, shape, dtype: allocations.append(shape))
    with pytest.raises(MemoryError, match=rf"^spec: expected a cache of at most {spec.nbytes} bytes .* \(a test's "
                                          rf"budget\), got one that needs {spec.nbytes + 24 + 8} bytes"):   # + 2 float32 scales
        cupykv.KVCache(spec, backend=backend)
    assert allocations == []


def test_emulator_zeros_commit_no_memory_until_used():
    before = resident_bytes()
    array = memory.zeros((2**28,), np.float32)   # 1 GiB
    grown = resident_bytes() - before
    assert grown < 64 * 2**20, f"zeros committed {grown} bytes"
    assert not array[:: 2**20].any() and array[-1] == 0


def test_q_len_and_n_new_may_be_max_new_and_no_more():
    """q_len and n_new are 1..MAX_NEW (so that max_seq + q_len fits the kernels' int): both ends are
    accepted and one past either end is refused, naming the range. Zero-stride views stand in for arrays of
    2**30 rows (the shape checks read no element)."""
    from cupykv._args.cache_args import check_q, check_rows
    from cupykv.spec import MAX_NEW
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=16, batch=1, dtype="float32")

    def rows(n, heads=1):
        return np.broadcast_to(np.float32(0), (1, n, heads, 8))

    assert check_rows("k", rows(MAX_NEW), spec) == MAX_NEW and check_rows("k", rows(1), spec) == 1
    assert check_q(rows(MAX_NEW, 2), spec) == (MAX_NEW, 2) and check_q(rows(1), spec) == (1, 1)
    with pytest.raises(ValueError, match=rf"^k: expected shape \(1, n_new in 1\.\.{MAX_NEW}, 1, 8\) \[batch, n_new, "
                                         rf"n_kv_heads, head_dim\], got \(1, {MAX_NEW + 1}, 1, 8\)$"):
        check_rows("k", rows(MAX_NEW + 1), spec)
    with pytest.raises(ValueError, match=rf"^q: expected shape \(1, q_len in 1\.\.{MAX_NEW}, n_heads, 8\) "
                                         rf"\[batch, q_len, n_heads, head_dim\] with n_heads a multiple of "
                                         rf"n_kv_heads=1, got \(1, {MAX_NEW + 1}, 1, 8\)$"):
        check_q(rows(MAX_NEW + 1), spec)
    with pytest.raises(ValueError, match=r"^k: expected shape \(1, n_new in 1\.\.\d+, 1, 8\) .*got \(1, 0, 1, 8\)$"):
        check_rows("k", rows(0), spec)
    with pytest.raises(ValueError, match=r"^q: expected shape \(1, q_len in 1\.\.\d+, n_heads, 8\) .*got \(1, 0, 1, 8\)$"):
        check_q(rows(0), spec)
    # the query rows batch * q_len * n_heads are a kernel int: 2**31 - 1 of them is the most
    assert check_q(rows(1, 2**31 - 1), spec) == (1, 2**31 - 1)
    with pytest.raises(ValueError, match=r"^q: expected batch \* q_len \* n_heads <= 2147483647 query rows, "
                                         r"got 1 \* 2 \* 1073741824 = 2147483648$"):
        check_q(rows(2, 2**30), spec)
    with pytest.raises(ValueError, match=r"^q: expected shape \(1, 1, n_heads, 8\) .*got \(1, 1, 0, 8\)$"):
        check_q(rows(1, 0), spec)


def test_an_op_axis_may_be_int32_max_and_no_more():
    """The ops' free axes (rows, features, vocab) are kernel ints: 1..2**31 - 1 (zero-stride views stand in)."""
    from cupykv._args import check_shape
    big = 2**31 - 1
    assert check_shape("x", np.broadcast_to(np.float32(0), (big, 1)), (None, 1), ("rows", "hidden")) == (big, 1)
    with pytest.raises(ValueError, match=r"^x: expected shape \(rows, 1\) \[rows, hidden\] with every size in "
                                         r"1\.\.2\*\*31-1, got \(2147483648, 1\)$"):
        check_shape("x", np.broadcast_to(np.float32(0), (big + 1, 1)), (None, 1), ("rows", "hidden"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_kernels_reach_the_last_sequence_of_a_partial_block(backend):
    """advance, set_lengths, truncate and reset run a thread per sequence in blocks of 256: batch 257 takes a
    second block for one sequence, the one a rounded-down block count would leave out."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=1, max_seq=8, batch=257)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    steps = [("advance", 3), ("set_lengths", np.arange(257) % 9), ("truncate", np.arange(257) % 9 // 2),
             ("reset", [0, 256]), ("advance", 1), ("set_lengths", 5)]
    for op, value in steps:
        for twin in (cache, oracle):
            getattr(twin, op)(value)
        assert cache.lengths_host().tolist() == np.asarray(oracle.lengths).tolist(), op
    assert cache.lengths_host()[256] == 5
    mask = testing.to_numpy(cache.additive_mask(1), spec)
    np.testing.assert_array_equal(mask, oracle.additive_mask(1))
