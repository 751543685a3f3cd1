"""ops: linear, embedding, rmsnorm, silu_mul, add and argmax match ops_reference on every backend.

Tolerances, per op (u = unit roundoff of the storage dtype, 2^-24 / 2^-11 /
2^-8 for float32 / float16 / bfloat16; u32 = 2^-24). The reference is the
exact result rounded once to the storage dtype; a kernel computes in fp32 and
rounds once, so it may land one rounding step away, plus its fp32 error:

- embedding, argmax: exact (bit for bit; the index of a unique maximum).
- add: within 1 ulp. The fp32 sum of two storage values rounds like the
  exact sum, so in practice it is bit-exact; 1 ulp is the contract.
- silu_mul: within 1 ulp for float16 / bfloat16, whose ulp dwarfs the fp32
  error. For float32 storage the fp32 math is the whole error: expf (up to
  2 ulp on the GPU), 1 + e, the division and the product, about 7 u32
  relative, so up to 8 ulp.
- rmsnorm: 1 ulp plus the fp32 relative error in ulps of the storage dtype:
  the sum of squares (hidden + 16 roundings of positive terms), halved by
  the square root, rsqrtf (2 ulp on the GPU) and two products, at most
  (hidden / 2 + 15) u32; that is 1 ulp for the 16-bit types.
- linear: per element |got - want| <= 2u(1 + 2u)|want| + 2 * acc + tiny,
  where acc = (in_features + 8) u32 * sum_k |x_k w_k| bounds fp32
  accumulation (a sequential FMA chain of in_features / 32 terms per lane,
  then a 5-level warp tree), 2u|want| is one storage ulp (the two roundings
  of kernel and reference), and tiny is the subnormal spacing. Relative to
  sum |x w|, not to |want|: cancellation makes relative output error
  meaningless.

On failure the message gives the max and mean error and the worst element.
"""
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import cupykv
from cupykv import ops, ops_reference as reference
from cupykv.reference import round_to_storage
from cupykv.backends import get_backend
from cupykv.tolerances import UNIT_ROUNDOFF, ulp_distance
from cupykv.validate_launches import recording_launch_records
from backends import BACKENDS

DTYPES = ("float32", "float16", "bfloat16")
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
SUBNORMAL_SPACING = {"float32": 2.0 ** -149, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
U32 = 2.0 ** -24
IN_FEATURES = (1, 3, 8, 64, 100, 256)   # 1, 3 (and 100 for 16-bit types): scalar loads; others 16-byte vectors
OUT_FEATURES = (1, 5, 32, 130)          # 5, 130: a pair of warps with one valid output; 130: 33 blocks
ROWS = (1, 2, 7, 16, 33)                # row tiles 1, 2, 8, 16, and 16 + 16 + 1


# -- helpers -------------------------------------------------------------------
def random(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])


def to_host(backend, array, dtype=None):
    """NumPy copy of a backend array (bfloat16 bit patterns viewed as bfloat16)."""
    host = np.asarray(get_backend(backend).to_host(array))
    return host.view(NP_DTYPES[dtype]) if dtype is not None and host.dtype != NP_DTYPES[dtype] else host


def device(backend, array):
    return get_backend(backend).asarray(array)


def report(got, want, error, bound, what):
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    return (f"{what}: max error {error.max():.3g}, mean error {error.mean():.3g}; worst at {worst}: "
            f"got {got[worst]!r}, want {want[worst]!r}, allowed {np.broadcast_to(bound, error.shape)[worst]:.3g}")


def assert_within_ulps(got, want, ulps, what):
    distance = ulp_distance(got, want)
    if distance.max(initial=0) > ulps:
        worst = np.unravel_index(np.argmax(distance), distance.shape)
        raise AssertionError(f"{what}: {int(distance.max())} ulp apart (allowed {ulps}), mean {distance.mean():.3g} "
                             f"ulp; worst at {worst}: got {got[worst]!r}, want {want[worst]!r}")


def fp32_error_ulps(dtype, roundings):
    """Storage ulps a result may be off: 1 for the final rounding, plus ``roundings`` u32 of fp32 error.

    ``|got - want| < ulp + roundings * u32 * |z|`` and ``u * |z| < ulp``, and
    ``got - want`` is a whole number of ulps.
    """
    return 1 + math.floor(roundings * U32 / UNIT_ROUNDOFF[dtype])


def assert_linear_close(got, x, weight, want, dtype, what=""):
    u = UNIT_ROUNDOFF[dtype]
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(weight.astype(np.float64)).T   # sum_k |x_k w_k|
    acc = (x.shape[1] + 8) * U32 * magnitude
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    bound = 2 * u * (1 + 2 * u) * np.abs(want64) + 2 * acc + SUBNORMAL_SPACING[dtype]
    error = np.abs(got64 - want64)
    if np.isnan(error).any() or (error > bound).any():
        raise AssertionError(report(got64, want64, np.nan_to_num(error, nan=np.inf), bound, f"linear {what}"))


# -- linear ----------------------------------------------------------------------
def run_linear(backend, dtype, rows, in_features, out_features, seed, use_out=False):
    rng = np.random.default_rng(seed)
    x, weight = random(rng, (rows, in_features), dtype), random(rng, (out_features, in_features), dtype)
    out = None
    if use_out:  # poisoned, to prove every element is written
        out = device(backend, np.full((rows, out_features), np.nan, NP_DTYPES[dtype]))
    got = ops.linear(device(backend, x), device(backend, weight), out=out)
    assert out is None or got is out
    assert_linear_close(to_host(backend, got, dtype), x, weight, reference.linear(x, weight), dtype,
                        f"({dtype}, rows {rows}, in {in_features}, out {out_features})")


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), rows=st.sampled_from(ROWS), in_features=st.sampled_from(IN_FEATURES),
       out_features=st.sampled_from(OUT_FEATURES), seed=st.integers(0, 2**32 - 1), use_out=st.booleans())
