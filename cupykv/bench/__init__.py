"""``python -m cupykv bench``: the performance harness (meant for a GPU).

Sections, all measured in one run so that every ratio compares figures taken
side by side:

- ``copy``: device-to-device copy of a large buffer, bytes read plus written
  per second: the yardstick.
- ``attention_decode``: :func:`cupykv.attention` at q_len 1, GQA 64/8, head
  dim 128, bf16, per batch and live length; live K+V bytes per second and as
  a percentage of the copy bandwidth.
- ``attention_shapes`` (:mod:`cupykv.bench.attention_shapes`): bf16 attention
  for q_len 1, 4, 8, 16 (decode and speculative verification), batch 1, 8, 32,
  live 1k to 128k and GQA group 1, 4, 8: percent of copy bandwidth, TFLOPS, and
  time as a ratio to q_len 1 at the same batch, group and live length.
- ``attention_head_dim_256``: the same at head_dim 256 (Gemma 2 and 3, GQA 2
  and 4), which the tensor-core kernel tiles with one key warp per block.
- ``attention_fp8`` (:mod:`cupykv.bench.attention_fp8`): decode attention over
  an fp8 (E4M3) cache against a bf16 cache of the same shape: the fp8 speed-up
  and the fp8 cache's bandwidth as a percentage of copy.
- ``full_axis``: at a fixed large ``max_seq``, cupykv.attention against the
  whole-axis attention of other static caches (matmul over every position,
  plus the additive mask, softmax, matmul), per live length.
- ``linear``: :func:`cupykv.linear` for 1..16 rows; bytes of W per second.
- ``model_decode``: eager against graph-replayed decode step of
  ``cupykv.models.llama``.
- ``smollm2_decode``: tokens/s of a random-weight model with SmolLM2-135M's
  shape, batch 1 and 8, eager and graph.
- ``decode_loops``: greedy generation of the SmolLM2-shaped model, wall
  clock per call: tokens/s with N decode steps per graph replay, and one
  speculative cycle (self-speculative draft) as a multiple of one decode step.
- ``peers`` (where torch can be imported; :mod:`cupykv.bench.peers`): decode
  attention against each of torch's SDPA backends on the same device buffers
  (DLPack), and end-to-end greedy decoding against transformers' static-cache
  ``generate``, eager and under ``torch.compile``; skipped, with the failed
  import, without torch. On the emulator: correctness only, no times.
- ``traffic`` (emulator only): sectors per warp request and distinct sectors
  over the ideal for decode attention's K/V loads and linear's weight loads,
  counted by the emulator; properties of the access patterns, not GPU figures.

On CuPy, times come from CUDA events around one call, after warm-up, with an
L2 flush and a device-side delay before each timed call, so that the window
holds device work only (see ``cupykv.bench.timing``); the median is kept with
min and max. On the
emulator a smoke version (small shapes, a couple of points per section) runs
on the host clock and every output says "emulator timings: CPU emulation, NOT
GPU figures". Results go to ``bench.json`` and ``bench.png`` in ``--out``.
"""
from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cupykv.backends import get_backend
from cupykv.bench import attention_fp8, attention_shapes, model, peers, report, sections
from cupykv.bench.attention_fp8 import Fp8Plan
from cupykv.bench.attention_shapes import ShapesPlan
from cupykv.bench.peers import PeersPlan
from cupykv.bench.timing import make_timer

SCHEMA = "cupykv-bench/1"
GiB, MiB = 2**30, 2**20


@dataclass(frozen=True)
class Plan:
    """Sizes and repeat counts of one bench mode."""

    mode: str
    warmup: int
    repeat: int
    copy_bytes: int
    decode_batches: tuple
    decode_lives: tuple
    decode_max_seq: int
    full_axis_max_seq: int
    full_axis_batch: int
    full_axis_divisors: tuple    # live lengths are max_seq // divisor
    linear_rows: tuple
    linear_shapes: tuple         # (out_features, in_features)
    model_config: tuple          # LlamaConfig keyword arguments, as (name, value) pairs
    model_batch: int
    model_max_seq: int
    model_context: int           # live tokens when each timing phase starts
    smollm2_config: tuple = ()   # LlamaConfig keyword arguments of the SmolLM2-shaped model, as pairs
    smollm2_batches: tuple = (1, 8)
    loop_tokens: int = 64        # decode_loops: new tokens per generate call
    loop_replay_steps: tuple = (1, 4, 16)   # decode_loops: decode steps per graph replay
    loop_draft_layers: int = 8   # decode_loops: the self-speculative draft keeps this many layers
    loop_speculative: int = 4    # decode_loops: tokens a draft proposes per cycle
    loop_batches: tuple = (1, 8)
    loop_repeat: int = 6         # decode_loops: timed generate calls per figure (wall clock)
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 128
    full_axis_check_divisor: int = 8
    peers: PeersPlan = PeersPlan()   # the peers section: torch SDPA and transformers on the same data
    shapes: ShapesPlan = ShapesPlan()   # attention_shapes: q_len x batch x live x GQA group
    # attention_head_dim_256: the same at Gemma's head size
    shapes_256: ShapesPlan = ShapesPlan(lives=(1024, 8192, 32768), groups=(2, 4), q_lens=(1, 4, 8), head_dim=256)
    fp8: Fp8Plan = Fp8Plan()            # attention_fp8: fp8 against bf16 caches, batch x live x GQA group

    def __post_init__(self):
        steps = self.warmup + self.repeat + 1   # per model phase: warm-up, timed calls, capture's own step
        if self.model_context + steps > self.model_max_seq:
            raise ValueError(f"model_max_seq: expected >= model_context + {steps} decode steps, "
                             f"got {self.model_max_seq}")


