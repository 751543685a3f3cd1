"""``python -m cupykv validate``: the CPU run end to end, then its pieces one by one.

The CPU run goes through the command line in a subprocess, with ``--backend
emulator`` so that it is the emulator plan on any machine (without a GPU that
is also what the bare command picks: see ``test_choose_backend``). The
pieces are tested with small synthetic parts: exit codes, timeouts, the
overall budget, output checks and the file limit; then the plans a GPU
machine would run (commands only: nothing here needs a GPU), and the launch
coverage check.
"""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cupykv.validate as validate
from cupykv import occupancy, ops
from cupykv.backends import cuda_available, get_backend
from cupykv.backends.base import Backend
from cupykv.bench.report import EMULATOR_LABEL as BENCH_EMULATOR_LABEL
from cupykv.kernels import KERNELS, KernelFile
from cupykv.validate import (EMULATOR_BUDGETS, GPU_BUDGETS, MAX_FILES, NCU_KERNELS, NO_GPU, NOT_GPU_LABEL,
                             Part, Plan, build_plan, execute, junit_counts)
from cupykv.validate_launches import (CoverageError, check_coverage, expected_instances, launch_every_kernel,
                                      recording_launch_records, recording_launches)
from cupykv.validate_launches import main as launches_main

GPU_ONLY = ("gpu_suite", "memcheck", "racecheck", "synccheck", "initcheck", "ncu")
PY = sys.executable


# -- the CPU run, end to end ---------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(validate_cpu_run):
    """The CPU run (conftest.py runs it once per session: test_bench.py reads its bench output)."""
    return validate_cpu_run


