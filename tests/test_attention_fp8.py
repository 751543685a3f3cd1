"""The tensor-core attention kernel on fp8 (E4M3) caches: kernels/attention_mma.cu's fp8 load path.

An fp8 cache stores codes and one fp32 scale per (layer, kv head). The kernel stages the codes as
bytes (three stages per warp), builds the mma B fragments from them widened exactly to 16 bits, and
applies the scales to its fp32 results: ``scale * k_scale`` on the logits, ``v_scale`` on the output.
These tests hold it to the reference (which attends over ``code * scale`` in float64) within the
stated tolerance of the io dtype (cupykv.tolerances), where its design could go wrong:

- every io dtype: the mma operands are halves, bfloat16 and float16 q exact in one piece, float32 q in
  three half pieces, rope in three pieces; GQA groups 1, 4 and 8; q_len 1, 4 and 8 (up to 64 rows: one,
  two and four row tiles); splits 1 and 3 (the merge writes the io dtype);
- bfloat16 and float32 q rows far outside the half's range (1e-7 and 1e5), which each row's power-of-two
  factor brings into it;
- the scales of the right layer and head (each different), read at run time;
- the byte stages: lengths at every step and warp-round edge of the three-stage pipeline;
- NaN codes (0x7F) in rows past the attended ones, pending in the query's own step or in the tail:
  zero-filled or masked, never read into a product;
- bit-identical rows across q_len with split_keys.
"""
import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from cupykv.attention_plan import attention_kernel
from cupykv.fp8 import dequantize_e4m3
from cupykv.kernels import KERNELS
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS

MMA = KERNELS["attention_mma"].constants("attention_mma_tiling")
STEP = MMA["kStepKeys"]
WARPS = {64: MMA["kWarps64"], 96: MMA["kWarps96"], 128: MMA["kWarps128"], 256: MMA["kWarps256"]}
HEAD_DIMS = [64, 96, 128, 256]
IO_DTYPES = ["bfloat16", "float16", "float32"]
NAN_CODE = 0x7F


def _scales(rng, spec):
    """Per-(layer, kv head) scales, each different: N(0, 1) values land on codes up to about 400."""
    return (rng.uniform(0.012, 0.03, (spec.n_layers, spec.n_kv_heads)).astype(np.float32) for _ in "kv")


def _caches(backend, lengths, *, head_dim, io_dtype="bfloat16", n_kv=2, max_seq=400, seed=0, rope=None):
    """An fp8 cache and its reference twin holding the same codes, lengths[b] committed rows each."""
    rng = np.random.default_rng(seed)
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=n_kv, head_dim=head_dim, max_seq=max_seq, batch=len(lengths),
                            dtype="float8_e4m3", io_dtype=io_dtype)
    k_scale, v_scale = _scales(rng, spec)
    cache = cupykv.KVCache(spec, backend=backend, k_scale=k_scale, v_scale=v_scale)
    oracle = reference.KVCache(spec, k_scale=k_scale, v_scale=v_scale)
    testing.fill(cache, oracle, lengths, rng, rope=rope)
    return cache, oracle, rng


def _value_scale(oracle, layer, ends):
    """max |v| over the rows sequence b attends (positions < ends[b]), as the values they stand for."""
    values = [dequantize_e4m3(oracle.v[layer, b, :end], oracle.v_scales[layer][:, None]) for b, end in enumerate(ends)]
    return max((float(np.abs(v).max()) for v in values if v.size), default=0.0)


def _host(out, spec):
    """Host copy of an attention output, in the io dtype (CuPy holds bfloat16 as uint16 bits)."""
    host = np.array(out.get() if hasattr(out, "get") else out, copy=True)
    return host.view(spec.io_np_dtype) if host.dtype != spec.io_np_dtype else host


def _attend(cache, q, layer, **options):
    return _host(cupykv.attention(cache.to_device(q), cache, layer, **options), cache.spec)


