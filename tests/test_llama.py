"""The LLaMA model: HF config and weights, eager == graph decoding, logits within tolerance of the reference model."""
import json

import numpy as np
import pytest

from cupykv.models import Llama, LlamaConfig
from cupykv.models.llama import load_weights
from cupykv.models.llama_reference import LlamaReference
from cupykv.tolerances import logits_tolerance
from backends import BACKENDS

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 200,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "max_position_embeddings": 4096,
}
PROMPTS = [[1, 5, 9, 2, 7], [3, 4, 4, 8, 120, 17, 11, 6, 2], [42, 43, 44]]   # three different lengths


def test_from_hf_reads_the_older_and_the_current_rope_forms():
    old = LlamaConfig.from_hf(HF_CONFIG)
    current = dict(HF_CONFIG)
    del current["rope_theta"]
    current["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert LlamaConfig.from_hf(current) == old
    assert old.rope_theta == 500000.0 and old.head_dim == 16 and old.num_key_value_heads == 2


def test_from_hf_honours_head_dim_and_defaults_kv_heads():
    config = dict(HF_CONFIG, head_dim=32)
    del config["num_key_value_heads"]
    parsed = LlamaConfig.from_hf(config)
    assert parsed.head_dim == 32 and parsed.num_key_value_heads == 4
    assert parsed.weight_shapes()["model.layers.0.self_attn.q_proj.weight"] == (128, 64)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, r"rope_parameters.rope_type: .*got 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling.rope_type: .*got 'linear'"),
    ({"hidden_act": "gelu"}, r"hidden_act: expected one of \('silu',\), got 'gelu'"),
    ({"attention_bias": True}, r"attention_bias: expected false"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads: expected a divisor of num_attention_heads=4, got 3"),
])
def test_from_hf_rejects_what_it_does_not_implement(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf(dict(HF_CONFIG, **change))


#: The required LlamaConfig fields, HF_CONFIG's values.
SHAPE = {name: HF_CONFIG[name] for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "intermediate_size", "vocab_size")}


@pytest.mark.parametrize("change, error, message", [
    *[({name: 0}, ValueError, rf"{name}: expected an int in 1\.\.2147483647, got 0") for name in SHAPE],
    ({"vocab_size": 2**31}, ValueError, r"vocab_size: expected an int in 1\.\.2147483647, got 2147483648"),
    ({"num_key_value_heads": 0}, ValueError, r"num_key_value_heads: expected an int in 1\.\.2147483647, got 0"),
    ({"head_dim": 15}, ValueError, r"head_dim: expected an even int \(rotary pairs halves\), got 15"),
    ({"head_dim": 1}, ValueError, r"head_dim: expected an int in 2\.\.256, got 1"),
    ({"head_dim": 258}, ValueError, r"head_dim: expected an int in 2\.\.256, got 258"),
    ({"hidden_size": 66}, ValueError, r"hidden_size: expected a multiple of num_attention_heads=4 \(or an explicit "
                                      r"head_dim\), got 66"),
    ({"tie_word_embeddings": 1}, TypeError, r"tie_word_embeddings: expected a bool, got 1"),
])
def test_a_config_that_the_kernels_cannot_run_is_refused_by_field(change, error, message):
    with pytest.raises(error, match=rf"^LlamaConfig\.{message}$"):
        LlamaConfig(**{**SHAPE, **change})


def test_a_config_defaults_like_hugging_faces_and_is_a_frozen_value():
    config = LlamaConfig(**SHAPE)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (4, 16, False)
    assert (config.rms_norm_eps, config.rope_theta) == (1e-6, 10000.0)
    noted = LlamaConfig(**SHAPE, extra={"torch_dtype": "bfloat16"})
    assert noted == config and repr(noted) == repr(config)      # extra keys neither compare nor print
    with pytest.raises(AttributeError):
        config.vocab_size = 7
    assert LlamaConfig.from_hf({k: v for k, v in HF_CONFIG.items() if k != "tie_word_embeddings"}) \
        .tie_word_embeddings is False                            # absent from config.json: untied, as in HF


def test_from_hf_names_every_missing_required_key():
    with pytest.raises(ValueError, match=r"^config: expected the keys \['hidden_size', 'num_hidden_layers', "
                                         r"'num_attention_heads', 'intermediate_size', 'vocab_size'\], missing "
                                         r"\['num_hidden_layers', 'vocab_size'\]$"):
        LlamaConfig.from_hf({k: v for k, v in HF_CONFIG.items() if k not in ("num_hidden_layers", "vocab_size")})


def test_weights_that_are_not_a_mapping_or_not_floats_are_refused():
    config = LlamaConfig(**SHAPE)
    with pytest.raises(TypeError, match=r"^weights: expected a mapping of Hugging Face names to arrays, got list$"):
        config.check_weights([1, 2])
    weights = config.random_weights(0)
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.int32)
    with pytest.raises(TypeError, match=r"^weights\['model\.norm\.weight'\]: expected a float array, got dtype "
                                        r"int32$"):
        config.check_weights(weights)


