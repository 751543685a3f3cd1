"""The CUDA C++ sources of cupykv's kernels and the template instances each one exports.

Every op lives in one ``<op>.cu`` file in this folder; ``common.cuh`` holds the
helpers they share. Both backends (CuPy's ``RawModule`` and the CPU emulator)
and the offline NVRTC check compile exactly the instances listed here.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
from dataclasses import dataclass

from cupykv.kernels.cexpr import eval_int

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))

#: dtype name -> the CUDA type of its template instances (activations, weights, and q/out/new rows).
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

#: cache storage dtype name -> its CUDA type: CUDA_TYPES plus the 8-bit float (kv_codec.cuh).
CACHE_CUDA_TYPES = {**CUDA_TYPES, "float8_e4m3": "__nv_fp8_e4m3"}

#: io dtypes an fp8 cache takes its rows in and attends with (CacheSpec.io_dtype).
FP8_IO_DTYPES = ("bfloat16", "float16", "float32")

#: every (storage dtype, io dtype) a cache can have: 16- and 32-bit caches store their io dtype.
CACHE_DTYPE_PAIRS = tuple((dtype, dtype) for dtype in CUDA_TYPES) + tuple(("float8_e4m3", io) for io in FP8_IO_DTYPES)

#: head sizes the staged float32 attention (kernels/attention_f32.cu) is compiled for (its HEAD_DIM).
#: float32 caches of these sizes run on them, and of other multiples of 4 above
#: :data:`ATTENTION_F32_PADDED_ABOVE` on the next one up, padded (:func:`attention_f32_head_dim`); the
#: rest runs on the generic CUDA-core attention (attention.cu, HEAD_DIM = 0).
ATTENTION_HEAD_DIMS = (32, 64, 128, 256)

#: float32 heads of at most this many dims keep the generic kernel: padded onto the 32 instance, a row
#: of 16 floats or fewer would leave more than half of each copy, stage row and FMA to zeros.
ATTENTION_F32_PADDED_ABOVE = 16

#: head sizes the tensor-core attention (kernels/attention_mma.cu) is compiled for (its HEAD_DIM).
#: 16-bit and fp8 caches of these sizes run on them, and caches of a smaller size on the next one up,
#: padded (:func:`attention_mma_head_dim`); the rest runs on CUDA cores at HEAD_DIM = 0.
ATTENTION_MMA_HEAD_DIMS = (64, 96, 128, 256)

#: bytes of one element of a cache's storage dtype.
CACHE_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1}


def attention_f32_head_dim(dtype: str, head_dim: int) -> int | None:
    """The HEAD_DIM of the staged float32 instance that attends over a ``dtype`` cache of ``head_dim``, or
    None where the cache runs elsewhere.

    float32 caches whose rows are whole 16-byte copies (``head_dim`` a multiple of 4) above
    :data:`ATTENTION_F32_PADDED_ABOVE` and up to 256 run on the smallest of :data:`ATTENTION_HEAD_DIMS`
    that holds them: at their own size, or padded (head_dim 80 and 96 on the 128 instance, 48 on 64, 24
    on 32, 192 on 256).
    Padded dims are zeros in q and in the K/V stages, copied from nothing, so the cache bytes read are
    the same; only the arithmetic grows, by ``HEAD_DIM / head_dim``.
    """
    if dtype != "float32" or head_dim % 4 or not ATTENTION_F32_PADDED_ABOVE < head_dim <= ATTENTION_HEAD_DIMS[-1]:
        return None
    return next(size for size in ATTENTION_HEAD_DIMS if size >= head_dim)


def attention_mma_head_dim(dtype: str, head_dim: int) -> int | None:
    """The HEAD_DIM of the tensor-core instance that attends over a ``dtype`` cache of ``head_dim``,
    or None where the cache runs on CUDA cores.

    16-bit and fp8 caches whose rows are whole 16-byte copies (``head_dim`` a multiple of 8, or of
    16 for fp8) run on the smallest of :data:`ATTENTION_MMA_HEAD_DIMS` that holds them: at their own
    size, or padded (head_dim 80 on the 96 instance, 40 on 64, 160 on 256). Padded dims are zeros in
    q and in the K/V stages, copied from nothing, so the cache bytes read are the same; only the
    mma work grows, by ``HEAD_DIM / head_dim``. float32 caches, and other sizes, return None.
    """
    if dtype == "float32" or head_dim % (16 // CACHE_ITEM_BYTES[dtype]) != 0:
        return None
    return next((size for size in ATTENTION_MMA_HEAD_DIMS if size >= head_dim), None)

#: m16 row tiles per block of the tensor-core attention: 1 for up to 16 query rows per sequence and
#: kv head (q_len x group), 2 for up to 32, 4 past that (two row groups of warps sharing the K/V
#: stages). Head_dim 256 takes 1 or 2 (:func:`attention_mma_row_tiles`).
ATTENTION_MMA_ROW_TILES = (1, 2, 4)


def attention_mma_row_tiles(head_dim: int) -> tuple[int, ...]:
    """The row tiles per block the tensor-core attention has at ``head_dim``: all of
    ATTENTION_MMA_ROW_TILES, or 1 and 2 at head_dim 256, where four tiles' q pieces and stages
    (132 KiB) would pass the 99 KiB of shared memory a block may have on sm_86 and sm_89."""
    return ATTENTION_MMA_ROW_TILES[:2] if head_dim == 256 else ATTENTION_MMA_ROW_TILES

#: rows a linear warp accumulates at once; one instance each (see kernels/linear.cu).
LINEAR_ROW_TILES = (1, 2, 4, 8, 16)

#: row tiles of the tensor-core linear (kernels/linear_mma.cu): 8 rows (half an mma) or 16.
LINEAR_MMA_ROW_TILES = (8, 16)

#: dtypes whose linear runs on tensor cores (where in_features and alignment allow).
LINEAR_MMA_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class KernelFile:
    """One ``.cu`` file and the kernel instances (NVRTC name expressions) it exports."""

    filename: str
    instances: tuple[str, ...]

    def source(self, kernel_dir: str = KERNEL_DIR) -> str:
        with open(os.path.join(kernel_dir, self.filename), encoding="utf-8") as f:
            return f.read()

    def module_source(self, kernel_dir: str = KERNEL_DIR) -> str:
        """The source as handed to a compiler whose cache sees only this text.

        CuPy's on-disk module cache keys on the ``.cu`` text, the options and
        the name expressions, not on the headers the text includes. The
        source is therefore followed by one comment line holding the sha256
        of every header in ``kernel_dir``: editing ``common.cuh`` (or
        upgrading cupykv in place) changes the text, so CuPy compiles a new
        module instead of loading a stale cubin. Line numbers are unchanged.
        """
        return f"{self.source(kernel_dir)}\n// cupykv headers sha256 {header_digest(kernel_dir)}\n"

    def constants(self, namespace: str, kernel_dir: str = KERNEL_DIR) -> dict[str, int]:
        """The ``constexpr int`` constants of ``namespace { ... }`` in this file, by name.

        The launch code reads a kernel's tiling (threads per block, rows per
        tile) from the ``.cu`` source itself, so the two cannot drift apart.
        Each constant is an int literal or integer arithmetic (``+ - * /``,
        parentheses) on constants defined before it; anything else raises
        ValueError, as does a missing namespace.
        """
        return parse_constants(self.source(kernel_dir), namespace, self.filename)


def _per_type(template: str) -> tuple[str, ...]:
    return tuple(template.format(t=t) for t in CUDA_TYPES.values())


def cache_types(dtype: str, io_dtype: str) -> str:
    """``"T, TI"``: the template arguments of a cache kernel for storage ``dtype`` and ``io_dtype``."""
    return f"{CACHE_CUDA_TYPES[dtype]}, {CUDA_TYPES[io_dtype]}"


def _per_cache(template: str) -> tuple[str, ...]:
    return tuple(template.format(types=cache_types(dtype, io)) for dtype, io in CACHE_DTYPE_PAIRS)


KERNELS: dict[str, KernelFile] = {
    "append": KernelFile("append.cu", _per_cache("cupykv_append<{types}>")),
    "write": KernelFile("write.cu", _per_cache("cupykv_write<{types}>")),
    "advance": KernelFile("advance.cu", ("cupykv_advance",)),
    "set_lengths": KernelFile("set_lengths.cu", ("cupykv_set_lengths",)),
    "truncate": KernelFile("truncate.cu", ("cupykv_truncate",)),
    "reset": KernelFile("reset.cu", ("cupykv_reset",)),
    "additive_mask": KernelFile("additive_mask.cu", ("cupykv_additive_mask",)),
    "attention": KernelFile(
        "attention.cu",
        # the generic path: float32 caches at the sizes attention_f32.cu does not take, 16-bit and fp8
        # caches at those attention_mma.cu does not take (rows that are not whole 16-byte copies)
        tuple(f"cupykv_attention<{cache_types(dtype, io)}, 0>" for dtype, io in CACHE_DTYPE_PAIRS),
    ),
    # float32 caches at head_dim 32, 64, 128 and 256, and other multiples of 4 above 16 padded onto them
    # (attention_f32_head_dim): K/V staged by cp.async, on CUDA cores
    "attention_f32": KernelFile("attention_f32.cu", tuple(f"cupykv_attention_f32<{hd}>" for hd in ATTENTION_HEAD_DIMS)),
    # the tensor-core path of 16-bit and fp8 caches, compiled at head_dim 64, 96, 128 and 256 (smaller
    # sizes run padded on the next one up: attention_mma_head_dim)
    "attention_mma": KernelFile(
        "attention_mma.cu",
        tuple(f"cupykv_attention_mma<{cache_types(dtype, io)}, {hd}, {tiles}>" for dtype, io in CACHE_DTYPE_PAIRS
              if dtype != "float32" for hd in ATTENTION_MMA_HEAD_DIMS for tiles in attention_mma_row_tiles(hd)),
    ),
    # decoder ops (cupykv.ops): everything a LLaMA-style decode step needs besides attention
    "linear": KernelFile(
        "linear.cu", tuple(f"cupykv_linear<{t}, {tile}>" for t in CUDA_TYPES.values() for tile in LINEAR_ROW_TILES)
    ),
    # its tensor-core path for 16-bit x and weight (cupykv.ops.linear picks it)
    "linear_mma": KernelFile(
        "linear_mma.cu", tuple(f"cupykv_linear_mma<{CUDA_TYPES[d]}, {tile}>" for d in LINEAR_MMA_DTYPES
                               for tile in LINEAR_MMA_ROW_TILES)
    ),
    "embedding": KernelFile("embedding.cu", _per_type("cupykv_embedding<{t}>")),
    "rmsnorm": KernelFile("rmsnorm.cu", _per_type("cupykv_rmsnorm<{t}>")),
    "silu_mul": KernelFile("silu_mul.cu", _per_type("cupykv_silu_mul<{t}>")),
    "add": KernelFile("add.cu", _per_type("cupykv_add<{t}>")),
    "argmax": KernelFile("argmax.cu", _per_type("cupykv_argmax<{t}>")),
    "delay": KernelFile("delay.cu", ("cupykv_delay",)),  # the bench timer's guard (bench/timing.py)
    # decoding loops on the device (cupykv.models.decoding): stopping, and the speculative cycle
    "decode_commit": KernelFile("decode_commit.cu", ("cupykv_decode_commit",)),
    "speculative": KernelFile("speculative.cu", ("cupykv_speculative_gather", "cupykv_speculative_accept")),
}


def parse_constants(source: str, namespace: str, filename: str = "<source>") -> dict[str, int]:
    """``constexpr int NAME = EXPR;`` statements (one or more lines each) of ``namespace <namespace> { ... }``
    in CUDA C++ ``source``."""
    block = re.search(r"namespace\s+" + re.escape(namespace) + r"\s*\{(.*?)\}\s*//\s*namespace", source, re.S)
    if block is None:
        raise ValueError(f"{filename}: no 'namespace {namespace} {{ ... }}  // namespace' block")
    constants: dict[str, int] = {}
    code_only = " ".join(line.split("//")[0] for line in block.group(1).splitlines())
    *statements, unterminated = code_only.split(";")
    if unterminated.strip():
        statements.append(unterminated)   # reported below: no ';' after it
    for statement in statements:
        code = " ".join(statement.split())   # a statement may span lines
        if not code:
            continue
        code += ";" if statement is not unterminated else ""
        match = re.fullmatch(r"constexpr\s+int\s+(\w+)\s*=\s*([^;]+);", code)
        if match is None:
            raise ValueError(f"{filename}: namespace {namespace}: expected 'constexpr int NAME = EXPR;', got {code!r}")
        constants[match.group(1)] = _integer_expression(match.group(2), constants, f"{filename}: {code!r}")
    return constants


def _integer_expression(text: str, known: dict[str, int], where: str) -> int:
    """Value of C integer arithmetic ``text`` over the ``known`` constants."""
    def substitute(match):
        if match.group() not in known:
            raise ValueError(f"{where}: unknown name {match.group()!r} (only earlier constants are understood)")
        return f"({known[match.group()]})"
    try:
        return eval_int(re.sub(r"[A-Za-z_]\w*", substitute, text.strip()))
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"{where}: not an integer constant expression ({error})") from None


def header_digest(kernel_dir: str = KERNEL_DIR) -> str:
    """sha256 over the names and contents of the ``.cuh`` headers in ``kernel_dir``."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(kernel_dir, "*.cuh"))):
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def attention_instance(dtype: str, head_dim: int, io_dtype: str | None = None, row_tiles: int = 1) -> tuple[str, str]:
    """``(op, instance)`` of the attention kernel for a cache's storage and io dtypes and head size.

    16-bit and fp8 caches run on tensor cores (``attention_mma.cu``) at the instance
    :func:`attention_mma_head_dim` gives; float32 caches on CUDA cores with staged K/V
    (``attention_f32.cu``) at the instance :func:`attention_f32_head_dim` gives; the other head sizes on
    the generic CUDA-core kernel (``attention.cu``). ``io_dtype`` defaults to ``dtype`` (it must be
    given for an fp8 cache).
    ``row_tiles``: the tensor-core kernel's m16 row tiles per block, one of
    :func:`attention_mma_row_tiles` of that instance (``cupykv.attention_plan`` picks it from the
    query shape; the CUDA-core kernel has no such choice).
    """
    types = cache_types(dtype, io_dtype or dtype)
    instance_head_dim = attention_mma_head_dim(dtype, head_dim)
    if instance_head_dim is not None:
        if row_tiles not in attention_mma_row_tiles(instance_head_dim):
            raise ValueError(f"row_tiles: expected one of {attention_mma_row_tiles(instance_head_dim)} at head_dim "
                             f"{head_dim}, got {row_tiles!r}")
        return "attention_mma", f"cupykv_attention_mma<{types}, {instance_head_dim}, {row_tiles}>"
    staged_head_dim = attention_f32_head_dim(dtype, head_dim)
    if staged_head_dim is not None:
        return "attention_f32", f"cupykv_attention_f32<{staged_head_dim}>"
    return "attention", f"cupykv_attention<{types}, 0>"


def cuda_paths(wheel_globs, toolkit_glob) -> list[str]:
    """CUDA files found by glob: first in NVIDIA's pip wheels on ``sys.path``, then in a toolkit.

    ``wheel_globs`` are relative to ``site-packages/nvidia`` (e.g. ``"cu*/include"``);
    ``toolkit_glob`` is relative to ``$CUDA_PATH``, ``$CUDA_HOME`` and ``/usr/local/cuda``.
    """
    found = []
    for entry in sys.path:
        for pattern in wheel_globs:
            found += sorted(glob.glob(os.path.join(entry, "nvidia", pattern)))
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            found += sorted(glob.glob(os.path.join(root, toolkit_glob)))
    return found


def cuda_include_dirs() -> list[str]:
    """Folders holding cuda_fp16.h / cuda_bf16.h: the nvidia-cuda-runtime wheel, then a toolkit."""
    return [d for d in cuda_paths(("cu*/include",), "include") if os.path.exists(os.path.join(d, "cuda_fp16.h"))]
