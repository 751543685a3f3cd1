"""The checkers every other test trusts: tolerances, ulp distance, the whole-cache comparison, poison.

A checker that passes too much hides every bug it is asked about, so each is
held here to inputs whose verdict is known: a bit flipped in K or V, a length
or an overflow flag fails the whole-cache comparison; the tolerances are the
formulas ``cupykv.tolerances`` states, not looser ones; ``poison_tail`` poisons
exactly the rows from its start.
"""
import math

import ml_dtypes
import numpy as np
import pytest

import cupykv
from cupykv import reference, testing, tolerances

BF16 = np.dtype(ml_dtypes.bfloat16)
U = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


# -- ulp distance --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16, np.dtype(np.float32)])
def test_ulp_distance_counts_units_across_zero_and_reports_nan_as_the_largest(dtype):
    unsigned = np.dtype(f"u{dtype.itemsize}")
    sign = 1 << (8 * dtype.itemsize - 1)

    def from_bits(*patterns):
        return np.array(patterns, unsigned).view(dtype)

    one = np.array([1.0], dtype)
    up = (one.view(unsigned) + 1).view(dtype)
    assert testing.ulp_distance(one, up).tolist() == [1]
    assert testing.ulp_distance(-one, -up).tolist() == [1]
    assert testing.ulp_distance(one, one).tolist() == [0]
    # +0 and -0 are equal; the smallest subnormals of either sign are two units apart, through zero
    assert testing.ulp_distance(from_bits(0), from_bits(sign)).tolist() == [0]
    assert testing.ulp_distance(from_bits(1), from_bits(sign | 1)).tolist() == [2]
    assert testing.ulp_distance(from_bits(3), from_bits(sign | 2)).tolist() == [5]
    nan = np.array([np.nan], dtype)
    assert testing.ulp_distance(nan, one).tolist() == [np.iinfo(np.int64).max]
    assert testing.ulp_distance(one, nan).tolist() == [np.iinfo(np.int64).max]


# -- the stated tolerances -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_attention_tolerance_is_the_stated_formula(dtype):
    # value_scale * (2 u(dtype) + 256 u(fp32) + min(2, e^(2 logit_error) - 1))
    accumulation = 256 * 2.0 ** -24
    assert tolerances.attention_tolerance(dtype, 3.0) == 3.0 * (2 * U[dtype] + accumulation)
    assert tolerances.attention_tolerance(dtype, 3.0, 0.01) == pytest.approx(
        3.0 * (2 * U[dtype] + accumulation + math.expm1(0.02)), rel=1e-15)
    assert tolerances.attention_tolerance(dtype, 3.0, 5.0) == 3.0 * (2 * U[dtype] + accumulation + 2.0)
    # a zero value scale still allows the smallest normal float32, not nothing
    assert tolerances.attention_tolerance(dtype, 0.0) > 0


def test_attention_error_fails_what_lies_past_the_tolerance_and_every_nan():
    want = np.zeros(4)
    edge = tolerances.attention_tolerance("bfloat16", 1.0)
    assert tolerances.attention_error(want + edge, want, "bfloat16", 1.0) == 1.0
    assert tolerances.attention_error(want + 1.01 * edge, want, "bfloat16", 1.0) > 1.0
    with pytest.raises(AssertionError, match="outside tolerance"):
        tolerances.assert_attention_close(want + 1.01 * edge, want, "bfloat16", 1.0)
    assert tolerances.attention_error(np.array([0, 0, np.nan, 0]), want, "bfloat16", 1.0) == math.inf


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_logits_tolerance_is_the_stated_formula(dtype):
    # logit_scale * n_layers * (8 rounding points x 2 u(dtype) + 256 u(fp32)); at least one layer
    assert tolerances.logits_tolerance(dtype, 10.0, 3) == 10.0 * 3 * (16 * U[dtype] + 256 * 2.0 ** -24)
    assert tolerances.logits_tolerance(dtype, 10.0, 0) == tolerances.logits_tolerance(dtype, 10.0, 1)


