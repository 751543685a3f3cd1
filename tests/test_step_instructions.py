"""The instruction counts of ``python -m cupykv check --steps`` (cupykv.step_instructions).

- docs/performance.md's tables (a key step of the tensor-core attention on sm_90, and of its fp8
  instances on sm_80, whose codes widen by bit moves; an iteration of the tensor-core linear's
  weight loop, and of the float32 CUDA-core linear's vector loop; a block step of the staged float32
  attention) are the count, row for row, under the pinned NVRTC and nvdisasm: bytes, HMMA and FFMA
  exactly, issued instructions within the drift ptxas shows between hosts (tests/compiler_drift.py);
- the count's parsing of SASS (labels, loops, the nested S loop, the HMMA check) on listings
  written here, so that a counting bug shows apart from any compiler;
- CUPYKV_COMMON_PATH fixes the tests only in the count: a real build keeps the rescale vote.
"""
import importlib.metadata
import re
from pathlib import Path

import pytest

from cupykv import step_instructions as steps
from cupykv.__main__ import main as cli_main
from cupykv.kernels import ATTENTION_HEAD_DIMS, KERNELS
from cupykv.nvrtc_check import PINNED_NVRTC, load_nvrtc
from compiler_drift import assert_instructions_near

DOC = Path(__file__).parents[1] / "docs" / "performance.md"
_ROW = re.compile(r"^\| ([a-z0-9 ,]+) \| (\d+) \| (\d+) \(([\d.]+)\) \| (\d+) \(([\d.]+)\) \| (\d+) \(([\d.]+)\) \|$", re.M)


def documented_rows(section: str = "## Instructions per step on the common path", least: int = 16) -> dict[str, tuple]:
    """The rows of an instruction-count table: label -> (bytes, hmma, settled, moved)."""
    text = DOC.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): tuple(int(m.group(g)) for g in (2, 3, 5, 7)) for m in _ROW.finditer(text)}
    assert len(rows) >= least, "a table of docs/performance.md lost rows, or its format changed"
    return rows


def documented_sm80_fp8_rows() -> dict[str, tuple]:
    """The fp8 section's table: the fp8 instances counted for sm_80 at head_dim 64 and 128 (of half io,
    the one-tile ones), and at 96 and 256 the bf16-io ones with one tile and with the most tiles."""
    rows = documented_rows("## fp8 caches on tensor cores: the load path", least=14)
    assert set(rows) == {i.label for i in steps.fp8_instances()
                         if (i.head_dim in (64, 128) and (i.io_dtype != "float16" or i.row_tiles == 1))
                         or (i.io_dtype == "bfloat16" and i.row_tiles in (1, 4 if i.head_dim == 96 else 2))}
    return rows


def _instance(label: str) -> steps.Instance:
    (found,) = [i for i in steps.instances() if i.label == label]
    return found


def assert_row_is_the_count(label: str, count, documented: tuple) -> None:
    """A tensor-core attention row: the step's bytes and HMMA count exact, its settled and moved
    instruction counts within the drift ptxas shows between hosts (tests/compiler_drift.py)."""
    step_bytes, hmma, settled, moved = documented
    assert (count.instance.step_bytes, count.hmma) == (step_bytes, hmma), label
    assert_instructions_near(f"{label}: the settled step", count.settled, settled)
    assert_instructions_near(f"{label}: the moved step", count.moved, moved)


@pytest.fixture(scope="module")
def tools():
    return load_nvrtc(), steps.find_nvdisasm()


# The counts of the three smaller tables, made once: the documented-row tests read them, and the
# command-line test prints them (the staged one alone compiles 8 programs, about a minute here).
@pytest.fixture(scope="module")
def linear_counts(tools):
    return steps.count_all_linear(*tools)


@pytest.fixture(scope="module")
def cuda_core_linear_counts(tools):
    return steps.count_all_cuda_core_linear(*tools)


@pytest.fixture(scope="module")
def staged_counts(tools):
    return steps.count_all_staged(*tools)


