"""The parallel run of the README's test command (``pytest -n auto``, tests/conftest.py): which tests share
a worker, so that an expensive fixture runs once, how many workers ``-n auto`` starts, and what a crashed
worker does to the run."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest

TESTS = Path(__file__).parent


def test_every_one_worker_module_exists():
    """A renamed module would silently lose its group and run its fixture once per worker."""
    assert all((TESTS / name).is_file() for name in conftest.ONE_WORKER_MODULES)
    assert all((TESTS / name).is_file() for name in conftest.LONG_SINGLE_TESTS)


def test_modules_sharing_a_fixture_form_one_work_unit_and_other_tests_go_alone():
    unit = conftest.work_unit
    assert unit("tests/test_bench.py::test_png_written") == unit("tests/test_validate.py::test_cpu_run_part_statuses")
    assert unit("tests/test_smollm2.py::test_a") == unit("tests/test_smollm2.py::test_b[x-1]") != unit(
        "tests/test_bench.py::test_png_written")
    assert unit("tests/test_ops.py::test_linear_large[a]") == "tests/test_ops.py::test_linear_large[a]"
    assert unit("tests/test_ops.py::test_linear_large[a]") != unit("tests/test_ops.py::test_linear_large[b]")


def test_the_scheduler_splits_work_by_work_unit():
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) is not installed")
    scheduling = conftest.work_unit_scheduling()
    nodeid = "tests/test_validate.py::test_cpu_run_part_statuses"
    assert scheduling._split_scope(None, nodeid) == "validate"   # the method reads no state of its own
    assert scheduling._split_scope(None, "tests/test_ops.py::test_x[1]") == "tests/test_ops.py::test_x[1]"

    class LoadFile:   # an explicit --dist other than load keeps xdist's own scheduler
        @staticmethod
        def getvalue(name):
            return "loadfile"

    assert conftest.pytest_xdist_make_scheduler(LoadFile, None) is None


def test_auto_starts_no_more_workers_than_cores_or_memory_allow(pytestconfig):
    import os
    workers = conftest.pytest_xdist_auto_num_workers(pytestconfig)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 <= workers <= len(os.sched_getaffinity(0))
    assert workers <= max(1, memory // conftest.WORKER_PEAK_BYTES)


def test_a_crashed_worker_fails_the_run_at_once_naming_its_test(tmp_path):
    """A segfault (an emulated kernel's, here a read of address 0) takes a worker down; the run must stop
    with that test named, not wait for a replacement worker the work-unit scheduler never feeds."""
    (tmp_path / "test_crash.py").write_text("import ctypes\n\n\ndef test_crash():\n    ctypes.string_at(0)\n\n\n"
                                            "def test_after():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "conftest", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_crash.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "worker 'gw0' crashed while running 'test_crash.py::test_crash'" in run.stdout, run.stdout
    assert "FAILED test_crash.py::test_crash" in run.stdout, run.stdout


def test_a_requested_worker_restart_count_is_kept():
    config = SimpleNamespace(option=SimpleNamespace(maxworkerrestart="3"))
    conftest.pytest_configure(config)
    assert config.option.maxworkerrestart == "3"
    config.option.maxworkerrestart = None
    conftest.pytest_configure(config)
    assert config.option.maxworkerrestart == "0"
