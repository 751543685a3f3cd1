"""The NumPy reference against independent formulations of the contract.

Every property compares ``cupykv.reference`` with code written differently on
purpose: attention as per-query, per-head python loops; GQA as an MHA cache
with repeated kv heads; rotary as complex multiplication; the causal mask as
an additive mask over the whole ``max_seq`` axis; rounding as integer
arithmetic on the bit patterns; the cache protocol as a python model driven
by a hypothesis state machine. Mutations are checked on the whole cache,
bit for bit, and rejected calls must leave the whole cache unchanged.
"""

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cupykv import MASK_VALUE, CacheOverflowError, CacheSpec, Rope
from cupykv.reference import KVCache, attention
from cupykv.testing import bits
from cupykv.rope import rope_angles
from cupykv.spec import IO_DTYPES as DTYPES, LAYOUTS   # fp8 caches: test_fp8_cache.py

BF16 = np.dtype(ml_dtypes.bfloat16)
INPUT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BF16)
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
MAX_NORMAL_EXPONENT = {"float32": 127, "float16": 15, "bfloat16": 127}


# ----------------------------------------------------------------- helpers


def snapshot(cache):
    return [bits(cache.k).copy(), bits(cache.v).copy(), cache.lengths.copy(), cache.overflow.copy()]


def assert_unchanged(cache, before):
    after = snapshot(cache)
    for name, old, new in zip(("k", "v", "lengths", "overflow"), before, after):
        assert old.dtype == new.dtype and np.array_equal(old, new), f"{name} changed"


def row_index(spec, layer, b, pos):
    """Index of the [n_kv, hd] row at (layer, b, pos), spelled out per layout."""
    if spec.layout == "NHD":
        return (layer, b, pos, slice(None), slice(None))
    return (layer, b, slice(None), pos, slice(None))


def head_axis(spec):
    return 3 if spec.layout == "NHD" else 2


def round_bf16_from_float32(x32):
    """Round-to-nearest-even float32 -> bfloat16 on the bit patterns (finite inputs)."""
    b = x32.view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).view(BF16)


def round_float32_to(x32, dtype):
    """Storage value of float32 input, computed without going through float64."""
    if dtype == "float32":
        return x32.copy()
    if dtype == "float16":
        return x32.astype(np.float16)
    return round_bf16_from_float32(x32)


def round_float64_to_mantissa(x64, mantissa_bits):
    """Round float64 to ``mantissa_bits`` explicit bits, nearest even, on the bit patterns.

    Valid for results in the target's normal range (the test keeps exponents there).
    """
    shift = 52 - mantissa_bits
    b = x64.view(np.uint64)
    half = np.uint64(1 << (shift - 1))
    rounded = (b + half - np.uint64(1) + ((b >> np.uint64(shift)) & np.uint64(1))) >> np.uint64(shift)
    return (rounded << np.uint64(shift)).view(np.float64)