@pytest.mark.parametrize("label", sorted(documented_rows()))
def test_the_documented_row_is_the_count(tools, label):
    nvrtc, nvdisasm = tools
    count = steps.count_instance(nvrtc, nvdisasm, _instance(label))
    assert_row_is_the_count(label, count, documented_rows()[label])
    # the rescale is the only difference of the two compiles: the moved step multiplies accumulators
    assert count.moved > count.settled
    line = steps.format_table([count]).splitlines()[-1]
    assert _ROW.match(line) and line.startswith(f"| {label} |")


@pytest.mark.parametrize("label", sorted(documented_sm80_fp8_rows()))
def test_the_documented_sm80_fp8_row_is_the_count(tools, label):
    nvrtc, nvdisasm = tools
    count = steps.count_instance(nvrtc, nvdisasm, _instance(label), steps.FP8_BIT_WIDEN_ARCH)
    assert_row_is_the_count(f"{label} on sm_80", count, documented_sm80_fp8_rows()[label])
    # the widen is bit moves and one f16x2 multiply a pair: each warp widens the whole step, K and V,
    # head_dim / 2 pairs a lane (no E4M3 conversion: count_instance fails on any loop in the key loop
    # but the S loop of two tiles per warp, and cuda_fp8.h's has one per code)
    assert count.opcodes["HMUL2"] == count.instance.head_dim // 2
    assert count.moved > count.settled


_LINEAR_ROW = re.compile(r"^  \| (bf16|half), (\d+) \| (\d+) \| (\d+) \| (\d+) \(([\d.]+)\) \|$", re.M)


def documented_linear_rows() -> dict[str, tuple]:
    """The rows of the linear section's table: label -> (bytes, hmma, instructions)."""
    section = DOC.read_text().split("## `linear`: the design account", 1)[1].split("\n## ", 1)[0]
    rows = {f"{m.group(1)}, {m.group(2)}": tuple(int(m.group(g)) for g in (3, 4, 5)) for m in _LINEAR_ROW.finditer(section)}
    assert len(rows) == 4, "the linear table of docs/performance.md lost rows, or its format changed"
    return rows


def test_the_documented_linear_rows_are_the_count(linear_counts):
    counted = {c.instance.label: (c.instance.loop_bytes, c.opcodes["HMMA"], c.instructions) for c in linear_counts}
    documented = documented_linear_rows()
    assert set(counted) == set(documented)
    for label, (loop_bytes, hmma, instructions) in counted.items():
        assert (loop_bytes, hmma) == documented[label][:2], label
        assert_instructions_near(f"linear {label}", instructions, documented[label][2])
    # 8 steps of 512 bytes ahead at up to 8 rows, 4 at 16: an HMMA per 16 features of 8 weight rows
    assert {label: row[0] for label, row in counted.items()} == {"half, 8": 4096, "bf16, 8": 4096,
                                                                  "half, 16": 2048, "bf16, 16": 2048}


_CUDA_CORE_ROW = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \(([\d.]+)\) \|$", re.M)


def documented_cuda_core_linear_rows() -> dict[int, tuple]:
    """The CUDA-core linear's table: rows -> (bytes, FFMA, instructions)."""
    section = DOC.read_text().split("**CUDA cores (float32, odd sizes).**", 1)[1].split("\n## ", 1)[0]
    rows = {int(m.group(1)): tuple(int(m.group(g)) for g in (2, 3, 4)) for m in _CUDA_CORE_ROW.finditer(section)}
    assert sorted(rows) == [1, 2, 4, 8, 16], "the CUDA-core linear table of docs/performance.md lost rows"
    return rows


def test_the_documented_cuda_core_linear_rows_are_the_count(cuda_core_linear_counts):
    counted = {c.instance.row_tile: (c.instance.loop_bytes, c.opcodes["FFMA"], c.instructions)
               for c in cuda_core_linear_counts}
    documented = documented_cuda_core_linear_rows()
    assert set(counted) == set(documented)
    for rows, (loop_bytes, ffma, instructions) in counted.items():
        assert (loop_bytes, ffma) == documented[rows][:2], rows
        assert_instructions_near(f"CUDA-core linear at {rows} rows", instructions, documented[rows][2])
    # 4 steps of two 512-byte weight rows a warp; 32 FFMA a row of x (4 steps x 4 floats x 2 outputs)
    assert {rows: row[:2] for rows, row in counted.items()} == {r: (4096, 32 * r) for r in (1, 2, 4, 8, 16)}


