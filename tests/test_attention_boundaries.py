"""attention at every boundary a redesign could move (issue 10, item 5), pinned against today's kernel.

The coming decode-attention redesign changes the tiling (key tiles, cp.async stages, tensor-core row
tiles), the split plan and the combine. These tests fix the contract at the places such changes break:

- live lengths b*T - 1, b*T, b*T + 1 (b = 1..3) for today's chunk and row tile and for the plausible
  tiles of a redesign (BOUNDARY_SIZES), and at capacity;
- query-row counts (q_len x group) that straddle every row tile, and q_len 1..16 at every GQA group 1..8;
- split counts 1..64 with live ranges k*T*splits + 1 (an uneven last split), more splits than keys
  (empty splits), and the split counts plan_splits gives an H200 (132 SMs x 4..6 blocks);
- windows that start just before, at and just after a tile (chunk, split) edge, and steps a staged
  kernel leaves unmasked, which must hold only keys every row of the tile attends;
- NaN and +-inf in rows that are pending but not attended, past the live rows, below a window and in
  the other layer: the output must stay finite and within tolerance;
- a query whose every logit is infinite or NaN comes out NaN, at the cache's last position too;
- a row's max logit at every key position of a chunk (a max reduction that skips one overflows);
- the split-KV combine across graph replays while lengths change on the device;
- empty history (lengths 0) with q_len > 1, and rows that attend only themselves (exact).

The key ranges carry a few marked keys (at the edges under test) whose logit is about SPIKE for
every query of the sequence, so dropping or doubling one moves the output far past the tolerance
of every dtype, bfloat16 included. The reference is the oracle; tolerances are cupykv.tolerances'.
Two checks are exact, as the contract's arithmetic is: a query that attends one row alone returns
that V row bit for bit (its weight is exp(0) / exp(0) = 1), and one that attends nothing returns zeros.
"""
import math

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

import cupykv
from cupykv import attention_plan, reference, testing
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS

CHUNK = attention_plan.CHUNK            # keys a block scores at once today
TILE_ROWS = attention_plan.TILE_ROWS    # query rows (query x head of a GQA group) a block owns today
# Today's tiles and the tiles a redesign may plausibly choose (keys per stage, rows per mma tile).
BOUNDARY_SIZES = sorted({CHUNK, TILE_ROWS, 16, 32, 64, 128, 256})
ROW_TILES = sorted({TILE_ROWS, 16, 32, 64})
SPIKE = 8.0                              # logit of a marked key: e**8 outweighs hundreds of plain keys
NAN, INF = float("nan"), float("inf")
POISONS = [(NAN, NAN), (INF, -INF), (-INF, NAN), (NAN, INF)]   # (K, V) values written where nothing may read
DTYPES = ["float32", "float16", "bfloat16"]
# (dtype, head_dim) of each attention kernel, which the tests below take in turn: the generic CUDA-core
# kernel (float32 at 8), the two tensor-core sizes (float16 at 64, bfloat16 at 128: one m16 tile per
# block up to 16 query rows, two past that), and the staged float32 kernel at each of its sizes
# (attention_f32.cu: 32-key steps, 16 at 256; four rows per warp). With a dtype alone (head_dim 8), a
# 16-bit cache runs padded on the tensor-core instance of 64.
KERNEL_CASES = [("float32", 8), ("float16", 64), ("bfloat16", 128), ("float32", 64), ("float32", 128),
                ("float32", 32), ("float32", 256)]


def straddling(tile, multiples=(1, 2, 3)):
    """b * tile - 1, b * tile, b * tile + 1 for each multiple b."""
    return [b * tile + d for b in multiples for d in (-1, 0, 1)]


def _nhd(array, spec):
    """``[n_layers, batch, max_seq, n_kv, hd]`` view of a cache-shaped array in either layout."""
    return array if spec.layout == "NHD" else array.swapaxes(2, 3)


def _spec(max_seq, *, batch=1, n_kv=1, head_dim=8, dtype="float32", layout="NHD", n_layers=2):
    return cupykv.CacheSpec(n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim, max_seq=max_seq, batch=batch,
                            dtype=dtype, layout=layout)


def _oracle(spec, q_len, group, rng, *, layer, marked=None):
    """The reference cache with random K/V at every position, and queries ``[batch, q_len, n_heads, hd]``.

    Every query of sequence b leans on one direction per kv head; the keys at ``marked[b]`` (in
    ``layer``, every kv head) point along it, so each gets a logit near SPIKE for every such query.
    """
    dtype, hd = spec.np_dtype, spec.head_dim
    oracle = reference.KVCache(spec)
    oracle.k[...] = (rng.standard_normal(spec.shape) * 0.5).astype(dtype)
    oracle.v[...] = rng.standard_normal(spec.shape).astype(dtype)
    u = rng.standard_normal((spec.batch, spec.n_kv_heads, hd))     # [batch, n_kv, hd], |u|^2 = hd
    u *= math.sqrt(hd) / np.linalg.norm(u, axis=-1, keepdims=True)
    noise = rng.standard_normal((spec.batch, q_len, group * spec.n_kv_heads, hd))
    q = np.repeat(u, group, axis=1)[:, None] + 0.25 * noise   # [batch, q_len, n_heads, hd]
    for b, positions in (marked or {}).items():
        positions = sorted({p for p in positions if 0 <= p < spec.max_seq})
        _nhd(oracle.k, spec)[layer, b, positions] = (u[b] * (SPIKE / math.sqrt(hd))).astype(dtype)
    return oracle, q.astype(dtype)


def _poisoned(oracle, spec, layer, tail, *, below=None, extra=None, values=(NAN, NAN)):
    """Copies of the oracle's K and V with ``values`` wherever attention may not look.

    That is: the whole other layer(s), positions ``>= tail[b]`` of every layer, positions
    ``< below[b]`` of ``layer`` and ``extra[b]`` positions of ``layer``.
    """
    k, v = oracle.k.copy(), oracle.v.copy()
    for array, value in zip((k, v), values):
        view = _nhd(array, spec)
        view[np.arange(spec.n_layers) != layer] = value
        for b in range(spec.batch):
            view[:, b, max(0, int(tail[b])):] = value
            if below is not None:
                view[layer, b, :max(0, int(below[b]))] = value
            if extra is not None and len(extra[b]):
                view[layer, b, list(extra[b])] = value
    return k, v


