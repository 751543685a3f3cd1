"""The measured sections: copy, decode attention, live length vs full axis, linear.

Each section takes a :class:`Context` and returns a dict with ``status``,
``description``, ``params``, ``units``, ``results`` (one row per point) and
``checks`` (relative errors against a float32 computation of the same
inputs, taken before anything is timed). Bandwidths are in GB/s (1e9 bytes
per second); every ratio is computed from two figures of this run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import cupykv
from cupykv.bench.arrays import fill_random, random_array, relative_error, to_f32

if TYPE_CHECKING:
    from cupykv.backends.base import Backend
    from cupykv.bench import Plan
    from cupykv.bench.timing import Timing

GB = 1e9
ERROR_LIMIT = 1e-2  # bf16 outputs: one rounding to bfloat16 is about 2e-3 relative


@dataclass
class Context:
    """What every section needs: the backend, the sizes, the timer, and the copy yardstick."""

    backend: Backend
    plan: Plan
    timer: Callable[..., Timing]   # timer(fn, flush=True) -> Timing (cupykv.bench.timing.make_timer)
    copy_GBps: float = math.nan


def _check(name: str, error: float, limit: float = ERROR_LIMIT) -> dict:
    return {"what": name, "relative_error": error, "limit": limit, "passed": bool(error <= limit)}


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


# -- copy bandwidth --------------------------------------------------------------
def copy_bandwidth(ctx: Context) -> dict:
    """Device-to-device copy of one large buffer: the yardstick for the other sections."""
    backend, nbytes = ctx.backend, ctx.plan.copy_bytes
    xp = backend.xp
    src = random_array(backend, (nbytes // 4,), "float32", seed=1)
    dst = backend.zeros((nbytes // 4,), np.float32)
    emulated = backend.device_info().emulated

    def copy():  # cudaMemcpyAsync device to device (NumPy's copy in host memory on the emulator)
        backend.copy(dst, src)
    timing = ctx.timer(copy, flush=False)  # the buffer is far larger than L2
    check = float(xp.abs(dst - src).max())
    ctx.copy_GBps = _rate(2 * src.nbytes, timing.median_s)
    return {
        "status": "ok",
        "description": "device-to-device copy of one buffer; bandwidth counts bytes read plus bytes written "
                       "(2 x buffer bytes / time)",
        "params": {"buffer_bytes": int(src.nbytes), "method": "numpy.copyto in host memory" if emulated
                   else "cudaMemcpyAsync"},
        "units": {"bytes_moved": "bytes (read + written)", "time_ms": "ms, median", "bandwidth_GBps": "1e9 bytes/s"},
        "results": [{"bytes_moved": int(2 * src.nbytes), **timing.as_ms(), "bandwidth_GBps": ctx.copy_GBps}],
        "checks": [{"what": "copy equals source", "max_abs_difference": check, "passed": check == 0.0}],
    }


# -- attention -------------------------------------------------------------------
def _host_matmul(a, b):
    """NumPy matmul without BLAS: single-threaded C loops, steady on a busy host.

    Host BLAS threads ran some calls 100x slower than others on the shared
    2-core CI machine, which made the emulator's stand-in baseline meaningless.
    """
    return np.einsum("...ij,...jk->...ik", a, b)


def _matmul(xp):
    return xp.matmul if xp is not np else _host_matmul


def _attention_f32(xp, q, k_t, v, mask, scale):
    """Whole-axis attention: ``softmax(q k^T * scale + mask) v`` with cuBLAS-style matmuls.

    q ``[batch, n_kv, group, hd]``, k_t ``[batch, n_kv, hd, seq]``, v ``[batch, n_kv, seq, hd]``,
    mask float32 ``[batch, 1, 1, seq]`` or None. Scores and softmax are float32
    (as in eager Hugging Face attention); the matmuls run in the operands' dtype.
    Returns ``[batch, n_kv, group, hd]`` in that dtype.
    """
    matmul = _matmul(xp)
    scores = matmul(q, k_t).astype(xp.float32)      # [batch, n_kv, group, seq]
    scores *= xp.float32(scale)
    if mask is not None:
        scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    weights = xp.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return matmul(weights.astype(v.dtype), v)       # [batch, n_kv, group, hd]


def _reference(backend, q, cache, live: int):
    """float32 attention of ``q`` over the first ``live`` rows of layer 0: ``[batch, 1, n_heads, hd]``."""
    xp, spec = backend.xp, cache.spec
    batch, _, n_heads, hd = q.shape
    k = to_f32(backend, cache.k[0][:, :live])              # [batch, live, n_kv, hd]
    v = to_f32(backend, cache.v[0][:, :live])
    q32 = to_f32(backend, q).reshape(batch, spec.n_kv_heads, n_heads // spec.n_kv_heads, hd)
    out = _attention_f32(xp, q32, xp.ascontiguousarray(k.transpose(0, 2, 3, 1)),
                         xp.ascontiguousarray(v.transpose(0, 2, 1, 3)), None, 1.0 / math.sqrt(hd))
    return out.reshape(batch, 1, n_heads, hd)


def _decode_cache(ctx: Context, batch: int, max_seq: int, seed: int):
    """A one-layer bf16 cache filled with random K/V, a random query and an output buffer."""
    plan, backend = ctx.plan, ctx.backend
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=plan.n_kv_heads, head_dim=plan.head_dim, max_seq=max_seq,
                            batch=batch, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend=backend.name)
    fill_random(backend, cache.k, "bfloat16", seed)
    fill_random(backend, cache.v, "bfloat16", seed + 1)
    q = random_array(backend, (batch, 1, plan.n_heads, plan.head_dim), "bfloat16", seed + 2)
    out = backend.zeros(q.shape, backend.storage_dtype("bfloat16"))
    return cache, q, out


def _set_live(cache, live: int) -> None:
    """Make the decode query attend to exactly ``live`` rows: lengths = live - 1 plus its own pending row."""
    cache.reset()
    cache.advance(live - 1)


def _kv_bytes(plan, batch: int, keys: int) -> int:
    """Bytes of K and V (2 bytes each) that attending ``keys`` rows of every sequence reads."""
    return batch * keys * plan.n_kv_heads * plan.head_dim * 2 * 2


def _decode_points(ctx: Context, batch: int, results: list, checks: list) -> None:
    """The decode rows of one batch size: one cache, every live length (the cache is freed on return)."""
    plan, backend = ctx.plan, ctx.backend
    cache, q, out = _decode_cache(ctx, batch, plan.decode_max_seq, seed=10 + batch)
    for i, live in enumerate(plan.decode_lives):
        _set_live(cache, live)
        if i == 0:
            cupykv.attention(q, cache, 0, out=out)
            checks.append(_check(f"attention batch {batch} live {live} vs float32",
                                 relative_error(backend, out, _reference(backend, q, cache, live))))
        timing = ctx.timer(lambda: cupykv.attention(q, cache, 0, out=out))
        nbytes = _kv_bytes(plan, batch, live)
        bandwidth = _rate(nbytes, timing.median_s)
        results.append({"batch": batch, "live_len": live, "kv_bytes": nbytes, **timing.as_ms(),
                        "bandwidth_GBps": bandwidth, "pct_of_copy": 100.0 * bandwidth / ctx.copy_GBps})


def attention_decode(ctx: Context) -> dict:
    """Decode attention (q_len 1, bf16) bandwidth over live K+V bytes, per batch and live length."""
    plan = ctx.plan
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for batch in plan.decode_batches:
        _decode_points(ctx, batch, results, checks)
    return {
        "status": "ok",
        "description": "cupykv.attention decode step (q_len 1, GQA, bfloat16); bandwidth = live K+V bytes read "
                       "(batch * live_len * n_kv_heads * head_dim * 2 (K and V) * 2 bytes) / time; live_len counts "
                       "the keys each query attends to, its own pending row included",
        "params": {"n_heads": plan.n_heads, "n_kv_heads": plan.n_kv_heads, "head_dim": plan.head_dim,
                   "dtype": "bfloat16", "q_len": 1, "max_seq": plan.decode_max_seq,
                   "batches": list(plan.decode_batches), "live_lens": list(plan.decode_lives)},
        "units": {"kv_bytes": "bytes read", "time_ms": "ms, median", "bandwidth_GBps": "1e9 bytes/s",
                  "pct_of_copy": "percent of the copy section's bandwidth (read + write)"},
        "results": results,
        "checks": checks,
    }


def full_axis(ctx: Context) -> dict:
    """cupykv.attention (live rows only) against whole-axis matmul attention at a fixed max_seq."""
    plan, backend = ctx.plan, ctx.backend
    xp, max_seq, batch = backend.xp, plan.full_axis_max_seq, plan.full_axis_batch
    group, hd = plan.n_heads // plan.n_kv_heads, plan.head_dim
    cache, q, out = _decode_cache(ctx, batch, max_seq, seed=100)
    emulated = backend.device_info().emulated
    base_dtype = xp.float32 if emulated else xp.float16
    # The baseline's operands hold the cache's own values, whole axis, K pre-transposed (its best case).
    k_t = xp.ascontiguousarray(to_f32(backend, cache.k[0]).transpose(0, 2, 3, 1)).astype(base_dtype)
    v = xp.ascontiguousarray(to_f32(backend, cache.v[0]).transpose(0, 2, 1, 3)).astype(base_dtype)
    q_b = to_f32(backend, q).reshape(batch, plan.n_kv_heads, group, hd).astype(base_dtype)
    mask = backend.zeros((batch, 1, 1, max_seq), np.float32)
    scale = 1.0 / math.sqrt(hd)

    def baseline():
        return _attention_f32(xp, q_b, k_t, v, mask, scale)

    results, checks = [], []
    for divisor in plan.full_axis_divisors:
        live = max_seq // divisor
        _set_live(cache, live)
        cache.additive_mask(1, out=mask)   # once per step, shared by all layers: not timed
        if divisor == plan.full_axis_check_divisor:
            cupykv.attention(q, cache, 0, out=out)
            want = _reference(backend, q, cache, live)
            checks.append(_check(f"cupykv live {live} vs float32", relative_error(backend, out, want)))
            got = baseline().reshape(batch, 1, plan.n_heads, hd)
            checks.append(_check(f"full-axis baseline live {live} vs float32", relative_error(backend, got, want)))
        cupykv_time = ctx.timer(lambda: cupykv.attention(q, cache, 0, out=out))
        baseline_time = ctx.timer(baseline)
        results.append({"live_len": live, "live_fraction": live / max_seq, **cupykv_time.as_ms("cupykv_time"),
                        **baseline_time.as_ms("baseline_time"),
                        "ratio_baseline_over_cupykv": baseline_time.median_s / cupykv_time.median_s})
    if not emulated:
        baseline_name = ("CuPy (cuBLAS) float16 matmul q @ K^T over the whole max_seq axis, + additive_mask, "
                         "float32 softmax, float16 matmul with V; float16 because CuPy has no bfloat16 "
                         "(cupykv's bf16 is uint16 bits), same shapes and bytes per element")
    else:
        baseline_name = ("emulator stand-in: NumPy float32 matmul (einsum, no BLAS threads) q @ K^T over the whole "
                         "max_seq axis, + additive_mask, float32 softmax, matmul with V; not a GPU baseline")
    return {
        "status": "ok",
        "description": "time of cupykv.attention (reads live rows only) vs the whole-axis approach of other "
                       "static caches, at a fixed max_seq, per live length; ratio = baseline / cupykv",
        "params": {"max_seq": max_seq, "batch": batch, "n_heads": plan.n_heads, "n_kv_heads": plan.n_kv_heads,
                   "head_dim": hd, "cupykv_dtype": "bfloat16", "baseline_dtype": np.dtype(base_dtype).name,
                   "baseline": baseline_name, "live_lens": [max_seq // d for d in plan.full_axis_divisors],
                   "mask": "cache.additive_mask built once per live length, outside the timed region",
                   "highlight_live_len": max_seq // 8},
        "units": {"cupykv_time_ms": "ms, median", "baseline_time_ms": "ms, median",
                  "ratio_baseline_over_cupykv": "baseline_time_ms / cupykv_time_ms", "live_fraction": "live / max_seq"},
        "results": results,
        "checks": checks,
    }


# -- linear ----------------------------------------------------------------------
def linear(ctx: Context) -> dict:
    """cupykv.linear ``y = x @ W.T`` (bf16): bytes of W per second for a few rows."""
    plan, backend = ctx.plan, ctx.backend
    xp = backend.xp
    results, checks = [], []
    for n, (out_features, in_features) in enumerate(plan.linear_shapes):
        weight = random_array(backend, (out_features, in_features), "bfloat16", seed=200 + n, scale=0.05)
        for rows in plan.linear_rows:
            x = random_array(backend, (rows, in_features), "bfloat16", seed=300 + rows)
            y = backend.zeros((rows, out_features), backend.storage_dtype("bfloat16"))
            if rows == max(plan.linear_rows):
                cupykv.linear(x, weight, out=y)
                want = _matmul(xp)(to_f32(backend, x), to_f32(backend, weight).T)
                checks.append(_check(f"linear {rows}x{in_features} @ ({out_features}x{in_features}).T vs float32",
                                     relative_error(backend, y, want)))
            timing = ctx.timer(lambda: cupykv.linear(x, weight, out=y))
            nbytes = out_features * in_features * 2
            bandwidth = _rate(nbytes, timing.median_s)
            results.append({"out_features": out_features, "in_features": in_features, "rows": rows,
                            "weight_bytes": nbytes, **timing.as_ms(), "bandwidth_GBps": bandwidth,
                            "pct_of_copy": 100.0 * bandwidth / ctx.copy_GBps})
    return {
        "status": "ok",
        "description": "cupykv.linear y = x @ W.T, bfloat16; bandwidth = bytes of W (read once) / time",
        "params": {"dtype": "bfloat16", "rows": list(plan.linear_rows),
                   "weight_shapes": [list(shape) for shape in plan.linear_shapes]},
        "units": {"weight_bytes": "bytes", "time_ms": "ms, median", "bandwidth_GBps": "1e9 bytes/s",
                  "pct_of_copy": "percent of the copy section's bandwidth (read + write)"},
        "results": results,
        "checks": checks,
    }


# -- memory traffic (emulator only) ------------------------------------------------------------
def traffic(ctx: Context) -> dict:
    """Sectors per request and sectors over the ideal, for decode attention and linear (emulator only).

    Properties of the kernels' access patterns, counted by the emulator: not
    GPU figures (on a GPU, Nsight Compute measures them: python -m cupykv validate).
    """
    plan, backend = ctx.plan, ctx.backend
    if not backend.device_info().emulated:
        return {"status": "skipped", "reason": "traffic is counted by the CPU emulator; on a GPU, Nsight Compute "
                                               "measures it (python -m cupykv validate)"}
    results = []
    live = plan.decode_lives[0]
    cache, q, out = _decode_cache(ctx, 1, plan.decode_max_seq, seed=400)
    _set_live(cache, live)
    with backend.traffic() as counted:
        cupykv.attention(q, cache, 0, out=out)
    (launch,) = counted.kernels("cupykv_attention")   # either kernel (tensor cores or not)
    for name, array in (("K", cache.k), ("V", cache.v)):
        needed = _kv_bytes(plan, 1, live) // 2
        results.append(_traffic_row(f"attention {name}, live {live}", launch.coalescing("load", [array], needed)))
    out_features, in_features = plan.linear_shapes[0]
    weight = random_array(backend, (out_features, in_features), "bfloat16", seed=401, scale=0.05)
    for rows in (1, max(plan.linear_rows)):
        x = random_array(backend, (rows, in_features), "bfloat16", seed=402)
        with backend.traffic() as counted:
            cupykv.linear(x, weight)
        (launch,) = counted.kernels("cupykv_linear")   # either kernel (tensor cores or not)
        results.append(_traffic_row(f"linear W {out_features}x{in_features}, {rows} rows",
                                    launch.coalescing("load", [weight], int(weight.nbytes))))
    return {
        "status": "ok",
        "description": "global loads counted by the emulator (CPU-measured properties of the access patterns, "
                       "not GPU figures): sectors_per_request = distinct 32-byte sectors of one warp-level "
                       "request; sectors_over_ideal = distinct sectors / (bytes the op needs / 32); "
                       "requested_over_ideal counts a sector again each time a request asks for it",
        "params": {"dtype": "bfloat16", "n_heads": plan.n_heads, "n_kv_heads": plan.n_kv_heads,
                   "head_dim": plan.head_dim},
        "units": {"sectors_per_request": "sectors", "sectors_over_ideal": "ratio", "requested_over_ideal": "ratio"},
        "results": results,
        "checks": [_check_ratio(row) for row in results],
    }


def _traffic_row(what: str, coalescing) -> dict:
    return {"what": what, "sectors_per_request": coalescing.sectors_per_request,
            "sectors_over_ideal": coalescing.ratio, "requested_over_ideal": coalescing.requested_ratio}


def _check_ratio(row: dict) -> dict:
    """Nothing outside what the op needs: distinct sectors equal the ideal (targets: 1.1 attention, 1.05 linear)."""
    limit = 1.1 if row["what"].startswith("attention") else 1.05
    return {"what": f"{row['what']}: sectors <= {limit} x ideal", "sectors_over_ideal": row["sectors_over_ideal"],
            "passed": row["sectors_over_ideal"] <= limit}
