"""The peers section's end-to-end part: cupykv's LLaMA against transformers' ``generate``.

One random-weight model with the bench's SmolLM2 shape (``Plan.smollm2_config``),
the same weights in both (checked bit for bit), greedy decoding of
``prompt_len``-token prompts for ``new_tokens`` tokens per batch size:

- ``cupykv``: :meth:`cupykv.models.Llama.generate`, graph replay;
- ``hf_eager``: ``LlamaForCausalLM.generate(cache_implementation="static",
  disable_compile=True)`` (transformers would otherwise compile a static-cache
  decode on its own);
- ``hf_compiled``: the same with ``compile_config=CompileConfig(mode="reduce-overhead")``,
  which makes transformers run its decode step through
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs). Compilation starts
  only while the section's budget has room for it; otherwise the row says why
  it was not run.

Tokens/s = batch x new_tokens / wall-clock seconds of one whole generate call
(prefill included, the same for all three), median of ``e2e_repeat`` calls
after warm-up. The tokens must equal transformers eager's. A different token
passes only as a near-tie: at a sequence's first difference (the context is
still the same) transformers' own logits score the other token within
``(8 u(dtype) + 256 u(float32)) x max |logit|`` of its choice; the check
records where and by how much. On the CPU (correctness-only mode) the model
runs in float32 and nothing is timed.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from cupykv.bench.peers_torch import as_torch
from cupykv.bench.timing import HostTimer
from cupykv.tolerances import FP32_ACCUMULATION, UNIT_ROUNDOFF

if TYPE_CHECKING:
    from cupykv.bench.peers import PeersPlan
    from cupykv.bench.sections import Context
    from cupykv.models import Llama, LlamaConfig

IMPLS = {"cupykv": "cupykv graph decode", "hf_eager": "transformers eager, static cache",
         "hf_compiled": "transformers torch.compile(mode='reduce-overhead'), static cache"}


def end_to_end(ctx: Context, torch: Any, plan: PeersPlan, deadline: float) -> dict:
    """Tokens/s (GPU) or token agreement only (CPU) of cupykv against transformers; a section-like dict."""
    try:
        import transformers
    except Exception as exc:   # ImportError, or a broken install
        return {"status": "skipped", "reason": f"transformers is not importable ({type(exc).__name__}: {exc}); "
                                               f"pip install transformers to run the end-to-end peers"}
    from cupykv.models import Llama, LlamaConfig

    backend = ctx.backend
    gpu = not backend.device_info().emulated
    config_items = dict(ctx.plan.smollm2_config)
    config = LlamaConfig(**config_items)
    weights = config.random_weights(seed=0)
    hf = _hf_model(torch, transformers, config, weights, "cuda" if gpu else "cpu", plan.model_dtype)
    wall = HostTimer(backend, warmup=1, repeat=plan.e2e_repeat, min_warmup_s=0.0)   # cupykv: captures on warm-up
    hf_wall = HostTimer(backend, warmup=0, repeat=plan.e2e_repeat, min_warmup_s=0.0)   # warmed by the checked call
    rows, checks = [], []
    compile_s: Optional[float] = None
    compile_failed = 0   # the batch whose compiled run failed: later batches do not compile again
    for batch in plan.e2e_batches:
        prompts = np.random.default_rng(900 + batch).integers(0, config.vocab_size, (batch, plan.prompt_len))
        model = Llama(config, weights, dtype=plan.model_dtype, max_seq=plan.prompt_len + plan.new_tokens,
                      batch=batch, backend=backend.name)
        if batch == plan.e2e_batches[0]:
            checks.append(_same_weights(torch, model, hf))
        row: dict[str, Any] = {"batch": batch}
        runs = {"cupykv": _run_cupykv(model, prompts, plan, wall),
                "hf_eager": _run_hf(torch, transformers, hf, prompts, plan, hf_wall, gpu, compiled=False)}
        if plan.compile and plan.timed:
            left = deadline - time.perf_counter()
            need = max(plan.compile_reserve_s, 1.5 * (compile_s or 0.0))
            if compile_failed:
                row["hf_compiled_not_run"] = f"not run: compiling failed at batch {compile_failed}"
            elif left >= need:
                runs["hf_compiled"] = _run_hf(torch, transformers, hf, prompts, plan, hf_wall, gpu, compiled=True)
                compile_s = runs["hf_compiled"].get("first_call_s", compile_s)
                compile_failed = batch if "error" in runs["hf_compiled"] else 0
            else:
                row["hf_compiled_not_run"] = (f"not run: {max(0.0, left):.0f} s left of the section's "
                                              f"{plan.budget_s:.0f} s budget, compiling needs about {need:.0f} s")
        elif plan.compile:
            row["hf_compiled_not_run"] = "not run: the CPU correctness-only mode times nothing"
        checks += _compare(batch, runs, row, plan)
        rows.append(row)
        del model, runs
    units = {"first_step_logits_max_abs_difference": "max |cupykv logit - transformers eager logit| of the first "
                                                     "new token (same context, float32 logits)"}
    if plan.timed:
        units.update({"<impl>_time_ms": "ms per generate call (prefill + new_tokens steps), median",
                      "<impl>_tokens_per_s": "batch * new_tokens / median seconds per call",
                      "cupykv_over_<impl>": "cupykv tokens/s / that implementation's tokens/s",
                      "hf_compiled_first_call_s": "wall seconds of the first compiled call (compilation included)"})
    return {
        "status": "ok",
        "description": "greedy decoding of one random-weight model with the bench's SmolLM2 shape, same weights: "
                       + "; ".join(f"{key} = {text}" for key, text in IMPLS.items()),
        "params": {"config": config_items, "dtype": plan.model_dtype, "prompt_len": plan.prompt_len,
                   "new_tokens": plan.new_tokens, "batches": list(plan.e2e_batches), "repeat": plan.e2e_repeat,
                   "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                   "attn_implementation": hf.config._attn_implementation, "timer": wall.method,
                   "budget_s": plan.budget_s, "compile_reserve_s": plan.compile_reserve_s,
                   "near_tie": "at a sequence's first different token, transformers eager's logit of the other "
                               "token within (8 u(dtype) + 256 u(float32)) * max |logit| of its own choice"},
        "units": units,
        "results": rows,
        "checks": checks,
    }


def _compare(batch: int, runs: dict[str, dict], row: dict, plan: PeersPlan) -> list[dict]:
    """Fill ``row`` with each run's figures (or why it did not run); the token checks against transformers eager."""
    checks = []
    reference = runs["hf_eager"]
    if "error" in reference:
        checks.append({"what": f"batch {batch}: transformers eager ran", "error": reference["error"], "passed": False})
    for impl, run in runs.items():
        if "error" in run:
            row[f"{impl}_not_run"] = run["error"]
            continue
        if impl != "hf_eager" and "error" not in reference:
            checks.append(_same_tokens(f"batch {batch}: {IMPLS[impl]} tokens equal transformers eager's",
                                       reference, run, plan.model_dtype))
        if "timing" in run:
            row.update({**run["timing"].as_ms(f"{impl}_time"),
                        f"{impl}_tokens_per_s": batch * plan.new_tokens / run["timing"].median_s})
        if impl == "hf_compiled":
            row["hf_compiled_first_call_s"] = run["first_call_s"]
    if "error" not in reference:
        row["first_step_logits_max_abs_difference"] = float(
            np.abs(runs["cupykv"]["logits"][0] - reference["logits"][0]).max())
    for impl in ("hf_eager", "hf_compiled"):
        if f"{impl}_tokens_per_s" in row and "cupykv_tokens_per_s" in row:
            row[f"cupykv_over_{impl}"] = row["cupykv_tokens_per_s"] / row[f"{impl}_tokens_per_s"]
    return checks


