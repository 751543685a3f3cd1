"""Tokenizer: a GGUF's own byte-level BPE vocabulary, run by the ``tokenizers`` library.

llama.cpp stores the tokenizer inside the GGUF (``tokenizer.ggml.*``): the
token strings in id order, the BPE merges, each token's type, the special ids
and the chat template. :meth:`Tokenizer.from_gguf` builds a
``tokenizers.Tokenizer`` from exactly those, with the pre-tokenizer that the
file's ``tokenizer.ggml.pre`` names. Control tokens (type 3, such as
``<|im_start|>``) are special tokens: text containing them encodes to their
single ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from cupykv.models.gguf import GGUFError, read_metadata

if TYPE_CHECKING:
    import tokenizers
    from tokenizers.pre_tokenizers import PreTokenizer

#: GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
#: Control tokens that end a generation besides the file's eos/eot ids, wherever a vocabulary has them.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")

# The split patterns of the pre-tokenizers this module knows, as the GGUF's tokenizer.ggml.pre names them.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        steps: list[PreTokenizer] = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")]
    elif pre == "smollm":   # digits one at a time, then the GPT-2 split
        steps = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")]
    elif pre == "llama-bpe":
        steps = [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")]
    else:
        raise GGUFError(f"tokenizer.ggml.pre: expected one of {PRE_TOKENIZERS}, got {pre!r}")
    return pre_tokenizers.Sequence([*steps, byte_level])


@dataclass(frozen=True)
class Tokenizer:
    """Text to token ids and back, plus the chat template, for one model.

    Build it with :meth:`from_gguf`. ``bos_id`` and ``eos_id`` are the file's
    special ids (``None`` when it names none); ``stop_ids`` end a generation:
    the eos and end-of-turn ids, and the control tokens of :data:`END_MARKERS`.
    """

    backend: tokenizers.Tokenizer = field(repr=False)
    bos_id: int | None
    eos_id: int | None
    stop_ids: tuple
    chat_template: str | None = field(default=None, repr=False)
    add_bos: bool = False

    @classmethod
    def from_gguf(cls, path_or_metadata) -> "Tokenizer":
        """The tokenizer stored in a GGUF file (a path, or the metadata :func:`~cupykv.models.gguf.read_gguf` returned).

        Raises
        ------
        GGUFError
            A tokenizer model other than byte-level BPE (``gpt2``), or an unknown pre-tokenizer.
        """
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        metadata = path_or_metadata if isinstance(path_or_metadata, dict) else read_metadata(path_or_metadata)
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE), got {kind!r}")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
        types = list(metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
        bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)])

        def special(key):
            value = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return None if value is None else int(value)

        markers = [i for i, kind in enumerate(types) if kind == CONTROL and tokens[i] in END_MARKERS]
        stops = {i for i in (special("eos"), special("eot"), special("eom"), *markers) if i is not None}
        return cls(backend=backend, bos_id=special("bos"), eos_id=special("eos"), stop_ids=tuple(sorted(stops)),
                   chat_template=metadata.get("tokenizer.chat_template"),
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)))

    @property
    def vocab_size(self) -> int:
        """Ids are ``0..vocab_size - 1``."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; a BOS id first only with ``add_special_tokens`` and a model that wants one."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of token ids (``encode`` then ``decode`` gives the text back)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        """Render the model's chat template for ``messages`` (dicts with ``role`` and ``content``).

        Raises
        ------
        ValueError
            The GGUF carries no chat template.
        """
        import jinja2.sandbox

        if not self.chat_template:
            raise ValueError("chat template: expected tokenizer.chat_template in the GGUF, missing")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise TypeError(f"messages: expected a list of {{'role': str, 'content': str}} dicts, got {messages!r:.80}")
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = environment.from_string(self.chat_template)
        special = {"bos_token": self._token(self.bos_id), "eos_token": self._token(self.eos_id)}
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)

    def _token(self, token_id):
        return "" if token_id is None else self.backend.id_to_token(token_id)