_STAGED_ROW = re.compile(r"^\| (32|64|128|256), (\d+) \| ([\d, ]+) \| (\d+) \| (\d+) \(([\d.]+)\) \| (\d+) \(([\d.]+)\) \|$",
                         re.M)


def documented_staged_rows() -> dict[tuple[int, int], tuple]:
    """The staged float32 attention's table: (head_dim, rows per block) -> (bytes, settled, moved)."""
    section = DOC.read_text().split("## Decode attention on float32 caches", 1)[1].split("\n## ", 1)[0]
    rows = {(int(m.group(1)), int(m.group(2))): (int(m.group(4)), int(m.group(5)), int(m.group(7)))
            for m in _STAGED_ROW.finditer(section)}
    assert sorted(rows) == [(hd, t) for hd in ATTENTION_HEAD_DIMS for t in steps.STAGED_TILE_ROWS], \
        "the float32 attention table of docs/performance.md lost rows"
    return rows


def test_the_documented_staged_attention_rows_are_the_count(staged_counts):
    counted = {(c.instance.head_dim, c.tile_rows): (c.instance.step_bytes, c.settled, c.moved) for c in staged_counts}
    documented = documented_staged_rows()
    assert set(counted) == set(documented)
    for key, (step_bytes, settled, moved) in counted.items():
        assert step_bytes == documented[key][0], key
        assert_instructions_near(f"attention_f32 {key}: the settled step", settled, documented[key][1])
        assert_instructions_near(f"attention_f32 {key}: the moved step", moved, documented[key][2])
    # a step of K and V rows, float32, 32 keys (16 at 256); more live rows, more instructions
    assert {key: row[0] for key, row in counted.items()} == {(hd, t): (16 if hd == 256 else 32) * hd * 8
                                                            for hd, t in counted}
    for hd in ATTENTION_HEAD_DIMS:
        settled = [counted[hd, t][1] for t in steps.STAGED_TILE_ROWS]
        assert settled == sorted(settled) and len(set(settled)) == len(settled)


def test_the_tools_are_the_pinned_ones(tools):
    nvrtc, nvdisasm = tools
    assert nvrtc.wheel_version == PINNED_NVRTC
    assert importlib.metadata.version("nvidia-cuda-nvdisasm") == PINNED_NVRTC
    assert f'nvidia-cuda-nvdisasm=={PINNED_NVRTC}; extra == "test"' in importlib.metadata.requires("cupykv")
    assert "/nvidia/" in nvdisasm, f"nvdisasm found outside the wheel: {nvdisasm}"


def test_a_real_build_keeps_the_tests_the_count_fixes(tools):
    # Compiled without -DCUPYKV_COUNT_COMMON_PATH, the key loop still votes on the rescale, holds
    # both copies of S (one q piece and, for rope, three: 16 + 48 HMMA, then 32 for P.V) and the
    # masking and softcap code: it is longer than even the moved step.
    nvrtc, nvdisasm = tools
    instance = _instance("bf16, 128, 1")
    three_piece_s = 8 * 2 * steps.Q_PIECES
    real = steps.count_key_loop(*steps.compiled_sass(nvrtc, nvdisasm, "attention_mma", instance.name), instance,
                                expected_hmma=instance.step_hmma + three_piece_s)
    counted = steps.count_instance(nvrtc, nvdisasm, instance)
    assert real["VOTE"] >= 1 and counted.opcodes["VOTE"] == 0
    assert sum(real.values()) > counted.moved