def complex_rotate(x, positions, theta):
    """Rotary embedding as complex multiplication: x [..., hd], positions [...]."""
    hd = x.shape[-1]
    half = hd // 2
    z = x[..., :half] + 1j * x[..., half:]
    freq = np.exp(-np.log(theta) * 2.0 * np.arange(half) / hd)  # [half]
    z = z * np.exp(1j * np.asarray(positions, dtype=np.float64)[..., None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def loop_attention(q, cache, layer, scale, window, softcap, theta):
    """Attention as explicit loops over sequences, queries, heads and positions."""
    spec = cache.spec
    batch, q_len, n_heads, hd = q.shape
    group = n_heads // spec.n_kv_heads
    keys = cache.k.astype(np.float64)[layer].tolist()
    values = cache.v.astype(np.float64)[layer].tolist()
    queries = q.astype(np.float64).tolist()
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    out = np.zeros((batch, q_len, n_heads, hd))
    for b in range(batch):
        for i in range(q_len):
            p = int(cache.lengths[b]) + i
            for h in range(n_heads):
                g = h // group
                query = queries[b][i][h]
                if theta is not None:
                    half = hd // 2
                    angles = [p / theta ** (2 * f / hd) for f in range(half)]
                    query = [query[f] * math.cos(a) - query[f + half] * math.sin(a) for f, a in enumerate(angles)] + [
                        query[f + half] * math.cos(a) + query[f] * math.sin(a) for f, a in enumerate(angles)
                    ]
                scores, rows = [], []
                for j in range(spec.max_seq):
                    if j > p or (window is not None and j <= p - window):
                        continue
                    key = keys[b][j][g] if spec.layout == "NHD" else keys[b][g][j]
                    s = scale * sum(a * c for a, c in zip(query, key))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    scores.append(s)
                    rows.append(values[b][j][g] if spec.layout == "NHD" else values[b][g][j])
                if not scores:
                    continue
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = math.fsum(weights)
                for d in range(hd):
                    out[b, i, h, d] = math.fsum(w * row[d] for w, row in zip(weights, rows)) / total
    return out


# -------------------------------------------------------------- strategies

seeds = st.integers(0, 2**32 - 1)
small_head_dims = st.integers(1, 16) | st.just(64)
even_head_dims = st.integers(1, 8).map(lambda h: 2 * h) | st.just(64)


@st.composite
def specs(draw, head_dims=small_head_dims, n_kv_heads=st.integers(1, 2), max_seq=st.integers(1, 16)):
    return CacheSpec(
        n_layers=draw(st.integers(1, 2)),
        n_kv_heads=draw(n_kv_heads),
        head_dim=draw(head_dims),
        max_seq=draw(max_seq),
        batch=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(DTYPES)),
        layout=draw(st.sampled_from(LAYOUTS)),
    )


def lengths_for(max_seq):
    near_edges = st.sampled_from(sorted({0, 1, max(0, max_seq - 1), max_seq}))
    return st.integers(0, max_seq) | near_edges


@st.composite
def caches(draw, spec_strategy=None, random_overflow=True):
    """A reference cache with random contents, lengths and (optionally) overflow flags."""
    spec = draw(spec_strategy if spec_strategy is not None else specs())
    rng = np.random.default_rng(draw(seeds))
    cache = KVCache(spec)
    cache.k[...] = rng.standard_normal(spec.shape).astype(spec.np_dtype)
    cache.v[...] = rng.standard_normal(spec.shape).astype(spec.np_dtype)
    cache.lengths[:] = draw(st.lists(lengths_for(spec.max_seq), min_size=spec.batch, max_size=spec.batch))
    if random_overflow:
        cache.overflow[:] = draw(st.lists(st.booleans(), min_size=spec.batch, max_size=spec.batch))
    return cache


@st.composite
def attention_cases(draw, head_dims=small_head_dims, with_extras=True):
    """(cache, layer, q, kwargs) for one attention call."""
    cache = draw(caches(specs(head_dims=head_dims)))
    spec = cache.spec
    group = draw(st.sampled_from([1, 2, 4, 8]))
    q_len = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(seeds))
    q_dtype = draw(st.sampled_from(INPUT_DTYPES))
    q = rng.standard_normal((spec.batch, q_len, spec.n_kv_heads * group, spec.head_dim)).astype(q_dtype)
    kwargs = {"scale": draw(st.none() | st.floats(0.01, 4.0))}
    if with_extras:
        kwargs["window"] = draw(st.none() | st.integers(1, spec.max_seq + 2))
        kwargs["softcap"] = draw(st.none() | st.floats(0.5, 50.0))
    return cache, draw(st.integers(0, spec.n_layers - 1)), q, kwargs


def poison_unread(cache, layer, q_len):
    """NaN into every row attention must not read: other layers and rows past the last query."""
    spec = cache.spec
    for other in range(spec.n_layers):
        for b in range(spec.batch):
            first_unread = 0 if other != layer else int(cache.lengths[b]) + q_len
            for pos in range(first_unread, spec.max_seq):
                cache.k[row_index(spec, other, b, pos)] = np.nan
                cache.v[row_index(spec, other, b, pos)] = np.nan


# --------------------------------------------------------------- attention


@given(attention_cases(), st.booleans())
def test_attention_matches_python_loops(case, use_rope):
    cache, layer, q, kwargs = case
    rope = Rope(500.0) if use_rope and cache.spec.head_dim % 2 == 0 else None
    poison_unread(cache, layer, q.shape[1])
    got = attention(q, cache, layer, rope=rope, **kwargs)
    expected = loop_attention(q, cache, layer, theta=None if rope is None else rope.theta, **kwargs)
    assert got.dtype == np.float64 and got.shape == q.shape
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-10)


