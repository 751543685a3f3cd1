"""Array arguments of the fast path: the backend's own arrays, in the kernel's dtype and layout.

A kernel reads and writes its arrays as contiguous blocks from their first
element, so an operand must be C-contiguous (a strided view, a reversed one
included, is refused rather than read as if it were contiguous); a contiguous
view at an offset into a larger buffer is passed as it is, without a copy. An
array the kernel writes must be writeable. Shape checks shared with the
reference live in :mod:`cupykv._args.cache_args`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import ml_dtypes
import numpy as np

from cupykv._args.limits import INT32_MAX
from cupykv._args.overlap import BufferOwner, check_apart_from_caches, check_no_overlap
from cupykv._typing import DeviceArray, Shape

if TYPE_CHECKING:
    from cupykv.backends.base import Backend

# The two forms a bfloat16 operand may take on either backend; each is viewed as the storage dtype.
_BFLOAT16_FORMS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))
# array dtype -> dtype name; uint16 holds bfloat16 bit patterns (CuPy has no bfloat16)
FLOAT_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.uint16): "bfloat16"}


def describe(array: object) -> str:
    """``module.Type (shape ..., dtype ...)``, for messages about a foreign object."""
    module = type(array).__module__.split(".")[0]
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    return f"{module}.{type(array).__name__} (shape {shape}, dtype {dtype})"


def backend_for(name: str, array: object, backend: str | Backend | None) -> Backend:
    """The backend ``backend`` names, else the one ``array`` belongs to (see ``cupykv.backends.backend_of``)."""
    from cupykv.backends import backend_of, get_backend   # deferred: the backends import this package's neighbours

    if backend is not None:
        return get_backend(backend)
    found = backend_of(array)
    if found is None:
        raise TypeError(f"{name}: expected a device array (cupy.ndarray, or an emulator device array), "
                        f"got {describe(array)}")
    return found


def to_backend_array(name: str, array: object, backend: Backend) -> DeviceArray:
    """``array`` as an array of ``backend`` (zero-copy), or TypeError naming ``name`` (see ``Backend.device_array``)."""
    return backend.device_array(name, array)


def check_contiguous(name: str, array: DeviceArray) -> None:
    """ValueError unless ``array`` is C-contiguous (negative strides and gaps are not)."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {array.strides} "
                         f"for shape {tuple(array.shape)}; pass a contiguous copy")


def check_writeable(name: str, array: DeviceArray) -> None:
    """ValueError when ``array`` is read-only (``flags.writeable`` is False; CuPy arrays always write)."""
    if not getattr(array.flags, "writeable", True):
        raise ValueError(f"{name}: expected a writeable array, got a read-only one (flags.writeable is False)")


def device_operand(name: str, array: object, backend: Backend, dtype: str, shape: Sequence[int] | None = None, *,
                   written: bool = False) -> DeviceArray:
    """Validate ``array`` as a float kernel operand and return it as a backend array.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    array : array-like
        The caller's array.
    backend : Backend
    dtype : {"float32", "float16", "bfloat16"}
        The array must hold exactly this type. bfloat16 may come as
        ``ml_dtypes.bfloat16`` or as uint16 bit patterns on either backend; it
        is viewed as the storage dtype without a copy.
    shape : tuple of int, optional
        Exact shape required.
    written : bool
        The kernel writes the array: it must be writeable.

    Raises
    ------
    TypeError
        Wrong array type, device or dtype.
    ValueError
        Wrong shape, a non-contiguous layout, or a read-only array the kernel writes.
    """
    array = to_backend_array(name, array, backend)
    backend.check_device(name, array)
    array = _as_storage_dtype(name, array, backend.storage_dtype(dtype), dtype)
    if shape is not None and tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(array.shape)}")
    check_contiguous(name, array)
    if written:
        check_writeable(name, array)
    return array


def _as_storage_dtype(name: str, array: DeviceArray, storage: np.dtype[Any], dtype: str) -> DeviceArray:
    """``array`` with dtype ``storage``: as it is, or a bfloat16 form viewed as ``storage`` (no copy)."""
    if array.dtype == storage:
        return array
    if dtype != "bfloat16":
        raise TypeError(f"{name}: expected dtype {storage} (the cache dtype {dtype}), got {array.dtype}")
    if array.dtype not in _BFLOAT16_FORMS:
        raise TypeError(f"{name}: expected dtype bfloat16 (the cache dtype), as ml_dtypes.bfloat16 or uint16 "
                        f"bit patterns, got {array.dtype}")
    return array.view(storage)


