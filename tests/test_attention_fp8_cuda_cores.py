"""attention over fp8 (E4M3) caches on CUDA cores (attention.cu: head sizes whose rows are not whole
16-byte copies, here 72 and 40; a multiple of 16 runs on tensor cores).

The cache stores codes; the kernel dots q with raw codes and applies the per-(layer, kv head)
scales once (q by scale * k_scale, the output by v_scale). Checked against reference.attention,
which attends over ``code * scale`` in float64, within the tolerance of the io dtype.
"""
import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from cupykv.fp8 import dequantize_e4m3
from cupykv.kernels import attention_instance
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS

IO_DTYPES = ("bfloat16", "float16", "float32")
NAN_CODE = 0x7F


def fp8_spec(head_dim, group, io_dtype, max_seq=320):
    return cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=head_dim, max_seq=max_seq, batch=2,
                            dtype="float8_e4m3", io_dtype=io_dtype, layout="NHD" if group == 1 else "HND")


def distinct_scales(rng, spec, lo, hi):
    """A different scale for every (layer, kv head): a kernel reading the wrong one is caught."""
    return rng.uniform(lo, hi, (spec.n_layers, spec.n_kv_heads)).astype(np.float32)


def host_output(array, spec):
    """A backend output as a NumPy array of the io dtype (CuPy holds bfloat16 as uint16 bits)."""
    host = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
    return np.array(host, copy=True).view(spec.io_np_dtype)


def dequantized_v(oracle, layer):
    """float64 values every V element of ``layer`` stands for (live or not), any layout."""
    spec = oracle.spec
    scales = oracle.v_scales[layer]   # [n_kv]
    shape = (spec.n_kv_heads, 1) if spec.layout == "NHD" else (spec.n_kv_heads, 1, 1)
    return dequantize_e4m3(oracle.v[layer], scales.reshape(shape))


def poison_tail_codes(cache, start):
    """Write the E4M3 NaN code 0x7F into K and V of every layer at positions >= start[b] of sequence b."""
    spec = cache.spec
    k, v = (cache._backend.to_host(a) for a in (cache.k, cache.v))
    for b, first in enumerate(np.asarray(start).tolist()):
        index = (slice(None), b, slice(first, None)) if spec.layout == "NHD" else \
            (slice(None), b, slice(None), slice(first, None))
        for host in (k, v):
            host.view(np.uint8)[index] = NAN_CODE
    cache._backend.upload(cache.k, k)
    cache._backend.upload(cache.v, v)
    stored = cache._backend.to_host(cache.k).view(np.uint8)
    assert np.isnan(np.asarray(stored.view(spec.np_dtype), np.float32)).sum() > 0


def run_fp8_case(backend, spec, group, q_len, lengths, num_splits, rope, seed, layer=1, **options):
    rng = np.random.default_rng(seed)
    k_scale, v_scale = distinct_scales(rng, spec, 0.004, 0.03), distinct_scales(rng, spec, 0.002, 0.02)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=k_scale, v_scale=v_scale)
    oracle = reference.KVCache(spec, k_scale=k_scale, v_scale=v_scale)
    testing.fill(cache, oracle, lengths, rng, rope=rope)
    # the q_len pending rows, then NaN codes everywhere past them: a read of the tail poisons the output
    shape = (spec.batch, q_len, spec.n_kv_heads, spec.head_dim)
    k, v = testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)
    cache.append(layer, cache.to_device(k), cache.to_device(v), rope=rope)
    oracle.append(layer, k, v, rope=rope)
    poison_tail_codes(cache, np.asarray(lengths) + q_len)
    q = testing.random_rows(rng, spec, (spec.batch, q_len, group * spec.n_kv_heads, spec.head_dim))
    got = cupykv.attention(cache.to_device(q), cache, layer, num_splits=num_splits, rope=rope, **options)
    want = reference.attention(q, oracle, layer, rope=rope, **options)
    got = host_output(got, spec)
    assert got.dtype == spec.io_np_dtype
    assert not np.isnan(got.astype(np.float32)).any()
    value_scale = float(np.abs(dequantized_v(oracle, layer)).max())
    assert_attention_close(got, want, spec.io_dtype, value_scale,
                           context=f"({spec}, group {group}, q_len {q_len}, lengths {lengths}, splits {num_splits}, "
                                   f"rope {rope}, {options})")
    return got


