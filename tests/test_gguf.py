"""GGUF loading and its tokenizer, on tiny synthetic files written with ``gguf``'s own writer."""
import dataclasses
import re

import numpy as np
import pytest

from cupykv.reference import _rotate
from cupykv.models import Llama
from cupykv.models.gguf import (GGUFError, SUPPORTED_TYPES, _hf_name, config_from_metadata, read_gguf,
                                read_metadata, unpermute_rotary_rows)
from cupykv.models.tokenizer import Tokenizer
from gguf_fixtures import END_TURN_ID, TINY, TYPE_OF, USER_TOKEN_ID, gguf_order_rows, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_llama(path)


def _expected_after_storage(hf, name, kind):
    """What a tensor of ``kind`` holds after quantization, dequantized, back in half-split order."""
    import gguf

    weight = hf[name].astype(np.float32)
    heads = TINY.num_attention_heads if "q_proj" in name else TINY.num_key_value_heads
    rotary = "q_proj" in name or "k_proj" in name
    stored = gguf_order_rows(weight, heads) if rotary else weight
    qtype = gguf.GGMLQuantizationType[kind]
    back = stored if kind == "F32" else stored.astype(np.float16).astype(np.float32) if kind == "F16" else \
        gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype)
    return unpermute_rotary_rows(back, heads) if rotary else back


def test_config_comes_from_the_files_keys(tiny):
    path, _ = tiny
    config = read_gguf(path).config
    assert config.rms_norm_eps == float(np.float32(TINY.rms_norm_eps))     # GGUF stores it as float32
    assert dataclasses.replace(config, rms_norm_eps=TINY.rms_norm_eps) == TINY