def test_missing_or_misshapen_weights_are_named():
    config = LlamaConfig.from_hf(HF_CONFIG)
    weights = config.random_weights(0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' of shape \(96, 64\), missing"):
        Llama(config, weights, backend="emulator")
    weights = config.random_weights(0)
    weights["lm_head.weight"] = weights["lm_head.weight"][:10]
    with pytest.raises(ValueError, match=r"weights\['lm_head.weight'\]: expected shape \(200, 64\), got \(10, 64\)"):
        Llama(config, weights, backend="emulator")


@pytest.fixture(scope="module")
def config():
    return LlamaConfig.from_hf(HF_CONFIG)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_graph_and_reference_agree(backend, dtype, config):
    weights = config.random_weights(seed=3)
    model = Llama(config, weights, dtype=dtype, max_seq=32, batch=3, backend=backend)
    eager_tokens, eager_logits = model.generate(PROMPTS, 6, use_graph=False, return_logits=True)
    graph_tokens, graph_logits = model.generate(PROMPTS, 6, use_graph=True, return_logits=True)
    assert graph_tokens == eager_tokens                         # identical tokens
    assert np.array_equal(graph_logits, eager_logits)           # same kernels, same inputs: bitwise
    assert eager_logits.shape == (6, 3, config.vocab_size) and eager_logits.dtype == np.float32
    want = LlamaReference(config, weights, dtype=dtype, max_seq=32).logits(PROMPTS, eager_tokens)
    tolerance = logits_tolerance(dtype, np.abs(want).max(), config.num_hidden_layers)
    error = np.abs(eager_logits - want).max()
    assert error <= tolerance, f"max logit error {error:.3g} > tolerance {tolerance:.3g}"
    # |logit error| <= error everywhere, so wherever the reference's best token wins by more than
    # 2 * error, greedy decoding must pick it
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * error                     # [steps, batch]
    chosen = np.asarray(eager_tokens).T                                   # [steps, batch]
    assert clear.sum() >= clear.size // 2
    assert np.array_equal(chosen[clear], want.argmax(-1)[clear])


def test_a_second_generate_replays_the_captured_step(config):
    model = Llama.random(config, seed=1, max_seq=32, batch=2, backend="emulator")
    first = model.generate(PROMPTS[:2], 4)
    graph = model._graph
    again = model.generate(PROMPTS[:2], 4)
    fresh = Llama.random(config, seed=1, max_seq=32, batch=2, backend="emulator").generate(PROMPTS[:2], 4,
                                                                                           use_graph=False)
    assert model._graph is graph and first == again == fresh


def test_fewer_prompts_than_slots_and_tied_embeddings():
    config = LlamaConfig.from_hf(dict(HF_CONFIG, tie_word_embeddings=True))
    weights = config.random_weights(0)
    assert "lm_head.weight" not in weights
    model = Llama(config, weights, max_seq=32, batch=3, backend="emulator")
    tokens, logits = model.generate([[5, 6, 7]], 3, return_logits=True)
    want = LlamaReference(config, weights, max_seq=32).logits([[5, 6, 7]], tokens)
    assert len(tokens) == 1 and logits.shape == (3, 1, config.vocab_size)
    assert np.abs(logits - want).max() <= logits_tolerance("float32", np.abs(want).max(), 2)


def test_weights_load_from_npz_and_safetensors(tmp_path, config):
    from safetensors import numpy as safetensors_numpy   # in the test extra
    weights = config.random_weights(seed=2)
    np.savez(tmp_path / "w.npz", **weights)
    safetensors_numpy.save_file(weights, str(tmp_path / "w.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    direct = Llama(config, weights, max_seq=32, batch=1, backend="emulator").generate([PROMPTS[0]], 3)
    for path in ("w.npz", "w.safetensors"):
        loaded = load_weights(tmp_path / path)
        assert set(loaded) == set(weights)
        assert all(np.array_equal(loaded[name], weights[name]) for name in weights)
        model = Llama.from_safetensors(tmp_path / "config.json", tmp_path / path, max_seq=32, batch=1,
                                       backend="emulator")
        assert model.generate([PROMPTS[0]], 3) == direct


def test_bfloat16_safetensors_load_as_ml_dtypes_bfloat16(tmp_path, config):
    from safetensors import numpy as safetensors_numpy
    import ml_dtypes
    weights = config.random_weights(seed=4)
    bits = {name: w.astype(ml_dtypes.bfloat16).view(np.uint16) for name, w in weights.items()}
    safetensors_numpy.save_file(bits, str(tmp_path / "u16.safetensors"))
    # relabel the uint16 tensors as BF16, as a bfloat16 checkpoint stores them
    raw = bytearray((tmp_path / "u16.safetensors").read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = bytes(raw[8 : 8 + size]).replace(b'"U16"', b'"BF16"')
    (tmp_path / "bf16.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(raw[8 + size:]))
    loaded = load_weights(tmp_path / "bf16.safetensors")
    assert all(loaded[name].dtype == ml_dtypes.bfloat16 and
               np.array_equal(loaded[name].view(np.uint16), bits[name]) for name in weights)
    model = Llama(config, loaded, dtype="bfloat16", max_seq=32, batch=1, backend="emulator")
    direct = Llama(config, weights, dtype="bfloat16", max_seq=32, batch=1, backend="emulator")
    assert model.generate([PROMPTS[0]], 3) == direct.generate([PROMPTS[0]], 3)


@pytest.mark.parametrize("prompts, new, message", [
    ([], 2, r"^prompts: expected a list of 1\.\.2 token lists"),
    ([[1], [2], [3]], 2, r"^prompts: expected a list of 1\.\.2"),
    ([[1, 2], []], 2, r"^prompts\[1\]: expected a non-empty list of token ids in 0\.\.199"),
    ([[1, 200]], 2, r"^prompts\[0\]: .*got \[1, 200\]"),
    ([[1] * 30], 5, r"^prompts\[0\]: expected len\(prompt\) \+ max_new_tokens <= max_seq=32, got 30 \+ 5"),
    ([[1]], 0, r"^max_new_tokens: expected an int in 1\.\.31, got 0"),
    ([[1]], 2**64, r"^max_new_tokens: expected an int in 1\.\.31, got 18446744073709551616"),
])
def test_bad_prompts_are_rejected_before_anything_runs(config, prompts, new, message):
    model = Llama.random(config, max_seq=32, batch=2, backend="emulator")
    with pytest.raises(ValueError, match=message):
        model.generate(prompts, new)
    assert model.cache.lengths_host().tolist() == [0, 0]


def test_the_smallest_caches_bound_max_new_tokens_by_max_seq_minus_one(config):
    # a prompt has a token at least, so max_new_tokens <= max_seq - 1 (and 1..1 for a cache of one row,
    # where the prompt check then refuses every prompt)
    two_rows = Llama.random(config, max_seq=2, batch=1, backend="emulator")
    with pytest.raises(ValueError, match=r"^max_new_tokens: expected an int in 1\.\.1, got 2$"):
        two_rows.generate([[1]], 2)
    roomy = Llama.random(config, max_seq=8, batch=1, backend="emulator")
    assert two_rows.generate([[1]], 1) == roomy.generate([[1]], 1)   # the prefill's token alone
    one_row = Llama.random(config, max_seq=1, batch=1, backend="emulator")
    with pytest.raises(ValueError, match=r"^max_new_tokens: expected an int in 1\.\.1, got 2$"):
        one_row.generate([[1]], 2)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: expected len\(prompt\) \+ max_new_tokens <= max_seq=1, "
                                         r"got 1 \+ 1$"):
        one_row.generate([[1]], 1)
    assert one_row.cache.lengths_host().tolist() == [0]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_seq=2**31), ValueError, r"^max_seq: expected an int in 1\.\.1073741824, got 2147483648$"),
    (dict(batch=np.uint64(2**64 - 1)), ValueError,
     r"^batch: expected an int in 1\.\.2147483647, got 18446744073709551615$"),
    (dict(dtype="float64"), ValueError, r"^dtype: expected one of 'float32', 'float16', 'bfloat16', got 'float64'$"),
    (dict(seed=-1), ValueError, r"^seed: expected an int in 0..18446744073709551615, got -1$"),
])
def test_bad_model_arguments_are_named(config, kwargs, error, message):
    with pytest.raises(error, match=message):
        Llama.random(config, **{"max_seq": 32, "backend": "emulator", **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(use_graph="no"), r"^use_graph: expected a bool, got 'no' \(str\)$"),
    (dict(return_logits=1), r"^return_logits: expected a bool, got 1 \(int\)$"),
    (dict(progress="print"), r"^progress: expected None or a callable, got 'print' \(str\)$"),
])
def test_bad_generate_flags_are_named_before_anything_runs(config, kwargs, message):
    model = Llama.random(config, max_seq=32, batch=2, backend="emulator")
    with pytest.raises(TypeError, match=message):
        model.generate([[1, 2]], 2, **kwargs)
    assert model.cache.lengths_host().tolist() == [0, 0]


def test_config_floats_must_hold_in_the_kernels_types():
    with pytest.raises(ValueError,
                       match=r"^LlamaConfig\.rms_norm_eps: expected a float in 1\.1754944e-38\.\.3\.4028235e\+38"):
        LlamaConfig.from_hf(dict(HF_CONFIG, rms_norm_eps=1e-50))          # 0 in float32: rmsnorm would give NaN
    with pytest.raises(ValueError, match=r"^LlamaConfig\.rope_theta: expected a float in 1\.\.1\.7976931e\+308"):
        LlamaConfig.from_hf(dict(HF_CONFIG, rope_theta=0.5))
