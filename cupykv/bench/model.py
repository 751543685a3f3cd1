"""Model decode step: eager against graph replay, through ``cupykv.models.llama``.

:func:`eager_vs_graph` times any zero-argument decode step both ways;
:func:`_llama_step` builds a random-weight model and returns its
``decode_step``; :func:`smollm2_decode` times SmolLM2-135M's shape per batch;
:func:`decode_loops` times whole generate calls (N steps per replay, speculative
cycles).
"""
from __future__ import annotations

import time

from cupykv.bench.arrays import fill_random
from cupykv.bench.timing import HostTimer
from cupykv.graph import capture


#: decode steps that the eager-against-graph check runs each way, after the timings
CHECKED_STEPS = 3


def eager_vs_graph(ctx, step, params: dict, start=None, after=None, state=None) -> dict:
    """Time ``step()`` eagerly and as a captured graph replayed once per call.

    ``step`` launches cupykv ops only, into preallocated buffers (so that it
    can be captured); each call is one decode step. ``start()``, if given,
    runs before each phase so both begin from the same state (e.g. the same
    context length); ``after()`` returns a list of checks, run at the end.
    ``state()``, if given (with ``start``), reads what a step leaves on the
    host (tokens, lengths): after the timings, :data:`CHECKED_STEPS` replays
    must leave what as many eager steps leave, from the same start, so a
    graph that went stale is not timed as if it decoded.
    """
    if start is not None:
        start()
    eager = ctx.timer(step, flush=False)
    if start is not None:
        start()
    graph = capture(step)
    replayed = ctx.timer(lambda: graph.replay(1), flush=False)
    checks = after() if after is not None else []
    if state is not None:
        checks.append(_replays_match_eager_steps(step, graph, start, state))
    return {
        "status": "ok",
        "description": "one decode step (every layer, LM head and argmax): eager launches vs one replay of the "
                       "captured graph; ratio = eager / graph",
        "params": {**params, "graph_launches": graph.num_launches},
        "units": {"eager_time_ms": "ms, median", "graph_time_ms": "ms, median",
                  "ratio_eager_over_graph": "eager_time_ms / graph_time_ms"},
        "results": [{**eager.as_ms("eager_time"), **replayed.as_ms("graph_time"),
                     "ratio_eager_over_graph": eager.median_s / replayed.median_s}],
        "checks": checks,
    }


def _replays_match_eager_steps(step, graph, start, state) -> dict:
    """The check of :func:`eager_vs_graph`: ``state()`` after each of CHECKED_STEPS eager steps and
    replays, both from ``start()``."""
    def run(one_step):
        start()
        seen = []
        for _ in range(CHECKED_STEPS):
            one_step()
            seen.append(state())
        return seen

    eager = run(step)
    replayed = run(lambda: graph.replay(1))
    return {"what": f"{CHECKED_STEPS} graph replays leave the tokens and lengths of {CHECKED_STEPS} eager steps",
            "passed": replayed == eager}


