"""``python -m cupykv validate --out DIR``: one command that validates cupykv where it runs.

With a usable GPU (:func:`cupykv.backends.cuda_available`) the parts are, in order:

- ``launches``: every kernel module compiled first, side by side in worker processes
  (``Backend.warm_up``: a cold machine pays for the largest module, not for all of them in
  turn), then every kernel instance in :data:`cupykv.kernels.KERNELS` launched once at small
  shapes (:mod:`cupykv.validate_launches`), failing on a missed instance;
- ``gpu_suite``: ``pytest -m gpu tests`` on :data:`GPU_SUITE_WORKERS` pytest-xdist workers (the notebooks and
  the stateful machine left out), then the CUDA-event timing tests (:data:`SERIAL_GPU_TESTS`) alone;
- ``stateful``: the stateful machine on CuPy (``tests/test_stateful.py::TestCupyCache``);
- ``memcheck``, ``racecheck``, ``synccheck``, ``initcheck``: the ``launches`` workload
  under ``compute-sanitizer --tool X --error-exitcode 1``;
- ``bench``: ``python -m cupykv bench --quick`` (the quick plan on a GPU, the smoke plan on the
  emulator), ``bench.json`` and ``bench.png``;
- ``ncu``: Nsight Compute on the decode attention and ``linear`` kernels (CSV in ``ncu.log``).

Without one, the same plan runs on the CPU emulator at tiny sizes: the launches
(the emulator checks bounds and barriers), the stateful machine on the emulator
and the bench's smoke run; the GPU-only parts are skipped with the reason,
and the summary says ``emulator: NOT GPU figures``.

Every part is a subprocess with a timeout (its budget, cut to what is left of
the whole run's budget); a timeout is a failure. Nothing is installed and no
network is used. ``DIR`` receives at most :data:`MAX_FILES` files:
``validate.json`` (the summary: status, duration and reason per part,
versions, exit code), ``validate.log`` (every part's output), ``bench.json``,
``bench.png`` and, with Nsight Compute, ``ncu.log``. The exit status is 1 if
any part failed.
"""
from __future__ import annotations

import datetime
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from cupykv.backends import CPU_BACKEND, GPU_BACKEND, cuda_available, get_backend, runs_on_gpu
from cupykv.kernels import cuda_paths

SCHEMA = "cupykv-validate/1"
NOT_GPU_LABEL = "emulator: NOT GPU figures"
NO_GPU = "no GPU"
EMULATOR_REQUESTED = "emulator run requested (--backend emulator)"
MAX_FILES = 8
SUMMARY_FILE, LOG_FILE, NCU_LOG_FILE = "validate.json", "validate.log", "ncu.log"
#: files this command writes into DIR; stale copies are removed before a run.
OWN_FILES = (SUMMARY_FILE, LOG_FILE, NCU_LOG_FILE, "bench.json", "bench.png")
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
_NOT_FOUND = "not found on PATH or in /usr/local/cuda*/bin"
#: a command is not started with less time than this left in its part's or the run's budget.
MIN_COMMAND_S = 5.0
#: the source tree: tests/ lives beside the cupykv package in a checkout.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
#: pytest-xdist workers of the gpu suite (the H200 machine has 16 cores; the tests' NumPy references
#: and hypothesis draws are host work, which one process would run for far longer than the part's budget).
GPU_SUITE_WORKERS = 8
#: gpu tests run alone after the parallel ones: they time CUDA-event windows, into which other workers'
#: kernels on the same GPU would fall.
SERIAL_GPU_TESTS = ("tests/test_timing.py",)
#: (label, kernel-name regex on demangled names) of the kernels Nsight Compute profiles once each.
NCU_KERNELS = (("decode attention", r".*cupykv_attention(_mma)?<.*"), ("linear", r".*cupykv_linear(_mma)?<.*"))
#: DRAM throughput, sectors per request, achieved occupancy and warp stall reasons.
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis_Tables", "Occupancy", "WarpStateStats")


