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

Errors name the argument: ``TypeError`` for a wrong type, device or dtype,
``ValueError`` for a wrong shape, layout or value.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from cupykv import _checks
from cupykv._inputs import _describe, _to_backend_array, device_input
from cupykv.backends import get_backend
from cupykv.kernels import CUDA_TYPES, LINEAR_ROW_TILES

__all__ = ["linear", "embedding", "rmsnorm", "silu_mul", "add", "argmax"]

LINEAR_THREADS = 128          # linear_tiling::kThreads in kernels/linear.cu
LINEAR_OUTS_PER_BLOCK = 8     # linear_tiling::kOutsPerBlock
EMBEDDING_THREADS = 128
RMSNORM_MAX_THREADS = 256
ARGMAX_MAX_THREADS = 512
ELEMENTWISE_MAX_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 1024  # grid-stride loops cover the rest
_INT32_MAX = 2**31 - 1

# array dtype -> dtype name; uint16 holds bfloat16 bit patterns (CuPy has no bfloat16)
_FLOAT_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                 np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.uint16): "bfloat16"}


# -- argument checks ------------------------------------------------------------
def _backend_for(name, array, backend):
    """The backend named by ``backend``, else the one ``array`` belongs to.

    ``cupy.ndarray`` (or any ``__cuda_array_interface__`` object) -> "cupy",
    ``numpy.ndarray`` -> "emulator".
    """
    if backend is not None:
        return get_backend(backend)
    if isinstance(array, np.ndarray):
        return get_backend("emulator")
    if type(array).__module__.split(".")[0] == "cupy" or hasattr(array, "__cuda_array_interface__"):
        return get_backend("cupy")
    raise TypeError(f"{name}: expected a cupy.ndarray, or a numpy.ndarray for the emulator backend, "
                    f"got {_describe(array)}")


def _float_operand(name, array, backend, dtype=None, like=None):
    """``array`` as a contiguous float array of ``backend``; returns ``(array, dtype name)``.

    With ``dtype``, the array must have that dtype (the one of argument ``like``).
    """
    array = _to_backend_array(name, array, backend)
    found = _FLOAT_DTYPES.get(np.dtype(array.dtype))
    if found is None:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16 (uint16 bit patterns on cupy), "
                        f"got {np.dtype(array.dtype)}")
    if dtype is not None and found != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the dtype of {like}), got {np.dtype(array.dtype)}")
    return device_input(name, array, backend, found), found


def _int32_operand(name, array, backend):
    """``array`` as a contiguous int32 array of ``backend``."""
    array = _to_backend_array(name, array, backend)
    backend.check_device(name, array)
    if np.dtype(array.dtype) != np.int32:
        raise TypeError(f"{name}: expected dtype int32, got {np.dtype(array.dtype)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {array.strides} "
                         f"for shape {tuple(array.shape)}; pass a contiguous copy")
    return array


def _check_shape(name, array, expected, axes=None):
    """Check ``array.shape`` against ``expected`` (ints, or None for any size >= 1).

    Every size must fit the kernels' int32 arithmetic. ``axes`` names the axes
    for the message, e.g. ``weight: expected shape (out_features, 64)
    [out_features, in_features], got (5, 63)``.
    """
    shape = tuple(array.shape)
    ok = len(shape) == len(expected) and all(
        (want is None and 1 <= size <= _INT32_MAX) or size == want for size, want in zip(shape, expected))
    if not ok:
        if axes is None:
            raise ValueError(f"{name}: expected shape {tuple(expected)}, got {shape}")
        shown = "(" + ", ".join(axis if want is None else str(want) for want, axis in zip(expected, axes)) + ")"
        sizes = " with every size in 1..2**31-1" if None in expected else ""
        raise ValueError(f"{name}: expected shape {shown} [{', '.join(axes)}]{sizes}, got {shape}")
    return shape


def _address_range(array):
    """``[first, last)`` byte addresses of a contiguous device array."""
    if isinstance(array, np.ndarray):
        start = array.__array_interface__["data"][0]
    else:
        start = array.data.ptr  # cupy
    return start, start + array.nbytes


def _check_no_overlap(out_name, out, name, array):
    """``out`` must not share memory with input ``array`` (the kernel would read its own output)."""
    (a0, a1), (b0, b1) = _address_range(out), _address_range(array)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{out_name}: expected a buffer that does not overlap {name}, got one that does")