def test_the_command_line_prints_the_table(monkeypatch, capsys, linear_counts, cuda_core_linear_counts,
                                           staged_counts):
    chosen = _instance("fp8, half io, 64, 1")
    monkeypatch.setattr(steps, "instances", lambda: [chosen])
    # the smaller tables' compiles are those of the fixtures (the same pinned tools)
    monkeypatch.setattr(steps, "count_all_linear", lambda *tools: linear_counts)
    monkeypatch.setattr(steps, "count_all_cuda_core_linear", lambda *tools: cuda_core_linear_counts)
    monkeypatch.setattr(steps, "count_all_staged", lambda *tools: staged_counts)
    assert cli_main(["check", "--steps"]) == 0
    out = capsys.readouterr().out
    assert f"nvidia-cuda-nvrtc {PINNED_NVRTC}" in out and "-DCUPYKV_COUNT_COMMON_PATH" in out
    assert "4.6 bytes per issued instruction" in out and "18.4 per HMMA" in out
    sm90, sm80 = [line for line in out.splitlines() if line.startswith("| fp8, half io, 64, 1 |")]
    assert _ROW.match(sm90) and _ROW.match(sm80) and sm90 != sm80
    assert out.index(sm90) < out.index("fp8 caches on sm_80") < out.index(sm80)
    assert "3.3 bytes per issued instruction" in out
    cuda_core = [line for line in out.splitlines() if re.match(r"\| (1|2|4|8|16) \| 4096 \|", line)]
    assert len(cuda_core) == 5 and all(_CUDA_CORE_ROW.match(line) for line in cuda_core)
    linear = [line for line in out.splitlines() if re.match(r"\| (bf16|half), (8|16) \|", line)]
    assert len(linear) == 4 and all(_LINEAR_ROW.match("  " + line) for line in linear)
    staged = [line for line in out.splitlines() if _STAGED_ROW.match(line)]
    assert len(staged) == len(steps.staged_instances()) * len(steps.STAGED_TILE_ROWS)
    # each table under its own heading, in the order main() prints them
    headings = ["The tensor-core linear, per warp", "The CUDA-core linear (float32 weights), per warp",
                "The staged float32 attention, per block"]
    places = [out.index(sm80), out.index(headings[0]), out.index(linear[0]), out.index(headings[1]),
              out.index(cuda_core[0]), out.index(headings[2]), out.index(staged[0])]
    assert places == sorted(places), places


def test_a_missing_nvdisasm_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPYKV_NVDISASM", raising=False)
    monkeypatch.setattr("sys.path", [str(tmp_path)])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(steps, "_toolkit_roots", lambda: (str(tmp_path),))
    with pytest.raises(steps.StepCountError, match=rf"nvidia-cuda-nvdisasm=={re.escape(PINNED_NVRTC)}"):
        steps.find_nvdisasm()