# -- the whole-cache comparison and its helpers ------------------------------------------------------
def _filled(layout="NHD", dtype="float32"):
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=4, max_seq=6, batch=2, dtype=dtype, layout=layout)
    cache, oracle = cupykv.KVCache(spec, backend="emulator"), reference.KVCache(spec)
    testing.fill(cache, oracle, [3, 5], np.random.default_rng(0))
    return spec, cache, oracle


def _flip_bits(cache, name, index, mask=1):
    """XOR ``mask`` into the bit pattern of one element of the device K or V: ``mask`` 1 moves it one
    unit in the last place, 2 two units (same sign: the ordered patterns differ by exactly that)."""
    array = getattr(cache, name)
    host = cache._backend.to_host(array)
    patterns = host.view(np.dtype(f"u{host.dtype.itemsize}"))
    patterns[index] ^= mask
    cache._backend.upload(array, patterns.view(host.dtype))


@pytest.mark.parametrize("name", ["k", "v"])
def test_one_bit_anywhere_in_k_or_v_fails_the_comparison(name):
    spec, cache, oracle = _filled()
    testing.assert_matches_reference(cache, oracle)
    # a row past the live lengths counts too: the whole cache is compared, not only what attention reads
    index = (1, 0, spec.max_seq - 1, 1, 3)
    _flip_bits(cache, name, index)
    with pytest.raises(AssertionError, match=rf"^{name} differs from the reference \(bitwise\) at \[\[1, 0, 5, 1, 3\]\]"):
        testing.assert_matches_reference(cache, oracle)


def test_rotated_keys_may_differ_by_one_unit_and_no_more():
    spec, cache, oracle = _filled()
    index = (0, 1, 2, 0, 1)
    _flip_bits(cache, "k", index)              # one unit: what rope's rounding may give
    testing.assert_matches_reference(cache, oracle, rope_used=True)
    with pytest.raises(AssertionError, match=r"^k differs from the reference \(bitwise\)"):
        testing.assert_matches_reference(cache, oracle)       # without rope, not even that
    _flip_bits(cache, "k", index, mask=3)      # bit 0 back, bit 1 flipped: two units
    with pytest.raises(AssertionError, match=r"^k differs from the reference by more than 1 ulp at \[\[0, 1, 2, 0, 1\]\]"):
        testing.assert_matches_reference(cache, oracle, rope_used=True)


def test_lengths_and_overflow_flags_must_match_exactly():
    spec, cache, oracle = _filled()
    oracle.lengths[1] -= 1
    with pytest.raises(AssertionError, match=r"^lengths \[3, 5\] != reference \[3, 4\]"):
        testing.assert_matches_reference(cache, oracle)
    oracle.lengths[1] += 1
    oracle.overflow[0] = True
    with pytest.raises(AssertionError, match=r"^overflow \[False, False\] != reference \[True, False\]"):
        testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_poison_tail_poisons_exactly_the_rows_from_each_start(layout):
    spec, cache, oracle = _filled(layout)
    testing.poison_tail(cache, [2, 6])   # sequence 1: from max_seq on, nothing
    for name in ("k", "v"):
        got = testing.to_numpy(getattr(cache, name), spec)
        want = getattr(oracle, name)
        seq_axis = 2 if layout == "NHD" else 3
        rows = np.moveaxis(got, seq_axis, 2)
        want_rows = np.moveaxis(want, seq_axis, 2)
        assert np.isnan(rows[:, 0, 2:]).all()
        assert testing.bits(rows[:, 0, :2]).tolist() == testing.bits(want_rows[:, 0, :2]).tolist()
        assert testing.bits(rows[:, 1]).tolist() == testing.bits(want_rows[:, 1]).tolist()


def test_value_scale_is_the_largest_stored_value_of_the_layer():
    spec, cache, oracle = _filled()
    layer = 1
    live = [np.abs(oracle._values(oracle.v, layer, b)) for b in range(spec.batch)]
    assert testing.value_scale(oracle, layer) == max(float(v.max()) for v in live) > 0
    # it is the max, not a typical size: one large value sets it
    oracle.v[(layer, 0, 0, 0, 0)] = 1e6
    assert testing.value_scale(oracle, layer) == 1e6
