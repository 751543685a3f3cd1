"""Instructions a warp issues per byte in the inner loops of the roofline kernels, read from sm_90 SASS.

``python -m cupykv check --steps`` prints, for each ``cupykv_attention_mma``
instance, what one warp issues for one 16-key step on the common path, and
the bytes of K/V that step brings: the design's bytes per instruction,
against the :data:`H200_BYTES_PER_INSTRUCTION` an H200 needs to keep HBM
busy. It prints the fp8-cache instances again for sm_80, where codes widen
by bit moves (no E4M3 conversion instruction before sm_89), against the
:data:`A100_BYTES_PER_INSTRUCTION` an A100 needs, and the same for one
iteration of the weight loop of each ``cupykv_linear_mma`` instance and of
the vector loop of each float32 ``cupykv_linear`` instance. No GPU is
involved; ``docs/performance.md`` holds the five tables ("Instructions per
step on the common path", the fp8 load path, the two in the ``linear``
design account, and the float32 attention's block step), and
``tests/test_step_instructions.py`` holds them to this count.

How it counts:

1. NVRTC compiles the instance for sm_90 with CuPy's options
   (:data:`cupykv.nvrtc_check.OPTIONS`) plus ``-DCUPYKV_COUNT_COMMON_PATH``:
   each run-time test of the key loop marked ``CUPYKV_COMMON_PATH``
   (``common.cuh``) takes its common outcome, a constant. The step has no
   softcap, no masked key and no rotary q. ``CUPYKV_STEP_RESCALES`` is 0
   (every row's max settled: the accumulator rescale is skipped) or 1 (some
   row's max moved in the step).
2. nvdisasm (the ``nvidia-cuda-nvdisasm`` wheel of the pinned NVRTC's
   version) lists the cubin's SASS.
3. The key loop is the loop (a backward branch and the label it goes to)
   with the most ``HMMA``; the shortest such loop. Every instruction of its
   body counts once, ``NOP`` padding left out. A loop nested in it (the S
   loop of a two-tile warp, which ``#pragma unroll`` leaves rolled, two
   k-steps an iteration) counts as often as it runs: the step's S k-steps
   (``head_dim / 16``) over the k-steps of one iteration (its ``HMMA`` over
   the ``HMMA`` of one k-step).
4. The step's ``HMMA`` must then equal what the tiling implies: per warp
   tile and 16 head dims, two for S per q piece (two n8 blocks of keys) and
   four for P.V (two n8 blocks of dims, P's high and low piece). A count
   that does not is an error, not a row of the table.

The weight loop of ``linear_mma.cu`` is counted the same way, compiled as
CuPy compiles it (it has no per-step test to fix): the loop with the most
``HMMA``, which must hold no other loop and two ``HMMA`` per 32-feature step
of the steps whose loads go out first; each ``HMMA`` takes 8 weight rows x
16 features, 256 bytes.

The float32 CUDA-core linear (``linear.cu``, :class:`CudaCoreLinearInstance`) is counted likewise:
its vector loop is the innermost loop (one holding no other) with the most ``FFMA``, which must hold
the ``LDG`` (kAhead 16-byte loads of each of the warp's two weight rows and of each row of x) and the
``FFMA`` (4 floats x 2 outputs per row of x and step) the tiling implies.

The staged float32 attention (``attention_f32.cu``, :class:`StagedInstance`) is compiled once for each
count of a warp's live rows (``-DCUPYKV_STEP_ROWS``, 0 to 4) and each rescale outcome; its key loop is
the outermost loop holding barriers and ``LDGSTS``, two barriers a step (an iteration the compiler
unrolled counts as its mean per step), its inner loops (the scores' dims, P.V's keys) as often as they
run; the step must hold the copies and the scores' and P.V's FFMA the tiling implies. The table sums
the four warps of a block for 1, 4, 8 and 16 query rows.

A forward branch inside the loop that the common path skips (a step's
copies past the last step, for instance) still counts, so each figure bounds
the common path from above; no such branch holds an ``HMMA``.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

from cupykv.attention_plan import mma_row_groups
from cupykv.kernels import (ATTENTION_HEAD_DIMS, ATTENTION_MMA_HEAD_DIMS, CACHE_DTYPE_PAIRS, CACHE_ITEM_BYTES,
                             CUDA_TYPES, KERNELS, LINEAR_MMA_DTYPES, LINEAR_MMA_ROW_TILES, LINEAR_ROW_TILES,
                             attention_mma_row_tiles, cache_types)
from cupykv.nvrtc_check import PINNED_NVRTC, Nvrtc, NvrtcError, compile_program, load_nvrtc, map_in_processes

#: K/V bytes per issued warp instruction that keep an H200's HBM busy: 4.8 TB/s over 132 SMs x 4
#: schedulers (one warp instruction a cycle each) x 1.98 GHz.
H200_BYTES_PER_INSTRUCTION = 4.8e12 / (132 * 4 * 1.98e9)
#: Cycles of an sm_90 tensor core (one per scheduler) for one dense 16-bit m16n8k16 (4096 flops) at its
#: full rate: 989 TFLOPS = 132 SMs x 4 x 1024 flops a cycle at 1.83 GHz. Whether legacy mma.sync reaches
#: that rate on sm_90 is for a GPU to measure; if it does not, every HMMA takes longer.
HMMA_CYCLES = 4
#: K/V bytes per HMMA that keep HBM busy at that rate (4.6 bytes a cycle and scheduler at 1.98 GHz; about
#: 19.9 at the 1.83 GHz of the quoted rate).
H200_BYTES_PER_HMMA = H200_BYTES_PER_INSTRUCTION * HMMA_CYCLES
#: K/V bytes per issued warp instruction that keep an A100's HBM busy: 2.04 TB/s (80 GB) over 108 SMs
#: x 4 schedulers x 1.41 GHz.
A100_BYTES_PER_INSTRUCTION = 2.04e12 / (108 * 4 * 1.41e9)
STEP_KEYS = 16            # keys of one warp step (attention_mma.cu kStepKeys)
Q_PIECES = 3              # 16-bit pieces of a float q (attention_mma.cu kQPieces)
ARCH = "sm_90"
#: The architecture of the second table: fp8 caches before sm_89, which has no E4M3 conversion
#: instruction, so each pair of codes is widened by bit moves (kv_codec.cuh widen_fp8_pair_by_bits).
FP8_BIT_WIDEN_ARCH = "sm_80"
COUNT_OPTION = "-DCUPYKV_COUNT_COMMON_PATH"


class StepCountError(RuntimeError):
    """nvdisasm is missing, or the SASS does not hold the key loop the count expects."""


@dataclass(frozen=True)
class Instance:
    """One ``cupykv_attention_mma`` instance: a cache dtype, its io dtype, head_dim and row tiles."""

    dtype: str
    io_dtype: str
    head_dim: int
    row_tiles: int

    @property
    def name(self) -> str:
        return f"cupykv_attention_mma<{cache_types(self.dtype, self.io_dtype)}, {self.head_dim}, {self.row_tiles}>"

    @property
    def row_groups(self) -> int:
        """Warps that share each key warp's stages (attention_mma_row_groups): 2 at four tiles, and at
        two tiles of head_dim 256."""
        return mma_row_groups(self.row_tiles, self.head_dim)

    @property
    def warp_tiles(self) -> int:
        return self.row_tiles // self.row_groups

    @property
    def q_pieces(self) -> int:
        """16-bit pieces of q without rope: three for a float q, one otherwise."""
        return Q_PIECES if self.io_dtype == "float32" else 1

    @property
    def step_bytes(self) -> int:
        """K and V bytes of one 16-key step, per warp: the row groups of a four-tile block share a step."""
        return STEP_KEYS * self.head_dim * 2 * CACHE_ITEM_BYTES[self.dtype] // self.row_groups

    @property
    def step_hmma(self) -> int:
        """The ``HMMA`` of one warp step: S (two per q piece) and P.V (four) per tile and 16 dims."""
        return self.warp_tiles * (self.head_dim // 16) * (2 * self.q_pieces + 4)

    @property
    def label(self) -> str:
        """How docs/performance.md names the instance: ``"fp8, bf16 io, 128, 4"``."""
        short = {"bfloat16": "bf16", "float16": "half", "float32": "float", "float8_e4m3": "fp8"}
        cache = short[self.dtype] + (f", {short[self.io_dtype]} io" if self.dtype == "float8_e4m3" else "")
        return f"{cache}, {self.head_dim}, {self.row_tiles}"


def instances() -> list[Instance]:
    """Every ``cupykv_attention_mma`` instance the library compiles, in ``KERNELS`` order."""
    found = [Instance(dtype, io, hd, tiles) for dtype, io in CACHE_DTYPE_PAIRS if dtype != "float32"
             for hd in ATTENTION_MMA_HEAD_DIMS for tiles in attention_mma_row_tiles(hd)]
    assert {i.name for i in found} == set(KERNELS["attention_mma"].instances)
    return found


@dataclass(frozen=True)
class StepCount:
    """What one warp issues for one key step of ``instance``: with the max settled and with it moved."""

    instance: Instance
    settled: int
    moved: int
    hmma: int
    opcodes: Counter   # the settled step's instructions by opcode

    def bytes_per_instruction(self, moved: bool = False) -> float:
        return self.instance.step_bytes / (self.moved if moved else self.settled)


# ------------------------------------------------------------------------------------- linear_mma
#: Weight bytes one HMMA of the tensor-core linear takes: 8 weight rows x 16 in_features x 2 bytes.
LINEAR_BYTES_PER_HMMA = 8 * 16 * 2


@dataclass(frozen=True)
class LinearInstance:
    """One ``cupykv_linear_mma`` instance: a 16-bit weight dtype and a row tile (8 or 16 rows)."""

    dtype: str
    row_tile: int

    @property
    def name(self) -> str:
        return f"cupykv_linear_mma<{CUDA_TYPES[self.dtype]}, {self.row_tile}>"

    @property
    def label(self) -> str:
        return f"{'bf16' if self.dtype == 'bfloat16' else 'half'}, {self.row_tile}"

    @property
    def loop_hmma(self) -> int:
        """HMMA of one loop iteration: the steps whose loads go out first (linear_mma.cu kAhead: 8, or 4
        at 16 rows), two k16 mma a 32-feature step."""
        return 2 * (4 if self.row_tile == 16 else 8)

    @property
    def loop_bytes(self) -> int:
        return self.loop_hmma * LINEAR_BYTES_PER_HMMA


#: A linear instance of either kernel: :class:`LinearInstance` or :class:`CudaCoreLinearInstance`.
LinearKind = TypeVar("LinearKind", "LinearInstance", "CudaCoreLinearInstance")


@dataclass(frozen=True)
class LinearLoopCount(Generic[LinearKind]):
    """What one warp of ``instance`` issues for one iteration of its weight loop."""

    instance: LinearKind
    instructions: int
    opcodes: Counter

    def bytes_per_instruction(self) -> float:
        return self.instance.loop_bytes / self.instructions


# ------------------------------------------------------------------------------ linear on CUDA cores
_LINEAR_TILING = KERNELS["linear"].constants("linear_tiling")   # kAhead, kOutsPerWarp: linear.cu
#: The float32 CUDA-core linear's vector loop: each lane loads 16 bytes of each of the warp's weight
#: rows for kAhead steps, 4 floats a load.
CUDA_CORE_LINEAR_FLOATS_PER_LOAD = 4


@dataclass(frozen=True)
class CudaCoreLinearInstance:
    """One float32 ``cupykv_linear`` instance (the CUDA-core kernel): its row tile, 1 to 16 rows."""

    row_tile: int

    @property
    def name(self) -> str:
        return f"cupykv_linear<float, {self.row_tile}>"

    @property
    def loop_loads(self) -> int:
        """Global loads of one iteration of the vector loop: each step one 16-byte load of each weight row
        and one of each row of x."""
        return _LINEAR_TILING["kAhead"] * (_LINEAR_TILING["kOutsPerWarp"] + self.row_tile)

    @property
    def loop_ffma(self) -> int:
        """FFMA of one iteration: each step, every float of a weight load times every row."""
        return (_LINEAR_TILING["kAhead"] * _LINEAR_TILING["kOutsPerWarp"] * CUDA_CORE_LINEAR_FLOATS_PER_LOAD
                * self.row_tile)

    @property
    def loop_bytes(self) -> int:
        """Weight bytes of one iteration, per warp: kAhead steps of the warp's rows, 512 bytes each."""
        return _LINEAR_TILING["kAhead"] * _LINEAR_TILING["kOutsPerWarp"] * 32 * 16