# LLaMA-3.2-1B shapes (1.2e9 parameters): random weights are drawn on the host, so larger models
# would spend minutes there before anything is timed.
_LLAMA_1B = (("hidden_size", 2048), ("intermediate_size", 8192), ("num_hidden_layers", 16),
             ("num_attention_heads", 32), ("num_key_value_heads", 8), ("vocab_size", 128256),
             ("rope_theta", 500000.0), ("tie_word_embeddings", True))

# SmolLM2-135M-Instruct's shape (the GGUF's llama.* keys); cupykv.models.generate runs the real one.
_SMOLLM2 = (("hidden_size", 576), ("intermediate_size", 1536), ("num_hidden_layers", 30),
            ("num_attention_heads", 9), ("num_key_value_heads", 3), ("vocab_size", 49152),
            ("rope_theta", 100000.0), ("rms_norm_eps", 1e-5), ("tie_word_embeddings", True))

PLANS = {
    "full": Plan(
        mode="full", warmup=5, repeat=30, copy_bytes=1 * GiB,
        decode_batches=(1, 8, 32), decode_lives=(512, 1024, 2048, 4096, 8192, 16384, 32768), decode_max_seq=32768,
        full_axis_max_seq=32768, full_axis_batch=8, full_axis_divisors=(64, 32, 16, 8, 4, 2, 1),
        linear_rows=(1, 2, 4, 8, 16), linear_shapes=((4096, 4096), (14336, 4096)),
        model_config=_LLAMA_1B, model_batch=1, model_max_seq=2048, model_context=1024,
        smollm2_config=_SMOLLM2),
    "quick": Plan(
        mode="quick", warmup=3, repeat=10, copy_bytes=256 * MiB,
        decode_batches=(1, 32), decode_lives=(512, 4096, 32768), decode_max_seq=32768,
        full_axis_max_seq=32768, full_axis_batch=8, full_axis_divisors=(64, 8, 1),
        linear_rows=(1, 16), linear_shapes=((4096, 4096), (14336, 4096)),
        model_config=tuple((k, 4) if k == "num_hidden_layers" else (k, v) for k, v in _LLAMA_1B),
        model_batch=1, model_max_seq=2048, model_context=1024, smollm2_config=_SMOLLM2,
        loop_tokens=32, loop_replay_steps=(1, 16), loop_batches=(1,), loop_repeat=3,
        # validate runs this plan within its bench budget: peers gets 60 s, so torch.compile is left out
        # unless the attention cases finish with 60 s to spare
        peers=PeersPlan(batches=(1, 32), lives=(1024, 32768), groups=(1, 8), e2e_batches=(1,), e2e_repeat=2,
                        budget_s=60.0, compile_reserve_s=60.0),
        shapes=ShapesPlan(batches=(1, 8), lives=(8192, 32768), groups=(4, 8), q_lens=(1, 8)),
        shapes_256=ShapesPlan(batches=(1, 8), lives=(8192, 32768), groups=(2,), q_lens=(1, 8), head_dim=256),
        fp8=Fp8Plan(batches=(1, 8), lives=(8192, 32768), groups=(8,))),
    # The emulator's smoke run: the real head configuration, tiny lengths and weights.
    "smoke": Plan(
        mode="smoke", warmup=1, repeat=3, copy_bytes=32 * MiB,
        decode_batches=(1, 2), decode_lives=(128, 512), decode_max_seq=512,
        full_axis_max_seq=1024, full_axis_batch=1, full_axis_divisors=(64, 8, 1),
        linear_rows=(1, 16), linear_shapes=((512, 512), (1024, 512)),
        model_config=(("hidden_size", 256), ("intermediate_size", 512), ("num_hidden_layers", 2),
                      ("num_attention_heads", 4), ("num_key_value_heads", 2), ("vocab_size", 1000)),
        model_batch=1, model_max_seq=64, model_context=16,
        smollm2_config=tuple((k, {"num_hidden_layers": 2, "vocab_size": 2048}.get(k, v)) for k, v in _SMOLLM2),
        smollm2_batches=(1, 2), loop_tokens=6, loop_replay_steps=(1, 4), loop_draft_layers=1,
        loop_batches=(1,), loop_repeat=1,   # emulator times are not figures: one timed call exercises the path
        # torch's CPU SDPA against the emulator: correctness only, three dtypes, both layouts, uneven lengths
        peers=PeersPlan(timed=False, batches=(2,), lives=(40,), groups=(1, 4), q_lens=(1, 8),
                        dtypes=("bfloat16", "float16", "float32"), layouts=("NHD", "HND"), n_kv_heads=2,
                        head_dim=64, uneven_lengths=True, model_dtype="float32", e2e_batches=(1, 2), prompt_len=8,
                        new_tokens=8, e2e_repeat=0, compile=False),
        # the tensor-core kernel at q_len 1, 5 and 9 (two warp rounds of keys), GQA 1 and 4: 1 to 36 query
        # rows, one m16 tile per block, two at 20 rows and four (two row groups of warps) at 36
        shapes=ShapesPlan(batches=(1,), lives=(40, 100), groups=(1, 4), q_lens=(1, 5, 9), n_kv_heads=2, head_dim=64,
                          check_live=70),
        # head_dim 256 at GQA 2: 2 and 18 query rows, one m16 tile per block and two (two warps)
        shapes_256=ShapesPlan(batches=(1,), lives=(40,), groups=(2,), q_lens=(1, 9), n_kv_heads=2, head_dim=256,
                              check_live=70),
        fp8=Fp8Plan(batches=(1,), lives=(100,), groups=(1, 4), n_kv_heads=2, head_dim=64, check_live=70)),
}

