"""The ``attention_fp8`` section: decode attention over an fp8 (E4M3) cache against a bf16 cache.

The same shapes, read side by side in one run: each point times the bf16 cache and the fp8 cache
(bf16 io, per-head scales) and reports the fp8 time as a speed-up over bf16 (the issue's target:
at least 1.8 at live lengths of 8k and more) and the fp8 cache's K+V bytes per second as a
percentage of the copy bandwidth (target: 85%). The fp8 codes are random finite E4M3 values,
so the data is as dense as a real cache's; the check compares the fp8 output with float32
attention over the dequantized values (code * scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

import cupykv
from cupykv.bench.arrays import fill_random, random_array, relative_error
from cupykv.bench.attention_shapes import reference_f32
from cupykv.bench.sections import _check, _rate

if TYPE_CHECKING:
    from cupykv.bench.sections import Context

_FINITE_CODES = 0x7E   # codes 0..0x7E (and their negatives) are finite; 0x7F is NaN
_SCALE = 3.0 / 448     # values up to about 3 in magnitude, as normalised K/V


@dataclass(frozen=True)
class Fp8Plan:
    """The points of the section: every combination of these, at q_len 1."""

    batches: tuple = (1, 8, 32)
    lives: tuple = (8192, 32768, 131072)
    groups: tuple = (4, 8)
    n_kv_heads: int = 8
    head_dim: int = 128
    check_live: int = 512
    max_tokens: int = 1 << 20


def _fill_codes(backend, array, seed: int) -> None:
    """Random finite E4M3 codes with random signs, generated on the device."""
    xp = backend.xp
    rng = xp.random.default_rng(seed)
    magnitude = rng.integers(0, _FINITE_CODES + 1, size=array.size, dtype=xp.uint8)
    sign = rng.integers(0, 2, size=array.size, dtype=xp.uint8) << xp.uint8(7)
    codes = (magnitude | sign).reshape(array.shape)
    backend.copy(array.reshape(-1), codes.view(array.dtype).reshape(-1))


def _dequantized(backend, codes, scale: float):
    """float32 ``code * scale`` of a device array of E4M3 codes, through a 256-entry table."""
    xp = backend.xp
    table = (np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale))
    return xp.asarray(table)[xp.asarray(codes).view(xp.uint8).astype(xp.int32)]


def attention_fp8(ctx: Context) -> dict:
    """Decode attention (q_len 1) over fp8 against bf16 caches: speed-up and fp8 bandwidth as % of copy."""
    plan, backend = ctx.plan.fp8, ctx.backend
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for batch in plan.batches:
        lives = [live for live in plan.lives if batch * live <= plan.max_tokens] or [min(plan.lives)]
        shape = dict(n_layers=1, n_kv_heads=plan.n_kv_heads, head_dim=plan.head_dim,
                     max_seq=max(max(lives), plan.check_live) + 1, batch=batch)
        bf16 = cupykv.KVCache(cupykv.CacheSpec(**shape, dtype="bfloat16"), backend=backend.name)
        fp8 = cupykv.KVCache(cupykv.CacheSpec(**shape, dtype="float8_e4m3", io_dtype="bfloat16"),
                             backend=backend.name, k_scale=_SCALE, v_scale=_SCALE)
        fill_random(backend, bf16.k, "bfloat16", seed=600 + batch)
        fill_random(backend, bf16.v, "bfloat16", seed=601 + batch)
        _fill_codes(backend, fp8.k, seed=602 + batch)
        _fill_codes(backend, fp8.v, seed=603 + batch)
        for group in plan.groups:
            q = random_array(backend, (batch, 1, plan.n_kv_heads * group, plan.head_dim), "bfloat16", 604)
            out = backend.zeros(q.shape, backend.storage_dtype("bfloat16"))
            plans = {name: cupykv.AttentionPlan(cache, 1, plan.n_kv_heads * group) for name, cache in
                     (("bf16", bf16), ("fp8", fp8))}
            fp8.reset()
            fp8.advance(plan.check_live)
            plans["fp8"].run(q, 0, out=out)
            seq = plan.check_live + 1
            want = reference_f32(backend, q, _dequantized(backend, fp8.k[0][:, :seq], _SCALE),
                                 _dequantized(backend, fp8.v[0][:, :seq], _SCALE), plan.check_live)
            checks.append(_check(f"attention_fp8 batch {batch} group {group} vs float32 over dequantized K/V",
                                 relative_error(backend, out, want)))
            for live in lives:
                row: dict[str, Any] = {"batch": batch, "group": group, "live_len": live}
                for name, cache in (("bf16", bf16), ("fp8", fp8)):
                    cache.reset()
                    cache.advance(live - 1)   # the query attends live keys, its own pending row included
                    timing = ctx.timer(lambda: plans[name].run(q, 0, out=out))
                    nbytes = batch * live * plan.n_kv_heads * plan.head_dim * 2 * (2 if name == "bf16" else 1)
                    bandwidth = _rate(nbytes, timing.median_s)
                    row.update({f"{name}_{key}": value for key, value in timing.as_ms().items()})
                    row.update({f"{name}_kv_bytes": nbytes, f"{name}_bandwidth_GBps": bandwidth,
                                f"{name}_pct_of_copy": 100.0 * bandwidth / ctx.copy_GBps,
                                f"{name}_num_splits": plans[name].num_splits})
                row["fp8_speedup"] = row["bf16_time_ms"] / row["fp8_time_ms"]
                results.append(row)
        del bf16, fp8
    return {
        "status": "ok",
        "description": "cupykv.AttentionPlan.run at q_len 1 over a bf16 cache and an fp8 (E4M3, bf16 io, per-head "
                       "scales) cache of the same shape; bandwidth = K+V bytes of the live keys / time, in each "
                       "cache's own bytes; fp8_speedup = bf16 time / fp8 time",
        "params": {"n_kv_heads": plan.n_kv_heads, "head_dim": plan.head_dim, "batches": list(plan.batches),
                   "live_lens": list(plan.lives), "groups": list(plan.groups), "max_tokens": plan.max_tokens,
                   "scale": _SCALE},
        "units": {**{f"{name}_{key}": unit for name in ("bf16", "fp8") for key, unit in (
                      ("time_ms", "ms, median"), ("kv_bytes", "bytes read"), ("bandwidth_GBps", "1e9 bytes/s"),
                      ("pct_of_copy", "percent of the copy section's bandwidth (read + write)"))},
                  "fp8_speedup": "bf16 time over fp8 time (targets: >= 1.8 at live >= 8192; fp8 >= 85% of copy)"},
        "results": results,
        "checks": checks,
    }

