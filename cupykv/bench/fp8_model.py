"""An fp8 (E4M3) KV cache against a bf16 one on a real model: logit error and greedy-token agreement.

``python -m cupykv.bench.fp8_model --model smollm2 [--prompts 8] [--new-tokens 16] [--backend cupy]``

Both models are the same GGUF checkpoint with bfloat16 weights and
activations; only the cache differs (``kv_dtype="float8_e4m3"`` against
``"bfloat16"``). The fp8 cache's scales are calibrated once on
``CALIBRATION_PROMPTS``, which the evaluation prompts do not include
(:meth:`Llama.calibrate_kv_scales <cupykv.models.Llama.calibrate_kv_scales>`).
For each of the first ``--prompts`` of ``PROMPTS`` it measures:

* **logit error**: the bf16-cache model decodes greedily; the fp8-cache model
  is then teacher-forced on the same tokens (``feed`` + ``decode_step``), so
  every step compares logits of the same context: max and mean
  ``|logits_fp8 - logits_bf16|``, and the max relative to ``max |logits_bf16|``;
* **teacher-forced agreement**: the share of those steps whose fp8 argmax is
  the bf16 model's token (the issue's "greedy tokens agree on >= 95% of steps");
* **free-running agreement**: the fp8 model decodes greedily on its own; the
  share of steps whose token equals the bf16 model's token at that step, and
  the step of each prompt's first difference (after one, contexts differ).

``--reference`` also computes the same figures with the float64 NumPy reference
model (:class:`~cupykv.models.llama_reference.LlamaReference`, cheap on a CPU)
for every prompt of ``PROMPTS`` and ``--reference-tokens`` steps, and checks
the fast fp8 model's logits against the reference fp8 model's (the tolerance
of :func:`cupykv.tolerances.logits_tolerance`). ``--out PATH`` writes the
summary as Markdown with the command that made it; the JSON goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

import numpy as np

FP8 = "float8_e4m3"
#: the evaluation prompts (fixed; ``--prompts N`` takes the first N)
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
)
#: the prompts the fp8 scales are calibrated on (none of them is evaluated)
CALIBRATION_PROMPTS = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city",
    "import numpy as np\n\ndef mean(values):\n    return sum(values) / len(values)\n",
    "Question: What is the boiling point of water at sea level? Answer:",
    "My favourite recipe for a quick dinner is pasta with tomatoes, garlic and basil.",
)


def _agreement(tokens: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """Position-wise token agreement of two greedy runs, and each prompt's first differing step (None: none)."""
    same = [[a == b for a, b in zip(row, want_row)] for row, want_row in zip(tokens, want)]
    flat = [x for row in same for x in row]
    return {"agreement": float(np.mean(flat)), "steps": len(flat),
            "first_difference": [row.index(False) if False in row else None for row in same]}


def _logit_figures(got: np.ndarray, want: np.ndarray, want_tokens: list[list[int]]) -> dict[str, Any]:
    """Logit error of ``got`` against ``want`` (``[steps, prompts, vocab]``) and argmax agreement with the tokens."""
    error = np.abs(got.astype(np.float64) - want)
    chosen = np.asarray(want_tokens).T                        # [steps, prompts]
    return {"max_logit_error": float(error.max()), "mean_logit_error": float(error.mean()),
            "max_abs_logit": float(np.abs(want).max()),
            "relative_max_logit_error": float(error.max() / np.abs(want).max()),
            "teacher_forced_agreement": float((got.argmax(-1) == chosen).mean()),
            "steps": int(chosen.size)}


def teacher_forced(model, prompts: list[list[int]], tokens: list[list[int]]) -> np.ndarray:
    """``model``'s float32 logits ``[steps, prompts, vocab]`` along given tokens: step ``s`` reads ``tokens[b][s-1]``.

    ``len(prompts)`` must be the model's batch; every ``tokens[b]`` has the same length.
    """
    steps = len(tokens[0])
    _, first = model.generate(prompts, 1, use_graph=False, return_logits=True)   # the prefill: step 0
    rows = [first[0]]
    for s in range(1, steps):
        model.feed([row[s - 1] for row in tokens])
        model.decode_step()
        rows.append(model._host_logits())
    return np.stack(rows)


