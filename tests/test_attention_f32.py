"""The staged float32 decode attention (kernels/attention_f32.cu): which caches run it, its launch, and
the properties its design claims that the boundary suite does not pin by itself.

The boundary suite (test_attention_boundaries.py) takes this kernel in turn with the others at every
tile, step, split and row-count edge; test_traffic.py holds its coalescing figures, test_races.py
its two stage barriers, and test_attention_mma.py's split_keys test its bit-identical rows. Its
shared-memory reads (traffic(banks=True)) show that each warp works on its own live rows only.
"""
import functools
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv import attention_plan, reference, testing
from cupykv import kernels
from cupykv.kernels import KERNEL_DIR, KERNELS
from cupykv.step_instructions import StagedInstance
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS
from source_lines import source_site
from test_attention_mma import CUT_STEP_CASES, ONE_POSITION_CASES, launch_steps
from test_traffic import cache_and_zero_queries

TILING = KERNELS["attention_f32"].constants("attention_f32_tiling")


# head_dim -> the staged instance (None: the generic kernel): 32, 64, 128 and 256, and other multiples of 4
# above 16 padded onto the next of them; 16 and below and other sizes stay generic
STAGED = {32: 32, 64: 64, 128: 128, 256: 256, 20: 32, 28: 32, 36: 64, 48: 64, 60: 64, 68: 128, 80: 128, 96: 128,
          124: 128, 132: 256, 192: 256, 252: 256, 4: None, 8: None, 16: None, 30: None, 50: None, 126: None,
          254: None}
HEAD_DIMS = kernels.ATTENTION_HEAD_DIMS


@pytest.mark.parametrize("head_dim, instance", sorted(STAGED.items()))
def test_float32_caches_run_the_staged_kernel_at_its_sizes_and_padded_onto_them(head_dim, instance):
    spec = cupykv.CacheSpec(n_layers=1, batch=1, max_seq=256, n_kv_heads=1, head_dim=head_dim, dtype="float32")
    plan = cupykv.AttentionPlan(cupykv.KVCache(spec), 1, 4)
    assert plan.kernel.op == ("attention" if instance is None else "attention_f32") and not plan.kernel.tensor_cores
    assert kernels.attention_f32_head_dim("float32", head_dim) == instance
    for dtype in ("float16", "bfloat16", "float8_e4m3"):
        assert kernels.attention_f32_head_dim(dtype, head_dim) is None
    if instance is not None:
        head_dim = instance   # a padded head's launch is its instance's
        assert plan.kernel.instance == f"cupykv_attention_f32<{head_dim}>"
        assert plan.block == (TILING["kThreads"],) and plan.kernel.rows_per_block == TILING["kTileRows"]
        # the q tile and two stages of K and V, rows padded by kRowPad floats but the last
        keys = StagedInstance(head_dim).step_keys   # 16-key steps at 256
        stages = (TILING["kStages"] * 2 * keys - 1) * (head_dim + TILING["kRowPad"]) + head_dim
        assert plan.shared_mem_bytes == (TILING["kTileRows"] * head_dim + stages) * 4
        assert plan.kernel.opts_in_to_shared_memory == (head_dim >= 128)   # 75760 bytes at 128, 82928 at 256
        assert attention_plan.block_row_choices("float32", head_dim) == (16,)


def filled_caches(backend, spec, rng, lengths, k_std=1.0):
    """A reference cache and one of ``backend`` holding the same random K (standard normal times
    ``k_std``) and V rows as float32, at ``lengths``."""
    oracle = reference.KVCache(spec)
    oracle.k[...] = (rng.standard_normal(spec.shape) * k_std).astype(np.float32)
    oracle.v[...] = rng.standard_normal(spec.shape).astype(np.float32)
    oracle.set_lengths(lengths)
    cache = cupykv.KVCache(spec, backend=backend)
    cache.k[...], cache.v[...] = cache.to_device(oracle.k), cache.to_device(oracle.v)
    cache.set_lengths(lengths)
    return oracle, cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_every_count_of_live_rows_per_warp(backend, head_dim, rows):
    # q_len x group = rows: warp w holds rows w, w + 4, ... so its live rows run 0..4; a warp with none
    # only copies. Each row's query leans on a different key, so a row computed by the wrong warp or
    # from another row's weights is far off.
    group = rows if rows <= 8 else 1
    q_len = rows // group
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=1, dtype="float32")
    rng = np.random.default_rng(rows)
    oracle, cache = filled_caches(backend, spec, rng, [297], k_std=0.3)
    q = (rng.standard_normal((1, q_len, group, head_dim)) * 0.3).astype(np.float32)
    for r in range(rows):   # row r leans on key 18 r + 1, in one of the three splits, attended by its query
        i, h = divmod(r, group)
        q[0, i, h] += oracle.k[0, 0, 18 * r + 1, 0] * 8.0
    for num_splits in (1, 3):
        got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, num_splits=num_splits), spec)
        want = reference.attention(q, oracle, 0)
        assert_attention_close(got.astype(np.float64), want, "float32", float(np.abs(oracle.v).max()),
                               context=f"rows {rows}, num_splits {num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("options", [dict(rope=cupykv.Rope(theta=500.0)), dict(softcap=2.0),
                                     dict(rope=cupykv.Rope(theta=10000.0), softcap=5.0, window=40)],
                         ids=["rope", "softcap", "rope-softcap-window"])