def test_keys_that_differ_from_their_defaults_are_read():
    # head_dim from key_length (not hidden / heads), kv heads, and the rope base, each unlike its default
    metadata = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
                "llama.attention.key_length": 32, "llama.rope.dimension_count": 32, "llama.attention.head_count_kv": 2,
                "llama.rope.freq_base": 100000.0, "llama.block_count": 3, "llama.feed_forward_length": 96,
                "llama.vocab_size": 50, "llama.attention.layer_norm_rms_epsilon": 1e-6}
    config = config_from_metadata(metadata)
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (32, 2, 100000.0)
    assert (config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (3, 96, 50)


def test_tensors_of_layers_past_the_block_count_are_not_the_models():
    # a file may carry tensors LLaMA does not use; a block numbered block_count is one
    assert _hf_name("blk.1.attn_q.weight", 2) == "model.layers.1.self_attn.q_proj.weight"
    assert _hf_name("blk.2.attn_q.weight", 2) is None
    assert _hf_name("rope_freqs.weight", 2) is None


def test_every_supported_type_is_dequantized_and_mapped_to_its_hf_name(tiny):
    path, hf = tiny
    checkpoint = read_gguf(path)
    assert set(checkpoint.tensor_types.values()) == set(SUPPORTED_TYPES)
    assert set(checkpoint.weights) == set(TINY.weight_shapes())
    for gguf_name, kind in checkpoint.tensor_types.items():
        layer = gguf_name.split(".")[1] if gguf_name.startswith("blk.") else None
        hf_name = next(n for n in TINY.weight_shapes() if _gguf_name(n) == gguf_name)
        got = checkpoint.weights[hf_name]
        assert got.dtype == np.float32 and got.shape == hf[hf_name].shape, gguf_name
        np.testing.assert_array_equal(got, _expected_after_storage(hf, hf_name, kind), err_msg=gguf_name)
        if kind == "F32":
            np.testing.assert_array_equal(got, hf[hf_name], err_msg=f"{gguf_name} (layer {layer})")


def _gguf_name(hf_name):
    from cupykv.models.gguf import HF_NAMES
    for gguf_name, template in HF_NAMES.items():
        if "{i}" not in template and template == hf_name:
            return gguf_name
        if "{i}" in template and hf_name.startswith("model.layers."):
            layer = hf_name.split(".")[2]
            if template.format(i=layer) == hf_name:
                return gguf_name.format(i=layer)
    return None


@pytest.mark.parametrize("heads", [TINY.num_attention_heads, TINY.num_key_value_heads])
def test_unpermuting_undoes_the_converters_row_order(heads):
    weight = np.random.default_rng(heads).standard_normal((heads * TINY.head_dim, 8)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(gguf_order_rows(weight, heads), heads), weight)


def _interleaved_rope(x, position, theta):
    """llama.cpp's rotary on ``x [..., d]``: pairs (x[2i], x[2i+1]) rotate by position * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = position * theta ** (-np.arange(0, d, 2) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[..., 1::2] = odd * np.cos(angle) + even * np.sin(angle)
    return out


def test_half_split_rope_on_unpermuted_rows_gives_llama_cpps_scores():
    # llama.cpp: interleaved rotary on stored (permuted) rows. cupykv: half-split rotary on the unpermuted
    # rows. The q.k scores must agree: the two conventions differ only by a per-head reordering of dims.
    rng = np.random.default_rng(0)
    d, hidden, theta = TINY.head_dim, 32, 10000.0
    wq, wk = rng.standard_normal((d, hidden)), rng.standard_normal((d, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    stored_q, stored_k = gguf_order_rows(wq, 1), gguf_order_rows(wk, 1)
    cpp = _interleaved_rope(stored_q @ x_q, 7, theta) @ _interleaved_rope(stored_k @ x_k, 3, theta)
    q = _rotate(unpermute_rotary_rows(stored_q, 1) @ x_q, 7, theta)     # the reference's half-split rotary
    k = _rotate(unpermute_rotary_rows(stored_k, 1) @ x_k, 3, theta)
    assert q @ k == pytest.approx(cpp, rel=1e-12)


def test_a_model_loaded_from_gguf_matches_the_reference_on_the_same_weights(tiny):
    path, _ = tiny
    checkpoint = read_gguf(path)
    model = Llama.from_gguf(checkpoint, dtype="float32", max_seq=32, batch=1, backend="emulator")
    from cupykv.models.llama_reference import LlamaReference
    tokens, logits = model.generate([[5, 9, 40, 77]], 4, return_logits=True)
    want = LlamaReference(checkpoint.config, checkpoint.weights, dtype="float32", max_seq=32).logits([[5, 9, 40, 77]],
                                                                                                   tokens)
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-3)


def test_a_truncated_file_is_refused_with_its_name(tiny, tmp_path):
    path, _ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="cut.gguf"):
        read_gguf(cut)


@pytest.mark.parametrize("drop, named", [
    ("blk.1.ffn_up.weight", r"'blk\.1\.ffn_up\.weight' \(model\.layers\.1\.mlp\.up_proj\.weight\)"),
    ("output_norm.weight", r"'output_norm\.weight' \(model\.norm\.weight\)"),     # not a layer's
])
def test_a_missing_tensor_is_named(tmp_path, drop, named):
    path = tmp_path / "missing.gguf"
    write_tiny_llama(path, drop=(drop,))
    with pytest.raises(GGUFError, match=rf"missing\.gguf: expected a tensor {named}, missing$"):
        read_gguf(path)


def test_another_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_llama(path, arch="gpt2")
    with pytest.raises(GGUFError, match="general.architecture: expected 'llama', got 'gpt2'"):
        read_gguf(path)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "q5.gguf"
    write_tiny_llama(path, type_of={"blk.0.ffn_gate.weight": "Q5_0"})
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate\.weight'.*got Q5_0"):
        read_gguf(path)


def test_a_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nothing.gguf"      # a Path is named as the plain string it stands for
    with pytest.raises(FileNotFoundError, match=rf"^path: expected a GGUF file, got {re.escape(repr(str(path)))} "
                                                r"\(no such file\)$"):
        read_gguf(path)


# -- the tokenizer ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny):
    return Tokenizer.from_gguf(tiny[0])


@pytest.mark.parametrize("text", ["the cat", "Ünïcödé ✓ 日本", "def f(x):\n\treturn x[0]  # ok", "12345", ""])
def test_encode_then_decode_gives_the_text_back(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_merges_apply_and_digits_split_one_by_one(tokenizer):
    tokens = tokenizer.backend.get_vocab()
    assert tokenizer.encode(" the") == [tokens["Ġthe"]]
    assert tokenizer.encode("in") == [tokens["in"]]
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]   # not "20" (a merge)


def test_control_tokens_encode_to_their_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user")[0] == 1
    assert tokenizer.encode("a<|im_end|>")[-1] == 2
    assert tokenizer.encode("x<|tool|>y")[1] == USER_TOKEN_ID   # user-defined: one id too
    # eos <|im_end|>, <|endoftext|> (an end marker) and the file's end-of-turn id
    assert tokenizer.stop_ids == (0, 2, END_TURN_ID)
    assert tokenizer.encode("x", add_special_tokens=True) == tokenizer.encode("x")   # the file asks for no BOS


def test_the_chat_template_is_rendered(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_prompts_longer_than_max_seq_are_refused(tiny):
    model = Llama.from_gguf(tiny[0], dtype="float32", max_seq=8, batch=1, backend="emulator")
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected len\(prompt\) \+ max_new_tokens <= max_seq=8"):
        model.generate([list(range(6))], 4)


def test_generation_stops_at_a_stop_id(tiny):
    model = Llama.from_gguf(tiny[0], dtype="float32", max_seq=32, batch=2, backend="emulator")
    free = model.generate([[5, 9], [7]], 6)
    stop = free[0][2]
    stopped = model.generate([[5, 9], [7]], 6, stop_ids=[stop])
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    seen = []
    model.generate([[5, 9]], 3, on_token=seen.append)
    assert [step[0] for step in seen] == model.generate([[5, 9]], 3)[0]


def test_truncate_and_feed_take_another_path_from_the_shared_prefix(tiny):
    model = Llama.from_gguf(tiny[0], dtype="float32", max_seq=32, batch=1, backend="emulator")
    prompt, other = [5, 9, 40], 77
    model.generate([prompt], 5)
    assert model.cache.lengths_host().tolist() == [len(prompt) + 4]
    model.cache.truncate([len(prompt)])
    model.feed([other])
    path = []
    for _ in range(3):
        model.decode_step()
        path += model.next_tokens()
    assert model.cache.lengths_host().tolist() == [len(prompt) + 3]
    assert path == model.generate([prompt + [other]], 3)[0]


def test_feed_refuses_ids_outside_the_vocabulary(tiny):
    model = Llama.from_gguf(tiny[0], dtype="float32", max_seq=16, batch=1, backend="emulator")
    with pytest.raises(ValueError, match=r"token_ids: expected 1 token ids in 0\.\.287"):
        model.feed([288])


def test_an_untied_output_head_is_read_and_unties_the_config(tmp_path):
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    path = tmp_path / "untied.gguf"
    hf = write_tiny_llama(path, config=untied)
    checkpoint = read_gguf(path)
    assert checkpoint.config == dataclasses.replace(untied, rms_norm_eps=checkpoint.config.rms_norm_eps)
    assert checkpoint.tensor_types["output.weight"] == TYPE_OF["output.weight"]
    np.testing.assert_array_equal(checkpoint.weights["lm_head.weight"],
                                  hf["lm_head.weight"].astype(np.float16).astype(np.float32))


#: The smallest metadata config_from_metadata accepts: every other key has a default.
REQUIRED = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.vocab_size": 50,
            "llama.attention.layer_norm_rms_epsilon": 1e-6}


def test_absent_optional_keys_take_llamas_defaults():
    config = config_from_metadata(REQUIRED)
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (16, 4, 10000.0)
    assert config.tie_word_embeddings is False                     # read_gguf decides it from output.weight
    without_vocab = {k: v for k, v in REQUIRED.items() if k != "llama.vocab_size"}
    assert config_from_metadata({**without_vocab, "tokenizer.ggml.tokens": ["a"] * 33}).vocab_size == 33
    assert config_from_metadata({**REQUIRED, "llama.rope.scaling.type": ""}).head_dim == 16      # "" is none


@pytest.mark.parametrize("change, message", [
    ({"llama.rope.dimension_count": 8}, r"llama\.rope\.dimension_count: expected the head dim 16 \(full rotary\), "
                                        r"got 8$"),
    ({"llama.attention.key_length": 32, "llama.rope.dimension_count": 16},
     r"llama\.rope\.dimension_count: expected the head dim 32 \(full rotary\), got 16$"),
    ({"llama.rope.scaling.type": "linear"}, r"llama\.rope\.scaling\.type: expected 'none' \(plain rotary\), "
                                            r"got 'linear'$"),
    ({"llama.block_count": None}, r"expected the key 'llama\.block_count' in the GGUF metadata, missing$"),
    ({"llama.attention.layer_norm_rms_epsilon": None},
     r"expected the key 'llama\.attention\.layer_norm_rms_epsilon' in the GGUF metadata, missing$"),
    ({"llama.vocab_size": None}, r"expected the key 'tokenizer\.ggml\.tokens' in the GGUF metadata, missing$"),
    ({"general.architecture": None}, r"expected the key 'general\.architecture' in the GGUF metadata, missing$"),
])
def test_unsupported_or_missing_keys_are_refused_by_name(change, message):
    metadata = {key: value for key, value in {**REQUIRED, **change}.items() if value is not None}
    with pytest.raises(GGUFError, match=r"^model\.gguf: " + message):
        config_from_metadata(metadata, "model.gguf")


@pytest.mark.parametrize("more", [1, 2])
def test_every_missing_tensor_is_counted_and_the_first_named(tmp_path, more):
    path = tmp_path / "missing.gguf"
    write_tiny_llama(path, drop=("output_norm.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight")[: more + 1])
    # the first in config.weight_shapes() order: the embedding and the final norm come before the layers
    with pytest.raises(GGUFError, match=r"missing\.gguf: expected a tensor 'output_norm\.weight' "
                                        rf"\(model\.norm\.weight\), missing \(and {more} more\)$"):
        read_gguf(path)


@pytest.mark.parametrize("name", ["blk.x.attn_q.weight", "blk.0.attn_qkv.weight", "blk.0", "output.bias",
                                  "blk.-1.attn_q.weight"])
def test_names_llama_does_not_use_map_to_nothing(name):
    assert _hf_name(name, 2) is None


def test_metadata_alone_is_read_without_the_tensors(tiny):
    path, _ = tiny
    metadata = read_metadata(path)
    assert metadata["general.architecture"] == "llama" and metadata["llama.block_count"] == TINY.num_hidden_layers
    assert metadata == read_gguf(path).metadata


def test_a_checkpoint_shows_its_config_not_its_arrays_and_is_frozen(tiny):
    path, _ = tiny
    checkpoint = read_gguf(path)
    assert repr(checkpoint) == f"GGUFCheckpoint(config={checkpoint.config!r})"     # no weights, metadata, types
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.config = TINY
