"""The types cupykv's annotations use for arrays, scalars and per-sequence values.

Annotations only: importing this module imports neither CuPy nor anything of
cupykv. CuPy ships no type information, so under a type checker
``cupy.ndarray`` is unknown (``Any``); the NumPy half of each union is checked
in full.

- :data:`DeviceArray`: an array where a backend's kernels read it:
  ``cupy.ndarray`` (backend ``"cupy"``) or the emulator's ``numpy.ndarray``
  (backend ``"emulator"``, made by ``cache.to_device`` / ``backend.asarray``).
  What cupykv returns.
- :data:`ArrayLike`: what a kernel operand may be given as: a
  :data:`DeviceArray`, or another library's device array that CuPy views
  without a copy (DLPack, ``__cuda_array_interface__``: a torch CUDA tensor).
- :data:`HostArray`: a NumPy array in host memory (the reference's arrays,
  ``lengths_host()``).
- :data:`IntLike`, :data:`FloatLike`: a Python or NumPy scalar (``bool`` is
  refused at run time, as the argument layer says).
- :data:`PerSequence`: one int for every sequence, host ints ``[batch]``, or a
  device int32 array ``[batch]`` (``advance``, ``truncate``, ``set_lengths``).
- :data:`Positions`: ``write``'s positions: a device int32 array, a NumPy int
  array or nested lists of ints ``[batch, n_new]`` (``[batch]`` when ``n_new`` is 1).
- :data:`Shape`, :data:`DTypeLike`: an array's shape and anything ``numpy.dtype()`` takes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence, Tuple, TypeAlias, Union

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:   # never at run time: cupykv imports without CuPy
    import cupy

__all__ = ["ArrayLike", "DTypeLike", "DeviceArray", "FloatLike", "HostArray", "IntLike", "PerSequence",
           "Positions", "Shape", "SupportsCudaArrayInterface", "SupportsDLPack"]


class SupportsCudaArrayInterface(Protocol):
    """An object that describes its device memory with ``__cuda_array_interface__`` (Numba, PyTorch, ...)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


class SupportsDLPack(Protocol):
    """An object that exports its memory through DLPack (``__dlpack__``, PyTorch and JAX arrays, ...)."""

    def __dlpack__(self) -> object: ...


HostArray: TypeAlias = npt.NDArray[Any]
DeviceArray: TypeAlias = Union[npt.NDArray[Any], "cupy.ndarray"]
ArrayLike: TypeAlias = Union[DeviceArray, SupportsDLPack, SupportsCudaArrayInterface]
IntLike: TypeAlias = Union[int, np.integer[Any]]
FloatLike: TypeAlias = Union[float, np.floating[Any], np.integer[Any]]
PerSequence: TypeAlias = Union[IntLike, Sequence[IntLike], npt.NDArray[np.integer[Any]], DeviceArray]
Positions: TypeAlias = Union[DeviceArray, Sequence[IntLike], Sequence[Sequence[IntLike]]]
Shape: TypeAlias = Tuple[int, ...]
DTypeLike: TypeAlias = npt.DTypeLike
