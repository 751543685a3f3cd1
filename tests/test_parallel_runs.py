"""The parallel run of the README's test command (``pytest -n auto``, tests/conftest.py): which tests share
a worker, so that an expensive fixture runs once, and how many workers ``-n auto`` starts."""
from pathlib import Path

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
