"""Shared test setup: hypothesis profiles, the ``gpu`` marker and the emulator's schedule seed.

Profiles: ``dev`` (50 random examples per property, the default on a
workstation), ``ci`` (200 derandomized examples, the default when the ``CI``
environment variable is set, so a CI verdict does not depend on the draw) and
``deep`` (1000 random examples, to hunt for new failures by hand);
``HYPOTHESIS_PROFILE`` overrides the default. Tests marked
``gpu`` are skipped, with the reason, unless CuPy can use a CUDA device.

Every emulator launch of the session runs in the order of one schedule seed:
``CUPYKV_EMULATOR_SEED`` when set, else ``SESSION_SEED``. tests/test_schedules.py
re-runs every kernel under a second seed. A failing test's report names the seed;
setting ``CUPYKV_EMULATOR_SEED`` to it replays the same order.
"""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from cupykv.backends import cuda_available
from cupykv.backends.base import Backend

sys.path.insert(0, os.path.dirname(__file__))   # tests/backends.py and friends

SESSION_SEED = 1
os.environ.setdefault("CUPYKV_EMULATOR_SEED", str(SESSION_SEED))   # read by every emulator launch
# A kernel that never ends (a planted bug, a wait on another block) fails its test after 120 s of CPU
# time instead of holding the run; the suite's slowest launch takes about 8 s (CUPYKV_EMULATOR_LAUNCH_TIMEOUT).
os.environ.setdefault("CUPYKV_EMULATOR_LAUNCH_TIMEOUT", "120")