def test_cpu_run_passes_with_exit_code_zero(cpu_run):
    done, summary = cpu_run["done"], cpu_run["summary"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["exit_code"] == 0 and summary["passed"] is True
    assert summary["failed_parts"] == [] and summary["errors"] == []


def test_cpu_run_is_labelled_not_gpu(cpu_run):
    summary = cpu_run["summary"]
    assert summary["label"] == NOT_GPU_LABEL == "emulator: NOT GPU figures"
    assert summary["gpu"] is False and summary["backend"] == "emulator"
    assert NOT_GPU_LABEL in cpu_run["done"].stdout


def test_cpu_run_part_statuses(cpu_run):
    parts = cpu_run["summary"]["parts"]
    assert list(parts) == ["launches", "gpu_suite", "stateful", "memcheck", "racecheck", "synccheck", "initcheck",
                           "bench", "ncu"]
    assert parts["launches"]["status"] == "passed"
    assert f"all {len(expected_instances())} kernel instances" in parts["launches"]["reason"]
    assert parts["launches"]["commands"][0].endswith(" --warm-up")
    # the part compiled the modules it did not already hold in worker processes first
    log = (cpu_run["out"] / "validate.log").read_text()
    assert re.search(r"^warm-up: \d+ kernel modules compiled in [\d.]+ s by \d+ processes", log, re.M), log[-2000:]
    assert parts["stateful"]["status"] == "passed"
    assert "TestEmulatorCache" in parts["stateful"]["what"]
    assert parts["stateful"]["tests"]["passed"] >= 1
    assert parts["stateful"]["tests"]["failed"] == parts["stateful"]["tests"]["errors"] == 0
    assert parts["bench"]["status"] == "passed"
    assert parts["bench"]["bench_label"] == BENCH_EMULATOR_LABEL and parts["bench"]["is_gpu_figures"] is False
    skip_reason = NO_GPU if not cuda_available()[0] else validate.EMULATOR_REQUESTED
    for name in GPU_ONLY:
        assert parts[name]["status"] == "skipped" and parts[name]["reason"] == skip_reason, name


def test_cpu_run_writes_at_most_max_files(cpu_run):
    out, summary = cpu_run["out"], cpu_run["summary"]
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert len(on_disk) <= MAX_FILES == 8
    assert on_disk == summary["files"] == ["bench.json", "bench.png", "validate.json", "validate.log"]


def test_cpu_run_records_versions_and_durations(cpu_run):
    summary = cpu_run["summary"]
    for key in ("python_version", "numpy_version", "cupykv_version", "cupy_version", "device", "driver_version"):
        assert key in summary["versions"], key
    assert summary["duration_s"] <= summary["budget_s"] == EMULATOR_BUDGETS.total_s
    for name, part in summary["parts"].items():
        assert 0 <= part["duration_s"] <= part["budget_s"] + 1, name
    assert cpu_run["elapsed"] < EMULATOR_BUDGETS.total_s + 30


def test_cpu_run_log_holds_every_run_part(cpu_run):
    log = (cpu_run["out"] / "validate.log").read_text()
    for name, part in cpu_run["summary"]["parts"].items():
        assert (f"==== {name}:" in log) == (part["status"] != "skipped"), name


# -- the runner, with synthetic parts ----------------------------------------------
def _python(code: str) -> tuple:
    return (PY, "-c", code)


def _plan(*parts, total_s=60.0) -> Plan:
    return Plan(backend="emulator", label=NOT_GPU_LABEL, gpu_reason=NO_GPU, total_s=total_s, parts=parts)


def _execute(plan, out):
    return execute(plan, out, environment={}, echo=lambda line: None)


def test_a_failing_part_makes_the_exit_code_nonzero(tmp_path):
    summary = _execute(_plan(Part("ok", "prints", 30, (_python("print('fine')"),)),
                             Part("fails", "exits 3", 30, (_python("print('boom'); raise SystemExit(3)"),)),
                             Part("gpu", "needs a GPU", skip_reason=NO_GPU)), tmp_path)
    assert summary["exit_code"] == 1 and summary["passed"] is False
    assert summary["failed_parts"] == ["fails"]
    assert [p["status"] for p in summary["parts"].values()] == ["passed", "failed", "skipped"]
    assert "exit status 3" in summary["parts"]["fails"]["reason"] and "boom" in summary["parts"]["fails"]["reason"]
    assert json.loads((tmp_path / "validate.json").read_text())["exit_code"] == 1


def test_passed_and_skipped_parts_exit_zero(tmp_path):
    summary = _execute(_plan(Part("ok", "prints", 30, (_python("print('fine')"),)),
                             Part("gpu", "needs a GPU", skip_reason=NO_GPU)), tmp_path)
    assert summary["exit_code"] == 0 and summary["parts"]["ok"]["reason"] == "fine"


def test_a_part_past_its_timeout_is_failed_and_its_processes_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "MIN_COMMAND_S", 0.5)
    marker = tmp_path / "grandchild-survived"
    grandchild = f"import time, pathlib; time.sleep(2); pathlib.Path({str(marker)!r}).write_text('x')"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    started = time.monotonic()
    summary = _execute(_plan(Part("slow", "sleeps", 1.0, (_python(child),))), tmp_path)
    part = summary["parts"]["slow"]
    assert part["status"] == "failed" and part["reason"].startswith("timed out after ")
    assert f"(part budget 1 s): {PY}; last output line: $ {PY} -c " in part["reason"]   # the program that hung
    assert summary["exit_code"] == 1
    assert time.monotonic() - started < 10
    time.sleep(2.5)
    assert not marker.exists(), "the timed-out part's process group was not killed"


@pytest.mark.parametrize("total_s", [0.0, validate.MIN_COMMAND_S - 1.0])
def test_a_part_left_without_time_is_failed_unrun(tmp_path, total_s):
    """No command starts with less than MIN_COMMAND_S left of the run: it could not finish."""
    summary = _execute(_plan(Part("late", "never starts", 30, (_python("print('ran')"),)), total_s=total_s), tmp_path)
    part = summary["parts"]["late"]
    assert part["status"] == "failed" and part["reason"].startswith("not run")
    assert "$ " not in (tmp_path / "validate.log").read_text()   # no command was started


def test_a_fail_pattern_fails_a_zero_exit(tmp_path):
    part = Part("ncu", "profiles nothing", 30, (_python("print('==WARNING== No kernels were profiled.')"),),
                log_file="ncu.log", fail_patterns=("No kernels were profiled",))
    summary = _execute(_plan(part), tmp_path)
    assert summary["parts"]["ncu"]["status"] == "failed"
    assert "No kernels were profiled" in summary["parts"]["ncu"]["reason"]
    assert "No kernels were profiled" in (tmp_path / "ncu.log").read_text()


def test_a_missing_output_fails_the_part(tmp_path):
    summary = _execute(_plan(Part("bench", "writes nothing", 30, (_python("pass"),),
                                  required_outputs=("bench.json",))), tmp_path)
    assert summary["parts"]["bench"]["status"] == "failed"
    assert "missing outputs: bench.json" in summary["parts"]["bench"]["reason"]


