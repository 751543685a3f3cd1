"""The tokenizer built from GGUF metadata: each pre-tokenizer's splits, special ids, BOS and the chat template.

:meth:`Tokenizer.from_gguf` also takes the metadata dict itself, so each
test here states exactly the keys it varies; the tiny GGUF file's tokenizer
is tested in ``test_gguf.py``.
"""
import pytest

from cupykv.models.gguf import GGUFError
from cupykv.models.tokenizer import Tokenizer
from gguf_fixtures import CONTROL_TOKENS, byte_symbols

# "2 0" joins two digits unless digits are split one by one; "3 4" joins them unless runs of 3 digits are;
# "' S" joins an upper-case contraction only where the split pattern ignores case (llama-bpe's).
MERGES = ["2 0", "3 4", "' S"]
TOKENS = CONTROL_TOKENS + byte_symbols() + ["".join(merge.split(" ")) for merge in MERGES] + ["<|eot_id|>"]
CONTROL = 3


def metadata(**keys):
    """Byte-level BPE metadata; the three CONTROL_TOKENS and <|eot_id|> are control tokens."""
    types = [CONTROL] * len(CONTROL_TOKENS) + [1] * (len(TOKENS) - len(CONTROL_TOKENS) - 1) + [CONTROL]
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.token_type": types}
    base.update({f"tokenizer.{key.replace('__', '.')}": value for key, value in keys.items()})
    return {key: value for key, value in base.items() if value is not None}


def pieces(tokenizer, text):
    return [tokenizer.decode([i]) for i in tokenizer.encode(text)]


@pytest.mark.parametrize("pre, expected", [
    (None, [["1", "2", "34", "5"], ["20", "2", "4"], ["I", "T", "'", "S"]]),        # no key: GPT-2's split
    ("gpt2", [["1", "2", "34", "5"], ["20", "2", "4"], ["I", "T", "'", "S"]]),
    ("default", [["1", "2", "34", "5"], ["20", "2", "4"], ["I", "T", "'", "S"]]),
    ("smollm", [["1", "2", "3", "4", "5"], ["2", "0", "2", "4"], ["I", "T", "'", "S"]]),   # digits one by one
    ("llama-bpe", [["1", "2", "3", "4", "5"], ["20", "2", "4"], ["I", "T", "'S"]]),       # 3 digits; any case
])
def test_each_pre_tokenizer_splits_as_its_pattern_says(pre, expected):
    tokenizer = Tokenizer.from_gguf(metadata(ggml__pre=pre))
    got = [pieces(tokenizer, text) for text in ("12345", "2024", "IT'S")]
    assert got == expected


def test_an_unknown_pre_tokenizer_or_tokenizer_model_is_refused_by_key():
    with pytest.raises(GGUFError, match=r"^tokenizer\.ggml\.pre: expected one of \('default', 'gpt2', 'smollm', "
                                        r"'llama-bpe'\), got 'qwen2'$"):
        Tokenizer.from_gguf(metadata(ggml__pre="qwen2"))
    with pytest.raises(GGUFError, match=r"^tokenizer\.ggml\.model: expected 'gpt2' \(byte-level BPE\), got 'llama'$"):
        Tokenizer.from_gguf(metadata(ggml__model="llama"))
    with pytest.raises(GGUFError, match=r"got None$"):
        Tokenizer.from_gguf(metadata(ggml__model=None))


def test_stop_ids_are_eos_eot_eom_and_the_end_markers_once_each():
    eot_id = TOKENS.index("<|eot_id|>")
    plain = Tokenizer.from_gguf(metadata())
    assert plain.stop_ids == (0, 2, eot_id)            # <|endoftext|>, <|im_end|>, <|eot_id|>: control end markers
    named = Tokenizer.from_gguf(metadata(ggml__eos_token_id=2, ggml__eot_token_id=100, ggml__eom_token_id=101))
    assert named.stop_ids == (0, 2, 100, 101, eot_id) and named.eos_id == 2 and named.bos_id is None


