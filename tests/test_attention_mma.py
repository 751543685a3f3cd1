"""The tensor-core attention kernel (kernels/attention_mma.cu): what its design could get wrong.

16-bit caches at head_dim 64, 96, 128 and 256 run on mma.sync with K/V staged by cp.async in 16-key
warp steps (4 key warps at head_dim 64, 2 at 96 and 128, 1 at 256, whose two row tiles are two
warps; at 96 a warp's copies run on across row ends). Smaller heads whose rows are whole 16-byte
copies run padded on the next of those sizes up. The general suites (test_attention*, the property and
stateful tests) run it against the reference within the stated tolerances; these tests pin what
those tolerances are too loose to see, or where its own tiling has edges:

- precision: its fp32 split results equal those of the CUDA-core kernel on the same values in a
  float32 cache, to fp32 accumulation error, with rope (q rotated in fp32: three 16-bit pieces),
  softcap and large logits. A dropped piece of q or of P is 100x to 1000x past that bound;
- the 16-key warp steps and the rounds of 2 or 4 key warps: lengths and windows at every edge, with
  one row group and with two (whose warps share the stages and meet at block barriers);
- one, two or four m16 row tiles per block (one or two at head_dim 256): q_len x group from 1 to 128
  rows, at every tile, row group and block edge, each row against the reference, with NaN in pending
  rows past the last query;
- splits 1..64 with an uneven last split, on this kernel;
- rows pending in the same step as a query but past it, holding NaN and inf: zero-filled or masked,
  never read into a product;
- bit-identical rows across q_len with split_keys (speculative verification equals greedy);
- padded heads (80 on the 96 instance, 40 on 64, ...): nothing read past a row (NaN after it, the
  buffer's end after the last), nothing written past it, rope at the cache's own head size;
- masks only in the steps a mask cuts: in blocks of rows at several positions, the V stage is read
  for non-finite elements (traffic(banks=True)) in those steps and no others.
"""
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from cupykv.attention_plan import attention_kernel, block_row_choices
from cupykv.backends.emulator.accounting import CopyWaits
from cupykv.kernels import ATTENTION_HEAD_DIMS, KERNEL_DIR, KERNELS, attention_mma_head_dim
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS
from source_lines import source_site
from test_traffic import cache_and_zero_queries

MMA = KERNELS["attention_mma"].constants("attention_mma_tiling")
F32 = KERNELS["attention_f32"].constants("attention_f32_tiling")   # the float32 kernel, beside it in two tests
STEP = MMA["kStepKeys"]
WARPS = {64: MMA["kWarps64"], 96: MMA["kWarps96"], 128: MMA["kWarps128"], 256: MMA["kWarps256"]}
CASES = [("bfloat16", 128), ("float16", 64), ("bfloat16", 64), ("float16", 128), ("float16", 96), ("bfloat16", 256)]
# the edge tests: a case of each head_dim's key-warp count (2, 4 and 1) and of rows that are not a
# power-of-two count of copies (96)
EDGE_CASES = CASES[:2] + CASES[-2:]
# (query rows, row tiles, warps per key warp): at head_dim 64 and 128 a warp holds two tiles and a block
# four; at 256 a warp holds one and a block two
TILINGS = {64: ((1, 1, 1), (16, 1, 1), (17, 2, 1), (32, 2, 1), (33, 4, 2), (64, 4, 2), (128, 4, 2)),
           256: ((1, 1, 1), (16, 1, 1), (17, 2, 2), (32, 2, 2), (33, 2, 2), (64, 2, 2), (128, 2, 2))}


def test_the_plan_picks_tensor_cores_for_16_bit_caches_at_64_96_128_and_256_only():
    for dtype in ("float16", "bfloat16"):
        cuda_type = "__half" if dtype == "float16" else "__nv_bfloat16"
        for head_dim in (64, 96, 128, 256):
            for query_rows, row_tiles, row_groups in TILINGS[256 if head_dim == 256 else 64]:
                kernel = attention_kernel(dtype, head_dim, query_rows=query_rows)
                assert kernel.tensor_cores
                assert kernel.instance == f"cupykv_attention_mma<{cuda_type}, {cuda_type}, {head_dim}, {row_tiles}>"
                # the same key warps at every row count: they split the keys, so a row's sums follow them;
                # four tiles take two warps per key warp
                assert kernel.threads == 32 * WARPS[head_dim] * row_groups and kernel.rows_per_block == 16 * row_tiles
                assert type(kernel.threads) is int   # a launch's block: 64, not 64.0
                loop = row_tiles * MMA[f"kQTile{head_dim}"] + MMA[f"kStages{head_dim}"]
                # accumulators (rows padded: conflict-free stores), row max and sum
                merge = WARPS[head_dim] * 16 * row_tiles * (head_dim + MMA["kAccPad"] + 2) * 4
                assert kernel.shared_mem_bytes == max(loop, merge)
                assert (kernel.shared_mem_bytes == merge) == (row_tiles == 4 and head_dim == 64)
                assert kernel.shared_mem_bytes <= MMA["kMaxShared"]
                assert kernel.opts_in_to_shared_memory == (kernel.shared_mem_bytes > 48 * 1024)
        for head_dim in (36, 100, 255, 2, 264):   # rows that are not whole 16-byte copies, or past 256
            assert not attention_kernel(dtype, head_dim, query_rows=64).tensor_cores
    assert not attention_kernel("float32", 128, query_rows=64).tensor_cores
    # one row tile fits without the opt-in; two take it at head_dim 128 (q pieces of 32 rows and the stages)
    assert not attention_kernel("bfloat16", 128, query_rows=16).opts_in_to_shared_memory
    assert attention_kernel("bfloat16", 128, query_rows=17).opts_in_to_shared_memory
    # head_dim 256: one key warp's stages (16 keys of 512-byte K and V rows, twice) and one tile's q
    # pieces; four tiles would take 132 KiB, past the 99 KiB sm_86 and sm_89 allow a block
    assert attention_kernel("bfloat16", 256, query_rows=16).shared_mem_bytes == 2 * 2 * 16 * 264 * 2 + 3 * 16 * 264 * 2
    assert block_row_choices("bfloat16", 256) == (16, 32) and block_row_choices("float16", 128) == (16, 32, 64)


def _twins(backend, dtype, head_dim, lengths, *, n_kv=2, max_seq=700, seed=0, scale=1.0):
    """A 16-bit cache and a float32 cache holding the same values (16-bit values are exact in fp32)."""
    rng = np.random.default_rng(seed)
    specs = [cupykv.CacheSpec(n_layers=1, n_kv_heads=n_kv, head_dim=head_dim, max_seq=max_seq,
                              batch=len(lengths), dtype=d) for d in (dtype, "float32")]
    caches = [cupykv.KVCache(spec, backend=backend) for spec in specs]
    shape = (len(lengths), max(lengths), n_kv, head_dim)
    k, v = (testing.random_rows(rng, specs[0], shape, scale) for _ in "kv")
    for cache, spec in zip(caches, specs):
        cache.append(0, cache.to_device(k.astype(spec.np_dtype)), cache.to_device(v.astype(spec.np_dtype)))
        cache.advance(lengths)
    return caches, rng