@given(attention_cases())
def test_gqa_equals_mha_with_repeated_kv_heads(case):
    cache, layer, q, kwargs = case
    spec = cache.spec
    group = q.shape[2] // spec.n_kv_heads
    mha = KVCache(CacheSpec(spec.n_layers, q.shape[2], spec.head_dim, spec.max_seq, spec.batch, spec.dtype, spec.layout))
    mha.k[...] = np.repeat(cache.k, group, axis=head_axis(spec))
    mha.v[...] = np.repeat(cache.v, group, axis=head_axis(spec))
    mha.lengths[:] = cache.lengths
    np.testing.assert_allclose(attention(q, cache, layer, **kwargs), attention(q, mha, layer, **kwargs), rtol=1e-12, atol=1e-14)


@given(attention_cases(with_extras=False))
def test_additive_mask_over_full_axis_equals_attention(case):
    cache, layer, q, kwargs = case
    spec = cache.spec
    n_heads = q.shape[2]
    scale = 1.0 / math.sqrt(spec.head_dim) if kwargs["scale"] is None else kwargs["scale"]
    kv_of_head = np.arange(n_heads) // (n_heads // spec.n_kv_heads)
    k, v = cache.k[layer].astype(np.float64), cache.v[layer].astype(np.float64)
    if spec.layout == "HND":  # -> [batch, max_seq, n_kv, hd]
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]  # [batch, max_seq, n_heads, hd]
    logits = scale * np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) + cache.additive_mask(q.shape[1])
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    expected = np.einsum("bhij,bjhd->bihd", weights, v)
    np.testing.assert_allclose(attention(q, cache, layer, **kwargs), expected, rtol=1e-9, atol=1e-12)


def test_query_with_nothing_to_attend_outputs_zeros():
    cache = KVCache(CacheSpec(1, 1, 4, 4, batch=2))
    cache.k[0, 0] = cache.v[0, 0] = np.nan  # sequence 0: never read
    cache.v[0, 1] = 1.0
    cache.lengths[:] = [4, 1]
    q = np.ones((2, 3, 1, 4), dtype=np.float32)
    out = attention(q, cache, 0, window=1)
    # sequence 0 sits at p = 4, 5, 6 >= max_seq + window - 1: nothing visible
    assert np.array_equal(out[0], np.zeros((3, 1, 4)))
    # sequence 1 sits at p = 1, 2, 3: exactly one visible row of ones each
    assert np.array_equal(out[1], np.ones((3, 1, 4)))


# ------------------------------------------------------------------ rotary


@given(caches(specs(head_dims=even_head_dims), random_overflow=False), st.integers(1, 4), st.floats(2.0, 1e6), seeds)
def test_rope_append_matches_complex_form(cache, n_new, theta, seed):
    spec = cache.spec
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((spec.batch, n_new, spec.n_kv_heads, spec.head_dim))
    v = rng.standard_normal(k.shape)
    start = cache.lengths.copy()
    cache.append(spec.n_layers - 1, k, v, rope=Rope(theta))
    ulp = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[spec.dtype]
    # below the normal range the rounding step is absolute: one subnormal step of the dtype
    subnormal_step = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}[spec.dtype]
    for b in range(spec.batch):
        for i in range(n_new):
            p = int(start[b]) + i
            if p >= spec.max_seq:
                continue
            idx = row_index(spec, spec.n_layers - 1, b, p)
            expected_k = complex_rotate(k[b, i], p, theta)
            np.testing.assert_allclose(cache.k[idx].astype(np.float64), expected_k, rtol=ulp, atol=subnormal_step)
            assert np.array_equal(bits(cache.v[idx]), bits(v[b, i].astype(spec.np_dtype)))  # v is not rotated


@given(attention_cases(head_dims=even_head_dims), st.floats(2.0, 1e6))
def test_rope_on_queries_matches_complex_form(case, theta):
    cache, layer, q, kwargs = case
    positions = cache.lengths[:, None].astype(np.int64) + np.arange(q.shape[1])  # [batch, q_len]
    rotated = complex_rotate(q.astype(np.float64), positions[..., None], theta)
    np.testing.assert_allclose(
        attention(q, cache, layer, rope=Rope(theta), **kwargs), attention(rotated, cache, layer, **kwargs), rtol=1e-9, atol=1e-10
    )


