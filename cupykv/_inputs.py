"""Checks that turn a caller's array into one a backend's kernels may read.

Shape checks are shared with the reference (``cupykv._checks``); this module
adds what only the fast path needs: the array lives on the backend's device,
has the storage dtype exactly, and is C-contiguous.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from cupykv.backends.base import Backend

# The two forms a bfloat16 operand may take on either backend; each is viewed as the storage dtype.
_BFLOAT16_FORMS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))


def _describe(array) -> str:
    module = type(array).__module__.split(".")[0]
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    return f"{module}.{type(array).__name__} (shape {shape}, dtype {dtype})"


def _to_backend_array(name: str, array, backend: Backend):
    if backend.is_device_array(array):
        return array
    if backend.name == "emulator" and isinstance(array, np.ndarray):
        return array  # the emulator shadows host arrays in guarded memory for each launch
    if backend.name == "cupy":
        import cupy
        if isinstance(array, np.ndarray):
            raise TypeError(f"{name}: expected a CUDA device array (cupy.ndarray, or an object with "
                            f"__cuda_array_interface__ or DLPack), got a host numpy.ndarray; "
                            f"move it with cupy.asarray first")
        # DLPack first: it carries bfloat16 as bfloat16, where torch's __cuda_array_interface__
        # gives bfloat16 an untyped "<V2" typestr (older torch versions raise instead).
        if hasattr(array, "__dlpack__"):
            return cupy.from_dlpack(array)
        if hasattr(array, "__cuda_array_interface__"):
            return cupy.asarray(array)
    raise TypeError(f"{name}: expected an array of the {backend.name} backend ({backend.xp.__name__}.ndarray), "
                    f"got {_describe(array)}")


def device_input(name: str, array, backend: Backend, dtype: str, shape=None):
    """Validate ``array`` as a kernel operand and return it as a backend array.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    array : array-like
        The caller's array.
    backend : Backend
    dtype : {"float32", "float16", "bfloat16"}
        Cache dtype; the array must hold exactly this storage type. bfloat16
        may come as ``ml_dtypes.bfloat16`` or as uint16 bit patterns on either
        backend; it is viewed as the storage dtype without a copy.
    shape : tuple of int, optional
        Exact shape required.

    Raises
    ------
    TypeError
        Wrong array type, device or dtype.
    ValueError
        Wrong shape or a non-contiguous layout.
    """
    array = _to_backend_array(name, array, backend)
    backend.check_device(name, array)
    array = _as_storage_dtype(name, array, backend.storage_dtype(dtype), dtype)
    if shape is not None and tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(array.shape)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {array.strides} "
                         f"for shape {tuple(array.shape)}; pass a contiguous copy")
    return array


def _as_storage_dtype(name: str, array, storage: np.dtype, dtype: str):
    """``array`` with dtype ``storage``: as it is, or a bfloat16 form viewed as ``storage`` (no copy)."""
    if array.dtype == storage:
        return array
    if dtype != "bfloat16":
        raise TypeError(f"{name}: expected dtype {storage} (the cache dtype {dtype}), got {array.dtype}")
    if array.dtype not in _BFLOAT16_FORMS:
        raise TypeError(f"{name}: expected dtype bfloat16 (the cache dtype), as ml_dtypes.bfloat16 or uint16 "
                        f"bit patterns, got {array.dtype}")
    return array.view(storage)
