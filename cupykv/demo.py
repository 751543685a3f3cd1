"""``python -m cupykv demo``: greedy decoding with a LLaMA-style model on cupykv, checked end to end.

It prefills a batch of prompts of different lengths, decodes eagerly and
through one captured graph of the whole decode step, and checks both against
the NumPy reference model: identical tokens, logits within the stated
tolerance. Without a GPU it runs a tiny seeded random model on the CPU
emulator (its timings are CPU emulation, not GPU figures); on a GPU a larger
one. Exits non-zero if a check fails.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from cupykv.backends import get_backend
from cupykv.models import Llama, LlamaConfig
from cupykv.models.llama_reference import LlamaReference
from cupykv.tolerances import logits_tolerance

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256)
GPU = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
           intermediate_size=2816, vocab_size=32000)


def _progress(label):
    def show(done, total):
        filled = int(30 * done / total)
        sys.stdout.write(f"\r  {label:6} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tokens")
        if done == total:
            sys.stdout.write("\n")
        sys.stdout.flush()
    return show


def run_demo(backend=None, steps=None, seed=0, dtype="bfloat16") -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    backend = get_backend(backend)
    on_gpu = backend.name == "cupy"
    config = LlamaConfig(**(GPU if on_gpu else TINY))
    steps = steps or (32 if on_gpu else 16)
    rng = np.random.default_rng(seed)
    lengths = (7, 12, 3, 9) if on_gpu else (5, 9, 3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    weights = config.random_weights(seed)
    model = Llama(config, weights, dtype=dtype, max_seq=64, batch=len(prompts), backend=backend.name)
    print(f"cupykv demo: backend '{backend.name}'" + ("" if on_gpu else " (CPU emulator: timings are NOT GPU figures)"))
    print(f"  model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, heads "
          f"{config.num_attention_heads}/{config.num_key_value_heads} kv, head_dim {config.head_dim}, "
          f"vocab {config.vocab_size}, {dtype}, seeded random weights")
    print(f"  prompts of lengths {list(lengths)}, {steps} new tokens each")

    model.generate(prompts, 2, use_graph=True)          # compile every kernel and capture the decode graph
    timings = {}
    results = {}
    for label, use_graph in (("eager", False), ("graph", True)):
        started = time.perf_counter()
        results[label] = model.generate(prompts, steps, use_graph=use_graph, return_logits=True,
                                        progress=_progress(label))
        timings[label] = time.perf_counter() - started
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = results["eager"], results["graph"]

    want = LlamaReference(config, weights, dtype=dtype, max_seq=64).logits(prompts, eager_tokens)
    error = float(np.abs(eager_logits - want).max())
    tolerance = logits_tolerance(dtype, float(np.abs(want).max()), config.num_hidden_layers)
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * error
    greedy_ok = bool(np.array_equal(np.asarray(eager_tokens).T[clear], want.argmax(-1)[clear]))

    tokens = len(prompts) * steps
    print(f"  tokens/s: eager {tokens / timings['eager']:.1f}, graph {tokens / timings['graph']:.1f} "
          f"(x{timings['eager'] / timings['graph']:.2f})")
    print(f"  eager and graph tokens identical: {eager_tokens == graph_tokens}; "
          f"logits bitwise equal: {np.array_equal(eager_logits, graph_logits)}")
    print(f"  max logit error vs the NumPy reference model: {error:.3g} (tolerance {tolerance:.3g})")
    print(f"  greedy tokens agree with the reference wherever its margin exceeds twice that error: {greedy_ok} "
          f"({int(clear.sum())}/{clear.size} steps)")
    for b, generated in enumerate(eager_tokens):
        print(f"  sequence {b}: {prompts[b]} -> {generated}")
    failures = [name for name, ok in (
        ("eager and graph tokens differ", eager_tokens == graph_tokens),
        ("eager and graph logits differ", np.array_equal(eager_logits, graph_logits)),
        ("logits outside tolerance", error <= tolerance),
        ("greedy tokens disagree with the reference", greedy_ok),
    ) if not ok]
    for failure in failures:
        print(f"FAILED: {failure}")
    print("demo: OK" if not failures else "demo: FAILED")
    return 1 if failures else 0