def test_a_previous_runs_files_are_removed_first(tmp_path):
    """A bench.json left by an earlier run must not stand in for one this run failed to write."""
    for name in validate.OWN_FILES:
        (tmp_path / name).write_text("from an earlier run")
    summary = _execute(_plan(Part("bench", "writes nothing", 30, (_python("pass"),),
                                  required_outputs=("bench.json", "bench.png"))), tmp_path)
    assert summary["parts"]["bench"]["status"] == "failed"
    assert "missing outputs: bench.json, bench.png" in summary["parts"]["bench"]["reason"]
    assert sorted(summary["files"]) == ["validate.json", "validate.log"]
    assert "from an earlier run" not in (tmp_path / "validate.log").read_text()


@pytest.mark.parametrize("leftovers", [MAX_FILES - 2, MAX_FILES - 1, MAX_FILES])
def test_more_than_max_files_fails_the_run(tmp_path, leftovers):
    for i in range(leftovers):
        (tmp_path / f"old{i}.txt").write_text("left over")
    summary = _execute(_plan(Part("ok", "prints", 30, (_python("print('fine')"),))), tmp_path)
    assert len(summary["files"]) == leftovers + 2   # the leftovers, validate.log and validate.json
    if leftovers + 2 <= MAX_FILES:
        assert summary["exit_code"] == 0 and summary["errors"] == []
    else:
        assert summary["exit_code"] == 1 and "more than 8" in summary["errors"][0]


@pytest.mark.parametrize("tests, skipped, status", [(5, 5, "failed"), (5, 4, "passed")], ids=["all-skipped", "one-ran"])
def test_a_test_part_in_which_no_test_passed_fails(tmp_path, tests, skipped, status):
    """A gpu suite that found no GPU skips every test and exits 0: that must not read as a pass."""
    xml = tmp_path / "suite.xml"
    suite = f'<testsuite name="pytest" tests="{tests}" failures="0" errors="0" skipped="{skipped}"/>'
    part = Part("gpu_suite", "writes its junit XML", 30, (_python(f"open({str(xml)!r}, 'w').write({suite!r})"),),
                junit_xmls=(str(xml),))
    record = _execute(_plan(part), tmp_path / "out")["parts"]["gpu_suite"]
    assert record["status"] == status and record["tests"]["passed"] == tests - skipped
    assert record["reason"].startswith("no test passed") == (status == "failed")


@pytest.mark.parametrize("keep_going", [True, False])
def test_a_part_that_keeps_going_runs_every_command_and_counts_every_suite(tmp_path, keep_going):
    """The gpu suite's second command (the tests run alone) runs after the first one failed, and the
    part reports the first failure with the tests of both; a part that does not keep going stops."""
    xmls = [tmp_path / "first.xml", tmp_path / "second.xml"]
    suites = ['<testsuite name="pytest" tests="9" failures="2" errors="0" skipped="1"/>',
              '<testsuite name="pytest" tests="3" failures="0" errors="0" skipped="0"/>']
    commands = (_python(f"open({str(xmls[0])!r}, 'w').write({suites[0]!r}); raise SystemExit(1)"),
                _python(f"open({str(xmls[1])!r}, 'w').write({suites[1]!r}); raise SystemExit(2)"))
    part = Part("gpu_suite", "two suites", 30, commands, junit_xmls=tuple(map(str, xmls)), keep_going=keep_going)
    record = _execute(_plan(part), tmp_path / "out")["parts"]["gpu_suite"]
    assert record["status"] == "failed" and record["reason"].startswith("exit status 1")
    assert xmls[1].exists() == keep_going
    # the first suite: 9 tests, 2 failed, 1 skipped; the second: 3 passed
    assert record["tests"] == {"passed": 9 if keep_going else 6, "failed": 2, "errors": 0, "skipped": 1}


def test_junit_counts(tmp_path):
    suite = '<testsuite name="pytest" tests="7" failures="1" errors="1" skipped="2"/>'
    (tmp_path / "one.xml").write_text(suite)
    (tmp_path / "many.xml").write_text(f"<testsuites>{suite}{suite}</testsuites>")
    assert junit_counts(tmp_path / "one.xml") == {"passed": 3, "failed": 1, "errors": 1, "skipped": 2}
    assert junit_counts(tmp_path / "many.xml") == {"passed": 6, "failed": 2, "errors": 2, "skipped": 4}


