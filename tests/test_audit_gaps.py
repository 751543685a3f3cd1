"""Gaps an audit found (issue 11, item 6): each test here fails on a bug the rest of the suite let through.

- uneven last split: every split-KV factor keeps the keys past the last whole chunk;
- masked rows: a NaN or Inf row that a query reads but may not attend never reaches its output;
- device truncate and advance: out-of-contract device values are clamped as the kernels document;
- the split plan: plan_splits' formula, checked on the CPU for a GPU's device figures;
- CuPy allocations inside a captured step are refused (GPU only).
"""
import itertools
import math

import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS

from cupykv import attention_plan

CHUNK = attention_plan.CHUNK


def _value_scale(oracle, layer=0):
    return float(np.abs(oracle.v[layer].astype(np.float64)).max())


# -- 1. uneven last split ----------------------------------------------------------------------
# A split's key range is ceil(range / splits) rounded up to whole chunks. Rounding range / splits
# down first loses the last keys exactly when range // splits is a multiple of the chunk and a
# remainder is left: range = k * CHUNK * splits + r with 0 < r < splits (k = 0: every key).
SPLIT_SPEC = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=64 * CHUNK + CHUNK, batch=2)
SPLITS = [2, 3, 4, 5, 8, 13, 31, 64]


def _uneven_ranges(splits):
    """Pairs of key ranges (one per sequence) of the form k * CHUNK * splits + r, 0 < r < splits."""
    remainders = sorted({1, splits - 1, max(1, splits // 2)})
    ranges = [k * CHUNK * splits + r for k in (0, 1, 2) for r in remainders
              if k * CHUNK * splits + r <= SPLIT_SPEC.max_seq]
    ranges += ranges[-1:] * (len(ranges) % 2)
    return [ranges[i:i + 2] for i in range(0, len(ranges), 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", SPLITS)
def test_the_last_split_keeps_the_keys_past_the_last_whole_chunk(backend, splits):
    spec = SPLIT_SPEC
    rng = np.random.default_rng(splits)
    for ranges in _uneven_ranges(splits):
        cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
        q = testing.random_rows(rng, spec, (spec.batch, 1, 1, spec.head_dim))   # query at position range - 1
        k = (rng.standard_normal(spec.shape) * 0.5).astype(spec.np_dtype)      # [1, batch, max_seq, 1, hd]
        v = testing.random_rows(rng, spec, spec.shape)
        scale = 1 / math.sqrt(spec.head_dim)
        for b, n in enumerate(ranges):
            # The last keys of the range get logit 8 each, so dropping them moves the output by O(|v|).
            last = max(1, n % CHUNK)
            k[0, b, n - last:n, 0] = q[b, 0, 0] * (8 / (scale * float(np.dot(q[b, 0, 0], q[b, 0, 0]))))
        cache.k[...] = cache.to_device(k)
        cache.v[...] = cache.to_device(v)
        oracle.k[...], oracle.v[...] = k, v
        committed = np.array(ranges, np.int32) - 1
        cache.advance(committed)
        oracle.advance(committed)
        testing.poison_tail(cache, ranges)   # a read past the range poisons the output too
        got = cupykv.attention(cache.to_device(q), cache, 0, num_splits=splits)
        want = reference.attention(q, oracle, 0)
        assert_attention_close(testing.to_numpy(got, spec), want, spec.dtype, _value_scale(oracle),
                               context=f"(num_splits {splits}, key ranges {ranges})")


# -- 2. NaN and Inf in rows read but masked --------------------------------------------------------
# A block reads the key range of all the queries of its tile, so a query reads rows it may not
# attend: rows of the same append past its position, and rows below its window that an earlier
# query still sees. Their probability is 0, and 0 * NaN or 0 * Inf would be NaN.
MASK_SPEC = dict(n_layers=1, n_kv_heads=2, head_dim=16, max_seq=300, batch=2)
POISONS = {"float32": (np.nan, np.inf), "float16": (np.nan, -np.inf), "bfloat16": (np.inf, np.nan)}


def _masked_rows_case(backend, dtype, lengths, q_len, window, poisoned, num_splits, seed):
    """Attention with K and V at ``poisoned[b]`` positions of sequence b set to NaN / Inf (as the reference).

    The tail past the pending rows is NaN as well; the layout is HND for an odd seed, else NHD.
    Returns (got, want) as float64 ``[batch, q_len, n_heads, head_dim]`` and the largest finite |v|.
    """
    spec = cupykv.CacheSpec(**MASK_SPEC, dtype=dtype, layout="HND" if seed % 2 else "NHD")
    rng = np.random.default_rng(seed)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, lengths, rng)
    shape = (spec.batch, q_len, spec.n_kv_heads, spec.head_dim)
    k, v = testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)
    cache.append(0, cache.to_device(k), cache.to_device(v))
    oracle.append(0, k, v)
    k_all, v_all = testing.to_numpy(cache.k, spec).copy(), testing.to_numpy(cache.v, spec).copy()
    for b, (positions, value) in enumerate(zip(poisoned, POISONS[dtype])):
        index = (0, b, positions) if spec.layout == "NHD" else (0, b, slice(None), positions)
        for array in (k_all, v_all, oracle.k, oracle.v):
            array[index] = value
    cache.k[...], cache.v[...] = cache.to_device(k_all), cache.to_device(v_all)
    testing.poison_tail(cache, np.asarray(lengths) + q_len)
    q = testing.random_rows(rng, spec, (spec.batch, q_len, 2 * spec.n_kv_heads, spec.head_dim))
    got = cupykv.attention(cache.to_device(q), cache, 0, window=window, num_splits=num_splits)
    with np.errstate(invalid="ignore", over="ignore"):   # the queries that do attend the poison
        want = reference.attention(q, oracle, 0, window=window)
    return testing.to_numpy(got, spec).astype(np.float64), want, _value_scale_finite(oracle)


def _value_scale_finite(oracle):
    v = oracle.v[0].astype(np.float64)
    return float(np.abs(v[np.isfinite(v)]).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("lengths", [[5, 130], [124, 0]], ids=["5,130", "124,0"])
def test_rows_of_the_same_append_past_a_query_never_reach_it(backend, dtype, num_splits, lengths):
    # Four pending rows; query 0 (position lengths[b]) reads rows lengths[b] + 1..3 but may not attend
    # them. With lengths 5 and 130 they sit both in the four-key loop of the value phase and in its
    # remainder loop; with 124 and 0, in the four-key loop at the end of a full chunk and of a short one.
    q_len = 4
    poisoned = [slice(n + 1, n + q_len) for n in lengths]
    got, want, scale = _masked_rows_case(backend, dtype, lengths, q_len, None, poisoned, num_splits,
                                         seed=sum(lengths) + num_splits)
    assert np.isfinite(want[:, 0]).all() and not np.isfinite(want[:, 1:]).all()   # the poison is where meant
    assert np.isfinite(got[:, 0]).all(), "query 0 read a NaN/Inf row past its position"
    assert_attention_close(got[:, 0], want[:, 0], dtype, scale, context=f"(query 0, lengths {lengths})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("q_len, window", [(4, 3), (2, 2)])
def test_rows_below_a_window_never_reach_the_query(backend, dtype, num_splits, q_len, window):
    # The tile's range starts at query 0's window; its first row is outside every later query's
    # window. (4, 3): six keys, the poisoned one in the four-key loop; (2, 2): three keys, remainder loop.
    lengths = [7, 140]
    poisoned = [slice(n - window + 1, n - window + 2) for n in lengths]
    got, want, scale = _masked_rows_case(backend, dtype, lengths, q_len, window, poisoned, num_splits,
                                         seed=q_len + num_splits)
    assert not np.isfinite(want[:, 0]).all() and np.isfinite(want[:, 1:]).all()
    assert np.isfinite(got[:, 1:]).all(), "a query read a NaN/Inf row below its window"
    assert_attention_close(got[:, 1:], want[:, 1:], dtype, scale, context=f"(queries 1.., window {window})")


# -- 3. and 4. device truncate and advance clamp what the host would reject --------------------------
LENGTH_SPEC = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=10, batch=4)


def _filled(backend, lengths):
    cache, oracle = cupykv.KVCache(LENGTH_SPEC, backend=backend), reference.KVCache(LENGTH_SPEC)
    testing.fill(cache, oracle, lengths, np.random.default_rng(0))
    return cache, oracle


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_truncate_never_grows_a_sequence(backend):
    # cache.truncate: "a device array is clamped on the device so that it can only shorten";
    # truncate.cu: lengths[b] = min(lengths[b], max(new_lengths[b], 0)). The host form is refused.
    cache, oracle = _filled(backend, [5, 3, 0, 10])
    targets = np.array([9, 3, 2, 2**31 - 1], np.int32)    # grow, equal, grow from 0, grow at capacity
    with pytest.raises(ValueError, match=r"^new_lengths: expected"):
        oracle.truncate(targets)
    cache.truncate(cache.to_device(targets))
    oracle.truncate(np.minimum(oracle.lengths, np.maximum(targets, 0)))
    assert cache.lengths_host().tolist() == [5, 3, 0, 10]
    testing.assert_matches_reference(cache, oracle)
    targets = np.array([-4, 7, -(2**31), 4], np.int32)    # negative: to 0
    cache.truncate(cache.to_device(targets))
    oracle.truncate(np.minimum(oracle.lengths, np.maximum(targets, 0)))
    assert cache.lengths_host().tolist() == [0, 3, 0, 4]
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_truncate_that_would_grow_is_clamped_on_every_replay(backend):
    cache, oracle = _filled(backend, [6, 2, 0, 9])
    targets = cache.to_device(np.array([8, 1, 3, 9], np.int32))
    graph = cupykv.capture(lambda: (cache.truncate(targets), cache.advance(1)))
    for _ in range(3):   # the warm-up step, then two replays
        oracle.truncate(np.minimum(oracle.lengths, [8, 1, 3, 9]))
        oracle.advance(1)
    graph.replay(2)
    assert cache.lengths_host().tolist() == oracle.lengths.tolist() == [9, 2, 3, 10]
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_advance_treats_negative_steps_as_zero(backend):
    # advance.cu: step = max(per_seq_steps[b], 0); a negative step neither shortens nor sets a flag.
    # The contract only allows n >= 0 and the reference (host values only) refuses negatives.
    cache, oracle = _filled(backend, [5, 10, 0, 9])
    steps = np.array([-3, -1, -(2**31), 2**31 - 1], np.int32)
    with pytest.raises(ValueError, match=r"^n: expected"):
        oracle.advance(steps)
    cache.advance(cache.to_device(steps))
    oracle.advance(np.maximum(steps, 0))
    assert cache.lengths_host().tolist() == [5, 10, 0, 10]
    assert cache._backend.to_host(cache.overflow).tolist() == [0, 0, 0, 1]
    testing.assert_matches_reference(cache, oracle)


# -- 5. the split plan on the CPU -------------------------------------------------------------------
H200_BLOCKS = 264   # the table below: 132 SMs x 2 resident blocks


def _spec(batch, n_kv_heads, max_seq):
    return cupykv.CacheSpec(n_layers=1, n_kv_heads=n_kv_heads, head_dim=64, max_seq=max_seq, batch=batch)


# (batch, n_kv_heads, q_len, n_heads, max_seq) -> splits. blocks = batch * n_kv * ceil(q_len * group / 16);
# splits = ceil(264 / blocks), at most max_seq // 256, at least 1.
PLANS = [
    ((1, 8, 1, 32, 32768), 33),    # 8 blocks: 33 splits fill 264
    ((1, 8, 1, 32, 4096), 16),     # capped: 4096 / 16 = 256 keys a split
    ((1, 8, 1, 32, 4351), 16),     # 4351 // 256 = 16
    ((1, 8, 1, 32, 4352), 17),
    ((1, 1, 1, 1, 1 << 20), 264),  # one block: one split per target block
    ((2, 8, 1, 32, 32768), 17),    # 16 blocks: ceil(16.5)
    ((1, 8, 4, 64, 32768), 17),    # q_len 4 x group 8 = 32 rows: 2 tiles, 16 blocks
    ((1, 8, 2, 64, 32768), 33),    # 16 rows: 1 tile
    ((1, 8, 3, 48, 32768), 17),    # 18 rows: 2 tiles
    ((4, 8, 1, 32, 32768), 9),     # 32 blocks: ceil(8.25)
    ((32, 8, 1, 32, 32768), 2),    # 256 blocks: not yet full
    ((33, 8, 1, 32, 32768), 1),    # 264 blocks: full
    ((64, 8, 1, 32, 32768), 1),    # more than full
    ((1, 8, 1, 32, 511), 1),       # 511 // 256 = 1
    ((1, 8, 1, 32, 255), 1),       # fewer than 256 keys in all: never below 1
    ((1, 8, 1, 32, 1), 1),
]


@pytest.mark.parametrize("shape, splits", PLANS, ids=[str(p[0]) for p in PLANS])
def test_plan_splits_for_a_gpu(shape, splits):
    batch, n_kv, q_len, n_heads, max_seq = shape
    assert attention_plan.plan_splits(_spec(batch, n_kv, max_seq), q_len, n_heads, H200_BLOCKS) == splits


@pytest.mark.parametrize("resident", [1, 132, 264, 660])
def test_plan_splits_stays_within_its_caps(resident):
    broken = []
    for batch, (n_kv_heads, q_len, n_heads), max_seq in itertools.product(
            [1, 2, 3, 5, 16, 33, 100], [(1, 1, 1), (8, 1, 32), (4, 5, 16), (2, 16, 16)],
            [1, 255, 256, 700, 4096, 131072]):
        splits = attention_plan.plan_splits(_spec(batch, n_kv_heads, max_seq), q_len, n_heads, resident)
        blocks = batch * n_kv_heads * math.ceil(q_len * (n_heads // n_kv_heads) / attention_plan.TILE_ROWS)
        fewest_keys = max_seq // splits if splits > 1 else None
        caps = {
            "at least 1 split": splits >= 1,
            "at least 256 keys a split": splits == 1 or fewest_keys >= attention_plan.MIN_KEYS_PER_SPLIT,
            "no split past a full device": (splits - 1) * blocks < resident or splits == 1,
            "1 split when the device is full": blocks < resident or splits == 1,
            # the largest such plan: one split more would break a cap
            "no fewer than the caps allow": max_seq // (splits + 1) < attention_plan.MIN_KEYS_PER_SPLIT
            or splits * blocks >= resident,
        }
        broken += [(batch, n_kv_heads, q_len, n_heads, max_seq, splits, cap) for cap, ok in caps.items() if not ok]
    assert not broken, f"(batch, n_kv_heads, q_len, n_heads, max_seq, splits, broken cap): {broken[:5]}"


def test_the_emulator_always_plans_one_split():
    cache = cupykv.KVCache(cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=8192), backend="emulator")
    assert cupykv.AttentionPlan(cache, 1, 1).num_splits == 1


# -- 6. a CuPy allocation inside a captured step ------------------------------------------------------
@pytest.mark.gpu
def test_a_cupy_allocation_inside_a_captured_step_is_a_capture_error():
    # Not a cupykv allocation (those check for a capture themselves) but CuPy's own, which only the
    # allocator capture() installs can see.
    import cupy

    cache = cupykv.KVCache(LENGTH_SPEC, backend="cupy")
    allocated = []

    def step():
        cache.advance(1)
        allocated.append(cupy.zeros((4, 16), cupy.float32))

    with pytest.raises(cupykv.CaptureError, match=r"allocation of \d+ bytes inside a captured step"):
        cupykv.capture(step)
    assert len(allocated) == 1     # the warm-up allocated; the capture did not