def attend(backend, spec, lengths, q_len, group, *, num_splits=1, window=None, layer=None, marked=None,
           poison_pending=None, values=(NAN, NAN), seed=0, checked=None, **options):
    """Attention on a poisoned backend cache against the reference; returns (got, want) as float64.

    Poisoned with ``values`` (K, V): the other layer, every row past the pending ones, with a
    window the rows below query 0's window, and ``poison_pending[b]`` (pending positions; then
    only the queries in ``checked``, a slice, are compared). Fails on a non-finite or
    out-of-tolerance output. ``layer`` defaults to ``seed % n_layers``.
    """
    rng = np.random.default_rng(seed)
    layer = seed % spec.n_layers if layer is None else layer
    oracle, q = _oracle(spec, q_len, group, rng, layer=layer, marked=marked)
    oracle.set_lengths(lengths)
    tail = [n + q_len for n in lengths]
    below = None
    if window is not None:   # below query 0's window: attended by no query
        below = [min(n - window + 1, spec.max_seq) for n in lengths]
    k, v = _poisoned(oracle, spec, layer, tail, below=below, extra=poison_pending, values=values)
    cache = cupykv.KVCache(spec, backend=backend)
    cache.k[...], cache.v[...] = cache.to_device(k), cache.to_device(v)
    cache.set_lengths(list(lengths))
    got = cupykv.attention(cache.to_device(q), cache, layer, window=window, num_splits=num_splits, **options)
    got = testing.to_numpy(got, spec).astype(np.float64)
    want = reference.attention(q, oracle, layer, window=window, **options)
    checked = slice(None) if checked is None else checked
    context = (f"({spec}, lengths {list(lengths)}, q_len {q_len}, group {group}, num_splits {num_splits}, "
               f"window {window}, layer {layer}, poison {values}, {options})")
    bad = ~np.isfinite(got[:, checked])
    assert not bad.any(), f"non-finite output at {np.argwhere(bad)[:5].tolist()} {context}"
    value_scale = float(np.abs(oracle.v[layer].astype(np.float64)).max())
    assert_attention_close(got[:, checked], want[:, checked], spec.dtype, value_scale, context=context)
    return got, want


def _splits(requested, max_seq):
    return min(requested, attention_plan.max_splits(max_seq))


def _pending_marks(length, q_len):
    """Each pending row up to 16 of them; of more, the first two, the last two and each 16th."""
    offsets = range(q_len) if q_len <= 16 else {0, 1, q_len - 2, q_len - 1} | set(range(15, q_len, 16))
    return [length + i for i in sorted(offsets)]


def _boundary_marks(live, tile):
    """The first key, the last three keys and the keys either side of each tile edge below ``live``."""
    return [0, live - 3, live - 2, live - 1] + [m * tile + d for m in (1, 2, 3) for d in (-1, 0) if m * tile < live]


# -- 1. live lengths across every tile edge -------------------------------------------------------
# (q_len, group, num_splits, dtype, head_dim, layout): fp32 for the tightest tolerance, both 16-bit
# dtypes, and the specialised head_dim 64 / 128 instances.
VARIANTS = [(1, 1, 1, "float32", 8, "NHD"), (1, 4, 2, "bfloat16", 16, "HND"), (3, 2, 3, "float16", 8, "NHD"),
            (2, 8, 4, "bfloat16", 128, "NHD"), (5, 1, 2, "float16", 64, "HND"), (1, 1, 2, "float32", 64, "NHD"),
            (4, 3, 3, "float32", 128, "HND")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "q{}g{}s{}-{}-hd{}-{}".format(*v))
@pytest.mark.parametrize("tile", BOUNDARY_SIZES)
@pytest.mark.parametrize("multiple", [1, 2, 3])
def test_live_lengths_straddle_every_tile_edge(backend, variant, tile, multiple):
    # One sequence per live length b*T - 1, b*T, b*T + 1 (live = committed + pending rows).
    q_len, group, splits, dtype, head_dim, layout = variant
    lives = straddling(tile, (multiple,))
    max_seq = max(3 * tile + 8, splits * CHUNK)
    spec = _spec(max_seq, batch=3, head_dim=head_dim, dtype=dtype, layout=layout)
    lengths = [max(0, live - q_len) for live in lives]
    marked = {b: _boundary_marks(live, tile) for b, live in enumerate(lives)}
    attend(backend, spec, lengths, q_len, group, num_splits=_splits(splits, max_seq), marked=marked,
           values=POISONS[multiple], seed=tile + multiple)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tile", BOUNDARY_SIZES)
@pytest.mark.parametrize("multiple", [1, 2, 3])
def test_capacity_on_a_tile_edge(backend, tile, multiple):
    # max_seq = b*T: full, one short and two short; q_len 3 runs queries past capacity, which see every row.
    max_seq = multiple * tile
    q_len, group, splits, dtype, head_dim, layout = VARIANTS[(tile + multiple) % len(VARIANTS)]
    spec = _spec(max_seq, batch=3, head_dim=head_dim, dtype=dtype, layout=layout)
    lengths = [max_seq, max_seq - 1, max(0, max_seq - 2)]
    marked = {b: _boundary_marks(max_seq, tile) for b in range(3)}
    attend(backend, spec, lengths, 3, group, num_splits=_splits(splits, max_seq), marked=marked,
           seed=tile * multiple)