def float_operand(name: str, array: object, backend: Backend, dtype: str | None = None, like: str | None = None, *,
                  written: bool = False) -> tuple[DeviceArray, str]:
    """``array`` as a contiguous float array of ``backend``; returns ``(array, dtype name)``.

    With ``dtype``, the array must have that dtype (the one of argument ``like``).
    """
    array = to_backend_array(name, array, backend)
    found = FLOAT_DTYPES.get(np.dtype(array.dtype))
    if found is None:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16 (uint16 bit patterns on cupy), "
                        f"got {np.dtype(array.dtype)}")
    if dtype is not None and found != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the dtype of {like}), got {np.dtype(array.dtype)}")
    return device_operand(name, array, backend, found, written=written), found


def int32_operand(name: str, array: object, backend: Backend, *, written: bool = False) -> DeviceArray:
    """``array`` as a contiguous int32 array of ``backend``; one the kernel writes must be writeable and
    apart from every cache's buffers."""
    array = to_backend_array(name, array, backend)
    backend.check_device(name, array)
    if np.dtype(array.dtype) != np.int32:
        raise TypeError(f"{name}: expected dtype int32, got {np.dtype(array.dtype)}")
    check_contiguous(name, array)
    if written:
        check_writeable(name, array)
        check_apart_from_caches(name, array)
    return array


#: what Backend.always_run registers its words as, among the buffers no output may overlap
ALWAYS_RUN = "always-run word"


def run_if_operand(run_if: object, backend: Backend, own: BufferOwner | None = None) -> DeviceArray | None:
    """``run_if`` checked as a launch's gate: ``None``, or a C-contiguous device int32 ``[1]`` of ``backend``.

    The word must share no byte with the buffers of a cache or plan (``own``,
    the call's cache, is named "the cache's"); ``Backend.always_run()`` itself
    is allowed. What the launch itself writes is checked later, by
    :func:`run_if_word`, once the outputs are known.
    """
    if run_if is None:
        return None
    word = int32_operand("run_if", run_if, backend)
    check_shape("run_if", word, (1,))
    check_apart_from_caches("run_if", word, own, shareable=(ALWAYS_RUN,))
    return word


def run_if_word(word: DeviceArray | None, backend: Backend,
                written: Iterable[tuple[str, DeviceArray | None]]) -> DeviceArray:
    """The word a launch reads first: ``word`` (from :func:`run_if_operand`), which must share no byte with
    ``written`` (``(name, array)`` pairs: what the launch writes), or ``backend.always_run()`` for ``None``."""
    if word is None:
        return backend.always_run()
    check_no_overlap("run_if", word, written)
    return word


def check_shape(name: str, array: DeviceArray, expected: Sequence[int | None],
                axes: Sequence[str] | None = None) -> Shape:
    """Check ``array.shape`` against ``expected`` (ints, or None for any size >= 1).

    Every size must fit the kernels' int32 arithmetic. ``axes`` names the axes
    for the message, e.g. ``weight: expected shape (out_features, 64)
    [out_features, in_features], got (5, 63)``.
    """
    shape = tuple(array.shape)
    ok = len(shape) == len(expected) and all(
        (want is None and 1 <= size <= INT32_MAX) or size == want for size, want in zip(shape, expected))
    if not ok:
        if axes is None:
            raise ValueError(f"{name}: expected shape {tuple(expected)}, got {shape}")
        shown = "(" + ", ".join(axis if want is None else str(want) for want, axis in zip(expected, axes)) + ")"
        sizes = " with every size in 1..2**31-1" if None in expected else ""
        raise ValueError(f"{name}: expected shape {shown} [{', '.join(axes)}]{sizes}, got {shape}")
    return shape


def float_output(out: object, backend: Backend, dtype: str, shape: Shape, like: str, *,
                 inputs: Iterable[tuple[str, DeviceArray | None]] = (),
                 in_place_inputs: Iterable[tuple[str, DeviceArray | None]] = ()) -> DeviceArray:
    """The output buffer: ``out`` checked, or new zeros when it is ``None``.

    ``out`` must have ``dtype`` and ``shape``, be C-contiguous and writeable,
    share no byte with any of ``inputs`` (``(name, array)`` pairs) or with a
    cache's buffers, and be either exactly one of ``in_place_inputs`` or
    apart from each of them.
    """
    if out is None:
        return backend.zeros(shape, backend.storage_dtype(dtype))
    out, _ = float_operand("out", out, backend, dtype, like, written=True)
    check_shape("out", out, shape)
    check_no_overlap("out", out, inputs)
    check_no_overlap("out", out, in_place_inputs, in_place_ok=True)
    check_apart_from_caches("out", out)
    return out
