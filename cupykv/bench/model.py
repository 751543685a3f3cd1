"""Model decode step: eager against graph replay, through ``cupykv.models.llama``.

:func:`eager_vs_graph` times any zero-argument decode step both ways. The
LLaMA wiring is :func:`_llama_step`: it builds the model and returns its step.
While ``cupykv.models.llama`` is missing, or lacks what ``_llama_step``
needs, the section is recorded as skipped with the reason.
"""
from __future__ import annotations

from cupykv.graph import capture


class Unavailable(Exception):
    """The model cannot be benchmarked here; the message says why."""


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason, "results": []}


def eager_vs_graph(ctx, step, params: dict) -> dict:
    """Time ``step()`` eagerly and as a captured graph replayed once per call.

    ``step`` must launch cupykv ops only, into preallocated buffers (so it can
    be captured); each call is one decode step.
    """
    eager = ctx.timer(step, flush=False)
    graph = capture(step)
    replayed = ctx.timer(lambda: graph.replay(1), flush=False)
    return {
        "status": "ok",
        "description": "one decode step: eager launches vs one replay of the captured graph; "
                       "ratio = eager / graph",
        "params": {**params, "graph_launches": graph.num_launches},
        "units": {"eager_time_ms": "ms, median", "graph_time_ms": "ms, median",
                  "ratio_eager_over_graph": "eager_time_ms / graph_time_ms"},
        "results": [{**eager.as_ms("eager_time"), **replayed.as_ms("graph_time"),
                     "ratio_eager_over_graph": eager.median_s / replayed.median_s}],
        "checks": [],
    }


def _llama_step(llama, ctx):
    """Build a random-weight LLaMA on the bench backend; return ``(step, params)``.

    The wiring point for ``cupykv.models.llama``: it needs ``LlamaConfig``,
    ``Llama.random(config, *, seed, dtype, max_seq, batch, backend)`` and a
    ``decode_step()`` method that launches one graph-capturable step.
    """
    sizes = dict(ctx.plan.model_config)
    try:
        config = llama.LlamaConfig(**sizes)
        model = llama.Llama.random(config, seed=0, dtype="bfloat16", max_seq=ctx.plan.model_max_seq,
                                   batch=ctx.plan.model_batch, backend=ctx.backend.name)
    except (AttributeError, TypeError) as exc:
        raise Unavailable(f"model not available: cupykv.models.llama does not take the bench's call "
                          f"({type(exc).__name__}: {exc}); adjust cupykv/bench/model.py:_llama_step") from None
    step = getattr(model, "decode_step", None)
    if not callable(step):
        raise Unavailable("model not available: cupykv.models.llama.Llama has no decode_step(); "
                          "adjust cupykv/bench/model.py:_llama_step")
    params = {"model": "cupykv.models.llama", "config": sizes, "dtype": "bfloat16",
              "batch": ctx.plan.model_batch, "max_seq": ctx.plan.model_max_seq}
    return step, params


def model_decode(ctx) -> dict:
    """The model section, or a skip that says why."""
    try:
        from cupykv.models import llama
    except ImportError as exc:
        return skipped(f"model not available: cupykv.models.llama is not importable "
                       f"({type(exc).__name__}: {exc})")
    try:
        step, params = _llama_step(llama, ctx)
    except Unavailable as exc:
        return skipped(str(exc))
    return eager_vs_graph(ctx, step, params)
