"""Public test helpers: check a cupykv backend, or your own pipeline, against the reference.

Needs the ``test`` extra (hypothesis). The pieces:

- :func:`specs`: a hypothesis strategy for :class:`CacheSpec`;
- :func:`to_numpy`, :func:`random_rows`: move data between host and a cache's backend;
- :func:`fill`: give a backend cache and a reference cache the same committed rows;
- :func:`poison_tail`: write NaN past the live rows, to prove a kernel never reads them;
- :func:`assert_matches_reference`: lengths, overflow flags and the whole K/V cache.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from cupykv import reference
from cupykv.spec import DTYPES, LAYOUTS, CacheSpec
from cupykv.tolerances import ulp_distance


@st.composite
def specs(draw, *, max_layers=2, kv_heads=(1, 2, 4), head_dims=(2, 4, 8, 16, 64, 128), max_seqs=(1, 4, 16),
          max_batch=3, dtypes=DTYPES, layouts=LAYOUTS):
    """Strategy for CacheSpec over the given choices (defaults keep examples small)."""
    return CacheSpec(
        n_layers=draw(st.integers(1, max_layers)),
        n_kv_heads=draw(st.sampled_from(kv_heads)),
        head_dim=draw(st.sampled_from(head_dims)),
        max_seq=draw(st.sampled_from(max_seqs)) if isinstance(max_seqs, tuple) else draw(max_seqs),
        batch=draw(st.integers(1, max_batch)),
        dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(layouts)),
    )


def to_numpy(array, spec: CacheSpec) -> np.ndarray:
    """Host copy of a backend array that holds cache-dtype values, viewed as ``spec.np_dtype``."""
    host = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
    return np.array(host, copy=True).view(spec.np_dtype) if host.dtype.itemsize == spec.itemsize else host


def bits(array) -> np.ndarray:
    """The raw bit patterns of a float array (uint16 or uint32), for exact comparisons."""
    array = np.asarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def random_rows(rng: np.random.Generator, spec: CacheSpec, shape, scale: float = 1.0) -> np.ndarray:
    """Normal random values in the cache dtype, ``shape`` as given."""
    return (rng.standard_normal(shape) * scale).astype(spec.np_dtype)


def fill(cache, oracle: "reference.KVCache", lengths, rng: np.random.Generator, rope=None) -> None:
    """Reset both caches and give them identical committed rows, ``lengths[b]`` per sequence.

    Goes through the public API only (reset, append at every layer, advance
    per sequence), so it works on any backend.
    """
    spec = cache.spec
    lengths = np.asarray(lengths, dtype=np.int64)
    cache.reset()
    oracle.reset()
    rows = int(lengths.max(initial=0))
    if rows:
        shape = (spec.batch, rows, spec.n_kv_heads, spec.head_dim)
        for layer in range(spec.n_layers):
            k, v = random_rows(rng, spec, shape), random_rows(rng, spec, shape)
            cache.append(layer, cache._backend.asarray(k), cache._backend.asarray(v), rope=rope)
            oracle.append(layer, k, v, rope=rope)
    cache.advance(lengths)
    oracle.advance(lengths)


def poison_tail(cache, start) -> None:
    """Write NaN into every layer of K and V at positions ``>= start[b]`` of sequence ``b``."""
    spec = cache.spec
    nan = np.array(np.nan, dtype=spec.np_dtype)
    nan_value = nan.view(np.uint16)[()] if spec.dtype == "bfloat16" and cache.backend == "cupy" else nan
    for b, first in enumerate(np.asarray(start).tolist()):
        first = max(0, min(int(first), spec.max_seq))
        index = (slice(None), b, slice(first, None)) if spec.layout == "NHD" else \
            (slice(None), b, slice(None), slice(first, None))
        cache.k[index] = nan_value
        cache.v[index] = nan_value


def assert_matches_reference(cache, oracle: "reference.KVCache", *, rope_used: bool = False) -> None:
    """Assert that a backend cache holds exactly what the reference holds.

    Compares lengths and overflow flags exactly, the whole V cache bit for bit,
    and the whole K cache bit for bit (within 1 ulp where keys were rotated by
    rope, see :mod:`cupykv.tolerances`).
    """
    spec = cache.spec
    lengths = np.asarray(cache.lengths_host())
    assert np.array_equal(lengths, oracle.lengths), f"lengths {lengths.tolist()} != reference {oracle.lengths.tolist()}"
    overflow = np.asarray(cache._backend.to_host(cache.overflow)).astype(bool)
    assert np.array_equal(overflow, oracle.overflow), \
        f"overflow {overflow.tolist()} != reference {oracle.overflow.tolist()}"
    for name, got, want in (("v", cache.v, oracle.v), ("k", cache.k, oracle.k)):
        got = to_numpy(got, spec)
        if name == "k" and rope_used:
            distance = ulp_distance(got, want)
            if distance.max(initial=0) > 1:
                where = np.argwhere(distance > 1)[:5].tolist()
                raise AssertionError(f"k differs from the reference by more than 1 ulp at {where}")
        elif not np.array_equal(bits(got), bits(want)):
            where = np.argwhere(bits(got) != bits(want))[:5].tolist()
            raise AssertionError(f"{name} differs from the reference (bitwise) at {where} "
                                 f"(indices into {spec.layout} shape {spec.shape})")
