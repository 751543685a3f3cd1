"""Bad input: each bad call gets its own clear error, raised before any launch, and the cache is unchanged.

The table holds, besides plain mistakes, every silent corruption a fuzz of the
emulator once found (issue 17): per-sequence values and scalars that wrapped
in the kernel's int, strided device arrays read as if contiguous, outputs and
inputs aliasing each other or the cache, and floats the kernel's float32
turned into inf or 0.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import cupykv
from cupykv import ops, reference, testing
from cupykv.backends import get_backend
from backends import BACKENDS
from test_ops import read_only

SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=16, batch=2, dtype="float16")


def rows(n_new=1, heads=2, head_dim=8, dtype=np.float16, batch=2):
    return np.ones((batch, n_new, heads, head_dim), dtype=dtype)


def cache_view(buffer, shape, dtype=None):
    """A C-contiguous view of the first elements of a cache buffer, of ``shape`` (and dtype): it aliases the cache."""
    flat = buffer.reshape(-1) if dtype is None else buffer.reshape(-1).view(dtype)
    return flat[: int(np.prod(shape))].reshape(shape)


def shifted_pair(d, shape, dtype=np.float16):
    """Two views of one device buffer, the second one element further: every element but one shared."""
    buffer = d(np.ones(int(np.prod(shape)) + 1, dtype))
    return buffer[:-1].reshape(shape), buffer[1:].reshape(shape)


def ints_device(d, values):
    return d(np.array(values, np.int32))


I32 = r"0\.\.2147483647"
FLOAT32 = r"a float in 1\.1754944e-38\.\.3\.4028235e\+38 \(normal and > 0 in float32, the kernel's type\)"


# (name, call(cache, dev) -> None, exception type, message pattern). `dev` moves host data to the device.
BAD_CALLS = [
    ("append layer -1", lambda c, d: c.append(-1, d(rows()), d(rows())), ValueError, r"^layer: expected an int in 0\.\.1, got -1"),
    ("append layer past the end", lambda c, d: c.append(2, d(rows()), d(rows())), ValueError, r"^layer: .*got 2"),
    ("append layer float", lambda c, d: c.append(1.0, d(rows()), d(rows())), TypeError, r"^layer: .*got 1\.0"),
    ("append layer bool", lambda c, d: c.append(True, d(rows()), d(rows())), TypeError, r"^layer: "),
    ("append k 3-d", lambda c, d: c.append(0, d(rows()[0]), d(rows())),
     ValueError, r"^k: expected shape \(2, n_new in 1\.\.1073741823, 2, 8\)"),
    ("append k wrong batch", lambda c, d: c.append(0, d(rows(batch=3)), d(rows())), ValueError, r"^k: .*got \(3, 1, 2, 8\)"),
    ("append k wrong kv heads", lambda c, d: c.append(0, d(rows(heads=4)), d(rows())), ValueError, r"^k: .*got \(2, 1, 4, 8\)"),
    ("append k wrong head_dim", lambda c, d: c.append(0, d(rows(head_dim=4)), d(rows())),
     ValueError, r"^k: expected shape \(2, 1, 2, 8\) \[batch, n_new, n_kv_heads, head_dim\], got \(2, 1, 2, 4\)$"),
    ("append k no rows", lambda c, d: c.append(0, d(rows(n_new=0)), d(rows())), ValueError, r"^k: .*got \(2, 0, 2, 8\)"),
    ("append v shape differs", lambda c, d: c.append(0, d(rows(n_new=2)), d(rows())), ValueError, r"^v: "),
    ("append k wrong dtype", lambda c, d: c.append(0, d(rows(dtype=np.float32)), d(rows())), TypeError, r"^k: expected dtype float16"),
    ("append k not contiguous", lambda c, d: c.append(0, d(rows(n_new=2))[:, ::2], d(rows())), ValueError, r"^k: expected a C-contiguous"),
    ("append k a list", lambda c, d: c.append(0, rows().tolist(), d(rows())), TypeError, r"^k: expected an array"),
    ("append rope not a Rope", lambda c, d: c.append(0, d(rows()), d(rows()), rope=10000.0),
     TypeError, r"^rope: expected None or a cupykv.Rope"),
    ("advance negative", lambda c, d: c.advance(-1), ValueError, rf"^n: expected an int in {I32}, got -1"),
    ("advance float", lambda c, d: c.advance(1.5), TypeError, r"^n: expected an int"),
    ("advance host float array", lambda c, d: c.advance(np.array([1.0, 1.0])), TypeError,
     rf"^n: expected an int in {I32} or 2 such ints \[batch\], got dtype float64$"),   # whole values, still refused
    ("advance wrong length", lambda c, d: c.advance([1, 2, 3]), ValueError, r"^n: .*got shape \(3,\)"),
    ("advance negative per sequence", lambda c, d: c.advance([1, -1]), ValueError, rf"^n: expected ints in {I32}, got n\[1\] = -1"),
    ("advance device int64", lambda c, d: c.advance(d(np.array([1, 1], dtype=np.int64))), ValueError, r"^n: expected a device int32 array"),
    ("truncate grows", lambda c, d: c.truncate([5, 0]), ValueError, r"^new_lengths: .*new_lengths\[0\] = 5 with lengths\[0\] = 3"),
    ("truncate negative", lambda c, d: c.truncate(-1), ValueError, r"^new_lengths: .*= -1"),
    ("truncate wrong shape", lambda c, d: c.truncate([1]), ValueError, r"^new_lengths: .*got shape \(1,\)"),
    ("truncate strings", lambda c, d: c.truncate("0"), TypeError, r"^new_lengths: "),
    ("truncate host float array", lambda c, d: c.truncate(np.array([0.0, 0.0])), TypeError,
     r"^new_lengths: expected an int or 2 ints \[batch\], got dtype float64$"),
    ("truncate device float", lambda c, d: c.truncate(d(np.zeros(2, np.float32))), ValueError, r"^new_lengths: expected a device int32"),
    ("reset slot out of range", lambda c, d: c.reset(5), ValueError, r"^slots: .*got 5"),
    ("reset slot batch", lambda c, d: c.reset(2), ValueError, r"^slots: expected an int in 0\.\.1, got 2$"),
    ("reset slot batch in a list", lambda c, d: c.reset([0, 2]), ValueError,
     r"^slots: expected None, an int or distinct ints in 0\.\.1, got slot 2$"),
    ("reset slots 2-d", lambda c, d: c.reset(np.array([[0], [1]])), ValueError,
     r"^slots: expected None, an int or distinct ints in 0\.\.1, got shape \(2, 1\)$"),
    ("reset repeated slots", lambda c, d: c.reset([0, 0]), ValueError, r"^slots: .*repeated slots \[0, 0\]"),
    ("reset a string", lambda c, d: c.reset("all"), TypeError, r"^slots: "),
    ("mask q_len 0", lambda c, d: c.additive_mask(0), ValueError, r"^q_len: expected an int in 1\.\.1073741823, got 0"),
    ("mask out wrong shape", lambda c, d: c.additive_mask(2, out=d(np.zeros((2, 1, 1, 16), np.float32))),
     ValueError, r"^out: expected shape \(2, 1, 2, 16\)"),
    ("mask out wrong dtype", lambda c, d: c.additive_mask(1, out=d(np.zeros((2, 1, 1, 16), np.float16))),
     TypeError, r"^out: expected dtype float32"),
    ("attention heads not a multiple", lambda c, d: cupykv.attention(d(rows(heads=3)), c, 0),
     ValueError, r"^q: .*multiple of n_kv_heads=2"),
    ("attention q wrong head_dim", lambda c, d: cupykv.attention(d(rows(head_dim=16)), c, 0), ValueError,
     r"^q: expected shape \(2, 1, n_heads, 8\) \[batch, q_len, n_heads, head_dim\] with n_heads a multiple of "
     r"n_kv_heads=2, got \(2, 1, 2, 16\)$"),
    ("attention q wrong dtype", lambda c, d: cupykv.attention(d(rows(dtype=np.float32)), c, 0), TypeError, r"^q: expected dtype float16"),
    ("attention layer past the end", lambda c, d: cupykv.attention(d(rows()), c, 5), ValueError, r"^layer: "),
    ("attention scale 0", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=0.0), ValueError, rf"^scale: expected {FLOAT32}, got 0\.0$"),
    ("attention scale nan", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=float("nan")), ValueError, r"^scale: "),
    ("attention window 0", lambda c, d: cupykv.attention(d(rows()), c, 0, window=0),
     ValueError, r"^window: expected an int in 1\.\.2147483647, got 0"),
    ("attention softcap negative", lambda c, d: cupykv.attention(d(rows()), c, 0, softcap=-1.0), ValueError, r"^softcap: "),
    ("attention out wrong shape", lambda c, d: cupykv.attention(d(rows()), c, 0, out=d(rows(n_new=2))),
     ValueError, r"^out: expected shape \(2, 1, 2, 8\)"),
    ("attention out wrong dtype", lambda c, d: cupykv.attention(d(rows()), c, 0, out=d(rows(dtype=np.float32))),
     TypeError, r"^out: expected dtype float16"),
    ("attention cache not a cache", lambda c, d: cupykv.attention(d(rows()), reference.KVCache(SPEC), 0),
     TypeError, r"^cache: expected a cupykv.KVCache"),
    ("attention num_splits 0", lambda c, d: cupykv.attention(d(rows()), c, 0, num_splits=0), ValueError, r"^num_splits: "),
    ("attention rope not a Rope", lambda c, d: cupykv.attention(d(rows()), c, 0, rope="neox"), TypeError, r"^rope: "),
    # -- integers that wrapped in the kernel's int (issue 17) --------------------------------------------------
    ("advance np.int64(2**31)", lambda c, d: c.advance(np.int64(2**31)), ValueError, rf"^n: expected an int in {I32}, got 2147483648$"),
    ("advance np.int64(2**32 + 1)", lambda c, d: c.advance(np.int64(2**32 + 1)),
     ValueError, rf"^n: expected an int in {I32}, got 4294967297$"),
    ("advance np.uint64(2**64 - 1)", lambda c, d: c.advance(np.uint64(2**64 - 1)), ValueError, rf"^n: .*got 18446744073709551615$"),
    ("advance int 2**31", lambda c, d: c.advance(2**31), ValueError, rf"^n: expected an int in {I32}, got 2147483648$"),
    ("advance int 2**40", lambda c, d: c.advance(2**40), ValueError, rf"^n: expected an int in {I32}, got 1099511627776$"),
    ("advance list [2**40, 0]", lambda c, d: c.advance([2**40, 0]),
     ValueError, rf"^n: expected ints in {I32}, got n\[0\] = 1099511627776$"),
    ("advance list [2**32 + 1, 1]", lambda c, d: c.advance([2**32 + 1, 1]), ValueError, r"^n: .*got n\[0\] = 4294967297$"),
    ("advance list [0, 2**64]", lambda c, d: c.advance([0, 2**64]), ValueError, r"^n: .*got n\[1\] = 18446744073709551616$"),
    ("advance uint64 array", lambda c, d: c.advance(np.array([2**64 - 1, 0], np.uint64)),
     ValueError, r"^n: .*got n\[0\] = 18446744073709551615$"),
    ("truncate uint64 array", lambda c, d: c.truncate(np.array([2**64 - 1, 0], np.uint64)),
     ValueError, r"^new_lengths: .*got new_lengths\[0\] = 18446744073709551615 with"),
    ("reset np.uint64(2**64 - 1)", lambda c, d: c.reset(np.uint64(2**64 - 1)), ValueError, r"^slots: .*got 18446744073709551615$"),
    ("reset slots [2**64]", lambda c, d: c.reset([2**64]), ValueError, r"^slots: .*got slot 18446744073709551616$"),
    ("append layer np.uint64(2**64 - 1)", lambda c, d: c.append(np.uint64(2**64 - 1), d(rows()), d(rows())),
     ValueError, r"^layer: expected an int in 0\.\.1, got 18446744073709551615$"),
    ("attention window 2**31", lambda c, d: cupykv.attention(d(rows()), c, 0, window=2**31),
     ValueError, r"^window: expected an int in 1\.\.2147483647, got 2147483648$"),
    ("attention num_splits np.int8(-1)", lambda c, d: cupykv.attention(d(rows()), c, 0, num_splits=np.int8(-1)),
     ValueError, r"^num_splits: expected an int in 1\.\.1, got -1$"),
    ("mask q_len 2**30", lambda c, d: c.additive_mask(2**30), ValueError, r"^q_len: expected an int in 1\.\.1073741823, got 1073741824$"),
    # -- array sizes: each at least 1 (a grid of 0 blocks is an error, or CuPy runs one) and within the int ----------
    ("rmsnorm zero rows", lambda c, d: ops.rmsnorm(d(np.zeros((0, 8), np.float16)), d(np.ones(8, np.float16)), 1e-5),
     ValueError, r"^x: expected shape \(rows, hidden\) \[rows, hidden\] with every size in 1\.\.2\*\*31-1, got \(0, 8\)$"),
    ("linear zero in_features", lambda c, d: ops.linear(d(np.zeros((2, 0), np.float16)), d(np.zeros((4, 0), np.float16))),
     ValueError, r"^x: expected shape \(rows, in_features\) .*got \(2, 0\)$"),
    # 4 GiB of zeros: reserved, never written (the emulator maps it without committing a page)
    ("argmax 2**31 rows", lambda c, d: ops.argmax(c._backend.zeros((2**31, 1), np.float16)),
     ValueError, r"^logits: expected shape \(rows, vocab\) \[rows, vocab\] with every size in 1\.\.2\*\*31-1, "
                 r"got \(2147483648, 1\)$"),
    # -- floats the kernel's float32 does not hold ------------------------------------------------------------------
    ("attention scale 1e39 (inf in float32)", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=1e39),
     ValueError, rf"^scale: expected {FLOAT32}, got 1e\+39$"),
    ("attention scale 1e-50 (zero in float32)", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=1e-50),
     ValueError, r"^scale: .*got 1e-50$"),
    ("attention scale subnormal in float32", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=1e-40),
     ValueError, r"^scale: .*got 1e-40$"),
    ("attention scale an int past float64", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=10**400),
     ValueError, r"^scale: .*got 10{44}\.\.\.0{12}$"),   # 401 digits shown as 60 characters
    ("attention scale of 60 digits", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=10**59),
     ValueError, r"^scale: .*got 10{59}$"),   # shown whole: 60 characters
    ("attention scale an int below -float64", lambda c, d: cupykv.attention(d(rows()), c, 0, scale=-10**400),
     ValueError, r"^scale: .*got -10{43}\.\.\.0{12}$"),
    ("attention softcap 1e39", lambda c, d: cupykv.attention(d(rows()), c, 0, softcap=np.float64(1e39)),
     ValueError, r"^softcap: .*got np\.float64\(1e\+39\)$"),
    ("attention softcap past 2**64", lambda c, d: cupykv.attention(d(rows()), c, 0, softcap=2.0**64 * (1 + 2.0**-20)),
     ValueError, r"^softcap: expected a float in 1\.1754944e-38\.\.1\.8446744e\+19 \(.* flush s / softcap to 0\), got 1\.844676166"),
    ("append rope theta below 1", lambda c, d: c.append(0, d(rows()), d(rows()), rope=cupykv.Rope(0.5)),
     ValueError, r"^Rope\.theta: expected a float in 1\.\.1\.7976931e\+308"),
    # -- strided device arrays read as if contiguous --------------------------------------------------------------
    ("advance device n every other element", lambda c, d: c.advance(ints_device(d, [5, 100, 7, 100])[::2]),
     ValueError, r"^n: expected a C-contiguous array, got strides \(8,\)"),
    ("advance device n reversed", lambda c, d: c.advance(ints_device(d, [1, 2])[::-1]),
     ValueError, r"^n: expected a C-contiguous array, got strides \(-4,\)"),
    ("truncate device new_lengths reversed", lambda c, d: c.truncate(ints_device(d, [1, 2])[::-1]),
     ValueError, r"^new_lengths: expected a C-contiguous array, got strides \(-4,\)"),
    ("reset device mask every other element", lambda c, d: c.reset(ints_device(d, [1, 0, 0, 0])[::2]),
     ValueError, r"^slots: expected a C-contiguous array"),
    ("append v reversed batch", lambda c, d: c.append(0, d(rows()), d(rows())[::-1]), ValueError, r"^v: expected a C-contiguous array"),
    ("attention q reversed heads", lambda c, d: cupykv.attention(d(rows())[:, :, ::-1], c, 0),
     ValueError, r"^q: expected a C-contiguous array"),
    ("attention out every other query", lambda c, d: cupykv.attention(d(rows()), c, 0, out=d(rows(n_new=2))[:, ::2]),
     ValueError, r"^out: expected a C-contiguous array"),
    ("mask out reversed positions", lambda c, d: c.additive_mask(1, out=d(np.zeros((2, 1, 1, 16), np.float32))[..., ::-1]),
     ValueError, r"^out: expected a C-contiguous array"),
    # -- outputs and inputs aliasing each other or the cache ------------------------------------------------------
    ("attention out views the cache's v", lambda c, d: cupykv.attention(d(rows(heads=4)), c, 0, out=cache_view(c.v, (2, 1, 4, 8))),
     ValueError, r"^out: expected an array that does not overlap the cache's v, got one that shares 128 bytes with it$"),
    ("attention out views the cache's k", lambda c, d: cupykv.attention(d(rows()), c, 1, out=cache_view(c.k[1], (2, 1, 2, 8))),
     ValueError, r"^out: expected an array that does not overlap the cache's k"),
    ("attention out one element past q", lambda c, d: (lambda q, out: cupykv.attention(q, c, 0, out=out))(*shifted_pair(d, (2, 1, 2, 8))),
     ValueError, r"^out: expected an array that does not overlap q, got one that shares 62 bytes with it$"),
    ("attention out is q", lambda c, d: (lambda q: cupykv.attention(q, c, 0, out=q))(d(rows())),
     ValueError, r"^out: expected an array that does not overlap q"),
    ("mask out views the cache's k", lambda c, d: c.additive_mask(1, out=cache_view(c.k, (2, 1, 1, 16), np.float32)),
     ValueError, r"^out: expected an array that does not overlap the cache's k"),
    ("append k rows taken from the cache's k", lambda c, d: c.append(0, cache_view(c.k, (2, 2, 2, 8)), d(rows(n_new=2))),
     ValueError, r"^k: expected an array that does not overlap the cache's k, got one that shares 128 bytes with it$"),
    ("append v rows taken from the cache's v", lambda c, d: c.append(1, d(rows()), cache_view(c.v[1], (2, 1, 2, 8))),
     ValueError, r"^v: expected an array that does not overlap the cache's v"),
    ("advance device n is the cache's lengths", lambda c, d: c.advance(c.lengths),
     ValueError, r"^n: expected an array that does not overlap the cache's lengths, got one that shares 8 bytes with it$"),
    ("truncate device new_lengths is the cache's overflow flags", lambda c, d: c.truncate(c.overflow),
     ValueError, r"^new_lengths: expected an array that does not overlap the cache's overflow flags"),
    ("reset device mask is the cache's lengths", lambda c, d: c.reset(c.lengths),
     ValueError, r"^slots: expected an array that does not overlap the cache's lengths"),
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


def test_reset_takes_each_slot_from_0_to_batch_minus_1():
    def lengths_after_reset(slots):
        cache = cupykv.KVCache(SPEC, backend="emulator")
        cache.advance([3, 5])
        cache.reset(slots)
        return cache.lengths_host().tolist()

    assert [lengths_after_reset(slot) for slot in range(SPEC.batch)] == [[0, 5], [3, 0]]
    # any int dtype, as a host array of slots (an object array of Python ints too)
    assert lengths_after_reset(np.array([1], np.int64)) == lengths_after_reset(np.array([1], np.uint8)) == [3, 0]
    assert lengths_after_reset(np.array([0, 1], dtype=object)) == [0, 0]


def test_advance_and_truncate_take_host_int_arrays_of_any_int_dtype():
    for n in (np.array([3, 5], np.int64), np.array([3, 5], np.uint16), np.array([3, 5], dtype=object)):
        cache = cupykv.KVCache(SPEC, backend="emulator")
        cache.advance(n)
        cache.truncate(n - np.array([1, 2], dtype=n.dtype))
        assert cache.lengths_host().tolist() == [2, 3]


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
    with pytest.raises(TypeError, match=r"^k: expected a device array \(cupy.ndarray, .* got a host numpy.ndarray"):
        cache.append(0, rows(), rows())


HOST_ARRAY_CALLS = [
    ("k", lambda c: c.append(0, rows(), c.to_device(rows()))),
    ("q", lambda c: cupykv.attention(rows(), c, 0)),
    ("out", lambda c: cupykv.attention(c.to_device(rows()), c, 0, out=rows())),
    ("x", lambda c: cupykv.linear(rows().reshape(2, 16), c.to_device(np.ones((3, 16), np.float16)))),
]


@pytest.mark.parametrize("name, call", HOST_ARRAY_CALLS, ids=[case[0] for case in HOST_ARRAY_CALLS])
def test_a_host_array_given_to_the_emulator_is_rejected_as_on_a_gpu(name, call):
    # The emulator wants its own device arrays, as CuPy does, so code that passes on the CPU runs on a GPU.
    cache, oracle = cupykv.KVCache(SPEC, backend="emulator"), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [3, 7], np.random.default_rng(0))
    before = snapshot(cache)
    with pytest.raises(TypeError, match=rf"^{name}: expected a device array \(an emulator device array, made by "
                                        rf"cache.to_device\(array\) .*\), got a host numpy.ndarray \(shape"):
        call(cache)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache)))


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


def test_a_mask_written_over_the_cache_lengths_is_refused():
    # the fuzz's reproduction: with max_seq 1 a float32 view of lengths has the mask's shape [batch, 1, 1, 1]
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=2, max_seq=1, batch=2)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance([1, 0])
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap the cache's lengths, "
                                         r"got one that shares 8 bytes with it$"):
        cache.additive_mask(1, out=cache.lengths.view(np.float32).reshape(2, 1, 1, 1))
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache)))


def test_a_mask_over_shared_lengths_names_the_calling_cache_first():
    # two caches share one lengths array: the message must name the call's own cache ("the cache's"),
    # not whichever of the two the registry happens to list first
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=2, max_seq=1, batch=2)
    first = cupykv.KVCache(spec, backend="emulator")
    second = cupykv.KVCache(spec, backend="emulator", lengths=first.lengths)
    for cache in (first, second):
        with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap the cache's lengths, "
                                             r"got one that shares 8 bytes with it$"):
            cache.additive_mask(1, out=cache.lengths.view(np.float32).reshape(2, 1, 1, 1))


# Emulator only: CuPy arrays have no read-only flag. Before issue 17 the emulator found these after the kernel ran.
READ_ONLY_OUTPUTS = [
    ("attention out, a device array", lambda c, d: cupykv.attention(d(rows()), c, 0, out=read_only(d(rows())))),
    ("mask out", lambda c, d: c.additive_mask(1, out=read_only(d(np.zeros((2, 1, 1, 16), np.float32))))),
]


@pytest.mark.parametrize("name, call", READ_ONLY_OUTPUTS, ids=[case[0] for case in READ_ONLY_OUTPUTS])
def test_a_read_only_output_is_refused_before_launch(name, call):
    cache, oracle = cupykv.KVCache(SPEC, backend="emulator"), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [3, 7], np.random.default_rng(0))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^out: expected a writeable array, got a read-only one"):
        call(cache, cache._backend.asarray)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache))), f"{name} changed the cache"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_op_writes_into_any_cache(backend):
    # an op has no cache argument, yet its output must not land in a cache's buffers (issue 17)
    from cupykv import ops
    cache, oracle = cupykv.KVCache(SPEC, backend=backend), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [3, 7], np.random.default_rng(0))
    other = cupykv.KVCache(SPEC, backend=backend)
    d = cache._backend.asarray
    x, w = d(np.ones((2, 8), np.float16)), d(np.ones((4, 8), np.float16))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap a KVCache's k, "
                                         r"got one that shares 16 bytes with it$"):
        ops.linear(x, w, out=cache_view(cache.k, (2, 4)))
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap a KVCache's lengths"):
        ops.argmax(x, out=cache.lengths)
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap a KVCache's v"):
        cupykv.attention(d(rows()), other, 0, out=cache_view(cache.v, (2, 1, 2, 8)))
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_that_only_touches_its_inputs_is_taken(backend):
    # one buffer cut into a | out | b: out begins where a ends and ends where b begins, sharing no byte
    from cupykv.backends import get_backend
    buffer = get_backend(backend).asarray(np.arange(96, dtype=np.float32))
    a, out, b = (buffer[i * 32:(i + 1) * 32].reshape(4, 8) for i in range(3))
    assert ops.add(a, b, out=out) is out
    host = get_backend(backend).to_host(buffer)
    assert host[32:64].tolist() == (np.arange(32) + np.arange(64, 96)).astype(np.float32).tolist()
    assert host[:32].tolist() == list(range(32)) and host[64:].tolist() == list(range(64, 96))


class _Owner:
    """A stand-in for a KVCache or AttentionPlan: it owns the ``(what, first, last)`` byte ranges it is given."""

    def __init__(self, ranges):
        self._ranges = tuple(ranges)

    def owned_ranges(self):
        return self._ranges


# fake addresses far above any real allocation, so that no live cache of another test is among the hits
_FAR = 1 << 62
_SPANS = st.tuples(st.integers(0, 96), st.integers(1, 48))


@st.composite
def _owners_and_query(draw):
    """Owners' spans, and a query ``(start, size)`` whose ends are often a span's edge (touching, not sharing)."""
    owners = draw(st.lists(st.lists(_SPANS, min_size=1, max_size=3), min_size=1, max_size=6))
    edges = sorted({edge for spans in owners for start, size in spans for edge in (start, start + size)})
    start = draw(st.sampled_from(edges) | st.integers(0, 150))
    end = draw(st.sampled_from([edge for edge in edges if edge >= start] or [start]) | st.integers(start, start + 48))
    return owners, (start, end - start)


@settings(deadline=None)
@given(owners_and_query=_owners_and_query())
# a span inside a longer one that ends where the query starts: the longer one keeps the search going
# down to it, and it shares no byte
@example(owners_and_query=([[(0, 48)], [(10, 10)]], (20, 10)))
# a query of no bytes where one span ends and the next starts
@example(owners_and_query=([[(30, 5), (10, 20)]], (30, 0)))
# a query between a span that ends where it starts and one that starts where it ends
@example(owners_and_query=([[(0, 20), (40, 8)]], (20, 20)))
def test_the_buffer_registry_finds_exactly_the_ranges_a_scan_finds(owners_and_query):
    """``check_apart_from_caches`` asks a sorted index (``cupykv._args.overlap._index``), not every owner in
    turn. Ranges here nest, repeat and touch (a cache may share its lengths, or part of another's), and the
    query's ends often fall on a range's edge: the index must return every range sharing a byte with the
    query, with the bytes shared, and nothing else (a range it only touches shares none)."""
    owners, query = owners_and_query
    import weakref
    from cupykv._args import overlap
    fakes = [_Owner((f"buffer {j}", _FAR + start, _FAR + start + size) for j, (start, size) in enumerate(spans))
             for spans in owners]
    # an index of these owners alone (the session's live caches would sort before them), so that the first
    # entry, the last and every one between are the fakes' own
    saved = overlap._live_owners, overlap._index
    overlap._live_owners, overlap._index = weakref.WeakSet(), overlap._RangeIndex()
    try:
        for owner in fakes:
            overlap.register_buffers(owner)
        first, last = _FAR + query[0], _FAR + query[0] + query[1]
        found = sorted((fakes.index(owner), what, common) for owner, what, common in overlap._index.overlapping(first, last))
    finally:
        overlap._live_owners, overlap._index = saved
    scan = sorted((i, what, min(last, end) - max(first, start)) for i, owner in enumerate(fakes)
                  for what, start, end in owner.owned_ranges() if min(last, end) - max(first, start) > 0)
    assert found == scan


def test_every_cache_method_checks_the_device_before_anything_else(monkeypatch, recorded_launches):
    """On a GPU, a cache used under a CUDA device other than its own is refused before anything launches or
    uploads (``Backend.check_device``). The emulator has one device, so its check is made to fail here:
    every method that launches, uploads, or hands the cache's arrays to a launch must ask it first."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=8, batch=2)
    cache = cupykv.KVCache(spec, backend="emulator")
    rows = cache.to_device(np.ones((2, 1, 1, 4), np.float32))
    q = cache.to_device(np.ones((2, 1, 1, 4), np.float32))

    def elsewhere(self, name, array):
        raise TypeError(f"{name}: on another device")

    monkeypatch.setattr(type(cache._backend), "check_device", elsewhere)
    calls = {"append": lambda: cache.append(0, rows, rows), "write": lambda: cache.write(0, [[0], [0]], rows, rows),
             "advance": lambda: cache.advance(1), "truncate": lambda: cache.truncate(0),
             "set_lengths": lambda: cache.set_lengths(0), "reset": lambda: cache.reset(),
             "additive_mask": lambda: cache.additive_mask(), "set_scales": lambda: cache.set_scales(1.0),
             "kernel_view": lambda: cache.kernel_view(0), "attention": lambda: cupykv.attention(q, cache, 0)}
    for what, call in calls.items():
        with pytest.raises(TypeError, match=r"^cache: on another device$"):
            call()
        assert recorded_launches == [], what


def test_overlap_is_decided_to_the_byte():
    from cupykv._args import check_no_overlap
    buffer = get_backend("emulator").asarray(np.zeros(16, np.uint8))
    out, touching, sharing_one = buffer[0:8], buffer[8:16], buffer[7:15]
    check_no_overlap("out", out, [("x", touching)])   # adjacent: no byte in common
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap x, got one that shares "
                                         r"1 bytes with it$"):
        check_no_overlap("out", out, [("x", sharing_one)])
    with pytest.raises(ValueError, match=r"^out: expected the very array given as x \(in place\) or one that does "
                                         r"not overlap it, got one that shares 1 bytes with it$"):
        check_no_overlap("out", out, [("x", sharing_one)], in_place_ok=True)
    check_no_overlap("out", out, [("x", buffer[0:8])], in_place_ok=True)


