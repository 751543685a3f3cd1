"""Tiny synthetic GGUF files, written with the ``gguf`` package's own writer, for fast loader tests.

:func:`write_tiny_llama` stores a small LLaMA model the way llama.cpp's
converter does: Hugging Face weights renamed, q/k rows reordered for
interleaved rotary (written here by explicit index arithmetic, not with the
loader's helper), and each tensor quantized to a chosen type. Its tokenizer is
a byte-level BPE over the 256 byte symbols, a few merges and control tokens.
"""
from __future__ import annotations

import numpy as np

from cupykv.models import LlamaConfig

TINY = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=288, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "2 0" merges two digits: only a pre-tokenizer that splits digits one by one keeps "2024" in four tokens
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "2 0"]
#: The last two ids: an end-of-turn control token (a stop id only through tokenizer.ggml.eot_token_id: it
#: is not an END_MARKERS name) and a user-defined token (GGUF type 4), which encodes to its single id.
END_TURN_ID, USER_TOKEN_ID = TINY.vocab_size - 2, TINY.vocab_size - 1
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")

#: Which stored type each GGUF tensor gets: every supported type appears.
TYPE_OF = {"token_embd.weight": "Q8_0", "output.weight": "F16", "output_norm.weight": "F32",
           "attn_norm": "F32", "ffn_norm": "F32", "attn_q": "F32", "attn_k": "F32", "attn_v": "F16",
           "attn_output": "BF16", "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[int]]:
    """Tokens in id order and their GGUF types (3 = control, 4 = user-defined, 1 = normal); 288 in all."""
    tokens = CONTROL_TOKENS + byte_symbols() + ["".join(m.split(" ")) for m in MERGES]
    tokens += [f"<unused{i}>" for i in range(TINY.vocab_size - 2 - len(tokens))] + ["<|end_turn|>", "<|tool|>"]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    types[END_TURN_ID], types[USER_TOKEN_ID] = 3, 4
    return tokens, types


def gguf_order_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: half-split row ``h*d + j*d/2 + i`` is stored at row ``h*d + 2i + j``."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    stored = np.empty_like(weight)
    for h in range(n_heads):
        for i in range(head_dim // 2):
            for j in range(2):
                stored[h * head_dim + 2 * i + j] = weight[h * head_dim + j * head_dim // 2 + i]
    return stored


def _stored_type(gguf_name: str) -> str:
    key = gguf_name if gguf_name in TYPE_OF else gguf_name.split(".")[2]
    return TYPE_OF[key]


def write_tiny_llama(path, *, seed=0, arch="llama", drop=(), type_of=None, config=TINY) -> dict:
    """Write a tiny LLaMA GGUF to ``path``; returns its Hugging Face-named float32 weights (before quantization).

    ``drop`` names GGUF tensors to leave out; ``type_of`` overrides stored types by GGUF name. A config
    with untied embeddings gets an ``output.weight`` (the lm head); a tied one has none, as llama.cpp writes it.
    """
    import gguf

    hf = config.random_weights(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokens, types = tiny_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(END_TURN_ID)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        for hf_part, gguf_part in parts.items():
            names[f"model.layers.{layer}.{hf_part}.weight"] = f"blk.{layer}.{gguf_part}.weight"
    type_of = type_of or {}
    for hf_name, gguf_name in names.items():
        if gguf_name in drop:
            continue
        weight = hf[hf_name]
        if hf_name.endswith("q_proj.weight"):
            weight = gguf_order_rows(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = gguf_order_rows(weight, config.num_key_value_heads)
        kind = gguf.GGMLQuantizationType[type_of.get(gguf_name, _stored_type(gguf_name))]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, weight.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, weight.astype(np.float16))
        else:
            data = gguf.quants.quantize(weight.astype(np.float32), kind)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