# -- 2. query rows across every row tile ---------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tile", ROW_TILES)
@pytest.mark.parametrize("multiple", [1, 2, 3])
def test_query_rows_straddle_every_row_tile(backend, tile, multiple):
    # rows = q_len * group = b*T - 1, b*T, b*T + 1, with the largest group <= 8 that divides them.
    for rows in straddling(tile, (multiple,)):
        group = max(g for g in range(1, 9) if rows % g == 0)
        q_len = rows // group
        # float16 at head_dim 64 and bfloat16 at 128 run on tensor cores: blocks of 16, 32 or 64 rows
        dtype, head_dim = KERNEL_CASES[(rows + multiple) % len(KERNEL_CASES)]
        spec = _spec(CHUNK + q_len + 4, batch=2, n_kv=1 + rows % 2, head_dim=head_dim, dtype=dtype)
        lengths = [CHUNK - q_len // 2, 0]           # seq 0's pending rows straddle a chunk edge
        marked = {b: _pending_marks(n, q_len) + [0, CHUNK - 1, CHUNK] for b, n in enumerate(lengths)}
        attend(backend, spec, lengths, q_len, group, num_splits=1 + rows % 2, marked=marked, seed=rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", range(1, 17))
@pytest.mark.parametrize("group", range(1, 9))
def test_every_q_len_at_every_gqa_group(backend, q_len, group):
    # Sequence 0's pending rows straddle a chunk edge; sequence 1 has no history (lengths 0).
    index = q_len * 8 + group
    dtype, head_dim = KERNEL_CASES[index % len(KERNEL_CASES)]
    spec = _spec(2 * CHUNK + 8, batch=2, head_dim=head_dim, dtype=dtype, layout=("NHD", "HND")[(index // 2) % 2])
    lengths = [CHUNK - q_len // 2 - 1, 0]
    marked = {b: [n + i for i in range(q_len)] + [0, CHUNK - 1, CHUNK] for b, n in enumerate(lengths)}
    attend(backend, spec, lengths, q_len, group, num_splits=1 + index % 2, marked=marked,
           values=POISONS[index % len(POISONS)], seed=index)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_q_len_and_group_on_the_specialised_head_dims(backend, head_dim, dtype):
    for q_len, group in [(1, 8), (4, 4), (8, 2), (16, 8), (5, 3), (16, 1)]:
        spec = _spec(2 * CHUNK + 24, batch=2, n_kv=2, head_dim=head_dim, dtype=dtype,
                     layout="HND" if group % 2 else "NHD")
        lengths = [CHUNK - q_len // 2, 0]
        marked = {b: [n + i for i in range(q_len)] + [CHUNK - 1, CHUNK] for b, n in enumerate(lengths)}
        attend(backend, spec, lengths, q_len, group, num_splits=2, marked=marked, seed=q_len * group)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", [("float32", 130), ("float32", 255), ("float16", 132), ("bfloat16", 250)])
def test_the_generic_cuda_core_kernel_past_head_dim_128(backend, dtype, head_dim):
    """Heads past 128 that are neither whole 16-byte copies nor a staged float32 size run on the
    generic CUDA-core kernel (attention.cu), where each thread owns a second dim, tid + 128. A block's
    keys end on a multiple of 4 or one past it (its 4-key V loop, then its one-key tail), unsplit and split."""
    assert attention_plan.attention_kernel(dtype, head_dim).instance.startswith("cupykv_attention<")
    spec = _spec(CHUNK + 40, batch=3, n_kv=2, head_dim=head_dim, dtype=dtype)
    q_len, group, lengths = 3, 2, [CHUNK + 6, 30, 29]   # keys to 137 and 33 (a tail of 1), and 32
    marked = {b: [0, n - 1, n + q_len - 1] for b, n in enumerate(lengths)}
    for num_splits in (1, 2):
        attend(backend, spec, lengths, q_len, group, num_splits=num_splits, marked=marked, seed=head_dim)


# -- 3. split counts 1..64: uneven last splits and empty splits ---------------------------------------
def _split_ranges(splits):
    """Key ranges T * splits + 1 for today's chunk and for one other boundary size T in turn, one key,
    and a chunk and one (empty splits from 3 splits on)."""
    others = [tile for tile in BOUNDARY_SIZES if tile != CHUNK]
    return sorted({1, CHUNK + 1, CHUNK * splits + 1, others[splits % len(others)] * splits + 1})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", range(1, 65))
def test_every_split_count_keeps_an_uneven_last_split(backend, splits):
    ranges = _split_ranges(splits)
    max_seq = max(max(ranges) + 4, splits * CHUNK)
    dtype, head_dim = KERNEL_CASES[splits % len(KERNEL_CASES)]
    spec = _spec(max_seq, batch=len(ranges), dtype=dtype, head_dim=head_dim, layout=("NHD", "HND")[splits % 2],
                 n_layers=1)
    marked = {b: [0, r - 3, r - 2, r - 1] for b, r in enumerate(ranges)}    # q_len 1: the query sits at r - 1
    attend(backend, spec, [r - 1 for r in ranges], 1, 1, num_splits=splits, marked=marked,
           values=POISONS[splits % len(POISONS)], seed=splits)


# (batch, n_kv, q_len, n_heads, max_seq): shapes whose H200 plans split 8..64 ways (those capped by
# max_seq // 256 and those that fill the device: 44, 55 and 64 splits; 8, 10 and 11).
H200_SHAPES = [(1, 1, 1, 1, 16384), (4, 2, 1, 8, 8192), (1, 1, 16, 2, 4096), (12, 1, 1, 4, 16384),
               (9, 8, 1, 64, 4096), (5, 2, 2, 16, 2048)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", H200_SHAPES, ids=str)
def test_the_split_counts_an_h200_plans(backend, shape):
    # plan_splits for 132 SMs x 4, 5 and 6 resident blocks; sequence 0 gets an uneven last split,
    # the others one key (empty splits) and a chunk and one.
    batch, n_kv, q_len, n_heads, max_seq = shape
    group = n_heads // n_kv
    spec = _spec(max_seq, batch=batch, n_kv=n_kv, dtype="bfloat16", n_layers=1)
    counts = sorted({attention_plan.plan_splits(spec, q_len, n_heads, 132 * per_sm) for per_sm in (4, 5, 6)})
    assert max(counts) > 1
    for splits in counts:
        lives = [min(CHUNK * splits + 1, max_seq)] + [(1, CHUNK + 1)[b % 2] for b in range(1, batch)]
        lengths = [max(0, live - q_len) for live in lives]
        marked = {b: [0, live - 2, live - 1] + [n + i for i in range(q_len)] for b, (live, n) in
                  enumerate(zip(lives, lengths))}
        attend(backend, spec, lengths, q_len, group, num_splits=splits, marked=marked, seed=splits)


# -- 4. windows starting at tile and split edges --------------------------------------------------------
# (q_len, group, num_splits, window): a window one key past a tile, two tiles long, and a chunk and one.
WINDOWS = [(1, 1, 1, "tile+1", lambda tile: tile + 1), (4, 2, 2, "2tile", lambda tile: 2 * tile),
           (2, 4, 3, "chunk+1", lambda tile: CHUNK + 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tile", BOUNDARY_SIZES)
@pytest.mark.parametrize("edge", [-1, 0, 1], ids=["before", "at", "after"])
@pytest.mark.parametrize("variant", WINDOWS, ids=lambda v: "q{}g{}s{}-w={}".format(*v[:4]))
def test_windows_start_at_tile_edges(backend, tile, edge, variant):
    # Query 0 of sequence b attends from b*T + edge on; the rows below are poisoned. The splits of a
    # split plan start at the window (today) or at whole tiles (a redesign may): both are crossed.
    q_len, group, splits, _, width = variant
    window = width(tile)
    starts = [m * tile + edge for m in (1, 2, 3)]
    lengths = [start + window - 1 for start in starts]
    max_seq = max(lengths) + q_len + 4
    dtype, head_dim = KERNEL_CASES[(tile + edge + WINDOWS.index(variant)) % len(KERNEL_CASES)]
    spec = _spec(max_seq, batch=3, dtype=dtype, head_dim=head_dim, layout=("NHD", "HND")[edge % 2])
    marked = {b: [s + i for i in range(q_len)] + [n + i for i in range(q_len)] + [s - 1 + tile]
              for b, (s, n) in enumerate(zip(starts, lengths))}
    attend(backend, spec, lengths, q_len, group, num_splits=_splits(splits, max_seq), window=window,
           marked=marked, values=POISONS[edge + 1], seed=tile + edge)


# Windows of at least a step (32 keys, 16 at head_dim 256 and on tensor cores) with one head a row
# (group 1), so that a tile's rows sit at consecutive positions; and split_keys cuts that end a split
# a key or two into a step.
UNMASKED_STEPS = [(2, 32, dict(num_splits=1)), (2, 65, dict(num_splits=1)), (3, 40, dict(num_splits=1)),
                  (1, 150, dict(split_keys=128)), (2, 150, dict(split_keys=128))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", KERNEL_CASES)
@pytest.mark.parametrize("q_len, window, splits", UNMASKED_STEPS, ids=lambda v: str(v))
def test_a_step_left_unmasked_holds_only_keys_every_row_attends(backend, dtype, head_dim, q_len, window, splits):
    """The staged kernels mask only the steps that hold a key some live row does not attend. Every key
    here has a logit near -SPIKE and a V row near +1, but query 0's first key (o), whose logit is
    near +SPIKE and V row near -1: a later query of the tile (one position on, so its window starts
    at o + 1) that took o's step as unmasked would return about -1, and a zero-filled key past a
    split's end taken for a live one (logit 0, V 0) would pull the row to about 0. Query 0's window
    starts at offsets o = 1, 2, 17, 31, 32, 33, across a step; the rows below it are poisoned."""
    offsets = [1, 2, 17, 31, 32, 33]
    lengths = [o + window - 1 for o in offsets]   # query 0 (position lengths[b]) attends from o on
    spec = _spec(max(lengths) + q_len + 3, batch=len(offsets), dtype=dtype, head_dim=head_dim, n_layers=1)
    rng = np.random.default_rng(window + q_len)
    oracle, q = _oracle(spec, q_len, 1, rng, layer=0, marked={b: [o] for b, o in enumerate(offsets)})
    keys, values = _nhd(oracle.k, spec)[0], _nhd(oracle.v, spec)[0]   # [batch, max_seq, n_kv, hd]
    for b, o in enumerate(offsets):
        spike = keys[b, o].astype(np.float64)   # logit about +SPIKE for every query of sequence b
        others = np.arange(spec.max_seq) != o
        keys[b, others] = (-spike + 0.05 * rng.standard_normal(keys[b, others].shape)).astype(keys.dtype)
        values[b] = (1.0 + 0.1 * rng.standard_normal(values[b].shape)).astype(values.dtype)
        values[b, o] *= -1
    oracle.set_lengths(lengths)
    k, v = _poisoned(oracle, spec, 0, [n + q_len for n in lengths], below=offsets)
    cache = cupykv.KVCache(spec, backend=backend)
    cache.k[...], cache.v[...] = cache.to_device(k), cache.to_device(v)
    cache.set_lengths(lengths)
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, window=window, **splits), spec)
    want = reference.attention(q, oracle, 0, window=window)
    assert np.abs(want[:, 0] + 1.0).max() < 0.5 and np.all(np.abs(want[:, 1:] - 1.0) < 0.5)   # o's -1, others' +1
    assert_attention_close(got.astype(np.float64), want, dtype, float(np.abs(values.astype(np.float64)).max()),
                           context=f"{dtype} {head_dim}, q_len {q_len}, window {window}, {splits}")


# -- 5. NaN and +-inf in pending rows a query does not attend ------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [2, 5, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("values", POISONS[:3], ids=["nan", "inf", "-inf"])
def test_pending_rows_past_a_query_never_reach_it(backend, q_len, group, values):
    # Pending row lengths[b] + m is poisoned: queries 0..m-1 read it (same tile, same chunk) but
    # may not attend it. Sequence 0's pending rows straddle a chunk edge; sequence 1 has no history.
    for m in sorted({1, q_len // 2, q_len - 1}):
        dtype, head_dim = KERNEL_CASES[(q_len + m + group) % len(KERNEL_CASES)]
        spec = _spec(2 * CHUNK + 24, batch=2, dtype=dtype, head_dim=head_dim, layout=("NHD", "HND")[m % 2])
        lengths = [CHUNK - q_len // 2, 0]
        marked = {b: [n + i for i in range(m)] + [CHUNK - 1] for b, n in enumerate(lengths)}
        attend(backend, spec, lengths, q_len, group, num_splits=1 + m % 2, marked=marked, values=values,
               poison_pending=[[n + m] for n in lengths], checked=slice(0, m), seed=q_len + m)


# -- 6. empty history and rows that attend only themselves -----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", KERNEL_CASES[:1] + KERNEL_CASES[3:] + [("float16", 8), ("bfloat16", 8)])
@pytest.mark.parametrize("q_len, group", [(2, 8), (7, 3), (16, 1)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_rows_that_attend_only_themselves_are_exact(backend, dtype, head_dim, q_len, group, num_splits):
    # With window 1 each query attends its own row alone, so its output is that V row exactly; past
    # capacity (sequence 3's later queries) it attends nothing: zeros. Sequence 0 has no history.
    max_seq = 2 * CHUNK
    spec = _spec(max_seq, batch=4, n_kv=2, dtype=dtype, head_dim=head_dim, layout="HND" if q_len % 2 else "NHD")
    lengths = [0, CHUNK - q_len // 2, CHUNK, max_seq - q_len // 2]
    got, want = attend(backend, spec, lengths, q_len, group, num_splits=num_splits, window=1, seed=q_len)
    assert np.array_equal(got, want), "a query that attends only its own row must return that V row exactly"
    past = q_len // 2                                        # sequence 3's first query past capacity
    assert np.all(got[3, past:] == 0) and np.all(np.abs(got[3, :past]).max(axis=-1) > 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len, group", [(2, 1), (5, 4), (16, 8)])
def test_empty_history_with_several_queries(backend, q_len, group):
    # lengths 0: query i attends rows 0..i, all of them pending; query 0 attends itself alone (exact).
    for dtype, head_dim, num_splits in [("float32", 8, 1), ("bfloat16", 8, 2), ("float16", 8, 3), ("float32", 64, 2),
                                        ("float32", 128, 1)]:
        spec = _spec(3 * CHUNK, batch=2, n_kv=2, dtype=dtype, head_dim=head_dim)
        marked = {b: range(q_len) for b in range(2)}
        got, want = attend(backend, spec, [0, 0], q_len, group, num_splits=num_splits, marked=marked,
                           values=POISONS[num_splits], seed=q_len + num_splits)
        assert np.array_equal(got[:, 0], want[:, 0]), "query 0 of an empty sequence must return its V row exactly"


# -- 7. the split-KV combine across graph replays ----------------------------------------------------------
REPLAY_LENGTHS = [[CHUNK - 1, 0], [CHUNK, 1], [3 * CHUNK + 1, 2 * CHUNK], [3 * CHUNK + 1, 2 * CHUNK],
                  [0, 5 * CHUNK - 2], [5 * CHUNK + 1, 0], [17, CHUNK + 1], [17, CHUNK + 1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits, q_len", [(2, 1), (3, 4), (8, 1), (5, 16)])
@pytest.mark.parametrize("dtype, head_dim", [("float32", 8), ("float32", 128), ("bfloat16", 128)],
                         ids=["cuda-cores", "cuda-cores-staged", "tensor-cores"])
def test_the_split_combine_is_right_on_every_replay(backend, splits, q_len, dtype, head_dim):
    # A captured step attends over both layers with one split plan (one workspace), then advances by
    # a device array. Between replays the lengths change on the device (set_lengths from a device
    # array inside the step) and the rows past the pending ones are poisoned again. On tensor cores
    # q_len 16 x group 2 is one block of two row tiles.
    group = 2
    spec = _spec(max(6 * CHUNK + q_len + 8, splits * CHUNK), batch=2, dtype=dtype, head_dim=head_dim,
                 layout="HND" if splits % 2 else "NHD")
    rng = np.random.default_rng(splits)
    marks = {b: [0, CHUNK - 1, CHUNK, 3 * CHUNK, 5 * CHUNK - 1] for b in range(2)}
    oracle, q_host = _oracle(spec, q_len, group, rng, layer=0, marked=marks)
    _nhd(oracle.k, spec)[1] = _nhd(oracle.k, spec)[0][:, ::-1]    # layer 1: the keys reversed
    cache = cupykv.KVCache(spec, backend=backend)
    plan = cupykv.AttentionPlan(cache, q_len, group * spec.n_kv_heads, num_splits=splits)
    assert plan.kernel.rows_per_block == (16 if not plan.kernel.tensor_cores or q_len * group <= 16 else
                                          32 if q_len * group <= 32 else 64)
    q = cache.to_device(q_host)
    outs = [cache.to_device(np.zeros(q_host.shape, spec.np_dtype)) for _ in range(spec.n_layers)]
    targets = cache.to_device(np.zeros(spec.batch, np.int32))
    steps = cache.to_device(np.zeros(spec.batch, np.int32))

    def step():
        cache.set_lengths(targets)
        for layer, out in enumerate(outs):
            plan.run(q, layer, out=out)
        cache.advance(steps)

    def prepare(lengths, advance):
        tail = [n + q_len for n in lengths]
        k, v = oracle.k.copy(), oracle.v.copy()
        for array in (k, v):
            for b, first in enumerate(tail):
                _nhd(array, spec)[:, b, first:] = NAN
        cache.k[...], cache.v[...] = cache.to_device(k), cache.to_device(v)
        targets[...] = cache.to_device(np.array(lengths, np.int32))
        steps[...] = cache.to_device(np.array(advance, np.int32))

    def check(lengths, advance, replay):
        oracle.set_lengths(lengths)
        scale = float(np.abs(oracle.v.astype(np.float64)).max())
        for layer, out in enumerate(outs):
            got = testing.to_numpy(out, spec).astype(np.float64)
            assert np.isfinite(got).all(), f"replay {replay}, layer {layer}: non-finite output"
            assert_attention_close(got, reference.attention(q_host, oracle, layer), spec.dtype, scale,
                                   context=f"(replay {replay}, layer {layer}, lengths {lengths}, splits {splits})")
        oracle.advance(advance)
        assert cache.lengths_host().tolist() == oracle.lengths.tolist()

    prepare(REPLAY_LENGTHS[0], [1, 0])
    graph = cupykv.capture(step)            # the warm-up run is replay 0
    check(REPLAY_LENGTHS[0], [1, 0], 0)
    for replay, lengths in enumerate(REPLAY_LENGTHS[1:], 1):
        advance = [replay % 3, CHUNK + 1]
        prepare(lengths, advance)
        graph.replay()
        check(lengths, advance, replay)


# -- 8. a property over the same boundaries ------------------------------------------------------------------
@st.composite
def boundary_cases(draw):
    """Lengths, windows and row counts near multiples of a boundary size, every option, every poison."""
    tile = draw(st.sampled_from(BOUNDARY_SIZES))
    near = st.builds(lambda m, d: max(0, m * tile + d), st.integers(0, 3), st.integers(-2, 2))
    q_len, group, n_kv = draw(st.integers(1, 16)), draw(st.integers(1, 8)), draw(st.sampled_from((1, 2)))
    # padded heads: 24 onto 32 (float32) and 64 (16-bit), 80 onto 128 and 96, 200 onto 256 (both)
    head_dim = draw(st.sampled_from((8, 16, 24, 64, 80, 128, 200)))
    lives = draw(st.lists(near, min_size=1, max_size=3))
    max_seq = max(1, max(lives) + draw(st.sampled_from((0, 1, 3))))
    spec = _spec(max_seq, batch=len(lives), n_kv=n_kv, head_dim=head_dim, dtype=draw(st.sampled_from(DTYPES)),
                 layout=draw(st.sampled_from(("NHD", "HND"))))
    lengths = [min(max(0, live - q_len), max_seq) for live in lives]
    options = dict(
        num_splits=draw(st.integers(1, min(64, attention_plan.max_splits(max_seq)))),
        window=draw(st.none() | st.sampled_from((1, 2)) | near.filter(bool)),
        softcap=draw(st.none() | st.just(10.0)),
        rope=draw(st.none() | st.just(cupykv.Rope(theta=500.0))),
        values=draw(st.sampled_from(POISONS)),
        seed=draw(st.integers(0, 2**16)),
    )
    return spec, lengths, q_len, group, options


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=max(10, settings.default.max_examples // 5))
@given(case=boundary_cases())
def test_boundary_cases_match_the_reference(backend, case):
    spec, lengths, q_len, group, options = case
    attend(backend, spec, lengths, q_len, group, **options)


# -- 9. a non-finite value in an attended row is never hidden -----------------------------------------------
# (dtype, io_dtype, head_dim): CUDA cores for float32 (generic at 8, staged at 64 and 128) and for a
# 16-bit head that is not whole 16-byte copies, tensor cores at one and two m16 tiles' heads, and both
# fp8 kernels.
NON_FINITE_KERNELS = [("float32", "", 8), ("float32", "", 64), ("float32", "", 128), ("float16", "", 36),
                      ("bfloat16", "", 64), ("float16", "", 128), ("float8_e4m3", "float16", 64),
                      ("float8_e4m3", "bfloat16", 72)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim", NON_FINITE_KERNELS, ids=lambda v: str(v) or "-")
@pytest.mark.parametrize("where, value", [("k", NAN), ("k", INF), ("k", -INF), ("v", NAN), ("v", INF)],
                         ids=["k-nan", "k-inf", "k--inf", "v-nan", "v-inf"])   # -inf in V behaves as +inf
def test_a_non_finite_attended_row_is_never_hidden(backend, dtype, io_dtype, head_dim, where, value):
    """A NaN or infinity in an attended K or V row reaches the output wherever the reference's does.

    Rows of kv head 0 hold ``value`` in half their dims: sequence 0's committed rows 37, which every
    query attends in a step of its own, and CHUNK - 1, which with ``window=11`` is query 0's first key
    and no other query's; sequence 1's pending row 38, which queries 0 and 1 share a 16-key step with
    but do not attend; and sequence 2's last pending row, at position CHUNK: with 3 splits it is alone
    in the second split, the only key there its query attends, and with ``window=1`` the only key it
    attends at all. Wherever the reference is non-finite the kernel must be too (a NaN logit or weight
    sum once came out as zeros, as if nothing were attended, or was dropped beside finite ones, as a
    split or chunk with no finite logit); the rows where the reference is finite must match it.
    """
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=2 * CHUNK + 32, batch=3,
                            dtype=dtype, io_dtype=io_dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(head_dim)
    lengths, q_len, group = [CHUNK + 9, 36, CHUNK - 3], 4, 2
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)
    for c in (cache, oracle):
        c.set_lengths(lengths)
    scale = testing.value_scale(oracle, 0)          # over the finite rows, before the poison
    poisoned = {0: [37, CHUNK - 1], 1: [lengths[1] + 2], 2: [lengths[2] + q_len - 1]}
    stored = np.array(testing.to_numpy(getattr(cache, where), spec))
    for b, rows in poisoned.items():
        for array in (stored, getattr(oracle, where)):
            _nhd(array, spec)[0, b, rows, 0, : head_dim // 2] = value
    getattr(cache, where)[...] = cache.to_device(stored.astype(getattr(cache, where).dtype))
    q = testing.random_rows(rng, spec, (spec.batch, q_len, 2 * group, head_dim))
    for window in (None, 1, lengths[0] - (CHUNK - 1) + 1):
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference.attention(q, oracle, 0, window=window)
        reached = ~np.isfinite(want)
        assert reached[:, :, :group].any() and not reached[:, :, group:].any()   # kv head 0 only
        for num_splits in (1, 3):
            got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, window=window,
                                                    num_splits=num_splits), spec, io=True).astype(np.float64)
            context = f"({spec}, {where} = {value} in half the dims, window {window}, {num_splits} splits)"
            assert_non_finite_kept(got, want, spec.io_dtype, scale, context)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim", NON_FINITE_KERNELS, ids=lambda v: str(v) or "-")
def test_a_query_whose_every_logit_is_infinite_is_nan_up_to_the_last_position(backend, dtype, io_dtype, head_dim):
    """A query row with -inf (or +inf, or NaN) in a dim where every key of its kv head is 1 has every
    logit -inf (+inf, NaN): the reference's softmax gives NaN (e^(-inf - (-inf))), and so must the
    kernel, though no weight was summed, unlike a row that attends nothing and returns zeros. Sequence
    0 fills the cache, so its last query sits at ``max_seq - 1``, where a kernel that judged "attends
    nothing" from the position alone (as a window does) would return zeros; sequence 1 does not.
    """
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=2 * CHUNK + 40, batch=2,
                            dtype=dtype, io_dtype=io_dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(head_dim + 1)
    q_len, group = 3, 2
    lengths = [spec.max_seq - q_len, 20]
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)
    for c in (cache, oracle):
        c.set_lengths(lengths)
    stored = np.array(testing.to_numpy(cache.k, spec))
    for array in (stored, oracle.k):
        _nhd(array, spec)[0, :, :, 0, 0] = 1.0   # kv head 0, dim 0: every key positive
    cache.k[...] = cache.to_device(stored.astype(cache.k.dtype))
    q = testing.random_rows(rng, spec, (spec.batch, q_len, 2 * group, head_dim))
    poisoned = {(0, q_len - 1, 0): -INF, (0, 0, 1): -INF, (1, q_len - 1, 1): INF, (1, 1, 0): NAN}
    for (b, i, h), value in poisoned.items():
        q[b, i, h, 0] = value
    poisoned_rows = tuple(zip(*poisoned))   # (batch, query, head) index arrays of those rows
    scale = testing.value_scale(oracle, 0)
    for window in (None, 1, 5):   # 1: the last query attends its own row alone
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference.attention(q, oracle, 0, window=window)
        assert np.isnan(want[poisoned_rows]).all() and np.isfinite(want[:, :, group:]).all()
        for num_splits in (1, 3):
            got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, window=window,
                                                    num_splits=num_splits), spec, io=True).astype(np.float64)
            context = f"({spec}, window {window}, {num_splits} splits)"
            assert np.isnan(got[poisoned_rows]).all(), f"a poisoned query is not NaN {context}"
            assert_non_finite_kept(got, want, spec.io_dtype, scale, context)


def assert_non_finite_kept(got, want, dtype, value_scale, context, may_be_nan=None):
    """``got`` is non-finite wherever ``want`` (the reference) is, and every row (the last axis) where
    ``want`` is finite is finite and within the tolerance, but for rows ``may_be_nan`` (a boolean mask
    of the rows) lets be NaN."""
    reached = ~np.isfinite(want)
    hidden = reached & np.isfinite(got)
    assert not hidden.any(), f"finite output where the reference is not, at {np.argwhere(hidden)[:4].tolist()} {context}"
    finite_rows = ~reached.any(axis=-1)
    if may_be_nan is not None:
        finite_rows &= ~(may_be_nan & np.isnan(got).all(axis=-1))
    assert np.isfinite(got[finite_rows]).all(), f"non-finite output where the reference is finite {context}"
    assert_attention_close(got[finite_rows], want[finite_rows], dtype, value_scale, context=context)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=max(10, settings.default.max_examples // 5))
@given(case=boundary_cases(), data=st.data())
def test_non_finite_attended_values_are_never_hidden_in_any_boundary_case(backend, case, data):
    # The boundary property's cases (tiles, splits, windows, softcap, rope, poison past the attended
    # rows), with 1 to 3 rows in reach of the queries (committed or pending) holding NaN or an
    # infinity in K or V, in some of one kv head's dims. A row is poisoned in K or in V, not both: a
    # -inf logit's weight of 0 times a NaN in V is NaN in the reference and is skipped by the CUDA
    # cores, a case the contract leaves open. On tensor cores a rotated q is three 16-bit pieces, and a
    # piece of 0 times an infinite K element is NaN: the queries that attend that row may be NaN
    # where the reference's -inf logit gives the row a weight of 0 (the contract says so).
    spec, lengths, q_len, group, options = case
    values, seed = options.pop("values"), options.pop("seed")
    rng = np.random.default_rng(seed)
    oracle, q = _oracle(spec, q_len, group, rng, layer=0)
    oracle.set_lengths(lengths)
    tail = [min(n + q_len, spec.max_seq) for n in lengths]
    scale = float(np.abs(oracle.v[0].astype(np.float64)).max())   # over the finite rows
    k, v = _poisoned(oracle, spec, 0, tail, values=values)
    poisoned = set()
    n_heads = group * spec.n_kv_heads
    may_be_nan = np.zeros((spec.batch, q_len, n_heads), bool)
    tensor_cores = attention_plan.attention_kernel(spec.dtype, spec.head_dim).tensor_cores
    pieces = options["rope"] is not None and tensor_cores
    for _ in range(data.draw(st.integers(1, 3), label="poisoned rows")):
        b = data.draw(st.integers(0, spec.batch - 1), label="sequence")
        if tail[b] == 0:
            continue
        row = data.draw(st.integers(0, tail[b] - 1), label="row")
        kv_head = data.draw(st.integers(0, spec.n_kv_heads - 1), label="kv head")
        if (b, row, kv_head) in poisoned:
            continue
        poisoned.add((b, row, kv_head))
        dims = data.draw(st.sampled_from([slice(0, 1), slice(0, spec.head_dim // 2), slice(None)]), label="dims")
        value = data.draw(st.sampled_from([NAN, INF, -INF]), label="value")
        where = data.draw(st.sampled_from(["k", "v"]), label="array")
        for array in ((k, oracle.k) if where == "k" else (v, oracle.v)):
            _nhd(array, spec)[0, b, row, kv_head, dims] = value
        if pieces and where == "k" and math.isinf(value):
            positions = lengths[b] + np.arange(q_len)
            window = options["window"]
            attends = (row <= positions) & ((window is None) | (row > positions - (window or 0)))
            may_be_nan[b, attends, kv_head * group:(kv_head + 1) * group] = True
    cache = cupykv.KVCache(spec, backend=backend)
    cache.k[...], cache.v[...] = cache.to_device(k), cache.to_device(v)
    cache.set_lengths(list(lengths))
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, **options), spec).astype(np.float64)
    reference_options = {name: options[name] for name in ("window", "softcap", "rope")}
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference.attention(q, oracle, 0, **reference_options)
    event("the poison reaches the reference's output" if not np.isfinite(want).all() else "no query attends the poison")
    event("tensor cores" if tensor_cores else "CUDA cores")
    assert_non_finite_kept(got, want, spec.dtype, scale, f"({spec}, lengths {lengths}, q_len {q_len}, {options})",
                           may_be_nan)


# -- 10. a scale near float32's limit, with logits that fit it --------------------------------------------
FLOAT32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim", NON_FINITE_KERNELS, ids=lambda v: str(v) or "-")
def test_a_scale_whose_product_with_q_overflows_still_gives_the_logits(backend, dtype, io_dtype, head_dim):
    """A logit is ``scale * (q . k)``: the kernels multiply the float32 dot product by the scale, so a
    scale that would overflow ``scale * q`` works wherever the logits fit float32.

    - Zero keys, ``scale`` = float32's largest: every logit is 0 and each query averages its V rows.
      The CUDA-core kernel once multiplied q by the scale first: ``inf * 0`` made those queries NaN.
    - Keys times 2^-12 (fp8: a k_scale of 2^-20), ``scale`` = 2^127, q of a few units (so ``scale *
      q`` is past float32's range): one marked key per sequence, which every query leans on, has a
      logit at least 2^100 above every other, so each query returns that key's V row bit for bit.
    """
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=2 * CHUNK + 32, batch=2,
                            dtype=dtype, io_dtype=io_dtype)
    lengths, q_len, group, marked = [CHUNK + 9, 37], 3, 2, [CHUNK + 2, 5]
    oracle, q = _oracle(spec, q_len, group, np.random.default_rng(head_dim), layer=0,
                        marked={b: [position] for b, position in enumerate(marked)})
    q = (4 * q.astype(np.float64)).astype(spec.io_np_dtype)
    quantized = spec.dtype == "float8_e4m3"
    zero_keys = np.zeros_like(oracle.k)
    small_keys = oracle.k.copy() if quantized else (oracle.k.astype(np.float64) * 2.0**-12).astype(oracle.k.dtype)
    for keys, scale, k_scale in ((zero_keys, FLOAT32_MAX, 1.0), (small_keys, 2.0**127, 2.0**-20)):
        oracle.k[...] = keys
        if quantized:
            oracle.set_scales(k_scale=k_scale)
        oracle.set_lengths(lengths)
        cache = cupykv.KVCache(spec, backend=backend, **({"k_scale": k_scale} if quantized else {}))
        cache.k[...], cache.v[...] = cache.to_device(oracle.k), cache.to_device(oracle.v)
        cache.set_lengths(lengths)
        assert np.abs(q.astype(np.float64)).max() * scale > FLOAT32_MAX   # scale * q alone would overflow
        want = reference.attention(q, oracle, 0, scale=scale)
        for num_splits in (1, 3):
            got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, scale=scale, num_splits=num_splits),
                                   spec, io=True).astype(np.float64)
            context = f"({spec}, scale {scale}, {num_splits} splits)"
            if scale == FLOAT32_MAX:
                assert_attention_close(got, want, spec.io_dtype, testing.value_scale(oracle, 0), context=context)
                continue
            for b, position in enumerate(marked):
                row = _nhd(oracle.v, spec)[0, b, position].astype(np.float64)   # [n_kv, hd]
                expected = np.broadcast_to(np.repeat(row, group, axis=0), got[b].shape)
                assert np.array_equal(want[b], expected), f"the reference does not pick the marked key {context}"
                assert np.array_equal(got[b], expected), f"not the marked key's V row, bit for bit {context}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", KERNEL_CASES)
def test_the_row_max_is_found_at_every_key_position_of_a_chunk(backend, dtype, head_dim):
    """Sequence b's one query has logit 0 for every key but key b, where it is 1000 (scale 1000): e^-1000
    is 0 in float32, so the query returns V row b bit for bit. A max reduction that skips a position of
    a chunk, a step or a lane's stride (lane + 32 k) shifts that sequence's weights by less than the
    logit, and e^(1000 - shift) overflows to inf: the row comes out inf or NaN. One sequence per
    position of the first CHUNK keys, all attended by a query at position CHUNK - 1.
    """
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=CHUNK, batch=CHUNK, dtype=dtype)
    cache = cupykv.KVCache(spec, backend=backend)
    keys = np.zeros(spec.shape, spec.np_dtype)
    values = np.random.default_rng(head_dim).standard_normal(spec.shape).astype(spec.np_dtype)
    sequences = np.arange(CHUNK)
    _nhd(keys, spec)[0, sequences, sequences, 0, 0] = 1   # sequence b: key b
    cache.k[...], cache.v[...] = cache.to_device(keys), cache.to_device(values)
    cache.set_lengths([CHUNK - 1] * CHUNK)
    q = np.zeros((CHUNK, 1, 1, head_dim), spec.io_np_dtype)
    q[..., 0] = 1
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, scale=1000.0), spec, io=True)
    want = _nhd(values, spec)[0, sequences, sequences][:, None]   # V row b of sequence b: [batch, 1, n_heads, hd]
    wrong = [b for b in range(CHUNK) if not np.array_equal(got[b], want[b])]
    assert not wrong, f"key positions {wrong} do not give their V row ({spec})"