class _CupyLike:
    """What byte_range reads of a CuPy array (data.ptr, shape, strides, dtype, size), over host memory."""

    def __init__(self, view):
        import types
        self.data = types.SimpleNamespace(ptr=view.__array_interface__["data"][0])
        self.shape, self.strides, self.dtype, self.size = view.shape, view.strides, view.dtype, view.size


@pytest.mark.parametrize("make_view", [lambda a: a, lambda a: a[3:9], lambda a: a[::-2], lambda a: a.reshape(6, 8).T,
                                       lambda a: a.reshape(6, 8)[::-1, 2:5], lambda a: a[5:5]],
                         ids=["whole", "slice", "reversed", "transposed", "reversed rows", "empty"])
def test_a_cupy_arrays_byte_range_is_the_numpy_one_of_the_same_memory(make_view):
    """byte_range describes a CuPy array by its device pointer and strides; on a GPU its addresses are the
    bounds of what the view can touch, as NumPy computes them for host memory (negative strides too)."""
    from cupykv._args import byte_range
    view = make_view(np.zeros(48, np.float32))
    assert byte_range(_CupyLike(view)) == byte_range(view)
    first, last = byte_range(view)
    if view.size:
        assert last - first >= view.itemsize and (first, last) != (0, 0)
    else:   # no byte to touch: the empty range at its pointer, which overlaps nothing
        assert (first, last) == (view.__array_interface__["data"][0],) * 2


