"""The NumPy reference of the LLaMA model: the logits the fast model is checked against.

Plain and independent of the fast path's batching: each prompt is run on its
own batch-1 ``cupykv.reference.KVCache`` with no padding, with
``cupykv.ops_reference`` ops (float64 math, every op's output rounded to the
storage dtype, as the kernels round it) and ``cupykv.reference.attention``.
Decoding is teacher-forced on given tokens, so the logits of every step can be
compared even where a near-tie made the two greedy paths differ. With
``kv_dtype="float8_e4m3"`` the reference cache quantizes K and V with the same
scales, bit for bit as the fast cache does (:mod:`cupykv.fp8`).
"""
from __future__ import annotations

import numpy as np

from cupykv import ops_reference as ops
from cupykv import reference
from cupykv._args import check_kv_scale
from cupykv.models.config import LlamaConfig
from cupykv.reference import round_to_storage
from cupykv.rope import Rope


class LlamaReference:
    """Same constructor arguments as :class:`cupykv.models.Llama` (no batch or backend).

    ``dtype`` rounds weights and every op's output; ``kv_dtype``, ``k_scale``
    and ``v_scale`` make the cache as the fast model's (``kv_dtype="float8_e4m3"``:
    an fp8 cache with those scales, float32 or broadcastable to
    ``[num_hidden_layers, num_key_value_heads]``). ``k_scales`` and ``v_scales``
    hold them as float32 ``[num_hidden_layers, num_key_value_heads]``.
    """

    def __init__(self, config: LlamaConfig, weights, *, dtype="float32", kv_dtype=None, k_scale=1.0, v_scale=1.0,
                 max_seq=256):
        self.config = config
        self.spec = config.cache_spec(dtype, max_seq, 1, kv_dtype)
        self.k_scales = check_kv_scale("k_scale", k_scale, self.spec)
        self.v_scales = check_kv_scale("v_scale", v_scale, self.spec)
        self.weights = {name: round_to_storage(np.asarray(w, np.float64), self.spec.io_np_dtype)
                        for name, w in config.check_weights(weights).items()}
        if config.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.rope = Rope(theta=config.rope_theta)

    def _cache(self) -> reference.KVCache:
        """An empty batch-1 reference cache of this model's spec and scales."""
        return reference.KVCache(self.spec, k_scale=self.k_scales, v_scale=self.v_scales)

    def _step(self, cache, ids, maps=None) -> np.ndarray:
        """Run ``ids`` (one sequence's new tokens) through the model; returns the last token's logits.

        ``maps``, a list, receives each layer's attention weights ``[n_heads, n, max_seq]``.
        """
        c, w, eps = self.config, self.weights, self.config.rms_norm_eps
        n = len(ids)
        hidden = ops.embedding(np.asarray(ids, np.int32), w["model.embed_tokens.weight"])     # [n, hidden]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            normed = ops.rmsnorm(hidden, w[p + "input_layernorm.weight"], eps)
            q = ops.linear(normed, w[p + "self_attn.q_proj.weight"]).reshape(1, n, c.num_attention_heads, c.head_dim)
            k = ops.linear(normed, w[p + "self_attn.k_proj.weight"]).reshape(1, n, c.num_key_value_heads, c.head_dim)
            v = ops.linear(normed, w[p + "self_attn.v_proj.weight"]).reshape(1, n, c.num_key_value_heads, c.head_dim)
            cache.append(i, k, v, rope=self.rope)
            attn = round_to_storage(reference.attention(q, cache, i, rope=self.rope), self.spec.io_np_dtype)
            if maps is not None:
                maps.append(reference.attention_weights(q, cache, i, rope=self.rope)[0].transpose(1, 0, 2))
            hidden = ops.add(hidden, ops.linear(attn.reshape(n, -1), w[p + "self_attn.o_proj.weight"]))
            normed = ops.rmsnorm(hidden, w[p + "post_attention_layernorm.weight"], eps)
            act = ops.silu_mul(ops.linear(normed, w[p + "mlp.gate_proj.weight"]),
                               ops.linear(normed, w[p + "mlp.up_proj.weight"]))
            hidden = ops.add(hidden, ops.linear(act, w[p + "mlp.down_proj.weight"]))
        cache.advance(n)
        last = ops.rmsnorm(hidden[-1:], w["model.norm.weight"], eps)
        return ops.linear(last, w["lm_head.weight"])[0].astype(np.float64)      # [vocab]

    def attention_maps(self, prompt) -> np.ndarray:
        """Every layer's attention weights over one prompt, ``[n_layers, n_heads, n, n]`` (float64).

        ``maps[l, h, i, j]`` is how much token ``i`` of ``prompt`` reads token
        ``j`` in head ``h`` of layer ``l`` (0 for ``j > i``).
        """
        maps: list[np.ndarray] = []
        self._step(self._cache(), list(prompt), maps)
        n = len(prompt)
        return np.stack(maps)[..., :n]

    def greedy(self, prompts, max_new_tokens) -> tuple[list[list[int]], np.ndarray]:
        """Greedy decoding of each prompt on its own: ``(tokens, logits)``, no stop ids.

        ``tokens[b]`` has ``max_new_tokens`` ids; ``logits`` is float64
        ``[max_new_tokens, len(prompts), vocab]``, row ``s`` the logits that chose token ``s``.
        """
        out = np.zeros((max_new_tokens, len(prompts), self.config.vocab_size))
        tokens: list[list[int]] = []
        for b, prompt in enumerate(prompts):
            cache, ids = self._cache(), list(prompt)
            for s in range(max_new_tokens):
                out[s, b] = self._step(cache, ids)
                ids = [int(out[s, b].argmax())]
            tokens.append([int(t) for t in out[:, b].argmax(-1)])
        return tokens, out

    def logits(self, prompts, tokens) -> np.ndarray:
        """Teacher-forced logits ``[steps, len(prompts), vocab]`` (float64).

        Step 0 comes from the prompt; step ``s`` feeds ``tokens[b][s - 1]``.
        """
        steps = len(tokens[0])
        out = np.zeros((steps, len(prompts), self.config.vocab_size))
        for b, (prompt, generated) in enumerate(zip(prompts, tokens)):
            cache = self._cache()
            out[0, b] = self._step(cache, prompt)
            for s in range(1, steps):
                out[s, b] = self._step(cache, [generated[s - 1]])
        return out