def test_rope_angles_shape_and_values():
    angles = rope_angles(np.arange(6).reshape(3, 2), 8, 100.0)
    assert angles.shape == (3, 2, 4) and angles.dtype == np.float64
    assert angles[2, 1, 0] == 5.0 and math.isclose(angles[1, 0, 3], 2 / 100.0 ** (6 / 8), rel_tol=1e-15)


# ---------------------------------------------------------------- protocol


@given(caches(), st.integers(1, 5), st.data())
def test_append_writes_only_pending_rows(cache, n_new, data):
    spec = cache.spec
    layer = data.draw(st.integers(0, spec.n_layers - 1))
    rng = np.random.default_rng(data.draw(seeds))
    k = (rng.standard_normal((spec.batch, n_new, spec.n_kv_heads, spec.head_dim)) * 3).astype(np.float32)
    v = (rng.standard_normal(k.shape) * 3).astype(np.float32)
    expected_k, expected_v = cache.k.copy(), cache.v.copy()
    lengths, overflow = cache.lengths.copy(), cache.overflow.copy()
    for b in range(spec.batch):
        for i in range(n_new):
            p = int(lengths[b]) + i
            if p < spec.max_seq:
                expected_k[row_index(spec, layer, b, p)] = round_float32_to(k[b, i], spec.dtype)
                expected_v[row_index(spec, layer, b, p)] = round_float32_to(v[b, i], spec.dtype)
    cache.append(layer, k, v)
    assert np.array_equal(bits(cache.k), bits(expected_k))
    assert np.array_equal(bits(cache.v), bits(expected_v))
    assert np.array_equal(cache.lengths, lengths)
    assert np.array_equal(cache.overflow, overflow | (lengths.astype(int) + n_new > spec.max_seq))


@st.composite
def near_ties(draw, dtype):
    """float64 values at, just below and just above rounding ties of ``dtype``."""
    shift = 52 - MANTISSA_BITS[dtype]
    tie = 1 << (shift - 1)
    low = draw(st.sampled_from([0, tie, tie - 1, tie + 1, 1, (1 << shift) - 1]) | st.integers(0, (1 << shift) - 1))
    high = draw(st.integers(0, (1 << MANTISSA_BITS[dtype]) - 1))
    top = MAX_NORMAL_EXPONENT[dtype] - 1
    exponent = draw(st.integers(max(-top, -60), min(top, 60)))
    sign = draw(st.integers(0, 1))
    return np.array([(sign << 63) | ((exponent + 1023) << 52) | (high << shift) | low], dtype=np.uint64).view(np.float64)[0]


@given(st.sampled_from(DTYPES).flatmap(lambda d: st.tuples(st.just(d), st.lists(near_ties(d), min_size=4, max_size=16))))
def test_append_rounds_float64_once_to_nearest_even(case):
    dtype, values = case
    spec = CacheSpec(1, 1, len(values), 2, dtype=dtype)
    cache = KVCache(spec)
    x = np.array(values).reshape(1, 1, 1, -1)
    cache.append(0, x, -x)
    expected = round_float64_to_mantissa(x[0, 0, 0], MANTISSA_BITS[dtype])
    assert np.array_equal(cache.k[0, 0, 0, 0].astype(np.float64), expected)
    assert np.array_equal(cache.v[0, 0, 0, 0].astype(np.float64), -expected)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1 + 2**-8 + 2**-52, 1 + 2**-7),  # just above a tie: up (a float32 detour would land on the tie, then go to even)
        (1 + 2**-8, 1.0),  # tie: to even
        (1 + 3 * 2**-8, 1 + 2**-6),  # tie: to even
        (1 + 2**-8 - 2**-52, 1.0),  # just below a tie: down
        (-(1 + 2**-8 + 2**-52), -(1 + 2**-7)),
    ],
)
def test_bfloat16_from_float64_rounds_once(value, expected):
    cache = KVCache(CacheSpec(1, 1, 1, 1, dtype="bfloat16"))
    x = np.full((1, 1, 1, 1), value)
    cache.append(0, x, x)
    assert float(cache.k[0, 0, 0, 0, 0]) == expected


