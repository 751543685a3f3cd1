"""Models built only from cupykv ops, so that a whole decode step can be captured in one graph."""
from cupykv.models.config import LlamaConfig
from cupykv.models.decoding import DecodeStats
from cupykv.models.llama import Llama

__all__ = ["LlamaConfig", "Llama", "DecodeStats"]
