"""cupykv: a static-capacity, GPU-resident KV cache for CuPy.

The NumPy oracle lives in ``cupykv.reference`` and is imported explicitly;
importing ``cupykv`` never imports it.
"""

from .attention import attention
from .cache import KVCache
from .errors import CacheOverflowError
from .rope import Rope
from .spec import MASK_VALUE, CacheSpec

__version__ = "0.1.0"

__all__ = ["CacheSpec", "KVCache", "attention", "CacheOverflowError", "Rope", "MASK_VALUE", "__version__"]