settings.register_profile(
    "ci",
    max_examples=200,
    derandomize=True,   # CI replays the same examples every run; random exploration runs under "dev"
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# "deep": a longer random search to run by hand (HYPOTHESIS_PROFILE=deep), for hunting new failures.
settings.register_profile("deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_report_header(config):
    available, reason = cuda_available()
    return [f"hypothesis: {settings.default.max_examples} examples per property",
            f"gpu tests: {'run' if available else 'skipped: ' + reason}",
            f"emulator schedule seed: CUPYKV_EMULATOR_SEED={os.environ['CUPYKV_EMULATOR_SEED']}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report names the emulator schedule seed it ran under."""
    report = (yield).get_result()
    if report.failed:
        seed = os.environ.get("CUPYKV_EMULATOR_SEED", "")
        report.sections.append(("emulator schedule", f"this test ran under CUPYKV_EMULATOR_SEED={seed}; "
                                                     f"set it to replay the same order of blocks and threads"))


@pytest.fixture(autouse=True)
def shared_backends_stay_unpatched(request):
    """Fail a test that leaves an attribute on a shared backend object that hides its class's.

    The backends are shared for the whole session (``get_backend`` caches them). pytest before 9.1
    undoes ``monkeypatch.setattr(backend, "launch", ...)`` by writing the bound method back into the
    instance's ``__dict__``, where it hides every later patch of ``Backend.launch``: a later test that
    records launches by patching the class then runs them for real (a CI run once hung that way).
    Patch the class (``type(backend)`` or ``Backend``) instead.
    """
    yield
    import cupykv.backends
    for name, backend in cupykv.backends._instances.items():
        hiding = sorted(key for key in vars(backend) if hasattr(type(backend), key))
        if hiding:
            for key in hiding:
                delattr(backend, key)   # so that one leak fails one test, not every test after it
            pytest.fail(f"{request.node.nodeid} left {hiding} in the shared {name!r} backend's __dict__, hiding "
                        f"{type(backend).__name__}'s own; patch the class (type(backend)) instead", pytrace=False)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        available, reason = cuda_available()
        if not available:
            pytest.skip(f"no usable CUDA GPU: {reason}")


@pytest.fixture
def recorded_launches(monkeypatch):
    """Every launch's (op, grid, block, shared_mem), recorded instead of run."""
    launches = []

    def record(self, op, instance, grid, block, args, shared_mem=0):
        launches.append((op, tuple(grid), tuple(block), shared_mem))

    monkeypatch.setattr(Backend, "launch", record)
    return launches


@pytest.fixture(scope="session")
def validate_cpu_run(tmp_path_factory):
    """``python -m cupykv validate --backend emulator`` run once in a subprocess, for test_validate.py and
    test_bench.py: its bench part is the emulator's smoke bench, so CI runs that bench once, not twice."""
    import json
    import subprocess
    import time

    from cupykv.validate import EMULATOR_BUDGETS

    out = tmp_path_factory.mktemp("validate")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cupykv", "validate", "--backend", "emulator", "--out", str(out)],
                          capture_output=True, text=True, timeout=EMULATOR_BUDGETS.total_s + 60)
    return {"done": done, "out": out, "elapsed": time.perf_counter() - started,
            "summary": json.loads((out / "validate.json").read_text())}


# Parallel runs (the README's `pytest -n auto`): tests go to the workers one at a time, except these
# modules, each kept whole on one worker (named by group) because an expensive fixture of theirs must run once.
ONE_WORKER_MODULES = {
    "test_smollm2.py": "smollm2",     # three generations with the real checkpoint (module fixture, ~100 s)
    "test_validate.py": "validate",   # the validate CPU run (validate_cpu_run), which test_bench.py reads too
    "test_bench.py": "validate",
    "test_nvrtc_check.py": "nvrtc",   # the NVRTC check of every instance (module fixture, ~35 s)
    "test_step_instructions.py": "steps",   # the staged float32 attention's count (module fixture, ~45 s)
    "test_peers.py": "peers",         # torch's SDPA against the emulator (module fixture, ~12 s)
}
# Modules with a single test of a minute or more: started first, so that none is left to run alone at the end.
LONG_SINGLE_TESTS = ("test_fuzz_api.py", "test_notebooks.py", "test_stateful.py")
# Memory to allow per worker: the largest resident size of any test process over a full run was 2.3 GB.
WORKER_PEAK_BYTES = 3 << 30


def work_unit(nodeid):
    """The unit of work a parallel run hands to one worker: a group of ONE_WORKER_MODULES, else the test."""
    return ONE_WORKER_MODULES.get(nodeid.split("::", 1)[0].rsplit("/", 1)[-1], nodeid)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):   # set in each worker; workers collect, the controller does not
        items.sort(key=lambda item: item.path.name not in LONG_SINGLE_TESTS)   # stable: otherwise unchanged


@pytest.hookimpl(tryfirst=True)       # before xdist's own (trylast) pytest_configure reads the option
def pytest_configure(config):
    """A worker that crashes (an emulated kernel's segfault takes the whole process) fails the run at once.

    The work-unit scheduler below hands no work to a worker started in a crashed one's place, so xdist's
    default of restarting workers left the controller waiting for tests nobody would run: a crash showed as
    the CI time limit. Unless ``--max-worker-restart`` is given, it is 0: the crashed test is named and the
    run stops. Without xdist the option does not exist and a crash ends pytest itself.
    """
    if getattr(config.option, "maxworkerrestart", "absent") is None:
        config.option.maxworkerrestart = "0"


@pytest.hookimpl(optionalhook=True)   # hooks of pytest-xdist, absent when it is not installed
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` with the default ``--dist load``: tests one at a time, but :func:`work_unit` groups whole.

    (xdist's own ``--dist loadgroup`` marks groups by renaming node ids, which pytest 9.1 and later
    ignore, so its groups silently split there.)
    """
    if config.getvalue("dist") != "load":
        return None   # another --dist, asked for by name: xdist's own
    return work_unit_scheduling()(config, log)


def work_unit_scheduling():
    """xdist's scope scheduler (larger units first, then in collection order) with :func:`work_unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return WorkUnitScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, but no more than the memory holds at a worker's peak."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return cores
    return max(1, min(cores, memory // WORKER_PEAK_BYTES))