@given(caches(), st.data())
def test_advance_adds_clamps_and_flags(cache, data):
    spec = cache.spec
    before = snapshot(cache)
    steps = st.integers(0, 2 * spec.max_seq + 1)
    n = data.draw(steps | st.lists(steps, min_size=spec.batch, max_size=spec.batch).map(np.array))
    total = cache.lengths.astype(np.int64) + np.broadcast_to(n, (spec.batch,))
    cache.advance(n)
    assert cache.lengths.dtype == np.int32
    assert np.array_equal(cache.lengths, np.minimum(total, spec.max_seq))
    assert np.array_equal(cache.overflow, before[3] | (total > spec.max_seq))
    assert np.array_equal(bits(cache.k), before[0]) and np.array_equal(bits(cache.v), before[1])


@given(caches(random_overflow=False), st.integers(1, 6))
def test_overflow_drops_rows_flags_and_check_names_sequences(cache, n_new):
    spec = cache.spec
    start = cache.lengths.astype(np.int64)
    k = np.ones((spec.batch, n_new, spec.n_kv_heads, spec.head_dim))
    for layer in range(spec.n_layers):
        cache.append(layer, k, 2 * k)
    cache.advance(n_new)
    bad = [b for b in range(spec.batch) if start[b] + n_new > spec.max_seq]
    assert cache.overflow.tolist() == [b in bad for b in range(spec.batch)]
    assert np.array_equal(cache.lengths, np.minimum(start + n_new, spec.max_seq))
    for _ in range(2):  # check() does not clear the flags
        if bad:
            with pytest.raises(CacheOverflowError, match=re.escape(f"sequences {bad}")):
                cache.check()
        else:
            cache.check()
    cache.reset(bad)
    cache.check()


@given(caches(), st.data())
def test_truncate_only_shortens(cache, data):
    spec = cache.spec
    before = snapshot(cache)
    new = data.draw(st.tuples(*(st.integers(0, int(n)) for n in cache.lengths)).map(np.array))
    cache.truncate(new)
    assert np.array_equal(cache.lengths, new)
    assert np.array_equal(bits(cache.k), before[0]) and np.array_equal(bits(cache.v), before[1])
    assert np.array_equal(cache.overflow, before[3])

    longer = data.draw(st.integers(0, spec.batch - 1))
    attempt = new.copy()
    attempt[longer] += data.draw(st.integers(1, 5))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=re.escape(f"new_lengths[{longer}]")):
        cache.truncate(attempt)
    assert_unchanged(cache, before)


@given(caches(), st.data())
def test_reset_touches_only_given_slots(cache, data):
    spec = cache.spec
    before = snapshot(cache)
    slots = data.draw(
        st.none()
        | st.integers(0, spec.batch - 1)
        | st.lists(st.integers(0, spec.batch - 1), unique=True, max_size=spec.batch)
    )
    chosen = set(range(spec.batch)) if slots is None else {slots} if isinstance(slots, int) else set(slots)
    cache.reset(slots)
    for b in range(spec.batch):
        assert cache.lengths[b] == (0 if b in chosen else before[2][b])
        assert cache.overflow[b] == (False if b in chosen else before[3][b])
    assert np.array_equal(bits(cache.k), before[0]) and np.array_equal(bits(cache.v), before[1])


@given(caches(), st.integers(1, 5))
def test_additive_mask(cache, q_len):
    spec = cache.spec
    before = snapshot(cache)
    mask = cache.additive_mask(q_len)
    assert mask.shape == (spec.batch, 1, q_len, spec.max_seq) and mask.dtype == np.float32
    for b in range(spec.batch):
        for i in range(q_len):
            for j in range(spec.max_seq):
                assert mask[b, 0, i, j] == (0.0 if j <= cache.lengths[b] + i else np.float32(MASK_VALUE))
    assert_unchanged(cache, before)


