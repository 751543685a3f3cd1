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
from hypothesis import given, strategies as st

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
    # every magnitude bit counts on the negative side too: -2 has the exponent's top bit set
    two = np.array([2.0], dtype)
    two_up = (two.view(unsigned) + 1).view(dtype)
    assert testing.ulp_distance(-two, -two_up).tolist() == [1]
    assert testing.ulp_distance(-two, two).tolist() == [2 * int(two.view(unsigned)[0])]


def test_ulp_distance_refuses_a_dtype_or_a_shape_that_differs():
    one = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"^b: expected dtype float32 and shape \(3,\), got float16 and \(3,\)$"):
        testing.ulp_distance(one, one.astype(np.float16))
    with pytest.raises(ValueError, match=r"^b: expected dtype float32 and shape \(3,\), got float32 and \(1, 3\)$"):
        testing.ulp_distance(one, one.reshape(1, 3))


def test_ulp_distance_takes_lists_as_float64():
    assert testing.ulp_distance([1.0, -0.0], [np.nextafter(1.0, 2.0), 0.0]).tolist() == [1, 0]
    assert testing.ulp_distance([[2.0**-1074]], [[-(2.0**-1074)]]).tolist() == [[2]]   # across zero


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


def test_attention_error_is_the_worst_element_against_any_want():
    edge = tolerances.attention_tolerance("float16", 2.0)
    want = np.array([[-3.0, 1.5], [0.25, 7.0]])
    got = want.copy()
    got[1, 0] += 0.5 * edge                        # one element off; the others exact
    assert tolerances.attention_error(got, want, "float16", 2.0) == pytest.approx(0.5, rel=1e-9)
    got[0, 1] -= 3 * edge                          # the worst element decides, whatever its sign
    assert tolerances.attention_error(got, want, "float16", 2.0) == pytest.approx(3.0, rel=1e-9)
    # one element is an array like any other; an empty one is within any tolerance
    assert tolerances.attention_error([1.0 + edge / 4], [1.0], "float16", 2.0) == pytest.approx(0.25, rel=1e-9)
    assert tolerances.attention_error(np.zeros((0, 4)), np.zeros((0, 4)), "float16", 2.0) == 0.0
    with pytest.raises(ValueError, match=r"^got: expected shape \(2, 2\), got \(4,\)$"):
        tolerances.attention_error(got.ravel(), want, "float16", 2.0)


def test_assert_attention_close_passes_the_edge_and_reports_the_worst_element():
    want = np.array([4.0, -2.0, 1.0])
    edge = tolerances.attention_tolerance("float32", 4.0)
    tolerances.assert_attention_close(want + edge, want, "float32", 4.0)        # exactly at the tolerance
    got = want.copy()
    got[1] += 2 * edge
    error = f"{2 * edge:.3g}"
    with pytest.raises(AssertionError, match=rf"max error {error} \(tolerance {edge:.3g}, float32, "
                                             rf"value scale 4, logit error 0\), .* worst at index \(1,\): got -1.99987.*, want -2.0$"):
        tolerances.assert_attention_close(got, want, "float32", 4.0)


