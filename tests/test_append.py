"""append: rows land at lengths[b] + i, bit for bit, and never past capacity."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupykv
from cupykv import reference, testing
from backends import BACKENDS


@st.composite
def append_cases(draw):
    spec = draw(testing.specs(max_seqs=(1, 2, 5, 16), dtypes=cupykv.spec.DTYPES))   # fp8 caches too
    lengths = draw(testing.lengths(spec))
    shape = draw(testing.row_shapes(spec))
    rope = draw(st.none() | st.just(cupykv.Rope(theta=10000.0))) if spec.head_dim % 2 == 0 else None
    return spec, lengths, shape, rope, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=append_cases())
def test_append_matches_reference_over_the_whole_cache(backend, case):
    spec, lengths, shape, rope, seed = case
    rng = np.random.default_rng(seed)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, lengths, rng)
    layer = int(rng.integers(spec.n_layers))
    k, v = testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)
    cache.append(layer, cache._backend.asarray(k), cache._backend.asarray(v), rope=rope)
    oracle.append(layer, k, v, rope=rope)
    testing.assert_matches_reference(cache, oracle, rope_used=rope is not None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_at_capacity_boundaries_sets_overflow_and_keeps_stored_rows(backend, dtype, layout):
    # Sequences at lengths 0, 1, capacity-1 and capacity each get 2 new rows.
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=6, batch=4, dtype=dtype, layout=layout)
    rng = np.random.default_rng(7)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [0, 1, 5, 6], rng)
    before = testing.to_numpy(cache.k, spec).copy()
    shape = (spec.batch, 2, spec.n_kv_heads, spec.head_dim)
    k, v = testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)
    cache.append(1, cache._backend.asarray(k), cache._backend.asarray(v))
    oracle.append(1, k, v)
    testing.assert_matches_reference(cache, oracle)
    flags = cache._backend.to_host(cache.overflow).tolist()
    assert flags == [0, 0, 1, 1]
    after = testing.to_numpy(cache.k, spec)
    # sequence 3 was full: nothing of it changed; sequence 2 got exactly its last row.
    assert np.array_equal(testing.bits(after[:, 3]), testing.bits(before[:, 3]))
    with pytest.raises(cupykv.CacheOverflowError, match=r"\[2, 3\]"):
        cache.check()
    cache.reset([2, 3])
    cache.check()  # reset clears the flags of the slots it empties


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_copies_every_bit_pattern_exactly(backend):
    # Bit patterns a float conversion could disturb: NaN payloads, -0, subnormals, infinities.
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=64, max_seq=4, batch=1, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend=backend)
    patterns = np.array([0x7FC1, 0xFFFF, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x3F80] * 8, dtype=np.uint16)
    rows = patterns.view(spec.np_dtype).reshape(1, 1, 1, 64)
    cache.append(0, cache._backend.asarray(rows), cache._backend.asarray(rows))
    stored = testing.bits(testing.to_numpy(cache.k, spec))[0, 0, 0, 0]
    assert np.array_equal(stored, patterns)
