"""CacheSpec: the static shape, dtype and layout of a KV cache.

A spec fixes everything the kernels need to know at compile and allocation
time; nothing about it changes while the cache is in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._args.limits import INT32_MAX, MAX_NEW, MAX_SEQ
from ._args.scalars import check_choice, check_int

__all__ = ["CacheSpec", "DTYPES", "IO_DTYPES", "FP8_DTYPE", "FP8_MAX", "LAYOUTS", "MAX_HEAD_DIM", "MAX_SEQ", "MAX_NEW",
           "MASK_VALUE", "host_dtype"]

#: dtypes of values given to and returned by a cache (rows, q, out), and of 16- and 32-bit storage
IO_DTYPES = ("float32", "float16", "bfloat16")
#: the 8-bit storage dtype: E4M3 (cuda_fp8.h's __nv_fp8_e4m3, ml_dtypes.float8_e4m3fn), scaled per head
FP8_DTYPE = "float8_e4m3"
#: the largest finite E4M3 value: stores saturate to +-FP8_MAX
FP8_MAX = 448.0
DTYPES = IO_DTYPES + (FP8_DTYPE,)
LAYOUTS = ("NHD", "HND")
MAX_HEAD_DIM = 256

# Additive-mask value for positions a query may not attend to.
MASK_VALUE = -1e30

_INT_FIELDS = (  # (field, upper bound): kernel ints; max_seq leaves room for positions max_seq + q_len
    ("n_layers", INT32_MAX),
    ("n_kv_heads", INT32_MAX),
    ("head_dim", MAX_HEAD_DIM),
    ("max_seq", MAX_SEQ),
    ("batch", INT32_MAX),
)
# (field, its factor, why): products every use of the cache passes to a kernel or a launch
_PRODUCTS = (
    ("batch", "n_kv_heads", "attention launches one block per sequence and kv head on grid x"),
    ("n_kv_heads", "head_dim", "append indexes a row of n_kv_heads * head_dim elements with an int"),
)


def host_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of a cupykv dtype name on the host (ml_dtypes for bfloat16 and float8_e4m3)."""
    named: dict[str, Any] = {"bfloat16": ml_dtypes.bfloat16, FP8_DTYPE: ml_dtypes.float8_e4m3fn}
    result: np.dtype[Any] = np.dtype(named.get(dtype, dtype))
    return result


@dataclass(frozen=True)
class CacheSpec:
    """Static description of a KV cache.

    Parameters
    ----------
    n_layers : int
        Transformer layers, each with its own K and V (1..2**31-1).
    n_kv_heads : int
        Key/value heads, i.e. GQA groups (1..2**31-1).
    head_dim : int
        Features per head, in 1..256.
    max_seq : int
        Capacity in positions per sequence, in 1..2**30 (``MAX_SEQ``): a position
        ``lengths[b] + i`` of ``q_len <= 2**30 - 1`` queries (``MAX_NEW``) then
        stays below 2**31, as the kernels' int positions need.
    batch : int, default 1
        Sequence slots (1..2**31-1).
    dtype : {"float32", "float16", "bfloat16", "float8_e4m3"}, default "float32"
        Storage type of K and V. ``"float8_e4m3"`` stores each value as
        E4M3(x / scale) (round to nearest even, saturated to +-448) with one
        fp32 scale per layer and kv head (see :class:`~cupykv.KVCache`): half
        the bytes of a 16-bit cache.
    io_dtype : {"float32", "float16", "bfloat16"}, optional
        (``""`` or ``None``: the default.) Type of the rows given to ``append``/``write`` and of ``q`` and ``out``
        in attention. Defaults to ``dtype`` and must equal it for 16- and
        32-bit caches; for ``"float8_e4m3"`` it defaults to ``"bfloat16"``.
    layout : {"NHD", "HND"}, default "NHD"
        Axis order of storage. ``"NHD"``:
        ``[n_layers, batch, max_seq, n_kv_heads, head_dim]``; ``"HND"``:
        ``[n_layers, batch, n_kv_heads, max_seq, head_dim]``.

    Raises
    ------
    TypeError
        A field has the wrong type (``bool`` is not an int; NumPy integer
        scalars are accepted and stored as python ints).
    ValueError
        A field is out of range or not one of the allowed strings, or
        ``batch * n_kv_heads`` or ``n_kv_heads * head_dim`` exceeds 2**31-1
        (every attention or append on such a cache would break a launch or
        int limit).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq: int
    batch: int = 1
    dtype: str = "float32"
    layout: str = "NHD"
    io_dtype: str = ""   # "" (or None): the default for the dtype, resolved in __post_init__

    def __post_init__(self) -> None:
        for name, hi in _INT_FIELDS:
            value = check_int(f"CacheSpec.{name}", getattr(self, name), lo=1, hi=hi)
            object.__setattr__(self, name, value)
        for name, factor, why in _PRODUCTS:
            a, b = getattr(self, name), getattr(self, factor)
            if a * b > INT32_MAX:
                raise ValueError(f"CacheSpec.{name}: expected {name} * {factor} <= {INT32_MAX} ({why}), "
                                 f"got {a} * {b} = {a * b}")
        check_choice("CacheSpec.dtype", self.dtype, DTYPES)
        check_choice("CacheSpec.layout", self.layout, LAYOUTS)
        if self.io_dtype in ("", None):
            object.__setattr__(self, "io_dtype", "bfloat16" if self.dtype == FP8_DTYPE else self.dtype)
        check_choice("CacheSpec.io_dtype", self.io_dtype, IO_DTYPES)
        if self.dtype != FP8_DTYPE and self.io_dtype != self.dtype:
            raise ValueError(f"CacheSpec.io_dtype: expected {self.dtype!r} (a {self.dtype} cache takes and returns "
                             f"its own dtype; only a {FP8_DTYPE!r} cache converts), got {self.io_dtype!r}")

    @property
    def quantized(self) -> bool:
        """Whether K and V are stored as scaled 8-bit floats (``dtype == "float8_e4m3"``)."""
        return self.dtype == FP8_DTYPE

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V): ``[batch, max_seq, n_kv_heads, head_dim]``
        for NHD, ``[batch, n_kv_heads, max_seq, head_dim]`` for HND."""
        if self.layout == "NHD":
            return (self.batch, self.max_seq, self.n_kv_heads, self.head_dim)
        return (self.batch, self.n_kv_heads, self.max_seq, self.head_dim)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Shape of K (or V): ``(n_layers,) + layer_shape``."""
        return (self.n_layers,) + self.layer_shape

    @property
    def seq_axis(self) -> int:
        """Index of the ``max_seq`` axis in ``shape``: 2 for NHD, 3 for HND."""
        return 2 if self.layout == "NHD" else 3

    @property
    def strides(self) -> tuple[int, ...]:
        """C-contiguous strides of ``shape``, in elements (not bytes)."""
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """Host NumPy dtype of storage (``ml_dtypes.bfloat16``, ``ml_dtypes.float8_e4m3fn`` for those dtypes)."""
        return host_dtype(self.dtype)

    @property
    def io_np_dtype(self) -> np.dtype[Any]:
        """Host NumPy dtype of the rows, queries and outputs (``io_dtype``)."""
        return host_dtype(self.io_dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return self.np_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of K plus V together."""
        n_elements = 1
        for size in self.shape:
            n_elements *= size
        return 2 * n_elements * self.itemsize
