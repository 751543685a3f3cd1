"""``peers``: cupykv against what a user would pick instead, on the same data, in the same run.

Two parts, each run only where its peer can be imported (torch is never a
dependency of cupykv: it is imported here, when the section runs):

- **decode attention**: :func:`cupykv.attention` against torch's
  ``scaled_dot_product_attention`` with ``enable_gqa=True``, each SDPA backend
  selected on its own with ``torch.nn.attention.sdpa_kernel`` (flash,
  efficient, cuDNN, math); a backend that refuses a case is recorded with
  torch's reason. Both read one set of device buffers: torch sees the cache's
  K/V, the queries and the lengths through DLPack, with no copy. Torch's
  layout changes (``[batch, heads, seq, head_dim]`` views, and any copy its
  kernels then make) happen inside torch's timed call. Every output is checked
  against a float32 (float64 on the CPU) reference written without masks
  (each query row slices the keys it may see) before anything is timed; a
  disagreement fails the section and that output is not timed.
- **end to end** (:mod:`cupykv.bench.peers_hf`): greedy decoding of the
  SmolLM2-shaped model by ``cupykv.models.llama`` (graph decode) and by
  transformers' ``LlamaForCausalLM.generate`` with a static cache, eager and
  under ``torch.compile(mode="reduce-overhead")``, with the same weights.

:mod:`cupykv.bench.peers_torch` holds torch's side (DLPack views, masks, one
call per backend); this module the plan, the cases, the reference and the timing.

On a GPU (torch with CUDA) the times come from the bench's own timer (CUDA
events around one call, L2 flush and window guard), with torch launching on
CuPy's current stream, so the events bracket torch's work as they do
cupykv's. On the CPU emulator, with torch importable, a correctness-only mode
runs torch's CPU SDPA against the emulator at tiny sizes (three dtypes, both
cache layouts, uneven lengths, q_len 1 and 8) and reports no times. Without
torch the section is skipped and says which import failed.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

import cupykv
from cupykv._args.overlap import byte_range
from cupykv.bench import peers_torch
from cupykv.bench.arrays import fill_random, random_array, to_f32
from cupykv.bench.peers_torch import TORCH_BACKENDS
from cupykv.bench.timing import TimingWindowError
from cupykv.tolerances import attention_error

if TYPE_CHECKING:
    from cupykv.bench.sections import Context

GB, GiB = 1e9, 2**30
#: enable_gqa arrived in torch 2.5
MIN_TORCH = (2, 5)
CPU_LABEL = "correctness only: torch's CPU SDPA and transformers against the cupykv emulator; NO times"


@dataclass(frozen=True)
class PeersPlan:
    """Sizes of the peers section.

    Attention cases are every combination of ``dtypes``, ``layouts``,
    ``batches``, ``lives`` (keys the last query of the longest sequence
    attends to, its own row included), ``groups`` (query heads per kv head)
    and ``q_lens``. With ``uneven_lengths`` sequence ``b`` holds
    ``(live - q_len) * (b + 1) // batch`` rows before its queries, else every
    sequence holds ``live - q_len``.
    """

    timed: bool = True                # False: the CPU correctness-only mode
    batches: tuple = (1, 8, 32)
    lives: tuple = (1024, 8192, 32768)
    groups: tuple = (1, 4, 8)
    q_lens: tuple = (1, 8)
    dtypes: tuple = ("bfloat16",)
    layouts: tuple = ("HND",)         # HND is torch's own [batch, heads, seq, head_dim]: no copy for it
    n_kv_heads: int = 8
    head_dim: int = 128
    uneven_lengths: bool = False
    math_max_bytes: int = 24 * GiB    # the math backend is not run where its temporaries would exceed this
    model_dtype: str = "bfloat16"     # end to end: the SmolLM2-shaped model (Plan.smollm2_config)
    e2e_batches: tuple = (1, 8)
    prompt_len: int = 32
    new_tokens: int = 128
    e2e_repeat: int = 3               # timed generate calls per figure
    compile: bool = True              # also time transformers under torch.compile(mode="reduce-overhead")
    budget_s: float = 170.0           # the whole section, on an H200 (the issue asks for < 3 min)
    compile_reserve_s: float = 75.0   # compilation starts only with this much of the budget left


def import_torch(gpu: bool) -> tuple[Any, Optional[str]]:
    """torch, or ``None`` and why the peers cannot run here (which import failed, or no CUDA)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (torch >= 2.3)
    except Exception as exc:   # ImportError, or a broken install (OSError from a shared library)
        return None, f"torch is not importable ({type(exc).__name__}: {exc}); pip install torch to run the peers"
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        return None, f"torch {torch.__version__} has no enable_gqa in scaled_dot_product_attention (needs >= 2.5)"
    if gpu and not torch.cuda.is_available():
        return None, (f"torch {torch.__version__} imports but cannot use CUDA (torch.cuda.is_available() is False; "
                      f"built for CUDA {torch.version.cuda})")
    return torch, None