def _hf_model(torch: Any, transformers: Any, config: LlamaConfig, weights: dict, device: str, dtype: str) -> Any:
    """``LlamaForCausalLM`` of ``config`` holding ``weights`` (float32 host arrays) rounded to ``dtype``."""
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings, hidden_act="silu",
        attention_bias=False, mlp_bias=False, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": getattr(hf_config, "rope_theta", None),
                                                           "rope_type": "default"}
    if rope.get("rope_theta") != config.rope_theta or rope.get("rope_type", "default") != "default":
        raise RuntimeError(f"transformers {transformers.__version__} read the rotary settings as {rope}, "
                           f"expected plain rotary with theta {config.rope_theta}")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config)
    model = model.to(getattr(torch, dtype)).eval()
    state = {name: torch.from_numpy(array).to(device=device, dtype=getattr(torch, dtype))
             for name, array in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"LlamaForCausalLM: parameters missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("LlamaForCausalLM: lm_head is not tied to embed_tokens")
    return model


def _same_weights(torch: Any, model: Llama, hf: Any) -> dict:
    """Every parameter of cupykv's model equals transformers', bit for bit (read through DLPack)."""
    params = hf.state_dict()
    dtype = model.cache.spec.dtype
    different = [name for name in model.config.weight_shapes()
                 if not torch.equal(as_torch(torch, model.weights[name], dtype), params[name])]
    return {"what": "the two models hold the same weights, bit for bit", "different": different[:5],
            "passed": not different}


def _run_cupykv(model: Llama, prompts: np.ndarray, plan: PeersPlan, wall: HostTimer) -> dict:
    """cupykv's tokens and float32 logits ``[steps, batch, vocab]``, and on a GPU plan its timing."""
    lists = [list(map(int, prompt)) for prompt in prompts]
    tokens, logits = model.generate(lists, plan.new_tokens, use_graph=True, return_logits=True)
    run: dict[str, Any] = {"tokens": tokens, "logits": logits}
    if plan.timed:
        run["timing"] = wall(lambda: model.generate(lists, plan.new_tokens, use_graph=True))
    return run


def _run_hf(torch: Any, transformers: Any, hf: Any, prompts: np.ndarray, plan: PeersPlan, wall: HostTimer,
            gpu: bool, compiled: bool) -> dict:
    """transformers' tokens and logits, eager or compiled, and on a GPU plan its timing (or the error)."""
    device = hf.device
    ids = torch.as_tensor(prompts, device=device)
    options: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "max_new_tokens": plan.new_tokens,
                               "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}
    if compiled:
        options.update(compile_config=transformers.CompileConfig(mode="reduce-overhead"), disable_compile=False)
    else:
        options.update(disable_compile=True)

    def generate(**extra: Any) -> Any:
        with torch.inference_mode():
            out = hf.generate(ids, **options, **extra)
        if gpu:
            torch.cuda.synchronize()
        return out
    started = time.perf_counter()
    try:
        out = generate(output_logits=True, return_dict_in_generate=True)
    except Exception as exc:   # a compiler or generate failure is reported in the row, not raised
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    run: dict[str, Any] = {"first_call_s": time.perf_counter() - started,
                           "tokens": out.sequences[:, prompts.shape[1]:].tolist(),
                           "logits": torch.stack(out.logits).float().cpu().numpy()}   # [steps, batch, vocab]
    if plan.timed:
        try:
            if compiled:
                generate()   # reduce-overhead records its CUDA graphs on the calls after the first
            run["timing"] = wall(generate)
        except Exception as exc:
            return {"error": f"timed calls: {type(exc).__name__}: {str(exc)[:300]}"}
    return run


def _same_tokens(what: str, reference: dict, run: dict, dtype: str) -> dict:
    """Equal tokens, or each sequence's first difference a near-tie in the reference's own logits."""
    relative = 8 * UNIT_ROUNDOFF[dtype] + FP32_ACCUMULATION
    divergences = []
    for b, (want, got) in enumerate(zip(reference["tokens"], run["tokens"])):
        step = next((s for s, (x, y) in enumerate(zip(want, got)) if x != y), None)
        if step is None:
            if len(want) != len(got):
                divergences.append({"sequence": b, "lengths": [len(want), len(got)], "near_tie": False})
            continue
        logits = reference["logits"][step, b]
        margin = float(logits[want[step]] - logits[got[step]])
        limit = relative * float(np.abs(logits).max())
        divergences.append({"sequence": b, "step": step, "reference_token": int(want[step]),
                            "token": int(got[step]), "margin": margin, "limit": limit, "near_tie": margin <= limit})
    return {"what": what, "identical": not divergences, "divergences": divergences,
            "passed": len(reference["tokens"]) == len(run["tokens"]) and all(d["near_tie"] for d in divergences)}
