"""fp8 (E4M3) caches: stores match the reference bit for bit, scales reach captured graphs, bad
scales and dtypes are refused by name, and quantization stays within its stated bound.

Attention over fp8 caches is tested in test_attention_fp8.py; this file covers the cache itself
(append, write, scales), the host quantizer and the error bound of cupykv.tolerances.
"""
import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, target, strategies as st

import cupykv
from cupykv import fp8, reference, testing, tolerances
from cupykv.backends import get_backend
from cupykv.spec import FP8_DTYPE, IO_DTYPES
from backends import BACKENDS

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FINITE_CODES = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)


def _spec(io_dtype="bfloat16", **fields):
    shape = dict(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=8, batch=2)
    shape.update(fields)
    return cupykv.CacheSpec(**shape, dtype=FP8_DTYPE, io_dtype=io_dtype)


def _codes(array, spec):
    return testing.bits(testing.to_numpy(array, spec))


# -- the host quantizer -------------------------------------------------------------------------
def test_quantize_maps_every_code_value_to_itself_and_ties_to_even():
    values = FINITE_CODES.view(E4M3).astype(np.float32)
    assert np.array_equal(fp8.quantize_e4m3(values, 1.0).view(np.uint8), FINITE_CODES)
    # midpoints between neighbouring positive codes round to the even code (the one with a 0 last bit)
    positive = np.arange(1, 0x7E, dtype=np.uint8)
    low, high = positive.view(E4M3).astype(np.float64), (positive + 1).view(E4M3).astype(np.float64)
    midpoints = ((low + high) / 2).astype(np.float32)   # exact: 5 significant bits
    got = fp8.quantize_e4m3(midpoints, 1.0).view(np.uint8)
    want = np.where(positive % 2 == 0, positive, positive + 1)
    assert np.array_equal(got, want)