# -- the plans -------------------------------------------------------------------------
TOOLS = {"compute-sanitizer": "/opt/cuda/bin/compute-sanitizer", "ncu": "/opt/cuda/bin/ncu"}
LAUNCHES_ON_CUPY = [PY, "-m", "cupykv.validate_launches", "--backend", "cupy"]


def _gpu_plan(tmp_path, tools=TOOLS):
    plan = build_plan(tmp_path / "out", tmp_path / "scratch", "cupy", "1 CUDA device(s)", tools, device="NVIDIA H200")
    return plan, {part.name: part for part in plan.parts}


def test_gpu_plan_fits_ten_minutes():
    # A GPU session has 15 minutes of device time, the machine's start included: 10 minutes leave room.
    parts = (GPU_BUDGETS.launches_s + GPU_BUDGETS.gpu_suite_s + GPU_BUDGETS.stateful_s + GPU_BUDGETS.bench_s
             + GPU_BUDGETS.ncu_s + sum(seconds for _, seconds in GPU_BUDGETS.sanitizer_s))
    assert parts <= GPU_BUDGETS.total_s <= 10 * 60
    assert {tool for tool, _ in GPU_BUDGETS.sanitizer_s} == set(validate.SANITIZER_TOOLS)


def test_gpu_plan_runs_the_gpu_suite_and_the_stateful_machine_apart(tmp_path):
    plan, parts = _gpu_plan(tmp_path)
    assert plan.label == "GPU: NVIDIA H200" and plan.backend == "cupy"
    assert all(part.skip_reason is None for part in plan.parts)
    (suite, alone), (stateful,) = parts["gpu_suite"].commands, parts["stateful"].commands
    assert suite[:3] == (PY, "-m", "pytest") and ("-m", "gpu", "tests") == suite[3:6]
    assert suite[suite.index("-n") + 1] == str(validate.GPU_SUITE_WORKERS)   # pytest-xdist is in the test extra
    assert "--ignore=tests/test_notebooks.py" in suite        # nbclient is not on the GPU machine
    assert suite[suite.index("--deselect") + 1] == "tests/test_stateful.py::TestCupyCache"
    # the CUDA-event timing tests run alone, after the parallel ones, and only there
    assert validate.SERIAL_GPU_TESTS == ("tests/test_timing.py",)
    assert "--ignore=tests/test_timing.py" in suite and "-n" not in alone
    assert alone[:6] == (PY, "-m", "pytest", "-m", "gpu", "tests/test_timing.py")
    assert "tests/test_stateful.py::TestCupyCache" in stateful
    xmls = parts["gpu_suite"].junit_xmls
    assert len(set(xmls)) == 2 and all(f"--junitxml={xml}" in command for xml, command in zip(xmls, (suite, alone)))
    assert parts["gpu_suite"].keep_going and parts["stateful"].junit_xmls and not parts["stateful"].keep_going


def test_gpu_plan_runs_the_suite_in_one_process_without_xdist(tmp_path, monkeypatch):
    real_find_spec = validate.importlib.util.find_spec
    monkeypatch.setattr(validate.importlib.util, "find_spec",
                        lambda name, *args: None if name == "xdist" else real_find_spec(name, *args))
    _, parts = _gpu_plan(tmp_path)
    suite, alone = parts["gpu_suite"].commands
    assert "-n" not in suite and "--ignore=tests/test_timing.py" in suite and "one process" in parts["gpu_suite"].what


def test_gpu_plan_runs_each_sanitizer_tool_over_the_launches(tmp_path):
    _, parts = _gpu_plan(tmp_path)
    # the first part compiles every module in parallel; the sanitizers' runs load them from the disk cache
    assert parts["launches"].commands == ((*LAUNCHES_ON_CUPY, "--warm-up"),)
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        (command,) = parts[tool].commands
        assert list(command) == [TOOLS["compute-sanitizer"], "--tool", tool, "--error-exitcode", "1",
                                 *LAUNCHES_ON_CUPY]