@pytest.mark.parametrize("io_dtype", IO_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_plan_picks_tensor_cores_and_the_fp8_shared_memory(io_dtype, head_dim):
    kernel = attention_kernel("float8_e4m3", head_dim, io_dtype)
    cuda_io = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}[io_dtype]
    assert kernel.tensor_cores and kernel.instance == f"cupykv_attention_mma<__nv_fp8_e4m3, {cuda_io}, {head_dim}, 1>"
    assert kernel.threads == 32 * WARPS[head_dim]
    assert kernel.shared_mem_bytes == MMA[f"kQTile{head_dim}"] + MMA[f"kStages{head_dim}Fp8"]
    # without the opt-in past 48 KiB but at head_dim 256, whose q pieces alone are 25 KB
    assert kernel.opts_in_to_shared_memory == (head_dim == 256)
    # the byte stages keep as many bytes per warp in flight as the 16-bit path, and hold the fp32 accumulators
    # and the row max and sum at the end
    stage_bytes = WARPS[head_dim] * MMA["kStagesFp8"] * 2 * STEP * (head_dim + MMA["kRowPadFp8"])
    assert (MMA["kStagesFp8"] - 1) * head_dim == (MMA["kStages"] - 1) * 2 * head_dim
    assert WARPS[head_dim] * MMA["kTileRows"] * (head_dim + MMA["kAccPad"] + 2) * 4 <= stage_bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", IO_DTYPES)
@pytest.mark.parametrize("head_dim, group, q_len", [(hd, g, q) for hd in (64, 128) for g, q in
                                                    [(1, 1), (4, 4), (8, 1), (8, 4), (8, 8)]]
                         + [(96, 8, 8), (256, 1, 1), (256, 8, 8)])   # 96: four tiles; 256: one, and two blocks of two