def peers(ctx: Context) -> dict:
    """The section: decode attention against torch SDPA, then end-to-end decoding against transformers."""
    from cupykv.bench import peers_hf

    plan, backend = ctx.plan.peers, ctx.backend
    gpu = not backend.device_info().emulated
    torch, reason = import_torch(gpu)
    if torch is None:
        return {"status": "skipped", "reason": reason}
    started = time.perf_counter()
    attention = _attention(ctx, torch, plan, gpu)
    if gpu:
        torch.cuda.empty_cache()
        backend.xp.get_default_memory_pool().free_all_blocks()
    end_to_end = peers_hf.end_to_end(ctx, torch, plan, deadline=started + plan.budget_s)
    e2e_checks = [dict(check, what=f"end to end: {check['what']}") for check in end_to_end.get("checks", [])]
    return {
        "status": "ok",
        "label": _label(backend, plan, gpu),
        "timed": plan.timed,
        **attention,
        "end_to_end": end_to_end,
        "checks": attention["checks"] + e2e_checks,
        "wall_s": time.perf_counter() - started,
    }


def _label(backend: Any, plan: PeersPlan, gpu: bool) -> str:
    if gpu:
        return f"GPU figures: {backend.device_info().name}"
    if plan.timed:   # only when a caller times the emulator on purpose (tests of the timing path)
        from cupykv.bench.report import EMULATOR_LABEL
        return EMULATOR_LABEL
    return CPU_LABEL


