"""``python -m cupykv bench`` on the emulator: the smoke run, its JSON, its PNG and its arithmetic.

The bench runs once per session, as the ``bench`` part of ``python -m cupykv
validate --backend emulator`` (through the CLI, into a temporary folder; see
conftest.py); the tests read what it wrote. Every ratio, bandwidth and percentage
is recomputed from the stored figures, not compared with constants.
"""
import itertools
import json
import math
import sys

import ml_dtypes
import numpy as np
import pytest

import cupykv
from cupykv.backends import get_backend
from cupykv.bench import PLANS, SCHEMA, plan_for
from cupykv.bench import SECTIONS as SECTION_RUNNERS, model as bench_model, sections as bench_sections
from cupykv.bench.arrays import bf16_bits_from_f32, f32_from_bf16_bits, relative_error
from cupykv.bench.timing import HostTimer, Timing
from cupykv.bench.peers import CPU_LABEL
from cupykv.bench.report import EMULATOR_LABEL

SECTIONS = ("copy", "attention_decode", "attention_shapes", "attention_head_dim_256", "attention_fp8", "full_axis", "linear", "model_decode", "smollm2_decode", "decode_loops",
            "peers", "traffic")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench(validate_cpu_run):
    """The smoke bench of ``python -m cupykv validate --backend emulator`` (its ``bench`` part runs
    ``python -m cupykv bench --backend emulator`` into the same folder; conftest.py runs it once)."""
    out, summary = validate_cpu_run["out"], validate_cpu_run["summary"]
    part = summary["parts"]["bench"]
    assert "python -m cupykv bench --backend emulator" in " ".join(part["commands"]).replace(sys.executable, "python")
    data = json.loads((out / "bench.json").read_text())
    status = 0 if part["status"] == "passed" else 1
    return {"status": status, "out": out, "printed": (out / "validate.log").read_text(), "data": data,
            "reason": part.get("reason", "")}


def _figures(row):
    return {key: value for key, value in row.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-12)


def test_smoke_run_succeeds(bench):
    assert bench["status"] == 0, bench["reason"] + "\n" + bench["printed"]


def test_emulator_label_everywhere(bench):
    data = bench["data"]
    assert data["schema"] == SCHEMA
    assert data["label"] == EMULATOR_LABEL
    assert data["is_gpu_figures"] is False
    assert data["backend"] == "emulator" and data["mode"] == "smoke"
    assert EMULATOR_LABEL in bench["printed"]
    for key in ("device", "date", "numpy_version", "driver_version", "cuda_runtime_version", "cupy_version"):
        assert key in data["environment"]


def test_timing_records_its_window_guard(bench):
    """Host timing needs no guard (the emulator runs kernels inside the call), and the JSON says so."""
    timing = bench["data"]["timing"]
    assert timing["window_guard"]["method"].startswith("none")
    assert timing["l2_flush_bytes"] == 0 and timing["l2_flush"].startswith("none")   # nothing is flushed here
    assert timing["method"] == HostTimer.method
    rows = [row for section in bench["data"]["sections"].values() for row in section.get("results", [])]
    assert not any("guard" in key for row in rows for key in row)


def test_every_section_has_positive_finite_figures(bench):
    sections = bench["data"]["sections"]
    assert list(sections) == list(SECTIONS)
    for name, section in sections.items():
        if name == "peers" and section["status"] == "skipped":   # no torch here: the only section that may skip
            assert section["reason"].startswith("torch is not importable"), section
            continue
        assert section["status"] == "ok", (name, section)
        assert section["results"], name
        for row in section["results"]:
            figures = _figures(row)
            assert figures, (name, row)
            for key, value in figures.items():
                assert math.isfinite(value) and value > 0, (name, key, value)
        for key in section["units"]:
            assert all(key in row for row in section["results"]), (name, key)


def test_every_check_passed(bench):
    checks = [check for section in bench["data"]["sections"].values() for check in section.get("checks", [])]
    assert checks
    assert all(check["passed"] for check in checks), checks
    assert "\nchecks: all passed\n" in bench["printed"]


