"""attention: matches reference.attention within the stated tolerance, never reads past the live rows."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupykv
from cupykv import attention_plan, reference, testing
from cupykv.tolerances import assert_attention_close
from backends import BACKENDS


@st.composite
def attention_cases(draw, max_seqs=(1, 3, 16, 40, 160), head_dims=(1, 3, 8, 16, 64, 128), dtypes=testing.IO_DTYPES):
    spec = draw(testing.specs(max_seqs=max_seqs, head_dims=head_dims, kv_heads=(1, 2), dtypes=dtypes))
    _, q_len, n_heads, _ = draw(testing.query_shapes(spec, groups=(1, 2, 4, 8), max_q_len=8))
    group = n_heads // spec.n_kv_heads
    lengths = draw(testing.lengths(spec))
    options = dict(
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        window=draw(st.none() | st.integers(1, spec.max_seq + 2)),
        softcap=draw(st.none() | st.floats(1.0, 30.0)),
        rope=draw(st.none() | st.just(cupykv.Rope(theta=500.0))) if spec.head_dim % 2 == 0 else None,
    )
    num_splits = draw(st.integers(1, 4))
    return spec, group, q_len, lengths, options, num_splits, draw(st.integers(0, 2**32 - 1))


def prepare_case(backend, spec, group, q_len, lengths, options, seed):
    """A cache and its reference twin holding ``lengths`` rows and the ``q_len`` pending ones (NaN past
    them), and the queries: ``(cache, oracle, layer, q)``."""
    rng = np.random.default_rng(seed)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, lengths, rng, rope=options["rope"])
    layer = int(rng.integers(spec.n_layers))
    # the q_len pending rows, then NaN everywhere past them: a read of the tail poisons the output
    shape = (spec.batch, q_len, spec.n_kv_heads, spec.head_dim)
    k, v = testing.random_rows(rng, spec, shape), testing.random_rows(rng, spec, shape)
    cache.append(layer, cache._backend.asarray(k), cache._backend.asarray(v), rope=options["rope"])
    oracle.append(layer, k, v, rope=options["rope"])
    testing.poison_tail(cache, np.asarray(lengths) + q_len)
    q = testing.random_rows(rng, spec, (spec.batch, q_len, group * spec.n_kv_heads, spec.head_dim))
    return cache, oracle, layer, q


def run_case(backend, spec, group, q_len, lengths, options, num_splits, seed):
    cache, oracle, layer, q = prepare_case(backend, spec, group, q_len, lengths, options, seed)
    got = cupykv.attention(cache._backend.asarray(q), cache, layer, num_splits=min(num_splits, 1 + spec.max_seq // 128),
                           **options)
    want = reference.attention(q, oracle, layer, **options)
    value_scale = float(np.abs(oracle.v[layer].astype(np.float64)).max())
    assert_attention_close(testing.to_numpy(got, spec), want, spec.dtype, value_scale,
                           context=f"({spec}, group {group}, q_len {q_len}, lengths {lengths}, {options})")
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_cases())
def test_attention_matches_reference(backend, case):
    run_case(backend, *case)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_cases(max_seqs=(16, 40, 160), head_dims=(64, 128),
                            dtypes=("float16", "bfloat16", "float8_e4m3")),
       split_keys=st.sampled_from([None, 128]))
def test_rows_per_block_never_changes_a_rows_bits(backend, case, split_keys):
    """Blocks of 16, 32 or 64 query rows (one, two or four m16 tiles) give every row the same bits,
    unsplit or with split_keys (without a window, whose first key follows the block's first row)."""
    spec, group, q_len, lengths, options, _, seed = case
    options = dict(options, window=None)
    cache, _, layer, q = prepare_case(backend, spec, group, q_len, lengths, options, seed)
    q = cache.to_device(q)
    splits = dict(num_splits=1) if split_keys is None else dict(split_keys=split_keys)
    results = []
    for rows in attention_plan.block_row_choices(spec.dtype, spec.head_dim, spec.io_dtype):
        plan = cupykv.AttentionPlan(cache, q_len, group * spec.n_kv_heads, rows_per_block=rows, **splits, **options)
        assert plan.kernel.tensor_cores and plan.kernel.rows_per_block == rows
        results.append(testing.bits(testing.to_numpy(plan.run(q, layer), spec)))
    for rows, bits in zip((32, 64), results[1:]):
        assert np.array_equal(bits, results[0]), f"rows_per_block={rows} differs from 16 ({spec}, q_len {q_len})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_attention_split_and_unsplit_agree_with_reference_on_long_sequences(backend, dtype, head_dim, group):
    # 300 live positions: three chunks of 128, so splits cut through chunks and meet a partial one.
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=512, batch=2, dtype=dtype,
                            layout="HND" if group % 2 else "NHD")
    options = dict(scale=None, window=None, softcap=None, rope=None)
    for splits in (1, 3):
        run_case(backend, spec, group, 2, [300, 17], options, splits, seed=splits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_with_nothing_to_attend_to_gives_zeros(backend):
    # Sequence 0 is full; its queries sit past max_seq and a window of 1 keeps no position.
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=4, batch=2)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [4, 1], np.random.default_rng(0))
    q = testing.random_rows(np.random.default_rng(1), spec, (2, 2, 1, 8))
    got = testing.to_numpy(cupykv.attention(cache._backend.asarray(q), cache, 0, window=1), spec)
    want = reference.attention(q, oracle, 0, window=1)
    assert not np.isnan(got).any()
    assert np.all(got[0] == 0) and np.all(want[0] == 0)
    assert np.abs(got[1]).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffer_is_written_in_place(backend):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=16, max_seq=8, batch=1, dtype="float16")
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, [5], np.random.default_rng(0))
    q = cache._backend.asarray(testing.random_rows(np.random.default_rng(1), spec, (1, 1, 4, 16)))
    out = cache._backend.zeros((1, 1, 4, 16), cache._backend.storage_dtype("float16"))
    assert cupykv.attention(q, cache, 0, out=out) is out
    assert np.abs(testing.to_numpy(out, spec).astype(np.float32)).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [130, 200, 256])
def test_head_dims_past_128_use_two_dims_per_thread(backend, head_dim):
    # the generic instance (HEAD_DIM = 0) covers head_dim 129..256 with two output dims per thread
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=300, batch=2, dtype="bfloat16")
    options = dict(scale=None, window=None, softcap=5.0, rope=cupykv.Rope())
    for splits in (1, 2):
        run_case(backend, spec, 4, 3, [290, 5], options, splits, seed=head_dim + splits)
