"""bfloat16 operands: ml_dtypes.bfloat16 arrays and uint16 bit patterns are both accepted, on both backends.

Whatever form a bfloat16 operand comes in, it is viewed (never copied) as the
backend's storage dtype: uint16 on CuPy, ml_dtypes.bfloat16 on the emulator.
"""
import ml_dtypes
import numpy as np
import pytest

import cupykv
from cupykv import ops, testing
from cupykv._args import device_operand
from cupykv.backends import get_backend
from cupykv.backends.base import Backend
from backends import BACKENDS

BF16 = np.dtype(ml_dtypes.bfloat16)

# How a caller may hand over bfloat16 data that is already on the device.
BF16_FORMS = {
    "ml_dtypes.bfloat16": lambda backend, host: backend.asarray(host.view(np.uint16)).view(BF16),
    "uint16 bit patterns": lambda backend, host: backend.asarray(host.view(np.uint16)),
}


def run_every_bfloat16_op(backend_name, form):
    """Run every op that takes bfloat16 data, each bfloat16 operand and output given as ``form`` makes it.

    Returns the bits of every result, by op name.
    """
    backend = get_backend(backend_name)
    rng = np.random.default_rng(0)

    def given(host):
        return form(backend, host)

    def values(*shape):
        return given(rng.standard_normal(shape).astype(BF16))

    def out(*shape):
        return given(np.zeros(shape, BF16))

    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=16, max_seq=8, batch=2, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend=backend_name)
    cache.append(0, values(2, 3, 2, 16), values(2, 3, 2, 16))     # k, v: [batch, n_new, n_kv_heads, head_dim]
    cache.advance(3)
    x = values(3, 16)                                             # [rows, hidden]
    results = {
        "attention": cupykv.attention(values(2, 1, 4, 16), cache, 0, out=out(2, 1, 4, 16)),
        "append": cache.k,
        "linear": ops.linear(x, values(8, 16), out=out(3, 8)),
        "rmsnorm": ops.rmsnorm(x, values(16), 1e-6, out=out(3, 16)),
        "add": ops.add(x, values(3, 16), out=out(3, 16)),
        "silu_mul": ops.silu_mul(x, values(3, 16), out=out(3, 16)),
        "embedding": ops.embedding(backend.asarray(np.array([1, 0, 5], np.int32)), values(8, 16), out=out(3, 16)),
        "argmax": ops.argmax(values(3, 50)),
    }
    return {name: testing.bits(np.asarray(backend.to_host(array))) for name, array in results.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_and_uint16_inputs_give_bit_identical_results_in_every_op(backend):
    as_bfloat16 = run_every_bfloat16_op(backend, BF16_FORMS["ml_dtypes.bfloat16"])
    as_bits = run_every_bfloat16_op(backend, BF16_FORMS["uint16 bit patterns"])
    assert as_bfloat16.keys() == as_bits.keys()
    for name in as_bfloat16:
        assert np.array_equal(as_bfloat16[name], as_bits[name]), f"{name}: results differ between input forms"
        if name != "argmax":
            assert as_bits[name].any(), f"{name}: an all-zero result compares nothing"


class Uint16StorageBackend(Backend):
    """Keeps bfloat16 as uint16 bit patterns, as the CuPy backend does; its device arrays are NumPy arrays."""

    name = "uint16-storage"
    xp = np

    def storage_dtype(self, dtype):
        return {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}[dtype]

    def is_device_array(self, array):
        return isinstance(array, np.ndarray)


def test_a_bfloat16_array_is_viewed_as_uint16_storage_without_a_copy():
    given = np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16)
    got = device_operand("q", given, Uint16StorageBackend(), "bfloat16", shape=(3, 4))
    assert got.dtype == np.uint16
    assert np.shares_memory(got, given)
    assert np.array_equal(got, given.view(np.uint16))


def test_uint16_storage_takes_its_own_dtype_as_is_and_refuses_other_floats():
    backend = Uint16StorageBackend()
    bits = np.zeros((3, 4), np.uint16)
    assert device_operand("q", bits, backend, "bfloat16") is bits
    with pytest.raises(TypeError, match=r"^q: expected dtype bfloat16 .*ml_dtypes.bfloat16 or uint16 .*got float16"):
        device_operand("q", np.zeros((3, 4), np.float16), backend, "bfloat16")


def host_backed_cupy_array(host):
    """A ``cupy.ndarray`` header over host memory: enough for dtype and view checks, never for a kernel."""
    cupy = pytest.importorskip("cupy")
    memory = cupy.cuda.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=0)
    return cupy.ndarray(host.shape, host.dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def test_the_cupy_backend_views_a_cupy_bfloat16_array_as_uint16_without_a_copy():
    pytest.importorskip("cupy")
    from cupykv.backends.cupy_backend import CupyBackend

    class CupyBackendWithoutADevice(CupyBackend):
        def check_device(self, name, array):
            """Nothing to check: no CUDA device here, and these arrays are never launched on."""

    host = np.arange(8, dtype=np.float32).astype(BF16)
    given = host_backed_cupy_array(host)
    got = device_operand("k", given, CupyBackendWithoutADevice(), "bfloat16", shape=(8,))
    assert got.dtype == np.uint16
    assert got.data.ptr == given.data.ptr == host.ctypes.data
