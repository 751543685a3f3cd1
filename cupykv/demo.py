"""``python -m cupykv demo``: greedy decoding with a LLaMA-style model on cupykv, checked end to end.

It prefills a batch of prompts of different lengths, decodes eagerly and
through one captured graph of the whole decode step, and checks both against
the NumPy reference model: identical tokens, logits within the stated
tolerance. Without a GPU it runs a tiny seeded random model on the CPU
emulator (its timings are CPU emulation, not GPU figures); on a GPU a larger
one. Exits non-zero if a check fails.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np

from cupykv._args import is_int
from cupykv.backends import get_backend
from cupykv.errors import InputError
from cupykv.models import Llama, LlamaConfig
from cupykv.models.llama_reference import LlamaReference
from cupykv.tolerances import logits_tolerance

TINY: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=256)
GPU: dict[str, Any] = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=2816, vocab_size=32000)
MAX_STEPS = 4096   # the demo is a short end-to-end check; long runs belong to `generate`


def _progress(label):
    def show(done, total):
        filled = int(30 * done / total)
        sys.stdout.write(f"\r  {label:6} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tokens")
        if done == total:
            sys.stdout.write("\n")
        sys.stdout.flush()
    return show


MIN_CLEAR_FRACTION = 0.5   # a greedy check that covers fewer steps than this proves little


def check_greedy_margins(tokens, want, error: float):
    """Check greedy tokens against the reference on the steps where its choice is clear.

    Every logit is within ``error`` of the reference's, so wherever the
    reference's best token leads its runner-up by more than ``2 * error``,
    greedy decoding must pick it: those steps are clear. At least
    ``MIN_CLEAR_FRACTION`` of all steps (and at least one) must be clear,
    or the check would pass without checking anything.

    Parameters
    ----------
    tokens : list of list of int, ``[batch][steps]``
        The greedy tokens.
    want : np.ndarray ``[steps, batch, vocab]``
        The reference's logits, teacher-forced on ``tokens``.
    error : float
        The largest |logit - reference logit| (NaN makes no step clear).

    Returns
    -------
    n_clear, n_needed : int
        Clear steps, and how many are required.
    failure : str or None
        What went wrong, or None when the check passed.
    """
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * error                        # [steps, batch]
    n_clear, n_needed = int(clear.sum()), max(1, math.ceil(MIN_CLEAR_FRACTION * clear.size))
    if n_clear < n_needed:
        return n_clear, n_needed, (f"greedy check covers too few steps: {n_clear}/{clear.size} have a reference "
                                   f"margin above twice the logit error {error:.3g}, {n_needed} needed")
    wrong = int((np.asarray(tokens).T[clear] != want.argmax(-1)[clear]).sum())
    if wrong:
        return n_clear, n_needed, f"greedy tokens disagree with the reference at {wrong} of {n_clear} clear steps"
    return n_clear, n_needed, None


def run_demo(backend=None, steps=None, seed=0, dtype="bfloat16") -> int:
    """Run the demo; returns the process exit code (0 when every check passed).

    ``steps`` new tokens per prompt, an int in ``1..MAX_STEPS`` (default 16, 32 on a GPU);
    the cache is sized for the longest prompt plus ``steps``. Raises
    :class:`~cupykv.errors.InputError` (a ``ValueError``) for any other ``steps``.
    """
    if steps is not None and not (is_int(steps) and 1 <= steps <= MAX_STEPS):
        raise InputError(f"steps: expected an int in 1..{MAX_STEPS} (new tokens per prompt), got {steps!r}")
    backend = get_backend(backend)
    on_gpu = not backend.device_info().emulated
    config = LlamaConfig(**(GPU if on_gpu else TINY))
    steps = int(steps) if steps is not None else (32 if on_gpu else 16)
    rng = np.random.default_rng(seed)
    lengths = (7, 12, 3, 9) if on_gpu else (5, 9, 3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    weights = config.random_weights(seed)
    # Room for the longest prompt plus the new tokens (2 at least: the warm-up below), in whole tiles of 16.
    max_seq = -(-(max(lengths) + max(steps, 2)) // 16) * 16
    model = Llama(config, weights, dtype=dtype, max_seq=max_seq, batch=len(prompts), backend=backend.name)
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

    want = LlamaReference(config, weights, dtype=dtype, max_seq=max_seq).logits(prompts, eager_tokens)
    error = float(np.abs(eager_logits - want).max())
    tolerance = logits_tolerance(dtype, float(np.abs(want).max()), config.num_hidden_layers)
    n_clear, n_needed, greedy_failure = check_greedy_margins(eager_tokens, want, error)

    tokens = len(prompts) * steps
    print(f"  tokens/s: eager {tokens / timings['eager']:.1f}, graph {tokens / timings['graph']:.1f} "
          f"(x{timings['eager'] / timings['graph']:.2f})")
    print(f"  eager and graph tokens identical: {eager_tokens == graph_tokens}; "
          f"logits bitwise equal: {np.array_equal(eager_logits, graph_logits)}")
    print(f"  max logit error vs the NumPy reference model: {error:.3g} (tolerance {tolerance:.3g})")
    print(f"  greedy tokens agree with the reference wherever its margin exceeds twice that error: "
          f"{greedy_failure is None} ({n_clear}/{want.shape[0] * want.shape[1]} steps clear, {n_needed} needed)")
    for b, generated in enumerate(eager_tokens):
        print(f"  sequence {b}: {prompts[b]} -> {generated}")
    failures = [name for name, ok in (
        ("eager and graph tokens differ", eager_tokens == graph_tokens),
        ("eager and graph logits differ", np.array_equal(eager_logits, graph_logits)),
        ("logits outside tolerance", error <= tolerance),
        (greedy_failure, greedy_failure is None),
    ) if not ok]
    for failure in failures:
        print(f"FAILED: {failure}")
    print("demo: OK" if not failures else "demo: FAILED")
    return 1 if failures else 0