@pytest.mark.parametrize("io_dtype", IO_DTYPES)
@pytest.mark.parametrize("head_dim", [72, 40])
def test_fp8_attention_runs_on_cuda_cores(io_dtype, head_dim):
    op, instance = attention_instance("float8_e4m3", head_dim, io_dtype)
    assert op == "attention"
    assert instance.endswith(", 0>") and instance.startswith("cupykv_attention<__nv_fp8_e4m3, ")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", IO_DTYPES)
@pytest.mark.parametrize("head_dim", [72, 40])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("use_rope", [False, True])
def test_fp8_attention_matches_reference(backend, io_dtype, head_dim, q_len, group, num_splits, use_rope):
    # 200 live rows: a full chunk of 128 and a partial one, so two splits each hold keys; 37: one chunk
    spec = fp8_spec(head_dim, group, io_dtype)
    rope = cupykv.Rope(theta=10000.0) if use_rope else None
    run_fp8_case(backend, spec, group, q_len, [200, 37], num_splits, rope, seed=head_dim + 7 * q_len + group)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", IO_DTYPES)
def test_fp8_attention_with_window_and_softcap(backend, io_dtype):
    spec = fp8_spec(40, 2, io_dtype)
    run_fp8_case(backend, spec, 2, 2, [150, 5], 2, None, seed=3, layer=0, window=60, softcap=5.0, scale=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", IO_DTYPES)
def test_fp8_attention_reads_the_scales_at_run_time(backend, io_dtype):
    # set_scales keeps the codes: the same plan's next run attends over code * new scale
    spec = fp8_spec(40, 1, io_dtype, max_seq=64)
    rng = np.random.default_rng(5)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [20, 9], rng)
    q = testing.random_rows(rng, spec, (spec.batch, 1, spec.n_kv_heads, spec.head_dim))
    plan = cupykv.AttentionPlan(cache, 1, spec.n_kv_heads, num_splits=1)
    before = host_output(plan.run(cache.to_device(q), 1), spec)
    assert_attention_close(before, reference.attention(q, oracle, 1), spec.io_dtype,
                           float(np.abs(dequantized_v(oracle, 1)).max()))
    k_scale, v_scale = distinct_scales(rng, spec, 0.05, 0.5), distinct_scales(rng, spec, 2.0, 8.0)
    cache.set_scales(k_scale, v_scale)
    oracle.set_scales(k_scale, v_scale)
    after = host_output(plan.run(cache.to_device(q), 1), spec)
    want = reference.attention(q, oracle, 1)
    assert_attention_close(after, want, spec.io_dtype, float(np.abs(dequantized_v(oracle, 1)).max()),
                           logit_error=0.0)
    assert np.abs(after.astype(np.float64)).max() > 2 * np.abs(before.astype(np.float64)).max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_query_with_nothing_to_attend_to_gives_zeros(backend, num_splits):
    # Sequence 0 is full; its queries sit past max_seq and a window of 1 keeps no position.
    spec = fp8_spec(40, 1, "float32", max_seq=256)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=0.01, v_scale=0.01)
    oracle = reference.KVCache(spec, k_scale=0.01, v_scale=0.01)
    testing.fill(cache, oracle, [256, 1], np.random.default_rng(0))
    q = testing.random_rows(np.random.default_rng(1), spec, (2, 2, 2, 40))
    got = host_output(cupykv.attention(cache.to_device(q), cache, 0, window=1, num_splits=num_splits), spec)
    want = reference.attention(q, oracle, 0, window=1)
    assert not np.isnan(got).any()
    assert np.all(got[0] == 0) and np.all(want[0] == 0)
    assert np.abs(got[1]).max() > 0
