"""Backend plumbing: each kernel is looked up once per backend; synchronize works outside capture;
asarray keeps a host array as it is."""
import math

import numpy as np
import pytest

from cupykv.backends import get_backend
from cupykv.backends.base import Backend
from cupykv.kernels import KERNELS
from backends import BACKENDS


class CountingModule:
    """Stands in for a CuPy RawModule: a new function object on every get_function, as CuPy builds one."""

    def __init__(self):
        self.lookups: dict[str, int] = {}

    def get_function(self, name):
        self.lookups[name] = self.lookups.get(name, 0) + 1
        return lambda grid, block, args, shared_mem=0: None


class CountingBackend(Backend):
    """A backend whose compiled modules count their kernel lookups."""

    name = "counting"
    xp = np

    def __init__(self):
        super().__init__()
        self.compiled: dict[str, CountingModule] = {}

    def _compile(self, filename, source, instances):
        self.compiled[filename] = CountingModule()
        return self.compiled[filename]


def test_each_kernel_instance_is_looked_up_once_per_backend():
    backend = CountingBackend()
    first, second = KERNELS["add"].instances[:2]
    kernels = [backend.kernel("add", name) for name in (first, second, first, second, first)]
    for _ in range(3):
        backend.launch("add", first, (1,), (32,), ())
    assert backend.compiled[KERNELS["add"].filename].lookups == {first: 1, second: 1}
    assert kernels[0] is kernels[2] is kernels[4] and kernels[1] is kernels[3]
    assert kernels[0] is not kernels[1]


def test_a_second_backend_looks_its_kernels_up_again():
    one, two = CountingBackend(), CountingBackend()
    name = KERNELS["add"].instances[0]
    assert one.kernel("add", name) is not two.kernel("add", name)
    assert two.compiled[KERNELS["add"].filename].lookups == {name: 1}


def test_the_emulator_returns_the_same_function_object_every_time():
    backend = get_backend("emulator")
    name = KERNELS["add"].instances[0]
    assert backend.kernel("add", name) is backend.kernel("add", name)


def test_synchronize_outside_capture_still_works_on_the_emulator():
    # cupykv.bench.timing calls backend.synchronize() between timed calls, outside any capture.
    get_backend("emulator").synchronize()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [5, np.int64(5), (5,), [2, 3], (), 0], ids=repr)
def test_zeros_takes_a_shape_as_cupy_does(backend, shape):
    """An int is one axis, as in ``cupy.zeros(5)``; a list is a tuple."""
    device = get_backend(backend)
    want = np.zeros(shape, np.float16)
    got = device.zeros(shape, np.float16)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert device.to_host(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (3,), (2, 3)], ids=str)
def test_asarray_keeps_the_host_arrays_shape_dtype_and_values(backend, shape):
    """As ``cupy.asarray`` keeps them: a 0-d array stays 0-d (NumPy's ``ascontiguousarray`` would make it
    ``(1,)``, and an op that refuses 0-d operands would then run on the emulator only)."""
    device = get_backend(backend)
    host = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + 0.5
    on_device = device.asarray(host)
    assert device.is_device_array(on_device)
    assert (on_device.shape, on_device.dtype) == (shape, np.float32)
    back = device.to_host(on_device)
    assert back.shape == shape and back.tobytes() == host.tobytes()
    transposed = device.asarray(host.T)   # not C-contiguous: copied into a C-contiguous device array
    assert transposed.shape == host.T.shape
    assert device.to_host(transposed).tobytes() == np.ascontiguousarray(host.T).tobytes()