def _llama_step(llama, ctx, config_items=None, batch=None):
    """Build a random-weight bf16 LLaMA on the bench backend; return ``(step, start, after, state, params)``.

    Uses ``LlamaConfig(**config_items)`` (``plan.model_config`` by default),
    ``Llama.random(...)`` and ``Llama.decode_step()`` (one token for every
    sequence: reads the device ids, writes the next ids, advances), with
    ``batch`` sequences (``plan.model_batch`` by default). The cache is filled
    with random K/V, and each phase starts at ``plan.model_context`` tokens
    with the same ids (``start``); ``state()`` reads the next tokens and the
    lengths a step left.
    """
    plan, backend = ctx.plan, ctx.backend
    config_items = dict(plan.model_config if config_items is None else config_items)
    batch = plan.model_batch if batch is None else batch
    started = time.perf_counter()
    config = llama.LlamaConfig(**config_items)
    model = llama.Llama.random(config, seed=0, dtype="bfloat16", max_seq=plan.model_max_seq,
                               batch=batch, backend=backend.name)
    step = model.decode_step
    cache = model.cache
    fill_random(backend, cache.k, "bfloat16", seed=500)
    fill_random(backend, cache.v, "bfloat16", seed=501)

    first_ids = [(7 * b + 1) % config.vocab_size for b in range(batch)]

    def start():
        cache.reset()
        cache.advance(plan.model_context)
        model.feed(first_ids)

    def state():
        return model.next_tokens(), cache.lengths_host().tolist()

    def after():
        try:
            cache.check()
        except Exception as exc:  # CacheOverflowError: the plan's max_seq is too small for its step count
            return [{"what": "no cache overflow during the timed steps", "error": str(exc), "passed": False}]
        return [{"what": "no cache overflow during the timed steps", "passed": True}]

    params = {"model": "cupykv.models.llama.Llama (random weights)", "config": config_items,
              "dtype": "bfloat16", "batch": batch, "max_seq": plan.model_max_seq,
              "context_len": plan.model_context,
              "note": "context_len tokens are live when each phase starts; every timed call adds one",
              "build_s": time.perf_counter() - started}
    return step, start, after, state, params


def model_decode(ctx) -> dict:
    """The model section: eager against graph decode step of a random-weight LLaMA."""
    from cupykv.models import llama

    step, start, after, state, params = _llama_step(llama, ctx)
    return eager_vs_graph(ctx, step, params, start=start, after=after, state=state)


def smollm2_decode(ctx) -> dict:
    """SmolLM2-135M's shape with random weights: tokens/s per batch, eager and graph.

    The real checkpoint cannot travel to a GPU machine without network, so its
    shape stands in (``plan.smollm2_config``); tokens/s = batch / step time.
    """
    from cupykv.models import llama

    rows, checks, params = [], [], {}
    for batch in ctx.plan.smollm2_batches:
        step, start, after, state, params = _llama_step(llama, ctx, ctx.plan.smollm2_config, batch)
        timed = eager_vs_graph(ctx, step, params, start=start, after=after, state=state)
        row = timed["results"][0]
        rows.append({"batch": batch, **row, "eager_tokens_per_s": batch / (row["eager_time_ms"] * 1e-3),
                     "graph_tokens_per_s": batch / (row["graph_time_ms"] * 1e-3)})
        checks += [dict(check, what=f"batch {batch}: {check['what']}") for check in timed["checks"]]
        del step, start, after, state
    return {
        "status": "ok",
        "description": "decode step of a random-weight model with SmolLM2-135M's shape (the real GGUF cannot reach "
                       "a GPU machine without network): tokens/s per batch, eager launches and graph replay",
        "params": {**{k: v for k, v in params.items() if k != "batch"}, "batches": list(ctx.plan.smollm2_batches)},
        "units": {"eager_tokens_per_s": "new tokens per second, all sequences", "graph_tokens_per_s": "same, graph",
                  "eager_time_ms": "ms per step, median", "graph_time_ms": "ms per step, median"},
        "results": rows,
        "checks": checks,
    }


