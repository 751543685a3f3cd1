"""Occupancy: how many blocks of one compiled kernel instance an SM keeps resident at once.

The arithmetic of NVIDIA's occupancy calculator for compute capabilities 8.0 and 9.0, from
the per-thread register count ptxas reports, the threads per block and the shared memory per
block. Each resource gives a limit; the smallest binds:

- registers: 65536 per SM, allocated per warp in units of 256, so a warp of a kernel using R
  registers per thread takes ``ceil(32 R / 256) * 256`` of them;
- threads: 2048 per SM (whole warps); blocks: 32 per SM;
- shared memory: 164 KB per SM on sm_80 and 228 KB on sm_90 (the largest carveout, which the
  driver picks when a kernel needs it), allocated per block in units of 128 bytes, with 1 KB
  per block reserved by the system (so one block may have at most 163 KB on sm_80 and 227 KB on
  sm_90), past 48 KB only with the kernel's opt-in.

``python -m cupykv check`` (:mod:`cupykv.nvrtc_check`) prints this for the attention and
``linear`` instances (:func:`rows`: each instance's launch from the host code, the generic
attention instance at head_dim 256) and fails when one falls below the minimum its
``__launch_bounds__`` declares.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cupykv.kernels import CACHE_CUDA_TYPES
from cupykv.spec import MAX_HEAD_DIM

if TYPE_CHECKING:
    from cupykv.nvrtc_check import InstanceReport


@dataclass(frozen=True)
class SmLimits:
    """What one streaming multiprocessor of an architecture offers resident blocks."""

    arch: str
    shared_bytes: int              # shared memory per SM, at the largest carveout
    registers: int = 65536         # 32-bit registers per SM
    register_unit: int = 256       # registers are allocated per warp, in units of this many
    max_threads: int = 2048
    max_block_threads: int = 1024  # threads one block may have
    max_blocks: int = 32
    shared_reserved: int = 1024    # bytes of shared memory the system reserves per block
    shared_unit: int = 128         # shared memory allocation granularity per block
    warp_size: int = 32


LIMITS = {
    "sm_80": SmLimits("sm_80", shared_bytes=164 * 1024),
    "sm_90": SmLimits("sm_90", shared_bytes=228 * 1024),
}


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks per SM of one instance: the binding limit and each resource's own."""

    blocks: int
    by_registers: int
    by_threads: int
    by_blocks: int
    by_shared: int

    @property
    def limiter(self) -> str:
        """The resources that bind (``"registers"``, ``"threads"``, ``"blocks"``, ``"shared"``), joined by ``+``."""
        limits = {"registers": self.by_registers, "threads": self.by_threads, "blocks": self.by_blocks,
                  "shared": self.by_shared}
        return "+".join(name for name, value in limits.items() if value == self.blocks)


def _round_up(value: int, unit: int) -> int:
    return math.ceil(value / unit) * unit


