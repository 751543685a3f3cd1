"""A compact LLaMA-architecture decoder built only from cupykv ops.

Token embedding, RMSNorm, rotary GQA attention through a :class:`KVCache`,
SwiGLU MLP, ``cupykv.linear`` projections and a greedy argmax on the device.
Every op of a decode step is a cupykv kernel writing preallocated buffers, so
the whole step (every layer) is captured once with :func:`cupykv.capture`:
the next token's id is written by argmax into the buffer the embedding reads
on the next replay, and positions come from the cache's device lengths.

Prompts of different lengths are prefilled in one batched pass (padded to the
longest; each sequence then advances by its own length), then decoded
greedily, eagerly or through the graph; both give identical tokens.
"""
from __future__ import annotations

import json
import os

import numpy as np

from cupykv import _args, ops
from cupykv.attention import attention
from cupykv.cache import KVCache
from cupykv.graph import capture
from cupykv.models.config import LlamaConfig
from cupykv.rope import Rope
from cupykv.spec import DTYPES, MAX_SEQ, CacheSpec

__all__ = ["LlamaConfig", "Llama"]


class _Activations:
    """Preallocated activations for ``rows`` tokens (rows = batch * tokens per sequence)."""

    def __init__(self, backend, config: LlamaConfig, storage, batch: int, tokens: int):
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

    Parameters
    ----------
    config : LlamaConfig
    weights : mapping of str to array
        Hugging Face parameter names (``model.embed_tokens.weight``,
        ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``)
        to host arrays; converted to ``dtype`` and moved to the backend.
    dtype : {"float32", "float16", "bfloat16"}, default "float32"
        Storage type of weights, activations and the cache.
    max_seq : int, default 256
        Cache capacity per sequence (prompt plus new tokens), in 1..2**30.
    batch : int, default 1
        Sequence slots; ``generate`` takes up to ``batch`` prompts.
    backend : {"cupy", "emulator"} or None

    Raises
    ------
    TypeError, ValueError
        A bad argument, named; MemoryError for a cache the backend cannot
        hold (see :class:`cupykv.KVCache`).
    """

    def __init__(self, config: LlamaConfig, weights, *, dtype="float32", max_seq=256, batch=1, backend=None):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        dtype = _args.check_choice("dtype", dtype, DTYPES)
        max_seq = _args.check_int("max_seq", max_seq, 1, MAX_SEQ)
        batch = _args.check_int32("batch", batch, lo=1)
        self.config = config
        self.cache = KVCache(CacheSpec(n_layers=config.num_hidden_layers, n_kv_heads=config.num_key_value_heads,
                                       head_dim=config.head_dim, max_seq=max_seq, batch=batch, dtype=dtype),
                             backend=backend)
        backend = self.cache._backend
        self.backend = backend
        self.rope = Rope(theta=config.rope_theta)
        storage = backend.storage_dtype(dtype)
        host_dtype = self.cache.spec.np_dtype
        self.weights = {name: backend.asarray(np.asarray(array, dtype=np.float32).astype(host_dtype))
                        for name, array in config.check_weights(weights).items()}
        if config.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self._storage = storage
        self._decode = _Activations(backend, config, storage, batch, 1)
        self._logits = backend.zeros((batch, config.vocab_size), storage)
        self._embedding_error = backend.zeros((1,), np.int32)
        self._graph = None

    # -- constructors ----------------------------------------------------------
    @classmethod
    def random(cls, config: LlamaConfig, *, seed: int = 0, **kwargs) -> "Llama":
        """A model with seeded random weights (see :meth:`LlamaConfig.random_weights`)."""
        return cls(config, config.random_weights(seed), **kwargs)

    @classmethod
    def from_safetensors(cls, config_path_or_dict, path, **kwargs) -> "Llama":
        """Load HF-named weights from a ``.safetensors`` (or ``.npz``) file and a config.json path or dict."""
        return cls(_load_config(config_path_or_dict), load_weights(path), **kwargs)

    @classmethod
    def from_gguf(cls, path_or_checkpoint, **kwargs) -> "Llama":
        """Load a LLaMA-architecture GGUF file (llama.cpp's format), dequantized to ``dtype``.

        Parameters
        ----------
        path_or_checkpoint : str, os.PathLike or GGUFCheckpoint
            The file, or what :func:`cupykv.models.gguf.read_gguf` returned for it.
        **kwargs
            ``dtype``, ``max_seq``, ``batch``, ``backend``, as for :class:`Llama`.

        Raises
        ------
        cupykv.models.gguf.GGUFError
            Another architecture, an unsupported tensor type, a missing tensor or a damaged file.
        """
        from cupykv.models.gguf import GGUFCheckpoint, read_gguf

        checkpoint = path_or_checkpoint if isinstance(path_or_checkpoint, GGUFCheckpoint) \
            else read_gguf(path_or_checkpoint)
        return cls(checkpoint.config, checkpoint.weights, **kwargs)

    # -- the forward pass ------------------------------------------------------
    def _w(self, layer: int, name: str):
        return self.weights[f"model.layers.{layer}.{name}.weight"]

    def _forward(self, act: _Activations) -> None:
        """Embed ``act.ids``, run every layer (appending K/V at the pending positions), leave ``act.hidden``.

        Launches only; allocates nothing, so it can be captured.
        """
        eps = self.config.rms_norm_eps
        ops.embedding(act.ids, self.weights["model.embed_tokens.weight"], out=act.hidden,
                      error_flag=self._embedding_error)
        for layer in range(self.config.num_hidden_layers):
            ops.rmsnorm(act.hidden, self._w(layer, "input_layernorm"), eps, out=act.normed)
            ops.linear(act.normed, self._w(layer, "self_attn.q_proj"), out=act.q)
            ops.linear(act.normed, self._w(layer, "self_attn.k_proj"), out=act.k)
            ops.linear(act.normed, self._w(layer, "self_attn.v_proj"), out=act.v)
            self.cache.append(layer, act.k4, act.v4, rope=self.rope)
            attention(act.q4, self.cache, layer, rope=self.rope, out=act.attn)
            ops.linear(act.attn2, self._w(layer, "self_attn.o_proj"), out=act.proj)
            ops.add(act.hidden, act.proj, out=act.hidden)
            ops.rmsnorm(act.hidden, self._w(layer, "post_attention_layernorm"), eps, out=act.normed)
            ops.linear(act.normed, self._w(layer, "mlp.gate_proj"), out=act.gate)
            ops.linear(act.normed, self._w(layer, "mlp.up_proj"), out=act.up)
            ops.silu_mul(act.gate, act.up, out=act.act)
            ops.linear(act.act, self._w(layer, "mlp.down_proj"), out=act.proj)
            ops.add(act.hidden, act.proj, out=act.hidden)

    def _head(self, hidden) -> None:
        """Final norm, LM head and greedy argmax into the decode ids (the next step's input)."""
        act = self._decode
        ops.rmsnorm(hidden, self.weights["model.norm.weight"], self.config.rms_norm_eps, out=act.normed)
        ops.linear(act.normed, self.weights["lm_head.weight"], out=self._logits)
        ops.argmax(self._logits, out=act.ids)

    def decode_step(self) -> None:
        """One greedy token for every sequence, from the ids of the previous one.

        Reads the device ids (the last token of each sequence), runs every
        layer at the cache's device lengths, writes the next ids and the logits
        into the model's buffers and advances the cache by one. Launches only,
        so it can be captured: ``generate`` replays it as one graph; call it
        directly (after a ``generate``) for custom loops or timing.
        """
        self._forward(self._decode)
        self._head(self._decode.hidden)
        self.cache.advance(1)

    def feed(self, token_ids) -> None:
        """Set the token each sequence embeds at the next :meth:`decode_step` (host ids, one per sequence).

        With :meth:`KVCache.truncate <cupykv.KVCache.truncate>` this rolls a
        sequence back and sends it down another path: truncate to the shared
        prefix, ``feed`` the new token, then ``decode_step()``. Not inside a
        captured step (it uploads host values).
        """
        batch = self.cache.spec.batch
        if not self._is_token_list(token_ids) or len(token_ids) != batch:
            raise ValueError(f"token_ids: expected {batch} token ids in 0..{self.config.vocab_size - 1} "
                             f"(one per sequence), got {token_ids!r:.80}")
        self.backend.upload(self._decode.ids, np.array([int(t) for t in token_ids], np.int32))

    def next_tokens(self) -> list[int]:
        """The greedy token of each sequence from the last step: what the next :meth:`decode_step` embeds."""
        return self.backend.to_host(self._decode.ids).tolist()

    def _prefill(self, prompts: list[list[int]]) -> None:
        """Run every prompt (padded to the longest) through the model; leaves the first new token in ids."""
        batch, longest = self.cache.spec.batch, max(len(p) for p in prompts)
        act = _Activations(self.backend, self.config, self._storage, batch, longest)
        ids = np.zeros((batch, longest), np.int32)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)] = prompt
        self.backend.upload(act.ids, ids.reshape(-1))
        self.cache.reset()
        self._forward(act)
        lengths = np.array([len(p) for p in prompts], np.int64)
        last_rows = np.arange(batch) * longest + lengths - 1   # each sequence's last prompt token
        self._head(act.hidden[self.backend.asarray(last_rows)])
        self.cache.advance(lengths)

    # -- generation --------------------------------------------------------------
    def _check_prompts(self, prompts, max_new_tokens) -> list[list[int]]:
        spec = self.cache.spec
        max_new_tokens = _args.check_int("max_new_tokens", max_new_tokens, 1, max(1, spec.max_seq - 1))
        if not isinstance(prompts, (list, tuple)) or not 1 <= len(prompts) <= spec.batch:
            raise ValueError(f"prompts: expected a list of 1..{spec.batch} token lists, got {prompts!r:.80}")
        checked = []
        for b, prompt in enumerate(prompts):
            tokens = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
            if not tokens or not self._is_token_list(tokens):
                raise ValueError(f"prompts[{b}]: expected a non-empty list of token ids in "
                                 f"0..{self.config.vocab_size - 1}, got {prompt!r:.80}")
            if len(tokens) + max_new_tokens > spec.max_seq:
                raise ValueError(f"prompts[{b}]: expected len(prompt) + max_new_tokens <= max_seq={spec.max_seq}, "
                                 f"got {len(tokens)} + {max_new_tokens}")
            checked.append([int(t) for t in tokens])
        # unused slots decode a one-token dummy prompt; their tokens are dropped
        return checked + [[0]] * (spec.batch - len(checked))

    def generate(self, prompts, max_new_tokens: int, *, use_graph: bool = True, return_logits: bool = False,
                 progress=None, stop_ids=(), on_token=None):
        """Greedy decoding of a batch of prompts.

        Parameters
        ----------
        prompts : list of list of int
            1..batch prompts of token ids, of any lengths >= 1.
        max_new_tokens : int
            Tokens to generate per prompt (the first comes from the prefill).
        use_graph : bool, default True
            Replay one captured decode step (every layer) instead of launching eagerly.
        return_logits : bool, default False
            Also return the float32 logits of every generated step, ``[steps, batch, vocab]``.
        progress : callable, optional
            Called as ``progress(done, total)`` after each token.
        stop_ids : sequence of int, optional
            Token ids that end a sequence (end of text, end of turn): a
            sequence's tokens stop after the first one, which is kept, and
            decoding stops once every sequence has emitted one.
        on_token : callable, optional
            Called as ``on_token(ids)`` after each step with that step's new
            token of every prompt (a list), for streaming.

        Returns
        -------
        tokens : list of list of int
            The new tokens, one list per prompt.
        logits : np.ndarray float32 ``[steps, len(prompts), vocab]``
            Only with ``return_logits=True``; ``steps`` is ``max_new_tokens``
            unless every sequence stopped earlier.
        """
        n_prompts = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        padded = self._check_prompts(prompts, max_new_tokens)
        use_graph = _args.check_bool("use_graph", use_graph)
        return_logits = _args.check_bool("return_logits", return_logits)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress: expected None or a callable, got {_args.got(progress)}")
        stops = self._check_stop_ids(stop_ids)
        self._prefill(padded)
        steps_ids, steps_logits = [], []
        stopped = np.zeros(n_prompts, bool)

        def collect(done):
            ids = self.backend.to_host(self._decode.ids)
            steps_ids.append(ids)
            if return_logits:
                steps_logits.append(self._host_logits())
            if on_token is not None:
                on_token(ids[:n_prompts].tolist())
            if progress is not None:
                progress(done, max_new_tokens)
            stopped[:] |= np.isin(ids[:n_prompts], stops)
            return bool(stopped.all())

        finished = collect(1)
        for step in range(1, max_new_tokens):
            if finished:
                break
            if not use_graph:
                self.decode_step()
            elif self._graph is None:
                self._graph = capture(self.decode_step)   # the warm-up run is this step
            else:
                self._graph.replay()
            finished = collect(step + 1)
        if self.backend.to_host(self._embedding_error)[0]:   # cannot happen for validated prompts and argmax ids
            raise RuntimeError("embedding: a token id outside 0..vocab_size-1 reached the model")
        tokens = [_cut_after_stop(row, stops) for row in np.stack(steps_ids, axis=1)[:n_prompts].tolist()]
        if return_logits:
            return tokens, np.stack(steps_logits)[:, :n_prompts]
        return tokens

    def _is_token_list(self, values) -> bool:
        """Whether ``values`` is a list, tuple or array of token ids in ``0..vocab_size - 1``."""
        return isinstance(values, (list, tuple, np.ndarray)) and all(
            _args.is_int(t) and 0 <= t < self.config.vocab_size for t in values)

    def _check_stop_ids(self, stop_ids) -> np.ndarray:
        if _args.is_int(stop_ids):
            stop_ids = [stop_ids]
        if not self._is_token_list(stop_ids):
            raise ValueError(f"stop_ids: expected token ids in 0..{self.config.vocab_size - 1}, got {stop_ids!r:.80}")
        return np.array([int(i) for i in stop_ids], np.int64)

    def _host_logits(self) -> np.ndarray:
        host = self.backend.to_host(self._logits)
        return host.view(self.cache.spec.np_dtype).astype(np.float32)


def _cut_after_stop(tokens: list[int], stop_ids) -> list[int]:
    """``tokens`` up to and including the first stop id."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


def _load_config(config_path_or_dict) -> LlamaConfig:
    if isinstance(config_path_or_dict, LlamaConfig):
        return config_path_or_dict
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        with open(config_path_or_dict, encoding="utf-8") as f:
            return LlamaConfig.from_hf(json.load(f))
    return LlamaConfig.from_hf(config_path_or_dict)


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16",
                       "I64": np.int64, "I32": np.int32}


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
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r}: expected one of {sorted(_SAFETENSORS_DTYPES)}, "
                             f"got dtype {entry['dtype']}")
        dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).newbyteorder("<")
        begin, end = entry["data_offsets"]
        weights[name] = data[begin:end].view(dtype).reshape(entry["shape"])
    return weights
