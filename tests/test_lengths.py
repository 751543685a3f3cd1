"""advance / truncate / reset: device-side length updates follow the reference exactly."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupykv
from cupykv import reference, testing
from backends import BACKENDS

SPEC = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=10, batch=3)


@pytest.mark.parametrize("backend", BACKENDS)
@given(ops=testing.operations(SPEC), seed=st.integers(0, 2**32 - 1))
def test_operation_sequences_follow_the_reference(backend, ops, seed):
    rng = np.random.default_rng(seed)
    cache, oracle = cupykv.KVCache(SPEC, backend=backend), reference.KVCache(SPEC)
    for operation in ops:
        testing.apply_operation(cache, oracle, operation, rng)
        assert cache.lengths_host().tolist() == oracle.lengths.tolist(), operation
        assert cache._backend.to_host(cache.overflow).astype(bool).tolist() == oracle.overflow.tolist()
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncate_that_would_grow_is_rejected_and_changes_nothing(backend):
    cache = cupykv.KVCache(SPEC, backend=backend)
    cache.advance([4, 2, 0])
    with pytest.raises(ValueError, match=r"new_lengths\[1\] = 3 with lengths\[1\] = 2"):
        cache.truncate([4, 3, 0])
    assert cache.lengths_host().tolist() == [4, 2, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_advance_past_capacity_clamps_and_flags(backend):
    cache = cupykv.KVCache(SPEC, backend=backend)
    cache.advance([9, 10, 3])
    cache.advance(1)
    assert cache.lengths_host().tolist() == [10, 10, 4]
    assert cache._backend.to_host(cache.overflow).tolist() == [0, 1, 0]
    with pytest.raises(cupykv.CacheOverflowError, match=r"\[1\]"):
        cache.check()


SET_LENGTHS_AT_CAPACITY = [   # (how the values are passed, values, lengths, overflow flags); max_seq is 10
    ("int", 10, [10, 10, 10], [0, 0, 0]),
    ("int", 11, [10, 10, 10], [1, 1, 1]),
    ("host", [10, 11, 9], [10, 10, 9], [0, 1, 0]),
    ("device", [10, 11, 9], [10, 10, 9], [0, 1, 0]),
    ("device", [11, 10, 2**31 - 1], [10, 10, 10], [1, 0, 1]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where, values, lengths, flags", SET_LENGTHS_AT_CAPACITY)
def test_set_lengths_flags_only_values_past_capacity(backend, where, values, lengths, flags):
    """max_seq itself is a full cache, not an overflow; max_seq + 1 is clamped and flagged."""
    cache = cupykv.KVCache(SPEC, backend=backend)
    cache.set_lengths(cache.to_device(np.array(values, np.int32)) if where == "device" else values)
    assert cache.lengths_host().tolist() == lengths
    assert cache._backend.to_host(cache.overflow).tolist() == flags


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_device_values_count_as_zero_without_a_flag(backend):
    """Host values are checked (test_bad_input.py); a device array is read by the kernel at run time,
    so its contract for negative values is the kernel's clamp: advance by 0, truncate or set to 0."""
    cache = cupykv.KVCache(SPEC, backend=backend)
    on_device = lambda values: cache.to_device(np.array(values, np.int32))
    cache.advance([4, 2, 6])
    cache.advance(on_device([-3, 1, -2**31]))
    assert cache.lengths_host().tolist() == [4, 3, 6]
    cache.truncate(on_device([-1, 3, -2**31]))
    assert cache.lengths_host().tolist() == [0, 3, 0]
    cache.set_lengths(on_device([-5, 7, -2**31]))
    assert cache.lengths_host().tolist() == [0, 7, 0]
    assert cache._backend.to_host(cache.overflow).tolist() == [0, 0, 0]
    cache.check()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 3])
def test_additive_mask_matches_reference(backend, q_len):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=300, batch=3)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [0, 299, 300], np.random.default_rng(0))
    got = cache._backend.to_host(cache.additive_mask(q_len))
    assert got.dtype == np.float32 and got.shape == (3, 1, q_len, 300)
    assert np.array_equal(got, oracle.additive_mask(q_len))
    out = cache._backend.zeros((3, 1, q_len, 300), np.float32)
    assert cache.additive_mask(q_len, out=out) is out
    assert np.array_equal(cache._backend.to_host(out), oracle.additive_mask(q_len))
