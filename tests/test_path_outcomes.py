"""The emulator's count of CUPYKV_COMMON_PATH outcomes (kernels/common.cuh, traffic.cpp).

Inside ``emulator.traffic()`` every launch counts, per source line of a marked run-time test and per
value, how many thread evaluations gave it (``LaunchTraffic.outcomes``). The attention suites hold
the masked steps with it (test_attention_mma.py, test_attention_f32.py); here a tiny kernel pins the
counter itself: exact counts per value, the value passed through unchanged, one launch's counts
only, and nothing counted outside a traffic block.
"""
import numpy as np

from cupykv.backends import emulator as E
from cupykv.backends.emulator import accounting, build
from cupykv.kernels import KERNEL_DIR
from source_lines import line_number

THREADS = 64
SOURCE = r"""#include "common.cuh"
extern "C" __global__ void marked_tests(int* out, const int* limit) {
    const int t = threadIdx.x;
    int taken = 0;
    for (int i = 0; i < 3; ++i)
        if (CUPYKV_COMMON_PATH(t + i < *limit, true)) taken += 1;   // bool outcome
    out[t] = 10 * CUPYKV_COMMON_PATH(t % 3 - 1, 0) + taken;         // int outcome: -1, 0, 1
}
"""


def module(tmp_path):
    path = tmp_path / "marked_tests.cu"
    path.write_text(SOURCE)
    return E.Module(SOURCE, ["marked_tests"], include_dirs=[KERNEL_DIR], filename=str(path)), path


def run(fn, limit):
    out = E.zeros(THREADS, np.int32)
    fn(1, THREADS, (out, E.asarray(np.array([limit], np.int32))))
    return np.asarray(out)


def expected(limit):
    t = np.arange(THREADS)
    taken = sum((t + i < limit).astype(int) for i in range(3))
    return 10 * (t % 3 - 1) + taken, int(taken.sum()), {v: int(np.count_nonzero(t % 3 - 1 == v)) for v in (-1, 0, 1)}


def test_each_outcome_is_counted_per_thread_evaluation_and_passed_through(tmp_path):
    mod, path = module(tmp_path)
    fn = mod.get_function("marked_tests")
    bool_site = f"{path.name}:{line_number(path, 'bool outcome')}"
    int_site = f"{path.name}:{line_number(path, 'int outcome')}"
    with E.traffic() as t:
        first = run(fn, 20)
        second = run(fn, 50)
    for launch, out, limit in zip(t.launches, (first, second), (20, 50)):
        want, taken, by_value = expected(limit)
        np.testing.assert_array_equal(out, want)   # the test's value reaches the kernel unchanged
        # each launch holds its own counts only (the second's are not added to the first's)
        assert launch.outcomes(bool_site) == {1: taken, 0: 3 * THREADS - taken}
        assert launch.outcomes(int_site) == by_value
        assert {site for site, _, _ in launch.path_outcomes} == {bool_site, int_site}
    assert t.launches[0].outcomes("marked_tests.cu:1") == {}   # a line without a marked test


def test_launches_outside_a_traffic_block_count_nothing(tmp_path):
    mod, _ = module(tmp_path)
    fn = mod.get_function("marked_tests")
    with E.traffic() as t:
        run(fn, 20)
    np.testing.assert_array_equal(run(fn, 0), expected(0)[0])   # runs, every test false, uncounted
    # the runtime still holds the traffic launch's counts: the launch after it added none
    assert accounting._path_outcomes(build.runtime()) == t.launches[0].path_outcomes
