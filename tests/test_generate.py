"""``python -m cupykv generate`` on a tiny synthetic GGUF: what it streams, where it stops, what it refuses.

The expected tokens come from the model's own :meth:`Llama.generate` on the
same file; the stream must print exactly their text, never a stop token, and
never half of a UTF-8 character.
"""
import dataclasses
import io
import re
import time

import numpy as np
import pytest

from cupykv.__main__ import main
from cupykv.errors import InputError
from cupykv.models import Llama, generate as generate_module
from cupykv.models.generate import _Stream, find_model_file, run_generate
from cupykv.models.gguf import read_gguf
from cupykv.models.tokenizer import Tokenizer
from gguf_fixtures import write_tiny_llama

PROMPT = "the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "tiny.gguf"
    write_tiny_llama(path)
    checkpoint = read_gguf(path)
    return str(path), checkpoint, Tokenizer.from_gguf(checkpoint.metadata)


def _expected_tokens(checkpoint, tokenizer, ids, new_tokens, *, dtype="bfloat16", use_graph=True, kv_dtype=None):
    """What run_generate must produce: the model's own greedy tokens, in a cache rounded up to 16 rows.

    An fp8 cache (``kv_dtype``) first has its scales calibrated on the prompt itself.
    """
    max_seq = -(-(len(ids) + new_tokens) // 16) * 16
    model = Llama.from_gguf(checkpoint, dtype=dtype, kv_dtype=kv_dtype, max_seq=max_seq, batch=1, backend="emulator")
    if kv_dtype is not None:
        model.calibrate_kv_scales([ids])
    return model.generate([ids], new_tokens, use_graph=use_graph, stop_ids=tokenizer.stop_ids)[0]


def _run(path, prompt=PROMPT, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(prompt, gguf=path, backend="emulator", out=out, err=err, **kwargs) == 0
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("new_tokens", [1, 5, 11, 12], ids=lambda n: f"{n}new")
def test_the_streamed_text_is_the_text_of_the_models_greedy_tokens(tiny, chat, new_tokens):
    # "the cat" is 5 ids and its chat rendering 23: prompt + new tokens lands below, on and just past 16 and 32 rows;
    # one new token is the least run_generate takes
    path, checkpoint, tokenizer = tiny
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]) if chat else PROMPT
    ids = tokenizer.encode(text, add_special_tokens=True)
    tokens = _expected_tokens(checkpoint, tokenizer, ids, new_tokens)
    assert len(tokens) == new_tokens and not set(tokens) & set(tokenizer.stop_ids)   # no early stop hides a bug
    started = time.perf_counter()
    out, err = _run(path, max_new_tokens=new_tokens, chat=chat)
    elapsed = time.perf_counter() - started
    assert out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
    timing = re.fullmatch(rf"{len(ids)} prompt tokens, {new_tokens} new tokens in (\d+\.\d\d) s: (\d+\.\d\d) tokens/s "
                          r"on emulator, bfloat16, graph \(emulator timings: CPU emulation, NOT GPU figures\); "
                          r"loading took (\d+\.\d) s\n", err)
    assert timing, err
    seconds, rate, loading = (float(group) for group in timing.groups())
    # the rate is the new tokens over the decode time, each printed to 0.01: their product is the count
    assert abs(rate * seconds - new_tokens) <= 0.005 * (rate + seconds) + 1e-4, err
    assert seconds + loading <= elapsed + 0.1, err      # both are parts of the call, which the test timed


