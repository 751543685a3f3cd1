"""Kernel outputs whose every bit is determined, compared bit for bit: a store that rounds the wrong way fails.

Every 16-bit tolerance elsewhere is at least one ulp, so a float -> float16/bfloat16 store that
truncates instead of rounding to nearest even would pass them. These outputs leave no room:

- add: a + b of two storage values in fp32, then one rounding to the storage type, equals the
  exact sum rounded once (the reference), bit for bit. For float32 it is one IEEE addition. For a
  16-bit type with p <= 11 significand bits, the fp32 sum can be inexact only when the smaller
  operand is below about 2^(p - 24) of the larger (2^-13 for float16); the sum then lies closer
  to the larger operand than to any midpoint of the 16-bit type, in fp32 as exactly, and both
  round to the larger operand.
- append with rope: append.cu rotates in double and rounds to fp32, then to the storage type;
  the stored keys are compared with exactly that arithmetic done here (in double, with libm's
  sin/cos/pow), allowing every fp32 value within 2^-36 (|x_lo| + |x_hi|) of the double result
  (so more than one only near an fp32 midpoint, or where the pair cancels), far more than the
  few double ulps by which two libms (or the GPU's) sin, cos and pow may differ. The contract
  itself allows 1 ulp from the reference there, which a truncating store meets. Without rope
  append is a copy, already compared bit for bit over the whole cache by test_append.py, as
  embedding is by test_ops.py.
- attention with equal logits (q = 0) over 4 values in [1, 2) of a 16-bit type: every fp32 step
  is exact (p = exp(0) = 1, sums of 4 values of <= 11 bits, division by 4), so the output is the
  exact mean rounded once, with and without split-KV (the combine kernel's store).
"""
import math

import ml_dtypes
import numpy as np
import pytest

import cupykv
from cupykv import ops, ops_reference, reference, testing
from cupykv.backends import get_backend
from backends import BACKENDS

NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _bits(array):
    return testing.bits(np.asarray(array))


# -- add ----------------------------------------------------------------------------------------
def _ties(dtype):
    """Pairs (a, b) whose exact sum is a midpoint of the storage type: half go up to even, half down."""
    if dtype == "float32":
        return np.zeros((0,)), np.zeros((0,))
    p = 11 if dtype == "float16" else 8
    k = np.arange(64)
    a = np.concatenate([1 + k * 2.0 ** (1 - p), -(4 + k * 2.0 ** (3 - p))])
    b = np.concatenate([np.full(64, 2.0 ** -p), np.full(64, -(2.0 ** (2 - p)))])
    return a, b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [4096, 4099])   # 16-byte vectors, and single elements
def test_add_rounds_the_exact_sum_once(backend, dtype, n):
    rng = np.random.default_rng(n)
    np_dtype = NP_DTYPES[dtype]
    tie_a, tie_b = _ties(dtype)
    scales = np.exp2(rng.integers(-14, 12, n - tie_a.size))          # from cancelling to 2^-26 apart
    a = np.concatenate([tie_a, rng.standard_normal(n - tie_a.size)]).astype(np_dtype)
    b = np.concatenate([tie_b, rng.standard_normal(n - tie_b.size) * scales]).astype(np_dtype)
    device = get_backend(backend)
    got = device.to_host(ops.add(device.asarray(a), device.asarray(b), backend=backend)).view(np_dtype)
    want = ops_reference.add(a, b)
    wrong = np.flatnonzero(_bits(got) != _bits(want))
    assert wrong.size == 0, (f"add ({dtype}): {wrong.size} of {n} sums not rounded once to nearest even, e.g. "
                             + ", ".join(f"{a[i]!r} + {b[i]!r}: got {got[i]!r}, want {want[i]!r}" for i in wrong[:3]))


