"""The ``attention_shapes`` section: bf16 attention across q_len, batch, live length and GQA group.

Decode (q_len 1) and speculative verification (q_len 4, 8, 16) over the same cache, so each
figure is a percentage of the same run's copy bandwidth and each q_len > 1 point also gets its
time as a ratio to q_len 1 at the same batch, group and live length (the redesign's target is
at most 1.3 at q_len 8), and its TFLOPS. Where the plan gives a block 64 rows (four m16 tiles in
two row groups of warps, reading each K/V row once), the same point is also timed with blocks of
32 rows (two blocks per 64 rows, each reading the K/V), so the run shows which design is faster.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import cupykv
from cupykv.bench.arrays import fill_random, random_array, relative_error, to_f32
from cupykv.bench.sections import _attention_f32, _check, _kv_bytes, _rate

if TYPE_CHECKING:
    from cupykv.bench.sections import Context


@dataclass(frozen=True)
class ShapesPlan:
    """The points of the section: every combination of these."""

    batches: tuple = (1, 8, 32)
    lives: tuple = (1024, 8192, 32768, 131072)
    groups: tuple = (1, 4, 8)
    q_lens: tuple = (1, 4, 8, 16)
    n_kv_heads: int = 8
    head_dim: int = 128
    check_live: int = 512      # the correctness check's live length (a float32 whole-axis reference)
    max_tokens: int = 1 << 20  # a batch runs the lives with batch * live at most this (cache memory)


def _flops(plan: ShapesPlan, batch: int, q_len: int, group: int, live: int) -> int:
    """QK^T and PV, two flops per multiply-add: query i of q_len attends live + i keys."""
    attended = q_len * live + q_len * (q_len - 1) // 2
    return 4 * batch * plan.n_kv_heads * group * attended * plan.head_dim


def _reference(backend, q, cache, length: int):
    """float32 causal attention of ``q [batch, q_len, n_heads, hd]`` at positions length + i (NHD cache, layer 0)."""
    seq = length + q.shape[1]
    return reference_f32(backend, q, to_f32(backend, cache.k[0][:, :seq]), to_f32(backend, cache.v[0][:, :seq]),
                         length)


def reference_f32(backend, q, k, v, length: int):
    """float32 causal attention of ``q [batch, q_len, n_heads, hd]`` over float32 ``k``, ``v``
    ``[batch, length + q_len, n_kv, hd]``, query i at position length + i."""
    xp = backend.xp
    batch, q_len, n_heads, hd = q.shape
    n_kv_heads = k.shape[2]
    group, seq = n_heads // n_kv_heads, length + q_len
    rows = to_f32(backend, q).reshape(batch, q_len, n_kv_heads, group, hd).transpose(0, 2, 1, 3, 4)
    rows = xp.ascontiguousarray(rows).reshape(batch, n_kv_heads, q_len * group, hd)
    query_of_row = np.arange(q_len * group) // group
    mask = np.where(np.arange(seq)[None, :] <= length + query_of_row[:, None], 0.0, -np.inf).astype(np.float32)
    out = _attention_f32(xp, rows, xp.ascontiguousarray(k.transpose(0, 2, 3, 1)),
                         xp.ascontiguousarray(v.transpose(0, 2, 1, 3)), xp.asarray(mask)[None, None],
                         1.0 / math.sqrt(hd))
    out = out.reshape(batch, n_kv_heads, q_len, group, hd).transpose(0, 2, 1, 3, 4)
    return xp.ascontiguousarray(out).reshape(batch, q_len, n_heads, hd)


def attention_shapes(ctx: Context) -> dict:
    """bf16 attention time per (batch, group, live, q_len): % of copy bandwidth, TFLOPS, ratio to q_len 1."""
    return _shapes_section(ctx, ctx.plan.shapes, "")


def attention_head_dim_256(ctx: Context) -> dict:
    """:func:`attention_shapes` at head_dim 256 (Gemma 2 and 3: GQA 2 and 4), its own tiling of the
    tensor-core kernel: one key warp per block and one m16 tile per warp."""
    return _shapes_section(ctx, ctx.plan.shapes_256, "head_dim 256 (Gemma), ")


def _shapes_section(ctx: Context, plan: ShapesPlan, about: str) -> dict:
    """The section of :func:`attention_shapes` over the points of ``plan``; ``about`` opens its description."""
    backend = ctx.backend
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    max_q = max(plan.q_lens)
    for batch in plan.batches:
        lives = [live for live in plan.lives if batch * live <= plan.max_tokens] or [min(plan.lives)]
        spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=plan.n_kv_heads, head_dim=plan.head_dim,
                                max_seq=max(max(lives), plan.check_live) + max_q, batch=batch, dtype="bfloat16")
        cache = cupykv.KVCache(spec, backend=backend.name)
        fill_random(backend, cache.k, "bfloat16", seed=500 + batch)
        fill_random(backend, cache.v, "bfloat16", seed=501 + batch)
        for group, q_len in itertools.product(plan.groups, plan.q_lens):
            q = random_array(backend, (batch, q_len, plan.n_kv_heads * group, plan.head_dim), "bfloat16", 502)
            out = backend.zeros(q.shape, backend.storage_dtype("bfloat16"))
            attention = cupykv.AttentionPlan(cache, q_len, plan.n_kv_heads * group)
            # blocks of 64 rows against the design they replace, blocks of 32
            narrower = (cupykv.AttentionPlan(cache, q_len, plan.n_kv_heads * group, rows_per_block=32)
                        if attention.kernel.rows_per_block == 64 else None)
            cache.reset()
            cache.advance(plan.check_live)
            want = _reference(backend, q, cache, plan.check_live)
            for each, label in ((attention, ""), (narrower, ", blocks of 32 rows")):
                if each is not None:
                    each.run(q, 0, out=out)
                    checks.append(_check(f"attention_shapes batch {batch} group {group} q_len {q_len}{label} "
                                         "vs float32", relative_error(backend, out, want)))
            for live in lives:
                cache.reset()
                cache.advance(live - 1)   # query i attends live + i keys, its own pending row included
                timing = ctx.timer(lambda: attention.run(q, 0, out=out))
                nbytes = _kv_bytes(plan, batch, live + q_len - 1)
                bandwidth = _rate(nbytes, timing.median_s)
                row = {"batch": batch, "group": group, "live_len": live, "q_len": q_len,
                       "num_splits": attention.num_splits, "rows_per_block": attention.kernel.rows_per_block,
                       "kv_bytes": nbytes, **timing.as_ms(),
                       "bandwidth_GBps": bandwidth, "pct_of_copy": 100.0 * bandwidth / ctx.copy_GBps,
                       "TFLOPS": _flops(plan, batch, q_len, group, live) / timing.median_s / 1e12}
                row.update(time_ms_32_row_blocks=None, num_splits_32_row_blocks=None, time_vs_32_row_blocks=None)
                if narrower is not None:
                    narrow_s = ctx.timer(lambda: narrower.run(q, 0, out=out)).median_s
                    row.update(time_ms_32_row_blocks=narrow_s * 1e3, num_splits_32_row_blocks=narrower.num_splits,
                               time_vs_32_row_blocks=timing.median_s / narrow_s)
                results.append(row)
        del cache
    base = {(r["batch"], r["group"], r["live_len"]): r["time_ms"] for r in results if r["q_len"] == 1}
    for row in results:
        key = (row["batch"], row["group"], row["live_len"])
        row["time_vs_q_len_1"] = row["time_ms"] / base[key] if key in base else None
    return {
        "status": "ok",
        "description": f"{about}cupykv.AttentionPlan.run over a bf16 cache for q_len 1 (decode) and 4-16 (speculative "
                       "verification); bandwidth = K+V bytes of the keys the last query attends to / time; "
                       "TFLOPS counts QK^T and PV of every attended key",
        "params": {"n_kv_heads": plan.n_kv_heads, "head_dim": plan.head_dim, "dtype": "bfloat16",
                   "batches": list(plan.batches), "live_lens": list(plan.lives), "groups": list(plan.groups),
                   "q_lens": list(plan.q_lens), "max_tokens": plan.max_tokens},
        "units": {"rows_per_block": "query rows (query x head of a GQA group) one block owns: the blocks of a "
                                    "sequence and kv head each read its keys",
                  "kv_bytes": "bytes read", "time_ms": "ms, median", "bandwidth_GBps": "1e9 bytes/s",
                  "pct_of_copy": "percent of the copy section's bandwidth (read + write)",
                  "TFLOPS": "1e12 flop/s", "time_vs_q_len_1": "time over the q_len 1 time at the same batch, group "
                                                              "and live length",
                  "time_ms_32_row_blocks": "ms, median, of the same point with rows_per_block=32 (only where the "
                                           "plan's blocks own 64 rows; None elsewhere)",
                  "num_splits_32_row_blocks": "the split-KV factor of the 32-row plan",
                  "time_vs_32_row_blocks": "time_ms over time_ms_32_row_blocks: below 1, the 64-row blocks are "
                                           "faster"},
        "results": results,
        "checks": checks,
    }
