"""The LLaMA model on an fp8 (E4M3) KV cache: ``Llama(..., kv_dtype="float8_e4m3")``.

Eager and graph decoding give identical tokens and logits, and the logits stay within the model's io-dtype
tolerance of the reference model on the same fp8 cache (the fast and the reference cache quantize bit for
bit alike). Calibrated scales are the per-head maxima of the rotated keys and of the values, and scales
set between replays reach a captured step.
"""
import dataclasses

import numpy as np
import pytest

from cupykv.fp8 import calibrate_scales
from cupykv.models import Llama, LlamaConfig
from cupykv.models.gguf import GGUFCheckpoint
from cupykv.models.llama_reference import LlamaReference
from cupykv.tolerances import logits_tolerance
from backends import BACKENDS

FP8 = "float8_e4m3"
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 200,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
}
PROMPTS = [[1, 5, 9, 2, 7], [3, 4, 4, 8, 120, 17, 11, 6, 2], [42, 43, 44]]   # three different lengths
CALIBRATION = [[7, 8, 9, 10, 11, 12], [150, 3, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 6


@pytest.fixture(scope="module")
def config():
    return LlamaConfig.from_hf(HF_CONFIG)


@pytest.fixture(scope="module")
def weights(config):
    return config.random_weights(seed=3)


def assert_within_tolerance(got, want, dtype, n_layers):
    """``got`` (float32 logits ``[steps, batch, vocab]``) within the io-dtype logits tolerance of ``want``."""
    tolerance = logits_tolerance(dtype, np.abs(want).max(), n_layers)
    error = np.abs(got - want)
    assert error.max() <= tolerance, (f"max logit error {error.max():.3g} (mean {error.mean():.3g}) "
                                      f"> tolerance {tolerance:.3g}")
    return error.max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eager_graph_and_reference_agree_on_an_fp8_cache(backend, dtype, config, weights):
    model = Llama(config, weights, dtype=dtype, kv_dtype=FP8, max_seq=32, batch=3, backend=backend)
    assert model.cache.spec.dtype == FP8 and model.cache.spec.io_dtype == dtype
    assert model.cache.spec.itemsize == 1
    k_scale, v_scale = model.calibrate_kv_scales(CALIBRATION)
    eager_tokens, eager_logits = model.generate(PROMPTS, NEW, use_graph=False, return_logits=True)
    graph_tokens, graph_logits = model.generate(PROMPTS, NEW, use_graph=True, return_logits=True)
    assert graph_tokens == eager_tokens                          # identical tokens
    assert np.array_equal(graph_logits, eager_logits)            # same kernels, same inputs: bitwise
    reference = LlamaReference(config, weights, dtype=dtype, kv_dtype=FP8, k_scale=k_scale, v_scale=v_scale,
                               max_seq=32)
    want = reference.logits(PROMPTS, eager_tokens)
    error = assert_within_tolerance(eager_logits, want, dtype, config.num_hidden_layers)
    # wherever the reference's best token wins by more than 2 * error, greedy decoding must pick it
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * error            # [steps, batch]
    assert clear.sum() >= clear.size // 2
    assert np.array_equal(np.asarray(eager_tokens).T[clear], want.argmax(-1)[clear])


def reference_scales(config, weights, prompts):
    """calibrate_scales over the rotated keys and the values of every prompt token, from the reference model
    on an unquantized float32 cache: (k_scale, v_scale), each ``[n_layers, n_kv_heads]``."""
    reference = LlamaReference(config, weights, dtype="float32", max_seq=16)
    n_layers = config.num_hidden_layers
    keys, values = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    for prompt in prompts:
        cache = reference._cache()
        reference._step(cache, prompt)
        for layer in range(n_layers):
            k, v = cache.rows(layer, 0)                          # [len, n_kv, hd] each
            keys[layer].append(k)
            values[layer].append(v)
    return tuple(calibrate_scales(np.stack([np.concatenate(rows) for rows in samples])) for samples in (keys, values))


@pytest.mark.parametrize("prompts", [CALIBRATION, [[5], [150], [17]]], ids=["mixed lengths", "one token each"])
def test_calibrated_scales_are_the_per_head_maxima_of_rotated_keys_and_values(config, weights, prompts):
    # batch 2 with 3 prompts: the calibration runs in two passes, padding rows left out
    model = Llama(config, weights, dtype="float32", kv_dtype=FP8, max_seq=16, batch=2, backend="emulator")
    k_scale, v_scale = model.calibrate_kv_scales(prompts)
    assert k_scale.shape == v_scale.shape == (2, 2) and k_scale.dtype == np.float32
    assert all(np.array_equal(got, want) for got, want in zip(model.cache.scales_host(), (k_scale, v_scale)))
    want_k, want_v = reference_scales(config, weights, prompts)
    np.testing.assert_allclose(k_scale, want_k, rtol=1e-5)      # float32 kernels vs float64 reference
    np.testing.assert_allclose(v_scale, want_v, rtol=1e-5)
    assert model.cache.lengths_host().tolist() == [0, 0]          # the model's own cache is untouched


def test_scales_set_between_replays_reach_the_captured_step(config, weights):
    model = Llama(config, weights, dtype="bfloat16", kv_dtype=FP8, max_seq=32, batch=3, backend="emulator")
    k_scale, v_scale = model.calibrate_kv_scales(CALIBRATION)
    first_tokens, first = model.generate(PROMPTS, NEW, return_logits=True)
    graph = model._graph
    # not powers of two (those only shift E4M3 exponents); V's saturate the largest values
    new_k, new_v = k_scale * np.float32(1.7), v_scale * np.float32(0.6)
    model.cache.set_scales(new_k, new_v)
    tokens, logits = model.generate(PROMPTS, NEW, return_logits=True)
    assert model._graph is graph                                  # replayed, not captured again
    assert not np.array_equal(logits[1:], first[1:])              # steps 1.. come from replays
    fresh = Llama(config, weights, dtype="bfloat16", kv_dtype=FP8, k_scale=new_k, v_scale=new_v, max_seq=32,
                  batch=3, backend="emulator")
    fresh_tokens, fresh_logits = fresh.generate(PROMPTS, NEW, use_graph=False, return_logits=True)
    assert tokens == fresh_tokens and np.array_equal(logits, fresh_logits)
    want = LlamaReference(config, weights, dtype="bfloat16", kv_dtype=FP8, k_scale=new_k, v_scale=new_v,
                          max_seq=32).logits(PROMPTS, tokens)
    assert_within_tolerance(logits, want, "bfloat16", config.num_hidden_layers)


def test_from_gguf_and_the_draft_keep_the_fp8_cache(config, weights):
    checkpoint = GGUFCheckpoint(config, weights, {}, {})
    model = Llama.from_gguf(checkpoint, dtype="bfloat16", kv_dtype=FP8, k_scale=0.01, v_scale=0.02, max_seq=32,
                            batch=2, backend="emulator")
    assert model.cache.spec.dtype == FP8 and model.cache.spec.io_dtype == "bfloat16"
    draft = model.first_layers(1)
    assert draft.cache.spec == dataclasses.replace(model.cache.spec, n_layers=1)
    assert all(np.all(s == want) for s, want in zip(draft.cache.scales_host(), (0.01, 0.02)))
    greedy = model.generate(PROMPTS[:2], 5, use_graph=False)
    assert model.generate(PROMPTS[:2], 5, use_graph=False, draft=draft, num_speculative=2) == greedy


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kv_dtype="float16"), ValueError,
     r"^kv_dtype: expected None, 'bfloat16' \(the model's dtype\) or 'float8_e4m3', got 'float16'$"),
    (dict(kv_dtype="fp8"), ValueError, r"^kv_dtype: expected None, 'bfloat16' .*got 'fp8'$"),
    (dict(kv_dtype=8), TypeError, r"^kv_dtype: expected None, .*got 8 \(int\)$"),
    (dict(dtype=FP8), ValueError, r"^dtype: expected one of 'float32', 'float16', 'bfloat16', got 'float8_e4m3'$"),
    (dict(kv_dtype=FP8, k_scale=-1.0), ValueError, r"^k_scale: expected every scale finite, > 0"),
    (dict(kv_dtype=FP8, v_scale=np.ones(3)), ValueError, r"^v_scale: expected a float or an array broadcastable"),
    (dict(k_scale=0.5), ValueError, r"^k_scale: expected 1\.0 for a bfloat16 cache"),
])
def test_bad_kv_arguments_are_named(config, weights, kwargs, error, message):
    with pytest.raises(error, match=message):
        Llama(config, weights, **{"dtype": "bfloat16", "max_seq": 16, "backend": "emulator", **kwargs})
    with pytest.raises(error, match=message):
        LlamaReference(config, weights, **{"dtype": "bfloat16", "max_seq": 16, **kwargs})


