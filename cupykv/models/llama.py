"""A compact LLaMA-architecture decoder built only from cupykv ops.

Token embedding, RMSNorm, rotary GQA attention through a :class:`KVCache`,
SwiGLU MLP, ``cupykv.linear`` projections and a greedy argmax on the device.
Every op of a decode step is a cupykv kernel writing preallocated buffers, so
the whole step (every layer) is captured once with :func:`cupykv.capture`:
the next token's id is written by argmax into the buffer the embedding reads
on the next replay, and positions come from the cache's device lengths.

Prompts of different lengths are prefilled in one batched pass (padded to the
longest; each sequence then advances by its own length), then decoded
greedily in a loop that stays on the device (:mod:`cupykv.models.decoding`):
several decode steps per graph replay, or speculative cycles with a draft
model, with stopping on the device. Eager and graph decoding, any number of
steps per replay and speculative decoding all give identical tokens.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import OrderedDict
from typing import (TYPE_CHECKING, Any, Callable, Hashable, Literal, Mapping, Sequence, TypeGuard, TypedDict,
                    Union, overload)

import numpy as np
import numpy.typing as npt

from cupykv import _args, ops
from cupykv._typing import DeviceArray, IntLike
from cupykv.attention import attention
from cupykv.attention_plan import CHUNK, AttentionPlan
from cupykv.backends.base import Backend
from cupykv.backends.capture import refuse_in_capture
from cupykv.cache import KVCache
from cupykv.fp8 import calibrate_scales
from cupykv.models.config import LlamaConfig
from cupykv.models.weights import load_config, load_weights
from cupykv.rope import Rope
from cupykv.spec import FP8_DTYPE, IO_DTYPES, MAX_SEQ

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from cupykv.graph import Graph
    from cupykv.models.decoding import DecodeStats, GreedyLoop, SpeculativeLoop, StopState
    from cupykv.models.gguf import GGUFCheckpoint

__all__ = ["LlamaConfig", "Llama", "load_weights"]

#: a prompt: token ids, as a list, a tuple or a NumPy int array
Prompt = Union[Sequence[IntLike], npt.NDArray[np.integer[Any]]]
#: ``generate``'s streaming callback: one new token per prompt (None where a prompt has none this time)
OnToken = Callable[[list[Union[int, None]]], object]


class ModelOptions(TypedDict, total=False):
    """The keyword arguments of :class:`Llama` that its constructors pass on."""

    dtype: str
    kv_dtype: str | None
    k_scale: float | npt.ArrayLike
    v_scale: float | npt.ArrayLike
    max_seq: IntLike
    batch: IntLike
    backend: str | Backend | None


#: Attention passes of up to this many queries per sequence (decode steps, speculative verification with
#: up to 64 proposals) split the keys at fixed positions, so their rows agree bit for bit (see
#: Llama._decode_split_keys); longer prefill passes split as the plan sees fit.
EXACT_Q_LEN = 65

class _Activations:
    """Preallocated activations for ``rows`` tokens (rows = batch * tokens per sequence)."""

    def __init__(self, backend: Backend, config: LlamaConfig, storage: np.dtype[Any], batch: int, tokens: int) -> None:
        rows = batch * tokens
        hd = config.head_dim
        zeros = backend.zeros
        self.ids = zeros((rows,), np.int32)
        self.hidden = zeros((rows, config.hidden_size), storage)        # residual stream
        self.normed = zeros((rows, config.hidden_size), storage)
        self.q = zeros((rows, config.num_attention_heads * hd), storage)
        self.k = zeros((rows, config.num_key_value_heads * hd), storage)
        self.v = zeros((rows, config.num_key_value_heads * hd), storage)
        self.attn = zeros((batch, tokens, config.num_attention_heads, hd), storage)
        self.proj = zeros((rows, config.hidden_size), storage)
        self.gate = zeros((rows, config.intermediate_size), storage)
        self.up = zeros((rows, config.intermediate_size), storage)
        self.act = zeros((rows, config.intermediate_size), storage)
        # views in attention's [batch, tokens, heads, head_dim] shape
        self.q4 = self.q.reshape(batch, tokens, config.num_attention_heads, hd)
        self.k4 = self.k.reshape(batch, tokens, config.num_key_value_heads, hd)
        self.v4 = self.v.reshape(batch, tokens, config.num_key_value_heads, hd)
        self.attn2 = self.attn.reshape(rows, config.num_attention_heads * hd)


class Llama:
    """Greedy LLaMA decoding on a cupykv cache.

    Graph-safe: no — refused inside a captured step (CaptureError): a model allocates its cache, weights
    and buffers. A step captures :meth:`decode_step` of a model made before.

    Parameters
    ----------
    config : LlamaConfig
    weights : mapping of str to array
        Hugging Face parameter names (``model.embed_tokens.weight``,
        ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``)
        to host arrays; converted to ``dtype`` and moved to the backend.
    dtype : {"float32", "float16", "bfloat16"}, default "float32"
        Storage type of weights and activations, and of the cache unless ``kv_dtype`` says otherwise.
    kv_dtype : {None, dtype, "float8_e4m3"}, optional
        What the cache stores: ``dtype`` by default; ``"float8_e4m3"`` makes an
        fp8 cache (half the bytes of bfloat16) whose ``io_dtype`` is ``dtype``:
        each layer's K (rotated) and V are quantized as they are appended, with
        one scale per layer and kv head, and attention reads them back
        dequantized (see :class:`cupykv.KVCache`).
    k_scale, v_scale : float or array broadcastable to ``[num_hidden_layers, num_key_value_heads]``, default 1.0
        The fp8 cache's scales: a value ``x`` is stored as
        ``E4M3(clamp(x / scale, -448, 448))``. 1.0 keeps values as they are,
        which suits magnitudes of about 0.02..448; :meth:`calibrate_kv_scales`
        measures them on sample prompts instead, and ``cache.set_scales``
        changes them later (a captured step reads the new ones at its next
        replay). Must be 1.0 for a cache that is not fp8.
    max_seq : int, default 256
        Cache capacity per sequence (prompt plus new tokens), in 1..2**30.
    batch : int, default 1
        Sequence slots; ``generate`` takes up to ``batch`` prompts.
    backend : {"cupy", "emulator"} or None

    Attributes
    ----------
    cache : KVCache
    stats : cupykv.models.decoding.DecodeStats or None
        What the last :meth:`generate` did: passes, steps, tokens, and for
        speculative decoding the acceptance rate and tokens per cycle.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named; MemoryError for a cache the backend cannot
        hold (see :class:`cupykv.KVCache`).
    """

    def __init__(self, config: LlamaConfig, weights: Mapping[str, npt.ArrayLike], *, dtype: str = "float32",
                 kv_dtype: str | None = None, k_scale: float | npt.ArrayLike = 1.0,
                 v_scale: float | npt.ArrayLike = 1.0, max_seq: IntLike = 256, batch: IntLike = 1,
                 backend: str | Backend | None = None) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        dtype = _args.check_choice("dtype", dtype, IO_DTYPES)
        max_seq = _args.check_int("max_seq", max_seq, 1, MAX_SEQ)
        batch = _args.check_int32("batch", batch, lo=1)
        cache = KVCache(config.cache_spec(dtype, max_seq, batch, kv_dtype), backend=backend,
                        k_scale=k_scale, v_scale=v_scale)
        host_dtype = cache.spec.io_np_dtype
        weights = {name: cache._backend.asarray(np.asarray(array, dtype=np.float32).astype(host_dtype))
                   for name, array in config.check_weights(weights).items()}
        if config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self._setup(config, cache, weights)

    def _setup(self, config: LlamaConfig, cache: KVCache, weights: dict[str, DeviceArray]) -> None:
        """Attach the cache and the device weights; allocate the decode buffers."""
        self.config, self.cache, self.weights = config, cache, weights
        backend = self.backend = cache._backend
        batch = cache.spec.batch
        self.rope = Rope(theta=config.rope_theta)
        storage = self._storage = backend.storage_dtype(str(cache.spec.io_dtype))   # activations: the io dtype
        self._decode = _Activations(backend, config, storage, batch, 1)
        self._logits = backend.zeros((batch, config.vocab_size), storage)
        self._embedding_error = backend.zeros((1,), np.int32)
        self._split_keys = self._decode_split_keys()
        # decoding loops (with their graphs) by shape, least recently used first
        self._loops: OrderedDict[Hashable, GreedyLoop | SpeculativeLoop] = OrderedDict()
        self._last_loop: GreedyLoop | SpeculativeLoop | None = None
        self._stop: StopState | None = None   # the device-side stopping state, made on first use
        self.stats: DecodeStats | None = None

    # -- constructors ----------------------------------------------------------
    @classmethod
    def random(cls, config: LlamaConfig, *, seed: int = 0, **kwargs: Unpack[ModelOptions]) -> Llama:
        """A model with seeded random weights (see :meth:`LlamaConfig.random_weights`).

        Graph-safe: no — refused inside a captured step (CaptureError): it makes a model (allocates
        and uploads).
        """
        return cls(config, config.random_weights(seed), **kwargs)

    @classmethod
    def from_safetensors(cls, config_path_or_dict: str | os.PathLike[str] | dict[str, Any] | LlamaConfig,
                         path: str | os.PathLike[str], **kwargs: Unpack[ModelOptions]) -> Llama:
        """Load HF-named weights from a ``.safetensors`` (or ``.npz``) file and a config.json path or dict.

        Graph-safe: no — refused inside a captured step (CaptureError): it makes a model (allocates
        and uploads).
        """
        return cls(load_config(config_path_or_dict), load_weights(path), **kwargs)

    @classmethod
    def from_gguf(cls, path_or_checkpoint: str | os.PathLike[str] | GGUFCheckpoint,
                  **kwargs: Unpack[ModelOptions]) -> Llama:
        """Load a LLaMA-architecture GGUF file (llama.cpp's format), dequantized to ``dtype``.

        Graph-safe: no — refused inside a captured step (CaptureError): it makes a model (allocates
        and uploads).

        Parameters
        ----------
        path_or_checkpoint : str, os.PathLike or GGUFCheckpoint
            The file, or what :func:`cupykv.models.gguf.read_gguf` returned for it.
        **kwargs
            ``dtype``, ``kv_dtype``, ``k_scale``, ``v_scale``, ``max_seq``, ``batch``, ``backend``, as for
            :class:`Llama`.

        Raises
        ------
        cupykv.models.gguf.GGUFError
            Another architecture, an unsupported tensor type, a missing tensor or a damaged file.
        """
        from cupykv.models.gguf import GGUFCheckpoint, read_gguf

        checkpoint = path_or_checkpoint if isinstance(path_or_checkpoint, GGUFCheckpoint) \
            else read_gguf(path_or_checkpoint)
        return cls(checkpoint.config, checkpoint.weights, **kwargs)

    def first_layers(self, n_layers: IntLike, *, max_seq: IntLike | None = None) -> Llama:
        """A draft for self-speculative decoding: this model cut after ``n_layers`` layers.

        The draft runs the embedding, layers ``0..n_layers-1``, the final norm
        and the LM head of this model, reading its device weights (nothing is
        copied), with a cache of its own: pass it as ``generate(...,
        draft=model.first_layers(n))``. Its cache has this cache's dtypes and,
        for fp8, a copy of the scales of those layers as they are now.

        Graph-safe: no — refused inside a captured step (CaptureError): the draft's cache and buffers
        are allocated.

        Parameters
        ----------
        n_layers : int
            In ``1..num_hidden_layers``.
        max_seq : int, optional
            The draft cache's capacity; this model's by default.

        Raises
        ------
        ValueError
            ``n_layers`` or ``max_seq`` out of range; MemoryError for a cache the backend cannot hold.
        """
        layers = _args.check_int("n_layers", n_layers, 1, self.config.num_hidden_layers)
        spec = self.cache.spec
        capacity = spec.max_seq if max_seq is None else _args.check_int("max_seq", max_seq, 1, MAX_SEQ)
        config = dataclasses.replace(self.config, num_hidden_layers=layers)
        k_scales, v_scales = self.cache.scales_host()
        cache = KVCache(config.cache_spec(str(spec.io_dtype), capacity, spec.batch, spec.dtype), backend=self.backend,
                        k_scale=k_scales[:layers], v_scale=v_scales[:layers])
        draft = Llama.__new__(Llama)
        draft._setup(config, cache, {name: self.weights[name] for name in (*config.weight_shapes(), "lm_head.weight")})
        return draft

    def calibrate_kv_scales(self, prompts: Sequence[Prompt]) -> tuple[npt.NDArray[np.float32],
                                                                       npt.NDArray[np.float32]]:
        """Set an fp8 cache's scales from the K and V that sample prompts produce (per layer and kv head).

        Runs the prompts (``batch`` at a time) through this model once with a
        temporary cache that stores the model's dtype (nothing quantized; the
        same weights and kernels), takes each layer's keys as the cache stores
        them (rotated) and its values over every prompt token, and sets
        ``cache.set_scales(k_scale, v_scale)`` with
        :func:`cupykv.fp8.calibrate_scales`: ``max |x| / 448`` per layer and kv
        head, so the largest sampled value is stored as +-448. Later values
        beyond it saturate there: calibrate on text like the text you decode,
        or scale the returned arrays up and set them yourself. The model's own
        cache and buffers are left alone; a graph captured before reads the
        new scales at its next replay.

        Graph-safe: no — refused inside a captured step (CaptureError): it allocates a cache and buffers,
        runs prefills and reads the keys and values on the host.

        Parameters
        ----------
        prompts : list of list of int
            Sample prompts of token ids (any number, any lengths >= 1).

        Returns
        -------
        k_scale, v_scale : np.ndarray float32 ``[num_hidden_layers, num_key_value_heads]``
            The scales now set (pass them to :class:`~cupykv.models.llama_reference.LlamaReference`
            to compare).

        Raises
        ------
        ValueError
            The cache is not fp8 (``kv_dtype`` is not ``"float8_e4m3"``), or a prompt is empty or has
            an id outside ``0..vocab_size-1``.
        CaptureError
            Inside a captured step.
        """
        refuse_in_capture("Llama.calibrate_kv_scales (it allocates and runs a prefill)",
                          "calibrate before capturing; a captured step reads the new scales at its next replay")
        spec = self.cache.spec
        if not spec.quantized:
            raise ValueError(f"calibrate_kv_scales: expected a model with kv_dtype={FP8_DTYPE!r}, got a "
                             f"{spec.dtype} cache (its scales are 1)")
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(
                self._is_token_list(p) and len(p) > 0 for p in prompts):
            raise ValueError(f"prompts: expected a non-empty list of non-empty token lists in "
                             f"0..{self.config.vocab_size - 1}, got {prompts!r:.80}")
        longest = _args.check_int("the longest prompt's length", max(len(p) for p in prompts), 1, MAX_SEQ)
        io_dtype = str(spec.io_dtype)
        probe = Llama.__new__(Llama)   # this model's weights, a cache of the io dtype
        probe._setup(self.config, KVCache(self.config.cache_spec(io_dtype, longest, spec.batch),
                                          backend=self.backend), self.weights)
        k_max = np.zeros((spec.n_layers, spec.n_kv_heads), np.float32)
        v_max = np.zeros_like(k_max)
        for first in range(0, len(prompts), spec.batch):
            chunk = [[int(t) for t in p] for p in prompts[first : first + spec.batch]]
            probe._prefill(chunk + [[0]] * (spec.batch - len(chunk)))
            for stored, running in ((probe.cache.k, k_max), (probe.cache.v, v_max)):
                rows = self.backend.to_host(stored).view(spec.io_np_dtype)   # [n_layers, batch, longest, n_kv, hd]
                for b, prompt in enumerate(chunk):
                    np.maximum(running, np.abs(rows[:, b, : len(prompt)].astype(np.float32)).max(axis=(1, 3)),
                               out=running)
        # calibrate_scales takes samples [n_layers, ..., n_kv_heads, head_dim]: the maxima are enough
        k_scale, v_scale = (calibrate_scales(m[:, None, :, None]) for m in (k_max, v_max))
        self.cache.set_scales(k_scale, v_scale)
        return k_scale, v_scale

    # -- the forward pass ------------------------------------------------------
    def _w(self, layer: int, name: str) -> DeviceArray:
        return self.weights[f"model.layers.{layer}.{name}.weight"]

    def _activations(self, tokens: int) -> _Activations:
        """Buffers for a forward pass of ``tokens`` tokens per sequence (allocates: not inside capture)."""
        return _Activations(self.backend, self.config, self._storage, self.cache.spec.batch, tokens)

    def _decode_split_keys(self) -> int | None:
        """Fixed split positions for attention passes of up to EXACT_Q_LEN queries, or None for one split.

        Attention splits the keys of a long cache to fill the device; with
        ``split_keys`` the splits sit at fixed positions, so a row of a
        verification pass (q_len k + 1) sums its keys exactly as the same row
        decoded alone: speculative tokens then equal greedy tokens bit for bit.
        The split size is what a one-query plan would use to fill the device,
        rounded up to the kernel's key chunk (1 split on the emulator).
        """
        spec = self.cache.spec
        splits = AttentionPlan(self.cache, 1, self.config.num_attention_heads).num_splits
        if splits == 1:
            return None
        return math.ceil(math.ceil(spec.max_seq / splits) / CHUNK) * CHUNK

    def _forward(self, act: _Activations, ids: DeviceArray | None = None, run_if: DeviceArray | None = None) -> None:
        """Embed ``ids`` (default ``act.ids``), run every layer (appending K/V at the pending positions),
        leave ``act.hidden``. With ``run_if`` (device int32 ``[1]``), every launch does nothing while it is 0.

        Launches only; allocates nothing, so it can be captured.
        """
        eps = self.config.rms_norm_eps
        ops.embedding(act.ids if ids is None else ids, self.weights["model.embed_tokens.weight"], out=act.hidden,
                      error_flag=self._embedding_error, run_if=run_if)
        for layer in range(self.config.num_hidden_layers):
            ops.rmsnorm(act.hidden, self._w(layer, "input_layernorm"), eps, out=act.normed, run_if=run_if)
            ops.linear(act.normed, self._w(layer, "self_attn.q_proj"), out=act.q, run_if=run_if)
            ops.linear(act.normed, self._w(layer, "self_attn.k_proj"), out=act.k, run_if=run_if)
            ops.linear(act.normed, self._w(layer, "self_attn.v_proj"), out=act.v, run_if=run_if)
            self.cache.append(layer, act.k4, act.v4, rope=self.rope, run_if=run_if)
            attention(act.q4, self.cache, layer, rope=self.rope, out=act.attn, run_if=run_if,
                      split_keys=self._split_keys if act.q4.shape[1] <= EXACT_Q_LEN else None)
            ops.linear(act.attn2, self._w(layer, "self_attn.o_proj"), out=act.proj, run_if=run_if)
            ops.add(act.hidden, act.proj, out=act.hidden, run_if=run_if)
            ops.rmsnorm(act.hidden, self._w(layer, "post_attention_layernorm"), eps, out=act.normed, run_if=run_if)
            ops.linear(act.normed, self._w(layer, "mlp.gate_proj"), out=act.gate, run_if=run_if)
            ops.linear(act.normed, self._w(layer, "mlp.up_proj"), out=act.up, run_if=run_if)
            ops.silu_mul(act.gate, act.up, out=act.act, run_if=run_if)
            ops.linear(act.act, self._w(layer, "mlp.down_proj"), out=act.proj, run_if=run_if)
            ops.add(act.hidden, act.proj, out=act.hidden, run_if=run_if)

    def _head(self, hidden: DeviceArray, normed: DeviceArray, logits: DeviceArray, ids: DeviceArray,
              run_if: DeviceArray | None = None) -> None:
        """Final norm (into ``normed``), LM head (into ``logits``) and greedy argmax (into ``ids``), per row
        (nothing while ``run_if``, when given, holds 0)."""
        ops.rmsnorm(hidden, self.weights["model.norm.weight"], self.config.rms_norm_eps, out=normed, run_if=run_if)
        ops.linear(normed, self.weights["lm_head.weight"], out=logits, run_if=run_if)
        ops.argmax(logits, out=ids, run_if=run_if)

    def decode_step(self) -> None:
        """One greedy token for every sequence, from the ids of the previous one.

        Reads the device ids (the last token of each sequence), runs every
        layer at the cache's device lengths, writes the next ids and the logits
        into the model's buffers and advances the cache by one, for every
        sequence (``generate``'s loops add a stop check per step, see
        :mod:`cupykv.models.decoding`). Launches only, so it can be captured;
        call it directly (after a ``generate``) for custom loops or timing.

        Graph-safe: yes — launches only, into the model's preallocated buffers; positions come from
        the cache's device lengths and token ids from the device, so each replay decodes the next
        token.
        """
        act = self._decode
        self._forward(act)
        self._head(act.hidden, act.normed, self._logits, act.ids)
        self.cache.advance(1)

    def feed(self, token_ids: Prompt) -> None:
        """Set the token each sequence embeds at the next :meth:`decode_step` (host ids, one per sequence).

        With :meth:`KVCache.truncate <cupykv.KVCache.truncate>` this rolls a
        sequence back and sends it down another path: truncate to the shared
        prefix, ``feed`` the new token, then ``decode_step()``.

        Graph-safe: no — refused inside a captured step (CaptureError): it uploads host values.

        Raises
        ------
        ValueError
            Not ``batch`` token ids in ``0..vocab_size-1``.
        CaptureError
            Inside a captured step.
        """
        batch = self.cache.spec.batch
        if not self._is_token_list(token_ids) or len(token_ids) != batch:
            raise ValueError(f"token_ids: expected {batch} token ids in 0..{self.config.vocab_size - 1} "
                             f"(one per sequence), got {token_ids!r:.80}")
        self.backend.upload(self._decode.ids, np.array([int(t) for t in token_ids], np.int32))

    def next_tokens(self) -> list[int]:
        """The greedy token of each sequence from the last step: what the next :meth:`decode_step` embeds.

        Graph-safe: no — refused inside a captured step (CaptureError): it synchronises and reads the
        device.

        Raises
        ------
        CaptureError
            Inside a captured step.
        """
        ids: list[int] = self.backend.to_host(self._decode.ids).tolist()
        return ids

    def _prefill(self, prompts: list[list[int]]) -> None:
        """Run every prompt (padded to the longest) through the model; leaves the first new token in ids."""
        batch, longest = self.cache.spec.batch, max(len(p) for p in prompts)
        act = self._activations(longest)
        ids = np.zeros((batch, longest), np.int32)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)] = prompt
        self.backend.upload(act.ids, ids.reshape(-1))
        self.cache.reset()
        self._forward(act)
        lengths = np.array([len(p) for p in prompts], np.int64)
        last_rows = np.arange(batch) * longest + lengths - 1   # each sequence's last prompt token
        self._head(act.hidden[self.backend.asarray(last_rows)], self._decode.normed, self._logits, self._decode.ids)
        self.cache.advance(lengths)

    # -- generation --------------------------------------------------------------
    def _check_prompts(self, prompts: object, max_new_tokens: object, margin: int = 0,
                       draft: Llama | None = None) -> list[list[int]]:
        """The prompts as int lists, padded with one-token dummies to ``batch``.

        ``margin`` (the draft's ``num_speculative``) is the verify pass's rows past the last token:
        ``len(prompt) + max_new_tokens + margin`` must fit the target, and one row more the draft.
        """
        spec = self.cache.spec
        new_tokens = _args.check_int("max_new_tokens", max_new_tokens, 1, max(1, spec.max_seq - 1))
        if not isinstance(prompts, (list, tuple)) or not 1 <= len(prompts) <= spec.batch:
            raise ValueError(f"prompts: expected a list of 1..{spec.batch} token lists, got {prompts!r:.80}")
        plus = " + num_speculative" if margin else ""
        limits = [(spec.max_seq, f"max_seq={spec.max_seq}")]
        if draft is not None:
            limits.append((draft.cache.spec.max_seq + 1, f"the draft's max_seq + 1={draft.cache.spec.max_seq + 1}"))
        checked = []
        for b, prompt in enumerate(prompts):
            tokens = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
            if not tokens or not self._is_token_list(tokens):
                raise ValueError(f"prompts[{b}]: expected a non-empty list of token ids in "
                                 f"0..{self.config.vocab_size - 1}, got {prompt!r:.80}")
            for limit, what in limits:
                if len(tokens) + new_tokens + margin > limit:
                    raise ValueError(f"prompts[{b}]: expected len(prompt) + max_new_tokens{plus} <= {what}, "
                                     f"got {len(tokens)} + {new_tokens}{f' + {margin}' if margin else ''}")
            checked.append([int(t) for t in tokens])
        # unused slots decode a one-token dummy prompt; their tokens are dropped
        return checked + [[0]] * (spec.batch - len(checked))

    @overload
    def generate(self, prompts: Sequence[Prompt], max_new_tokens: IntLike, *, use_graph: bool = ...,
                 return_logits: Literal[False] = ..., progress: Callable[[int, int], object] | None = ...,
                 stop_ids: IntLike | Sequence[IntLike] = ..., on_token: OnToken | None = ...,
                 eos_token_id: IntLike | Sequence[IntLike] | None = ..., tokens_per_replay: IntLike = ...,
                 draft: Llama | None = ..., num_speculative: IntLike | None = ...) -> list[list[int]]: ...

    @overload
    def generate(self, prompts: Sequence[Prompt], max_new_tokens: IntLike, *, use_graph: bool = ...,
                 return_logits: Literal[True], progress: Callable[[int, int], object] | None = ...,
                 stop_ids: IntLike | Sequence[IntLike] = ..., on_token: OnToken | None = ...,
                 eos_token_id: IntLike | Sequence[IntLike] | None = ..., tokens_per_replay: IntLike = ...,
                 draft: Llama | None = ..., num_speculative: IntLike | None = ...
                 ) -> tuple[list[list[int]], npt.NDArray[np.float32]]: ...

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: IntLike, *, use_graph: bool = True,
                 return_logits: bool = False, progress: Callable[[int, int], object] | None = None,
                 stop_ids: IntLike | Sequence[IntLike] = (), on_token: OnToken | None = None,
                 eos_token_id: IntLike | Sequence[IntLike] | None = None, tokens_per_replay: IntLike = 1,
                 draft: Llama | None = None, num_speculative: IntLike | None = None
                 ) -> list[list[int]] | tuple[list[list[int]], npt.NDArray[np.float32]]:
        """Greedy decoding of a batch of prompts, in a loop that runs on the device.

        After a batched prefill, either ``tokens_per_replay`` decode steps run
        per pass, or, with a ``draft``, one speculative cycle; each pass is one
        graph replay (or the same launches eagerly). Token ids, positions and
        the stopping state stay on the device inside a pass; the host reads the
        new tokens once per pass. Every setting gives the same tokens: those of
        plain greedy decoding of this model (see :mod:`cupykv.models.decoding`).
        ``self.stats`` (a :class:`~cupykv.models.DecodeStats`) describes the last call.

        Graph-safe: no — refused inside a captured step (CaptureError): it allocates its buffers,
        captures and replays its own graphs and reads the new tokens on the host.

        Parameters
        ----------
        prompts : list of list of int
            1..batch prompts of token ids, of any lengths >= 1.
        max_new_tokens : int
            Tokens to generate per prompt (the first comes from the prefill);
            ``len(prompt) + max_new_tokens <= max_seq``.
        use_graph : bool, default True
            Replay a captured pass instead of launching eagerly.
        return_logits : bool, default False
            Also return the float32 logits of every generated token.
        progress : callable, optional
            Called as ``progress(done, total)`` after each token (``done``: the
            longest prompt's new tokens so far).
        stop_ids, eos_token_id : int or sequence of int, optional
            Token ids that end a sequence (end of text, end of turn; both
            arguments are merged, at most 64 ids): its tokens end with the first
            one. A stopped sequence appends no more rows and its length stays
            frozen; decoding ends once every sequence has stopped.
        on_token : callable, optional
            Called as ``on_token(ids)`` with one new token per prompt (a list;
            ``None`` for a prompt that has no token in this call: it stopped,
            or, with a draft, it accepted fewer tokens this cycle), for streaming.
        tokens_per_replay : int, default 1
            Decode steps per pass, in 1..1024 (1 with a draft). Steps past a
            sequence's end are no-ops on the device.
        draft : Llama, optional
            A (smaller) model with the same vocabulary, batch and backend, and
            its own cache, that proposes tokens for speculative decoding.
        num_speculative : int, optional
            Tokens the draft proposes per cycle, in 1..64 (4 by default with a
            draft); ``len(prompt) + max_new_tokens + num_speculative`` must fit
            this model's ``max_seq`` and the draft's ``max_seq + 1``.

        Returns
        -------
        tokens : list of list of int
            The new tokens, one list per prompt, ending at a stop id.
        logits : np.ndarray float32 ``[steps, len(prompts), vocab]``
            Only with ``return_logits=True``: row ``s`` of prompt ``b`` gave its
            token ``s``; ``steps`` is the longest list's length, and rows past a
            shorter list's end are zeros.

        Raises
        ------
        TypeError, ValueError
            A bad argument, named, before anything runs.
        CaptureError
            Inside a captured step.
        RuntimeError
            The device's stop state broke its contract (a kernel bug): sequences still decoding
            after the most passes ``max_new_tokens`` allows, or a prompt given more tokens than it.
        """
        from cupykv.models import decoding

        n_prompts = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        k = decoding.check_draft(self, draft, num_speculative)
        padded = self._check_prompts(prompts, max_new_tokens, margin=k, draft=draft)
        use_graph = _args.check_bool("use_graph", use_graph)
        return_logits = _args.check_bool("return_logits", return_logits)
        for name, value in (("progress", progress), ("on_token", on_token)):
            if value is not None and not callable(value):
                raise TypeError(f"{name}: expected None or a callable, got {_args.got(value)}")
        tokens_per_replay = _args.check_int("tokens_per_replay", tokens_per_replay, 1, 1 if draft else 1024)
        stops = sorted(set(self._check_stop_ids("stop_ids", stop_ids))
                       | set(self._check_stop_ids("eos_token_id", () if eos_token_id is None else eos_token_id)))
        if len(stops) > decoding.MAX_STOP_IDS:
            raise ValueError(f"stop_ids: expected at most {decoding.MAX_STOP_IDS} distinct stop ids (with "
                             f"eos_token_id), got {len(stops)}")
        if draft is None:
            loop = self._loop(("greedy", tokens_per_replay), lambda: decoding.GreedyLoop(self, tokens_per_replay))
        else:
            loop = self._loop(("speculative", id(draft), k), lambda: decoding.SpeculativeLoop(self, draft, k))
        self._prefill(padded)
        if draft is not None:
            draft._prefill(padded)
        tokens, logits, self.stats = decoding.decode(self, loop, padded, n_prompts, int(max_new_tokens), stops,
                                                     use_graph=use_graph, return_logits=return_logits,
                                                     progress=progress, on_token=on_token)
        for model in (self, draft) if draft is not None else (self,):
            if model.backend.to_host(model._embedding_error)[0]:   # cannot happen for validated prompts and argmax ids
                raise RuntimeError("embedding: a token id outside 0..vocab_size-1 reached the model")
        if return_logits and logits is not None:
            return tokens, logits
        return tokens

    def _loop(self, key: Hashable,
              make: Callable[[], GreedyLoop | SpeculativeLoop]) -> GreedyLoop | SpeculativeLoop:
        """The decoding loop of shape ``key`` (a few kept, with their graphs), made on first use.

        A speculative loop holds its draft, so the draft's ``id`` in its key names a live model.
        """
        loop = self._loops.pop(key, None) or make()
        self._loops[key] = loop
        while len(self._loops) > _LOOPS_KEPT:
            self._loops.popitem(last=False)
        return loop

    def _stop_state(self) -> StopState:
        """The device-side stopping state every loop of this model shares (made once)."""
        from cupykv.models.decoding import StopState

        if self._stop is None:
            self._stop = StopState(self.backend, self.cache.spec.batch)
        return self._stop

    @property
    def _graph(self) -> Graph | None:
        """The graph of the loop the last ``generate`` ran (None after an eager one)."""
        return getattr(self._last_loop, "graph", None)

    def _is_token_list(self, values: object) -> TypeGuard[list[Any] | tuple[Any, ...] | npt.NDArray[Any]]:
        """Whether ``values`` is a list, tuple or array of token ids in ``0..vocab_size - 1``."""
        return isinstance(values, (list, tuple, np.ndarray)) and all(
            _args.is_int(t) and 0 <= t < self.config.vocab_size for t in values)

    def _check_stop_ids(self, name: str, stop_ids: object) -> list[int]:
        """``stop_ids`` (an id or a sequence of ids) as a list of ints."""
        ids = [stop_ids] if _args.is_int(stop_ids) else stop_ids
        if not self._is_token_list(ids):
            raise ValueError(f"{name}: expected token ids in 0..{self.config.vocab_size - 1}, got {stop_ids!r:.80}")
        return [int(i) for i in ids]

    def _host_logits(self) -> npt.NDArray[np.float32]:
        host = self.backend.to_host(self._logits)
        return host.view(self.cache.spec.io_np_dtype).astype(np.float32)


_LOOPS_KEPT = 4