@pytest.mark.parametrize("use_rope", [False, True], ids=["plain", "rope"])
def test_matches_the_reference(backend, io_dtype, head_dim, group, q_len, use_rope):
    # lengths off the 16-key steps; layer 1, whose scales differ from layer 0's in every head
    lengths = [0, 37, 301]
    rope = cupykv.Rope() if use_rope else None
    cache, oracle, rng = _caches(backend, lengths, head_dim=head_dim, io_dtype=io_dtype, rope=rope, seed=group)
    q = testing.random_rows(rng, cache.spec, (len(lengths), q_len, 2 * group, head_dim))
    assert q.dtype == cache.spec.io_np_dtype
    want = reference.attention(q, oracle, 1, rope=rope)
    value_scale = _value_scale(oracle, 1, [n + q_len for n in lengths])
    for num_splits in (1, 3):
        got = _attend(cache, q, 1, rope=rope, num_splits=num_splits)
        assert got.dtype == cache.spec.io_np_dtype
        assert_attention_close(got, want, io_dtype, value_scale, f"num_splits={num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("magnitude", [1e-7, 1e5])
def test_q_rows_outside_the_half_range_keep_their_precision(backend, io_dtype, head_dim, magnitude):
    """The mma operands are halves (subnormal below 6.1e-5, at most 65504). q rows of bf16 or float io
    of size 1e-7 (every element a subnormal half, or zero) or 1e5 (infinite as a half) are multiplied
    by a power of two per row before they are cut into pieces, and the logits by its inverse, so with a
    scale that makes the logits of order 1 the result is that of the exact q. The rows differ in
    size by up to a factor 16, so their factors differ."""
    lengths = [37, 301]
    cache, oracle, rng = _caches(backend, lengths, head_dim=head_dim, io_dtype=io_dtype, seed=5)
    q = rng.standard_normal((len(lengths), 2, 8, head_dim)) * magnitude
    q *= 2.0 ** rng.integers(-2, 3, (len(lengths), 2, 8, 1))   # row sizes a factor 16 apart
    # each row's largest element just below a power of two (as close as the io dtype allows): scaled into
    # [2^14, 2^15) its largest piece stays a finite half (65504 is the largest)
    top = np.floor(np.log2(np.abs(q).max(axis=-1)))
    q[..., 0] = (2.0 - 2.0 ** -20) * 2.0 ** top
    q = q.astype(cache.spec.io_np_dtype)
    scale = 2.0 / (magnitude * np.sqrt(head_dim))   # logits of about +-2 (k of about 1)
    want = reference.attention(q, oracle, 1, scale=scale)
    value_scale = _value_scale(oracle, 1, [n + 2 for n in lengths])
    got = _attend(cache, q, 1, scale=scale, num_splits=2)
    assert np.isfinite(got.astype(np.float32)).all()
    assert_attention_close(got, want, io_dtype, value_scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotated_half_q_rows_past_the_half_range_are_scaled_too(backend, head_dim):
    """float16 q is exact in one half piece, but rotated it takes three of fp32 values, which rotate
    past 65504 from elements near 6e4 (a pair (x, y) rotates to up to sqrt(x^2 + y^2)): those rows
    are brought into [2^14, 2^15) by a power of two like bf16 and float rows."""
    lengths = [37, 301]
    rope = cupykv.Rope(theta=500.0)
    cache, oracle, rng = _caches(backend, lengths, head_dim=head_dim, io_dtype="float16", seed=7, rope=rope)
    q = rng.uniform(-6e4, 6e4, (len(lengths), 2, 8, head_dim)).astype(np.float16)
    scale = 2.0 / (6e4 * np.sqrt(head_dim))   # logits of about +-2 (k of about 1)
    want = reference.attention(q, oracle, 1, scale=scale, rope=rope)
    got = _attend(cache, q, 1, scale=scale, rope=rope, num_splits=2)
    assert np.isfinite(got.astype(np.float32)).all()
    assert_attention_close(got, want, "float16", _value_scale(oracle, 1, [n + 2 for n in lengths]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lengths_at_every_step_and_warp_round_edge(backend, head_dim):
    # three stages: a warp's first steps are w, w + warps and w + 2 warps; lengths around each round's end
    round_keys = STEP * WARPS[head_dim]
    edges = sorted({e + d for e in (STEP, 2 * STEP, round_keys, 2 * round_keys, 3 * round_keys + STEP)
                    for d in (-1, 0, 1)})
    cache, oracle, rng = _caches(backend, [e - 1 for e in edges], head_dim=head_dim, n_kv=1,
                                 max_seq=max(edges) + 130)   # the query's own row makes e live rows
    q = testing.random_rows(rng, cache.spec, (len(edges), 1, 4, head_dim))
    want = reference.attention(q, oracle, 0)
    for num_splits in (1, 2):
        assert_attention_close(_attend(cache, q, 0, num_splits=num_splits), want, "bfloat16",
                               _value_scale(oracle, 0, edges), f"num_splits={num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("q_len", [1, 4, 9])   # 4, 16 and 36 rows: one, one and four row tiles (two blocks of two at 256)
def test_nan_codes_past_the_attended_rows_never_reach_the_output(backend, head_dim, q_len):
    """Rows pending past the last query (in its own 16-key step) and the cache's tail hold NaN codes:
    past the split, so the copy zero-fills them, and nothing of them reaches the output."""
    lengths = [5, 19, 140]
    cache, oracle, rng = _caches(backend, lengths, head_dim=head_dim)
    k, v = (testing.random_rows(rng, cache.spec, (len(lengths), q_len + 6, 2, head_dim)) for _ in "kv")
    k[:, q_len:] = np.nan
    v[:, q_len:] = np.nan
    for layer in (0, 1):
        cache.append(layer, cache.to_device(k), cache.to_device(v))   # pending: the queries' own rows, then NaN
        oracle.append(layer, k, v)
    codes = np.asarray(testing.to_numpy(cache.k, cache.spec)).view(np.uint8)
    assert (codes[1, 0, lengths[0] + q_len] == NAN_CODE).all()   # the store made them NaN codes
    poison = [n + q_len + 6 for n in lengths]
    testing.poison_tail(cache, poison)
    tail = np.asarray(testing.to_numpy(cache.v, cache.spec)).view(np.uint8)
    assert (tail[1, 2, poison[2]:] == NAN_CODE).all()
    q = testing.random_rows(rng, cache.spec, (len(lengths), q_len, 8, head_dim))
    want = reference.attention(q, oracle, 1)
    for num_splits in (1, 2):
        got = _attend(cache, q, 1, num_splits=num_splits)
        assert np.isfinite(got.astype(np.float32)).all()
        assert_attention_close(got, want, "bfloat16", _value_scale(oracle, 1, [n + q_len for n in lengths]),
                               f"num_splits={num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_scales_are_read_at_run_time(backend):
    cache, oracle, rng = _caches(backend, [33, 250], head_dim=64, io_dtype="float32")
    q = testing.random_rows(rng, cache.spec, (2, 2, 8, 64))
    plan = cupykv.AttentionPlan(cache, 2, 8, num_splits=2)
    first = _host(plan.run(cache.to_device(q), 1), cache.spec)
    # V scales doubled: the codes stand for twice the values, and the output doubles exactly
    v_scale = 2 * oracle.v_scales
    cache.set_scales(v_scale=v_scale)
    doubled = _host(plan.run(cache.to_device(q), 1), cache.spec)
    assert np.array_equal(doubled, 2 * first)
    # new K scales: new logits, as the reference attends with them
    k_scale = np.random.default_rng(9).uniform(0.005, 0.05, oracle.k_scales.shape).astype(np.float32)
    for twin in (cache, oracle):
        twin.set_scales(k_scale=k_scale, v_scale=v_scale)
    got = _host(plan.run(cache.to_device(q), 1), cache.spec)
    assert not np.array_equal(got, doubled)
    assert_attention_close(got, reference.attention(q, oracle, 1), "float32", _value_scale(oracle, 1, [35, 252]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_row_is_bit_identical_for_every_q_len_with_split_keys(backend, head_dim):
    cache, _, rng = _caches(backend, [300, 411], head_dim=head_dim, max_seq=600)
    q = testing.random_rows(rng, cache.spec, (2, 16, 6, head_dim))
    alone = cupykv.AttentionPlan(cache, 1, 6, split_keys=256).run(cache.to_device(q[:, :1].copy()), 0)
    alone = _host(alone, cache.spec)
    for q_len in (2, 5, 9, 16):   # 6, 15, 27 and 48 rows per kv head: one, one, two and four row tiles (256: two
                                  # blocks of two)
        together = cupykv.AttentionPlan(cache, q_len, 6, split_keys=256).run(cache.to_device(q[:, :q_len].copy()), 0)
        assert np.array_equal(testing.bits(_host(together, cache.spec)[:, :1]), testing.bits(alone)), q_len


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim, sectors_per_request", [(128, 1204 / 76), (64, 602 / 38), (256, 2408 / 151),
                                                           (96, 903 / 57)])
def test_decode_reads_each_row_once_in_whole_requests(head_dim, sectors_per_request, layout):
    """The fp8 byte stages on the emulator's traffic counter (301 live rows per sequence), K and V alike.

    A warp copies a 16-key step with 16-byte cp.async, 16 codes per copy: eight lanes on each
    128-byte row at head_dim 128 (four on each 64-byte row at 64), so a full request covers four
    (eight) whole rows, 16 sectors, each requested once; at head_dim 256, sixteen lanes on each
    256-byte row, two rows. 301 rows are 18 full steps and a last step of 13 rows. head_dim 128: 4
    requests a step; the last has 3 full ones and one with one live row (4 sectors): (18 x 4 x 16 +
    3 x 16 + 4) / (18 x 4 + 4) = 1204 / 76. head_dim 64: 2 requests a step; the last has a full one
    and one with 5 live rows (10 sectors): (18 x 2 x 16 + 16 + 10) / (18 x 2 + 2) = 602 / 38.
    head_dim 256: 8 requests a step; the last has 6 full ones and one with one live row (8 sectors):
    (18 x 8 x 16 + 6 x 16 + 8) / (18 x 8 + 7) = 2408 / 151. head_dim 96: a row is 6 copies (3
    sectors), and a warp's 32 copies run on across row ends (512 contiguous bytes, 16 sectors); 3
    requests a step; the last step's 13 live rows are 78 copies: two full requests and one of 14
    live copies (7 sectors): (18 x 3 x 16 + 2 x 16 + 7) / (18 x 3 + 3) = 903 / 57.
    """
    length = 300
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=512, batch=2, dtype="float8_e4m3",
                            layout=layout)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance(length)
    q = cache.to_device(np.zeros((2, 1, 8, head_dim), spec.io_np_dtype))
    with testing.traffic(cache) as t:
        cupykv.attention(q, cache, 0)
    assert len(t.launches) == 1, t.report()
    needed = 2 * (length + 1) * 2 * head_dim   # batch x rows x kv heads x row bytes
    for array in (cache.k, cache.v):
        c = t.launches[0].coalescing(arrays=[array], needed_bytes=needed)
        assert c.sectors == c.ideal_sectors and c.requested_ratio == 1.0, c
        assert c.sectors_per_request == pytest.approx(sectors_per_request), c