def test_calibration_needs_an_fp8_cache_and_good_prompts(config, weights):
    plain = Llama(config, weights, dtype="bfloat16", max_seq=16, backend="emulator")
    with pytest.raises(ValueError, match=r"^calibrate_kv_scales: expected a model with kv_dtype='float8_e4m3', "
                                         r"got a bfloat16 cache"):
        plain.calibrate_kv_scales(CALIBRATION)
    model = Llama(config, weights, dtype="bfloat16", kv_dtype=FP8, max_seq=16, backend="emulator")
    for prompts in ([], [[1, 2], []], [[1, 200]], "text"):
        with pytest.raises(ValueError, match=r"^prompts: expected a non-empty list of non-empty token lists"):
            model.calibrate_kv_scales(prompts)
    assert all(np.all(s == 1) for s in model.cache.scales_host())   # nothing was set


def test_the_benchs_teacher_forcing_reproduces_generate(config, weights):
    from cupykv.bench.fp8_model import teacher_forced     # what docs/fp8_smollm2.md's logit error rests on
    model = Llama(config, weights, dtype="bfloat16", kv_dtype=FP8, max_seq=32, batch=3, backend="emulator")
    model.calibrate_kv_scales(CALIBRATION)
    tokens, logits = model.generate(PROMPTS, 4, use_graph=False, return_logits=True)
    assert np.array_equal(teacher_forced(model, PROMPTS, tokens), logits)
