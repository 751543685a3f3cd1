"""The bench's ``peers`` section on the CPU: the skip path, and the correctness-only mode against torch.

Without torch the section is skipped and names the failed import. With torch
(CI installs its CPU build, see ``.ci/run``; elsewhere these tests skip and
say how to install it) the emulator's correctness-only mode runs torch's CPU
SDPA and transformers against cupykv on the same buffers, reports no times
and passes; planted plumbing bugs (a mask shifted by one, a copy instead of a
DLPack view) make it report failed checks. The timing and reporting code of
the GPU mode runs once too, with host timings of the emulator (not GPU figures).
"""
import dataclasses
import os
import subprocess
import sys
import types

import pytest

import cupykv
from cupykv.backends import get_backend
from cupykv.bench import PLANS, SECTIONS, report, sections
from cupykv.bench import peers_torch
from cupykv.bench.peers import CPU_LABEL, TORCH_BACKENDS, PeersPlan, _lengths, import_torch, peers, reference
from cupykv.bench.arrays import fill_random, random_array
from cupykv.bench.timing import make_timer
from cupykv.tolerances import attention_error

INSTALL = "pip install torch==2.13.0 transformers (the CPU build; .ci/run installs both)"


def _needs(name):
    """The module, or a visible skip (a failure on CI, which installs it)."""
    try:
        return __import__(name)
    except ImportError as missing:
        if os.environ.get("CI"):
            pytest.fail(f"the peers' correctness test needs {name} ({missing}); {INSTALL}")
        pytest.skip(f"{name} is not installed ({missing}); to run the peers' correctness mode: {INSTALL}")


def _context(**peer_changes):
    backend = get_backend("emulator")
    plan = PLANS["smoke"]
    plan = dataclasses.replace(plan, peers=dataclasses.replace(plan.peers, **peer_changes))
    return sections.Context(backend=backend, plan=plan, timer=make_timer(backend, 1, 2))


def _failed(section):
    return [check["what"] for check in section["checks"] if not check["passed"]]


def test_the_section_is_registered_between_decode_loops_and_traffic():
    names = [name for name, _ in SECTIONS]
    assert names.index("decode_loops") + 1 == names.index("peers") == names.index("traffic") - 1