def test_linear_matches_reference(backend, dtype, rows, in_features, out_features, seed, use_out):
    run_linear(backend, dtype, rows, in_features, out_features, seed, use_out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, in_features, out_features", [(4, 4096, 1024), (64, 512, 96), (3, 4097, 33)])
def test_linear_large(backend, dtype, rows, in_features, out_features):
    # a decode projection; 64 rows = four 16-row tiles; an odd in_features on the scalar path
    run_linear(backend, dtype, rows, in_features, out_features, seed=rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_at_the_edges_of_a_warps_load_steps_and_halves(backend, dtype):
    """A warp loads 32 lanes x 4 vectors ahead in its half of in_features: sizes one vector either
    side of one and two such steps per half, odd halves, and the scalar path's steps of 128."""
    vec = 16 // np.dtype(NP_DTYPES[dtype]).itemsize
    step = 32 * 4 * vec
    for units in (step - 1, step, step + 1, 2 * step + 1, 4 * step - 1):
        run_linear(backend, dtype, 2, 2 * units, 5, seed=units)        # vector path, halves of `units` each
    for in_features in (127, 255, 257, 513):
        run_linear(backend, dtype, 3, in_features, 3, seed=in_features)   # scalar path (odd in_features)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_wide_enough_to_keep_in_features_in_one_warp(backend, dtype):
    """From ops.LINEAR_SPLIT_K_BELOW_OUTS outputs on, a warp owns all of in_features (split_k 1,
    8 outputs a block): an odd count past it, both load paths."""
    out_features = ops.LINEAR_SPLIT_K_BELOW_OUTS + 5
    assert ops.linear_split_k(out_features) == ops.linear_split_k(ops.LINEAR_SPLIT_K_BELOW_OUTS) == 1
    assert ops.linear_split_k(ops.LINEAR_SPLIT_K_BELOW_OUTS - 1) == 2
    run_linear(backend, dtype, 2, 8 * (16 // np.dtype(NP_DTYPES[dtype]).itemsize), out_features, seed=3)
    run_linear(backend, dtype, 3, 9, out_features, seed=4)


def test_the_linear_split_rules_are_the_ones_docs_performance_states():
    """docs/performance.md explains each ``linear`` launch's split with numbers: they must be the code's."""
    text = " ".join((Path(__file__).parent.parent / "docs" / "performance.md").read_text().split())
    narrow = re.search(r"narrower than (\d+) outputs \(`ops\.LINEAR_SPLIT_K_BELOW_OUTS`\)", text)
    assert narrow and int(narrow.group(1)) == ops.LINEAR_SPLIT_K_BELOW_OUTS
    mma = re.search(r"`ops\.linear_mma_split_k` doubles the split while the launch has fewer than (\d+) warps "
                    r"\(an H200's 132 SMs x 16\) and each part keeps at least (\d+) steps of (\d+) features", text)
    assert mma and tuple(map(int, mma.groups())) == (ops.LINEAR_MMA_WARPS_WANTED, ops.LINEAR_MMA_MIN_STEPS,
                                                     ops.LINEAR_MMA_STEP_FEATURES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_row_tile(backend, dtype):
    """A row's output is bit-identical whether it comes alone or with 15 others (speculative
    verification must equal greedy decoding through every projection)."""
    rng = np.random.default_rng(11)
    for out_features, in_features in ((37, 1000), (ops.LINEAR_SPLIT_K_BELOW_OUTS + 3, 40)):   # split_k 2 and 1
        x, weight = random(rng, (16, in_features), dtype), random(rng, (out_features, in_features), dtype)
        together = to_host(backend, ops.linear(device(backend, x), device(backend, weight)), dtype)
        for rows in (1, 2, 5, 9):
            alone = to_host(backend, ops.linear(device(backend, np.ascontiguousarray(x[:rows])),
                                                device(backend, weight)), dtype)
            assert np.array_equal(alone.view(np.uint8), together[:rows].view(np.uint8)), (out_features, rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_on_misaligned_views_falls_back_to_scalar_loads(backend, dtype):
    rng = np.random.default_rng(1)
    x, weight = random(rng, (3, 64), dtype), random(rng, (10, 64), dtype)
    # one element in: contiguous but not 16-byte aligned
    x_buffer = device(backend, np.zeros(x.size + 1, x.dtype))
    w_buffer = device(backend, np.zeros(weight.size + 1, x.dtype))
    x_view, w_view = x_buffer[1:].reshape(x.shape), w_buffer[1:].reshape(weight.shape)
    x_view[...], w_view[...] = device(backend, x), device(backend, weight)
    got = ops.linear(x_view, w_view)
    assert_linear_close(to_host(backend, got, dtype), x, weight, reference.linear(x, weight), dtype, "misaligned")


def misaligned(backend, host):
    """A device copy of ``host``, contiguous, starting one element past a 16-byte boundary."""
    buffer = device(backend, np.zeros(host.size + 1, host.dtype))
    view = buffer[1:].reshape(host.shape)
    view[...] = device(backend, host)
    return view


def run_with_one_misaligned(backend, dtype, op, argument):
    """Runs ``op`` on small random inputs with ``argument`` alone misaligned (see misaligned())
    and checks the result against ops_reference as test_ops does for aligned inputs."""
    rng = np.random.default_rng(7)
    rows, features = 3, 64   # a multiple of every vector width: only the alignment can refuse them
    place = lambda name, host: misaligned(backend, host) if name == argument else device(backend, host)
    out_host = np.full((rows, features if op != "linear" else 24), np.nan, NP_DTYPES[dtype])
    out = place("out", out_host)
    what = f"{op} ({dtype}, {argument} misaligned)"
    if op == "linear":
        x, weight = random(rng, (rows, features), dtype), random(rng, (24, features), dtype)
        got = ops.linear(place("x", x), place("weight", weight), out=out)
        assert_linear_close(to_host(backend, got, dtype), x, weight, reference.linear(x, weight), dtype, what)
    elif op == "embedding":
        table, ids = random(rng, (40, features), dtype), np.array([0, 39, 17], np.int32)
        got = ops.embedding(device(backend, ids), place("table", table), out=out)
        want = reference.embedding(ids, table)
        np.testing.assert_array_equal(to_host(backend, got, dtype).view(f"u{want.itemsize}"),
                                      want.view(f"u{want.itemsize}"), what)
    elif op == "rmsnorm":
        x, weight = random(rng, (rows, features), dtype), random(rng, (features,), dtype)
        got = ops.rmsnorm(place("x", x), place("weight", weight), 1e-5, out=out)
        assert_within_ulps(to_host(backend, got, dtype), reference.rmsnorm(x, weight, 1e-5),
                           fp32_error_ulps(dtype, features / 2 + 15), what)
    elif op in ("silu_mul", "add"):
        names = ("gate", "up") if op == "silu_mul" else ("a", "b")
        a, b = random(rng, (rows, features), dtype, scale=4.0), random(rng, (rows, features), dtype)
        got = getattr(ops, op)(place(names[0], a), place(names[1], b), out=out)
        ulps = fp32_error_ulps(dtype, 7) if op == "silu_mul" else 1
        assert_within_ulps(to_host(backend, got, dtype), getattr(reference, op)(a, b), ulps, what)
    else:
        logits, winners = logits_with_unique_max(rng, rows, features, dtype)
        got = ops.argmax(place("logits", logits))
        assert to_host(backend, got).tolist() == winners.tolist(), what
    assert argument != "out" or got is out


MISALIGNED_ARGUMENTS = [("linear", "x"), ("linear", "weight"), ("linear", "out"), ("embedding", "table"),
                        ("embedding", "out"), ("rmsnorm", "x"), ("rmsnorm", "weight"), ("rmsnorm", "out"),
                        ("silu_mul", "gate"), ("silu_mul", "up"), ("silu_mul", "out"), ("add", "a"),
                        ("add", "b"), ("add", "out"), ("argmax", "logits")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, argument", MISALIGNED_ARGUMENTS, ids=[f"{o}-{a}" for o, a in MISALIGNED_ARGUMENTS])
def test_each_argument_alone_misaligned_gives_the_reference_result(backend, dtype, op, argument):
    """One argument a contiguous view one element past a 16-byte boundary, the others aligned:
    the kernel must see it and keep to loads and stores that address allows (a GPU ends the
    launch on a misaligned 16-byte access, and so does the emulator), and match the reference."""
    run_with_one_misaligned(backend, dtype, op, argument)


def test_linear_is_exported():
    assert cupykv.linear is ops.linear and "linear" in cupykv.__all__


# -- embedding -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), rows=st.sampled_from(ROWS), vocab=st.sampled_from((1, 5, 130)),
       hidden=st.sampled_from(IN_FEATURES), bad=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_embedding_copies_rows_bit_for_bit(backend, dtype, rows, vocab, hidden, bad, seed):
    rng = np.random.default_rng(seed)
    table = random(rng, (vocab, hidden), dtype)
    table.flat[rng.integers(table.size)] = np.nan   # a NaN and a -0 travel unchanged
    table.flat[rng.integers(table.size)] = -0.0
    ids = rng.integers(0, vocab, size=rows).astype(np.int32)
    if bad:
        ids[rng.integers(rows)] = rng.choice([-1, vocab, 2**31 - 1, -(2**31)])
    flag, want_flag = device(backend, np.zeros(1, np.int32)), np.zeros(1, np.int32)
    out = device(backend, np.full((rows, hidden), 7, NP_DTYPES[dtype]))   # bad rows must become zeros
    got = ops.embedding(device(backend, ids), device(backend, table), out=out, error_flag=flag)
    want = reference.embedding(ids, table, error_flag=want_flag)
    assert got is out
    np.testing.assert_array_equal(to_host(backend, got, dtype).view(f"u{table.itemsize}"),
                                  want.view(f"u{table.itemsize}"))
    assert to_host(backend, flag).tolist() == want_flag.tolist() == [int(bad)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threads", [1, 3, 1024])
@pytest.mark.parametrize("dtype, hidden", [("float32", 12), ("bfloat16", 24), ("bfloat16", 13)])
def test_embedding_takes_any_block_size(backend, threads, dtype, hidden, monkeypatch):
    """embedding.cu takes any block size (the host launches 128): one thread copies a whole row and sets
    the flag, 3 stride unevenly over its 16-byte words (12 float32, 24 bfloat16) or its elements (13),
    1024 leave most threads idle."""
    monkeypatch.setattr(ops, "EMBEDDING_THREADS", threads)
    rng = np.random.default_rng(threads + hidden)
    table = random(rng, (5, hidden), dtype)
    ids = np.array([4, -1, 0, 5, 2], np.int32)
    flag, want_flag = device(backend, np.zeros(1, np.int32)), np.zeros(1, np.int32)
    out = device(backend, np.full((5, hidden), 7, NP_DTYPES[dtype]))
    got = ops.embedding(device(backend, ids), device(backend, table), out=out, error_flag=flag)
    want = reference.embedding(ids, table, error_flag=want_flag)
    np.testing.assert_array_equal(to_host(backend, got, dtype).view(f"u{table.itemsize}"),
                                  want.view(f"u{table.itemsize}"))
    assert to_host(backend, flag).tolist() == want_flag.tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_flag_is_sticky(backend):
    table = device(backend, np.arange(12, dtype=np.float32).reshape(3, 4))
    flag = device(backend, np.zeros(1, np.int32))
    ops.embedding(device(backend, np.array([5], np.int32)), table, error_flag=flag)
    ops.embedding(device(backend, np.array([1], np.int32)), table, error_flag=flag)
    assert to_host(backend, flag).tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_without_an_error_flag_still_gives_zero_rows_for_bad_ids(backend):
    """Without ``error_flag`` the call allocates a scratch flag for the kernel to set: a bad id shows only
    as a row of zeros, and the good rows are copied as with a flag."""
    table = np.arange(12, dtype=np.float32).reshape(3, 4) + 1   # no zero anywhere
    ids = np.array([1, -1, 3, 0, 2**31 - 1, 2], np.int32)
    got = to_host(backend, ops.embedding(device(backend, ids), device(backend, table)))
    np.testing.assert_array_equal(got, reference.embedding(ids, table))
    assert np.all(got[[1, 2, 4]] == 0) and np.all(got[[0, 3, 5]] != 0)


# -- rmsnorm -----------------------------------------------------------------------
def run_rmsnorm(backend, dtype, rows, hidden, eps, seed, in_place=False):
    rng = np.random.default_rng(seed)
    x, weight = random(rng, (rows, hidden), dtype, scale=rng.choice([0.01, 1.0, 30.0])), random(rng, (hidden,), dtype)
    x_device = device(backend, x)
    got = ops.rmsnorm(x_device, device(backend, weight), eps, out=x_device if in_place else None)
    assert not in_place or got is x_device
    assert_within_ulps(to_host(backend, got, dtype), reference.rmsnorm(x, weight, eps),
                       fp32_error_ulps(dtype, hidden / 2 + 15), f"rmsnorm ({dtype}, rows {rows}, hidden {hidden})")


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), rows=st.sampled_from(ROWS), hidden=st.sampled_from(IN_FEATURES),
       eps=st.sampled_from((1e-6, 1e-5, 0.5)), seed=st.integers(0, 2**32 - 1), in_place=st.booleans())
def test_rmsnorm_matches_reference(backend, dtype, rows, hidden, eps, seed, in_place):
    run_rmsnorm(backend, dtype, rows, hidden, eps, seed, in_place)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [4096, 4099])
def test_rmsnorm_large(backend, dtype, hidden):
    run_rmsnorm(backend, dtype, 3, hidden, 1e-5, seed=hidden)


def rounded_once_where_clear(got, exact, dtype, relative_error, what):
    """16-bit storage: ``got`` equals ``exact`` (float64) rounded once to ``dtype``, bit for bit, wherever
    ``exact`` lies farther than ``relative_error * |exact|`` (the kernel's fp32 error) from the rounding
    boundary on its side, the midpoint between its rounding and the next value toward it. Within
    that margin the fp32 result may cross the boundary. Returns (the mask of those elements, the rounding)."""
    want = round_to_storage(exact, NP_DTYPES[dtype])
    magnitude = np.abs(want.astype(np.float64))
    bits = want.view(np.uint16) & np.uint16(0x7FFF)
    toward_bits = np.where(np.abs(exact) >= magnitude, bits + 1, np.maximum(bits, 1) - 1).astype(np.uint16)
    toward = np.abs(toward_bits.view(NP_DTYPES[dtype]).astype(np.float64))
    boundary = (magnitude + toward) / 2
    clear = (np.abs(np.abs(exact) - boundary) > relative_error * np.abs(exact)) & (magnitude > 0) & np.isfinite(toward)
    wrong = clear & (got.view(np.uint16) != want.view(np.uint16))
    assert not wrong.any(), (f"{what}: {int(wrong.sum())} of {int(clear.sum())} results not rounded once, first at "
                             f"{np.argwhere(wrong)[0].tolist()}")
    return clear, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hidden", [256, 251])   # 16-byte vectors, single elements
def test_rmsnorm_rounds_once_as_the_contract_says(backend, dtype, hidden):
    # For 16-bit storage the fp32 error is a small fraction of an ulp, so the result must be the exact
    # x * inv_rms * weight rounded once, except within that error of a rounding boundary. Rounding
    # x * inv_rms to the storage type first (Hugging Face's order) stays within the 1 ulp of
    # test_rmsnorm_matches_reference but fails here; the data is checked to hold such elements.
    rng = np.random.default_rng(hidden)
    x, weight = random(rng, (4, hidden), dtype), random(rng, (hidden,), dtype, scale=2.0)
    got = to_host(backend, ops.rmsnorm(device(backend, x), device(backend, weight), 1e-5), dtype)
    x64, w64 = x.astype(np.float64), weight.astype(np.float64)
    inv_rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float32(1e-5))
    clear, want = rounded_once_where_clear(got, x64 * inv_rms * w64, dtype, (hidden / 2 + 15) * U32,
                                           f"rmsnorm ({dtype}, hidden {hidden})")
    twice = round_to_storage(round_to_storage(x64 * inv_rms, NP_DTYPES[dtype]).astype(np.float64) * w64, NP_DTYPES[dtype])
    assert (clear & (twice.view(np.uint16) != want.view(np.uint16))).sum() >= 10


# -- silu_mul and add ------------------------------------------------------------------
ELEMENTWISE_SHAPES = st.tuples(st.sampled_from(ROWS), st.sampled_from(IN_FEATURES)) | \
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), shape=ELEMENTWISE_SHAPES, seed=st.integers(0, 2**32 - 1),
       in_place=st.sampled_from((None, 0, 1)))
def test_silu_mul_matches_reference(backend, dtype, shape, seed, in_place):
    rng = np.random.default_rng(seed)
    gate, up = random(rng, shape, dtype, scale=4.0), random(rng, shape, dtype)
    args = [device(backend, gate), device(backend, up)]
    got = ops.silu_mul(*args, out=None if in_place is None else args[in_place])
    assert in_place is None or got is args[in_place]
    assert_within_ulps(to_host(backend, got, dtype), reference.silu_mul(gate, up), fp32_error_ulps(dtype, 7),
                       f"silu_mul ({dtype}, shape {shape})")


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), shape=ELEMENTWISE_SHAPES, seed=st.integers(0, 2**32 - 1),
       in_place=st.sampled_from((None, 0, 1)))