def test_gpu_plan_profiles_attention_and_linear_once_each(tmp_path):
    _, parts = _gpu_plan(tmp_path)
    ncu = parts["ncu"]
    assert ncu.log_file == "ncu.log" and len(ncu.commands) == 2
    for command, (_, regex) in zip(ncu.commands, NCU_KERNELS):
        assert command[0] == TOOLS["ncu"] and f"regex:{regex}" in command
        assert command[command.index("--launch-count") + 1] == "1" and "--csv" in command
        assert command[-2:] == ("--workload", "profile")
    attention, linear = (regex for _, regex in NCU_KERNELS)
    assert re.search(attention, "void cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128>(__nv_bfloat16 *, float *)")
    assert not re.search(attention, "void cupykv_attention_combine<__nv_bfloat16>(__nv_bfloat16 *, float *)")
    assert re.search(linear, "void cupykv_linear<__nv_bfloat16, 1>(__nv_bfloat16 *)")
    assert re.search(linear, "void cupykv_linear_mma<__nv_bfloat16, 8>(__nv_bfloat16 *)")
    assert parts["bench"].commands[0][-5:] == ("--backend", "cupy", "--out", str(tmp_path / "out"), "--quick")


def test_gpu_plan_without_tools_skips_them_with_the_reason(tmp_path):
    plan, parts = _gpu_plan(tmp_path, {"compute-sanitizer": None, "ncu": None})
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        assert parts[tool].skip_reason.startswith("compute-sanitizer not found")
    assert parts["ncu"].skip_reason.startswith("ncu not found")
    assert parts["gpu_suite"].skip_reason is None and parts["bench"].skip_reason is None


def test_emulator_plan_skips_the_gpu_parts(tmp_path):
    plan = build_plan(tmp_path, tmp_path, "emulator", NO_GPU, TOOLS)
    parts = {part.name: part for part in plan.parts}
    assert plan.label == NOT_GPU_LABEL and plan.total_s == EMULATOR_BUDGETS.total_s
    assert all(parts[name].skip_reason == NO_GPU for name in GPU_ONLY)
    assert "tests/test_stateful.py::TestEmulatorCache" in parts["stateful"].commands[0]
    assert parts["launches"].commands == ((PY, "-m", "cupykv.validate_launches", "--backend", "emulator", "--warm-up"),)


def test_choose_backend(monkeypatch):
    monkeypatch.setattr(validate, "cuda_available", lambda: (False, "no driver"))
    assert validate.choose_backend() == ("emulator", NO_GPU)
    with pytest.raises(RuntimeError, match="no usable GPU: no driver"):
        validate.choose_backend("cupy")
    monkeypatch.setattr(validate, "cuda_available", lambda: (True, "1 CUDA device(s)"))
    assert validate.choose_backend() == ("cupy", "1 CUDA device(s)")
    assert validate.choose_backend("emulator") == ("emulator", validate.EMULATOR_REQUESTED)


def test_find_cuda_tool_searches_path(tmp_path, monkeypatch):
    tool = tmp_path / "cupykv-test-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert validate.find_cuda_tool("cupykv-test-tool") == str(tool)
    assert validate.find_cuda_tool("cupykv-no-such-tool") is None


# -- the launch coverage check ---------------------------------------------------------
def test_coverage_check_names_a_missing_instance():
    expected = expected_instances()
    missing = ("attention", KERNELS["attention"].instances[-1])
    with pytest.raises(CoverageError, match=re.escape(missing[1])):
        check_coverage(expected - {missing})
    check_coverage(expected)   # complete: no error


def test_a_kernel_added_to_KERNELS_without_a_launch_fails(monkeypatch):
    launched_today = expected_instances()
    monkeypatch.setitem(KERNELS, "new_op", KernelFile("new_op.cu", ("cupykv_new_op<float>",)))
    with pytest.raises(CoverageError, match=r"1 of \d+ kernel instances.*\n  new_op: cupykv_new_op<float>"):
        check_coverage(launched_today)


@pytest.fixture(scope="module")
def every_kernel_launch():
    """The :func:`launch_every_kernel` sweep on the emulator: ``(its return value, its LaunchRecords)``."""
    with recording_launch_records() as records:
        launched = launch_every_kernel("emulator")
    return launched, records


def test_launch_every_kernel_covers_KERNELS_on_the_emulator(every_kernel_launch):
    """Every instance is launched, and launches whole warps: a block of 129 threads would run a warp for one
    lane (the one-thread timing guard aside)."""
    launched, records = every_kernel_launch
    assert set(launched) == expected_instances() == {(r.op, r.instance) for r in records}
    blocks = {}
    for r in records:
        blocks.setdefault(r.instance, set()).add(math.prod(r.block))
    assert blocks.pop("cupykv_delay") == {1}   # the bench's timing guard: one thread spinning on the clock
    assert all(threads % 32 == 0 for threads_seen in blocks.values() for threads in threads_seen), blocks