def test_the_printed_table_has_each_sections_block_with_a_line_per_row(bench):
    """Every section but peers (printed by its own lines) has a ``name:`` line in the printed table;
    an ``ok`` one has its column header and one line per result row under it."""
    printed = bench["printed"].splitlines()
    for name, section in bench["data"]["sections"].items():
        if name == "peers":
            continue
        starts = [i for i, line in enumerate(printed) if line.split(":")[0] == name]
        assert len(starts) == 1, (name, starts)
        if section["status"] != "ok":
            continue
        block = list(itertools.takewhile(lambda line: line.startswith("  "), printed[starts[0] + 1:]))
        assert len(block) == 1 + len(section["results"]), (name, block)


def test_png_written(bench):
    png = (bench["out"] / "bench.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000


def test_ratios_are_quotients_of_stored_figures(bench):
    sections = bench["data"]["sections"]
    copy = sections["copy"]["results"][0]
    assert _close(copy["bandwidth_GBps"], copy["bytes_moved"] / (copy["time_ms"] * 1e-3) / 1e9)
    for row in sections["attention_decode"]["results"]:
        assert _close(row["bandwidth_GBps"], row["kv_bytes"] / (row["time_ms"] * 1e-3) / 1e9)
        assert _close(row["pct_of_copy"], 100 * row["bandwidth_GBps"] / copy["bandwidth_GBps"])
        assert row["kv_bytes"] == row["batch"] * row["live_len"] * 8 * 128 * 2 * 2
    for row in sections["attention_shapes"]["results"]:   # head_dim 64, 2 kv heads, bf16 (the smoke plan)
        assert row["kv_bytes"] == row["batch"] * (row["live_len"] + row["q_len"] - 1) * 2 * 64 * 2 * 2
        assert _close(row["pct_of_copy"], 100 * row["kv_bytes"] / (row["time_ms"] * 1e-3) / 1e9
                      / copy["bandwidth_GBps"])
        attended = row["q_len"] * row["live_len"] + row["q_len"] * (row["q_len"] - 1) // 2
        assert _close(row["TFLOPS"], 4 * row["batch"] * 2 * row["group"] * attended * 64 / (row["time_ms"] * 1e-3)
                      / 1e12)
        rows = row["q_len"] * row["group"]
        assert row["rows_per_block"] == (16 if rows <= 16 else 32 if rows <= 32 else 64)
        # 64-row blocks are timed against blocks of 32 rows at the same point, and only they
        assert (row["time_ms_32_row_blocks"] is not None) == (row["rows_per_block"] == 64)
        if row["rows_per_block"] == 64:
            assert _close(row["time_vs_32_row_blocks"], row["time_ms"] / row["time_ms_32_row_blocks"])
            assert row["num_splits_32_row_blocks"] >= 1
        alone = next(r for r in sections["attention_shapes"]["results"] if r["q_len"] == 1 and all(
            r[key] == row[key] for key in ("batch", "group", "live_len")))
        assert _close(row["time_vs_q_len_1"], row["time_ms"] / alone["time_ms"])
    assert {row["rows_per_block"] for row in sections["attention_shapes"]["results"]} == {16, 32, 64}
    narrow_checks = [c for c in sections["attention_shapes"]["checks"] if c["what"].endswith("blocks of 32 rows vs float32")]
    assert narrow_checks and all(c["passed"] for c in narrow_checks)
    for row in sections["attention_head_dim_256"]["results"]:   # head_dim 256, 2 kv heads, bf16 (the smoke plan)
        assert row["kv_bytes"] == row["batch"] * (row["live_len"] + row["q_len"] - 1) * 2 * 256 * 2 * 2
        assert _close(row["pct_of_copy"], 100 * row["kv_bytes"] / (row["time_ms"] * 1e-3) / 1e9
                      / copy["bandwidth_GBps"])
        # at most two m16 tiles a block at head_dim 256, so no 64-row blocks to time against 32-row ones
        assert row["rows_per_block"] == (16 if row["q_len"] * row["group"] <= 16 else 32)
        assert row["time_ms_32_row_blocks"] is None
    assert {row["rows_per_block"] for row in sections["attention_head_dim_256"]["results"]} == {16, 32}
    assert sections["attention_head_dim_256"]["params"]["head_dim"] == 256
    for row in sections["attention_fp8"]["results"]:   # head_dim 64, 2 kv heads (the smoke plan)
        for name, itemsize in (("bf16", 2), ("fp8", 1)):
            assert row[f"{name}_kv_bytes"] == row["batch"] * row["live_len"] * 2 * 64 * 2 * itemsize
            assert _close(row[f"{name}_pct_of_copy"], 100 * row[f"{name}_kv_bytes"] / (row[f"{name}_time_ms"] * 1e-3)
                          / 1e9 / copy["bandwidth_GBps"])
        assert _close(row["fp8_speedup"], row["bf16_time_ms"] / row["fp8_time_ms"])
    for row in sections["linear"]["results"]:
        assert row["weight_bytes"] == row["out_features"] * row["in_features"] * 2
        assert _close(row["bandwidth_GBps"], row["weight_bytes"] / (row["time_ms"] * 1e-3) / 1e9)
        assert _close(row["pct_of_copy"], 100 * row["bandwidth_GBps"] / copy["bandwidth_GBps"])
    full = sections["full_axis"]
    for row in full["results"]:
        assert _close(row["ratio_baseline_over_cupykv"], row["baseline_time_ms"] / row["cupykv_time_ms"])
        assert row["cupykv_time_ms_min"] <= row["cupykv_time_ms"] <= row["cupykv_time_ms_max"]
    assert full["params"]["highlight_live_len"] in [row["live_len"] for row in full["results"]]
    model = sections["model_decode"]
    for row in model["results"]:
        assert _close(row["ratio_eager_over_graph"], row["eager_time_ms"] / row["graph_time_ms"])
    assert 0 < model["params"]["build_s"] < bench["data"]["wall_s"]   # the model's build, a part of the run
    for row in sections["smollm2_decode"]["results"]:
        assert _close(row["eager_tokens_per_s"], row["batch"] / (row["eager_time_ms"] * 1e-3))
        assert _close(row["graph_tokens_per_s"], row["batch"] / (row["graph_time_ms"] * 1e-3))


def test_sections_cover_the_plan(bench):
    data, plan = bench["data"], PLANS["smoke"]
    decode = {(row["batch"], row["live_len"]) for row in data["sections"]["attention_decode"]["results"]}
    assert decode == {(b, live) for b in plan.decode_batches for live in plan.decode_lives}
    shapes = {(row["batch"], row["group"], row["live_len"], row["q_len"])
              for row in data["sections"]["attention_shapes"]["results"]}
    assert shapes == set(itertools.product(plan.shapes.batches, plan.shapes.groups, plan.shapes.lives,
                                           plan.shapes.q_lens))
    wide = {(row["batch"], row["group"], row["live_len"], row["q_len"])
            for row in data["sections"]["attention_head_dim_256"]["results"]}
    assert wide == set(itertools.product(plan.shapes_256.batches, plan.shapes_256.groups, plan.shapes_256.lives,
                                         plan.shapes_256.q_lens))
    fp8 = {(row["batch"], row["group"], row["live_len"]) for row in data["sections"]["attention_fp8"]["results"]}
    assert fp8 == set(itertools.product(plan.fp8.batches, plan.fp8.groups, plan.fp8.lives))
    lives = [row["live_len"] for row in data["sections"]["full_axis"]["results"]]
    assert lives == [plan.full_axis_max_seq // d for d in plan.full_axis_divisors]
    assert len(data["sections"]["linear"]["results"]) == len(plan.linear_rows) * len(plan.linear_shapes)
    smollm2 = data["sections"]["smollm2_decode"]
    assert [row["batch"] for row in smollm2["results"]] == list(plan.smollm2_batches)
    config = dict(plan.smollm2_config)
    assert smollm2["params"]["config"] == config
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (576, 9, 3)
    assert dict(PLANS["full"].smollm2_config)["num_hidden_layers"] == 30
    assert PLANS["full"].smollm2_batches == (1, 8)


def test_decode_loops_cover_the_plan_and_reproduce_greedy_tokens(bench):
    plan, section = PLANS["smoke"], bench["data"]["sections"]["decode_loops"]
    k, layers = plan.loop_speculative, plan.loop_draft_layers
    want = [(b, f"{n} steps per replay") for b in plan.loop_batches for n in plan.loop_replay_steps] + \
        [(b, f"speculative k={k}, draft {layers} layers") for b in plan.loop_batches]
    assert sorted((row["batch"], row["mode"]) for row in section["results"]) == sorted(want)
    new = section["params"]["loop_tokens"]
    first = {row["batch"]: row for row in section["results"] if row["mode"] == "1 steps per replay"}
    for row in section["results"]:
        assert _close(row["tokens_per_s"], row["batch"] / (row["time_per_token_ms"] * 1e-3))
        # the 1-token call holds the prompt's prefill and the host's fixed cost; the rest is new - 1 steps
        assert _close(row["time_per_token_ms"], (row["long_call_ms"] - row["one_token_call_ms"]) / (new - 1))
        if "cycles" in row:   # speculative: one cycle's time over one greedy step's
            assert _close(row["cycle_over_step"], row["time_per_token_ms"] * (new - 1) / max(1, row["cycles"])
                          / first[row["batch"]]["time_per_token_ms"])
    for row in section["results"]:
        assert _close(row["speedup_over_1"], first[row["batch"]]["time_per_token_ms"] / row["time_per_token_ms"])
    assert section["checks"] and all(check["passed"] for check in section["checks"])   # tokens as plain greedy


def test_peers_are_correctness_only_or_skipped_with_the_reason(bench):
    """With torch: torch's CPU SDPA and transformers against the emulator, no times; without: the failed import."""
    section = bench["data"]["sections"]["peers"]
    if section["status"] == "skipped":
        assert "torch is not importable" in section["reason"] and section["reason"] in bench["printed"]
        return
    assert section["label"] == CPU_LABEL and section["timed"] is False and section["label"] in bench["printed"]
    assert section["results"] and not any("time" in key for row in section["results"] for key in row)
    assert section["checks"] and all(check["passed"] for check in section["checks"])


def test_the_emulator_reports_traffic_with_exact_sector_counts(bench):
    # The access patterns of tests/test_traffic.py, as the bench reports them (CPU-measured, not GPU figures).
    plan = PLANS["smoke"]
    (out_features, in_features), live = plan.linear_shapes[0], plan.decode_lives[0]
    assert [row["what"] for row in bench["data"]["sections"]["traffic"]["results"]] == [
        f"attention K, live {live}", f"attention V, live {live}",
        *(f"linear W {out_features}x{in_features}, {rows} rows" for rows in (1, max(plan.linear_rows)))]
    for row in bench["data"]["sections"]["traffic"]["results"]:
        assert row["sectors_over_ideal"] == 1.0, row            # not one sector outside what the op needs
        assert row["sectors_per_request"] > 0 and row["requested_over_ideal"] >= 1.0
    assert all(check["passed"] for check in bench["data"]["sections"]["traffic"]["checks"])


def test_plan_choice():
    assert plan_for(True, quick=False) is PLANS["smoke"]
    assert plan_for(True, quick=True) is PLANS["smoke"]
    assert plan_for(False, quick=True) is PLANS["quick"]
    assert plan_for(False, quick=False) is PLANS["full"]
    full = PLANS["full"]
    assert (full.n_heads, full.n_kv_heads, full.head_dim) == (64, 8, 128)
    assert full.decode_batches == (1, 8, 32) and full.full_axis_max_seq // 8 in [
        full.full_axis_max_seq // d for d in full.full_axis_divisors]


def test_bfloat16_bit_helpers_match_ml_dtypes():
    """The CuPy path's bf16 conversions, run on NumPy: round to nearest even, exact widening."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10_000),
                        np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38], np.float32)]).astype(np.float32)
    bits = bf16_bits_from_f32(np, x)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(f32_from_bf16_bits(np, bits), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def _context_without_timing():
    """The smoke plan on the emulator with a timer that times nothing: each section checks its
    results before it times them, so the checks are what runs."""
    return bench_sections.Context(backend=get_backend("emulator"), plan=PLANS["smoke"],
                            timer=lambda fn, flush=True: Timing(1e-3, 1e-3, 1e-3, 1), copy_GBps=1.0)


# (section, the op it checks, checks of that op in the smoke plan): each checked call, patched to be 5% off.
# attention_shapes: groups 1 and 4 x q_len 1, 5 and 9, and 64-row blocks against blocks of 32 once;
# attention_head_dim_256: group 2 x q_len 1 and 9.
WRONG_RESULT_CASES = [("attention_decode", "attention", 2), ("linear", "linear", 2), ("full_axis", "attention", 1),
                      ("attention_shapes", "AttentionPlan.run", 7), ("attention_head_dim_256", "AttentionPlan.run", 2),
                      ("attention_fp8", "AttentionPlan.run", 2)]


@pytest.mark.parametrize("section, op, n_checks", WRONG_RESULT_CASES, ids=[case[0] for case in WRONG_RESULT_CASES])
@pytest.mark.parametrize("factor", [1.0, 1.05], ids=["right", "5%-off"])
def test_a_wrong_result_fails_the_sections_check(monkeypatch, section, op, n_checks, factor):
    """The figures are only as good as the checks before them: an op whose result is 5% off (past
    the 1% limit) fails every check of it in its section, with that error; the op itself passes.
    (full_axis also checks its whole-axis baseline, which the patch leaves alone.)"""
    owner, name = (cupykv.AttentionPlan, "run") if op == "AttentionPlan.run" else (cupykv, op)
    real = getattr(owner, name)

    def scaled(*args, out, **options):
        real(*args, out=out, **options)
        out[...] = (out.astype(np.float32) * factor).astype(out.dtype)
        return out

    monkeypatch.setattr(owner, name, scaled)
    checks = dict(SECTION_RUNNERS)[section](_context_without_timing())["checks"]
    patched = [check for check in checks if not check["what"].startswith("full-axis baseline")]
    assert len(patched) == n_checks and len(checks) - len(patched) == (section == "full_axis")
    for check in checks:
        assert check["limit"] == bench_sections.ERROR_LIMIT == 1e-2
        if factor == 1.0 or check not in patched:
            assert check["passed"] and check["relative_error"] < 4e-3, check   # one bf16 rounding, about 2e-3
        else:
            assert not check["passed"] and abs(check["relative_error"] - 0.05) < 5e-3, check


class _GraphThatDoesNothing:
    """A captured step gone stale in the plainest way: its replays launch nothing."""

    def __init__(self, graph):
        self.num_launches = graph.num_launches

    def replay(self, n=1):
        pass


class _GraphThatReplaysTwice:
    """A replay that runs the step twice: the right tokens, every other one."""

    def __init__(self, graph):
        self.graph, self.num_launches = graph, graph.num_launches

    def replay(self, n=1):
        self.graph.replay(2 * n)


@pytest.mark.parametrize("section", ["model_decode", "smollm2_decode"])
@pytest.mark.parametrize("graph", [None, _GraphThatDoesNothing, _GraphThatReplaysTwice],
                         ids=["real", "does-nothing", "replays-twice"])
def test_a_stale_graph_fails_the_model_sections_check(monkeypatch, section, graph):
    """The model sections time a graph only as good as its replays: after the timings, replays from
    the same start must leave the tokens and lengths that eager steps leave, for each batch."""
    if graph is not None:
        real_capture = bench_model.capture
        monkeypatch.setattr(bench_model, "capture", lambda step: graph(real_capture(step)))
    checks = dict(SECTION_RUNNERS)[section](_context_without_timing())["checks"]
    replays = [check for check in checks if "graph replays leave the tokens and lengths" in check["what"]]
    assert len(replays) == (len(PLANS["smoke"].smollm2_batches) if section == "smollm2_decode" else 1)
    assert all(check["passed"] is (graph is None) for check in replays), replays
    assert all(check["passed"] for check in checks if check not in replays)   # no overflow either way


def test_relative_error_and_the_check_boundary():
    backend = get_backend("emulator")
    want = np.array([[3.0, 4.0]], np.float32)   # norm 5
    got = backend.asarray(np.array([[3.0, 4.5]], np.float32))
    assert relative_error(backend, got, want) == pytest.approx(0.1, rel=1e-12)
    assert relative_error(backend, backend.asarray(np.full((1, 2), np.nan, np.float32)), want) == math.inf
    assert relative_error(backend, got, np.zeros((1, 2), np.float32)) == pytest.approx(math.hypot(3.0, 4.5))
    assert bench_sections._check("x", 1e-2)["passed"] and not bench_sections._check("x", 1.0001e-2)["passed"]
    assert not bench_sections._check("x", math.inf)["passed"]