def test_add_matches_reference(backend, dtype, shape, seed, in_place):
    rng = np.random.default_rng(seed)
    a, b = random(rng, shape, dtype), random(rng, shape, dtype, scale=rng.choice([1e-3, 1.0, 1e3]))
    args = [device(backend, a), device(backend, b)]
    got = ops.add(*args, out=None if in_place is None else args[in_place])
    assert in_place is None or got is args[in_place]
    assert_within_ulps(to_host(backend, got, dtype), reference.add(a, b), 1, f"add ({dtype}, shape {shape})")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_large(backend, dtype):
    rng = np.random.default_rng(0)
    a, b = random(rng, (4, 14336), dtype, scale=4.0), random(rng, (4, 14336), dtype)
    assert_within_ulps(to_host(backend, ops.add(device(backend, a), device(backend, b)), dtype),
                       reference.add(a, b), 1, "add")
    assert_within_ulps(to_host(backend, ops.silu_mul(device(backend, a), device(backend, b)), dtype),
                       reference.silu_mul(a, b), fp32_error_ulps(dtype, 7), "silu_mul")


# -- argmax -------------------------------------------------------------------------------
def logits_with_unique_max(rng, rows, vocab, dtype):
    """Logits in [-8, 8] with one element per row raised to 16: a unique maximum in any dtype."""
    logits = np.clip(rng.standard_normal((rows, vocab)) * 3, -8, 8)
    winners = rng.integers(0, vocab, size=rows)
    logits[np.arange(rows), winners] = 16.0
    return logits.astype(NP_DTYPES[dtype]), winners.astype(np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), rows=st.sampled_from(ROWS),
       vocab=st.sampled_from(IN_FEATURES + (1000,)), seed=st.integers(0, 2**32 - 1))
