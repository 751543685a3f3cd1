"""LlamaConfig (Hugging Face field names) and the weight names and shapes it implies."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import numpy.typing as npt

from cupykv import _args
from cupykv.spec import FP8_DTYPE, IO_DTYPES, MAX_HEAD_DIM, CacheSpec

_SUPPORTED_ROPE = ("default",)
_SUPPORTED_ACT = ("silu",)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-architecture decoder, with Hugging Face ``config.json`` field names.

    Parameters
    ----------
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size : int
        Each in 1..2**31-1 (the kernels' int).
    num_key_value_heads : int, optional
        GQA kv heads; defaults to ``num_attention_heads`` (as in HF).
    rms_norm_eps : float, default 1e-6
        A normal float32 > 0 (rmsnorm adds it in float32).
    rope_theta : float, default 10000.0
        Finite and >= 1 (see :class:`cupykv.Rope`).
    head_dim : int, optional
        Defaults to ``hidden_size // num_attention_heads``; must be even and <= 256.
    tie_word_embeddings : bool, default False
        The LM head reuses ``model.embed_tokens.weight``.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    # None (the default) means num_attention_heads, head_dim hidden_size // num_attention_heads: __post_init__
    # replaces None with that int, so a made config's fields are ints
    num_key_value_heads: int = None  # type: ignore[assignment]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int = None  # type: ignore[assignment]
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            object.__setattr__(self, name, _args.check_int32(f"LlamaConfig.{name}", getattr(self, name), lo=1))
        heads = self.num_attention_heads
        kv = heads if self.num_key_value_heads is None else \
            _args.check_int32("LlamaConfig.num_key_value_heads", self.num_key_value_heads, lo=1)
        if heads % kv:
            raise ValueError(f"LlamaConfig.num_key_value_heads: expected a divisor of num_attention_heads={heads}, "
                             f"got {kv}")
        object.__setattr__(self, "num_key_value_heads", kv)
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise ValueError(f"LlamaConfig.hidden_size: expected a multiple of num_attention_heads={heads} "
                                 f"(or an explicit head_dim), got {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        head_dim = _args.check_int("LlamaConfig.head_dim", self.head_dim, 2, MAX_HEAD_DIM)
        if head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim: expected an even int (rotary pairs halves), got {head_dim}")
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "rms_norm_eps", _args.check_positive_float32("LlamaConfig.rms_norm_eps",
                                                                              self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", _args.check_rope_theta("LlamaConfig.rope_theta", self.rope_theta))
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise TypeError(f"LlamaConfig.tie_word_embeddings: expected a bool, got {self.tie_word_embeddings!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        """Read a Hugging Face LLaMA ``config.json`` dict.

        Accepts the older form (top-level ``rope_theta``, optional
        ``rope_scaling``) and the current one (``rope_parameters``), honours an
        explicit ``head_dim`` and ignores unrelated keys. Rotary variants other
        than plain rotary (``rope_type`` "default") and activations other than
        SiLU are rejected, as are attention/MLP biases.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict (a parsed config.json), got {type(config).__name__}")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(f"config: expected the keys {list(required)}, missing {missing}")
        act = config.get("hidden_act", "silu")
        if act not in _SUPPORTED_ACT:
            raise ValueError(f"config.hidden_act: expected one of {_SUPPORTED_ACT}, got {act!r}")
        for bias in ("attention_bias", "mlp_bias"):
            if config.get(bias):
                raise ValueError(f"config.{bias}: expected false (biases are not implemented), got {config[bias]!r}")
        theta, rope_type, where = config.get("rope_theta", 10000.0), "default", "config.rope_scaling"
        if isinstance(config.get("rope_parameters"), dict):
            params, where = config["rope_parameters"], "config.rope_parameters"
            theta = params.get("rope_theta", theta)
            rope_type = params.get("rope_type", params.get("type", "default"))
        elif isinstance(config.get("rope_scaling"), dict):
            rope_type = config["rope_scaling"].get("rope_type", config["rope_scaling"].get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE:
            raise ValueError(f"{where}.rope_type: expected one of {_SUPPORTED_ROPE} (plain rotary), got {rope_type!r}")
        # absent or null: the defaults (num_attention_heads kv heads, hidden_size // num_attention_heads)
        derived = {key: config[key] for key in ("num_key_value_heads", "head_dim") if config.get(key) is not None}
        return cls(
            hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), **derived,
        )

    # -- the cache --------------------------------------------------------------
    def cache_spec(self, dtype: str, max_seq: int, batch: int, kv_dtype: str | None = None) -> CacheSpec:
        """The KV cache of a model of this shape: ``num_hidden_layers`` layers of ``num_key_value_heads`` heads.

        Parameters
        ----------
        dtype : {"float32", "float16", "bfloat16"}
            The model's dtype: the cache's ``io_dtype`` (its K/V rows, q and attention's output).
        max_seq, batch : int
            As for :class:`cupykv.CacheSpec`.
        kv_dtype : {None, dtype, "float8_e4m3"}, optional
            What the cache stores: ``None`` (or ``dtype`` itself) for ``dtype``,
            ``"float8_e4m3"`` for an fp8 cache with per-head scales.

        Raises
        ------
        TypeError, ValueError
            ``dtype`` or ``kv_dtype`` is not one of those, named (the other fields as for CacheSpec).
        """
        io_dtype = _args.check_choice("dtype", dtype, IO_DTYPES)
        if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in (io_dtype, FP8_DTYPE)):
            error, what = (ValueError, _args.shown) if isinstance(kv_dtype, str) else (TypeError, _args.got)
            raise error(f"kv_dtype: expected None, {io_dtype!r} (the model's dtype) or {FP8_DTYPE!r}, "
                        f"got {what(kv_dtype)}")
        stored = io_dtype if kv_dtype is None else kv_dtype
        return CacheSpec(n_layers=self.num_hidden_layers, n_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                         max_seq=max_seq, batch=batch, dtype=stored, io_dtype=io_dtype)

    # -- weights --------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the model reads: Hugging Face name -> shape."""
        hidden, heads, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, hidden), "model.norm.weight": (hidden,)}
        for i in range(self.num_hidden_layers):
            prefix = f"model.layers.{i}."
            shapes.update({
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (heads * hd, hidden),
                prefix + "self_attn.k_proj.weight": (kv * hd, hidden),
                prefix + "self_attn.v_proj.weight": (kv * hd, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, heads * hd),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "mlp.gate_proj.weight": (self.intermediate_size, hidden),
                prefix + "mlp.up_proj.weight": (self.intermediate_size, hidden),
                prefix + "mlp.down_proj.weight": (hidden, self.intermediate_size),
            })
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes

    def check_weights(self, weights: Mapping[str, npt.ArrayLike]) -> dict[str, npt.NDArray[Any]]:
        """Host float arrays for every parameter, shapes checked; unrelated names are ignored."""
        if not hasattr(weights, "__getitem__") or not hasattr(weights, "keys"):
            raise TypeError(f"weights: expected a mapping of Hugging Face names to arrays, "
                            f"got {type(weights).__name__}")
        checked: dict[str, npt.NDArray[Any]] = {}
        for name, shape in self.weight_shapes().items():
            if name not in weights:
                raise ValueError(f"weights: expected a parameter named {name!r} of shape {shape}, missing")
            array = np.asarray(weights[name])
            if tuple(array.shape) != shape:
                raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {tuple(array.shape)}")
            if array.dtype.kind != "f" and str(array.dtype) != "bfloat16":
                raise TypeError(f"weights[{name!r}]: expected a float array, got dtype {array.dtype}")
            checked[name] = array
        return checked

    def random_weights(self, seed: int = 0) -> dict[str, npt.NDArray[np.float32]]:
        """Seeded float32 weights with well-scaled activations (projections ~ 1/sqrt(fan_in)).

        ``seed`` is a 64-bit unsigned integer, ``0..2**64 - 1``.
        """
        rng = np.random.default_rng(_args.check_int("seed", seed, lo=0, hi=2**64 - 1))
        weights: dict[str, npt.NDArray[np.float32]] = {}
        for name, shape in self.weight_shapes().items():
            if len(shape) == 1:    # norm gains near 1
                weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif name == "model.embed_tokens.weight":
                weights[name] = rng.standard_normal(shape).astype(np.float32)
            else:
                weights[name] = (rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)
        return weights
