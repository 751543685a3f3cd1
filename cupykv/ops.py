"""Decoder ops for a decode step that is captured whole in a CUDA graph.

``linear``, ``embedding``, ``rmsnorm``, ``silu_mul``, ``add`` and ``argmax``:
with :func:`cupykv.attention` and the cache, everything a LLaMA-style decoder
runs per token, without cuBLAS (which CuPy refuses during stream capture).
Each op checks its arguments, then makes one launch of ``kernels/<op>.cu``;
the kernel header comments give the launch geometry.

Arrays are device arrays of one backend: ``cupy.ndarray`` (backend "cupy") or
the emulator's ``numpy.ndarray`` (backend "emulator"), inferred from the first
array argument when ``backend`` is ``None``. Float operands are float32,
float16 or bfloat16 (``ml_dtypes.bfloat16`` on the emulator, uint16 bit
patterns on CuPy), all of one dtype per call; math is fp32 and each output is
rounded once to that dtype. Pass ``out=`` (and ``error_flag=`` for
``embedding``) to write preallocated buffers: the graph-safe form, which
allocates nothing. ``cupykv.ops_reference`` is the NumPy oracle with the same
names and signatures.

Arguments are checked by ``cupykv._args`` before any launch; errors name
the argument: ``TypeError`` for a wrong type, device or dtype, ``ValueError``
for a wrong shape, layout or value, a read-only or overlapping output, or a
launch past CUDA's limits. Every operand is C-contiguous (a strided or
reversed view is refused; a contiguous view at an offset is used as it is).
An output may not share memory with an input, except where an op says it may
be that input exactly (in place), nor with the buffers of any KVCache.

Every op takes ``run_if=``, a device int32 array ``[1]`` that its kernel reads
first, at run time: where it holds 0 the launch returns at once, reading
nothing else and writing nothing (``out``, ``error_flag`` keep their bytes; an
output the call allocated holds zeros); any other value, or ``None``, runs the
op as usual. Because the word is read on the device, a captured graph sees its
value at every replay: a decode loop that captures several steps in one graph
clears it once every sequence has stopped, and the remaining launches do no
work. It is the caller's buffer (or ``Backend.always_run()``), C-contiguous,
and may not overlap what the launch writes or any buffer of a KVCache or
AttentionPlan; it may be an input.
"""
from __future__ import annotations

import math

import numpy as np

from cupykv import _args
from cupykv._typing import ArrayLike, DeviceArray, FloatLike
from cupykv.backends.base import Backend
from cupykv.kernels import CUDA_TYPES, KERNELS, LINEAR_MMA_DTYPES, LINEAR_MMA_ROW_TILES, LINEAR_ROW_TILES

__all__ = ["linear", "embedding", "rmsnorm", "silu_mul", "add", "argmax"]

_LINEAR_TILING = KERNELS["linear"].constants("linear_tiling")   # read from kernels/linear.cu
LINEAR_THREADS = _LINEAR_TILING["kThreads"]
LINEAR_WARPS = _LINEAR_TILING["kWarps"]
LINEAR_OUTS_PER_WARP = _LINEAR_TILING["kOutsPerWarp"]
#: Projections narrower than this split in_features between two warps per pair of outputs: below
#: it, one warp per 2 outputs leaves an H200 (132 SMs x 64 warps) short of warps; above it the
#: split only adds a reduction. The choice depends on the weight's shape alone, never on rows.
LINEAR_SPLIT_K_BELOW_OUTS = 16384


def linear_split_k(out_features: int) -> int:
    """Warps sharing each pair of outputs of a CUDA-core ``linear`` launch (2 for narrow projections, else 1)."""
    return _LINEAR_TILING["kMaxSplitK"] if out_features < LINEAR_SPLIT_K_BELOW_OUTS else 1


_LINEAR_MMA_TILING = KERNELS["linear_mma"].constants("linear_mma_tiling")   # read from kernels/linear_mma.cu
LINEAR_MMA_THREADS = _LINEAR_MMA_TILING["kThreads"]
LINEAR_MMA_WARPS = _LINEAR_MMA_TILING["kWarps"]
LINEAR_MMA_OUTS_PER_WARP = _LINEAR_MMA_TILING["kOutsPerWarp"]
LINEAR_MMA_STEP_FEATURES = _LINEAR_MMA_TILING["kStepFeatures"]
#: Warps a tensor-core ``linear`` launch aims for: an H200's 132 SMs x 2 blocks x 8 warps, rounded.
LINEAR_MMA_WARPS_WANTED = 2048
#: Fewest warp steps (of LINEAR_MMA_STEP_FEATURES in_features) a split part keeps.
LINEAR_MMA_MIN_STEPS = 4