def test_an_fp8_cache_is_calibrated_on_the_prompt_before_generating(tiny, monkeypatch):
    # the tiny model repeats its last prompt token whatever the scales, so the tokens alone cannot tell whether
    # calibration ran: the scales the cache holds when generate starts are compared as well
    path, checkpoint, tokenizer = tiny
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    calibrated = Llama.from_gguf(checkpoint, dtype="bfloat16", kv_dtype="float8_e4m3", max_seq=16, batch=1,
                                 backend="emulator")
    default = calibrated.cache.scales_host()
    want = calibrated.calibrate_kv_scales([ids])
    assert not np.array_equal(want[0], default[0]) and not np.array_equal(want[1], default[1])
    seen = []
    real_generate = Llama.generate

    def generate(self, *args, **kwargs):
        seen.append(self.cache.scales_host())
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(Llama, "generate", generate)
    out, err = _run(path, max_new_tokens=8, kv_dtype="float8_e4m3")
    (scales,) = seen
    np.testing.assert_array_equal(scales[0], want[0])
    np.testing.assert_array_equal(scales[1], want[1])
    tokens = _expected_tokens(checkpoint, tokenizer, ids, 8, kv_dtype="float8_e4m3")
    assert out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
    assert "on emulator, bfloat16 (float8_e4m3 cache), graph" in err


def test_generation_ends_at_the_tokenizers_stop_ids_which_are_not_printed(tiny, monkeypatch):
    path, checkpoint, tokenizer = tiny
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    free = _expected_tokens(checkpoint, tokenizer, ids, 6)
    stop = free[2]            # a greedy token ends the generation where it first comes (the tiny model repeats one)
    stopping = dataclasses.replace(tokenizer, stop_ids=tokenizer.stop_ids + (stop,))
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(lambda cls, metadata: stopping))
    out, err = _run(path, max_new_tokens=6)
    printed = free[: free.index(stop)]       # the stop token itself is generated but never printed
    assert out == tokenizer.decode(printed, skip_special_tokens=True) + "\n"
    assert err.startswith(f"{len(ids)} prompt tokens, {len(printed) + 1} new tokens in ")


def test_the_command_line_passes_chat_dtype_and_eager_through(tiny, capsys):
    # capsys swaps sys.stdout after import: run_generate must look it up when called, not bind it at import
    path, checkpoint, tokenizer = tiny
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
                           add_special_tokens=True)
    tokens = _expected_tokens(checkpoint, tokenizer, ids, 4, dtype="float32", use_graph=False)
    assert main(["generate", PROMPT, "--gguf", path, "--max-new-tokens", "4", "--chat", "--dtype", "float32",
                 "--no-graph", "--backend", "emulator"]) == 0
    captured = capsys.readouterr()
    assert captured.out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
    assert captured.err.startswith(f"{len(ids)} prompt tokens, 4 new tokens in ")
    assert "on emulator, float32, eager (emulator timings" in captured.err


@pytest.mark.parametrize("entry", ["function", "command line"])
def test_by_default_32_new_tokens_stream_from_a_bfloat16_graph(tiny, capsys, entry):
    # the documented defaults of both entry points: --max-new-tokens 32, --dtype bfloat16, graph decode
    path, checkpoint, tokenizer = tiny
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    tokens = _expected_tokens(checkpoint, tokenizer, ids, 32)
    assert len(tokens) == 32
    if entry == "function":
        assert run_generate(PROMPT, gguf=path, backend="emulator") == 0
    else:
        assert main(["generate", PROMPT, "--gguf", path, "--backend", "emulator"]) == 0
    captured = capsys.readouterr()
    assert captured.out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
    assert captured.err.startswith(f"{len(ids)} prompt tokens, 32 new tokens in ")
    assert "on emulator, bfloat16, graph (emulator timings" in captured.err


def test_the_stream_waits_for_whole_characters_and_skips_stop_tokens(tiny):
    _, _, tokenizer = tiny
    out = io.StringIO()
    stream = _Stream(tokenizer, out)
    ids = tokenizer.encode("a✓é")                      # one byte, then three, then two: no merge joins them
    assert len(ids) == 6
    seen = []
    for token in ids[:4]:
        stream([token])
        seen.append(out.getvalue())
    assert seen == ["a", "a", "a", "a✓"]               # nothing while the check mark is incomplete
    stream([tokenizer.stop_ids[0]])
    stream([1])                                          # <|im_start|>: a control token that is not a stop
    stream([ids[4]])
    assert out.getvalue() == "a✓"
    stream([ids[5]])
    assert out.getvalue() == "a✓é"                       # neither the stop token nor the control token printed
    assert stream.ids == ids[:4] + [1] + ids[4:]          # the stop token is not kept; the control token is
    stream([7, 99])                                      # only the first row of a step is streamed
    assert stream.ids == ids[:4] + [1] + ids[4:] + [7]


