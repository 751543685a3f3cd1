"""fp32 subnormals: the emulator flushes them as the GPU does under CuPy's ``-ftz=true``.

CuPy compiles every RawModule with ``-ftz=true``, so fp32 arithmetic on the GPU
treats subnormal inputs as zero and flushes subnormal results to zero (sign
kept). The emulator runs kernels with x86's denormals-are-zero and
flush-to-zero set, and restores the host's settings when a launch ends, even
one that faults, so NumPy on the host keeps its subnormals.
"""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cupykv
from cupykv import fp8, ops, reference, testing
from cupykv.ftz import flush_float32_subnormals
from cupykv.rope import rope_angles
from cupykv.backends import emulator as E
from cupykv.backends import get_backend
from backends import BACKENDS
BUGS = Path(__file__).parent / "emulator_kernels" / "bugs.cu"
SUBNORMAL = np.float32(1e-39)


def assert_host_keeps_subnormals():
    assert np.float32(SUBNORMAL) * np.float32(1.0) == SUBNORMAL != 0
    assert np.add(np.array([SUBNORMAL]), np.float32(0))[0] == SUBNORMAL


def _add(a, b, backend):
    device = get_backend(backend)
    return device.to_host(ops.add(device.asarray(a), device.asarray(b), backend=backend))


def test_fp32_subnormal_inputs_are_read_as_zero():
    # 2e-38 is normal, -1e-38 subnormal: with the input flushed the sum is 2e-38 exactly,
    # where IEEE arithmetic gives 1e-38 (itself subnormal, so flushing only the result gives 0).
    # -subnormal + -0 is -0: the flushed input keeps its sign (and -0 + +0 would be +0).
    a = np.array([2e-38, SUBNORMAL, -SUBNORMAL, 1.0], np.float32)
    b = np.array([-1e-38, 0.0, -0.0, SUBNORMAL], np.float32)
    got = _add(a, b, "emulator")
    assert got.tobytes() == np.array([2e-38, 0.0, -0.0, 1.0], np.float32).tobytes()


def test_fp32_subnormal_results_are_flushed_with_their_sign():
    # Both inputs are normal; their difference is subnormal.
    a = np.array([1.5e-38, -1.5e-38], np.float32)
    b = np.array([-1.2e-38, 1.2e-38], np.float32)
    assert abs(float(a[0]) + float(b[0])) < np.finfo(np.float32).tiny   # the exact result is subnormal
    got = _add(a, b, "emulator")
    assert got.tobytes() == np.array([0.0, -0.0], np.float32).tobytes()


def test_bfloat16_subnormals_are_kept_by_conversion_and_flushed_by_arithmetic():
    # bf16 has fp32's exponent range: 0x0001 is a bf16 subnormal. Converting it to fp32 is exact
    # (a bit shift on the GPU), but the fp32 add reads it as zero.
    bits = np.array([0x0001, 0x8001, 0x0080, 0x3F80], np.uint16)
    a = bits.view(ml_dtypes.bfloat16)
    b = np.array([0x0000, 0x8000, 0x0000, 0x0000], np.uint16).view(ml_dtypes.bfloat16)   # +0, -0, +0, +0
    got = _add(a, b, "emulator").view(np.uint16)
    assert got.tolist() == [0x0000, 0x8000, 0x0080, 0x3F80]


def test_the_host_keeps_subnormals_after_launches_and_after_a_fault():
    _add(np.full(4, SUBNORMAL, np.float32), np.zeros(4, np.float32), "emulator")
    assert_host_keeps_subnormals()
    bugs = E.Module(BUGS.read_text(), ["write_past_end"], filename=str(BUGS))
    with pytest.raises(E.EmulatorFault):
        bugs.get_function("write_past_end")((1,), (64,), (E.zeros(64, np.float32),))
    assert_host_keeps_subnormals()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_emulator_and_gpu_agree_bit_for_bit_on_subnormals(dtype):
    rng = np.random.default_rng(0)
    tiny = np.finfo(np.float32).tiny
    a = (rng.standard_normal(4096) * tiny * 4).astype(np.float32).astype(dtype)
    b = (rng.standard_normal(4096) * tiny * 4).astype(np.float32).astype(dtype)
    bits = np.uint32 if dtype == np.float32 else np.uint16
    on_gpu = _add(a, b, "cupy").view(bits)
    emulated = _add(a, b, "emulator").view(bits)
    assert np.array_equal(on_gpu, emulated), np.flatnonzero(on_gpu != emulated)[:10]