# -- append with rope ---------------------------------------------------------------------------
def _rope_store_candidates(x_lo, x_hi, pos, i, head_dim, theta, dtype):
    """Bit patterns append.cu may store for the rotated pair: double math, then fp32, then the storage type."""
    angle = pos * math.pow(theta, -2.0 * i / head_dim)
    cos_a, sin_a = math.cos(angle), math.sin(angle)
    margin = 2.0 ** -36 * (abs(x_lo) + abs(x_hi))
    out = []
    for value in (x_lo * cos_a - x_hi * sin_a, x_hi * cos_a + x_lo * sin_a):
        fp32, last = np.float32(value - margin), np.float32(value + margin)   # one, but near a midpoint
        candidates = {fp32}
        while fp32 < last:
            fp32 = np.nextafter(fp32, np.float32(np.inf))
            candidates.add(fp32)
        out.append({int(_bits(np.array(f, np.float32).astype(NP_DTYPES[dtype]))) for f in candidates})
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_with_rope_stores_the_documented_rounding(backend, dtype, layout):
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, max_seq=64, batch=3, dtype=dtype, layout=layout)
    rope, lengths, n_new = cupykv.Rope(theta=10000.0), [0, 13, 50], 8
    rng = np.random.default_rng(len(layout) + len(dtype))
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, lengths, rng)
    shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    k, v = testing.random_rows(rng, spec, shape, scale=3.0), testing.random_rows(rng, spec, shape)
    cache.append(1, cache.to_device(k), cache.to_device(v), rope=rope)
    oracle.append(1, k, v, rope=rope)
    testing.assert_matches_reference(cache, oracle, rope_used=True)   # V bit for bit, K within 1 ulp
    stored = _bits(testing.to_numpy(cache.k, spec))[1]                 # [batch, ...] of layer 1
    half, wrong = spec.head_dim // 2, []
    k64 = k.astype(np.float64)
    for b, length in enumerate(lengths):
        for row in range(n_new):
            pos = length + row
            got = stored[b, pos] if layout == "NHD" else stored[b, :, pos]   # [n_kv, hd]
            for h in range(spec.n_kv_heads):
                for i in range(half):
                    lo, hi = _rope_store_candidates(k64[b, row, h, i], k64[b, row, h, i + half], pos, i,
                                                    spec.head_dim, rope.theta, dtype)
                    for d, allowed in ((i, lo), (i + half, hi)):
                        if int(got[h, d]) not in allowed:
                            wrong.append((b, pos, h, d, hex(int(got[h, d])), sorted(hex(x) for x in allowed)))
    assert not wrong, (f"{len(wrong)} rotated keys not rounded as documented, "
                       f"e.g. (b, pos, head, dim, got, want) {wrong[:3]}")


# -- attention with equal logits -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_of_equal_logits_is_the_exact_mean_rounded_once(backend, dtype, num_splits):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, max_seq=200, batch=2, dtype=dtype)
    precision = 11 if dtype == "float16" else 8                               # significand bits
    rng = np.random.default_rng(num_splits)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [9, 150], rng)
    values = 1 + rng.integers(0, 2 ** (precision - 1), spec.shape) * 2.0 ** (1 - precision)   # exact in dtype
    cache.v[...] = cache.to_device(values.astype(spec.np_dtype))
    oracle.v[...] = values.astype(spec.np_dtype)
    q_len, window = 3, 4                                                      # every query attends 4 rows
    q = np.zeros((spec.batch, q_len, 4, spec.head_dim), spec.np_dtype)
    got = cupykv.attention(cache.to_device(q), cache, 0, window=window, num_splits=num_splits)
    want = reference.round_to_storage(reference.attention(q, oracle, 0, window=window), spec.np_dtype)
    got = testing.to_numpy(got, spec)
    wrong = np.argwhere(_bits(got) != _bits(want))
    examples = [(i, got[tuple(i)], want[tuple(i)]) for i in wrong[:3].tolist()]
    assert wrong.size == 0, f"{len(wrong)} outputs are not the exact mean rounded once, e.g. (at, got, want) {examples}"