def blocks_per_sm(limits: SmLimits, registers: int, threads: int, shared_bytes: int) -> Occupancy:
    """Resident blocks per SM of a kernel using ``registers`` per thread, ``threads`` per block and
    ``shared_bytes`` of shared memory per block (static plus dynamic). ``blocks`` is 0 when
    one block does not fit at all.

    Raises ValueError for threads outside 1..``limits.max_block_threads`` or negative amounts.
    """
    if not 1 <= threads <= limits.max_block_threads:
        raise ValueError(f"threads per block must be in 1..{limits.max_block_threads}, got {threads}")
    if registers < 0 or shared_bytes < 0:
        raise ValueError(f"registers and shared memory must be >= 0, got {registers} and {shared_bytes}")
    warps = math.ceil(threads / limits.warp_size)
    registers_per_warp = _round_up(registers * limits.warp_size, limits.register_unit)
    by_registers = (limits.registers // registers_per_warp) // warps if registers_per_warp else limits.max_blocks
    by_threads = limits.max_threads // (warps * limits.warp_size)
    by_shared = limits.shared_bytes // _round_up(shared_bytes + limits.shared_reserved, limits.shared_unit)
    return Occupancy(min(by_registers, by_threads, limits.max_blocks, by_shared), by_registers, by_threads,
                     limits.max_blocks, by_shared)


# ---- the attention and linear instances of `python -m cupykv check` ------------------------------
#: The head_dim the generic attention instance (HEAD_DIM = 0) is checked at: the largest a cache
#: allows, whose shared memory, hence occupancy, is the lowest that instance runs at.
GENERIC_HEAD_DIM = MAX_HEAD_DIM


#: CUDA type of a template instance -> the cupykv dtype name
_DTYPE_OF = {cuda: name for name, cuda in CACHE_CUDA_TYPES.items()}


@dataclass(frozen=True)
class LaunchShape:
    """A kernel instance's launch as the host code makes it: threads and dynamic shared memory per block."""

    threads: int
    dynamic_shared_bytes: int
    note: str = ""


def launch_shape(instance: str) -> LaunchShape | None:
    """The block of an attention or ``linear`` instance (from cupykv.attention_plan and cupykv.ops);
    None for the other kernels, whose occupancy the check does not report."""
    from cupykv import attention_plan, ops   # the launch code's own constants, read from the .cu sources
    attention = re.fullmatch(r"cupykv_attention<.+, (\d+)>", instance)
    if attention:
        head_dim = int(attention.group(1))
        note = f"head_dim {head_dim}" if head_dim else f"head_dim {GENERIC_HEAD_DIM} (generic: its largest)"
        return LaunchShape(attention_plan.THREADS, attention_plan.shared_memory_bytes(head_dim or GENERIC_HEAD_DIM),
                           note)
    staged = re.fullmatch(r"cupykv_attention_f32<(\d+)>", instance)
    if staged:
        kernel = attention_plan.attention_kernel("float32", int(staged.group(1)))
        return LaunchShape(kernel.threads, kernel.shared_mem_bytes, f"head_dim {staged.group(1)}, staged K/V")
    tensor_cores = re.fullmatch(r"cupykv_attention_mma<(.+), (.+), (\d+), (\d+)>", instance)
    if tensor_cores:
        dtype, io_dtype = (_DTYPE_OF[name] for name in tensor_cores.group(1, 2))
        head_dim, row_tiles = int(tensor_cores.group(3)), int(tensor_cores.group(4))
        kernel = attention_plan.attention_kernel(dtype, head_dim, io_dtype, attention_plan.TILE_ROWS * row_tiles)
        return LaunchShape(kernel.threads, kernel.shared_mem_bytes,
                           f"head_dim {head_dim}, tensor cores, {kernel.rows_per_block} rows")
    if instance.startswith("cupykv_linear<"):
        return LaunchShape(ops.LINEAR_THREADS, 0)
    if instance.startswith("cupykv_linear_mma<"):
        return LaunchShape(ops.LINEAR_MMA_THREADS, 0, "tensor cores")
    return None


@dataclass(frozen=True)
class OccupancyRow:
    """One instance on one arch: its launch and the blocks per SM it implies."""

    report: InstanceReport
    shape: LaunchShape
    occupancy: Occupancy

    @property
    def shared_bytes(self) -> int:
        return self.report.shared_bytes + self.shape.dynamic_shared_bytes

    @property
    def below_minimum(self) -> bool:
        """Fewer resident blocks than the instance's ``__launch_bounds__`` minimum (or none at all)."""
        return self.occupancy.blocks < max(1, self.report.min_blocks or 0)


def rows(reports) -> list[OccupancyRow]:
    """The occupancy of every attention and ``linear`` instance among ``reports`` (ptxas's
    :class:`cupykv.nvrtc_check.InstanceReport` objects)."""
    found = []
    for r in reports:
        shape = launch_shape(r.instance)
        if shape is None:
            continue
        blocks = blocks_per_sm(LIMITS[r.arch], r.registers, shape.threads, r.shared_bytes + shape.dynamic_shared_bytes)
        found.append(OccupancyRow(r, shape, blocks))
    return found


def format_rows(table) -> str:
    """The rows of :func:`rows` as the text table the check prints."""
    width = max(len(row.report.instance) for row in table)
    lines = [f"{'arch':6} {'instance':{width}} {'regs':>5} {'threads':>7} {'smem':>6} {'blocks/SM':>9} "
             f"{'warps/SM':>8} {'min':>4}  limited by, launch"]
    for row in table:
        r, o = row.report, row.occupancy
        declared = str(r.min_blocks) if r.min_blocks else "-"
        note = f", {row.shape.note}" if row.shape.note else ""
        flag = "  BELOW MINIMUM" if row.below_minimum else ""
        lines.append(f"{r.arch:6} {r.instance:{width}} {r.registers:5d} {row.shape.threads:7d} {row.shared_bytes:6d} "
                     f"{o.blocks:9d} {o.blocks * row.shape.threads // 32:8d} {declared:>4}  {o.limiter}{note}{flag}")
    return "\n".join(lines)