# ------------------------------------------------------------------------- SASS parsing, by hand
def listing(*lines: str) -> str:
    """An nvdisasm-style listing: ("LABEL:" | "OPCODE operands") lines, 16 bytes per instruction."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)


ONE_TILE = steps.Instance("bfloat16", "bfloat16", 64, 1)   # 24 HMMA a step
TWO_TILES = steps.Instance("bfloat16", "bfloat16", 64, 2)  # 48: S 2 x 4 x 2 = 16 (two k-steps an iteration: 8)


def test_labels_and_predicated_branches_are_read():
    text = listing("MOV R1, R2", ".L_x_3:", "@!P0 BRA !P4, `(.L_x_3)", "@P1 HMMA.16816.F32.BF16 R4, R8, R12, R4",
                   "NOP", "EXIT")
    instructions, labels = steps.parse_sass(text)
    assert labels == {".L_x_3": 0x10}
    assert [i.opcode for i in instructions] == ["MOV", "BRA", "HMMA", "NOP", "EXIT"]
    assert instructions[1].target == ".L_x_3"
    assert steps.loops(instructions, labels) == [(0x10, 0x10)]


def test_the_key_loop_is_the_shortest_loop_with_the_most_mma():
    # an outer loop around the step loop (same HMMA) and an earlier loop without any
    text = listing(".L_x_0:", "IADD3 R0, R0, 1", "@P0 BRA `(.L_x_0)",
                   ".L_x_1:", "MOV R1, R2",
                   ".L_x_2:", *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 24, "FADD R1, R1, R2", "NOP",
                   "@P0 BRA `(.L_x_2)", "@P1 BRA `(.L_x_2)", "LDS R3, [R2]", "@P2 BRA `(.L_x_1)", "EXIT")
    counted = steps.count_key_loop(*steps.parse_sass(text), ONE_TILE)
    # both back-edges to .L_x_2 bound one loop; NOP is padding; the outer loop's MOV and LDS are not in it
    assert counted == {"HMMA": 24, "FADD": 1, "BRA": 2}


def test_the_nested_s_loop_counts_as_often_as_it_runs():
    # two tiles at head_dim 64: 4 S k-steps, two an iteration of the inner loop (8 HMMA), so the inner
    # body runs twice; the rest of the step is the 32 HMMA of P.V
    text = listing(".L_x_5:", "LDGSTS [R1], desc[UR4][R2.64]",
                   ".L_x_6:", "LDSM.16.M88.4 R8, [R3]", *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 8,
                   "@P0 BRA `(.L_x_6)",
                   *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 32, "@P1 BRA `(.L_x_5)", "EXIT")
    counted = steps.count_key_loop(*steps.parse_sass(text), TWO_TILES)
    assert counted == {"HMMA": 48, "LDSM": 2, "LDGSTS": 1, "BRA": 3}


@pytest.mark.parametrize("mma_in_step, message", [(23, "issues 23 HMMA a step, the tiling implies 24"),
                                                   (25, "issues 25 HMMA")])
def test_a_step_without_the_tilings_mma_count_fails(mma_in_step, message):
    text = listing(".L_x_0:", *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * mma_in_step, "@P0 BRA `(.L_x_0)")
    with pytest.raises(steps.StepCountError, match=message):
        steps.count_key_loop(*steps.parse_sass(text), ONE_TILE)


def test_an_inner_loop_that_is_not_the_s_loop_fails():
    # 6 HMMA an iteration: not a whole number of two-tile S k-steps (4 HMMA each)
    text = listing(".L_x_0:", "MOV R1, R2", ".L_x_1:", *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 6, "@P0 BRA `(.L_x_1)",
                   *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 32, "@P1 BRA `(.L_x_0)")
    with pytest.raises(steps.StepCountError, match="not the S loop"):
        steps.count_key_loop(*steps.parse_sass(text), TWO_TILES)


STAGED_64 = steps.StagedInstance(64)   # 8 LDGSTS a thread and step; 2 x rows x 64 FFMA


def staged_listing(steps_per_iteration, ldgsts=8, score_trips=2, pv_trips=4, rows=1, bars=2):
    """A key loop of the staged kernel at head_dim 64, ``steps_per_iteration`` steps an iteration, each
    with its copies, ``bars`` barriers, a score loop run ``score_trips`` times and a P.V loop (with its
    shuffles) run ``pv_trips`` times, each loop holding its share of the step's rows x 64 FFMA, and 2
    FFMA a row of softmax."""
    body = []
    for n in range(steps_per_iteration):
        body += ["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]"] * ldgsts + ["BAR.SYNC.DEFER_BLOCKING 0x0"] * (bars - 1)
        body += [f".L_x_{10 + 2 * n}:", "LDS.128 R4, [R3]", *["FFMA R5, R6, R7, R5"] * (rows * 64 // score_trips),
                 f"@P0 BRA `(.L_x_{10 + 2 * n})", *["FFMA R5, R6, R7, R5"] * (2 * rows),
                 f".L_x_{11 + 2 * n}:", "SHFL.IDX PT, R8, R9, R10, 0x1f",
                 *["FFMA R5, R6, R7, R5"] * (rows * 64 // pv_trips),
                 f"@P1 BRA `(.L_x_{11 + 2 * n})", "BAR.SYNC.DEFER_BLOCKING 0x0"]
    return listing("MOV R0, R1", ".L_x_0:", *body, "@P2 BRA `(.L_x_0)", "EXIT")


def test_a_staged_key_loop_counts_its_inner_loops_per_run_and_its_steps_per_iteration():
    counted, steps_run = steps.count_staged_step(*steps.parse_sass(staged_listing(1)), STAGED_64, rows=1)
    assert steps_run == 1
    # the score loop (32 FFMA, 2 trips) and the P.V loop (16 FFMA, 4 trips) as often as they run
    assert counted == {"LDGSTS": 8, "BAR": 2, "LDS": 2, "FFMA": 130, "SHFL": 4, "BRA": 7}
    unrolled, steps_run = steps.count_staged_step(*steps.parse_sass(staged_listing(2)), STAGED_64, rows=1)
    assert steps_run == 2 and unrolled["FFMA"] == 2 * 130 and unrolled["LDGSTS"] == 16


@pytest.mark.parametrize("changes, message", [(dict(ldgsts=7), "7 LDGSTS and 130 FFMA in 1 step"),
                                              (dict(bars=3), "3 barriers in the key loop, not whole steps"),
                                              (dict(score_trips=3), "an inner loop of 21 FFMA does not divide"),
                                              (dict(rows=2), "implies 8 and 128")])
def test_a_staged_key_loop_of_another_shape_fails(changes, message):
    with pytest.raises(steps.StepCountError, match=message):
        steps.count_staged_step(*steps.parse_sass(staged_listing(1, **changes)), STAGED_64, rows=1)


def test_the_staged_tiles_rows_per_warp():
    assert [steps.StagedInstance.warp_rows(t) for t in (1, 4, 5, 8, 13, 16)] == [
        [1, 0, 0, 0], [1, 1, 1, 1], [2, 1, 1, 1], [2, 2, 2, 2], [4, 3, 3, 3], [4, 4, 4, 4]]
    assert (STAGED_64.step_bytes, STAGED_64.step_copies, STAGED_64.step_ffma(3)) == (16384, 8, 384)
    assert steps.StagedInstance(128).step_copies == 16
    # head_dim 256: 16-key steps (1 KB rows), two lanes a key in the scores: half the FFMA a row per lane
    wide = steps.StagedInstance(256)
    assert (wide.step_keys, wide.step_bytes, wide.step_copies, wide.step_ffma(1)) == (16, 32768, 16, 256)
    small = steps.StagedInstance(32)
    assert (small.step_keys, small.step_bytes, small.step_copies, small.step_ffma(2)) == (32, 8192, 4, 128)


LINEAR_8 = steps.LinearInstance("bfloat16", 8)   # 16 HMMA an iteration


def test_the_linear_loop_counts_one_iteration():
    text = listing("MOV R1, R2", ".L_x_0:", *["LDG.E.128 R4, desc[UR4][R2.64]"] * 16,
                   *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 16, "NOP", "@P0 BRA `(.L_x_0)", "EXIT")
    assert steps.count_linear_loop(*steps.parse_sass(text), LINEAR_8) == {"LDG": 16, "HMMA": 16, "BRA": 1}


@pytest.mark.parametrize("body, message", [
    ((".L_x_1:", "IADD3 R0, R0, 1", "@P1 BRA `(.L_x_1)", *["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 16),
     "1 loops inside the weight loop"),
    (["HMMA.16816.F32.BF16 R4, R8, R12, R4"] * 8, "issues 8 HMMA an iteration, the tiling implies 16"),
])
def test_a_linear_loop_of_another_shape_fails(body, message):
    text = listing(".L_x_0:", "MOV R1, R2", *body, "@P0 BRA `(.L_x_0)")
    with pytest.raises(steps.StepCountError, match=message):
        steps.count_linear_loop(*steps.parse_sass(text), LINEAR_8)


CUDA_CORE_2 = steps.CudaCoreLinearInstance(2)   # 16 LDG (8 weight, 8 x) and 64 FFMA an iteration


def test_the_cuda_core_linear_loop_is_the_innermost_with_the_most_ffma():
    vector = ["LDG.E.128 R4, desc[UR4][R2.64]"] * 16 + ["FFMA R1, R2, R3, R1"] * 64
    scalar = ["LDG.E R4, desc[UR4][R2.64]"] * 16 + ["FFMA R1, R2, R3, R1"] * 16
    # the row-tile loop holds both: more FFMA, but not innermost
    text = listing(".L_x_0:", "MOV R1, R2", ".L_x_1:", *scalar, "@P0 BRA `(.L_x_1)", ".L_x_2:", *vector, "IADD3 R0, R0, 1",
                   "@P1 BRA `(.L_x_2)", "@P2 BRA `(.L_x_0)", "EXIT")
    counted = steps.count_cuda_core_linear_loop(*steps.parse_sass(text), CUDA_CORE_2)
    assert counted == {"LDG": 16, "FFMA": 64, "IADD3": 1, "BRA": 1}


def test_of_innermost_loops_with_as_many_ffma_the_shortest_is_the_vector_loop():
    body = ["LDG.E.128 R4, desc[UR4][R2.64]"] * 16 + ["FFMA R1, R2, R3, R1"] * 64
    # the longer loop comes first, so a tie broken by position (or by its end) would pick it
    text = listing(".L_x_0:", *body, *["IADD3 R0, R0, 1"] * 10, "@P0 BRA `(.L_x_0)", "MOV R1, R2",
                   ".L_x_1:", *body, "@P1 BRA `(.L_x_1)", "EXIT")
    assert steps.count_cuda_core_linear_loop(*steps.parse_sass(text), CUDA_CORE_2) == {"LDG": 16, "FFMA": 64, "BRA": 1}


@pytest.mark.parametrize("loads, ffma, message", [
    (15, 64, "issues 15 LDG and 64 FFMA an iteration, the tiling implies 16 and 64"),
    (16, 32, "issues 16 LDG and 32 FFMA"),
])
def test_a_cuda_core_linear_loop_of_another_shape_fails(loads, ffma, message):
    text = listing(".L_x_0:", *["LDG.E.128 R4, desc[UR4][R2.64]"] * loads, *["FFMA R1, R2, R3, R1"] * ffma,
                   "@P0 BRA `(.L_x_0)")
    with pytest.raises(steps.StepCountError, match=message):
        steps.count_cuda_core_linear_loop(*steps.parse_sass(text), CUDA_CORE_2)


def test_no_loop_with_mma_fails():
    text = listing(".L_x_0:", "FADD R1, R1, R2", "@P0 BRA `(.L_x_0)", "HMMA.16816.F32.BF16 R4, R8, R12, R4")
    with pytest.raises(steps.StepCountError, match="no loop with HMMA"):
        steps.count_key_loop(*steps.parse_sass(text), ONE_TILE)


def test_the_tiling_implies_each_instances_mma_and_bytes():
    by_label = {i.label: i for i in steps.instances()}
    assert len(by_label) == len(KERNELS["attention_mma"].instances) == 55
    # head_dim 256: one tile a warp, S 16 k-steps x 2 and P.V 16 x 4; one key warp's step is 16 KB, which
    # the two warps (row groups) of a two-tile block share
    assert (by_label["bf16, 256, 1"].step_hmma, by_label["bf16, 256, 1"].step_bytes) == (96, 16384)
    assert (by_label["bf16, 256, 2"].step_hmma, by_label["bf16, 256, 2"].step_bytes) == (96, 8192)
    assert "half, 256, 4" not in by_label
    # head_dim 96: S 6 k-steps x 2 and P.V 6 x 4 per tile; 16 keys of 192-byte K and V rows
    assert (by_label["bf16, 96, 2"].step_hmma, by_label["bf16, 96, 2"].step_bytes) == (72, 6144)
    # one tile of bf16 at head_dim 128: S 8 k-steps x 2, P.V 8 x 4; K and V of 16 keys, 2 bytes each
    assert (by_label["bf16, 128, 1"].step_hmma, by_label["bf16, 128, 1"].step_bytes) == (48, 8192)
    # four tiles: two row groups of two tiles each, sharing a step's bytes
    assert (by_label["half, 64, 4"].step_hmma, by_label["half, 64, 4"].step_bytes) == (48, 2048)
    # float q: three pieces for S
    assert (by_label["fp8, float io, 128, 2"].step_hmma, by_label["fp8, float io, 128, 2"].step_bytes) == (160, 4096)
