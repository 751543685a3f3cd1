"""Checkpoint files: Hugging Face config.json and weights from ``.safetensors`` or ``.npz``, as host arrays."""
from __future__ import annotations

import json
import os

import numpy as np
import numpy.typing as npt

from cupykv.models.config import LlamaConfig

__all__ = ["load_config", "load_weights"]


def load_config(config_path_or_dict) -> LlamaConfig:
    """A LlamaConfig, as it is, or from a config.json path or its parsed dict."""
    if isinstance(config_path_or_dict, LlamaConfig):
        return config_path_or_dict
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        with open(config_path_or_dict, encoding="utf-8") as f:
            return LlamaConfig.from_hf(json.load(f))
    return LlamaConfig.from_hf(config_path_or_dict)


_SAFETENSORS_DTYPES: dict[str, npt.DTypeLike] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "I64": np.int64, "I32": np.int32}


def load_weights(path) -> dict[str, np.ndarray]:
    """HF-named host arrays from a ``.safetensors`` file or an ``.npz``.

    The safetensors format (an 8-byte little-endian header size, a JSON header,
    then raw little-endian tensors) is read directly, memory-mapped, so that
    bfloat16 checkpoints load as ``ml_dtypes.bfloat16`` arrays (NumPy itself has
    no bfloat16, and ``safetensors.numpy`` rejects them).
    """
    import ml_dtypes

    path = os.fspath(path)
    if path.endswith(".npz"):
        with np.load(path) as archive:
            return {name: archive[name] for name in archive.files}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header_size = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8 : 8 + header_size]))
    data = raw[8 + header_size :]
    weights = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        stored = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if stored is None:
            raise ValueError(f"{path}: tensor {name!r}: expected one of {sorted(_SAFETENSORS_DTYPES)}, "
                             f"got dtype {entry['dtype']}")
        dtype = np.dtype(ml_dtypes.bfloat16 if stored == "bfloat16" else stored).newbyteorder("<")
        begin, end = entry["data_offsets"]
        weights[name] = data[begin:end].view(dtype).reshape(entry["shape"])
    return weights