def _lengths(plan: PeersPlan, batch: int, live: int, q_len: int) -> list[int]:
    if plan.uneven_lengths:
        return [(live - q_len) * (b + 1) // batch for b in range(batch)]
    return [live - q_len] * batch


def _cache(ctx: Context, plan: PeersPlan, dtype: str, layout: str, batch: int) -> cupykv.KVCache:
    """A one-layer cache of random K/V, large enough for every live length of the plan."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=plan.n_kv_heads, head_dim=plan.head_dim,
                            max_seq=max(plan.lives), batch=batch, dtype=dtype, layout=layout)
    cache = cupykv.KVCache(spec, backend=ctx.backend.name)
    fill_random(ctx.backend, cache.k, dtype, seed=600 + batch)
    fill_random(ctx.backend, cache.v, dtype, seed=700 + batch)
    return cache


def _zero_copy_check(torch: Any, cache: cupykv.KVCache, where: str) -> dict:
    """torch's views of K, V and the lengths start at the cache's own addresses."""
    dtype = cache.spec.dtype
    pairs = [(peers_torch.as_torch(torch, array, dtype), array) for array in (cache.k, cache.v)]
    pairs.append((peers_torch.as_torch(torch, cache.lengths), cache.lengths))
    shared = all(tensor.data_ptr() == byte_range(array)[0] for tensor, array in pairs)
    return {"what": f"{where}: torch's K, V and lengths are the cache's memory (DLPack, no copy)", "passed": shared}


# -- the reference -----------------------------------------------------------------
def _key_rows(backend: Any, layer: Any, b: int, end: int, layout: str, compute: Any) -> Any:
    """Rows ``0..end-1`` of sequence ``b`` of one layer's K or V as ``[end, n_kv, head_dim]`` in ``compute``."""
    rows = layer[b, :end] if layout == "NHD" else layer[b, :, :end].transpose(1, 0, 2)
    return to_f32(backend, rows).astype(compute)


def reference(backend: Any, q: Any, cache: cupykv.KVCache, lengths: list[int]) -> tuple[np.ndarray, float]:
    """Attention by the contract, no mask involved: each query row slices the keys it may see.

    q ``[batch, q_len, n_heads, hd]``; returns the host float64 output of that
    shape and the value scale (max ``|v|`` over the rows attended). float64 on
    the emulator, float32 on a GPU (where bf16 rounding dominates the tolerance).
    """
    xp, spec = backend.xp, cache.spec
    compute = np.float64 if xp is np else xp.float32
    batch, q_len, n_heads, hd = q.shape
    group, scale = n_heads // spec.n_kv_heads, 1.0 / math.sqrt(hd)
    out = np.zeros(q.shape, np.float64)
    value_scale = 0.0
    for b in range(batch):
        end = lengths[b] + q_len
        k = _key_rows(backend, cache.k[0], b, end, spec.layout, compute)         # [end, n_kv, hd]
        v = _key_rows(backend, cache.v[0], b, end, spec.layout, compute)
        qb = to_f32(backend, q[b]).astype(compute).reshape(q_len, spec.n_kv_heads, group, hd)
        for i in range(q_len):
            seen = lengths[b] + i + 1
            scores = xp.einsum("kgd,lkd->kgl", qb[i], k[:seen]) * scale           # [n_kv, group, seen]
            scores -= scores.max(axis=-1, keepdims=True)
            weights = xp.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            row = xp.einsum("kgl,lkd->kgd", weights, v[:seen]).reshape(n_heads, hd)
            out[b, i] = np.asarray(backend.to_host(row), np.float64)
        value_scale = max(value_scale, float(xp.abs(v).max()))
    return out, value_scale


# -- the cases ---------------------------------------------------------------------
def _attention(ctx: Context, torch: Any, plan: PeersPlan, gpu: bool) -> dict:
    """Every attention case of the plan: rows (with times on a GPU) and agreement checks."""
    rows: list[dict] = []
    checks: list[dict] = []
    masks: dict[str, str] = {}
    with peers_torch.on_current_stream(torch, ctx.backend, gpu) as stream:
        for dtype, layout, batch in itertools.product(plan.dtypes, plan.layouts, plan.batches):
            cache = _cache(ctx, plan, dtype, layout, batch)
            checks.append(_zero_copy_check(torch, cache, f"{dtype} {layout} batch {batch}"))
            for live, group, q_len in itertools.product(plan.lives, plan.groups, plan.q_lens):
                row, case_checks, how = _case(ctx, torch, plan, cache, live, group, q_len, gpu)
                rows.append(row)
                checks += case_checks
                masks.update({f"q_len {q_len}, {name}": text for name, text in how.items()})
            del cache
    units = {"error_over_tolerance": "max |out - reference| / cupykv.tolerances.attention_tolerance (<= 1 passes)"}
    if plan.timed:
        units.update({"kv_bytes": "live K+V bytes read (batch * live_len * n_kv_heads * head_dim * 2 * itemsize)",
                      "<impl>_time_ms": "ms, median (min, max and the window guard beside it)",
                      "<impl>_pct_of_copy": "kv_bytes / time as a percent of the copy section's bandwidth",
                      "speedup_over_fastest_torch": "fastest torch backend's time / cupykv's time"})
    return {
        "description": "decode attention, cupykv.attention against torch.nn.functional.scaled_dot_product_attention "
                       "(enable_gqa=True) with each SDPA backend selected alone, on the same device buffers "
                       "(DLPack); outputs checked against a reference before timing",
        "params": {"torch_version": torch.__version__, "cuda": torch.version.cuda if gpu else None,
                   "torch_backends": list(TORCH_BACKENDS), "dtypes": list(plan.dtypes),
                   "layouts": list(plan.layouts), "batches": list(plan.batches), "live_lens": list(plan.lives),
                   "groups": list(plan.groups), "q_lens": list(plan.q_lens), "n_kv_heads": plan.n_kv_heads,
                   "head_dim": plan.head_dim, "uneven_lengths": plan.uneven_lengths, "masks": masks,
                   "stream": stream, "reference": "per query row, softmax over exactly the keys it may see "
                   "(no mask), " + ("float32 on the GPU" if gpu else "float64"),
                   "torch_views": "q.transpose(1, 2) and the live rows of K/V as [batch, n_kv, seq, head_dim], "
                                  "built inside torch's call (any copy torch makes is in its time)",
                   "math_max_bytes": plan.math_max_bytes},
        "units": units,
        "results": rows,
        "checks": checks,
    }


def _case(ctx: Context, torch: Any, plan: PeersPlan, cache: cupykv.KVCache, live: int, group: int, q_len: int,
          gpu: bool) -> tuple[dict, list[dict], dict[str, str]]:
    """One case: check cupykv and every torch backend against the reference, then time those that agree."""
    backend, spec = ctx.backend, cache.spec
    batch, dtype, n_heads = spec.batch, spec.dtype, group * spec.n_kv_heads
    lengths = _lengths(plan, batch, live, q_len)
    cache.set_lengths(lengths)
    q = random_array(backend, (batch, q_len, n_heads, spec.head_dim), dtype, seed=800 + live + group + q_len)
    out = backend.zeros(q.shape, backend.storage_dtype(dtype))
    want, value_scale = reference(backend, q, cache, lengths)
    name = f"{dtype} {spec.layout} batch {batch} live {live} GQA {group} q_len {q_len}"
    row: dict[str, Any] = {"case": name, "dtype": dtype, "layout": spec.layout, "batch": batch, "live_len": live,
                           "group": group, "n_heads": n_heads, "q_len": q_len, "lengths": lengths}
    errors, not_run, runs = {}, {}, {}

    def run_cupykv() -> Any:
        return cupykv.attention(q, cache, 0, out=out)
    run_cupykv()
    errors["cupykv"] = attention_error(backend.to_host(to_f32(backend, out)), want, dtype, value_scale)
    runs["cupykv"] = run_cupykv
    calls = peers_torch.torch_calls(torch, cache, q, lengths, gpu)
    kv_len = max(lengths) + q_len
    for impl, (call, _) in calls.items():
        math_bytes = peers_torch.math_bytes(batch, n_heads, q_len, kv_len, spec.head_dim)
        if impl == "math" and math_bytes > plan.math_max_bytes:
            not_run[impl] = (f"not run: the math backend would materialize about {math_bytes / GB:.0f} GB (K/V "
                             f"expanded over the group and upcast, and scores), over the plan's "
                             f"{plan.math_max_bytes / GB:.0f} GB")
            continue
        got, refused = peers_torch.first_call(torch, call)
        if refused is not None:
            not_run[impl] = f"refused: {refused}"
            continue
        errors[impl] = attention_error(got.transpose(1, 2).float().cpu().numpy(), want, dtype, value_scale)
        runs[impl] = call
        del got
    row["error_over_tolerance"] = errors
    row["torch_not_run"] = not_run
    checks = [{"what": f"{name}: {impl} agrees with the reference", "error_over_tolerance": error, "limit": 1.0,
               "passed": bool(error <= 1.0)} for impl, error in errors.items()]
    checks.append({"what": f"{name}: at least one torch backend ran", "passed": len(errors) > 1})
    if plan.timed:
        _time(ctx, row, {impl: fn for impl, fn in runs.items() if errors[impl] <= 1.0},
              batch * live * spec.n_kv_heads * spec.head_dim * 2 * spec.itemsize)
    return row, checks, {impl: how for impl, (_, how) in calls.items() if impl in errors}


def _time(ctx: Context, row: dict, runs: dict[str, Callable[[], Any]], kv_bytes: int) -> None:
    """Time each agreeing call with the bench's timer; add times, % of copy and cupykv's speed-up to ``row``."""
    row["kv_bytes"] = kv_bytes
    medians = {}
    for impl, fn in runs.items():
        try:
            timing = ctx.timer(fn)
        except TimingWindowError as exc:   # a torch call that waits for the GPU cannot be timed by events
            if impl == "cupykv":
                raise
            row["torch_not_run"][impl] = f"not timed: {exc}"
            continue
        medians[impl] = timing.median_s
        pct = 100.0 * kv_bytes / timing.median_s / GB / ctx.copy_GBps
        row.update({**timing.as_ms(f"{impl}_time"), f"{impl}_pct_of_copy": pct if math.isfinite(pct) else None})
    torch_times = {impl: s for impl, s in medians.items() if impl != "cupykv"}
    if torch_times and "cupykv" in medians:
        fastest = min(torch_times, key=torch_times.__getitem__)
        row.update({"fastest_torch": fastest, "fastest_torch_time_ms": torch_times[fastest] * 1e3,
                    "speedup_over_fastest_torch": torch_times[fastest] / medians["cupykv"]})