def test_copy_and_rows():
    cache = KVCache(CacheSpec(2, 2, 4, 8, batch=2, dtype="bfloat16", layout="HND"))
    cache.append(1, np.full((2, 3, 2, 4), 1.5), np.full((2, 3, 2, 4), -2.0))
    cache.advance([3, 1])
    twin = cache.copy()
    k, v = twin.rows(1, 1)
    assert k.shape == (1, 2, 4) and k.dtype == np.float64 and (k == 1.5).all() and (v == -2.0).all()
    twin.reset()
    twin.k[...] = 0
    assert cache.lengths.tolist() == [3, 1] and cache.rows(1, 0)[0].shape == (3, 2, 4)
    assert (cache.rows(1, 0)[0] == 1.5).all()


# ------------------------------------------------------- stateful protocol


class CacheProtocol(RuleBasedStateMachine):
    """Drives the reference with random operations; a python model predicts every stored row."""

    @initialize(spec=specs(max_seq=st.integers(1, 8)), seed=seeds)
    def setup(self, spec, seed):
        self.cache = KVCache(spec)
        self.rng = np.random.default_rng(seed)
        # model: rows[layer][b][pos] -> (k, v) in storage dtype, or None while still zero
        self.rows = [[[None] * spec.max_seq for _ in range(spec.batch)] for _ in range(spec.n_layers)]
        self.lengths = [0] * spec.batch
        self.overflow = [False] * spec.batch

    @rule(data=st.data())
    def append(self, data):
        spec = self.cache.spec
        layer = data.draw(st.integers(0, spec.n_layers - 1))
        n_new = data.draw(st.integers(1, 3))
        shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
        k = self.rng.standard_normal(shape).astype(spec.np_dtype)  # already representable: stored exactly
        v = self.rng.standard_normal(shape).astype(spec.np_dtype)
        self.cache.append(layer, k, v)
        for b in range(spec.batch):
            for i in range(n_new):
                p = self.lengths[b] + i
                if p < spec.max_seq:
                    self.rows[layer][b][p] = (k[b, i], v[b, i])
                else:
                    self.overflow[b] = True

    @rule(data=st.data())
    def advance(self, data):
        spec = self.cache.spec
        n = data.draw(st.lists(st.integers(0, 3), min_size=spec.batch, max_size=spec.batch))
        self.cache.advance(n)
        for b in range(spec.batch):
            self.overflow[b] |= self.lengths[b] + n[b] > spec.max_seq
            self.lengths[b] = min(self.lengths[b] + n[b], spec.max_seq)

    @rule(data=st.data())
    def truncate(self, data):
        new = [data.draw(st.integers(0, n)) for n in self.lengths]
        self.cache.truncate(new)
        self.lengths = new

    @rule(data=st.data())
    def reset(self, data):
        spec = self.cache.spec
        slots = data.draw(st.lists(st.integers(0, spec.batch - 1), unique=True, max_size=spec.batch))
        self.cache.reset(slots)
        for b in slots:
            self.lengths[b], self.overflow[b] = 0, False

    @rule()
    def check(self):
        bad = [b for b, flag in enumerate(self.overflow) if flag]
        if bad:
            with pytest.raises(CacheOverflowError, match=re.escape(f"sequences {bad}")):
                self.cache.check()
        else:
            self.cache.check()

    @invariant()
    def matches_model(self):
        spec = self.cache.spec
        assert self.cache.lengths.tolist() == self.lengths
        assert self.cache.overflow.tolist() == self.overflow
        zero = np.zeros((spec.n_kv_heads, spec.head_dim), dtype=spec.np_dtype)
        for layer in range(spec.n_layers):
            for b in range(spec.batch):
                for pos, stored in enumerate(self.rows[layer][b]):
                    k, v = stored if stored is not None else (zero, zero)
                    idx = row_index(spec, layer, b, pos)
                    assert np.array_equal(bits(self.cache.k[idx]), bits(k))
                    assert np.array_equal(bits(self.cache.v[idx]), bits(v))


TestCacheProtocol = CacheProtocol.TestCase
TestCacheProtocol.settings = settings(TestCacheProtocol.settings, stateful_step_count=20)


# -------------------------------------------------------------- bad inputs


def bad_cache():
    """Two sequences, lengths [3, 8] of max_seq 8, sequence 1 flagged, random contents."""
    cache = KVCache(CacheSpec(2, 2, 8, 8, batch=2, dtype="float16", layout="HND"))
    rng = np.random.default_rng(0)
    cache.k[...] = rng.standard_normal(cache.spec.shape)
    cache.v[...] = rng.standard_normal(cache.spec.shape)
    cache.lengths[:] = [3, 8]
    cache.overflow[:] = [False, True]
    return cache


