"""The NumPy reference of the LLaMA model: the logits the fast model is checked against.

Plain and independent of the fast path's batching: each prompt is run on its
own batch-1 ``cupykv.reference.KVCache`` with no padding, with
``cupykv.ops_reference`` ops (float64 math, every op's output rounded to the
storage dtype, as the kernels round it) and ``cupykv.reference.attention``.
Decoding is teacher-forced on given tokens, so the logits of every step can be
compared even where a near-tie made the two greedy paths differ.
"""
from __future__ import annotations

import numpy as np

from cupykv import ops_reference as ops
from cupykv import reference
from cupykv.models.config import LlamaConfig
from cupykv.reference import round_to_storage
from cupykv.rope import Rope
from cupykv.spec import CacheSpec


class LlamaReference:
    """Same constructor arguments as :class:`cupykv.models.Llama` (no backend)."""

    def __init__(self, config: LlamaConfig, weights, *, dtype="float32", max_seq=256):
        self.config = config
        self.spec = CacheSpec(n_layers=config.num_hidden_layers, n_kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim, max_seq=max_seq, batch=1, dtype=dtype)
        self.weights = {name: round_to_storage(np.asarray(w, np.float64), self.spec.np_dtype)
                        for name, w in config.check_weights(weights).items()}
        if config.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.rope = Rope(theta=config.rope_theta)

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
            attn = round_to_storage(reference.attention(q, cache, i, rope=self.rope), self.spec.np_dtype)
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
        self._step(reference.KVCache(self.spec), list(prompt), maps)
        n = len(prompt)
        return np.stack(maps)[..., :n]

    def logits(self, prompts, tokens) -> np.ndarray:
        """Teacher-forced logits ``[steps, len(prompts), vocab]`` (float64).

        Step 0 comes from the prompt; step ``s`` feeds ``tokens[b][s - 1]``.
        """
        steps = len(tokens[0])
        out = np.zeros((steps, len(prompts), self.config.vocab_size))
        for b, (prompt, generated) in enumerate(zip(prompts, tokens)):
            cache = reference.KVCache(self.spec)
            out[0, b] = self._step(cache, prompt)
            for s in range(1, steps):
                out[s, b] = self._step(cache, [generated[s - 1]])
        return out