def test_cupykv_and_its_bench_import_without_torch():
    """torch is never a dependency: importing cupykv, its bench and its CLI leaves torch and transformers alone."""
    code = ("import sys, cupykv, cupykv.bench, cupykv.bench.peers, cupykv.__main__; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_without_torch_the_section_is_skipped_with_the_failed_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` now raises ImportError
    section = peers(_context())
    assert section["status"] == "skipped"
    assert section["reason"].startswith("torch is not importable (ModuleNotFoundError: import of torch halted")
    assert "pip install torch" in section["reason"]
    data = {"sections": {"peers": section}, "label": "x", "backend": "emulator", "mode": "smoke", "wall_s": 1.0,
            "environment": {"device": "cpu"}}
    assert f"peers: skipped: {section['reason']}" in report.table(data)
    report.figure(data)   # the peer panels say why they are empty


@pytest.mark.parametrize("version, usable", [("2.4.1+cpu", False), ("2.5.0", True), ("2.11.0+cu130", True),
                                             ("1.13.1", False)])
def test_a_torch_older_than_2_5_has_no_enable_gqa_and_is_a_reason(monkeypatch, version, usable):
    """A stand-in torch of each version (only what import_torch reads): 2.5 added enable_gqa."""
    torch = types.ModuleType("torch")
    torch.__version__ = version
    attention = types.ModuleType("torch.nn.attention")
    attention.SDPBackend, attention.sdpa_kernel = object(), object()
    for name, module in (("torch", torch), ("torch.nn", types.ModuleType("torch.nn")),
                         ("torch.nn.attention", attention)):
        monkeypatch.setitem(sys.modules, name, module)
    module, reason = import_torch(gpu=False)
    if usable:
        assert module is torch and reason is None
    else:
        assert module is None and reason == f"torch {version} has no enable_gqa in scaled_dot_product_attention " \
                                           "(needs >= 2.5)"


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("batch, live, q_len", [(1, 1024, 1), (3, 100, 8), (8, 8192, 8)])
def test_the_longest_sequences_last_query_attends_live_keys(uneven, batch, live, q_len):
    """Each sequence holds its rows before the q_len queries; the longest holds live - q_len, so its
    last query attends live keys (its own included); uneven lengths grow with the sequence index."""
    lengths = _lengths(PeersPlan(uneven_lengths=uneven), batch, live, q_len)
    assert len(lengths) == batch and max(lengths) + q_len == live and lengths[-1] == live - q_len
    if uneven:
        assert lengths == sorted(lengths) and lengths[0] == (live - q_len) // batch
    else:
        assert set(lengths) == {live - q_len}


def test_torch_without_cuda_is_a_reason_on_a_gpu():
    torch = _needs("torch")
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    module, reason = import_torch(gpu=True)
    assert module is None and "cannot use CUDA" in reason and torch.__version__ in reason


def test_without_transformers_the_end_to_end_part_is_skipped(monkeypatch):
    _needs("torch")
    monkeypatch.setitem(sys.modules, "transformers", None)
    section = peers(_context(dtypes=("float32",), layouts=("HND",), q_lens=(1,)))
    assert section["status"] == "ok"
    assert section["end_to_end"]["status"] == "skipped"
    assert section["end_to_end"]["reason"].startswith("transformers is not importable")


@pytest.fixture(scope="module")
def correctness():
    _needs("torch")
    _needs("transformers")
    return peers(_context())


def test_the_correctness_mode_passes_and_reports_no_times(correctness):
    section, plan = correctness, PLANS["smoke"].peers
    assert section["status"] == "ok" and section["timed"] is False and section["label"] == CPU_LABEL
    assert not _failed(section), _failed(section)
    cases = {(r["dtype"], r["layout"], r["group"], r["q_len"]) for r in section["results"]}
    assert cases == {(d, lay, g, q) for d in plan.dtypes for lay in plan.layouts for g in plan.groups
                     for q in plan.q_lens}
    for row in section["results"]:
        assert not any("time" in key or "pct" in key or "speedup" in key for key in row), row
        assert row["lengths"] == [(row["live_len"] - row["q_len"]) * (b + 1) // 2 for b in range(2)]   # uneven
        assert set(row["error_over_tolerance"]) | set(row["torch_not_run"]) == {"cupykv", *TORCH_BACKENDS}
        assert {"cupykv", "flash", "math"} <= set(row["error_over_tolerance"])   # torch's CPU kernels
        assert all(0 <= error <= 1 for error in row["error_over_tolerance"].values())
    zero_copy = [check for check in section["checks"] if "no copy" in check["what"]]
    assert len(zero_copy) == len(plan.dtypes) * len(plan.layouts) * len(plan.batches)


def test_the_correctness_mode_compares_tokens_with_transformers(correctness):
    e2e = correctness["end_to_end"]
    assert e2e["status"] == "ok" and e2e["params"]["dtype"] == "float32"
    assert [row["batch"] for row in e2e["results"]] == list(PLANS["smoke"].peers.e2e_batches)
    tokens = [check for check in e2e["checks"] if "tokens" in check["what"]]
    assert len(tokens) == len(e2e["results"]) and all(check["identical"] for check in tokens)
    assert any("same weights" in check["what"] and check["passed"] for check in e2e["checks"])
    assert all(not any("tokens_per_s" in key for key in row) for row in e2e["results"])


def test_a_mask_shifted_by_one_fails_the_section(monkeypatch):
    _needs("torch")
    shifted = peers_torch.causal_mask
    monkeypatch.setattr(peers_torch, "causal_mask",
                        lambda torch, lengths, q_len, kv_len: shifted(torch, lengths + 1, q_len, kv_len))
    section = peers(_context(dtypes=("float32",), e2e_batches=()))
    failed = _failed(section)
    assert failed and all(what.endswith(("flash agrees with the reference", "math agrees with the reference"))
                          for what in failed), failed
    assert not any("cupykv agrees" in what for what in failed)


def test_a_copy_instead_of_a_dlpack_view_fails_the_section(monkeypatch):
    _needs("torch")
    view = peers_torch.as_torch
    monkeypatch.setattr(peers_torch, "as_torch", lambda torch, array, dtype=None: view(torch, array, dtype).clone())
    section = peers(_context(dtypes=("float32",), layouts=("HND",), q_lens=(1,), e2e_batches=()))
    assert [what for what in _failed(section)] == ["float32 HND batch 2: torch's K, V and lengths are the cache's "
                                                   "memory (DLPack, no copy)"]


def test_the_gpu_flash_call_for_q_len_8_is_the_contract_or_a_refusal(monkeypatch):
    """On a GPU, flash takes q_len > 1 through torch's lower-right causal bias; here its CPU path checks the rule."""
    torch = _needs("torch")
    backend = get_backend("emulator")
    cache = _small_cache(backend)
    q_len, lengths = 8, [21, 21]
    cache.set_lengths(lengths)
    q = random_array(backend, (2, q_len, 8, 64), "float32", seed=5)
    call, how = peers_torch.torch_calls(torch, cache, q, lengths, gpu=True)["flash"]
    assert "causal_lower_right" in how
    out, refused = peers_torch.first_call(torch, call)   # no CUDA tensors: flash refuses, and says why
    assert out is None and "can_use_flash_attention" in refused
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda params, debug=False: True)
    out, refused = peers_torch.first_call(torch, call)   # torch's CPU path of the same bias
    assert refused is None
    want, value_scale = reference(backend, q, cache, lengths)
    assert attention_error(out.transpose(1, 2).numpy(), want, "float32", value_scale) <= 1.0


def _small_cache(backend):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, max_seq=48, batch=2, layout="HND")
    cache = cupykv.KVCache(spec, backend=backend)
    fill_random(backend, cache.k, "float32", seed=1)
    fill_random(backend, cache.v, "float32", seed=2)
    return cache