def test_argmax_finds_the_unique_maximum(backend, dtype, rows, vocab, seed):
    logits, winners = logits_with_unique_max(np.random.default_rng(seed), rows, vocab, dtype)
    out = device(backend, np.full(rows, -5, np.int32))
    got = ops.argmax(device(backend, logits), out=out)
    assert got is out
    assert to_host(backend, got).tolist() == reference.argmax(logits).tolist() == winners.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 128257])
def test_argmax_large_vocab_and_ties(backend, dtype, vocab):
    rng = np.random.default_rng(vocab)
    logits, winners = logits_with_unique_max(rng, 5, vocab, dtype)
    ninf = np.array(-np.inf, NP_DTYPES[dtype])
    logits[1, [vocab - 1, 7, vocab // 2]] = 20.0   # a tie: the lowest index wins
    logits[4, [18, 17]] = 20.0                   # a tie inside one thread's 16-byte load, not its first
    logits[2] = ninf                             # nothing but -inf: index 0
    logits[3] = np.array(np.nan, NP_DTYPES[dtype])   # nothing but NaN (the first NaN wins): index 0,
    got = to_host(backend, ops.argmax(device(backend, logits)))   # a token id, never one past the vocab
    assert got.tolist() == reference.argmax(logits).tolist() == [winners[0], 7, 0, 0, 17]


@pytest.mark.parametrize("backend", BACKENDS)
@given(dtype=st.sampled_from(DTYPES), vocab=st.sampled_from((40, 1000, 4096, 32000)),
       n_nans=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_argmax_ranks_nan_above_every_number_as_numpy_does(backend, dtype, vocab, n_nans, seed):
    """A row holding NaN gives its first NaN, wherever the NaN lies against the row's largest number
    (another thread's elements, another warp's, the same vector): a corrupted row shows, as in NumPy."""
    rng = np.random.default_rng(seed)
    logits, winners = logits_with_unique_max(rng, 4, vocab, dtype)
    nan = np.array(np.nan, NP_DTYPES[dtype])
    logits[0, rng.choice(vocab, n_nans, replace=False)] = nan        # anywhere
    logits[1, vocab - 1] = nan                                       # the last element, after the maximum
    logits[2, [winners[2], (winners[2] + 1) % vocab]] = [np.inf, nan]  # inf does not beat NaN
    # row 3 keeps no NaN: its unique maximum
    firsts = [int(np.flatnonzero(np.isnan(logits[r].astype(np.float32)))[0]) for r in range(3)]
    got = to_host(backend, ops.argmax(device(backend, logits)))
    assert got.tolist() == reference.argmax(logits).tolist() == np.argmax(logits, axis=-1).tolist() \
        == firsts + [winners[3]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["argmax", "rmsnorm"])
@pytest.mark.parametrize("width", [4096, 4095], ids=["vectors", "elements"])
def test_argmax_and_rmsnorm_run_the_largest_block_their_kernels_take(backend, op, width, monkeypatch):
    """argmax.cu and rmsnorm.cu take blocks of up to 1024 threads (the host launches at most 512 and
    256 today), and keep one shared slot per warp, 32 of them: at 1024 threads the last warp (threads
    992-1023) holds argmax's winner in row 0 (element ``width - 1``: thread 1023's last vector, or
    thread 1022's last element) and a share of every row's sum of squares in rmsnorm."""
    monkeypatch.setattr(ops, "ARGMAX_MAX_THREADS", 1024)
    monkeypatch.setattr(ops, "RMSNORM_MAX_THREADS", 1024)
    if op == "rmsnorm":
        run_rmsnorm(backend, "float32", 2, width, 1e-5, seed=width)
        return
    logits, _ = logits_with_unique_max(np.random.default_rng(width), 2, width, "float32")
    logits[0, width - 1] = 20.0
    got = to_host(backend, ops.argmax(device(backend, logits)))
    assert got.tolist() == reference.argmax(logits).tolist() == [width - 1, int(np.argmax(logits[1]))]


# -- a captured greedy decode loop -------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_replays_in_a_captured_step_reading_token_ids_on_the_device(backend):
    # embedding -> rmsnorm -> silu_mul -> add -> linear -> argmax, whose ids the next replay embeds
    rng = np.random.default_rng(0)
    vocab, hidden, eps = 40, 24, 1e-5
    table, head = random(rng, (vocab, hidden), "float32"), random(rng, (vocab, hidden), "float32")
    norm = random(rng, (hidden,), "float32")
    zeros = get_backend(backend).zeros
    table_d, norm_d, head_d = device(backend, table), device(backend, norm), device(backend, head)
    ids = device(backend, np.array([3, 11], np.int32))
    hidden_d, normed, mixed = (zeros((2, hidden), np.float32) for _ in range(3))
    logits, flag = zeros((2, vocab), np.float32), zeros((1,), np.int32)

    def step():
        ops.embedding(ids, table_d, out=hidden_d, error_flag=flag)
        ops.rmsnorm(hidden_d, norm_d, eps, out=normed)
        ops.silu_mul(normed, hidden_d, out=mixed)
        ops.add(hidden_d, mixed, out=hidden_d)
        ops.linear(hidden_d, head_d, out=logits)
        ops.argmax(logits, out=ids)

    def reference_step(token_ids):
        h = reference.embedding(token_ids, table)
        h = reference.add(h, reference.silu_mul(reference.rmsnorm(h, norm, eps), h))
        return reference.argmax(reference.linear(h, head))

    graph = cupykv.capture(step)   # runs one real step first
    want = reference_step(np.array([3, 11], np.int32))
    assert graph.num_launches == 6 and to_host(backend, ids).tolist() == want.tolist()
    seen = set()
    for _ in range(4):
        graph.replay()
        want = reference_step(want)
        got = to_host(backend, ids)
        assert got.tolist() == want.tolist()
        seen.add(tuple(got.tolist()))
    assert len(seen) > 1 and to_host(backend, flag).tolist() == [0]   # the ids did change between replays


# -- bad inputs ------------------------------------------------------------------------
def _emulator_arrays(**arrays):
    backend = get_backend("emulator")
    return {name: backend.asarray(value) for name, value in arrays.items()}


F32, F16 = np.float32, np.float16
IN_PLACE = " the very array given as"
APART = " an array that does not overlap"
BAD_CALLS = [
    # (call, error type, argument named in the message[, what the message says it expected])
    (lambda a: ops.linear(a["x64"], a["w"]), TypeError, "x"),
    (lambda a: ops.linear([[1.0]], a["w"]), TypeError, "x"),
    (lambda a: ops.linear(a["x"], a["w16"]), TypeError, "weight"),
    (lambda a: ops.linear(a["x"], a["w_in5"]), ValueError, "weight"),
    (lambda a: ops.linear(a["x"][0], a["w"]), ValueError, "x"),
    (lambda a: ops.linear(a["w"].T, a["w"]), ValueError, "x"),            # transposed: not contiguous
    (lambda a: ops.linear(a["x"], a["w"].T), ValueError, "weight"),
    (lambda a: ops.linear(a["x"], a["w"], out=a["w"]), ValueError, "out"),  # wrong shape
    (lambda a: ops.linear(a["x"], a["w"], out=a["y16"]), TypeError, "out"),
    (lambda a: ops.linear(a["sq"], a["sq"], out=a["sq"]), ValueError, "out"),  # overlaps x
    (lambda a: ops.embedding(a["ids64"], a["w"]), TypeError, "ids"),
    (lambda a: ops.embedding(a["ids"], a["ids"]), TypeError, "table"),
    (lambda a: ops.embedding(a["ids"], a["w"], error_flag=a["ids"]), ValueError, "error_flag"),
    (lambda a: ops.embedding(a["ids"], a["w"], out=a["w"]), ValueError, "out"),
    (lambda a: ops.rmsnorm(a["x"], a["w"], 1e-5), ValueError, "weight"),
    (lambda a: ops.rmsnorm(a["x"], a["x"][0], 0.0), ValueError, "eps"),
    (lambda a: ops.rmsnorm(a["x"], a["x"][0], "1e-5"), TypeError, "eps"),
    (lambda a: ops.silu_mul(a["x"], a["w"]), ValueError, "up"),
    (lambda a: ops.silu_mul(a["x64"], a["x64"]), TypeError, "gate"),
    (lambda a: ops.add(a["x"], a["y16"]), TypeError, "b"),
    (lambda a: ops.add(a["x"], a["x"], out=a["w"]), ValueError, "out"),
    (lambda a: ops.argmax(a["x"], out=a["ids64"]), TypeError, "out"),
    (lambda a: ops.argmax(a["x"], out=a["ids"][:1]), ValueError, "out"),
    (lambda a: ops.argmax(a["ids"]), TypeError, "logits"),
    # issue 17: scalars the kernel's float32 does not hold, strided views, read-only and aliased outputs
    (lambda a: ops.rmsnorm(a["x"], a["x"][0], 1e-50), ValueError, "eps", " a float in 1.1754944e-38"),  # 0 in float32
    (lambda a: ops.rmsnorm(a["x"], a["x"][0], np.float64(1e39)), ValueError, "eps", " a float in"),
    (lambda a: ops.add(a["x"][:, ::-1], a["x"]), ValueError, "a", " a C-contiguous array, got strides \\(24, -4\\)"),
    (lambda a: ops.linear(a["x"], a["w"][::2]), ValueError, "weight", " a C-contiguous"),
    (lambda a: ops.embedding(a["buf"][:4].view(np.int32)[::2], a["w"]), ValueError, "ids", " a C-contiguous"),
    (lambda a: ops.add(a["x"], a["x"], out=read_only(a["y"])), ValueError, "out", " a writeable array"),
    (lambda a: ops.argmax(a["x"], out=read_only(a["ids"])), ValueError, "out", " a writeable array"),
    (lambda a: ops.embedding(a["ids"], a["w"], error_flag=read_only(a["flag"])), ValueError, "error_flag",
     " a writeable"),
    (lambda a: ops.add(*shifted(a["buf"], (2, 6), 0, 0), out=shifted(a["buf"], (2, 6), 1)[0]), ValueError, "out",
     IN_PLACE),
    (lambda a: ops.add(a["x"], shifted(a["buf"], (2, 6), 0)[0], out=shifted(a["buf"], (2, 6), 1)[0]), ValueError, "out",
     IN_PLACE + " b"),
    (lambda a: ops.silu_mul(*shifted(a["buf"], (2, 6), 1, 0), out=shifted(a["buf"], (2, 6), 2)[0]), ValueError, "out",
     IN_PLACE + " gate"),
    (lambda a: ops.rmsnorm(shifted(a["buf"], (2, 6), 0)[0], a["w"][0], 1e-5, out=shifted(a["buf"], (2, 6), 1)[0]),
     ValueError, "out", IN_PLACE + " x"),
    (lambda a: ops.rmsnorm(a["y"], shifted(a["buf"], (6,), 0)[0], 1e-5, out=shifted(a["buf"], (2, 6), 3)[0]),
     ValueError, "out", APART + " weight"),
    (lambda a: ops.linear(shifted(a["buf"], (2, 6), 0)[0], a["w"], out=shifted(a["buf"], (2, 3), 5)[0]),
     ValueError, "out", APART + " x"),
    (lambda a: ops.embedding(a["buf"][:2].view(np.int32), a["w"], out=shifted(a["buf"], (2, 6), 1)[0]),
     ValueError, "out", APART + " ids"),
    (lambda a: ops.embedding(a["ids"], a["w"], error_flag=a["ids"][:1]), ValueError, "error_flag", APART + " ids"),
    (lambda a: ops.embedding(a["ids"], a["w"], error_flag=a["flags"]), ValueError, "error_flag",
     r" shape \(1,\), got \(2,\)$"),
    (lambda a: ops.embedding(a["ids"], a["w"], error_flag=a["flags"].reshape(1, 2)[:, :1]), ValueError, "error_flag",
     r" shape \(1,\), got \(1, 1\)$"),
    (lambda a: ops.argmax(a["x"], out=a["x"].reshape(-1)[:2].view(np.int32)), ValueError, "out", APART + " logits"),
    (lambda a: ops.add(a["scalar"], a["scalar"]), ValueError, "a",
     r" an array of rank >= 1 with every size >= 1, got shape \(\)$"),
    (lambda a: ops.silu_mul(a["empty"], a["empty"]), ValueError, "gate",
     r" an array of rank >= 1 with every size >= 1, got shape \(2, 0\)$"),
]


def read_only(array):
    """``array``, its writeable flag cleared (host and emulator arrays: CuPy's have none)."""
    array.flags.writeable = False
    return array


def shifted(buffer, shape, *offsets):
    """Views of ``shape`` into one flat buffer, starting ``offsets`` elements in: overlapping neighbours."""
    size = math.prod(shape)
    return [buffer[offset : offset + size].reshape(shape) for offset in offsets]


@pytest.mark.parametrize("call, error, name, expected", [(*case, "")[:4] for case in BAD_CALLS],
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_inputs_are_rejected_naming_the_argument_and_write_nothing(call, error, name, expected):
    arrays = _emulator_arrays(
        x=np.ones((2, 6), F32), x64=np.ones((2, 6)), w=np.ones((3, 6), F32), w16=np.ones((3, 6), F16),
        w_in5=np.ones((3, 5), F32), y16=np.ones((2, 6), F16), sq=np.ones((4, 4), F32), y=np.ones((2, 6), F32),
        ids=np.zeros(2, np.int32), ids64=np.zeros(2, np.int64), flag=np.zeros(1, np.int32),
        flags=np.zeros(2, np.int32),
        buf=np.arange(20, dtype=F32), scalar=np.ones((), F32), empty=np.ones((2, 0), F32))
    before = {key: value.copy() for key, value in arrays.items()}
    with pytest.raises(error, match=rf"^{name}: expected{expected}"):
        call(arrays)
    for key, value in arrays.items():
        assert np.array_equal(value, before[key], equal_nan=True), f"a refused call wrote into {key}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["add", "silu_mul"])
def test_an_output_one_element_past_an_input_is_refused_but_the_input_itself_is_in_place(backend, op):
    # before issue 17, out = a shifted by one element gave wrong values: each block read what another had written
    buffer = device(backend, np.arange(1, 34, dtype=np.float32))
    a, out = buffer[:32].reshape(4, 8), buffer[1:].reshape(4, 8)
    b = device(backend, np.full((4, 8), 0.5, np.float32))
    with pytest.raises(ValueError, match=r"^out: expected the very array given as (a|gate) \(in place\) or one that "
                                         r"does not overlap it, got one that shares 124 bytes with it$"):
        getattr(ops, op)(a, b, out=out)
    assert to_host(backend, buffer).tolist() == list(range(1, 34))
    want = getattr(reference, op)(to_host(backend, a), to_host(backend, b))
    assert getattr(ops, op)(a, b, out=a) is a
    assert_within_ulps(to_host(backend, a), want, fp32_error_ulps("float32", 7), f"{op} in place")


def _launch_geometry(call, *arrays):
    """``(grid, block)`` of the one launch ``call`` makes with host ``arrays`` copied to the emulator."""
    backend = get_backend("emulator")
    on_device = [backend.asarray(a) for a in arrays]
    with recording_launch_records() as records:
        call(*on_device)
    (record,) = records
    return record.grid, record.block


@pytest.mark.parametrize("name, call, shapes, grid, block", [
    # one block per row, a warp per 32 elements of the row, up to 256 (rmsnorm) or 512 (argmax) threads
    ("rmsnorm 32", lambda x, w: ops.rmsnorm(x, w, 1e-6), [(3, 32), (32,)], (3,), (32,)),
    ("rmsnorm 33", lambda x, w: ops.rmsnorm(x, w, 1e-6), [(3, 33), (33,)], (3,), (64,)),
    ("rmsnorm 4096", lambda x, w: ops.rmsnorm(x, w, 1e-6), [(2, 4096), (4096,)], (2,), (256,)),
    ("argmax 33", lambda x: ops.argmax(x), [(5, 33)], (5,), (64,)),
    ("argmax 480", lambda x: ops.argmax(x), [(1, 480)], (1,), (480,)),
    ("argmax 32000", lambda x: ops.argmax(x), [(2, 32000)], (2,), (512,)),
    # elementwise: a thread per 16-byte pack (4 floats) rounded up to a warp, up to 256, then blocks of
    # 256 up to 1024 (a grid-stride loop covers the rest)
    ("add 8", lambda a, b: ops.add(a, b), [(8,), (8,)], (1,), (32,)),
    ("add 33 packs", lambda a, b: ops.add(a, b), [(3, 44), (3, 44)], (1,), (64,)),
    ("silu_mul 257 packs", lambda a, b: ops.silu_mul(a, b), [(1028,), (1028,)], (2,), (256,)),
    ("add past 1024 blocks", lambda a, b: ops.add(a, b), [(1025 * 1024,), (1025 * 1024,)], (1024,), (256,)),
], ids=lambda case: case if isinstance(case, str) else "")
def test_the_small_ops_launch_the_geometry_their_kernel_headers_give(name, call, shapes, grid, block):
    arrays = [np.ones(shape, np.float32) for shape in shapes]
    assert _launch_geometry(call, *arrays) == (grid, block)


def test_embedding_launches_a_block_of_128_threads_per_row():
    ids, table = np.array([2, 0, 1], np.int32), np.ones((4, 40), np.float32)
    assert _launch_geometry(lambda i, t: ops.embedding(i, t), ids, table) == ((3,), (128,))


LINEAR_GRIDS = [
    # CUDA cores (kernels/linear.cu's header): 4 warps of 2 outputs; below 16384 outputs two warps
    # split in_features for each pair (4 outputs a block), from 16384 on one warp has it (8 a block)
    ("float32", 1, 64, (1,), (128,)),
    ("float32", 5, 64, (2,), (128,)),
    ("float32", 16383, 4, (4096,), (128,)),
    ("float32", 16384, 4, (2048,), (128,)),
    ("float32", 16385, 4, (2049,), (128,)),
    ("bfloat16", 7, 100, (2,), (128,)),      # in_features not a multiple of 8: CUDA cores
    # tensor cores (kernels/linear_mma.cu): 8 warps of 8 outputs, the split_k warps of a group
    # sharing its 8: 64 / split_k outputs a block (split_k from the 32-feature steps, see
    # test_linear_mma.py: 2 steps no split, 8 steps 2 ways, 16 steps 4, 32 and 128 steps 8)
    ("bfloat16", 65, 64, (2,), (256,)),
    ("float16", 33, 256, (2,), (256,)),
    ("bfloat16", 17, 512, (2,), (256,)),
    ("bfloat16", 9, 1024, (2,), (256,)),
    ("bfloat16", 1024, 4096, (128,), (256,)),   # an 8B LLaMA's k and v projections
]


@pytest.mark.parametrize("dtype, out_features, in_features, grid, block", LINEAR_GRIDS,
                         ids=[f"{dtype}-out{o}-in{i}" for dtype, o, i, _, _ in LINEAR_GRIDS])
def test_linear_launches_only_the_blocks_its_outputs_need(recorded_launches, dtype, out_features, in_features,
                                                          grid, block):
    # a block past the last output runs no multiply and writes nothing, so only the geometry shows
    # one (a doubled grid costs launch and scheduling time, never a wrong value)
    backend = get_backend("emulator")
    weight = backend.zeros((out_features, in_features), NP_DTYPES[dtype])
    for rows in (1, 17):   # the grid depends on the weight's shape alone
        ops.linear(backend.zeros((rows, in_features), NP_DTYPES[dtype]), weight)
    assert [(g, b) for _, g, b, _ in recorded_launches] == [(grid, block)] * 2


def test_the_reference_ops_refuse_a_dtype_they_do_not_store():
    x32, x16 = np.ones((2, 4), np.float32), np.ones((2, 4), np.float16)
    with pytest.raises(TypeError, match=r"^x: expected dtype float32, float16 or bfloat16, got float64$"):
        reference.linear(np.ones((2, 4)), x32)
    with pytest.raises(TypeError, match=r"^weight: expected dtype float32, got float16$"):
        reference.linear(x32, x16)
    with pytest.raises(TypeError, match=r"^b: expected dtype float16, got float32$"):
        reference.add(x16, x32)
    assert reference.add(x16, x16).dtype == np.float16
