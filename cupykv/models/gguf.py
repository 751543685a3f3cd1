"""LLaMA-architecture checkpoints from GGUF files (llama.cpp's format): config, weights, metadata.

The file is read with the ``gguf`` package (llama.cpp's own reader and NumPy
dequantizer). Three things differ from a Hugging Face checkpoint, and
:func:`read_gguf` undoes each:

- **Names.** ``blk.{i}.attn_q.weight`` is ``model.layers.{i}.self_attn.q_proj.weight``
  and so on (:data:`HF_NAMES`).
- **Quantization.** Tensors may be stored as F32, F16, BF16, Q8_0, Q4_0 or Q4_1
  (:data:`SUPPORTED_TYPES`); they are dequantized to float32.
- **Rotary layout.** llama.cpp rotates interleaved pairs ``(x[2i], x[2i+1])``,
  so its converter stores the rows of each head of ``q_proj`` and ``k_proj``
  reordered from the half-split layout ``(x[i], x[i + d/2])`` that Hugging
  Face and :class:`cupykv.Rope` use: half-split row ``j*d/2 + i`` of a head is
  stored at row ``2i + j``. :func:`unpermute_rotary_rows` moves them back
  (per query head for ``q``, per kv head for ``k``).

The hyperparameters come from the file's ``llama.*`` keys, never assumed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from cupykv.errors import InputError
from cupykv.models.config import LlamaConfig

#: Tensor types this loader dequantizes (each covered by tests/test_gguf.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

#: GGUF tensor name (``{i}`` = layer) -> Hugging Face parameter name.
HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


class GGUFError(InputError):
    """A GGUF file cupykv cannot load: truncated, not LLaMA, or with an unsupported tensor or key.

    A ``ValueError``, and a :class:`~cupykv.errors.UserError`: the command line reports it in one line.
    """


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What :func:`read_gguf` found: the config, HF-named float32 weights and the raw metadata.

    Attributes
    ----------
    config : LlamaConfig
    weights : dict of str to np.ndarray
        Hugging Face names to float32 host arrays (``[out_features, in_features]``
        for projections), rotary rows already in the half-split layout.
    metadata : dict
        Every key/value of the file (tokenizer arrays included).
    tensor_types : dict of str to str
        GGUF tensor name -> its stored type (``"Q4_1"``, ...).
    """

    config: LlamaConfig
    weights: dict = field(repr=False)
    metadata: dict = field(repr=False)
    tensor_types: dict = field(repr=False)


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q or k projection from llama.cpp's interleaved order back to the half-split order.

    Parameters
    ----------
    weight : np.ndarray ``[n_heads * head_dim, in_features]``
    n_heads : int
        Query heads for ``q_proj``, kv heads for ``k_proj``.

    Returns
    -------
    np.ndarray of the same shape, where row ``h*d + j*d/2 + i`` is the stored row ``h*d + 2i + j``.
    """
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _open(path):
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: expected a GGUF file, got {path!r} (no such file)")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:   # the reader raises ValueError, IndexError, struct errors... on a damaged file
        raise GGUFError(f"path: {path!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _metadata(reader) -> dict:
    values = {}
    for key, entry in reader.fields.items():
        try:
            values[key] = entry.contents()
        except Exception:  # pragma: no cover - a key type the reader cannot decode; not one we read
            continue
    return values


def read_metadata(path) -> dict:
    """Every key/value of a GGUF file (tokenizer arrays included), without reading its tensors."""
    return _metadata(_open(path))


def _require(metadata: dict, key: str, path):
    if key not in metadata:
        raise GGUFError(f"{path}: expected the key {key!r} in the GGUF metadata, missing")
    return metadata[key]


def config_from_metadata(metadata: dict, path="GGUF") -> LlamaConfig:
    """The :class:`~cupykv.models.LlamaConfig` that the ``llama.*`` keys of a GGUF describe.

    Raises
    ------
    GGUFError
        Another architecture, a missing key, partial rotary or rope scaling.
    """
    arch = _require(metadata, "general.architecture", path)
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture: expected 'llama', got {arch!r}")
    heads = int(_require(metadata, "llama.attention.head_count", path))
    hidden = int(_require(metadata, "llama.embedding_length", path))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // heads))
    rotary = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"{path}: llama.rope.dimension_count: expected the head dim {head_dim} (full rotary), "
                        f"got {rotary}")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise GGUFError(f"{path}: llama.rope.scaling.type: expected 'none' (plain rotary), got {scaling!r}")
    vocab = metadata.get("llama.vocab_size")
    if vocab is None:
        vocab = len(_require(metadata, "tokenizer.ggml.tokens", path))
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=int(_require(metadata, "llama.block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(metadata.get("llama.attention.head_count_kv", heads)),
        intermediate_size=int(_require(metadata, "llama.feed_forward_length", path)),
        vocab_size=int(vocab),
        rms_norm_eps=float(_require(metadata, "llama.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        head_dim=head_dim,
        tie_word_embeddings=False,   # set by read_gguf from whether output.weight exists
    )


def _hf_name(gguf_name: str, n_layers: int) -> str | None:
    if gguf_name in HF_NAMES:
        return HF_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
        template = HF_NAMES.get(f"blk.{{i}}.{parts[2]}")
        return template.format(i=parts[1]) if template else None
    return None


def _dequantize(tensor, path) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {tensor.name!r}: expected one of the types {SUPPORTED_TYPES}, got {kind}")
    shape = tuple(int(n) for n in reversed(tensor.shape))     # GGUF lists dims innermost first
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def read_gguf(path) -> GGUFCheckpoint:
    """Read a LLaMA GGUF: config, dequantized Hugging Face-named weights, metadata.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    GGUFCheckpoint

    Raises
    ------
    FileNotFoundError
        No such file.
    GGUFError
        A damaged or truncated file, another architecture, an unsupported
        tensor type, or a missing tensor (each named).
    """
    reader = _open(path)
    metadata = _metadata(reader)
    config = config_from_metadata(metadata, path)
    n_layers = config.num_hidden_layers
    weights, tensor_types = {}, {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, n_layers)
        if name is None:
            continue   # tensors LLaMA does not use (rope_freqs of llama 3.1, ...)
        tensor_types[tensor.name] = tensor.tensor_type.name
        weights[name] = _dequantize(tensor, path)
    tied = "lm_head.weight" not in weights
    config = dataclasses.replace(config, tie_word_embeddings=tied)
    missing = [name for name in config.weight_shapes() if name not in weights]
    if missing:
        gguf_names = {hf: g for g, hf in HF_NAMES.items()}
        first = missing[0]
        layer = first.split(".")[2] if first.startswith("model.layers.") else None
        template = first.replace(f"layers.{layer}.", "layers.{i}.") if layer is not None else first
        stored = gguf_names.get(template, first).format(i=layer)
        raise GGUFError(f"{path}: expected a tensor {stored!r} ({first}), missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for index in range(n_layers):
        q, k = (f"model.layers.{index}.self_attn.{p}_proj.weight" for p in "qk")
        weights[q] = unpermute_rotary_rows(weights[q], config.num_attention_heads)
        weights[k] = unpermute_rotary_rows(weights[k], config.num_key_value_heads)
    return GGUFCheckpoint(config, config.check_weights(weights), metadata, tensor_types)

