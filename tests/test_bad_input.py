"""Bad input: each bad call gets its own clear error, raised before any launch, and the cache is unchanged."""
import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from backends import BACKENDS

SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=16, batch=2, dtype="float16")


def rows(n_new=1, heads=2, head_dim=8, dtype=np.float16, batch=2):
    return np.ones((batch, n_new, heads, head_dim), dtype=dtype)


# (name, call(cache, dev) -> None, exception type, message pattern). `dev` moves host data to the device.
BAD_CALLS = [
    ("append layer -1", lambda c, d: c.append(-1, d(rows()), d(rows())), ValueError, r"^layer: expected an int in 0\.\.1, got -1"),
    ("append layer past the end", lambda c, d: c.append(2, d(rows()), d(rows())), ValueError, r"^layer: .*got 2"),
    ("append layer float", lambda c, d: c.append(1.0, d(rows()), d(rows())), TypeError, r"^layer: .*got 1\.0"),
    ("append layer bool", lambda c, d: c.append(True, d(rows()), d(rows())), TypeError, r"^layer: "),
    ("append k 3-d", lambda c, d: c.append(0, d(rows()[0]), d(rows())), ValueError, r"^k: expected shape \(2, n_new>=1, 2, 8\)"),
    ("append k wrong batch", lambda c, d: c.append(0, d(rows(batch=3)), d(rows())), ValueError, r"^k: .*got \(3, 1, 2, 8\)"),
    ("append k wrong kv heads", lambda c, d: c.append(0, d(rows(heads=4)), d(rows())), ValueError, r"^k: .*got \(2, 1, 4, 8\)"),
    ("append k wrong head_dim", lambda c, d: c.append(0, d(rows(head_dim=4)), d(rows())), ValueError, r"^k: .*got \(2, 1, 2, 4\)"),
    ("append k no rows", lambda c, d: c.append(0, d(rows(n_new=0)), d(rows())), ValueError, r"^k: .*got \(2, 0, 2, 8\)"),
    ("append v shape differs", lambda c, d: c.append(0, d(rows(n_new=2)), d(rows())), ValueError, r"^v: "),
    ("append k wrong dtype", lambda c, d: c.append(0, d(rows(dtype=np.float32)), d(rows())), TypeError, r"^k: expected dtype float16"),
    ("append k not contiguous", lambda c, d: c.append(0, d(rows(n_new=2))[:, ::2], d(rows())), ValueError, r"^k: expected a C-contiguous"),
    ("append k a list", lambda c, d: c.append(0, rows().tolist(), d(rows())), TypeError, r"^k: expected an array"),
    ("append rope not a Rope", lambda c, d: c.append(0, d(rows()), d(rows()), rope=10000.0), TypeError, r"^rope: expected None or a cupykv.Rope"),
    ("advance negative", lambda c, d: c.advance(-1), ValueError, r"^n: expected an int >= 0, got -1"),
    ("advance float", lambda c, d: c.advance(1.5), TypeError, r"^n: expected an int"),
    ("advance wrong length", lambda c, d: c.advance([1, 2, 3]), ValueError, r"^n: .*got shape \(3,\)"),
    ("advance negative per sequence", lambda c, d: c.advance([1, -1]), ValueError, r"^n: expected non-negative ints, got n\[1\] = -1"),
    ("advance device int64", lambda c, d: c.advance(d(np.array([1, 1], dtype=np.int64))), ValueError, r"^n: expected a device int32 array"),
    ("truncate grows", lambda c, d: c.truncate([5, 0]), ValueError, r"^new_lengths: .*new_lengths\[0\] = 5 with lengths\[0\] = 3"),
    ("truncate negative", lambda c, d: c.truncate(-1), ValueError, r"^new_lengths: .*= -1"),
    ("truncate wrong shape", lambda c, d: c.truncate([1]), ValueError, r"^new_lengths: .*got shape \(1,\)"),
    ("truncate strings", lambda c, d: c.truncate("0"), TypeError, r"^new_lengths: "),
    ("truncate device float", lambda c, d: c.truncate(d(np.zeros(2, np.float32))), ValueError, r"^new_lengths: expected a device int32"),
    ("reset slot out of range", lambda c, d: c.reset(5), ValueError, r"^slots: .*got 5"),
    ("reset repeated slots", lambda c, d: c.reset([0, 0]), ValueError, r"^slots: .*repeated slots \[0, 0\]"),
    ("reset a string", lambda c, d: c.reset("all"), TypeError, r"^slots: "),
    ("mask q_len 0", lambda c, d: c.additive_mask(0), ValueError, r"^q_len: expected an int >= 1, got 0"),
    ("mask out wrong shape", lambda c, d: c.additive_mask(2, out=d(np.zeros((2, 1, 1, 16), np.float32))), ValueError, r"^out: expected shape \(2, 1, 2, 16\)"),
    ("mask out wrong dtype", lambda c, d: c.additive_mask(1, out=d(np.zeros((2, 1, 1, 16), np.float16))), TypeError, r"^out: expected dtype float32"),
    ("attention heads not a multiple", lambda c, d: cupykv.attention(d(rows(heads=3)), c, 0), ValueError, r"^q: .*multiple of n_kv_heads=2"),
    ("attention q wrong head_dim", lambda c, d: cupykv.attention(d(rows(head_dim=16)), c, 0), ValueError, r"^q: "),
    ("attention q wrong dtype", lambda c, d: cupykv.attention(d(rows(dtype=np.float32)), c, 0), TypeError, r"^q: expected dtype float16"),
    ("attention layer past the end", lambda c, d: cupykv.attention(d(rows()), c, 5), ValueError, r"^layer: "),
    ("attention scale 0", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=0.0), ValueError, r"^scale: expected a finite float > 0, got 0\.0"),
    ("attention scale nan", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=float("nan")), ValueError, r"^scale: "),
    ("attention window 0", lambda c, d: cupykv.attention(d(rows()), c, 0, window=0), ValueError, r"^window: expected an int >= 1, got 0"),
    ("attention softcap negative", lambda c, d: cupykv.attention(d(rows()), c, 0, softcap=-1.0), ValueError, r"^softcap: "),
    ("attention out wrong shape", lambda c, d: cupykv.attention(d(rows()), c, 0, out=d(rows(n_new=2))), ValueError, r"^out: expected shape \(2, 1, 2, 8\)"),
    ("attention out wrong dtype", lambda c, d: cupykv.attention(d(rows()), c, 0, out=d(rows(dtype=np.float32))), TypeError, r"^out: expected dtype float16"),
    ("attention cache not a cache", lambda c, d: cupykv.attention(d(rows()), reference.KVCache(SPEC), 0), TypeError, r"^cache: expected a cupykv.KVCache"),
    ("attention num_splits 0", lambda c, d: cupykv.attention(d(rows()), c, 0, num_splits=0), ValueError, r"^num_splits: "),
    ("attention rope not a Rope", lambda c, d: cupykv.attention(d(rows()), c, 0, rope="neox"), TypeError, r"^rope: "),
]