def test_assert_attention_close_takes_lists_and_names_its_context():
    # array_like, as documented: the report indexes the inputs as arrays, whatever was passed
    with pytest.raises(AssertionError, match=r"^attention outside tolerance layer 3: max error 0\.5 .* "
                                             r"worst at index \(1,\): got 2\.0, want 2\.5$"):
        tolerances.assert_attention_close([1.0, 2.0], [1.0, 2.5], "float32", 1.0, context="layer 3")
    with pytest.raises(AssertionError, match=r"^attention outside tolerance: max error"):   # no context: no space
        tolerances.assert_attention_close([[2.0]], [[2.5]], "float32", 1.0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_logits_tolerance_is_the_stated_formula(dtype):
    # logit_scale * n_layers * (8 rounding points x 2 u(dtype) + 256 u(fp32)); at least one layer
    assert tolerances.logits_tolerance(dtype, 10.0, 3) == 10.0 * 3 * (16 * U[dtype] + 256 * 2.0 ** -24)
    assert tolerances.logits_tolerance(dtype, 10.0, 1) == 10.0 * (16 * U[dtype] + 256 * 2.0 ** -24)
    assert tolerances.logits_tolerance(dtype, 10.0, 0) == tolerances.logits_tolerance(dtype, 10.0, 1)


def test_the_logit_error_bound_is_the_stated_formula():
    # (head_dim + 4) u(fp32) |scale| max norm(q) max norm(k), over rows of any leading shape
    head_dim = 3
    q = np.zeros((2, 4, head_dim))
    q[1, 2] = [2.0, 3.0, 6.0]                      # norm 7: the largest, not the first row
    q[0, 0] = [1.0, 0.0, 0.0]
    k = np.zeros((5, head_dim))
    k[3] = [0.0, 3.0, 4.0]                         # norm 5
    k[4] = [np.inf, 0.0, 0.0]                      # rows that are not finite are not attended: left out
    k[0] = [np.nan, 1e30, 0.0]
    bound = (head_dim + 4) * 2.0 ** -24 * 0.5 * 7.0 * 5.0
    assert tolerances.logit_error_bound(q, k, 0.5) == bound
    assert tolerances.logit_error_bound(q, k, -0.5) == bound      # a negative scale errs as much
    assert tolerances.logit_error_bound(q, np.full((2, head_dim), np.nan), 0.5) == 0.0


@given(head_dim=st.sampled_from([1, 2, 64, 128, 256]), magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
       scale=st.sampled_from([0.0625, 1.0, -3.0]), seed=st.integers(0, 2**32 - 1))
def test_the_logit_error_bound_holds_for_fp32_dot_products_in_any_order(head_dim, magnitude, scale, seed):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((3, head_dim)) * magnitude).astype(np.float32)
    k = (rng.standard_normal((4, head_dim)) * magnitude).astype(np.float32)
    k[1] = np.abs(k[1]) * np.sign(q[0])            # terms of one sign: no cancellation to hide the error
    exact = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    bound = tolerances.logit_error_bound(q, k, scale)
    for order in (np.arange(head_dim), np.arange(head_dim)[::-1], rng.permutation(head_dim)):
        total = np.zeros((3, 4), np.float32)
        for d in order:                            # one fp32 rounding per product and per addition
            total = (total + np.float32(1) * q[:, d:d + 1] * k[:, d]).astype(np.float32)
        logits = (np.float32(scale) * total).astype(np.float32)
        assert np.abs(logits - exact).max() <= bound


def test_the_fp8_attention_bound_is_the_stated_formula():
    # value_scale (2**-4 + min(2, e^(2 eps_q) - 1)) + 2**-10 max(v_scale), with
    # eps_q = |scale| (2**-4 max_rows sum |q_d k_d| + 2**-10 max(k_scale) max_q sum |q_d|)
    q = np.array([[[0.5, -0.25]], [[0.125, 1.0]]])                # two query rows, head_dim 2
    k = np.array([[1.0, 2.0], [-4.0, 0.5], [0.0, 0.0]])
    v = np.array([[0.5, -3.0], [1.0, 2.0], [0.0, 0.0]])
    k_scale, v_scale = [0.5, 2.0], [0.25, 0.75]
    # sum |q_d k_d| over pairs: the largest is row 0 with key 1 (2 + 0.125)
    products = max(abs(qd * kd).sum() for qd in q.reshape(-1, 2) for kd in k)
    assert products == 2.125
    q_sum = max(np.abs(row).sum() for row in q.reshape(-1, 2))     # row 1: 1.125
    eps_q = 0.1 * (2.0 ** -4 * products + 2.0 ** -10 * 2.0 * q_sum)
    want = 3.0 * (2.0 ** -4 + math.expm1(2 * eps_q)) + 2.0 ** -10 * 0.75
    assert tolerances.fp8_attention_bound(q, k, v, 0.1, k_scale, v_scale) == pytest.approx(want, rel=1e-12)
    assert tolerances.fp8_attention_bound(q, k, v, -0.1, k_scale, v_scale) == pytest.approx(want, rel=1e-12)
    # large logits: the weights move by at most 2 (both outputs are convex combinations of the same rows)
    assert tolerances.fp8_attention_bound(q, k, v, 100.0, k_scale, v_scale) == 3.0 * (2.0 ** -4 + 2) + 2.0 ** -10 * 0.75
    # one query and one key of one element are bounded like any other; no query or no key bounds nothing
    one = tolerances.fp8_attention_bound([[2.0]], [[3.0]], [[5.0]], 1.0, 1.0, 1.0)
    assert one == pytest.approx(5.0 * (2.0 ** -4 + math.expm1(2 * (6 * 2.0 ** -4 + 2 * 2.0 ** -10))) + 2.0 ** -10)
    assert tolerances.fp8_attention_bound(np.zeros((0, 2)), k, v, 1.0, 1.0, 1.0) == 0.0
    assert tolerances.fp8_attention_bound(q, np.zeros((0, 2)), v, 1.0, 1.0, 1.0) == 0.0


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