def _split_results(plan, q):
    """The plan's per-split softmax outputs (fp32): partial_out / partial_sum, zeros where a split is empty."""
    plan.run(q, 0)
    workspace = plan._workspace
    out, total = (testing.to_numpy(a, plan.cache.spec) for a in (workspace.partial_out, workspace.partial_sum))
    return np.divide(out, total[..., None], out=np.zeros_like(out), where=total[..., None] > 0), total


def _assert_split_results_equal_the_cuda_core_kernels(cache16, cache32, q, **options):
    """Three-split plans over twin caches (``_twins``) for ``q`` [batch, 2, 8, head_dim]: the tensor-core
    kernel's per-split results and row sums equal the CUDA-core kernel's to fp32 accuracy."""
    plans = [cupykv.AttentionPlan(c, 2, 8, num_splits=3, **options) for c in (cache16, cache32)]
    assert plans[0].kernel.tensor_cores and not plans[1].kernel.tensor_cores
    (got, got_sum), (want, want_sum) = (_split_results(p, c.to_device(q.astype(c.spec.np_dtype)))
                                        for p, c in zip(plans, (cache16, cache32)))
    assert np.isfinite(got).all() and np.isfinite(got_sum).all()
    assert np.array_equal(got_sum > 0, want_sum > 0)
    # the workspace's row sums are sum_j e^(s_j - max) on both kernels, whatever factor the mma's operands
    # took; each weight's exponent differs by up to |s_j - max| 2^-24 (about 60 2^-24 for logits of 30)
    # plus 2 ulp
    sum_error = float(np.abs(got_sum - want_sum).max() / np.abs(want_sum).max())
    assert sum_error <= 256 * 2.0 ** -24, f"split row sums differ by {sum_error:.3g}"
    value_scale = float(np.abs(want).max())
    error = np.abs(got - want).max() / value_scale
    # an fp32 dot product's error grows with its length: at head_dim 256 each kernel's merged result is
    # up to three times as far from a float64 computation as at 128 (41 to 63 x 2^-24 of the value scale
    # against 14 to 41 for these cases), and their difference with it
    bound = (192 if cache16.spec.head_dim == 256 else 64) * 2.0 ** -24
    assert error <= bound, f"split results differ by {error:.3g} of the value scale"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", CASES)
@pytest.mark.parametrize("options", [dict(), dict(rope=cupykv.Rope()), dict(softcap=20.0, rope=cupykv.Rope(theta=500)),
                                     dict(window=100)], ids=["plain", "rope", "softcap-rope", "window"])