ROWS = np.zeros((2, 1, 2, 8), dtype=np.float32)
Q = np.zeros((2, 1, 4, 8), dtype=np.float32)

BAD_CALLS = [
    # (call, exception, argument named first in the message)
    (lambda c: c.append(2, ROWS, ROWS), ValueError, "layer"),
    (lambda c: c.append(-1, ROWS, ROWS), ValueError, "layer"),
    (lambda c: c.append(1.0, ROWS, ROWS), TypeError, "layer"),
    (lambda c: c.append(True, ROWS, ROWS), TypeError, "layer"),
    (lambda c: c.append(0, ROWS.tolist(), ROWS), TypeError, "k"),
    (lambda c: c.append(0, ROWS.astype(np.int32), ROWS), TypeError, "k"),
    (lambda c: c.append(0, ROWS[0], ROWS), ValueError, "k"),
    (lambda c: c.append(0, ROWS[:1], ROWS), ValueError, "k"),
    (lambda c: c.append(0, ROWS[:, :0], ROWS), ValueError, "k"),
    (lambda c: c.append(0, ROWS[:, :, :1], ROWS), ValueError, "k"),
    (lambda c: c.append(0, ROWS[..., :4], ROWS), ValueError, "k"),
    (lambda c: c.append(0, ROWS, np.zeros((2, 1, 2, 8), dtype=np.complex64)), TypeError, "v"),
    (lambda c: c.append(0, ROWS, np.zeros((2, 1, 2, 7), dtype=np.float32)), ValueError, "v"),
    (lambda c: c.append(0, np.ones((2, 2, 2, 8)), np.ones((2, 1, 2, 8))), ValueError, "v"),
    (lambda c: c.append(0, ROWS, ROWS, rope="rope"), TypeError, "rope"),
    (lambda c: c.append(0, ROWS, ROWS, rope=10000.0), TypeError, "rope"),
    (lambda c: c.advance(-1), ValueError, "n"),
    (lambda c: c.advance([1, -1]), ValueError, "n"),
    (lambda c: c.advance([1, 2, 3]), ValueError, "n"),
    (lambda c: c.advance(np.ones((2, 1), dtype=np.int32)), ValueError, "n"),
    (lambda c: c.advance(1.0), TypeError, "n"),
    (lambda c: c.advance([1.0, 2.0]), TypeError, "n"),
    (lambda c: c.advance(True), TypeError, "n"),
    (lambda c: c.advance(np.array([True, False])), TypeError, "n"),
    (lambda c: c.advance("1"), TypeError, "n"),
    (lambda c: c.truncate([4, 8]), ValueError, "new_lengths"),
    (lambda c: c.truncate(4), ValueError, "new_lengths"),
    (lambda c: c.truncate(-1), ValueError, "new_lengths"),
    (lambda c: c.truncate([1]), ValueError, "new_lengths"),
    (lambda c: c.truncate(None), TypeError, "new_lengths"),
    (lambda c: c.truncate(1.0), TypeError, "new_lengths"),
    (lambda c: c.reset(2), ValueError, "slots"),
    (lambda c: c.reset(-1), ValueError, "slots"),
    (lambda c: c.reset([0, 0]), ValueError, "slots"),
    (lambda c: c.reset([0, 5]), ValueError, "slots"),
    (lambda c: c.reset([[0, 1]]), ValueError, "slots"),
    (lambda c: c.reset(1.0), TypeError, "slots"),
    (lambda c: c.reset([0.0]), TypeError, "slots"),
    (lambda c: c.reset("0"), TypeError, "slots"),
    (lambda c: c.additive_mask(0), ValueError, "q_len"),
    (lambda c: c.additive_mask(2.0), TypeError, "q_len"),
    (lambda c: c.additive_mask(None), TypeError, "q_len"),
    (lambda c: c.rows(2, 0), ValueError, "layer"),
    (lambda c: c.rows(0, 2), ValueError, "b"),
    (lambda c: attention(Q, c, 2), ValueError, "layer"),
    (lambda c: attention(Q, c, "0"), TypeError, "layer"),
    (lambda c: attention(Q.tolist(), c, 0), TypeError, "q"),
    (lambda c: attention(Q.astype(np.int64), c, 0), TypeError, "q"),
    (lambda c: attention(Q[0], c, 0), ValueError, "q"),
    (lambda c: attention(Q[:1], c, 0), ValueError, "q"),
    (lambda c: attention(Q[:, :0], c, 0), ValueError, "q"),
    (lambda c: attention(Q[:, :, :3], c, 0), ValueError, "q"),
    (lambda c: attention(Q[:, :, :0], c, 0), ValueError, "q"),
    (lambda c: attention(Q[..., :4], c, 0), ValueError, "q"),
    (lambda c: attention(Q, c.k, 0), TypeError, "cache"),
    (lambda c: attention(Q, c, 0, scale=0.0), ValueError, "scale"),
    (lambda c: attention(Q, c, 0, scale=-1.0), ValueError, "scale"),
    (lambda c: attention(Q, c, 0, scale=float("nan")), ValueError, "scale"),
    (lambda c: attention(Q, c, 0, scale="1"), TypeError, "scale"),
    (lambda c: attention(Q, c, 0, scale=True), TypeError, "scale"),
    (lambda c: attention(Q, c, 0, window=0), ValueError, "window"),
    (lambda c: attention(Q, c, 0, window=2.0), TypeError, "window"),
    (lambda c: attention(Q, c, 0, softcap=0.0), ValueError, "softcap"),
    (lambda c: attention(Q, c, 0, softcap=float("inf")), ValueError, "softcap"),
    (lambda c: attention(Q, c, 0, softcap="30"), TypeError, "softcap"),
    (lambda c: attention(Q, c, 0, rope=True), TypeError, "rope"),
]