@dataclass(frozen=True)
class Budgets:
    """Seconds each part may run (its subprocess timeout) and the cap of the whole run."""

    total_s: float
    launches_s: float
    stateful_s: float
    bench_s: float
    gpu_suite_s: float = 0.0
    sanitizer_s: tuple = ()      # (tool, seconds) pairs
    ncu_s: float = 0.0


#: An H200 must finish within 10 minutes: the budgets add up to the total, 9 min 45 s. The bench runs its
#: quick plan (decode loops and peers included, peers within 60 s); the gpu suite holds about 1700 tests,
#: whose host work (NumPy references, hypothesis) runs on 8 workers.
GPU_BUDGETS = Budgets(total_s=585, launches_s=60, stateful_s=40, bench_s=180, gpu_suite_s=150,
                      sanitizer_s=(("memcheck", 30), ("racecheck", 40), ("synccheck", 25), ("initcheck", 30)),
                      ncu_s=30)
#: The emulator at tiny sizes, on a 2-core machine that also runs another test process: with a cold build
#: cache, launches took 48 s (45 s of it compiling), stateful 12 s and the bench 120 s on the slowest CI
#: machine seen (stop 30), where the bench ran 1.6 times as long as on the development machine. The smoke
#: plan was then cut from 76 s to 51 s on the development machine (about 80 s on that CI machine). The
#: launches and bench budgets are about 3 times their parts on that machine, stateful's 5 times: guards
#: against hangs, not speed targets.
EMULATOR_BUDGETS = Budgets(total_s=480, launches_s=150, stateful_s=60, bench_s=240)


@dataclass(frozen=True)
class Part:
    """One part of the plan: commands run one after another within ``budget_s``, or a skip reason."""

    name: str
    what: str
    budget_s: float = 0.0
    commands: tuple = ()                     # argv tuples
    skip_reason: Optional[str] = None
    log_file: str = LOG_FILE
    junit_xmls: tuple = ()                   # pytest's --junitxml paths: tests are counted from them
    keep_going: bool = False                 # run every command even after one fails (the first failure counts)
    fail_patterns: tuple = ()                # output text that fails the part whatever the exit status
    required_outputs: tuple = ()             # files in DIR the part must leave
    details: Optional[Callable[[Path], dict]] = None   # extra summary fields, read from DIR after a pass


@dataclass(frozen=True)
class Plan:
    """What one run executes and how it labels its results."""

    backend: str
    label: str
    gpu_reason: str
    total_s: float
    parts: tuple