def test_the_occupancy_check_describes_the_launches_the_host_code_makes(every_kernel_launch):
    """``python -m cupykv check`` computes each attention and ``linear`` instance's occupancy from
    :func:`cupykv.occupancy.launch_shape`: that must be the block and the dynamic shared memory the
    host code launches it with. The generic attention instance is checked at its largest head_dim
    (its least occupancy), so the sweep's head_dim 30 may ask for less."""
    _, records = every_kernel_launch
    checked = [r for r in records if occupancy.launch_shape(r.instance) is not None]
    assert {r.op for r in checked} == {"attention", "attention_f32", "attention_mma", "linear", "linear_mma"}
    for r in checked:
        shape = occupancy.launch_shape(r.instance)
        assert math.prod(r.block) == shape.threads, r
        if r.instance.endswith(", 0>"):   # the generic attention instance
            assert 0 < r.shared_mem < shape.dynamic_shared_bytes, r
        else:
            assert r.shared_mem == shape.dynamic_shared_bytes, r


def test_profile_workload_launches_the_kernels_ncu_selects(capsys):
    """Through the command that validate's ncu part profiles (``--workload profile``)."""
    with recording_launches() as launched:
        assert launches_main(["--backend", "emulator", "--workload", "profile"]) == 0
    assert capsys.readouterr().out == "profile workload ran on emulator\n"
    instances = [instance for _, instance in launched]
    attention, linear = (regex for _, regex in NCU_KERNELS)
    assert "cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 1>" in instances and "cupykv_linear_mma<__nv_bfloat16, 8>" in instances
    assert sum(bool(re.search(attention, name)) for name in instances) == 1
    assert sum(bool(re.search(linear, name)) for name in instances) == 1


def test_launches_main_exits_one_when_an_instance_is_not_launched(monkeypatch, capsys):
    monkeypatch.setitem(KERNELS, "new_op", KernelFile("new_op.cu", ("cupykv_new_op<float>",)))
    assert launches_main(["--backend", "emulator"]) == 1
    assert "new_op: cupykv_new_op<float>" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True], ids=["warmed", "warm-up-failed"])
def test_launches_main_warms_up_first_and_goes_on_when_the_warm_up_fails(monkeypatch, capsys, fails):
    from cupykv import validate_launches
    from cupykv.backends.warm_up import WarmUp
    calls = []

    def warm_up(self, ops=None, processes=None):
        calls.append("warm-up")
        if fails:
            raise RuntimeError("cudaErrorDevicesUnavailable")
        return WarmUp(("attention_mma", "add"), 2, 20.5, {"attention_mma": 19.4, "add": 0.5})

    monkeypatch.setattr(Backend, "warm_up", warm_up)
    monkeypatch.setattr(validate_launches, "launch_every_kernel",
                        lambda backend: calls.append("sweep") or [("add", "cupykv_add<float>")])
    assert launches_main(["--backend", "emulator", "--warm-up"]) == 0
    assert calls == ["warm-up", "sweep"]
    out = capsys.readouterr().out
    if fails:
        assert ("warm-up: failed (RuntimeError: cudaErrorDevicesUnavailable); each module compiles on first use "
                "instead") in out
    else:
        assert "warm-up: 2 kernel modules compiled in 20.5 s by 2 processes (slowest: attention_mma, 19.4 s)" in out
    assert "launched all 1 kernel instances" in out


def test_recording_launches_records_and_restores():
    original = Backend.launch
    a = get_backend("emulator").asarray(np.ones(8, np.float32))
    with recording_launch_records() as records, recording_launches() as launched:
        ops.add(a, a)
        assert Backend.launch is not original and launched == [("add", "cupykv_add<float>")]
    assert launched == [("add", "cupykv_add<float>")]
    # 8 floats are 2 packs of 16 bytes: one block of one warp, no dynamic shared memory
    assert records == [("add", "cupykv_add<float>", (1,), (32,), 0)]
    assert Backend.launch is original


def test_readme_gives_the_single_gpu_command():
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Validating on a GPU"):]
    assert ("pip install --no-deps --no-build-isolation -e . && python -m cupykv validate --out docs/gpu/$(date +%F)"
            in section)