def linear_mma_split_k(out_features: int, in_features: int) -> int:
    """Warps sharing each 8 outputs of a tensor-core ``linear`` launch: 1, 2, 4 or 8.

    Doubled while the launch has fewer than ``LINEAR_MMA_WARPS_WANTED`` warps and each part would
    keep at least ``LINEAR_MMA_MIN_STEPS`` steps: 8 for a 1024 x 4096 projection, 1 for a
    128256-row LM head. It depends on the weight's shape alone, never on the number of rows.
    """
    groups = math.ceil(out_features / LINEAR_MMA_OUTS_PER_WARP)
    steps = math.ceil(in_features / LINEAR_MMA_STEP_FEATURES)
    split = 1
    while (split < _LINEAR_MMA_TILING["kMaxSplitK"] and groups * split < LINEAR_MMA_WARPS_WANTED
           and steps // (2 * split) >= LINEAR_MMA_MIN_STEPS):
        split *= 2
    return split


def linear_uses_tensor_cores(dtype: str, x: DeviceArray, weight: DeviceArray) -> bool:
    """Whether :func:`linear` runs ``x @ weight.T`` (both of ``dtype``) on tensor cores
    (kernels/linear_mma.cu): float16 or bfloat16, ``in_features`` a multiple of 8, both arrays
    16-byte aligned. It never depends on the number of rows."""
    return (dtype in LINEAR_MMA_DTYPES and weight.shape[1] % _LINEAR_MMA_TILING["kVec"] == 0
            and _args.byte_range(x)[0] % 16 == 0 and _args.byte_range(weight)[0] % 16 == 0)


EMBEDDING_THREADS = 128
RMSNORM_MAX_THREADS = 256
ARGMAX_MAX_THREADS = 512
ELEMENTWISE_MAX_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 1024  # grid-stride loops cover the rest


def _row_threads(n: int, limit: int) -> int:
    """Threads for one block per row: ``n`` rounded up to a warp, at most ``limit``."""
    return min(limit, 32 * math.ceil(n / 32))


# -- ops --------------------------------------------------------------------------
def linear(x: ArrayLike, weight: ArrayLike, *, out: ArrayLike | None = None,
           backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out = x @ weight.T``: the projection of a few rows (GEMV / skinny GEMM).

    Each weight element is read from global memory once per launch for up to
    16 rows (once per 16-row tile beyond), in 16-byte vectors when
    ``in_features`` allows; accumulation is fp32. float16 and bfloat16 run on
    tensor cores when ``in_features`` is a multiple of 8 and both arrays are
    16-byte aligned (:func:`linear_uses_tensor_cores`); a row's result never
    depends on the other rows of the call.

    Graph-safe: yes, with ``out=`` — one launch into ``out``; without ``out`` the output is allocated,
    which a captured step refuses (CaptureError).

    Parameters
    ----------
    x : device array ``[rows, in_features]``
        rows = batch * q_len in a decode step; any sizes in 1..2**31-1.
    weight : device array ``[out_features, in_features]``
        The HF / PyTorch layout, row-major, the dtype of ``x``.
    out : device array ``[rows, out_features]``, optional
        Written in place and returned; must not overlap ``x`` or ``weight``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``x`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, read on the device at run time: 0 makes the launch
        return at once, reading nothing else (not one weight byte) and writing
        nothing, so ``out`` keeps its bytes; any other value, or ``None``, runs
        the op. Must not overlap ``out`` or a buffer of a KVCache or
        AttentionPlan (see the module docstring).

    Returns
    -------
    device array ``[rows, out_features]`` in the dtype of ``x``; with ``run_if`` holding 0,
    ``out`` as it was (zeros when the call allocated it).

    Raises
    ------
    TypeError
        An argument of the wrong type, device or dtype (``run_if`` included).
    ValueError
        Mismatched ``in_features``, a wrong shape (``run_if`` not ``[1]``), a
        non-contiguous array, a read-only ``out``, ``out`` overlapping an
        input, or ``run_if`` overlapping ``out`` or a cache's or plan's buffers.
    CaptureError
        No ``out`` inside a captured step.
    """
    backend = _args.backend_for("x", x, backend)
    x, dtype = _args.float_operand("x", x, backend)
    rows, in_features = _args.check_shape("x", x, (None, None), ("rows", "in_features"))
    weight, _ = _args.float_operand("weight", weight, backend, dtype, "x")
    out_features, _ = _args.check_shape("weight", weight, (None, in_features), ("out_features", "in_features"))
    word = _args.run_if_operand(run_if, backend)
    tiles: tuple[int, ...]
    if linear_uses_tensor_cores(dtype, x, weight):
        kernel, tiles = "linear_mma", LINEAR_MMA_ROW_TILES
        split_k = linear_mma_split_k(out_features, in_features)
        outs_per_block, threads = LINEAR_MMA_WARPS // split_k * LINEAR_MMA_OUTS_PER_WARP, LINEAR_MMA_THREADS
    else:
        kernel, tiles = "linear", LINEAR_ROW_TILES
        split_k = linear_split_k(out_features)
        outs_per_block, threads = LINEAR_WARPS // split_k * LINEAR_OUTS_PER_WARP, LINEAR_THREADS
    grid, block = (math.ceil(out_features / outs_per_block),), (threads,)
    _args.check_launch("weight", f"out_features = {out_features}", grid, block)
    out = _args.float_output(out, backend, dtype, (rows, out_features), "x", inputs=[("x", x), ("weight", weight)])
    word = _args.run_if_word(word, backend, [("out", out)])
    tile = next((t for t in tiles if t >= rows), tiles[-1])
    backend.launch(kernel, f"cupykv_{kernel}<{CUDA_TYPES[dtype]}, {tile}>", grid, block,
                   (out, x, weight, np.int32(rows), np.int32(in_features), np.int32(out_features), np.int32(split_k),
                    word))
    return out


def embedding(ids: ArrayLike, table: ArrayLike, *, out: ArrayLike | None = None, error_flag: ArrayLike | None = None,
              backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out[r] = table[ids[r]]``: token embeddings gathered at device-resident ids.

    Rows are copied bit for bit. An id outside ``0..vocab-1`` gives a row of
    zeros and sets ``error_flag[0] = 1`` (never cleared here).

    Graph-safe: yes, with ``out=`` and ``error_flag=`` — one launch into them; without either, it is
    allocated, which a captured step refuses (CaptureError).

    Parameters
    ----------
    ids : device int32 array ``[rows]``
        Read on the device at launch time (e.g. written by :func:`argmax`).
    table : device array ``[vocab, hidden]``
    out : device array ``[rows, hidden]``, optional
        Written in place and returned; must not overlap ``ids`` or ``table``.
    error_flag : device int32 array ``[1]``, optional
        Set to 1 when an id is out of range; must not overlap ``ids``,
        ``table`` or ``out``. Without it a scratch flag is allocated and bad
        ids only show as zero rows.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``ids`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, as for :func:`linear`: 0 leaves ``out`` and
        ``error_flag`` untouched. Must not overlap either, nor a buffer of a
        KVCache or AttentionPlan.

    Returns
    -------
    device array ``[rows, hidden]`` in the dtype of ``table``; with ``run_if`` holding 0,
    ``out`` as it was (zeros when the call allocated it).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`.
    CaptureError
        No ``out`` or no ``error_flag`` inside a captured step.
    """
    backend = _args.backend_for("ids", ids, backend)
    ids = _args.int32_operand("ids", ids, backend)
    (rows,) = _args.check_shape("ids", ids, (None,), ("rows",))
    table, dtype = _args.float_operand("table", table, backend)
    vocab, hidden = _args.check_shape("table", table, (None, None), ("vocab", "hidden"))
    word = _args.run_if_operand(run_if, backend)
    grid, block = (rows,), (EMBEDDING_THREADS,)
    _args.check_launch("ids", f"rows = {rows}", grid, block)
    if error_flag is not None:
        error_flag = _args.int32_operand("error_flag", error_flag, backend, written=True)
        _args.check_shape("error_flag", error_flag, (1,))
        _args.check_no_overlap("error_flag", error_flag, [("ids", ids), ("table", table)])
    out = _args.float_output(out, backend, dtype, (rows, hidden), "table",
                             inputs=[("ids", ids), ("table", table), ("error_flag", error_flag)])
    word = _args.run_if_word(word, backend, [("out", out), ("error_flag", error_flag)])
    if error_flag is None:
        error_flag = backend.zeros((1,), np.int32)
    backend.launch("embedding", f"cupykv_embedding<{CUDA_TYPES[dtype]}>", grid, block,
                   (out, table, ids, error_flag, np.int32(vocab), np.int32(hidden), word))
    return out


def rmsnorm(x: ArrayLike, weight: ArrayLike, eps: FloatLike, *, out: ArrayLike | None = None,
            backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * weight``, per row, in fp32.

    Graph-safe: yes, with ``out=`` — one launch into ``out``; without ``out`` the output is allocated,
    which a captured step refuses (CaptureError).

    Parameters
    ----------
    x : device array ``[rows, hidden]``
    weight : device array ``[hidden]``, the dtype of ``x``
    eps : float
        A normal float32 > 0 (the kernel adds it in float32: 1e-50 would be 0 there).
    out : device array ``[rows, hidden]``, optional
        Written in place and returned; may be ``x`` exactly (in place), must
        not otherwise overlap ``x`` or ``weight``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``x`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, as for :func:`linear`: 0 leaves ``out`` untouched.
        Must not overlap ``out`` or a buffer of a KVCache or AttentionPlan.

    Returns
    -------
    device array ``[rows, hidden]`` in the dtype of ``x``; with ``run_if`` holding 0, ``out``
    as it was (zeros when the call allocated it).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`, and ``eps`` out of range.
    CaptureError
        No ``out`` inside a captured step.
    """
    backend = _args.backend_for("x", x, backend)
    x, dtype = _args.float_operand("x", x, backend)
    rows, hidden = _args.check_shape("x", x, (None, None), ("rows", "hidden"))
    weight, _ = _args.float_operand("weight", weight, backend, dtype, "x")
    _args.check_shape("weight", weight, (hidden,), ("hidden",))
    eps = _args.check_positive_float32("eps", eps)
    word = _args.run_if_operand(run_if, backend)
    grid, block = (rows,), (_row_threads(hidden, RMSNORM_MAX_THREADS),)
    _args.check_launch("x", f"rows = {rows}", grid, block)
    out = _args.float_output(out, backend, dtype, (rows, hidden), "x", inputs=[("weight", weight)],
                             in_place_inputs=[("x", x)])
    word = _args.run_if_word(word, backend, [("out", out)])
    backend.launch("rmsnorm", f"cupykv_rmsnorm<{CUDA_TYPES[dtype]}>", grid, block,
                   (out, x, weight, np.int32(hidden), np.float32(eps), word))
    return out


def _elementwise(op: str, name_a: str, a: ArrayLike, name_b: str, b: ArrayLike, out: ArrayLike | None,
                 backend: str | Backend | None, run_if: ArrayLike | None) -> DeviceArray:
    """Shared body of the two-input elementwise ops (same shape, any rank >= 1)."""
    backend = _args.backend_for(name_a, a, backend)
    a, dtype = _args.float_operand(name_a, a, backend)
    shape = tuple(a.shape)
    if not shape or not all(1 <= size for size in shape) or math.prod(shape) > 2**62:
        raise ValueError(f"{name_a}: expected an array of rank >= 1 with every size >= 1, got shape {shape}")
    b, _ = _args.float_operand(name_b, b, backend, dtype, name_a)
    _args.check_same_shape(name_a, a, name_b, b)
    word = _args.run_if_operand(run_if, backend)
    n = math.prod(shape)
    packs = math.ceil(n / (16 // a.dtype.itemsize))
    threads = _row_threads(packs, ELEMENTWISE_MAX_THREADS)
    grid, block = (min(ELEMENTWISE_MAX_BLOCKS, math.ceil(packs / threads)),), (threads,)
    _args.check_launch(name_a, f"shape {shape}", grid, block)
    out = _args.float_output(out, backend, dtype, shape, name_a, in_place_inputs=[(name_a, a), (name_b, b)])
    word = _args.run_if_word(word, backend, [("out", out)])
    backend.launch(op, f"cupykv_{op}<{CUDA_TYPES[dtype]}>", grid, block, (out, a, b, np.int64(n), word))
    return out


def silu_mul(gate: ArrayLike, up: ArrayLike, *, out: ArrayLike | None = None,
             backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out = silu(gate) * up = gate / (1 + exp(-gate)) * up``, elementwise (SwiGLU), in fp32.

    Graph-safe: yes, with ``out=`` — one launch into ``out``; without ``out`` the output is allocated,
    which a captured step refuses (CaptureError).

    Parameters
    ----------
    gate, up : device arrays of one shape and dtype (e.g. ``[rows, intermediate]``)
    out : device array of that shape, optional
        Written in place and returned; may be ``gate`` or ``up`` exactly (in
        place), must not otherwise overlap either (a view shifted by one
        element would read values the launch already wrote).
    backend : {"cupy", "emulator"}, optional
        Inferred from ``gate`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, as for :func:`linear`: 0 leaves ``out`` untouched.
        Must not overlap ``out`` or a buffer of a KVCache or AttentionPlan.

    Returns
    -------
    device array of the shape and dtype of ``gate``; with ``run_if`` holding 0, ``out`` as it
    was (zeros when the call allocated it).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`; and ``gate``, ``up`` of different shapes or dtypes.
    CaptureError
        No ``out`` inside a captured step.
    """
    return _elementwise("silu_mul", "gate", gate, "up", up, out, backend, run_if)


def add(a: ArrayLike, b: ArrayLike, *, out: ArrayLike | None = None,
        backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out = a + b``, elementwise (the residual connection), in fp32.

    Graph-safe: yes, with ``out=`` — one launch into ``out``; without ``out`` the output is allocated,
    which a captured step refuses (CaptureError).

    Parameters
    ----------
    a, b : device arrays of one shape and dtype (e.g. ``[rows, hidden]``)
    out : device array of that shape, optional
        Written in place and returned; may be ``a`` or ``b`` exactly (in
        place), must not otherwise overlap either.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``a`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, as for :func:`linear`: 0 leaves ``out`` untouched.
        Must not overlap ``out`` or a buffer of a KVCache or AttentionPlan.

    Returns
    -------
    device array of the shape and dtype of ``a``; with ``run_if`` holding 0, ``out`` as it
    was (zeros when the call allocated it).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`; and ``a``, ``b`` of different shapes or dtypes.
    CaptureError
        No ``out`` inside a captured step.
    """
    return _elementwise("add", "a", a, "b", b, out, backend, run_if)


def argmax(logits: ArrayLike, *, out: ArrayLike | None = None,
           backend: str | Backend | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """``out[r] = argmax(logits[r])`` as int32 (greedy sampling), the lowest index on ties.

    NaN ranks above every number, as in NumPy and PyTorch: a row holding a NaN gives
    its first NaN's index (a corrupted row is seen as such, not hidden behind its largest
    number). A row of -inf, or of NaN, gives 0, an id inside the vocabulary. The ids stay
    on the device, so the next replay of a captured decode step can feed them to
    :func:`embedding`.

    Graph-safe: yes, with ``out=`` — one launch into ``out``; without ``out`` the output is allocated,
    which a captured step refuses (CaptureError).

    Parameters
    ----------
    logits : device array ``[rows, vocab]``
    out : device int32 array ``[rows]``, optional
        Written in place and returned; must not overlap ``logits``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``logits`` by default.
    run_if : device int32 array ``[1]``, optional
        The launch's gate, as for :func:`linear`: 0 leaves ``out`` untouched.
        Must not overlap ``out`` or a buffer of a KVCache or AttentionPlan.

    Returns
    -------
    device int32 array ``[rows]``; with ``run_if`` holding 0, ``out`` as it was (zeros when
    the call allocated it).

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`.
    CaptureError
        No ``out`` inside a captured step.
    """
    backend = _args.backend_for("logits", logits, backend)
    logits, dtype = _args.float_operand("logits", logits, backend)
    rows, vocab = _args.check_shape("logits", logits, (None, None), ("rows", "vocab"))
    word = _args.run_if_operand(run_if, backend)
    grid, block = (rows,), (_row_threads(vocab, ARGMAX_MAX_THREADS),)
    _args.check_launch("logits", f"rows = {rows}", grid, block)
    if out is None:
        out = backend.zeros((rows,), np.int32)
    else:
        out = _args.int32_operand("out", out, backend, written=True)
        _args.check_shape("out", out, (rows,))
        _args.check_no_overlap("out", out, [("logits", logits)])
    word = _args.run_if_word(word, backend, [("out", out)])
    backend.launch("argmax", f"cupykv_argmax<{CUDA_TYPES[dtype]}>", grid, block,
                   (out, logits, np.int32(vocab), word))
    return out