def decode_loops(ctx) -> dict:
    """Greedy generation of the SmolLM2-shaped model: N steps per replay, and speculative cycles.

    Each figure is a difference of two wall-clock timings of whole
    ``generate`` calls (``loop_tokens`` new tokens, and 1; the fastest of
    ``loop_repeat`` calls each, the least disturbed by other host work), so the prefill and
    the first token cancel and what remains is ``loop_tokens - 1`` decode
    steps, with the host's reads of the tokens once per replay included. The
    graphs are captured on the warm-up calls and replayed in the timed ones.
    """
    from cupykv.models import Llama, LlamaConfig

    plan, backend = ctx.plan, ctx.backend
    wall = HostTimer(backend, warmup=1, repeat=plan.loop_repeat, min_warmup_s=0.0)
    config = LlamaConfig(**dict(plan.smollm2_config))
    k, new = plan.loop_speculative, plan.loop_tokens
    rows, checks = [], []
    for batch in plan.loop_batches:
        model = Llama.random(config, seed=0, dtype="bfloat16", max_seq=16 + new + k + 16, batch=batch,
                             backend=backend)
        draft = model.first_layers(plan.loop_draft_layers)
        prompts = [[(31 * b + 7 * i) % config.vocab_size for i in range(8 + b % 3)] for b in range(batch)]

        def per_step(**options):
            """Seconds per decode step, the tokens, the stats of generate with ``options``, and the
            fastest calls' seconds it came from (``loop_tokens`` new tokens, then 1).

            The tokens and stats are those of the last timed call of ``loop_tokens`` new tokens.
            """
            last = {}

            def generate_long():
                last["tokens"] = model.generate(prompts, new, use_graph=True, **options)
                last["stats"] = model.stats

            long = wall(generate_long)
            tokens, stats = last["tokens"], last["stats"]
            short = wall(lambda: model.generate(prompts, 1, use_graph=True, **options))
            calls = {"long_call_ms": long.min_s * 1e3, "one_token_call_ms": short.min_s * 1e3}  # fastest: least noise
            return (long.min_s - short.min_s) / (new - 1), tokens, stats, calls

        greedy = per_step(tokens_per_replay=1)
        greedy_step, want, _, _ = greedy
        for steps in plan.loop_replay_steps:
            seconds, tokens, _, calls = per_step(tokens_per_replay=steps) if steps != 1 else greedy
            rows.append({"batch": batch, "mode": f"{steps} steps per replay", "time_per_token_ms": seconds * 1e3,
                         "tokens_per_s": batch / seconds, "speedup_over_1": greedy_step / seconds, **calls})
            checks.append({"what": f"batch {batch}, {steps} steps per replay: tokens equal 1 step per replay",
                           "passed": tokens == want})
        seconds, tokens, stats, calls = per_step(draft=draft, num_speculative=k)
        cycle_s = seconds * (new - 1) / max(1, stats.cycles)
        rows.append({"batch": batch, "mode": f"speculative k={k}, draft {plan.loop_draft_layers} layers",
                     "time_per_token_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
                     "speedup_over_1": greedy_step / seconds, "cycle_over_step": cycle_s / greedy_step,
                     "acceptance_rate": stats.acceptance_rate, "tokens_per_cycle": stats.tokens_per_cycle,
                     "cycles": stats.cycles, **calls})
        checks.append({"what": f"batch {batch}, speculative: tokens equal plain greedy", "passed": tokens == want})
        del model, draft
    return {
        "status": "ok",
        "description": "generate() of a random-weight model with SmolLM2-135M's shape, wall clock per call: time per "
                       "token = (fastest call of loop_tokens new tokens - fastest call of 1) / (loop_tokens - 1), "
                       "graphs replayed, "
                       "host reads of the tokens included; cycle_over_step = one speculative cycle / one greedy "
                       "decode step (1 step per replay), speculative rows only, with acceptance_rate, tokens_per_cycle "
                       "and cycles (speculative cycles of the last long call)",
        "params": {"config": dict(plan.smollm2_config), "dtype": "bfloat16", "loop_tokens": new,
                   "replay_steps": list(plan.loop_replay_steps), "num_speculative": k,
                   "draft_layers": plan.loop_draft_layers, "batches": list(plan.loop_batches),
                   "timer": wall.method},
        "units": {"time_per_token_ms": "ms per decode step, all sequences", "tokens_per_s": "new tokens per second",
                  "speedup_over_1": "time per token at 1 step per replay / this",
                  "long_call_ms": "fastest generate call of loop_tokens new tokens",
                  "one_token_call_ms": "fastest generate call of 1 new token"},
        "results": rows,
        "checks": checks,
    }