def test_an_unregistered_owner_is_checked_directly():
    """The call's own cache is checked from its own ranges when it is not (yet) in the registry."""
    from cupykv._args import byte_range, check_apart_from_caches
    out = get_backend("emulator").asarray(np.zeros(16, np.uint8))[0:8]
    first, _ = byte_range(out)
    check_apart_from_caches("out", out, _Owner([("k", first + 8, first + 16)]), others=False)   # touching only
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap the cache's k, got one "
                                         r"that shares 1 bytes with it$"):   # out's last byte
        check_apart_from_caches("out", out, _Owner([("v", first - 8, first), ("k", first + 7, first + 12)]),
                                others=False)


def test_a_kernel_float_is_checked_as_the_kernel_rounds_it():
    """scale, softcap and eps reach a kernel as float32: both ends of the normal range are taken, a value that
    rounds to a subnormal, to zero or past the top is refused."""
    from cupykv._args import check_positive_float32
    tiny, top = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    assert check_positive_float32("scale", tiny) == tiny and check_positive_float32("scale", top) == top
    assert check_positive_float32("scale", np.float32(1.5)) == 1.5 and check_positive_float32("scale", 3) == 3.0
    for bad in (tiny / 2, 1e-50, 3.5e38, -1.0, 10**400):
        with pytest.raises(ValueError, match=r"^scale: expected a float in 1\.1754944e-38\.\.3\.4028235e\+38 "):
            check_positive_float32("scale", bad)
    assert check_positive_float32("softcap", 2.0**64, 2.0**64, "why") == 2.0**64
    with pytest.raises(ValueError, match=r"^softcap: expected a float in 1\.1754944e-38\.\.1\.8446744e\+19 \(why\), "
                                         r"got 3\.7e\+19$"):
        check_positive_float32("softcap", 3.7e19, 2.0**64, "why")