def test_a_model_that_wants_a_bos_gets_it_before_the_prompt(tiny, monkeypatch):
    path, checkpoint, tokenizer = tiny
    with_bos = dataclasses.replace(tokenizer, add_bos=True)          # the tiny file names bos 1 but asks for none
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(lambda cls, metadata: with_bos))
    ids = with_bos.encode(PROMPT, add_special_tokens=True)
    assert ids == [1] + tokenizer.encode(PROMPT)
    tokens = _expected_tokens(checkpoint, tokenizer, ids, 3)
    out, err = _run(path, max_new_tokens=3)
    assert out == tokenizer.decode(tokens, skip_special_tokens=True) + "\n"
    assert err.startswith(f"{len(ids)} prompt tokens, 3 new tokens in ")


def test_a_prompt_that_encodes_to_no_token_is_refused(tiny):
    path, _, _ = tiny
    with pytest.raises(InputError, match=r"^prompt: expected text that encodes to at least one token, got an empty"):
        _run(path, prompt="")


@pytest.mark.parametrize("sources", [{}, {"gguf": "x.gguf", "model": "smollm2"}], ids=["neither", "both"])
def test_exactly_one_of_a_file_and_a_model_name_is_taken(sources):
    with pytest.raises(InputError, match=r"^generate: expected exactly one of --gguf PATH and --model NAME$"):
        run_generate("hi", backend="emulator", out=io.StringIO(), err=io.StringIO(), **sources)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3"])
def test_max_new_tokens_below_one_or_not_an_int_is_refused(tiny, bad):
    path, _, _ = tiny
    with pytest.raises(InputError, match=rf"^--max-new-tokens: expected an int >= 1, got {bad!r}$"):
        _run(path, max_new_tokens=bad)


# -- --model NAME: the GGUF shipped by a package, found without importing it ------------------------------
def _fake_package(tmp_path, monkeypatch, files):
    """A package ``cupykv_fake_model`` on sys.path whose __init__ fails if imported, holding ``files``."""
    folder = tmp_path / "cupykv_fake_model"
    folder.mkdir()
    (folder / "__init__.py").write_text("raise RuntimeError('the package must not be imported')\n")
    for name in files:
        (folder / name).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(generate_module.KNOWN_MODELS, "fake", ("cupykv_fake_model", "pip install fake-model"))
    return folder


def test_the_model_file_is_the_first_gguf_of_the_package_by_name(tmp_path, monkeypatch):
    folder = _fake_package(tmp_path, monkeypatch, ["b.gguf", "a.gguf", "notes.txt"])
    assert find_model_file("fake") == str(folder / "a.gguf")


def test_a_package_without_a_gguf_file_is_named(tmp_path, monkeypatch):
    folder = _fake_package(tmp_path, monkeypatch, ["notes.txt"])
    with pytest.raises(InputError, match=rf"^--model fake: no \.gguf file in \[{re.escape(repr(str(folder)))}\]$"):
        find_model_file("fake")


def test_a_missing_package_gives_its_install_command(monkeypatch):
    monkeypatch.setitem(generate_module.KNOWN_MODELS, "fake", ("cupykv_no_such_package", "pip install fake-model"))
    with pytest.raises(InputError, match=r"^--model fake: the package cupykv_no_such_package is not installed; "
                                         r"run `pip install fake-model`$"):
        find_model_file("fake")


def test_an_unknown_model_name_lists_the_known_ones():
    with pytest.raises(InputError, match=r"^--model: expected one of \['smollm2'\], got 'llama70b'$"):
        find_model_file("llama70b")