def measure(checkpoint, tokenizer, *, n_prompts: int, new_tokens: int, backend: str | None,
            reference: bool = False, reference_tokens: int = 16, log=sys.stderr) -> dict[str, Any]:
    """The figures described in the module docstring, as a JSON-ready dict."""
    from cupykv.models import Llama
    from cupykv.models.llama import ModelOptions
    from cupykv.models.llama_reference import LlamaReference
    from cupykv.tolerances import logits_tolerance

    def note(message):
        log.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
        log.flush()

    prompts = [tokenizer.encode(p) for p in PROMPTS[:n_prompts]]
    calibration = [tokenizer.encode(p) for p in CALIBRATION_PROMPTS]
    max_seq = -(-(max(map(len, prompts + calibration)) + max(new_tokens, reference_tokens)) // 16) * 16
    options: ModelOptions = {"dtype": "bfloat16", "max_seq": max_seq, "batch": n_prompts, "backend": backend}
    result: dict[str, Any] = {"model": checkpoint.metadata.get("general.name", "?"),
                              "prompts": list(PROMPTS[:n_prompts]), "new_tokens": new_tokens,
                              "calibration_prompts": list(CALIBRATION_PROMPTS)}
    started = time.perf_counter()

    fp8_options: ModelOptions = {**options, "kv_dtype": FP8}
    fp8 = Llama.from_gguf(checkpoint, **fp8_options)
    k_scale, v_scale = fp8.calibrate_kv_scales(calibration)
    result["backend"] = fp8.cache.backend
    result["emulated"] = fp8.cache.device_info().emulated
    result["scales"] = {"k_min": float(k_scale.min()), "k_max": float(k_scale.max()),
                        "v_min": float(v_scale.min()), "v_max": float(v_scale.max())}
    note(f"calibrated: k_scale {k_scale.min():.3g}..{k_scale.max():.3g}, "
         f"v_scale {v_scale.min():.3g}..{v_scale.max():.3g}")

    bf16 = Llama.from_gguf(checkpoint, **options)
    bf16_tokens, bf16_logits = bf16.generate(prompts, new_tokens, return_logits=True)
    note(f"bf16 cache: {new_tokens} tokens x {n_prompts} prompts")
    del bf16
    forced = teacher_forced(fp8, prompts, bf16_tokens)
    note("fp8 cache, teacher-forced on the bf16 tokens")
    fp8_tokens = fp8.generate(prompts, new_tokens)
    note("fp8 cache, free-running")
    result["fast"] = {**_logit_figures(forced, bf16_logits.astype(np.float64), bf16_tokens),
                      "free_running": _agreement(fp8_tokens, bf16_tokens),
                      "bf16_text": [tokenizer.decode(t) for t in bf16_tokens],
                      "fp8_text": [tokenizer.decode(t) for t in fp8_tokens]}

    if reference:
        n_layers = checkpoint.config.num_hidden_layers
        ref_bf16 = LlamaReference(checkpoint.config, checkpoint.weights, dtype="bfloat16", max_seq=max_seq)
        ref_fp8 = LlamaReference(checkpoint.config, checkpoint.weights, dtype="bfloat16", kv_dtype=FP8,
                                 k_scale=k_scale, v_scale=v_scale, max_seq=max_seq)
        # the fast fp8 model against the reference fp8 model, on the same (bf16-cache) tokens
        want = ref_fp8.logits(prompts, bf16_tokens)
        result["fast_vs_reference"] = {"max_logit_error": float(np.abs(forced - want).max()),
                                       "tolerance": logits_tolerance("bfloat16", np.abs(want).max(), n_layers)}
        note("fast fp8 against reference fp8")
        all_prompts = [tokenizer.encode(p) for p in PROMPTS]
        ref_tokens, ref_logits = ref_bf16.greedy(all_prompts, reference_tokens)
        ref_forced = ref_fp8.logits(all_prompts, ref_tokens)
        ref_free, _ = ref_fp8.greedy(all_prompts, reference_tokens)
        result["reference"] = {"prompts": len(all_prompts), "new_tokens": reference_tokens,
                               **_logit_figures(ref_forced, ref_logits, ref_tokens),
                               "free_running": _agreement(ref_free, ref_tokens)}
        note("reference models")
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    """The summary as a Markdown page (an orphan page of the docs: in no toctree)."""
    fast = result["fast"]
    where = result["backend"] + (" (CPU emulator: accuracy figures only, no timings)" if result["emulated"] else "")
    lines = ["---", "orphan: true", "---", "",
             f"# fp8 (E4M3) KV cache against bf16 on {result['model']}", "",
             "Made by:", "", "```", command, "```", "",
             f"Backend: {where}; bfloat16 weights and activations in both models, only the cache differs. "
             f"Scales calibrated per layer and kv head on {len(result['calibration_prompts'])} other prompts "
             f"(k_scale {result['scales']['k_min']:.3g}..{result['scales']['k_max']:.3g}, "
             f"v_scale {result['scales']['v_min']:.3g}..{result['scales']['v_max']:.3g}). "
             f"{len(result['prompts'])} prompts x {result['new_tokens']} new tokens; {result['seconds']} s.", "",
             "| figure | fast model |" + (" reference model |" if "reference" in result else ""),
             "|---|---|" + ("---|" if "reference" in result else "")]
    ref = result.get("reference")

    def row(name, get, fmt):
        cells = [fmt(get(fast))] + ([fmt(get(ref))] if ref else [])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("prompts x steps", lambda r: r["steps"], str)
    row("max abs logit error (teacher-forced)", lambda r: r["max_logit_error"], lambda v: f"{v:.4g}")
    row("mean abs logit error", lambda r: r["mean_logit_error"], lambda v: f"{v:.4g}")
    row("max error / max abs logit", lambda r: r["relative_max_logit_error"], lambda v: f"{v:.3%}")
    row("greedy agreement, teacher-forced", lambda r: r["teacher_forced_agreement"], lambda v: f"{v:.1%}")
    row("greedy agreement, free-running", lambda r: r["free_running"]["agreement"], lambda v: f"{v:.1%}")
    row("first differing step per prompt", lambda r: r["free_running"]["first_difference"],
        lambda v: ", ".join("-" if x is None else str(x) for x in v))
    lines += ["", "Teacher-forced: the fp8-cache model reads the bf16-cache model's tokens, so both give logits for "
                  "the same contexts; agreement is the share of those steps whose fp8 argmax is the bf16 token. "
                  "Free-running: each model decodes on its own; agreement is the share of steps with equal tokens "
                  "(after a prompt's first difference the contexts differ). The reference column repeats this with "
                  "the float64 NumPy reference model (same rounding points, same fp8 codes) over all prompts, on its "
                  "own greedy tokens."]
    if "fast_vs_reference" in result:
        check = result["fast_vs_reference"]
        lines += ["", f"Fast fp8 model against the reference fp8 model on the same tokens: max logit error "
                      f"{check['max_logit_error']:.4g} (tolerance {check['tolerance']:.4g})."]
    lines += ["", "Continuations (bf16 cache / fp8 cache):", ""]
    for prompt, a, b in zip(result["prompts"], fast["bf16_text"], fast["fp8_text"]):
        lines.append(f"- {prompt!r}: {a!r} / {b!r}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, measure, print the JSON summary (and write ``--out``); returns the exit code."""
    from cupykv.models.generate import find_model_file
    from cupykv.models.gguf import read_gguf
    from cupykv.models.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="python -m cupykv.bench.fp8_model", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a known model name (smollm2)")
    source.add_argument("--gguf", help="a GGUF file")
    parser.add_argument("--prompts", type=int, default=8, help=f"evaluation prompts, 1..{len(PROMPTS)}")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--backend", choices=("cupy", "emulator"), default=None)
    parser.add_argument("--reference", action="store_true", help="also measure with the NumPy reference model")
    parser.add_argument("--reference-tokens", type=int, default=16)
    parser.add_argument("--out", help="write the summary as Markdown here")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.new_tokens < 1 or args.reference_tokens < 1:
        parser.error(f"--prompts: expected 1..{len(PROMPTS)}; --new-tokens, --reference-tokens: expected >= 1")
    checkpoint = read_gguf(args.gguf if args.gguf else find_model_file(args.model))
    tokenizer = Tokenizer.from_gguf(checkpoint.metadata)
    result = measure(checkpoint, tokenizer, n_prompts=args.prompts, new_tokens=args.new_tokens,
                     backend=args.backend, reference=args.reference, reference_tokens=args.reference_tokens)
    command = "python -m cupykv.bench.fp8_model " + " ".join(shlex.quote(a) for a in
                                                             (sys.argv[1:] if argv is None else argv))
    result["command"] = command
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            file.write(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