def _float_output(out, backend, dtype, shape, like):
    """The output buffer: ``out`` checked against ``shape`` and ``dtype``, or new zeros."""
    if out is None:
        return backend.zeros(shape, backend.storage_dtype(dtype))
    out, _ = _float_operand("out", out, backend, dtype, like)
    _check_shape("out", out, shape)
    return out


def _row_threads(n, limit):
    """Threads for one block per row: ``n`` rounded up to a warp, at most ``limit``."""
    return min(limit, 32 * math.ceil(n / 32))


# -- ops --------------------------------------------------------------------------
def linear(x, weight, *, out=None, backend=None):
    """``out = x @ weight.T``: the projection of a few rows (GEMV / skinny GEMM).

    Each weight element is read from global memory once per launch for up to
    16 rows (once per 16-row tile beyond), in 16-byte vectors when
    ``in_features`` allows; accumulation is fp32.

    Parameters
    ----------
    x : device array ``[rows, in_features]``
        rows = batch * q_len in a decode step; any sizes >= 1.
    weight : device array ``[out_features, in_features]``
        The HF / PyTorch layout, row-major, the dtype of ``x``.
    out : device array ``[rows, out_features]``, optional
        Written in place and returned; must not overlap ``x`` or ``weight``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``x`` by default.

    Returns
    -------
    device array ``[rows, out_features]`` in the dtype of ``x``.

    Raises
    ------
    TypeError
        An argument of the wrong type, device or dtype.
    ValueError
        Mismatched ``in_features``, a wrong shape, a non-contiguous array, or
        ``out`` overlapping an input.
    """
    backend = _backend_for("x", x, backend)
    x, dtype = _float_operand("x", x, backend)
    rows, in_features = _check_shape("x", x, (None, None), ("rows", "in_features"))
    weight, _ = _float_operand("weight", weight, backend, dtype, "x")
    out_features, _ = _check_shape("weight", weight, (None, in_features), ("out_features", "in_features"))
    given = out is not None
    out = _float_output(out, backend, dtype, (rows, out_features), "x")
    if given:
        _check_no_overlap("out", out, "x", x)
        _check_no_overlap("out", out, "weight", weight)
    tile = next((t for t in LINEAR_ROW_TILES if t >= rows), LINEAR_ROW_TILES[-1])
    backend.launch(
        "linear", f"cupykv_linear<{CUDA_TYPES[dtype]}, {tile}>",
        (math.ceil(out_features / LINEAR_OUTS_PER_BLOCK),), (LINEAR_THREADS,),
        (out, x, weight, np.int32(rows), np.int32(in_features), np.int32(out_features)))
    return out


def embedding(ids, table, *, out=None, error_flag=None, backend=None):
    """``out[r] = table[ids[r]]``: token embeddings gathered at device-resident ids.

    Rows are copied bit for bit. An id outside ``0..vocab-1`` gives a row of
    zeros and sets ``error_flag[0] = 1`` (never cleared here).

    Parameters
    ----------
    ids : device int32 array ``[rows]``
        Read on the device at launch time (e.g. written by :func:`argmax`).
    table : device array ``[vocab, hidden]``
    out : device array ``[rows, hidden]``, optional
        Written in place and returned; must not overlap ``table``.
    error_flag : device int32 array ``[1]``, optional
        Set to 1 when an id is out of range. Without it a scratch flag is
        allocated and bad ids only show as zero rows.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``ids`` by default.

    Returns
    -------
    device array ``[rows, hidden]`` in the dtype of ``table``.

    Raises
    ------
    TypeError, ValueError
        As for :func:`linear`.
    """
    backend = _backend_for("ids", ids, backend)
    ids = _int32_operand("ids", ids, backend)
    (rows,) = _check_shape("ids", ids, (None,), ("rows",))
    table, dtype = _float_operand("table", table, backend)
    vocab, hidden = _check_shape("table", table, (None, None), ("vocab", "hidden"))
    given = out is not None
    out = _float_output(out, backend, dtype, (rows, hidden), "table")
    if given:
        _check_no_overlap("out", out, "table", table)
    if error_flag is None:
        error_flag = backend.zeros((1,), np.int32)
    else:
        error_flag = _int32_operand("error_flag", error_flag, backend)
        _check_shape("error_flag", error_flag, (1,))
    backend.launch("embedding", f"cupykv_embedding<{CUDA_TYPES[dtype]}>", (rows,), (EMBEDDING_THREADS,),
                   (out, table, ids, error_flag, np.int32(vocab), np.int32(hidden)))
    return out