def test_without_token_types_nothing_is_special():
    tokenizer = Tokenizer.from_gguf(metadata(ggml__token_type=None))
    assert tokenizer.stop_ids == ()                    # end markers count only as control tokens
    assert len(tokenizer.encode("<|im_end|>")) > 1     # and text spelling one is just text
    assert Tokenizer.from_gguf(metadata()).encode("<|im_end|>") == [2]


@pytest.mark.parametrize("add_bos, bos_id, expected", [(True, 1, [1, 123]), (False, 1, [123]), (True, None, [123]),
                                                       (None, 1, [123])])
def test_bos_comes_first_only_when_the_file_asks_and_names_one(add_bos, bos_id, expected):
    tokenizer = Tokenizer.from_gguf(metadata(ggml__add_bos_token=add_bos, ggml__bos_token_id=bos_id))
    assert tokenizer.encode("x", add_special_tokens=True) == expected     # "x" is byte 120, id 3 + 120
    assert tokenizer.encode("x") == [123]


def test_vocab_size_counts_every_token():
    assert Tokenizer.from_gguf(metadata()).vocab_size == len(TOKENS)


def test_encode_takes_only_text():
    with pytest.raises(TypeError, match=r"^text: expected a str, got bytes$"):
        Tokenizer.from_gguf(metadata()).encode(b"x")


TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_the_chat_template_sees_the_messages_the_special_tokens_and_the_generation_prompt_flag():
    tokenizer = Tokenizer.from_gguf(metadata(chat_template=TEMPLATE, ggml__bos_token_id=1, ggml__eos_token_id=2))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == \
        "<|im_start|>[system]be brief<|im_end|>[user]hi<|im_end|>[assistant]"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == \
        "<|im_start|>[system]be brief<|im_end|>[user]hi<|im_end|>"
    unnamed = Tokenizer.from_gguf(metadata(chat_template=TEMPLATE))
    assert unnamed.apply_chat_template(messages[1:]) == "[user]hi[assistant]"     # no bos/eos id: empty strings


def test_block_tags_leave_no_whitespace_of_their_own_as_in_hugging_faces_renderer():
    # transformers renders chat templates with trim_blocks and lstrip_blocks: a block tag's own line (its
    # indentation and its newline) disappears; text lines keep theirs
    template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n  [{{ m['content'] }}]\n"
                "    {% endif %}\n{% endfor %}")
    tokenizer = Tokenizer.from_gguf(metadata(chat_template=template))
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"},
                {"role": "user", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages) == "  [hi]\n  [yo]\n"


def test_decode_keeps_control_tokens_unless_asked_to_skip_them():
    tokenizer = Tokenizer.from_gguf(metadata())
    ids = tokenizer.encode("<|im_start|>user hi<|im_end|>")
    assert tokenizer.decode(ids) == "<|im_start|>user hi<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user hi"


def test_a_tokenizer_shows_its_special_ids_not_its_vocabulary_and_is_frozen():
    tokenizer = Tokenizer.from_gguf(metadata(chat_template=TEMPLATE, ggml__bos_token_id=1, ggml__eos_token_id=2))
    eot_id = TOKENS.index("<|eot_id|>")
    assert repr(tokenizer) == f"Tokenizer(bos_id=1, eos_id=2, stop_ids=(0, 2, {eot_id}), add_bos=False)"
    with pytest.raises(AttributeError):
        tokenizer.bos_id = 0


@pytest.mark.parametrize("messages", [{"role": "user", "content": "hi"}, [{"role": "user"}],
                                      [{"role": "user", "content": 3}], ["hi"]])
def test_chat_messages_that_are_not_role_and_content_strings_are_refused(messages):
    tokenizer = Tokenizer.from_gguf(metadata(chat_template=TEMPLATE))
    with pytest.raises(TypeError, match=r"^messages: expected a list of \{'role': str, 'content': str\} dicts, got "):
        tokenizer.apply_chat_template(messages)


def test_a_file_without_a_chat_template_says_so():
    with pytest.raises(ValueError, match=r"^chat template: expected tokenizer\.chat_template in the GGUF, missing$"):
        Tokenizer.from_gguf(metadata()).apply_chat_template([{"role": "user", "content": "hi"}])