def test_split_results_equal_the_cuda_core_kernel_to_fp32_accuracy(backend, dtype, head_dim, options):
    # logits of about +-30 (scale 1, values of 2): a 16-bit q rounds them by about 0.1, P's hi piece alone
    # moves a weight by up to 2**-9 relative: both far past the fp32 bound asserted here
    lengths = [301, 37, 640]
    (cache16, cache32), rng = _twins(backend, dtype, head_dim, lengths, scale=2.0 if dtype == "bfloat16" else 1.0)
    q = testing.random_rows(rng, cache16.spec, (3, 2, 8, head_dim), 2.0 if dtype == "bfloat16" else 1.0)
    _assert_split_results_equal_the_cuda_core_kernels(cache16, cache32, q, scale=1.0 / 8, **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("largest", [2.0 ** -9, 6e4], ids=["small", "large"])
def test_rotated_half_q_rows_keep_fp32_accuracy_at_either_end_of_the_half_range(backend, head_dim, largest):
    """A half cache with rope cuts q rotated in fp32 into three half pieces. Rows whose largest |q| is
    2^-9 would leave their third piece (2^-33 of it) far below the half's subnormal step 2^-24, and rows
    near 6e4 rotate past the half's 65504 (a pair (x, y) rotates to up to sqrt(x^2 + y^2)). Each row is
    first brought into [2^14, 2^15) by a power of two, and its logits take the inverse, so the split
    results equal the CUDA-core kernel's on the same values to fp32 accuracy. The rows differ in size by
    up to a factor 16, so their factors differ."""
    lengths = [301, 37]
    (cache16, cache32), rng = _twins(backend, "float16", head_dim, lengths)
    q = rng.uniform(-1.0, 1.0, (2, 2, 8, head_dim)) * largest
    q *= 2.0 ** -rng.integers(0, 5, (2, 2, 8, 1))   # row sizes a factor 16 apart
    q[..., 0] = np.where(rng.random((2, 2, 8)) < 0.5, -1.0, 1.0) * np.abs(q).max(axis=-1) * 1.001   # a pair's large x
    q = q.astype(np.float16)
    assert np.isfinite(q).all()
    scale = 2.0 / (largest * np.sqrt(head_dim))   # logits of about +-2 (k of about 1)
    _assert_split_results_equal_the_cuda_core_kernels(cache16, cache32, q, scale=scale, rope=cupykv.Rope(theta=500.0))


# the operand types of P V: half for a half cache and an fp8 cache with half io; bf16 (no subnormals in
# this range) for a bf16 cache
P_OPERANDS = [("float16", None), ("float8_e4m3", "float16"), ("bfloat16", None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype", P_OPERANDS, ids=["half", "fp8-half-io", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_weights_below_the_half_subnormal_range_still_count(backend, dtype, io_dtype, head_dim):
    """P V takes P as half pieces when the operands are half. A half below 2^-14 is subnormal, with a
    step of 2^-24, so a weight under 2^-25 would round to zero in both pieces. Here the first key of
    each key warp in each split has a logit 17.375 above the split's other keys (weights e^-17.375,
    2.9e-8), so every warp's max is such a key: the other keys' share of the split's result (V 1
    against 0) must survive, to fp32 accuracy."""
    split_keys, length = 2048, 4096
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=length + 8, batch=1, dtype=dtype,
                            io_dtype=io_dtype)
    cache = cupykv.KVCache(spec, backend=backend)
    keys = np.arange(length + 1)   # the committed rows and the query's own
    top = (keys % split_keys < STEP * WARPS[head_dim]) & (keys % STEP == 0)   # each key warp's first key of a split
    k = np.zeros((1, length + 1, 1, head_dim), spec.io_np_dtype)
    v = np.ones_like(k)
    k[0, top, 0, 0] = 16.0
    v[0, top] = 0.0
    cache.append(0, cache.to_device(k), cache.to_device(v))
    cache.advance([length])
    q = np.zeros((1, 1, 1, head_dim), spec.io_np_dtype)
    q[0, 0, 0, 0] = 1.0
    plan = cupykv.AttentionPlan(cache, 1, 1, split_keys=split_keys, scale=17.375 / 16)
    assert plan.kernel.tensor_cores
    got, _ = _split_results(plan, cache.to_device(q))
    weights = np.where(top, 1.0, np.exp(-17.375))
    for split in range(len(got)):
        part = slice(split * split_keys, (split + 1) * split_keys)
        want = np.dot(weights[part], v[0, part, 0, 0].astype(np.float64)) / weights[part].sum()
        error = np.abs(got[split, 0] - want).max()
        assert error <= 64 * 2.0 ** -24, f"split {split}: {got[split, 0, 0]:.6g}, want {want:.6g}"


# (q_len, group, row): the row whose max moves late. 16 rows (one tile): rows 3 and 12, a lane's first
# and second half (quad_row and quad_row + 8); 32 rows: row 21, in the warp's second tile; 64 rows (two
# row groups): rows 45 and 62, in the second group's first and second tile
MOVING_ROWS = [(1, 16, 3), (1, 16, 12), (4, 8, 21), (8, 8, 45), (8, 8, 62)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", CASES)
@pytest.mark.parametrize("q_len, group, moving_row", MOVING_ROWS, ids=[f"row{r}of{q * g}" for q, g, r in MOVING_ROWS])
def test_a_new_max_in_a_late_step_rescales_that_rows_sums(backend, dtype, head_dim, q_len, group, moving_row):
    """A tile's accumulators are rescaled only in a step where a warp vote finds a row whose max moved.
    Here every row's max is key 0's logit, except one row whose max moves at key 260 (step 16 of 19)
    by 8: that step alone must rescale the row's sums, by e^-8. Row r's query
    is 4 e_r, so its logits are 4 k[j, r]: key 0 is 2 in every dim, key 260 is 4 in the moving
    row's dim, and the other keys are small."""
    length = 300
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=length + q_len + 4, batch=1,
                            dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(moving_row)
    k = rng.standard_normal((1, length + q_len, 1, head_dim)) * 0.125
    k[:, 0] = 2.0
    k[:, 260, 0, moving_row] = 4.0
    k = k.astype(spec.io_np_dtype)
    v = testing.random_rows(rng, spec, (1, length + q_len, 1, head_dim))
    cache.append(0, cache.to_device(k), cache.to_device(v))
    oracle.append(0, k, v)
    cache.advance([length])
    oracle.advance([length])
    q = np.zeros((1, q_len, group, head_dim), spec.io_np_dtype)
    for row in range(q_len * group):
        q[0, row // group, row % group, row] = 4.0
    for num_splits in (1, 2):
        got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, scale=1.0, num_splits=num_splits), spec)
        want = reference.attention(q, oracle, 0, scale=1.0)
        assert_attention_close(got, want, dtype, float(np.abs(v.astype(np.float32)).max()), f"num_splits={num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", CASES)
@pytest.mark.parametrize("q_len", [1, 16], ids=["4rows", "64rows"])   # one row group, or two
def test_lengths_at_every_step_and_warp_round_edge(backend, dtype, head_dim, q_len):
    round_keys = STEP * WARPS[head_dim]
    edges = sorted({e + d for e in (STEP, 2 * STEP, round_keys, 2 * round_keys + STEP, 128) for d in (-1, 0, 1)})
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=max(edges) + 3,
                            batch=len(edges), dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(1)
    # the queries' own rows make e live rows for the last query (and e - q_len + 1 .. e for the others)
    testing.fill(cache, oracle, [max(e - q_len, 0) for e in edges], rng)
    q = testing.random_rows(rng, spec, (len(edges), q_len, 4, head_dim))
    for num_splits in (1, 2):
        got = cupykv.attention(cache.to_device(q), cache, 0, num_splits=num_splits)
        assert_attention_close(testing.to_numpy(got, spec), reference.attention(q, oracle, 0), dtype,
                               float(np.abs(oracle.v.astype(np.float32)).max()), f"num_splits={num_splits}")


# (dtype, head_dim, splits, q_len): every split count and row tiling at head_dim 64 and 128; at 96 and
# 256, whose split logic is the same code, the smallest, an odd and the largest counts at one tile and
# at the most tiles (the emulator's time)
SPLIT_CASES = [(dtype, head_dim, splits, q_len) for dtype, head_dim in EDGE_CASES
               for splits in ([1, 2, 3, 5, 8, 13, 32, 64] if head_dim in (64, 128) else [1, 13, 64])
               for q_len in ([1, 5, 9] if head_dim in (64, 128) else [1, 9] if head_dim == 96 else [1, 5])]
# GQA 4: 4, 20 and 36 rows, 1, 2 or 4 row tiles (at 256, whose most is 2: 4 and 20 rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim, splits, q_len", SPLIT_CASES,
                         ids=[f"{d}-{hd}-{s}splits-{4 * q}rows" for d, hd, s, q in SPLIT_CASES])
def test_every_split_count_with_an_uneven_last_split(backend, dtype, head_dim, splits, q_len):
    lives = [splits * 128 + 1, 2 * 128 * splits + 1 if splits <= 8 else 300, 17]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=max(lives) + q_len + 3,
                            batch=len(lives), dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(splits)
    testing.fill(cache, oracle, [n - 1 for n in lives], rng)
    q = testing.random_rows(rng, spec, (len(lives), q_len, 8, head_dim))
    got = cupykv.attention(cache.to_device(q), cache, 0, num_splits=min(splits, (max(lives) + 4 + 127) // 128))
    assert_attention_close(testing.to_numpy(got, spec), reference.attention(q, oracle, 0), dtype,
                           float(np.abs(oracle.v.astype(np.float32)).max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", EDGE_CASES)
@pytest.mark.parametrize("window", [1, STEP - 1, STEP, STEP + 1, 2 * STEP, 100])
@pytest.mark.parametrize("q_len", [3, 12], ids=["12rows", "48rows"])   # one row group, or two
def test_windows_at_step_edges(backend, dtype, head_dim, window, q_len):
    lengths = [2 * STEP * WARPS[head_dim] + 5, STEP + 2, 3 * STEP, 200]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=260,
                            batch=len(lengths), dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(window)
    testing.fill(cache, oracle, lengths, rng)
    q = testing.random_rows(rng, spec, (len(lengths), q_len, 4, head_dim))
    got = cupykv.attention(cache.to_device(q), cache, 0, window=window, num_splits=2)
    assert_attention_close(testing.to_numpy(got, spec), reference.attention(q, oracle, 0, window=window), dtype,
                           float(np.abs(oracle.v.astype(np.float32)).max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", EDGE_CASES)
def test_pending_rows_past_the_query_in_its_own_step_are_never_read(backend, dtype, head_dim):
    """Rows appended past a q_len-1 query share its 16-key step: they are past the split, so the
    copy zero-fills them and nothing of their NaN / inf reaches the output."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=64, batch=2, dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(4)
    testing.fill(cache, oracle, [5, 19], rng)
    k, v = (testing.random_rows(rng, spec, (2, 6, 1, head_dim)) for _ in "kv")
    k[:, 1:] = np.nan
    v[:, 1:3] = np.inf
    v[:, 3:] = np.nan
    cache.append(0, cache.to_device(k), cache.to_device(v))   # pending: row 0 is the query's own
    oracle.append(0, k, v)
    q = testing.random_rows(rng, spec, (2, 1, 2, head_dim))
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0), spec)
    assert np.isfinite(got.astype(np.float32)).all()
    attended = [oracle.v[0, b, :length + 1].astype(np.float32) for b, length in enumerate([5, 19])]
    assert_attention_close(got, reference.attention(q, oracle, 0), dtype, max(float(np.abs(a).max()) for a in attended))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", EDGE_CASES + [("float32", hd) for hd in ATTENTION_HEAD_DIMS])  # and the
def test_a_row_is_bit_identical_for_every_q_len_with_split_keys(backend, dtype, head_dim):  # staged float32 kernel
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=600, batch=2, dtype=dtype)
    rng = np.random.default_rng(5)
    cache = cupykv.KVCache(spec, backend=backend)
    rows = testing.random_rows(rng, spec, (2, 420, 2, head_dim))
    cache.append(0, cache.to_device(rows), cache.to_device(rows[:, ::-1].copy()))
    cache.advance([300, 411])
    q = testing.random_rows(rng, spec, (2, 16, 6, head_dim))
    alone = testing.to_numpy(cupykv.AttentionPlan(cache, 1, 6, split_keys=256).run(cache.to_device(q[:, :1].copy()), 0),
                             spec)
    for q_len in (2, 5, 9, 16):   # 12, 30 (two row tiles), 54 (four: two row groups) and 96 rows (two blocks)
        together = cupykv.AttentionPlan(cache, q_len, 6, split_keys=256).run(cache.to_device(q[:, :q_len].copy()), 0)
        assert np.array_equal(testing.bits(testing.to_numpy(together, spec)[:, :1]), testing.bits(alone)), q_len


# (q_len, group): rows 17 (the second tile holds one row), 31, 32 (one full block of two tiles); past 32
# a block of four tiles in two row groups: 33 (the second group holds one row), 40, 48, 64 (one full
# block), 65 (a second block whose second group is past the rows), 96 (the same, with its first group
# full) and 128 (two full blocks)
ROW_SHAPES = [(17, 1), (31, 1), (8, 4), (11, 3), (5, 8), (16, 3), (8, 8), (13, 5), (12, 8), (16, 8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", CASES)
@pytest.mark.parametrize("q_len, group", ROW_SHAPES, ids=[f"q{q}xg{g}" for q, g in ROW_SHAPES])
def test_two_and_four_row_tiles_at_every_tile_group_and_block_edge(backend, dtype, head_dim, q_len, group):
    """Every row of a two- or four-tile block equals the reference; rows appended past the last query
    share its step and hold NaN and inf, which must never reach a product."""
    lengths = [3, 2 * STEP * WARPS[head_dim] + 5, 130]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=max(lengths) + q_len + 24,
                            batch=len(lengths), dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(q_len * 8 + group)
    testing.fill(cache, oracle, lengths, rng)
    k, v = (testing.random_rows(rng, spec, (len(lengths), q_len + 20, 2, head_dim)) for _ in "kv")
    k[:, q_len:] = np.nan   # pending rows past the last query: in its step, past its keys
    v[:, q_len:q_len + 3] = np.inf
    v[:, q_len + 3:] = np.nan
    cache.append(0, cache.to_device(k), cache.to_device(v))
    oracle.append(0, k, v)
    q = testing.random_rows(rng, spec, (len(lengths), q_len, 2 * group, head_dim))
    plan = cupykv.AttentionPlan(cache, q_len, 2 * group, num_splits=2)
    block_rows = min(32 if q_len * group <= 32 else 64, block_row_choices(dtype, head_dim)[-1])
    assert plan.kernel.rows_per_block == block_rows
    assert plan.grid == (len(lengths) * 2 * -(-q_len * group // block_rows), 2)
    got = testing.to_numpy(plan.run(cache.to_device(q), 0), spec)
    assert np.isfinite(got.astype(np.float32)).all()
    attended = max(float(np.abs(oracle.v[0, b, :n + q_len].astype(np.float32)).max()) for b, n in enumerate(lengths))
    assert_attention_close(got, reference.attention(q, oracle, 0), dtype, attended)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", EDGE_CASES)
@pytest.mark.parametrize("options", [dict(window=60, num_splits=3), dict(rope=cupykv.Rope(), softcap=30.0),
                                     dict(split_keys=128)], ids=["window", "rope-softcap", "split_keys"])
@pytest.mark.parametrize("q_len, group", [(9, 4), (32, 1), (48, 1)], ids=["q9xg4", "q32xg1", "q48xg1"])
def test_more_row_tiles_with_windows_rope_and_fixed_splits(backend, dtype, head_dim, options, q_len, group):
    # 36 rows: four tiles, the second row group holding 4 rows; 32 queries of one head: a block whose
    # second tile's windows start 16 keys after the first tile's (its unmasked steps must follow the
    # last query); 48 queries of one head: a second row group whose windows start 32 keys later
    lengths = [40, 300]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=360, batch=2, dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(7)
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)
    cache.set_lengths(lengths)
    oracle.set_lengths(lengths)
    q = testing.random_rows(rng, spec, (2, q_len, 2 * group, head_dim))
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, **options), spec)
    reference_options = {name: value for name, value in options.items() if name in ("window", "rope", "softcap")}
    want = reference.attention(q, oracle, 0, **reference_options)
    assert_attention_close(got, want, dtype, float(np.abs(oracle.v.astype(np.float32)).max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, head_dim", EDGE_CASES)
@pytest.mark.parametrize("options", [dict(num_splits=1), dict(split_keys=128), dict(rope=cupykv.Rope(), split_keys=256)],
                         ids=["unsplit", "split_keys", "rope-split_keys"])
def test_every_rows_per_block_gives_the_same_bits(backend, dtype, head_dim, options):
    """rows_per_block (16, 32 or 64 rows: 1, 2 or 4 m16 tiles; 16 or 32 at head_dim 256) changes which
    warps compute a row, not the order of its sums: unsplit or with split_keys every row is
    bit-identical at each block size."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=400, batch=2, dtype=dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(11)
    testing.fill(cache, oracle, [150, 333], rng)
    cache.set_lengths([141, 324])   # 9 queries over rows already written: 36 rows per kv head at GQA 4
    q = cache.to_device(testing.random_rows(rng, spec, (2, 9, 8, head_dim)))
    results = {}
    choices = block_row_choices(dtype, head_dim)
    assert len(choices) == (2 if head_dim == 256 else 3)
    for rows in (None, *choices):
        plan = cupykv.AttentionPlan(cache, 9, 8, rows_per_block=rows, **options)
        assert plan.kernel.rows_per_block == (rows or choices[-1])
        assert plan.grid[0] == 2 * 2 * -(-36 // (rows or choices[-1]))
        results[rows] = testing.bits(testing.to_numpy(plan.run(q, 0), spec))
    for rows in choices:
        assert np.array_equal(results[rows], results[None]), rows


# Smaller heads on the next instance up (attention_mma_head_dim): (dtype, io dtype, head_dim, instance).
# 80: Phi-2; 40: a copy short of half the 64 instance; 112 and 160: one and three row pieces of padding
# (160 on the 256 instance, one key warp); fp8 rows are whole copies at multiples of 16.
PADDED = [("bfloat16", "", 80, 96), ("float16", "", 40, 64), ("bfloat16", "", 112, 128), ("float16", "", 160, 256),
          ("float8_e4m3", "bfloat16", 80, 96), ("float8_e4m3", "float16", 48, 64)]
# float32 heads padded onto the staged CUDA-core kernel (attention_f32.cu), which pads as this one does
# (20: five copies of the 32 instance's eight; 200: the 256 instance's second dims of each lane in part)
PADDED_F32 = [("float32", "", 80, 128), ("float32", "", 36, 64), ("float32", "", 100, 128), ("float32", "", 20, 32),
              ("float32", "", 200, 256)]


def test_a_head_whose_rows_are_whole_copies_takes_the_next_tensor_core_instance_up():
    for dtype in ("float16", "bfloat16"):
        want = {8: 64, 16: 64, 40: 64, 56: 64, 64: 64, 72: 96, 80: 96, 88: 96, 96: 96, 104: 128, 120: 128,
                128: 128, 136: 256, 160: 256, 192: 256, 248: 256, 256: 256}
        assert {hd: attention_mma_head_dim(dtype, hd) for hd in want} == want
        for head_dim in (2, 4, 6, 36, 100, 250, 264):
            assert attention_mma_head_dim(dtype, head_dim) is None, head_dim
    want = {16: 64, 48: 64, 64: 64, 80: 96, 96: 96, 112: 128, 128: 128, 144: 256, 240: 256, 256: 256}
    assert {hd: attention_mma_head_dim("float8_e4m3", hd) for hd in want} == want
    for head_dim in (8, 40, 72, 120, 264):   # fp8 rows of 8 codes (half a copy) stay on CUDA cores
        assert attention_mma_head_dim("float8_e4m3", head_dim) is None, head_dim
    for head_dim in (64, 80, 128):
        assert attention_mma_head_dim("float32", head_dim) is None
    for dtype, io_dtype, head_dim, instance in PADDED:
        for query_rows, row_tiles, _ in TILINGS[256 if instance == 256 else 64]:
            kernel = attention_kernel(dtype, head_dim, io_dtype or None, query_rows=query_rows)
            twin = attention_kernel(dtype, instance, io_dtype or None, query_rows=query_rows)
            assert kernel == twin and f", {instance}, {row_tiles}>" in kernel.instance
        assert block_row_choices(dtype, head_dim, io_dtype or None) == block_row_choices(dtype, instance, io_dtype or None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim, instance", PADDED + PADDED_F32,
                         ids=[f"{d}-{hd}" for d, _, hd, _ in PADDED + PADDED_F32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_padded_head_reads_and_writes_only_its_own_dims(backend, dtype, io_dtype, head_dim, instance, layout):
    """A head smaller than its instance zero-fills the instance's extra dims in q and in the K/V
    stages, copying them from nothing. A copy of a padded dim read from memory takes the next bytes:
    the next key's row (one kv head; HND), which past sequence 0's attended rows holds NaN, or, for
    the last row of sequence 1, which fills the cache of the last layer, past the end of the buffer
    (an out-of-bounds read on the emulator). q's padding left unzeroed is the poison the emulator
    writes over shared memory. An output or split result at the instance's row stride lands on the
    wrong rows. Rope rotates at the cache's head size, whose pairs are (d, d + head_dim / 2). A padded
    copy that reads anything (even a live byte of its row, harmless to the result) shows in the bytes
    the launch loads: exactly the attended rows' once."""
    max_seq, length_0 = 160, 77   # sequence 0's live rows; sequence 1's queries end at the buffer's end
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=1, head_dim=head_dim, max_seq=max_seq, batch=2, dtype=dtype,
                            io_dtype=io_dtype, layout=layout)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(head_dim)
    testing.fill(cache, oracle, [max_seq, max_seq], rng)
    # q_len falling, so that each call's pending rows are below the NaN an earlier call wrote
    for q_len, group, options in ((5, 8, dict(softcap=30.0, split_keys=128)),
                                  (3, 2, dict(rope=cupykv.Rope(), num_splits=2)), (1, 4, dict(num_splits=1))):
        committed = [length_0, max_seq - q_len]   # sequence 1's last query attends key max_seq - 1
        cache.set_lengths(committed)
        oracle.set_lengths(committed)
        testing.poison_tail(cache, [length_0 + q_len, max_seq])
        plan = cupykv.AttentionPlan(cache, q_len, group, **options)
        # the instance of the padded size, as a cache of that size would run it
        assert plan.kernel == attention_kernel(dtype, instance, io_dtype or None, query_rows=q_len * group)
        q = testing.random_rows(rng, spec, (2, q_len, group, head_dim))
        if backend == "emulator" and q_len == 1:   # each attended row's bytes read once, no more
            with testing.traffic(cache) as traffic:
                plan.run(cache.to_device(q), 1)
            (launch,) = traffic.launches
            rows = committed[0] + 1 + committed[1] + 1
            for array in (cache.k, cache.v):
                assert launch.of(array).bytes_loaded == rows * head_dim * spec.itemsize
        got = testing.to_numpy(plan.run(cache.to_device(q), 1), spec, io=True)
        assert np.isfinite(got).all()
        reference_options = {name: value for name, value in options.items() if name in ("rope", "softcap")}
        want = reference.attention(q, oracle, 1, **reference_options)
        assert_attention_close(got, want, spec.io_dtype, testing.value_scale(oracle, 1),
                               f"(q_len {q_len}, group {group}, {options})")


def verification_tile(tiling, dtype, head_dim, io_dtype):
    """``(q_len, group)`` of a verification tile: 15 rows in one tile ("one-tile"), or every row of the
    block of the most rows, at group 4 ("row-groups": two row groups sharing the stage)."""
    if tiling == "one-tile":
        return 5, 3
    return attention_kernel(dtype, head_dim, io_dtype or None, query_rows=64).rows_per_block // 4, 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim", [(d, "", hd) for d, hd in EDGE_CASES] + [("float8_e4m3", "float16", 64)],
                         ids=[f"{d}-{hd}" for d, hd in EDGE_CASES] + ["fp8-64"])
@pytest.mark.parametrize("poison, last_dim_only", [(np.nan, False), (np.inf, False), (-np.inf, False), (np.nan, True)],
                         ids=["nan", "inf", "-inf", "nan-in-the-last-dim"])
@pytest.mark.parametrize("tiling", ["one-tile", "row-groups"])
@pytest.mark.parametrize("lengths", [[121, 40], [126, 45]], ids=["mid-step", "step-edges"])
def test_a_non_finite_pending_row_reaches_only_the_queries_that_attend_it(backend, dtype, io_dtype, head_dim, poison,
                                                                          last_dim_only, tiling, lengths):
    """Pending row n + 2 of a verification tile holds NaN or an infinity in half of V's dims
    (or NaN in its last dim alone, which one lane of the warp's stage scan reads): queries 0 and 1
    do not attend it, and share its step (mid-step: at lengths 121 and 40 it is key 11 and 10 of its
    16-key step) or run in the step before (step-edges: at 126 and 45 it is key 0 of its step, and
    key 15 of the step queries 0 and 1 share). In an mma their weight 0 times it would be
    NaN, so in such a step the kernel zeroes those elements and marks the rows that attend them.
    Queries 0 and 1 match the reference; the later ones, which attend it with a weight above 0, are
    NaN in every dim (the reference is non-finite in the poisoned dims only). 15 rows run a one-tile
    block, which zeroes the elements in its stage; a block's most rows (64, 32 at head_dim 256) run
    two row groups sharing the stage (at head_dim 64, 128 and 256), which zero them in each V fragment
    instead."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=300, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(5)
    q_len, group = verification_tile(tiling, dtype, head_dim, io_dtype)
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)
    for c in (cache, oracle):
        c.set_lengths(lengths)
    poisoned = {b: n + 2 for b, n in enumerate(lengths)}
    dims = slice(head_dim - 1, head_dim) if last_dim_only else slice(0, head_dim // 2)
    v = np.array(testing.to_numpy(cache.v, spec))
    for b, row in poisoned.items():
        for array in (v, oracle.v):
            array[0, b, row, :, dims] = poison
    cache.v[...] = cache.to_device(v.astype(cache.v.dtype))
    q = testing.random_rows(rng, spec, (2, q_len, 2 * group, head_dim))
    got = testing.to_numpy(cupykv.attention(cache.to_device(q), cache, 0, num_splits=1), spec, io=True)
    with np.errstate(invalid="ignore"):
        want = reference.attention(q, oracle, 0)
    assert np.isfinite(got[:, :2]).all()
    assert_attention_close(got[:, :2], want[:, :2], spec.io_dtype, testing.value_scale(oracle, 0))
    finite = np.ones(head_dim, bool)
    finite[dims] = False
    assert not np.isfinite(want[:, 2:, :, ~finite]).any() and np.isfinite(want[:, 2:, :, finite]).all()
    assert np.isnan(got[:, 2:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype, head_dim", [("float16", "", 64), ("bfloat16", "", 128),
                                                     ("float8_e4m3", "float32", 64)],
                         ids=["float16-64", "bfloat16-128", "fp8-64"])
@pytest.mark.parametrize("tiling", ["one-tile", "row-groups"])
def test_a_non_finite_row_just_before_a_window_changes_no_bit_of_the_queries_that_skip_it(backend, dtype, io_dtype,
                                                                                          head_dim, tiling):
    """In sequence b, key ``p = length + s - window`` holds NaN in half of V's dims: queries below ``s``
    attend it, and query ``s``'s window opens on key ``p + 1``. Queries from ``s`` on must come out
    bit for bit as they do when those elements are zeros, which is what the kernel turns them into;
    a mask that zeroes a bit more than the element (the next element of its word) shows only in
    those bits. A block's keys start at its first query's window, so ``p`` is key ``s - 1`` of its
    step: key 0 in sequence 0 (s = 1), key 1 in sequence 1 (s = 2). In the V fragments of a block
    of two row groups a word holds a dim of two keys, 2 j and 2 j + 1, so in sequence 0 ``p + 1``
    shares each of ``p``'s words."""
    window, lengths, first_skipping = 40, [120, 41], [1, 2]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=200, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    q_len, group = verification_tile(tiling, dtype, head_dim, io_dtype)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    rng = np.random.default_rng(7)
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)
    for c in (cache, oracle):
        c.set_lengths(lengths)
    q = testing.random_rows(rng, spec, (2, q_len, group, head_dim))
    dims = slice(0, head_dim // 2)
    v = np.array(testing.to_numpy(cache.v, spec))
    outputs = []   # with zeros, then with NaN (the reference sees the NaN)
    for poison in (0.0, np.nan):
        for b, (n, s) in enumerate(zip(lengths, first_skipping)):
            for array in (v, oracle.v):
                array[0, b, n + s - window, :, dims] = poison
        cache.v[...] = cache.to_device(v.astype(cache.v.dtype))
        out = cupykv.attention(cache.to_device(q), cache, 0, window=window, num_splits=1)
        outputs.append(testing.to_numpy(out, spec, io=True))
    with np.errstate(invalid="ignore"):
        want = reference.attention(q, oracle, 0, window=window)
    for b, s in enumerate(first_skipping):
        zeros, got = outputs[0][b], outputs[1][b]
        assert np.isnan(got[:s]).all()
        assert got[s:].tobytes() == zeros[s:].tobytes(), f"sequence {b}: {np.argwhere(got[s:] != zeros[s:])[:4]}"
        assert_attention_close(got[s:], want[b, s:], spec.io_dtype, testing.value_scale(oracle, 0))


def steps_the_mask_cuts(positions, window, begin, end, step=STEP):
    """How many of the ``step``-key steps of keys [begin, end) hold a key that some row (at ``positions``)
    does not attend, or that lies at or past ``end``: the steps that must be masked."""
    def attended(key, position):
        return key < end and key <= position and (window is None or key > position - window)
    return sum(not all(attended(key, p) for p in positions for key in range(first, first + step))
               for first in range(begin, end, step))


def launch_steps(max_seq, lengths, q_len, group, rows_per_block, window, split_keys, step=STEP,
                 mixed_only=False):
    """``(cut, all)``: the steps that the blocks of one (kv head's) launch must mask, and all the steps
    they run, summed over sequences, row blocks and splits (of ``split_keys`` keys); with
    ``mixed_only``, only in blocks whose rows sit at several positions."""
    cut = every = 0
    for length in lengths:
        for first_row in range(0, q_len * group, rows_per_block):
            rows = range(first_row, min(first_row + rows_per_block, q_len * group))
            positions = {length + row // group for row in rows}
            if mixed_only and len(positions) == 1:
                continue   # rows at one position attend the same keys: no step checks V
            begin = 0 if window is None else max(0, min(positions) - window + 1)
            end = min(max(positions) + 1, max_seq)
            for split_begin in range(0, max_seq, split_keys):
                split = max(begin, split_begin), min(end, split_begin + split_keys)
                if split[0] < split[1]:
                    cut += steps_the_mask_cuts(positions, window, *split, step=step)
                    every += -(-(split[1] - split[0]) // step)
    return cut, every


# (q_len, group, lengths, window, splits): rows at several positions per block (verification)
CUT_STEP_CASES = [
    (8, 1, [200, 7], None, dict(num_splits=1)),     # keys [0, 208): the last step cut; [0, 15): one step
    (8, 1, [200, 7], 40, dict(num_splits=1)),       # keys [161, 208): first and last cut, middle open
    (4, 4, [300, 130], 100, dict(split_keys=128)),  # 16 rows at 4 positions; splits cut the window's keys
    (3, 2, [37, 0], None, dict(split_keys=128)),    # 6 rows: steps [0, 16), [16, 32) open, [32, 40) cut
    (16, 4, [250, 90], 70, dict(num_splits=1)),     # 64 rows: four row tiles, two row groups
    (16, 8, [250, 90], None, dict(num_splits=1)),   # 128 rows: a second block, from position 258 on
    (8, 1, [143, 60], 23, dict(split_keys=128)),    # positions 143..150: step [128, 144) is open, exactly
    (4, 2, [300, 20], None, dict(split_keys=128)),  # whole splits before the queries: open to their last key
]


# (q_len, group, lengths, window, splits): rows at one position per block (decode), where masking a step
# that needs none changes neither the output nor any memory traffic
ONE_POSITION_CASES = [
    (1, 4, [200, 7], 40, dict(num_splits=1)),      # keys [161, 201): the last step cut; [0, 8): one step
    (1, 8, [300, 130], None, dict(split_keys=128)),  # the last split's last step cut, whole splits open
    (1, 1, [255, 16], None, dict(num_splits=1)),   # [0, 256) ends on a step: nothing cut; [0, 17): one step
    (1, 4, [100, 50], 16, dict(split_keys=128)),   # a 16-key window on one step, [85, 101): open
    (1, 1, [100, 50], 16, dict(split_keys=128)),   # the same for a block of one row
    (1, 2, [130, 3], 130, dict(num_splits=1)),     # the window reaches key 1: [1, 131) cut at its end
]


@pytest.mark.parametrize("dtype, io_dtype, head_dim",
                         [(d, "", hd) for d, hd in EDGE_CASES] + [("float16", "", 40), ("float8_e4m3", "bfloat16", 64)],
                         ids=[f"{d}-{hd}" for d, hd in EDGE_CASES] + ["float16-40", "fp8-64"])
@pytest.mark.parametrize("q_len, group, lengths, window, splits", ONE_POSITION_CASES + CUT_STEP_CASES,
                         ids=[f"q{q}xg{g}-{lengths[0]}-w{w}" for q, g, lengths, w, _ in
                              ONE_POSITION_CASES + CUT_STEP_CASES])
def test_only_the_steps_the_mask_cuts_look_for_non_finite_v(dtype, io_dtype, head_dim, q_len, group, lengths,
                                                            window, splits):
    """A block whose rows sit at several positions reads its V stage for NaN and infinity (step 4) in
    each step that its mask cuts, and in no other: a step whose every key every row attends runs
    unmasked and unchecked. A block at one position (decode) never checks: its rows attend the same
    keys. Masking an open step changes no output (every key passes the mask), so
    only this work shows a step test that is too cautious, or that leaves the mask open too long
    (the outputs show that too). Each warp sharing a stage reads its 16 rows once, at the instance's
    width: 16 x instance x itemsize bytes a cut step."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache, banks=True) as t:
        cupykv.attention(q, cache, 0, window=window, **splits)
    launch, = t.launches
    kernel = attention_kernel(dtype, head_dim, io_dtype or None, query_rows=q_len * group)
    assert launch.kernel.startswith("cupykv_attention_mma")
    instance = attention_mma_head_dim(dtype, head_dim)
    row_groups = kernel.threads // (32 * WARPS[instance])
    cut_steps, _ = launch_steps(spec.max_seq, lengths, q_len, group, kernel.rows_per_block, window,
                                splits.get("split_keys", spec.max_seq), mixed_only=True)
    site = source_site(Path(KERNEL_DIR) / "kv_codec.cuh", "if (word_has_non_finite<T>(reinterpret_cast")
    checked = sum(s.bytes for s in launch.shared_sites if s.kind == "load" and s.site.startswith(f"{site} (inlined"))
    assert (cut_steps > 0) == (q_len > 1)   # each case of several positions cuts a step
    assert checked == row_groups * cut_steps * STEP * instance * spec.itemsize, (checked, cut_steps)


@pytest.mark.parametrize("dtype, io_dtype, head_dim",
                         [(d, "", hd) for d, hd in EDGE_CASES] + [("float8_e4m3", "bfloat16", 64)],
                         ids=[f"{d}-{hd}" for d, hd in EDGE_CASES] + ["fp8-64"])
@pytest.mark.parametrize("q_len, group, lengths, window, splits", ONE_POSITION_CASES + CUT_STEP_CASES,
                         ids=[f"q{q}xg{g}-{lengths[0]}-w{w}" for q, g, lengths, w, _ in
                              ONE_POSITION_CASES + CUT_STEP_CASES])
def test_only_the_steps_the_mask_cuts_are_masked(dtype, io_dtype, head_dim, q_len, group, lengths, window,
                                                 splits):
    """Every warp of a block tests each of its steps for a key that some row must not attend, and masks
    only the steps where one may lie (the emulator counts the test's outcomes, thread by thread): the
    steps a window or the live length cuts, never one whose every key every row attends. In a decode
    block (rows at one position) masking an open step changes no output and no memory traffic, so
    only this count shows a step test that is too cautious."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0, window=window, **splits)
    launch, = t.launches
    kernel = attention_kernel(dtype, head_dim, io_dtype or None, query_rows=q_len * group)
    assert launch.kernel.startswith("cupykv_attention_mma")
    row_groups = kernel.threads // (32 * WARPS[attention_mma_head_dim(dtype, head_dim)])
    cut, every = launch_steps(spec.max_seq, lengths, q_len, group, kernel.rows_per_block, window,
                              splits.get("split_keys", spec.max_seq))
    site = source_site(Path(KERNEL_DIR) / "attention_mma.cu", "const bool open = CUPYKV_COMMON_PATH(")
    lanes = 32 * row_groups   # the lanes of a step's warps, one warp per row group
    assert launch.outcomes(site) == {value: lanes * steps for value, steps in ((0, cut), (1, every - cut)) if steps}


def decode_split_steps(max_seq, lengths, window, splits, step, q_len=1):
    """The ``step``-key steps of each (sequence, split) that holds keys, for a block of the ``q_len``
    queries at ``length .. length + q_len - 1`` (decode: one), which attend from ``length - window + 1``
    (the first query's window) to ``length + q_len - 1``; ``splits`` the attention call's split options
    (``split_keys``, or one split: the cases here pass ``num_splits=1`` otherwise)."""
    split_keys = splits.get("split_keys", max_seq)
    counts = []
    for length in lengths:
        begin = 0 if window is None else max(0, length - window + 1)
        for split_begin in range(0, max_seq, split_keys):
            keys = max(begin, split_begin), min(length + q_len, split_begin + split_keys)
            if keys[0] < keys[1]:
                counts.append(-(-(keys[1] - keys[0]) // step))
    return counts


# (dtype, kernel file, the line of its rescale test)
RESCALE_TESTS = [("float16", "attention_mma.cu", "if (CUPYKV_COMMON_PATH(__any_sync(0xffffffffu, rescale[0] != 1.0f"),
                 ("float32", "attention_f32.cu", "if (CUPYKV_COMMON_PATH(new_max != row_max[m], CUPYKV_STEP_RESCALES))")]
# decode (q_len 1, group 4: one tile of 4 rows) at lengths and options of ONE_POSITION_CASES
RESCALE_CASES = [([200, 7], 40, dict(num_splits=1)), ([300, 130], None, dict(split_keys=128)),
                 ([255, 16], None, dict(num_splits=1))]


@pytest.mark.parametrize("dtype, kernel_file, needle", RESCALE_TESTS, ids=["mma", "f32"])
@pytest.mark.parametrize("lengths, window, splits", RESCALE_CASES, ids=["window", "splits", "aligned"])
@pytest.mark.parametrize("logits", ["settled", "rising"])
def test_the_accumulators_are_rescaled_only_in_steps_where_a_max_moved(dtype, kernel_file, needle, lengths,
                                                                       window, splits, logits):
    """Rescaling the accumulators by exactly 1 changes no bit, so only the count of the rescale test's
    outcomes shows that a step whose row maxima stand skips it. With every logit equal ("settled") a
    warp's running max moves once, in its first step (from -inf); with the logit rising key by key
    ("rising") it moves in every step. The tensor-core kernel votes once per warp and step (each key
    warp keeps its own max); the float32 kernel tests each live row in each step, in every lane."""
    head_dim, group = 64, 4
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=2, dtype=dtype)
    cache = cupykv.KVCache(spec, backend="emulator")
    rows = max(lengths) + 1
    k = np.zeros((spec.batch, rows, 1, head_dim), np.float32)
    if logits == "rising":
        k[:, :, 0, 0] = np.arange(rows) / 64   # exact in half: logit j * scale / 64
    cache.append(0, cache.to_device(k.astype(dtype)), cache.to_device(np.zeros_like(k).astype(dtype)))
    cache.set_lengths(lengths)
    q = np.zeros((spec.batch, 1, group, head_dim), dtype)
    q[..., 0] = 1
    with testing.traffic(cache) as t:
        cupykv.attention(cache.to_device(q), cache, 0, window=window, **splits)
    launch, = t.launches
    step = STEP if dtype == "float16" else F32["kStepKeys"]
    split_steps = decode_split_steps(spec.max_seq, lengths, window, splits, step)
    if dtype == "float16":   # one vote per key warp and step, 32 lanes; the first step of each key warp moves
        assert launch.kernel == "cupykv_attention_mma<__half, __half, 64, 1>"
        every = 32 * sum(split_steps)
        moved = every if logits == "rising" else 32 * sum(min(s, WARPS[64]) for s in split_steps)
    else:   # each lane of a warp tests each of its live rows (one each here) in every step
        assert launch.kernel == f"cupykv_attention_f32<{head_dim}>"
        every = 32 * group * sum(split_steps)
        moved = every if logits == "rising" else 32 * group * len(split_steps)
    site = source_site(Path(KERNEL_DIR) / kernel_file, needle)
    assert launch.outcomes(site) == {value: n for value, n in ((1, moved), (0, every - moved)) if n}


def zero_query_launch(dtype, io_dtype, head_dim, lengths, q_len, group, window, splits):
    """One attention launch of zero queries under the traffic counter, one kv head, max_seq 400:
    (spec, its LaunchTraffic, the planned kernel)."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=400, batch=len(lengths),
                            dtype=dtype, io_dtype=io_dtype)
    cache, q = cache_and_zero_queries(spec, lengths, q_len, group)
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0, window=window, **splits)
    launch, = t.launches
    return spec, launch, attention_kernel(dtype, head_dim, io_dtype, query_rows=q_len * group)


# (cache dtype, io dtype, q_len, group, the tensor-core block's row groups; None: the float32 kernel)
PIPELINE_KINDS = {"mma": ("float16", None, 1, 4, 1), "mma-fp8": ("float8_e4m3", "float16", 1, 4, 1),
                  "mma-row-groups": ("float16", None, 8, 8, 2), "mma-fp8-row-groups": ("float8_e4m3", "float16", 8, 8, 2),
                  "f32": ("float32", None, 1, 4, None)}


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
@pytest.mark.parametrize("lengths, window, splits", RESCALE_CASES, ids=["window", "splits", "aligned"])
def test_each_step_computes_while_the_next_steps_copies_are_in_flight(kind, lengths, window, splits):
    """The K/V stages are a pipeline: a thread's wait for its copies of a step leaves its copies of the
    next step (the tensor-core kernel: of the key warp's next kStages - 1 steps, 2 of 16-bit caches and
    3 of fp8 ones) in flight, so that they land while the step computes. Waiting for every copy instead
    gives the same output and the same traffic; only the emulator's count of what each wait leaves in
    flight shows it. head_dim 64; decode (one tile of 4 rows), and for the tensor-core kernel also a
    block of 64 rows (q_len 8, group 8), whose two row groups share each key warp's stages and wait in
    every round of the block, past their key warp's last step too."""
    dtype, io_dtype, q_len, group, row_groups = PIPELINE_KINDS[kind]
    head_dim = 64
    spec, launch, kernel = zero_query_launch(dtype, io_dtype, head_dim, lengths, q_len, group, window, splits)
    assert launch.kernel == kernel.instance
    step = F32["kStepKeys"] if row_groups is None else STEP
    split_steps = decode_split_steps(spec.max_seq, lengths, window, splits, step, q_len)
    step_bytes = 2 * step * head_dim * spec.itemsize   # K and V of a step, copied by all its threads
    if row_groups is not None:   # key warp w copies and waits for steps w, w + warps, ... (its sharers each)
        assert kernel.threads == 32 * WARPS[head_dim] * row_groups and kernel.tensor_cores
        warps = WARPS[head_dim]
        ahead = MMA["kStagesFp8" if dtype == "float8_e4m3" else "kStages"] - 1
        sharers = 32 * row_groups
        waits = in_flight = steps_in_flight = 0
        for steps in split_steps:
            rounds = -(-steps // warps)
            for w in range(warps):
                # one row group stops after its own steps; two meet the block in every round
                waited = range(w, steps, warps) if row_groups == 1 else range(w, rounds * warps, warps)
                later = [sum(s + j * warps < steps for j in range(1, ahead + 1)) for s in waited]
                waits += sharers * len(waited)
                in_flight += sharers * sum(n > 0 for n in later)
                steps_in_flight += sum(later)
    else:   # every thread copies its share of each step, and waits once a step
        assert launch.kernel == f"cupykv_attention_f32<{head_dim}>"
        waits = F32["kThreads"] * sum(split_steps)
        in_flight = F32["kThreads"] * sum(s - 1 for s in split_steps)
        steps_in_flight = sum(s - 1 for s in split_steps)
    expected_bytes = steps_in_flight * step_bytes
    assert launch.copy_waits == CopyWaits(waits, in_flight, expected_bytes)


# (cache dtype, io dtype, q_len, group, q pieces: 1 where q is exact in the mma type, 3 for float q)
MMA_WORK_KINDS = {"half": ("float16", None, 1, 4, 1), "bf16-row-groups": ("bfloat16", None, 8, 8, 1),
                  "fp8": ("float8_e4m3", "bfloat16", 1, 4, 1), "fp8-float-q": ("float8_e4m3", "float32", 1, 4, 3)}


@pytest.mark.parametrize("kind", MMA_WORK_KINDS)
@pytest.mark.parametrize("lengths, window, splits", RESCALE_CASES, ids=["window", "splits", "aligned"])
def test_each_key_warp_multiplies_its_own_steps_once(kind, lengths, window, splits):
    """Key warp w of a block computes steps w, w + warps, ... of its split's keys, each step once: per
    warp tile and 16 head dims, two mma for S per q piece and four for P V (docs/performance.md). A
    step computed twice or by the wrong warp, an extra step, or the three-piece S loop run for q that
    is exact in one piece changes no output and no traffic; the emulator's count of each warp's mma
    shows it. head_dim 64 (two key warps); decode blocks of 4 rows, and 64 rows in two row groups of
    two tiles a warp."""
    dtype, io_dtype, q_len, group, pieces = MMA_WORK_KINDS[kind]
    head_dim = 64
    spec, launch, kernel = zero_query_launch(dtype, io_dtype, head_dim, lengths, q_len, group, window, splits)
    assert launch.kernel == kernel.instance and kernel.tensor_cores
    warps = WARPS[head_dim]
    row_groups = kernel.threads // (32 * warps)
    warp_tiles = kernel.rows_per_block // 16 // row_groups
    step_mma = warp_tiles * head_dim // 16 * (2 * pieces + 4)
    want = sorted(tuple(sorted(step_mma * len(range(w, steps, warps)) for w in range(warps) for _ in range(row_groups)))
                  for steps in decode_split_steps(spec.max_seq, lengths, window, splits, STEP, q_len))
    by_block = {}
    for (block, warp), count in launch.mma_per_warp().items():
        by_block.setdefault(block, []).append(count)
    # every block with keys: each of its warps' counts (a key warp without a step issues none)
    got = sorted(tuple(sorted(counts + [0] * (warps * row_groups - len(counts)))) for counts in by_block.values())
    assert got == [w for w in want if any(w)]