def cuda_core_linear_instances() -> list[CudaCoreLinearInstance]:
    """The float32 ``cupykv_linear`` instances, one per row tile."""
    found = [CudaCoreLinearInstance(tile) for tile in LINEAR_ROW_TILES]
    assert {i.name for i in found} <= set(KERNELS["linear"].instances)
    return found


def linear_instances() -> list[LinearInstance]:
    """Every ``cupykv_linear_mma`` instance the library compiles."""
    found = [LinearInstance(dtype, tile) for dtype in LINEAR_MMA_DTYPES for tile in LINEAR_MMA_ROW_TILES]
    assert {i.name for i in found} == set(KERNELS["linear_mma"].instances)
    return found


# ------------------------------------------------------------------- attention on float32 caches
_F32_TILING = KERNELS["attention_f32"].constants("attention_f32_tiling")   # attention_f32.cu
#: The count's define of a warp's live rows in attention_f32.cu (``CUPYKV_STEP_ROWS``, 0 to kRowsPerWarp).
STEP_ROWS_OPTION = "-DCUPYKV_STEP_ROWS"
#: Query rows per block (q_len x group) the float32 table shows: decode at GQA 1, 4 and 8, and a full tile.
STAGED_TILE_ROWS = (1, 4, 8, 16)


@dataclass(frozen=True)
class StagedInstance:
    """One ``cupykv_attention_f32`` instance (float32 caches on CUDA cores, K/V staged): its head_dim."""

    head_dim: int

    @property
    def name(self) -> str:
        return f"cupykv_attention_f32<{self.head_dim}>"

    @property
    def step_keys(self) -> int:
        """Keys of one block step: kStepKeys, or kWideStepKeys at kWideHeadDim."""
        wide = self.head_dim == _F32_TILING["kWideHeadDim"]
        return _F32_TILING["kWideStepKeys" if wide else "kStepKeys"]

    @property
    def step_bytes(self) -> int:
        """K and V bytes of one block step: step_keys rows of each, float32."""
        return self.step_keys * self.head_dim * 4 * 2

    @property
    def step_copies(self) -> int:
        """16-byte cp.async (LDGSTS) one thread issues a step: its share of the step's K and V rows."""
        return 2 * self.step_keys * (self.head_dim // 4) // _F32_TILING["kThreads"]

    def phase_ffma(self, rows: int) -> int:
        """The FFMA of a warp's scores, or of its P.V, in one step: for each live row, one per head dim
        and key, spread over the warp's 32 lanes."""
        return rows * self.step_keys * self.head_dim // 32

    def step_ffma(self, rows: int) -> int:
        """The FFMA of a warp's scores and P.V in one step (:meth:`phase_ffma` of each)."""
        return 2 * self.phase_ffma(rows)

    @staticmethod
    def warp_rows(tile_rows: int) -> list[int]:
        """Live rows of each warp for a tile of ``tile_rows`` rows (warp w holds rows w, w + kWarps, ...)."""
        warps, most = _F32_TILING["kWarps"], _F32_TILING["kRowsPerWarp"]
        return [min(most, max(0, -(-(tile_rows - w) // warps))) for w in range(warps)]


@dataclass(frozen=True)
class StagedStepCount:
    """What the block of ``instance`` issues for one step with ``tile_rows`` query rows: the sum over its
    warps, with every live row's max settled and with each one moved."""

    instance: StagedInstance
    tile_rows: int
    settled: int
    moved: int

    def bytes_per_instruction(self, moved: bool = False) -> float:
        return self.instance.step_bytes / (self.moved if moved else self.settled)


# ---------------------------------------------------------------------------------------------- SASS
@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str             # the mnemonic without its modifiers or predicate: "HMMA", "BRA"
    target: str | None      # the label a branch goes to


_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of one function's nvdisasm listing, and each label's address."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        address = int(match.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        opcode, operands = match.group(2), match.group(3)
        target = _BRANCH_TARGET.search(operands) if opcode == "BRA" else None
        instructions.append(Instruction(address, opcode, target.group(1) if target else None))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) addresses of each loop: a backward branch to a label, merged per label."""
    last_by_head: dict[int, int] = {}
    for ins in instructions:
        if ins.target is not None and labels[ins.target] <= ins.address:
            head = labels[ins.target]
            last_by_head[head] = max(last_by_head.get(head, head), ins.address)
    return sorted(last_by_head.items())


def _body(instructions: list[Instruction], first: int, last: int) -> Counter:
    """The instructions from ``first`` to ``last`` by opcode, ``NOP`` padding left out."""
    return Counter(i.opcode for i in instructions if first <= i.address <= last and i.opcode != "NOP")


def _mma_loop(instructions: list[Instruction], labels: dict[str, int],
              name: str) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The shortest of the loops with the most HMMA, and the loops nested in it."""
    spans = loops(instructions, labels)
    with_mma = [(_body(instructions, *span)["HMMA"], span) for span in spans]
    with_mma = [(hmma, span) for hmma, span in with_mma if hmma > 0]
    if not with_mma:
        raise StepCountError(f"{name}: no loop with HMMA in the SASS")
    most = max(hmma for hmma, _ in with_mma)
    first, last = min((span for hmma, span in with_mma if hmma == most), key=lambda s: s[1] - s[0])
    return (first, last), [s for s in spans if first <= s[0] and s[1] <= last and s != (first, last)]


def count_key_loop(instructions: list[Instruction], labels: dict[str, int], instance: Instance,
                   expected_hmma: int | None = None) -> Counter:
    """The instructions of one warp step by opcode, inner loops counted as often as they run.

    The step must hold ``expected_hmma`` HMMA, by default what the tiling implies (``step_hmma``).
    """
    (first, last), inner = _mma_loop(instructions, labels, instance.name)
    total = _body(instructions, first, last)
    # loops without HMMA (a real build's check of a masked step's V for non-finite elements, which the
    # counted build leaves out) count once, as written; the one with HMMA is the S loop of two tiles
    s_loops = [span for span in inner if _body(instructions, *span)["HMMA"]]
    if len(s_loops) > 1:
        raise StepCountError(f"{instance.name}: {len(s_loops)} loops with HMMA inside the key loop; the count models one")
    for span in s_loops:
        once = _body(instructions, *span)
        per_k_step = instance.warp_tiles * 2 * instance.q_pieces   # HMMA of one S k-step
        if once["HMMA"] == 0 or once["HMMA"] % per_k_step:
            raise StepCountError(f"{instance.name}: an inner loop of {once['HMMA']} HMMA is not the S loop")
        k_steps = instance.head_dim // 16
        trips, rest = divmod(k_steps, once["HMMA"] // per_k_step)
        if rest:
            raise StepCountError(f"{instance.name}: the S loop's {once['HMMA']} HMMA do not divide {k_steps} k-steps")
        for _ in range(trips - 1):
            total.update(once)
    expected = instance.step_hmma if expected_hmma is None else expected_hmma
    if total["HMMA"] != expected:
        raise StepCountError(f"{instance.name}: the key loop issues {total['HMMA']} HMMA a step, the tiling "
                             f"implies {expected}")
    return total


#: Block barriers of one step of attention_f32.cu's key loop: its copies landed; the stage released.
STAGED_STEP_BARRIERS = 2


def count_staged_step(instructions: list[Instruction], labels: dict[str, int], instance: StagedInstance,
                      rows: int) -> tuple[Counter, int]:
    """The instructions one warp with ``rows`` live rows issues for one iteration of ``instance``'s key
    loop, by opcode, and the steps an iteration runs (the compiler may unroll the loop: 2 at 0 rows).

    The key loop is the outermost loop holding a barrier (``BAR``) and copies (``LDGSTS``); its steps
    are its barriers over :data:`STAGED_STEP_BARRIERS`. A loop inside it (the scores' dims or P.V's
    keys, which ``#pragma unroll`` leaves partly rolled) counts as often as it runs: each of the two
    does :meth:`StagedInstance.phase_ffma` FFMA a step in all. Each step must then hold
    :attr:`StagedInstance.step_copies` LDGSTS and the :meth:`StagedInstance.step_ffma` of scores and
    P.V, plus at most three per row for the softmax (its two exponentials' products, and the rescaled
    sum of weights).
    """
    spans = [span for span in loops(instructions, labels)
             if _body(instructions, *span)["BAR"] and _body(instructions, *span)["LDGSTS"]]
    if not spans:
        raise StepCountError(f"{instance.name}: no loop with barriers and copies in the SASS")
    first, last = max(spans, key=lambda span: span[1] - span[0])
    total = _body(instructions, first, last)
    steps, rest = divmod(total["BAR"], STAGED_STEP_BARRIERS)
    if rest or steps < 1:
        raise StepCountError(f"{instance.name}: {total['BAR']} barriers in the key loop, not whole steps of "
                             f"{STAGED_STEP_BARRIERS}")
    for span in loops(instructions, labels):
        if span == (first, last) or not (first <= span[0] and span[1] <= last):
            continue
        once = _body(instructions, *span)
        trips, rest = divmod(instance.phase_ffma(rows), once["FFMA"]) if once["FFMA"] else (0, 1)
        if rest or trips < 1:
            raise StepCountError(f"{instance.name}: an inner loop of {once['FFMA']} FFMA does not divide the "
                                 f"{instance.phase_ffma(rows)} of the scores or of P.V")
        for _ in range(trips - 1):
            total.update(once)
    if total["LDGSTS"] != steps * instance.step_copies or not (
            instance.step_ffma(rows) <= total["FFMA"] / steps <= instance.step_ffma(rows) + 3 * rows):
        raise StepCountError(f"{instance.name}: the key loop issues {total['LDGSTS']} LDGSTS and {total['FFMA']} "
                             f"FFMA in {steps} step(s) at {rows} rows, the tiling implies {instance.step_copies} and "
                             f"{instance.step_ffma(rows)} (plus the softmax's) a step")
    return total, steps


def count_staged_instance(nvrtc: Nvrtc, nvdisasm: str, instance: StagedInstance) -> list[StagedStepCount]:
    """Compile ``instance`` for each count of a warp's live rows that :data:`STAGED_TILE_ROWS` take (0, 1,
    2 and 4) and both ways (max settled, max moved), and sum its warps' steps for each of those tiles."""
    per_warp = {}
    for rows in sorted({rows for tile_rows in STAGED_TILE_ROWS for rows in StagedInstance.warp_rows(tile_rows)}):
        for rescales in (0, 1):
            options = (COUNT_OPTION, f"-DCUPYKV_STEP_RESCALES={rescales}", f"{STEP_ROWS_OPTION}={rows}")
            counted, steps = count_staged_step(*compiled_sass(nvrtc, nvdisasm, "attention_f32", instance.name,
                                                              extra_options=options), instance, rows)
            per_warp[rows, rescales] = round(sum(counted.values()) / steps)   # an unrolled loop's mean
    return [StagedStepCount(instance, tile_rows, *(sum(per_warp[rows, rescales] for rows in
                                                       StagedInstance.warp_rows(tile_rows)) for rescales in (0, 1)))
            for tile_rows in STAGED_TILE_ROWS]


def staged_instances() -> list[StagedInstance]:
    """Every ``cupykv_attention_f32`` instance the library compiles."""
    found = [StagedInstance(head_dim) for head_dim in ATTENTION_HEAD_DIMS]
    assert {i.name for i in found} == set(KERNELS["attention_f32"].instances)
    return found


def count_all_staged(nvrtc: Nvrtc | None = None, nvdisasm: str | None = None) -> list[StagedStepCount]:
    return [count for counts in _count_each(count_staged_instance, staged_instances(), nvrtc, nvdisasm)
            for count in counts]


def format_staged_table(counts: list[StagedStepCount]) -> str:
    """The markdown table of docs/performance.md's float32 attention section."""
    lines = ["| head_dim, rows per block | warps' live rows | bytes per block step | max settled (bytes/instr) "
             "| max moved (bytes/instr) |", "|---|---|---|---|---|"]
    for c in counts:
        rows = ", ".join(map(str, StagedInstance.warp_rows(c.tile_rows)))
        lines.append(f"| {c.instance.head_dim}, {c.tile_rows} | {rows} | {c.instance.step_bytes} | {c.settled} "
                     f"({c.bytes_per_instruction():.1f}) | {c.moved} ({c.bytes_per_instruction(True):.1f}) |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- the tools
def _toolkit_roots() -> tuple[str | None, ...]:
    return os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"


def find_nvdisasm() -> str:
    """nvdisasm: ``$CUPYKV_NVDISASM``, the nvidia-cuda-nvdisasm wheel, ``PATH``, then a CUDA toolkit."""
    if os.environ.get("CUPYKV_NVDISASM"):
        return os.environ["CUPYKV_NVDISASM"]
    for entry in sys.path:
        found = sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    on_path = shutil.which("nvdisasm")
    if on_path:
        return on_path
    for root in _toolkit_roots():
        if root and os.path.exists(os.path.join(root, "bin", "nvdisasm")):
            return os.path.join(root, "bin", "nvdisasm")
    raise StepCountError(f"nvdisasm not found: pip install 'nvidia-cuda-nvdisasm=={PINNED_NVRTC}' (the test "
                         "extra installs it), or set CUPYKV_NVDISASM")


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
    if done.returncode != 0:
        raise StepCountError(f"nvdisasm failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def compiled_sass(nvrtc: Nvrtc, nvdisasm: str, op: str, instance_name: str, arch: str = ARCH,
                  extra_options: tuple[str, ...] = ()) -> tuple[list[Instruction], dict[str, int]]:
    """The SASS of one instance of kernel file ``op`` (a :data:`KERNELS` key), compiled as CuPy compiles it
    plus ``extra_options``: its instructions and labels (:func:`parse_sass`)."""
    kernel = KERNELS[op]
    program = compile_program(nvrtc, kernel.filename, kernel.source(), [instance_name], arch,
                              extra_options=extra_options)
    return parse_sass(disassemble(program.cubin, nvdisasm))


def count_instance(nvrtc: Nvrtc, nvdisasm: str, instance: Instance, arch: str = ARCH) -> StepCount:
    """Compile ``instance`` for ``arch`` both ways (max settled, max moved) and count its key loop's step."""
    counts = []
    for rescales in (0, 1):
        options = (COUNT_OPTION, f"-DCUPYKV_STEP_RESCALES={rescales}")
        counts.append(count_key_loop(*compiled_sass(nvrtc, nvdisasm, "attention_mma", instance.name, arch, options),
                                     instance))
    settled, moved = counts
    return StepCount(instance, sum(settled.values()), sum(moved.values()), settled["HMMA"], settled)


def count_linear_loop(instructions: list[Instruction], labels: dict[str, int], instance: LinearInstance) -> Counter:
    """The instructions of one iteration of the weight loop (the loop with the most HMMA) by opcode.

    The loop must hold no other loop, and the HMMA of :attr:`LinearInstance.loop_hmma`.
    """
    (first, last), inner = _mma_loop(instructions, labels, instance.name)
    if inner:
        raise StepCountError(f"{instance.name}: {len(inner)} loops inside the weight loop; the count models none")
    total = _body(instructions, first, last)
    if total["HMMA"] != instance.loop_hmma:
        raise StepCountError(f"{instance.name}: the weight loop issues {total['HMMA']} HMMA an iteration, the "
                             f"tiling implies {instance.loop_hmma}")
    return total


def count_linear_instance(nvrtc: Nvrtc, nvdisasm: str, instance: LinearInstance) -> LinearLoopCount[LinearInstance]:
    """Compile ``instance`` as CuPy would and count one iteration of its weight loop."""
    counted = count_linear_loop(*compiled_sass(nvrtc, nvdisasm, "linear_mma", instance.name), instance)
    return LinearLoopCount(instance, sum(counted.values()), counted)


def count_cuda_core_linear_loop(instructions: list[Instruction], labels: dict[str, int],
                                instance: CudaCoreLinearInstance) -> Counter:
    """The instructions of one iteration of the float32 linear's vector loop by opcode.

    The loop is the innermost loop (one holding no other) with the most ``FFMA``, the shortest of
    those if several tie; it must hold the ``LDG`` and ``FFMA`` of
    :attr:`CudaCoreLinearInstance.loop_loads` and ``loop_ffma`` (the scalar loop, for odd sizes,
    holds a quarter of the FFMA).
    """
    spans = loops(instructions, labels)
    innermost = [span for span in spans
                 if not any(other != span and span[0] <= other[0] and other[1] <= span[1] for other in spans)]
    bodies = [(_body(instructions, *span), span) for span in innermost]
    bodies = [(body, span) for body, span in bodies if body["FFMA"] > 0]
    if not bodies:
        raise StepCountError(f"{instance.name}: no loop with FFMA in the SASS")
    body = max(bodies, key=lambda found: (found[0]["FFMA"], -(found[1][1] - found[1][0])))[0]
    if (body["LDG"], body["FFMA"]) != (instance.loop_loads, instance.loop_ffma):
        raise StepCountError(f"{instance.name}: the vector loop issues {body['LDG']} LDG and {body['FFMA']} FFMA an "
                             f"iteration, the tiling implies {instance.loop_loads} and {instance.loop_ffma}")
    return body


def count_cuda_core_linear_instance(nvrtc: Nvrtc, nvdisasm: str,
                                    instance: CudaCoreLinearInstance) -> LinearLoopCount[CudaCoreLinearInstance]:
    """Compile ``instance`` as CuPy would and count one iteration of its vector loop."""
    counted = count_cuda_core_linear_loop(*compiled_sass(nvrtc, nvdisasm, "linear", instance.name), instance)
    return LinearLoopCount(instance, sum(counted.values()), counted)


def _count_job(nvrtc: Nvrtc, job) -> list:
    count, nvdisasm, instance = job
    return count(nvrtc, nvdisasm, instance)


def _count_each(count, chosen, nvrtc: Nvrtc | None, nvdisasm: str | None) -> list:
    """``count(nvrtc, nvdisasm, instance)`` for each instance, the compiles on every core (in processes:
    :func:`cupykv.nvrtc_check.map_in_processes` says why)."""
    nvrtc = nvrtc or load_nvrtc()
    nvdisasm = nvdisasm or find_nvdisasm()
    return map_in_processes(_count_job, [(count, nvdisasm, instance) for instance in chosen], nvrtc)


def count_all(selected: list[Instance] | None = None, nvrtc: Nvrtc | None = None,
              nvdisasm: str | None = None, arch: str = ARCH) -> list[StepCount]:
    return _count_each(partial(count_instance, arch=arch), instances() if selected is None else selected, nvrtc,
                       nvdisasm)


def fp8_instances() -> list[Instance]:
    """The fp8-cache instances: the second table counts them for :data:`FP8_BIT_WIDEN_ARCH`."""
    return [i for i in instances() if i.dtype == "float8_e4m3"]


def count_all_linear(nvrtc: Nvrtc | None = None, nvdisasm: str | None = None) -> list[LinearLoopCount[LinearInstance]]:
    return _count_each(count_linear_instance, linear_instances(), nvrtc, nvdisasm)


def count_all_cuda_core_linear(nvrtc: Nvrtc | None = None,
                               nvdisasm: str | None = None) -> list[LinearLoopCount[CudaCoreLinearInstance]]:
    return _count_each(count_cuda_core_linear_instance, cuda_core_linear_instances(), nvrtc, nvdisasm)


def format_cuda_core_linear_table(counts: list[LinearLoopCount[CudaCoreLinearInstance]]) -> str:
    """The markdown table of the CUDA-core kernel in docs/performance.md's `linear` section."""
    lines = ["| rows (float32) | weight bytes per iteration | FFMA | instructions (bytes/instr) |", "|---|---|---|---|"]
    for c in counts:
        i = c.instance
        lines.append(f"| {i.row_tile} | {i.loop_bytes} | {i.loop_ffma} | {c.instructions} "
                     f"({c.bytes_per_instruction():.1f}) |")
    return "\n".join(lines)


def format_linear_table(counts: list[LinearLoopCount[LinearInstance]]) -> str:
    """The markdown table of docs/performance.md's `linear` section."""
    lines = ["| weight, row tile | weight bytes per iteration | HMMA | instructions (bytes/instr) |", "|---|---|---|---|"]
    for c in counts:
        i = c.instance
        lines.append(f"| {i.label} | {i.loop_bytes} | {i.loop_hmma} | {c.instructions} ({c.bytes_per_instruction():.1f}) |")
    return "\n".join(lines)


def format_table(counts: list[StepCount]) -> str:
    """The markdown table of docs/performance.md: instructions and bytes per instruction."""
    lines = ["| cache, head_dim, row tiles | bytes per warp-step | HMMA (bytes each) | max settled (bytes/instr) "
             "| max moved (bytes/instr) |",
             "|---|---|---|---|---|"]
    for c in counts:
        i = c.instance
        lines.append(f"| {i.label} | {i.step_bytes} | {c.hmma} ({i.step_bytes / c.hmma:.1f}) | "
                     f"{c.settled} ({c.bytes_per_instruction():.1f}) | {c.moved} ({c.bytes_per_instruction(True):.1f}) |")
    return "\n".join(lines)


def main(nvrtc_path: str | None = None) -> int:
    """``python -m cupykv check --steps``: print the table; 1 when a count fails."""
    try:
        nvrtc, nvdisasm = load_nvrtc(nvrtc_path), find_nvdisasm()
        counts = count_all(nvrtc=nvrtc, nvdisasm=nvdisasm)
        fp8_counts = count_all(fp8_instances(), nvrtc, nvdisasm, FP8_BIT_WIDEN_ARCH)
        linear_counts = count_all_linear(nvrtc, nvdisasm)
        cuda_core_counts = count_all_cuda_core_linear(nvrtc, nvdisasm)
        staged_counts = count_all_staged(nvrtc, nvdisasm)
    except (NvrtcError, StepCountError) as exc:
        print(f"cupykv check --steps: FAILED\n{exc}", file=sys.stderr)
        return 1
    print(f"{nvrtc.describe()}, {nvdisasm}; {ARCH}, {COUNT_OPTION}")
    print(f"Per warp and {STEP_KEYS}-key step on the common path. An H200 needs {H200_BYTES_PER_INSTRUCTION:.1f} "
          f"bytes per issued instruction, and {H200_BYTES_PER_HMMA:.1f} per HMMA at the tensor core's full rate "
          f"({HMMA_CYCLES} cycles each).")
    print(format_table(counts))
    print(f"\nfp8 caches on {FP8_BIT_WIDEN_ARCH}, whose codes widen by bit moves (no E4M3 conversion instruction "
          f"before sm_89); an A100 needs {A100_BYTES_PER_INSTRUCTION:.1f} bytes per issued instruction:")
    print(format_table(fp8_counts))
    print("\nThe tensor-core linear, per warp and iteration of its weight loop (the steps whose loads go out "
          "before the first mma):")
    print(format_linear_table(linear_counts))
    print("\nThe CUDA-core linear (float32 weights), per warp and iteration of its vector loop (kAhead steps "
          "of its two weight rows):")
    print(format_cuda_core_linear_table(cuda_core_counts))
    print(f"\nThe staged float32 attention, per block and step ({_F32_TILING['kStepKeys']} keys, "
          f"{_F32_TILING['kWideStepKeys']} at head_dim {_F32_TILING['kWideHeadDim']}) on the common path "
          f"(the sum over its {_F32_TILING['kWarps']} warps, each with its live rows):")
    print(format_staged_table(staged_counts))
    return 0