#: section name -> function of a Context, in run order (copy first: the others divide by it).
SECTIONS = (("copy", sections.copy_bandwidth), ("attention_decode", sections.attention_decode),
            ("attention_shapes", attention_shapes.attention_shapes),
            ("attention_head_dim_256", attention_shapes.attention_head_dim_256), ("attention_fp8", attention_fp8.attention_fp8),
            ("full_axis", sections.full_axis), ("linear", sections.linear), ("model_decode", model.model_decode),
            ("smollm2_decode", model.smollm2_decode), ("decode_loops", model.decode_loops), ("peers", peers.peers),
            ("traffic", sections.traffic))


def plan_for(emulated: bool, quick: bool) -> Plan:
    """The emulator always runs the smoke plan; a GPU runs ``quick`` or ``full``."""
    if emulated:
        return PLANS["smoke"]
    return PLANS["quick" if quick else "full"]


def run(backend=None, out="bench_results", quick=False, echo=print) -> dict:
    """Run every section, write ``bench.json`` and ``bench.png`` into ``out``, return the JSON data.

    Parameters
    ----------
    backend : {"cupy", "emulator"} or None
        ``None`` picks CuPy when a GPU is usable, else the emulator.
    out : str or Path
        Output folder, created if needed.
    quick : bool
        On CuPy, fewer points and repeats. The emulator always runs its smoke plan.
    echo : callable
        Receives progress lines and the final table.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("python -m cupykv bench draws bench.png with matplotlib: pip install matplotlib")
    backend = get_backend(backend)
    is_gpu = not backend.device_info().emulated
    plan = plan_for(not is_gpu, quick)
    env = report.environment(backend)
    label = f"GPU figures: {env['device']}" if is_gpu else report.EMULATOR_LABEL
    timer = make_timer(backend, plan.warmup, plan.repeat, env.get("l2_bytes") or 0)
    ctx = sections.Context(backend=backend, plan=plan, timer=timer)
    echo(f"cupykv bench ({plan.mode}) on {backend.name}: {env['device']}")
    echo(label)
    started = time.perf_counter()
    results = {}
    for name, section in SECTIONS:
        section_started = time.perf_counter()
        results[name] = section(ctx)
        echo(f"  {name}: {results[name]['status']} ({time.perf_counter() - section_started:.1f} s)")
    data = {
        "schema": SCHEMA,
        "label": label,
        "is_gpu_figures": is_gpu,
        "backend": backend.name,
        "mode": plan.mode,
        "environment": env,
        "timing": {"method": timer.method, "warmup": plan.warmup, "repeat": plan.repeat,
                   "min_warmup_s": getattr(timer, "min_warmup_s", 0.0),
                   "statistic": "median of the timed calls; min and max kept as *_min / *_max",
                   "l2_flush_bytes": timer.flush_bytes,
                   "l2_flush": ("a buffer of l2_flush_bytes is overwritten before each timed attention/linear call, "
                                "outside the timed region") if is_gpu else "none (host timing)",
                   "window_guard": timer.window_guard},
        "bandwidth_unit": "GB/s = 1e9 bytes per second",
        "plan": asdict(plan),
        "wall_s": time.perf_counter() - started,
        "sections": results,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    report.write_png(data, out / "bench.png")
    echo(report.table(data))
    echo(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return data


def main(backend=None, out="bench_results", quick=False) -> int:
    """CLI entry: run the bench; exit status 1 if a correctness check failed."""
    data = run(backend=backend, out=out, quick=quick)
    return 0 if all(check["passed"] for check in report.all_checks(data)) else 1


__all__ = ["Plan", "PLANS", "SECTIONS", "plan_for", "run", "main", "SCHEMA"]
