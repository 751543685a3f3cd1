"""``python -m cupykv demo``: a batched decode loop on the kernels, checked against the reference.

Random projections stand in for a model: each step appends one K/V row per
layer for every sequence, runs attention at the new position, and advances.
The same calls run on ``cupykv.reference``; the demo compares stored rows bit
for bit and attention within the stated tolerance, rolls two sequences back
with ``truncate`` as speculative decoding does, and finally overflows one
sequence on purpose to show that ``check()`` raises and nothing past capacity
was written.
"""
from __future__ import annotations

import time

import numpy as np

import cupykv
from cupykv import reference
from cupykv.tolerances import attention_error, ulp_distance


def _bits(array) -> np.ndarray:
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _cache_matches(k, v, oracle) -> bool:
    return np.array_equal(_bits(v), _bits(oracle.v)) and int(ulp_distance(k, oracle.k).max()) <= 1


def run_demo(backend=None, steps=12, seed=0) -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, max_seq=48, batch=3, dtype="bfloat16")
    n_heads = 8
    rope = cupykv.Rope(theta=10000.0)
    cache = cupykv.KVCache(spec, backend=backend)
    oracle = reference.KVCache(spec)
    xp = cache.xp
    rng = np.random.default_rng(seed)
    storage = spec.np_dtype
    print(f"cupykv {cupykv.__version__} demo on backend '{cache.backend}'")
    print(f"  cache: {spec}")
    print(f"  {spec.nbytes / 2**20:.2f} MiB of K+V, GQA {n_heads}/{spec.n_kv_heads}, rope theta {rope.theta}")

    def to_host(array) -> np.ndarray:
        return (xp.asnumpy(array) if cache.backend == "cupy" else np.asarray(array)).view(storage)

    def to_device(host):
        return xp.asarray(host.view(np.uint16)) if cache.backend == "cupy" and spec.dtype == "bfloat16" \
            else (xp.asarray(host) if cache.backend == "cupy" else host)

    def step(n_new):
        worst = 0.0
        for layer in range(spec.n_layers):
            k = rng.standard_normal((spec.batch, n_new, spec.n_kv_heads, spec.head_dim)).astype(storage)
            v = rng.standard_normal((spec.batch, n_new, spec.n_kv_heads, spec.head_dim)).astype(storage)
            q = rng.standard_normal((spec.batch, n_new, n_heads, spec.head_dim)).astype(storage)
            cache.append(layer, to_device(k), to_device(v), rope=rope)
            oracle.append(layer, k, v, rope=rope)
            got = to_host(cupykv.attention(to_device(q), cache, layer, rope=rope))
            want = reference.attention(q, oracle, layer, rope=rope)
            worst = max(worst, attention_error(got, want, spec.dtype, float(np.abs(oracle.v[layer].astype(np.float64)).max())))
        cache.advance(n_new)
        oracle.advance(n_new)
        return worst

    failures = []
    started = time.perf_counter()
    worst = step(8)  # prefill 8 tokens for every sequence
    for _ in range(steps):
        worst = max(worst, step(1))
    elapsed = time.perf_counter() - started
    print(f"  prefill 8 + decode {steps} steps x {spec.n_layers} layers: {elapsed:.2f} s")
    print(f"  lengths {cache.lengths_host().tolist()} (reference {oracle.lengths.tolist()})")
    print(f"  worst attention error / tolerance: {worst:.3f} (must be <= 1)")
    if worst > 1.0:
        failures.append("attention differs from the reference beyond tolerance")

    cache.truncate([5, cache.lengths_host()[1], 3])  # speculative rollback of sequences 0 and 2
    oracle.truncate([5, oracle.lengths[1], 3])
    worst = step(1)
    print(f"  after truncate to {cache.lengths_host().tolist()}: error / tolerance {worst:.3f}")
    if worst > 1.0:
        failures.append("attention after truncate differs from the reference")

    rows_match = _cache_matches(to_host(cache.k), to_host(cache.v), oracle)
    print(f"  whole cache matches the reference (V bit for bit, rotated K within 1 ulp): {rows_match}")
    if not rows_match:
        failures.append("cache contents differ from the reference")

    # Overflow on purpose: more new rows than sequence 0 has room for.
    room = spec.max_seq - int(cache.lengths_host().min())
    k = rng.standard_normal((spec.batch, room + 2, spec.n_kv_heads, spec.head_dim)).astype(storage)
    cache.append(0, to_device(k), to_device(k))
    oracle.append(0, k, k)
    try:
        cache.check()
        failures.append("overflow was not reported")
    except cupykv.CacheOverflowError as exc:
        print(f"  overflow caught by check(): {exc}")
    same = _cache_matches(to_host(cache.k), to_host(cache.v), oracle)
    print(f"  after the overflowing append, the cache still matches the reference: {same}")
    if not same:
        failures.append("overflowing append wrote differently from the reference")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("demo: OK" if not failures else "demo: FAILED")
    return 1 if failures else 0