def test_rope_softcap_and_window_match_the_reference(backend, head_dim, options):
    # Queries at several positions (q_len 3, GQA 4: 12 rows in three warps' worth of rows), over two
    # sequences whose live keys cross step and split edges; softcap 2 caps logits of about 8.
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=head_dim, max_seq=300, batch=2, dtype="float32")
    rng = np.random.default_rng(head_dim)
    oracle, cache = filled_caches(backend, spec, rng, [161, 30])
    q = (rng.standard_normal((2, 3, 8, head_dim)) * 0.5).astype(np.float32)
    want = reference.attention(q, oracle, 1, **options)
    # the options change the result: a kernel that ignored one would not match
    assert np.abs(reference.attention(q, oracle, 1) - want).max() > 1e-2
    for num_splits in (1, 2):
        got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 1, num_splits=num_splits, **options), spec)
        assert_attention_close(got.astype(np.float64), want, "float32", float(np.abs(oracle.v).max()),
                               context=f"{options}, num_splits {num_splits}")


PADDED = sorted(head_dim for head_dim, instance in STAGED.items() if instance not in (None, head_dim))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", PADDED)
def test_padded_heads_match_the_reference_and_write_only_their_own_dims(backend, head_dim):
    # A head run on the next instance up: its lanes past head_dim hold zeros and must write nothing.
    # Output rows are head_dim apart, so a write of a padded dim would land in the next row (another
    # warp's: a race) or past the end of out; rows of 5 (GQA 5) and both sequences, split and not.
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=2, dtype="float32")
    rng = np.random.default_rng(head_dim)
    oracle, cache = filled_caches(backend, spec, rng, [297, 40], k_std=0.5)
    q = (rng.standard_normal((2, 1, 5, head_dim)) * 0.5).astype(np.float32)
    assert cupykv.AttentionPlan(cache, 1, 5).kernel.instance == f"cupykv_attention_f32<{STAGED[head_dim]}>"
    want = reference.attention(q, oracle, 0)
    for num_splits in (1, 3):
        got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, num_splits=num_splits), spec)
        assert_attention_close(got.astype(np.float64), want, "float32", float(np.abs(oracle.v).max()),
                               context=f"head_dim {head_dim}, num_splits {num_splits}")


# 'attention_f32.cu:LINE' of a needle: a shared-memory site of the traffic counter
source_line = functools.partial(source_site, Path(KERNEL_DIR) / "attention_f32.cu")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_each_warp_scores_only_its_live_rows(head_dim, rows):
    """Warp w scores rows w, w + 4, ... of the tile (a compile-time count of 0 to 4): each step reads
    each live row of the q tile once (every lane: 32 x its score dims), and the K and V stages once
    per warp with a live row. A warp that ran the step for more rows than it has (a count one too
    high) would only add work the output never shows. One tile of `rows` heads (q_len 1, GQA `rows`) over 100 keys."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=128, batch=1, dtype="float32")
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance([99])
    q = cache._backend.zeros((1, 1, rows, head_dim), np.float32)
    with testing.traffic(cache, banks=True) as t:
        cupykv.attention(q, cache, 0, num_splits=1)
    launch, = t.launches
    step_keys = StagedInstance(head_dim).step_keys
    steps, lanes, score_dims = -(-100 // step_keys), 32, head_dim // (32 // step_keys)
    live_warps = min(rows, TILING["kWarps"])

    def loaded(needle):
        site = source_line(needle)
        return sum(s.bytes for s in launch.shared_sites if s.kind == "load" and s.site == site)

    assert loaded("const float4 q4 =") == steps * rows * lanes * score_dims * 4
    # a warp with a live row reads the whole K and V stage of each step once
    assert loaded("const float4 k4 =") == loaded("v4[piece] =") == steps * live_warps * step_keys * head_dim * 4


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("q_len, group, lengths, window, splits", ONE_POSITION_CASES + CUT_STEP_CASES[:5],
                         ids=[f"q{q}xg{g}-{lengths[0]}-w{w}" for q, g, lengths, w, _ in
                              ONE_POSITION_CASES + CUT_STEP_CASES[:5]])
def test_only_the_steps_the_mask_cuts_are_masked(head_dim, q_len, group, lengths, window, splits):
    """Every thread of a block tests each step for a key that some row must not attend, and the block
    runs the masked copy of the step only where one may lie: the steps a window or the live length cuts
    (the emulator counts the test's outcomes). Masking an open step changes no output and no memory
    traffic, so only this count shows a step test that is too cautious."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=2, dtype="float32")
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0, window=window, **splits)
    launch, = t.launches
    assert launch.kernel == f"cupykv_attention_f32<{head_dim}>"
    cut, every = launch_steps(spec.max_seq, lengths, q_len, group, TILING["kTileRows"], window,
                              splits.get("split_keys", spec.max_seq), step=StagedInstance(head_dim).step_keys)
    threads = TILING["kThreads"]
    assert launch.outcomes(source_line("const bool open = CUPYKV_COMMON_PATH(")) == {
        value: threads * steps for value, steps in ((0, cut), (1, every - cut)) if steps}