def test_quantize_saturates_divides_in_float32_and_keeps_nan():
    x = np.array([1e6, -1e6, np.inf, -np.inf, 448.0, 464.0, np.nan], np.float32)
    codes = fp8.quantize_e4m3(x, 1.0).view(np.uint8)
    assert codes.tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x7E, 0x7F]
    # the quotient is rounded to float32 before E4M3: 3 / 0.1f in float32, not in float64
    assert fp8.quantize_e4m3(np.float32(3.0), np.float32(0.1)) == (np.float32(3.0) / np.float32(0.1)).astype(E4M3)
    assert fp8.dequantize_e4m3(fp8.quantize_e4m3(np.float32(3.0), 0.5), 0.5) == 3.0
    # a scale is a float32, as the cache holds it: code 1.0 at scale 0.1 reads back as float32(0.1)
    assert fp8.dequantize_e4m3(fp8.quantize_e4m3(np.float32(1.0), 1.0), 0.1) == float(np.float32(0.1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_subnormal_rows_are_flushed_before_the_division_on_host_and_device(backend):
    # With k_scale = the smallest normal float32, x / scale is 1/4 for x = tiny / 4, a subnormal: the
    # device (-ftz=true) flushes x to a zero of its sign first, so the code is +-0, not E4M3(0.25). x =
    # tiny itself is normal and stores 1.0.
    tiny = np.finfo(np.float32).tiny
    row = np.zeros(8, np.float32)
    row[:4] = [tiny / 4, -tiny / 4, tiny, -tiny]
    want = [0x00, 0x80, 0x38, 0xB8]
    assert fp8.quantize_e4m3(row[:4], tiny).view(np.uint8).tolist() == want
    spec = _spec("float32", n_layers=1, n_kv_heads=1, max_seq=1, batch=1)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=tiny, v_scale=1.0)
    rows = row.reshape(1, 1, 1, 8)
    cache.append(0, cache.to_device(rows), cache.to_device(rows))
    assert _codes(cache.k, spec)[0, 0, 0, 0, :4].tolist() == want


def test_calibrate_scales_maps_each_heads_largest_value_to_448_without_saturating():
    rng = np.random.default_rng(3)
    samples = rng.standard_normal((3, 5, 7, 4, 16)) * np.array([1.0, 1e-3, 1e3, 0.0])[:, None]   # heads 0..3
    scales = fp8.calibrate_scales(samples)
    assert scales.shape == (3, 4) and scales.dtype == np.float32
    assert np.all(scales[:, 3] == 1.0)   # all-zero head
    for layer in range(3):
        for head in range(3):
            largest = np.abs(samples[layer, ..., head, :]).max()
            assert largest / scales[layer, head] <= 448.0
            assert largest / scales[layer, head] > 448.0 * (1 - 1e-6)
    # a head too small for a normal float32 scale (1e-42 / 448) gets the smallest normal one, never a
    # subnormal that the device's flush-to-zero would turn into a division by 0
    tiny = np.finfo(np.float32).tiny
    assert fp8.calibrate_scales(np.full((1, 1, 1, 2), 1e-42)).tolist() == [[tiny]]
    with pytest.raises(ValueError, match="samples: expected finite"):
        fp8.calibrate_scales(np.full((1, 2, 3), np.nan))
    with pytest.raises(ValueError, match=r"samples: expected a non-empty array .* got shape \(2, 3\)"):
        fp8.calibrate_scales(np.ones((2, 3)))
    for empty in ((1, 0, 2, 4), (1, 2, 0)):   # no tokens, or no features: no largest value to map
        with pytest.raises(ValueError, match=r"samples: expected a non-empty array .* got shape " + re.escape(str(empty))):
            fp8.calibrate_scales(np.ones(empty))


def test_calibrate_scales_keeps_a_scale_that_is_already_exact():
    """A head whose largest value is 448 * 2**k gets exactly 2**k: rounding up is only for a quotient
    that float32 rounded down (then the next float32 up keeps the largest value unsaturated)."""
    samples = np.zeros((1, 2, 3, 4), np.float32)
    samples[0, 1, 0, 2], samples[0, 0, 1, 3], samples[0, 1, 2, 0] = 448.0, -896.0, 448.0 / 1024
    assert fp8.calibrate_scales(samples).tolist() == [[1.0, 2.0, 1 / 1024]]
    # 450 / 448 rounds down to a float32 (450 / float32(450 / 448) > 448): the scale is the next one up;
    # 449 / 448 rounds up, and is kept
    rounded_down, rounded_up = np.float32(450 / 448), np.float32(449 / 448)
    assert 450 / float(rounded_down) > 448 and 449 / float(rounded_up) < 448
    scales = fp8.calibrate_scales(np.array([450.0, 449.0]).reshape(1, 1, 2, 1))
    assert scales.tolist() == [[np.nextafter(rounded_down, np.float32(2)), rounded_up]]


def test_calibrate_scales_takes_bfloat16_samples_and_refuses_ints():
    samples = np.array([[[[3.0, -448.0 * 4]]]], ml_dtypes.bfloat16)   # [1 layer, 1 token, 1 head, 2]
    assert fp8.calibrate_scales(samples).tolist() == [[4.0]]
    with pytest.raises(TypeError, match=r"^samples: expected a float array .*, got dtype int32$"):
        fp8.calibrate_scales(np.ones((1, 1, 1, 2), np.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_calibrate_scales_reads_a_device_array_of_either_backend_or_nested_lists(backend):
    samples = np.random.default_rng(5).standard_normal((2, 3, 2, 8)).astype(np.float32)
    on_device = get_backend(backend).asarray(samples)
    assert fp8.calibrate_scales(on_device).tobytes() == fp8.calibrate_scales(samples).tobytes()
    assert fp8.calibrate_scales(samples.tolist()).tobytes() == fp8.calibrate_scales(samples).tobytes()   # array_like


def test_dequantize_reads_uint8_bit_patterns_as_the_codes_they_hold():
    codes = np.array([0x38, 0xB8, 0x7E, 0x01], np.uint8)   # 1.0, -1.0, 448, the smallest subnormal 2**-9
    assert fp8.dequantize_e4m3(codes, 2.0).tolist() == [2.0, -2.0, 896.0, 2.0**-8]
    assert fp8.dequantize_e4m3(codes.view(E4M3), 2.0).tolist() == [2.0, -2.0, 896.0, 2.0**-8]


# -- stores, bit for bit ------------------------------------------------------------------------
@st.composite
def fp8_store_cases(draw):
    spec = draw(testing.specs(max_seqs=(1, 3, 8), head_dims=(2, 8, 64), dtypes=(FP8_DTYPE,)))
    exponents = draw(st.lists(st.integers(-130, 40), min_size=2 * spec.n_layers * spec.n_kv_heads,
                              max_size=2 * spec.n_layers * spec.n_kv_heads))
    scales = np.float32(2.0) ** np.array(exponents, np.float32).reshape(2, spec.n_layers, spec.n_kv_heads)
    odd = draw(st.booleans())   # scales that are not powers of two: the division rounds
    if odd:
        scales = (scales * np.float32(1.37)).astype(np.float32)
    scales = np.clip(scales, np.finfo(np.float32).tiny, 2.0 ** 100).astype(np.float32)
    lengths = draw(testing.lengths(spec))
    n_new = draw(st.integers(1, 4))
    rope = draw(st.none() | st.just(cupykv.Rope(theta=10000.0))) if spec.head_dim % 2 == 0 else None
    magnitude = draw(st.sampled_from([1.0, 1e-3, 1e3, 1e30, 1e-30]))
    return spec, scales, lengths, n_new, rope, magnitude, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=fp8_store_cases())
def test_fp8_append_and_write_match_the_reference_bit_for_bit(backend, case):
    spec, scales, lengths, n_new, rope, magnitude, seed = case
    rng = np.random.default_rng(seed)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=scales[0], v_scale=scales[1])
    oracle = reference.KVCache(spec, k_scale=scales[0], v_scale=scales[1])
    testing.fill(cache, oracle, lengths, rng, rope=rope)
    shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    # Rows past the io dtype's range become inf, and rope turns inf into NaN: both on purpose.
    with np.errstate(over="ignore", invalid="ignore"):
        k = testing.random_rows(rng, spec, shape, magnitude * scales[0].max())
        v = testing.random_rows(rng, spec, shape, magnitude * scales[1].max())
    k.reshape(-1)[::7] = np.nan   # NaN is stored as code 0x7F
    v.reshape(-1)[1::5] = np.inf  # saturates to 448
    layer = int(rng.integers(spec.n_layers))
    cache.append(layer, cache.to_device(k), cache.to_device(v), rope=rope)
    with np.errstate(over="ignore", invalid="ignore"):
        oracle.append(layer, k, v, rope=rope)
    # distinct positions per sequence from -1, 0 or 1 on: some out of range (flagged, not written)
    positions = np.arange(n_new)[None, :] - 1 + rng.integers(0, 3, size=(spec.batch, 1))
    cache.write(layer, positions.tolist(), cache.to_device(v), cache.to_device(k), rope=rope)
    with np.errstate(over="ignore", invalid="ignore"):
        oracle.write(layer, positions.tolist(), v, k, rope=rope)
    testing.assert_matches_reference(cache, oracle, rope_used=rope is not None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", IO_DTYPES)
def test_fp8_stores_round_ties_to_even_and_saturate_on_the_device(backend, io_dtype):
    # Every midpoint between two positive codes, times a power-of-two scale (so x / scale is the
    # exact midpoint): the kernel must round each to the even code, as the reference does.
    spec = _spec(io_dtype, n_layers=1, n_kv_heads=1, head_dim=128, max_seq=2, batch=1)
    positive = np.arange(0, 0x7E, dtype=np.uint8)
    low, high = positive.view(E4M3).astype(np.float64), (positive + 1).view(E4M3).astype(np.float64)
    midpoints = np.concatenate([(low + high) / 2, [512.0, -8192.0]])   # and two that saturate
    scale = 0.25 if io_dtype != "float16" else 2.0 ** -6   # midpoints * scale stay exact in the io dtype
    row = np.zeros(128)
    row[: midpoints.size] = midpoints * scale
    rows = row.astype(spec.io_np_dtype).reshape(1, 1, 1, 128)
    assert np.array_equal(rows.astype(np.float64).ravel(), row)   # exact in the io dtype
    cache = cupykv.KVCache(spec, backend=backend, k_scale=scale, v_scale=scale)
    cache.append(0, cache.to_device(rows), cache.to_device(-rows))
    got_k = _codes(cache.k, spec)[0, 0, 0, 0, : midpoints.size]
    got_v = _codes(cache.v, spec)[0, 0, 0, 0, : midpoints.size]
    even = np.where(positive % 2 == 0, positive, positive + 1)
    assert np.array_equal(got_k, np.concatenate([even, [0x7E, 0xFE]]))
    assert np.array_equal(got_v, np.concatenate([even | 0x80, [0xFE, 0x7E]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache_holds_half_the_bytes_of_a_bf16_cache(backend):
    fp8_cache = cupykv.KVCache(_spec(max_seq=64), backend=backend)
    bf16 = cupykv.KVCache(cupykv.CacheSpec(2, 2, 8, 64, batch=2, dtype="bfloat16"), backend=backend)
    assert fp8_cache.k.nbytes * 2 == bf16.k.nbytes
    assert fp8_cache.spec.nbytes * 2 == bf16.spec.nbytes


# -- scales ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_set_scales_reaches_a_captured_append_at_its_next_replay(backend):
    spec = _spec("float32", n_layers=1, n_kv_heads=2, max_seq=4, batch=1)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=1.0, v_scale=[[1.0, 2.0]])
    oracle = reference.KVCache(spec, k_scale=1.0, v_scale=[[1.0, 2.0]])
    rows = np.linspace(-3, 3, 16, dtype=np.float32).reshape(1, 1, 2, 8)
    k, v = cache.to_device(rows), cache.to_device(rows * 10)

    def step():
        cache.append(0, k, v)
        cache.advance(1)

    graph = cupykv.capture(step)   # runs the step once, at the first scales
    for scales in (None, ([[0.5, 0.125]], 4.0), ([[3.0, 1e-3]], None)):
        if scales is not None:
            cache.set_scales(*scales)
            oracle.set_scales(*scales)
            graph.replay()
        oracle.append(0, rows, rows * 10)
        oracle.advance(1)
        testing.assert_matches_reference(cache, oracle)
    assert np.array_equal(cache.scales_host()[0], np.float32([[3.0, 1e-3]]))
    assert np.array_equal(cache.scales_host()[1], [[4.0, 4.0]])
    # the steps stored different codes for the same rows
    stored = _codes(cache.k, spec)[0, 0]
    assert len({stored[i].tobytes() for i in range(3)}) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_scales_is_refused_inside_a_captured_step(backend):
    cache = cupykv.KVCache(_spec(), backend=backend)
    def step():
        cache.advance(1)
        cache.set_scales(2.0)

    with pytest.raises(cupykv.CaptureError, match="set_scales"):
        cupykv.capture(step)
    assert np.all(cache.scales_host()[0] == 2.0)   # set by the warm-up run, which is a real step


BAD_SCALES = [
    (float("nan"), ValueError, r"k_scale: expected every scale finite, > 0"),
    (0.0, ValueError, r"k_scale: expected every scale finite, > 0 .* got 0.0 at \[layer, kv_head\] = \(0, 0\)"),
    (-1.0, ValueError, r"k_scale: expected every scale finite, > 0"),
    (1e-45, ValueError, r"k_scale: expected every scale finite, > 0 and normal"),
    (np.ones((3, 2)), ValueError, r"k_scale: expected .* broadcastable to \[n_layers, n_kv_heads\] = \(2, 2\), "
                                  r"got shape \(3, 2\)"),
    ("1.0", TypeError, r"k_scale: expected .* of real numbers, got dtype <U3"),
    (True, TypeError, r"k_scale: expected a float or an array"),
    (np.array(1 + 0j), TypeError, r"k_scale: expected .* of real numbers, got dtype complex128"),
    # the first bad element is named, wherever it is
    (np.array([[2.0, 2.0], [np.inf, 0.0]]), ValueError, r"k_scale: expected every scale finite, .* got inf at "
                                                         r"\[layer, kv_head\] = \(1, 0\)$"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, error, message", BAD_SCALES)
def test_bad_scales_are_refused_by_name_and_change_nothing(backend, bad, error, message):
    with pytest.raises(error, match=message):
        cupykv.KVCache(_spec(), backend=backend, k_scale=bad)
    with pytest.raises(error, match=message):
        reference.KVCache(_spec(), k_scale=bad)
    cache = cupykv.KVCache(_spec(), backend=backend, k_scale=2.0, v_scale=3.0)
    oracle = reference.KVCache(_spec(), k_scale=2.0, v_scale=3.0)
    for twin in (cache, oracle):
        with pytest.raises(error, match=message):
            twin.set_scales(bad, 5.0)
        with pytest.raises(error, match=message.replace("k_scale", "v_scale")):
            twin.set_scales(5.0, bad)   # a good k_scale is not set either
        k_scales, v_scales = twin.scales_host() if twin is cache else (twin.k_scales, twin.v_scales)
        assert np.all(k_scales == 2.0) and np.all(v_scales == 3.0)   # neither scale changed


@pytest.mark.parametrize("backend", BACKENDS)
def test_scales_other_than_one_are_refused_for_unquantized_caches(backend):
    spec = cupykv.CacheSpec(1, 2, 8, 4, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"v_scale: expected 1.0 for a bfloat16 cache .* got 2.0"):
        cupykv.KVCache(spec, backend=backend, v_scale=2.0)
    cupykv.KVCache(spec, backend=backend, k_scale=1.0, v_scale=np.ones((1, 2)))   # ones are fine
    with pytest.raises(ValueError, match=r"k_scale: expected 1.0 for a bfloat16 cache .* got 0.5 at "
                                         r"\[layer, kv_head\] = \(0, 1\)$"):
        cupykv.KVCache(spec, backend=backend, k_scale=[[1.0, 0.5]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_scales_are_host_values_and_the_smallest_normal_is_one(backend):
    tiny = float(np.finfo(np.float32).tiny)
    cache = cupykv.KVCache(_spec(), backend=backend, k_scale=tiny, v_scale=np.float32(tiny))
    assert np.all(cache.scales_host()[0] == np.float32(tiny)) and np.all(cache.scales_host()[1] == np.float32(tiny))
    on_device = cache.to_device(np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match=r"^k_scale: expected a float or an array broadcastable to .* on the host, "
                                        r"got "):
        cache.set_scales(on_device, 1.0)


def test_io_dtype_is_checked_against_the_storage_dtype():
    assert _spec().io_dtype == "bfloat16" and cupykv.CacheSpec(1, 1, 8, 4, dtype=FP8_DTYPE).io_dtype == "bfloat16"
    assert cupykv.CacheSpec(1, 1, 8, 4, dtype="float16").io_dtype == "float16"
    with pytest.raises(ValueError, match=r"CacheSpec.io_dtype: expected 'float16' .* got 'float32'"):
        cupykv.CacheSpec(1, 1, 8, 4, dtype="float16", io_dtype="float32")
    with pytest.raises(ValueError, match=r"CacheSpec.io_dtype: expected one of 'float32', 'float16', 'bfloat16', "
                                         r"got 'float8_e4m3'"):
        cupykv.CacheSpec(1, 1, 8, 4, dtype=FP8_DTYPE, io_dtype=FP8_DTYPE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_and_queries_in_the_storage_dtype_are_refused_by_name(backend):
    spec = _spec("float16", n_layers=1, n_kv_heads=1, max_seq=4, batch=1)
    cache = cupykv.KVCache(spec, backend=backend)
    codes = cache.to_device(np.zeros((1, 1, 1, 8), E4M3))
    half = cache.to_device(np.zeros((1, 1, 1, 8), np.float16))
    with pytest.raises(TypeError, match=r"^k: expected dtype float16 .* got float8_e4m3fn|^k: expected dtype float16"):
        cache.append(0, codes, half)
    with pytest.raises(TypeError, match=r"^q: expected dtype float16"):
        cupykv.attention(codes, cache, 0)
    assert cache.lengths_host().tolist() == [0]
    assert not _codes(cache.k, spec).any()


# -- what quantization costs, against the K/V before it ------------------------------------------
@st.composite
def quantization_cases(draw):
    head_dim = draw(st.sampled_from([4, 16, 64]))
    keys = draw(st.integers(1, 24))
    magnitudes = draw(st.tuples(*(st.sampled_from([1e-3, 1.0, 30.0]) for _ in range(3))))
    headroom = draw(st.sampled_from([1.0, 4.0, 1e3]))   # scale = max / 448 * headroom: 1e3 pushes values subnormal
    return head_dim, keys, magnitudes, headroom, draw(st.integers(0, 2**32 - 1))


@given(case=quantization_cases())
def test_fp8_attention_error_against_unquantized_kv_stays_within_the_stated_bound(case):
    head_dim, keys, (q_size, k_size, v_size), headroom, seed = case
    rng = np.random.default_rng(seed)
    spec = cupykv.CacheSpec(1, 1, head_dim, keys, dtype=FP8_DTYPE, io_dtype="float32")
    exact_spec = cupykv.CacheSpec(1, 1, head_dim, keys, dtype="float32")
    q = (rng.standard_normal((1, 1, 2, head_dim)) * q_size).astype(np.float32)
    k = (rng.standard_normal((1, keys, 1, head_dim)) * k_size).astype(np.float32)
    v = (rng.standard_normal((1, keys, 1, head_dim)) * v_size).astype(np.float32)
    k_scale = np.float32(np.abs(k).max() / 448 * headroom)
    v_scale = np.float32(np.abs(v).max() / 448 * headroom)
    quantized = reference.KVCache(spec, k_scale=k_scale, v_scale=v_scale)
    exact = reference.KVCache(exact_spec)
    for cache in (quantized, exact):
        cache.append(0, k, v)
        cache.advance(keys - 1)   # the query sits at the last position
    scale = 1 / math.sqrt(head_dim)
    error = np.abs(reference.attention(q, quantized, 0) - reference.attention(q, exact, 0)).max()
    bound = tolerances.fp8_attention_bound(q, k, v, scale, k_scale, v_scale)
    target(float(error / bound), label="error / bound")
    assert error <= bound, f"quantization error {error:.3g} above the stated bound {bound:.3g}"