def _stored(values, spec, scale):
    """float64 ``values`` as a cache of ``spec`` stores them (rounded once, fp8 as codes), as float64."""
    if spec.quantized:
        return fp8.quantize_e4m3(values, scale).astype(np.float64)
    return reference.round_to_storage(values, spec.np_dtype).astype(np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, io_dtype", [("float32", None), ("bfloat16", None), ("float8_e4m3", "float32")])
def test_rope_reads_a_subnormal_key_as_zero_and_stores_a_subnormal_rotation_as_zero(backend, dtype, io_dtype):
    """The kernels rotate a key in double, widening each float32 element with cvt.ftz.f64.f32 and
    narrowing the result with cvt.rn.ftz.f32.f64 (CuPy's -ftz=true); the reference does the same.

    The row is stored at position 1 (angle 1 for the pair of dims 0 and 2, 0.01 for dims 1 and 3).
    Dim 0 is a float32 subnormal, read as 0: the pair stores (-y sin 1, y cos 1). Dims 1 and 3 are
    normal, but the rotated dim 1 (1.1 cos 0.01 - 30 sin 0.01, in units of float32's smallest
    normal) is subnormal: it is stored as 0. fp8 uses that smallest normal as its scale, so that
    both show as codes.
    """
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4, max_seq=2, batch=1, dtype=dtype, io_dtype=io_dtype)
    tiny = float(np.finfo(np.float32).tiny)
    scale = np.float32(tiny) if spec.quantized else np.float32(1.0)
    x, y = -0.5 * tiny, 3.0 * tiny
    keys = np.array([x, 1.1 * tiny, y, 30.0 * tiny]).astype(np.float32).astype(spec.io_np_dtype).reshape(1, 1, 1, 4)
    read = keys.astype(np.float64).ravel()
    assert 0 < abs(read[0]) < tiny and read[2] == y   # dim 0 is a float32 subnormal, as the docstring says
    rope = cupykv.Rope(theta=10000.0)
    cache, oracle = cupykv.KVCache(spec, backend=backend, k_scale=scale), reference.KVCache(spec, k_scale=scale)
    cache.set_lengths([1])
    oracle.set_lengths([1])
    cache.append(0, cache.to_device(keys), cache.to_device(keys), rope=rope)
    oracle.append(0, keys, keys, rope=rope)

    angles = rope_angles(np.array([1]), 4, rope.theta).ravel()     # [2]: the two pairs' angles at position 1

    def rotate(row):
        lo, hi = row[:2], row[2:]
        return np.concatenate([lo * np.cos(angles) - hi * np.sin(angles), hi * np.cos(angles) + lo * np.sin(angles)])
    flushed = read.copy()
    flushed[0] = -0.0
    want = _stored(flush_float32_subnormals(rotate(flushed)), spec, scale)
    unflushed = _stored(rotate(read), spec, scale)
    assert want[0] != unflushed[0] and want[2] != unflushed[2]   # the flushed input shows in its pair
    assert want[1] == 0 and want[3] != 0                          # and the flushed result
    assert spec.quantized or unflushed[1] != 0                    # (fp8's quantizer flushes it anyway)
    got = testing.to_numpy(cache.k, spec).astype(np.float64)[0, 0, 1, 0]
    assert got.tolist() == want.tolist() == oracle.k.astype(np.float64)[0, 0, 1, 0].tolist()


NARROW = "__global__ void narrow(const double* x, float* y) { y[threadIdx.x] = (float)x[threadIdx.x]; }"


def _narrow(values, backend):
    """float32 of each float64 in ``values`` as a kernel converts it under -ftz=true (cvt.rn.ftz.f32.f64)."""
    if backend == "emulator":
        fn = E.Module(NARROW, ["narrow"], filename="narrow.cu").get_function("narrow")
        x, y = E.asarray(values), E.zeros(len(values), np.float32)
        fn(1, len(values), (x, y))
        return np.asarray(y).copy()
    import cupy
    fn = cupy.RawModule(code=NARROW, options=("-std=c++17",), name_expressions=["narrow"]).get_function("narrow")
    x, y = cupy.asarray(values), cupy.zeros(len(values), cupy.float32)
    fn((1,), (len(values),), (x, y))
    return cupy.asnumpy(y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_host_flush_narrows_doubles_as_the_kernels_do(backend):
    """cupykv.ftz's float64 rule against a kernel's narrowing: near float32's smallest normal, a
    double that rounds up to it is kept, one whose 24-bit rounding stays below it (the midpoint under
    it included, though it rounds to even, up) is flushed, with its sign; elsewhere the plain cast."""
    tiny = float(np.finfo(np.float32).tiny)
    near = np.array([1 - 2.0**-40, 1 - 2.0**-25, 1 - 2.0**-24, 1 - 2.0**-23, 1 - 2.0**-20, 0.5, 1.0, 1 + 2.0**-24])
    values = np.concatenate([near * tiny, -near * tiny, [3.0, -2.5e-39, 0.0, -0.0, 1e-300]])
    got = _narrow(values, backend)
    want = flush_float32_subnormals(values).astype(np.float32)
    assert got.tobytes() == want.tobytes(), (got.tolist(), want.tolist())
    assert want[2] == 0 and np.signbit(want[10]) and want[10] == 0 and want[1] == np.float32(tiny)   # the cases named


def test_the_host_flush_keeps_float32_and_float64_and_takes_other_inputs_as_float64():
    tiny = float(np.finfo(np.float32).tiny)
    single = flush_float32_subnormals(np.array([tiny / 2, -tiny, 1.5], np.float32))
    assert single.dtype == np.float32 and single.tolist() == [0.0, -tiny, 1.5]
    double = flush_float32_subnormals(np.array([tiny / 4, tiny * (1 - 2.0**-30)]))
    assert double.dtype == np.float64 and double.tolist() == [0.0, tiny * (1 - 2.0**-30)]   # the second rounds up
    # a list, ints and float16 are read as float64 (float16's own subnormals are far above float32's)
    for other in ([tiny / 2, -3.0], np.array([-3, 0]), np.array([2.0**-20, -1.0], np.float16)):
        flushed = flush_float32_subnormals(other)
        assert flushed.dtype == np.float64
        np.testing.assert_array_equal(flushed, np.where(np.abs(np.asarray(other, np.float64)) < tiny, 0.0, other))
    assert np.signbit(flush_float32_subnormals([-tiny / 2])[0])