def rmsnorm(x, weight, eps, *, out=None, backend=None):
    """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * weight``, per row, in fp32.

    Parameters
    ----------
    x : device array ``[rows, hidden]``
    weight : device array ``[hidden]``, the dtype of ``x``
    eps : float
        Finite, > 0.
    out : device array ``[rows, hidden]``, optional
        Written in place and returned; may be ``x``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``x`` by default.

    Returns
    -------
    device array ``[rows, hidden]`` in the dtype of ``x``.
    """
    backend = _backend_for("x", x, backend)
    x, dtype = _float_operand("x", x, backend)
    rows, hidden = _check_shape("x", x, (None, None), ("rows", "hidden"))
    weight, _ = _float_operand("weight", weight, backend, dtype, "x")
    _check_shape("weight", weight, (hidden,), ("hidden",))
    eps = _checks.check_positive_float("eps", eps)
    out = _float_output(out, backend, dtype, (rows, hidden), "x")
    backend.launch("rmsnorm", f"cupykv_rmsnorm<{CUDA_TYPES[dtype]}>", (rows,),
                   (_row_threads(hidden, RMSNORM_MAX_THREADS),), (out, x, weight, np.int32(hidden), np.float32(eps)))
    return out


def _elementwise(op, name_a, a, name_b, b, out, backend):
    """Shared body of the two-input elementwise ops (same shape, any rank >= 1)."""
    backend = _backend_for(name_a, a, backend)
    a, dtype = _float_operand(name_a, a, backend)
    shape = tuple(a.shape)
    if not shape or not all(1 <= size for size in shape) or math.prod(shape) > 2**62:
        raise ValueError(f"{name_a}: expected an array of rank >= 1 with every size >= 1, got shape {shape}")
    b, _ = _float_operand(name_b, b, backend, dtype, name_a)
    _checks.check_same_shape(name_a, a, name_b, b)
    out = _float_output(out, backend, dtype, shape, name_a)
    n = math.prod(shape)
    packs = math.ceil(n / (16 // a.dtype.itemsize))
    threads = _row_threads(packs, ELEMENTWISE_MAX_THREADS)
    blocks = min(ELEMENTWISE_MAX_BLOCKS, math.ceil(packs / threads))
    backend.launch(op, f"cupykv_{op}<{CUDA_TYPES[dtype]}>", (blocks,), (threads,), (out, a, b, np.int64(n)))
    return out


def silu_mul(gate, up, *, out=None, backend=None):
    """``out = silu(gate) * up = gate / (1 + exp(-gate)) * up``, elementwise (SwiGLU), in fp32.

    Parameters
    ----------
    gate, up : device arrays of one shape and dtype (e.g. ``[rows, intermediate]``)
    out : device array of that shape, optional
        Written in place and returned; may be ``gate`` or ``up``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``gate`` by default.

    Returns
    -------
    device array of the shape and dtype of ``gate``.
    """
    return _elementwise("silu_mul", "gate", gate, "up", up, out, backend)


def add(a, b, *, out=None, backend=None):
    """``out = a + b``, elementwise (the residual connection), in fp32.

    Parameters
    ----------
    a, b : device arrays of one shape and dtype (e.g. ``[rows, hidden]``)
    out : device array of that shape, optional
        Written in place and returned; may be ``a`` or ``b``.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``a`` by default.

    Returns
    -------
    device array of the shape and dtype of ``a``.
    """
    return _elementwise("add", "a", a, "b", b, out, backend)


def argmax(logits, *, out=None, backend=None):
    """``out[r] = argmax(logits[r])`` as int32 (greedy sampling), the lowest index on ties.

    Inputs are assumed NaN-free. The ids stay on the device, so the next
    replay of a captured decode step can feed them to :func:`embedding`.

    Parameters
    ----------
    logits : device array ``[rows, vocab]``
    out : device int32 array ``[rows]``, optional
        Written in place and returned.
    backend : {"cupy", "emulator"}, optional
        Inferred from ``logits`` by default.

    Returns
    -------
    device int32 array ``[rows]``.
    """
    backend = _backend_for("logits", logits, backend)
    logits, dtype = _float_operand("logits", logits, backend)
    rows, vocab = _check_shape("logits", logits, (None, None), ("rows", "vocab"))
    if out is None:
        out = backend.zeros((rows,), np.int32)
    else:
        out = _int32_operand("out", out, backend)
        _check_shape("out", out, (rows,))
    backend.launch("argmax", f"cupykv_argmax<{CUDA_TYPES[dtype]}>", (rows,),
                   (_row_threads(vocab, ARGMAX_MAX_THREADS),), (out, logits, np.int32(vocab)))
    return out
