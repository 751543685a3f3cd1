"""Backend.warm_up: kernel modules compiled in worker processes, then loaded from the disk cache.

``python -m cupykv validate`` warms up at the start of its first part, so that a cold GPU machine
compiles every module side by side instead of one after another inside that part's budget. These
tests run the same code on the emulator, whose g++ builds share ``$CUPYKV_CACHE_DIR`` as CuPy's
NVRTC builds share CuPy's kernel cache.
"""
import shutil

import pytest

from cupykv.backends.capture import CaptureError, Recorder, capturing
from cupykv.backends.emulator import build
from cupykv.backends.emulator_backend import EmulatorBackend
from cupykv.backends.warm_up import compile_in_parallel, compile_order
from cupykv.kernels import KERNELS


def test_the_largest_module_is_handed_out_first():
    order = compile_order(list(KERNELS))
    assert sorted(order) == sorted(KERNELS)
    assert order[0] == "attention_mma"   # 55 instances: about half of all NVRTC time for sm_90
    assert order.index("attention") < order.index("add")


def test_workers_build_the_modules_and_this_process_then_loads_them_from_disk(tmp_path, monkeypatch):
    # A fresh cache, but for the runtime library (content-keyed, so a copy is the same build): only
    # the two modules are left to build, by the workers.
    fresh = tmp_path / "cache"
    (fresh / "emulator").mkdir(parents=True)
    for runtime in build.cache_dir().glob("cuemu-runtime-*.so"):
        shutil.copy(runtime, fresh / "emulator" / runtime.name)
    monkeypatch.setenv("CUPYKV_CACHE_DIR", str(fresh))
    assert not list((fresh / "emulator").glob("mod-*.so"))

    warm = EmulatorBackend().warm_up(ops=["add", "argmax"], processes=2)
    assert sorted(warm.ops) == ["add", "argmax"] and warm.processes == 2
    assert set(warm.op_seconds) == {"add", "argmax"} and all(s > 0 for s in warm.op_seconds.values())
    built = sorted((fresh / "emulator").glob("mod-*.so"))
    assert len(built) == 2

    build.clear_memory_cache()   # this process has loaded nothing of them: what it uses comes from disk
    build.runtime()              # (the runtime of the fresh cache, loaded first: not counted below)
    compiles, disk_hits = build.stats["compiles"], build.stats["disk_hits"]
    backend = EmulatorBackend()
    for op in ("add", "argmax"):
        backend.kernel(op, KERNELS[op].instances[-1])
    assert build.stats["compiles"] == compiles and build.stats["disk_hits"] == disk_hits + 2
    assert sorted((fresh / "emulator").glob("mod-*.so")) == built


def test_modules_the_backend_holds_are_left_out():
    backend = EmulatorBackend()
    backend.kernel("add", KERNELS["add"].instances[0])
    warm = backend.warm_up(ops=["add"])
    assert warm.ops == () and warm.op_seconds == {}


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^ops: expected keys of cupykv.kernels.KERNELS, got \['nope'\]$"):
        compile_in_parallel("emulator", ["add", "nope"])
    with pytest.raises(ValueError, match=r"^processes: expected an int >= 1, got 0$"):
        compile_in_parallel("emulator", ["add"], 0)
    for bad in (True, 1.5):
        with pytest.raises(TypeError, match=r"^processes: expected an int >= 1, got "):
            compile_in_parallel("emulator", ["add"], bad)


def test_warm_up_is_refused_inside_a_captured_step():
    backend = EmulatorBackend()
    with capturing(Recorder(execute=False, capturing=True)):
        with pytest.raises(CaptureError, match=r"^warm_up \(it starts processes\) inside a captured step"):
            backend.warm_up(ops=["add"])
