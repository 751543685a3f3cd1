"""reference.attention_weights: the softmax weights behind reference.attention."""
import numpy as np

import cupykv
from cupykv import reference


def _cache(rng, window_lengths=(5, 9)):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=8, max_seq=16, batch=2, dtype="float32")
    cache = reference.KVCache(spec)
    rows = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    cache.append(0, rows, rows[::-1].copy())
    cache.advance(list(window_lengths))
    return cache


def test_weights_sum_to_one_over_exactly_the_attended_positions():
    rng = np.random.default_rng(0)
    cache = _cache(rng)
    q = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    weights = reference.attention_weights(q, cache, 0, window=4, rope=cupykv.Rope())
    assert weights.shape == (2, 3, 4, 16)
    for b, length in enumerate((5, 9)):
        for i in range(3):
            p = length + i
            attended = np.zeros(16, bool)
            attended[max(0, p - 3): min(p, 15) + 1] = True
            assert np.all(weights[b, i][:, ~attended] == 0)
            np.testing.assert_allclose(weights[b, i][:, attended].sum(-1), 1.0, rtol=1e-12)


def test_attention_is_the_weighted_sum_of_values():
    rng = np.random.default_rng(1)
    cache = _cache(rng)
    q = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    weights = reference.attention_weights(q, cache, 0, softcap=5.0)
    values = cache.v[0].astype(np.float64)[:, :, [0, 0, 1, 1]]       # [batch, max_seq, heads, head_dim]
    np.testing.assert_allclose(reference.attention(q, cache, 0, softcap=5.0),
                               np.einsum("bihj,bjhd->bihd", weights, values), rtol=1e-12, atol=1e-12)


def test_llama_reference_attention_maps_are_causal_distributions():
    from cupykv.models import LlamaConfig
    from cupykv.models.llama_reference import LlamaReference

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50)
    model = LlamaReference(config, config.random_weights(0), max_seq=16)
    maps = model.attention_maps([3, 1, 4, 1, 5])
    assert maps.shape == (2, 4, 5, 5)
    assert np.all(np.triu(maps, k=1) == 0)
    np.testing.assert_allclose(maps.sum(-1), 1.0, rtol=1e-12)
    assert maps[0, 0, 0, 0] == 1.0 and 0 < maps[1, 2, 4, 2] < 1