@pytest.mark.parametrize("call, exc, argument", BAD_CALLS)
def test_bad_input_is_rejected_and_cache_unchanged(call, exc, argument):
    cache = bad_cache()
    before = snapshot(cache)
    with pytest.raises(exc) as info:
        call(cache)
    message = str(info.value)
    assert message.startswith(f"{argument}: expected "), message
    assert ", got " in message, message
    assert_unchanged(cache, before)


def test_messages_show_expected_and_got():
    cache = KVCache(CacheSpec(1, 4, 64, 8, batch=2))
    with pytest.raises(ValueError) as info:
        cache.append(0, np.zeros((2, 3, 4, 32)), np.zeros((2, 3, 4, 32)))
    assert str(info.value) == "k: expected shape (2, 3, 4, 64) [batch, n_new, n_kv_heads, head_dim], got (2, 3, 4, 32)"
    cache.lengths[:] = [3, 5]
    with pytest.raises(ValueError, match=re.escape("got new_lengths[1] = 6 with lengths[1] = 5")):
        cache.truncate([2, 6])


def test_rope_needs_even_head_dim():
    cache = KVCache(CacheSpec(1, 1, 7, 4))
    before = snapshot(cache)
    rows = np.ones((1, 1, 1, 7))
    with pytest.raises(ValueError, match=r"^rope: expected .*even head_dim, got head_dim=7"):
        cache.append(0, rows, rows, rope=Rope())
    with pytest.raises(ValueError, match=r"^rope: "):
        attention(rows, cache, 0, rope=Rope())
    assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "theta, exc", [(0.0, ValueError), (-1.0, ValueError), (0.5, ValueError), (np.float32(0.999), ValueError),
                   (float("nan"), ValueError), (float("inf"), ValueError), (10**400, ValueError), ("1e4", TypeError),
                   (True, TypeError), (None, TypeError)]
)
def test_bad_rope_theta(theta, exc):
    # theta >= 1 keeps every inverse frequency <= 1: an angle is at most its position, never inf or NaN
    with pytest.raises(exc, match=r"^Rope\.theta: expected a float in 1\.\.1\.7976931e\+308 \(finite and >= 1, "):
        Rope(theta)


def test_rope_theta_normalised():
    assert Rope(500) == Rope(500.0) and type(Rope(np.int64(7)).theta) is float
    assert Rope(1).theta == 1.0   # the smallest base: every frequency is 1


def test_cache_needs_a_spec():
    with pytest.raises(TypeError, match=r"^spec: expected a cupykv.CacheSpec, got "):
        KVCache({"n_layers": 1})