def snapshot(cache):
    return [testing.bits(testing.to_numpy(a, cache.spec)).copy() for a in (cache.k, cache.v)] + \
        [cache.lengths_host().copy(), cache._backend.to_host(cache.overflow).copy()]


@pytest.fixture(params=BACKENDS)
def filled_cache(request):
    cache, oracle = cupykv.KVCache(SPEC, backend=request.param), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [3, 7], np.random.default_rng(0))
    return cache


def test_the_table_has_at_least_30_distinct_calls():
    assert len({name for name, *_ in BAD_CALLS}) == len(BAD_CALLS) >= 30


@pytest.mark.parametrize("name, call, error, message", BAD_CALLS, ids=[case[0] for case in BAD_CALLS])
def test_bad_call_raises_its_error_and_changes_nothing(filled_cache, name, call, error, message):
    before = snapshot(filled_cache)
    with pytest.raises(error, match=message):
        call(filled_cache, filled_cache._backend.asarray)
    after = snapshot(filled_cache)
    for a, b in zip(before, after):
        assert np.array_equal(a, b), f"{name} changed the cache"


def test_bad_spec_for_a_cache():
    with pytest.raises(TypeError, match="^spec: expected a cupykv.CacheSpec"):
        cupykv.KVCache({"n_layers": 1})


def test_bad_backend_name():
    with pytest.raises(ValueError, match="^backend: expected one of"):
        cupykv.KVCache(SPEC, backend="tpu")


def test_rope_on_an_odd_head_dim_is_rejected():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=5, max_seq=4)
    cache = cupykv.KVCache(spec, backend="emulator")
    k = np.ones((1, 1, 1, 5), np.float32)
    with pytest.raises(ValueError, match="^rope: expected a cache with an even head_dim, got head_dim=5"):
        cache.append(0, k, k, rope=cupykv.Rope())
    assert cache.lengths_host().tolist() == [0] and not cache.k.any()


@pytest.mark.gpu
def test_a_host_array_given_to_the_gpu_backend_is_rejected():
    cache = cupykv.KVCache(SPEC, backend="cupy")
    with pytest.raises(TypeError, match="^k: expected a CUDA device array .* got a host numpy.ndarray"):
        cache.append(0, rows(), rows())


def test_cupykv_backend_environment_variable_chooses_the_default(monkeypatch):
    monkeypatch.setenv("CUPYKV_BACKEND", "emulator")
    assert cupykv.KVCache(SPEC).backend == "emulator"
    monkeypatch.setenv("CUPYKV_BACKEND", "tpu")
    with pytest.raises(ValueError, match="^CUPYKV_BACKEND: expected one of \\('cupy', 'emulator'\\), got 'tpu'"):
        cupykv.KVCache(SPEC)


def test_default_backend_follows_gpu_availability(monkeypatch):
    from cupykv.backends import cuda_available
    monkeypatch.delenv("CUPYKV_BACKEND", raising=False)
    assert cupykv.KVCache(SPEC).backend == ("cupy" if cuda_available()[0] else "emulator")