def test_the_timed_path_and_its_report_run_on_the_emulator():
    """The GPU mode's timing, ratios, table and figure, fed by host timings (NOT GPU figures)."""
    _needs("torch")
    _needs("transformers")
    context = _context(timed=True, dtypes=("bfloat16",), layouts=("NHD",), groups=(4,), e2e_batches=(1,),
                       e2e_repeat=1, compile=True, compile_reserve_s=1e9)
    context.copy_GBps = 10.0
    section = peers(context)
    assert section["status"] == "ok" and section["label"] == report.EMULATOR_LABEL and not _failed(section)
    for row in section["results"]:
        torch_times = {impl: row[f"{impl}_time_ms"] for impl in TORCH_BACKENDS if f"{impl}_time_ms" in row}
        assert torch_times and row["fastest_torch"] == min(torch_times, key=torch_times.get)
        assert row["speedup_over_fastest_torch"] == pytest.approx(min(torch_times.values()) / row["cupykv_time_ms"])
        assert row["cupykv_pct_of_copy"] == pytest.approx(
            100 * row["kv_bytes"] / (row["cupykv_time_ms"] * 1e-3) / 1e9 / context.copy_GBps)
        peers_plan = context.plan.peers   # the bytes are K and V of every live row, 2 bytes each (bf16)
        assert row["kv_bytes"] == row["batch"] * row["live_len"] * peers_plan.n_kv_heads * peers_plan.head_dim * 2 * 2
    (row,) = section["end_to_end"]["results"]
    assert row["cupykv_over_hf_eager"] == pytest.approx(row["cupykv_tokens_per_s"] / row["hf_eager_tokens_per_s"])
    assert row["hf_compiled_not_run"].startswith("not run:") and "budget" in row["hf_compiled_not_run"]
    data = {"sections": {"peers": section}, "label": "x", "backend": "emulator", "mode": "smoke", "wall_s": 1.0,
            "environment": {"device": "cpu"}}
    table = report.table(data)
    assert "end to end, batch 1: tokens/s cupykv" in table and "speedup" in table
    report.figure(data)


def test_a_torch_backend_just_past_the_tolerance_fails_and_is_not_timed(monkeypatch):
    """An error of 1.5 tolerances (a near miss: the shifted mask's errors are far larger) fails the
    agreement check, and the backend that disagrees is neither timed nor a candidate for "fastest"."""
    _needs("torch")
    from cupykv.bench import peers as peers_module
    last_called = []
    real_calls, real_error = peers_torch.torch_calls, peers_module.attention_error

    def marked_calls(*args, **kwargs):   # each torch call notes its backend's name when it runs
        def marked(impl, call):
            def run(*call_args, **call_kwargs):
                last_called.append(impl)
                return call(*call_args, **call_kwargs)
            return run
        return {impl: (marked(impl, call), how) for impl, (call, how) in real_calls(*args, **kwargs).items()}

    def near_miss_for_math(*args, **kwargs):
        error = real_error(*args, **kwargs)
        impl = last_called[-1] if last_called else "cupykv"
        last_called.clear()
        return 1.5 if impl == "math" else error

    monkeypatch.setattr(peers_torch, "torch_calls", marked_calls)
    monkeypatch.setattr(peers_module, "attention_error", near_miss_for_math)
    context = _context(timed=True, dtypes=("bfloat16",), layouts=("NHD",), groups=(4,), e2e_batches=())
    context.copy_GBps = 10.0
    section = peers(context)
    failed = _failed(section)
    assert failed and all(what.endswith("math agrees with the reference") for what in failed), failed
    for row in section["results"]:
        assert row["error_over_tolerance"]["math"] == 1.5
        assert "math_time_ms" not in row and row["fastest_torch"] != "math"
        assert "flash_time_ms" in row and "cupykv_time_ms" in row


def test_a_case_where_every_torch_backend_refuses_fails(monkeypatch):
    _needs("torch")
    monkeypatch.setattr(peers_torch, "first_call", lambda torch, call: (None, "a planted refusal"))
    section = peers(_context(dtypes=("float32",), layouts=("NHD",), q_lens=(1,), e2e_batches=()))
    failed = _failed(section)
    assert failed and all(what.endswith("at least one torch backend ran") for what in failed), failed
    for row in section["results"]:
        assert set(row["error_over_tolerance"]) == {"cupykv"}
        assert "refused: a planted refusal" in row["torch_not_run"].values()