def test_a_rope_theta_is_taken_from_1_to_the_largest_float64():
    top = float(np.finfo(np.float64).max)
    for theta in (1, 1.0, np.float16(1.0), 10000, top, 10**308):
        assert cupykv.Rope(theta).theta == float(theta)
    expected = r"^Rope\.theta: expected a float in 1\.\.1\.7976931e\+308 \(finite and >= 1, "
    for bad in (np.nextafter(1.0, 0.0), 0, -1.0, float("inf"), float("nan"), 2**1024, -(2**1024)):
        with pytest.raises(ValueError, match=expected):
            cupykv.Rope(bad)
    for bad in (True, "1e4", None, 1 + 0j):
        with pytest.raises(TypeError, match=expected):
            cupykv.Rope(bad)
    # a refused value is shown whole up to 60 characters, as the argument layer shows one
    assert len(repr(-(10**58))) == 60
    with pytest.raises(ValueError, match=rf"got {-(10**58)}$"):
        cupykv.Rope(-(10**58))
    with pytest.raises(ValueError, match=r"got -1" + "0" * 43 + r"\.\.\." + "0" * 12 + "$"):   # 45 + 3 + 12
        cupykv.Rope(-(10**59))


@pytest.mark.parametrize("make, field, bad", [(lambda: cupykv.Rope(500.0), "theta", -1.0),
                                              (lambda: SPEC, "max_seq", -4), (lambda: SPEC, "dtype", "int8")],
                         ids=["Rope.theta", "CacheSpec.max_seq", "CacheSpec.dtype"])
def test_a_checked_rope_or_spec_cannot_be_changed_afterwards(make, field, bad):
    # both are checked once, when made: an assignment afterwards would carry an unchecked value to the kernels
    settings_object = make()
    before = getattr(settings_object, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings_object, field, bad)
    assert getattr(settings_object, field) == before
    assert hash(settings_object) == hash(make()) and settings_object == make()
