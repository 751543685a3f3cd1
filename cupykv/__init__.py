"""cupykv: a static-capacity, GPU-resident KV cache for CuPy.

The NumPy oracle lives in ``cupykv.reference`` and is imported explicitly;
importing ``cupykv`` never imports it.
"""

from .attention import attention
from .attention_plan import AttentionPlan
from .cache import KernelView, KVCache
from .errors import CacheOverflowError
from .fp8 import calibrate_scales
from .graph import CaptureError, Graph, capture
from .ops import linear
from .rope import Rope
from .spec import MASK_VALUE, CacheSpec

__version__ = "0.1.0"

__all__ = ["CacheSpec", "KVCache", "KernelView", "AttentionPlan", "attention", "capture", "Graph", "CaptureError", "CacheOverflowError", "Rope",
           "MASK_VALUE", "linear", "calibrate_scales", "__version__"]
