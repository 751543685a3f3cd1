"""How far ptxas's choices may differ between hosts under the same pinned NVRTC, for the tests that
hold docs/performance.md's tables to the compiler's output.

The tables are what NVRTC 13.5.37 gives on the machine that wrote them. CI once compiled the same
commit (stop 38, 2026-12-02) with the same wheel and got ``cupykv_attention_f32<128>`` on sm_90 at 139
registers where the dev machine gets 138, and the 256 instance's rescaling block step at 8 rows at
3988 instructions where it gets 3956 (0.8 % more). The dev machine gives its figures every time: under
CPU contention, under other MXCSR rounding and flush modes, with glibc's AVX/FMA dispatch masked, and
from clones at other paths.

A later clue (2026-12-02, twenty-first session): on the dev machine too, the full suite under CI's
settings warned twice (the staged 256 instance's settled step at 8 and then 16 rows, 32 instructions
more), while the same counts run alone gave the documented figures. The counts then compiled in
threads of one process, several NVRTC programs at a time; run that way under CPU load, the step at 8
rows came out at 3988 once in ten runs, the very figure CI saw, and never in nine runs that compiled
one program at a time in a process. The check and the counts now compile in worker processes
(``cupykv.nvrtc_check.map_in_processes``). The slack stays until CI has shown no drift for a while.
Processes are not the whole cure: a CI reproduction on the dev machine (2026-12-03, worker processes)
warned once more, the staged 256 instance's settled step at 8 rows at 3880 instructions where the docs
say 3848: again 32 more, again under the full suite's load. So threads made the drift likelier, and
something else in a loaded host still makes it.

So the tables' register and issued-instruction figures are compared within the slack below, and a
difference within it is reported as a warning naming the host's CPU, so that CI's log shows it.
What decides a verdict stays exact: spills, the blocks per SM each ``__launch_bounds__`` declares,
the bytes a step moves, and the HMMA and FFMA counts, which the algorithm fixes.
"""
from __future__ import annotations

import platform
import warnings

#: registers either way: the observed drift was one
REGISTER_SLACK = 2
#: issued instructions per step, relative: the observed drift was 0.8 %
INSTRUCTION_SLACK = 0.02


def host_cpu() -> str:
    """The CPU's model name from /proc/cpuinfo, else the platform's machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.machine() or "unknown"


def _near(what: str, computed: int, documented: int, slack: float, unit: str) -> None:
    if abs(computed - documented) > slack:
        raise AssertionError(f"{what}: this host's ptxas gives {computed} {unit}, docs/performance.md says "
                             f"{documented}: further apart than the {slack:g} that ptxas may drift between hosts "
                             f"(tests/compiler_drift.py)")
    if computed != documented:
        warnings.warn(f"ptxas drift on this host ({host_cpu()}): {what} is {computed} {unit}, "
                      f"docs/performance.md says {documented}", stacklevel=3)


def assert_registers_near(what: str, computed: int, documented: int) -> None:
    """``computed`` registers are ``documented`` within :data:`REGISTER_SLACK`; a difference within it is warned."""
    _near(what, computed, documented, REGISTER_SLACK, "registers")


def assert_instructions_near(what: str, computed: int, documented: int) -> None:
    """``computed`` instructions are ``documented`` within :data:`INSTRUCTION_SLACK` of it; a difference within
    it is warned."""
    _near(what, computed, documented, INSTRUCTION_SLACK * documented, "instructions")
