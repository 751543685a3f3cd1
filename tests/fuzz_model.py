"""Builders of fuzzed calls of the LLaMA model: its config, its constructor and ``generate`` (see test_fuzz_api).

``generate`` runs on one tiny float32 model shared by every example (it
resets its cache on every call); an accepted call is checked against
:class:`LlamaReference`: its logits within ``logits_tolerance``, its greedy
tokens wherever the reference's best token wins clearly.
"""
from __future__ import annotations

import functools

import numpy as np
from hypothesis import strategies as st

from cupykv.models import Llama, LlamaConfig
from cupykv.models.llama_reference import LlamaReference
from cupykv.tolerances import logits_tolerance
from fuzz_args import (Arg, Call, arg, arguments, choices, floats, ints, invalid, maybe_bad, normal_float32,
                       rope_theta_contract)

INT32_MAX = 2**31 - 1
TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
            vocab_size=40)
MAX_SEQ, BATCH = 12, 2


@functools.lru_cache(maxsize=1)
def tiny_model():
    config = LlamaConfig(**TINY)
    weights = config.random_weights(seed=0)
    model = Llama(config, weights, max_seq=MAX_SEQ, batch=BATCH, backend="emulator")
    return model, LlamaReference(config, weights, max_seq=MAX_SEQ)


@arguments("vocab_size", "rms_norm_eps", "rope_theta", "head_dim", "tie_word_embeddings")
def build_llama_config(draw, env):
    args = dict(vocab_size=arg(draw, "vocab_size", ints(1, INT32_MAX)),
                rms_norm_eps=arg(draw, "rms_norm_eps", floats(normal_float32)),
                rope_theta=arg(draw, "rope_theta", floats(rope_theta_contract, st.floats(1.0, 1e7))),
                head_dim=arg(draw, "head_dim", st.just(Arg(None, True, "derived")) | ints(2, 256, none_ok=True)),
                tie_word_embeddings=arg(draw, "tie_word_embeddings", choices((False, True), (0, "yes", None))))
    head_dim = args["head_dim"]
    if head_dim.valid and head_dim.value is not None and int(head_dim.value) % 2:
        args["head_dim"] = Arg(head_dim.value, False, "odd head_dim")
    fixed = {name: value for name, value in TINY.items() if name != "vocab_size"}

    def check(config):
        assert config.vocab_size == int(args["vocab_size"].value) and config.rope_theta == float(
            args["rope_theta"].value)

    return Call("LlamaConfig", tuple(f"LlamaConfig.{name}" for name in args), args,
                lambda: LlamaConfig(**fixed, **{name: drawn.value for name, drawn in args.items()}), check)


@arguments("dtype", "max_seq", "batch", "seed")
def build_llama(draw, env):
    args = dict(dtype=arg(draw, "dtype", choices(("float32", "bfloat16"), ("float64", None))),
                max_seq=arg(draw, "max_seq", ints(1, 2**30)), batch=arg(draw, "batch", ints(1, INT32_MAX)),
                seed=arg(draw, "seed", ints(0, 2**64 - 1)))
    valid_sizes = args["max_seq"].valid and args["batch"].valid
    if valid_sizes and int(args["max_seq"].value) * int(args["batch"].value) > 2**16:
        args["max_seq"] = Arg(np.int32(8), True, "small")   # a large valid cache only costs time (or memory)

    def run():
        return Llama.random(LlamaConfig(**TINY), seed=args["seed"].value, dtype=args["dtype"].value,
                            max_seq=args["max_seq"].value, batch=args["batch"].value, backend="emulator")

    def check(model):
        assert model.cache.spec.max_seq == int(args["max_seq"].value) and not model.cache.lengths_host().any()

    return Call("Llama", ("dtype", "max_seq", "batch", "seed", "spec"), args, run, check)


@st.composite
def prompts(draw, vocab):
    """A batch of prompts: lists of token ids (some out of range or not ints), or not a batch at all."""
    if maybe_bad(draw) and draw(st.integers(0, 3)) == 0:
        return Arg(draw(st.sampled_from(([], [[]], "hello", None, [1, 2], [[1]] * (BATCH + 1)))), False, "junk")
    batch = []
    valid = True
    for _ in range(draw(st.integers(1, BATCH))):
        tokens = draw(st.lists(ints(0, vocab - 1, junk=False), min_size=1, max_size=4))
        valid &= all(t.valid for t in tokens)
        batch.append([t.value for t in tokens])
    return Arg(batch, valid, f"{batch}")


@arguments("prompts", "max_new_tokens", "use_graph", "return_logits", "progress")
def build_generate(draw, env):
    model, oracle = tiny_model()
    vocab = model.config.vocab_size
    args = dict(prompts=arg(draw, "prompts", prompts(vocab)),
                max_new_tokens=arg(draw, "max_new_tokens", ints(1, MAX_SEQ - 1)),
                use_graph=arg(draw, "use_graph", choices((False, True), (1, "no", None))),
                return_logits=arg(draw, "return_logits", choices((False, True), (0, "yes"))),
                progress=arg(draw, "progress", choices((None, lambda done, total: None), ("print",))))
    if args["prompts"].valid and args["max_new_tokens"].valid and \
            max(len(p) for p in args["prompts"].value) + int(args["max_new_tokens"].value) > MAX_SEQ:
        args["lengths"] = invalid("a prompt plus max_new_tokens past max_seq")
    for array in (model.cache.k, model.cache.v, model.cache.lengths, model.cache.overflow):
        env.keep(array)   # a refused generate must leave the model's cache as it was

    def run():
        return model.generate(args["prompts"].value, args["max_new_tokens"].value, use_graph=args["use_graph"].value,
                              return_logits=args["return_logits"].value, progress=args["progress"].value)

    def check(result):
        tokens, logits = result if args["return_logits"].value else (result, None)
        batch = [[int(t) for t in p] for p in args["prompts"].value]
        want = oracle.logits(batch, tokens)                                  # [steps, prompts, vocab]
        tolerance = logits_tolerance("float32", np.abs(want).max(), 1)
        if logits is not None:
            assert np.abs(logits - want).max() <= tolerance
        top2 = np.sort(want, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 2 * tolerance
        assert np.array_equal(np.asarray(tokens).T[clear], want.argmax(-1)[clear])

    return Call("generate", tuple(args), args, run, check)