def find_cuda_tool(name: str) -> Optional[str]:
    """Path of a CUDA toolkit program (``compute-sanitizer``, ``ncu``): PATH, then ``/usr/local/cuda*/bin``."""
    candidates = [shutil.which(name)] + cuda_paths((), f"bin/{name}")
    candidates += sorted(glob.glob(f"/usr/local/cuda-*/bin/{name}"), reverse=True)
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def junit_counts(path) -> dict:
    """``{"passed", "failed", "errors", "skipped"}`` summed over the test suites of a pytest junit XML."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    total = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def _bench_details(out: Path) -> dict:
    data = json.loads((out / "bench.json").read_text())
    return {"bench_label": data["label"], "bench_mode": data["mode"], "is_gpu_figures": data["is_gpu_figures"]}


def _pytest(*selection: str, junit_xml: str) -> tuple:
    return (sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider",
            "--ignore=tests/test_notebooks.py", f"--junitxml={junit_xml}")


def build_plan(out, scratch, backend: str, gpu_reason: str, tools: dict, budgets: Budgets | None = None,
               device: str = "") -> Plan:
    """The parts of a run on ``backend`` ("cupy" or "emulator").

    Parameters
    ----------
    out, scratch : Path
        The output folder and a scratch folder (pytest's junit XML).
    backend : {"cupy", "emulator"}
    gpu_reason : str
        Why a GPU is or is not used: on the emulator, the reason GPU-only
        parts are skipped (:data:`NO_GPU` or :data:`EMULATOR_REQUESTED`).
    tools : dict
        ``{"compute-sanitizer": path or None, "ncu": path or None}``.
    budgets : Budgets, optional
        :data:`GPU_BUDGETS` or :data:`EMULATOR_BUDGETS` by default.
    device : str, optional
        The GPU's name, for the label of a GPU run.
    """
    out, scratch, gpu = Path(out).resolve(), Path(scratch), runs_on_gpu(backend)   # parts run in SOURCE_ROOT
    budgets = budgets or (GPU_BUDGETS if gpu else EMULATOR_BUDGETS)
    launches = (sys.executable, "-m", "cupykv.validate_launches", "--backend", backend)
    stateful_test = "tests/test_stateful.py::" + ("TestCupyCache" if gpu else "TestEmulatorCache")
    dev_profile = "HYPOTHESIS_PROFILE=dev"
    # the first part pays for the cold compiles: every module at once, in worker processes (Backend.warm_up)
    parts = [Part("launches", f"every kernel instance in KERNELS launched once on {backend}", budgets.launches_s,
                  ((*launches, "--warm-up"),))]
    if gpu:
        junit, serial_junit = str(scratch / "gpu_suite.xml"), str(scratch / "gpu_suite_serial.xml")
        workers = ("-n", str(GPU_SUITE_WORKERS)) if importlib.util.find_spec("xdist") is not None else ()
        suite = _pytest("-m", "gpu", "tests", *workers, "--deselect", "tests/test_stateful.py::TestCupyCache",
                        *(f"--ignore={path}" for path in SERIAL_GPU_TESTS), junit_xml=junit)
        serial = _pytest("-m", "gpu", *SERIAL_GPU_TESTS, junit_xml=serial_junit)
        on = f"{GPU_SUITE_WORKERS} workers" if workers else "one process (no pytest-xdist)"
        parts.append(Part("gpu_suite", f"pytest -m gpu tests on {on}, then {', '.join(SERIAL_GPU_TESTS)} alone; "
                                       f"stateful machine and notebooks left out ({dev_profile})",
                          budgets.gpu_suite_s, (suite, serial), junit_xmls=(junit, serial_junit), keep_going=True))
    else:
        parts.append(Part("gpu_suite", "pytest -m gpu tests", skip_reason=gpu_reason))
    junit = str(scratch / "stateful.xml")
    parts.append(Part("stateful", f"the stateful machine on {backend}: {stateful_test} ({dev_profile})",
                      budgets.stateful_s, (_pytest(stateful_test, junit_xml=junit),), junit_xmls=(junit,)))
    sanitizer = tools.get("compute-sanitizer")
    for tool, seconds in budgets.sanitizer_s or [(tool, 0.0) for tool in SANITIZER_TOOLS]:
        what = f"compute-sanitizer --tool {tool} over the launches workload"
        if not gpu:
            parts.append(Part(tool, what, skip_reason=gpu_reason))
        elif sanitizer is None:
            parts.append(Part(tool, what, skip_reason=f"compute-sanitizer {_NOT_FOUND}"))
        else:
            parts.append(Part(tool, what, seconds, ((sanitizer, "--tool", tool, "--error-exitcode", "1", *launches),)))
    parts.append(Part("bench", f"python -m cupykv bench on {backend}" + ("" if gpu else " (smoke run)"),
                      budgets.bench_s, ((sys.executable, "-m", "cupykv", "bench", "--backend", backend,
                                         "--out", str(out), "--quick"),),
                      required_outputs=("bench.json", "bench.png"), details=_bench_details))
    ncu, what = tools.get("ncu"), "Nsight Compute: decode attention and linear, once each (CSV)"
    if not gpu:
        parts.append(Part("ncu", what, skip_reason=gpu_reason))
    elif ncu is None:
        parts.append(Part("ncu", what, skip_reason=f"ncu {_NOT_FOUND}"))
    else:
        sections = [arg for section in NCU_SECTIONS for arg in ("--section", section)]
        commands = tuple((ncu, "--kernel-name-base", "demangled", "--kernel-name", f"regex:{regex}",
                          "--launch-count", "1", *sections, "--csv", "--page", "details",
                          sys.executable, "-m", "cupykv.validate_launches", "--backend", GPU_BACKEND,
                          "--workload", "profile") for _, regex in NCU_KERNELS)
        parts.append(Part("ncu", what, budgets.ncu_s, commands, log_file=NCU_LOG_FILE,
                          fail_patterns=("No kernels were profiled", "==ERROR==")))
    label = f"GPU: {device or gpu_reason}" if gpu else NOT_GPU_LABEL
    return Plan(backend=backend, label=label, gpu_reason=gpu_reason, total_s=budgets.total_s, parts=tuple(parts))


def _run_command(command, timeout_s: float, log) -> tuple[Optional[int], bool]:
    """Run ``command`` with output appended to the open binary ``log``; ``(exit status, timed out)``.

    On a timeout the command's whole process group is killed (a sanitizer's or
    profiler's target process included).
    """
    env = dict(os.environ, HYPOTHESIS_PROFILE="dev", PYTHONUNBUFFERED="1")
    log.write(f"$ {' '.join(command)}\n".encode())
    log.flush()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               cwd=SOURCE_ROOT, env=env, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None, True


def _read_from(path: Path, start: int, max_bytes: int = 8 * 2**20) -> str:
    """What was appended to ``path`` after byte ``start`` (its last ``max_bytes`` at most)."""
    with open(path, "rb") as f:
        f.seek(max(start, f.seek(0, os.SEEK_END) - max_bytes))
        return f.read().decode(errors="replace")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_part(part: Part, out: Path, deadline: float) -> dict:
    """Run one part; its summary record (``status`` is "passed", "failed" or "skipped")."""
    record: dict[str, Any] = {"what": part.what, "status": "skipped", "duration_s": 0.0, "budget_s": part.budget_s}
    if part.skip_reason is not None:
        return dict(record, reason=part.skip_reason)
    log_path, started = out / part.log_file, time.monotonic()
    record.update(log=part.log_file, commands=[" ".join(command) for command in part.commands])
    failure, output = None, ""
    with open(log_path, "ab") as log:
        log.write(f"\n==== {part.name}: {part.what} ====\n".encode())
        for command in part.commands:
            left = min(part.budget_s - (time.monotonic() - started), deadline - time.monotonic())
            if left < MIN_COMMAND_S:
                failure = failure or f"not run: {max(left, 0):.0f} s left of the part's or the run's budget"
                break
            log.flush()
            start = log.tell()
            status, timed_out = _run_command(command, left, log)
            output = _read_from(log_path, start)
            found = [pattern for pattern in part.fail_patterns if pattern in output]
            problem = None
            if timed_out:
                problem = f"timed out after {left:.0f} s (part budget {part.budget_s:.0f} s): {command[0]}"
            elif status != 0:
                problem = f"exit status {status}"
            elif found:
                problem = f"output contains {found[0]!r}"
            failure = failure or problem   # the first command's failure is the one reported
            if failure is not None and not part.keep_going:
                break
    record["duration_s"] = round(time.monotonic() - started, 2)
    written = [path for path in part.junit_xmls if os.path.exists(path)]   # pytest writes one as it exits
    if written:
        counts = [junit_counts(path) for path in written]
        record["tests"] = {key: sum(count[key] for count in counts) for key in counts[0]}
        if failure is None and record["tests"]["passed"] == 0:
            failure = "no test passed"
    missing = [name for name in part.required_outputs if not (out / name).is_file()]
    if failure is None and missing:
        failure = f"missing outputs: {', '.join(missing)}"
    if failure is not None:
        last = _last_line(output)
        return dict(record, status="failed", reason=failure + (f"; last output line: {last}" if last else ""))
    if part.details is not None:
        record.update(part.details(out))
    return dict(record, status="passed", reason=_last_line(output))


def execute(plan: Plan, out, environment: dict, echo=print) -> dict:
    """Run every part of ``plan``, write ``DIR/validate.json`` and return the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in OWN_FILES:
        (out / name).unlink(missing_ok=True)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    started = time.monotonic()
    deadline = started + plan.total_s
    echo(f"cupykv validate on {plan.backend}: {plan.label}")
    parts = {}
    for part in plan.parts:
        try:
            parts[part.name] = run_part(part, out, deadline)
        except Exception as exc:  # a bookkeeping error fails this part, not the whole run
            parts[part.name] = {"what": part.what, "status": "failed", "duration_s": 0.0,
                                "budget_s": part.budget_s, "reason": f"{type(exc).__name__}: {exc}"}
        record = parts[part.name]
        echo(f"  {part.name:<10} {record['status']:<8} {record['duration_s']:7.1f} s  {record.get('reason', '')}")
    files = sorted({str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} | {SUMMARY_FILE})
    errors = [f"{len(files)} files in {out}, more than {MAX_FILES}: use an empty folder"] * (len(files) > MAX_FILES)
    failed = [name for name, record in parts.items() if record["status"] == "failed"]
    summary = {
        "schema": SCHEMA,
        "label": plan.label,
        "gpu": runs_on_gpu(plan.backend),
        "backend": plan.backend,
        "gpu_reason": plan.gpu_reason,
        "passed": not failed and not errors,
        "exit_code": 1 if failed or errors else 0,
        "failed_parts": failed,
        "errors": errors,
        "started": started_at,
        "duration_s": round(time.monotonic() - started, 2),
        "budget_s": plan.total_s,
        "versions": environment,
        "parts": parts,
        "files": files,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    echo(f"{'PASSED' if summary['passed'] else 'FAILED'} in {summary['duration_s']:.1f} s: {plan.label}"
         + (f"; failed: {', '.join(failed)}" if failed else "") + "".join(f"; {error}" for error in errors))
    echo(f"wrote {out / SUMMARY_FILE}")
    return summary


def choose_backend(backend: Optional[str] = None) -> tuple[str, str]:
    """``(backend, why)``: "cupy" when a GPU is usable (unless "emulator" is asked for), else "emulator".

    ``why`` is :func:`cuda_available`'s reason for CuPy, and for the emulator
    the reason GPU-only parts are skipped: :data:`NO_GPU` or :data:`EMULATOR_REQUESTED`.
    """
    available, reason = cuda_available()
    if backend is not None and runs_on_gpu(backend) and not available:
        raise RuntimeError(f"validate --backend {backend}: no usable GPU: {reason}")
    if not available:
        return CPU_BACKEND, NO_GPU
    return (CPU_BACKEND, EMULATOR_REQUESTED) if backend == CPU_BACKEND else (GPU_BACKEND, reason)


def versions(backend: str) -> dict:
    """Python, NumPy, CuPy, cupykv, the device (GPU name from CuPy's device properties) and driver versions."""
    from cupykv.bench.report import environment
    return environment(get_backend(backend))


def main(out="validate_results", backend: Optional[str] = None) -> int:
    """CLI entry: choose the plan for this machine, run it into ``out``; exit status 1 if a part failed."""
    try:
        backend, reason = choose_backend(backend)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 2
    out = Path(out).resolve()
    tools = {name: find_cuda_tool(name) for name in ("compute-sanitizer", "ncu")}
    environment = dict(versions(backend), cuda_available=cuda_available()[1], tools=tools)
    with tempfile.TemporaryDirectory(prefix="cupykv-validate-") as scratch:
        plan = build_plan(out, scratch, backend, reason, tools, device=environment.get("device") or "")
        summary = execute(plan, out, environment)
    return summary["exit_code"]


__all__ = ["Budgets", "Part", "Plan", "GPU_BUDGETS", "EMULATOR_BUDGETS", "MAX_FILES", "NOT_GPU_LABEL", "NO_GPU",
           "build_plan", "choose_backend", "execute", "find_cuda_tool", "junit_counts", "main", "run_part"]
