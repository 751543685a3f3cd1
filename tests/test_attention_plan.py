"""AttentionPlan: static work planned once (splits, geometry, workspace), run per layer and step.

Each plan owns its split-KV workspace, so plans never share scratch memory;
cupykv.attention() keeps a few plans per cache and makes them outside capture.
"""
import gc
import weakref

import numpy as np
import pytest

import importlib

import cupykv
from cupykv import attention_plan, reference, testing
from cupykv.backends.base import Backend
from cupykv.kernels import parse_constants
from backends import BACKENDS

attention_module = importlib.import_module("cupykv.attention")   # cupykv.attention is the function

N_HEADS = 4
SPLITS = 2     # forced: the emulator's plan picks 1, and max_seq 256 allows 2
SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=256, batch=2, dtype="float32")


def filled(backend):
    cache, oracle = cupykv.KVCache(SPEC, backend=backend), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [200, 7], np.random.default_rng(0))
    return cache, oracle


def queries(rng, q_len):
    return testing.random_rows(rng, SPEC, (SPEC.batch, q_len, N_HEADS, SPEC.head_dim))


def assert_attention_matches(cache, oracle, q_host, out, layer=0):
    want = reference.attention(q_host, oracle, layer)
    scale = float(np.abs(oracle.v[layer]).max())
    testing.assert_attention_close(testing.to_numpy(out, SPEC), want, SPEC.dtype, scale)


def workspace(plan):
    """The plan's device buffers: partial out, max and sum, and the per-tile split counters."""
    return plan._workspace.buffers


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_runs_every_layer_and_matches_the_reference(backend):
    cache, oracle = filled(backend)
    plan = cupykv.AttentionPlan(cache, 3, N_HEADS, num_splits=SPLITS)
    q_host = queries(np.random.default_rng(1), 3)
    q = cache.to_device(q_host)
    for layer in range(SPEC.n_layers):
        out = cache.to_device(np.zeros(q_host.shape, np.float32))
        assert plan.run(q, layer, out=out) is out
        assert_attention_matches(cache, oracle, q_host, out, layer)


def test_a_plan_owns_exact_separate_workspace_buffers():
    # Exact sizes and no shared memory: an emulated overrun of one buffer hits its guard page.
    cache, _ = filled("emulator")
    plan = cupykv.AttentionPlan(cache, 3, N_HEADS, num_splits=SPLITS)
    rows = SPEC.batch * 3 * N_HEADS
    partial_out, partial_max, partial_sum, counters = plan._workspace.buffers
    assert partial_out.shape == (SPLITS, rows, SPEC.head_dim)
    assert partial_max.shape == partial_sum.shape == (SPLITS, rows)
    assert counters.shape == (plan.grid[0],) and counters.dtype == np.uint32   # one per query tile
    assert plan.workspace_bytes == 4 * (SPLITS * rows * SPEC.head_dim + 2 * SPLITS * rows + plan.grid[0])
    buffers = (partial_out, partial_max, partial_sum, counters)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(buffers) for b in buffers[i + 1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_counters_are_zero_after_every_run_and_replay(backend):
    """The last block of a tile merges the splits and its atomicInc wraps the counter to 0: eager
    runs and graph replays (while lengths change) leave every counter at 0 and merge right."""
    cache, oracle = filled(backend)
    rng = np.random.default_rng(7)
    q_host = queries(rng, 2)
    q, out = cache.to_device(q_host), cache.to_device(np.zeros_like(q_host))
    plan = cupykv.AttentionPlan(cache, 2, N_HEADS, num_splits=SPLITS)
    counters = workspace(plan)[3]
    for _ in range(2):
        plan.run(q, 1, out=out)
        assert_attention_matches(cache, oracle, q_host, out, layer=1)
        assert not testing.to_numpy(counters, SPEC).any()
    graph = cupykv.capture(lambda: plan.run(q, 1, out=out))
    for lengths in ([150, 9], [201, 3], [0, 60]):
        cache.set_lengths(cache.to_device(np.array(lengths, np.int32)))
        oracle.set_lengths(np.array(lengths))
        graph.replay()
        assert_attention_matches(cache, oracle, q_host, out, layer=1)
        assert not testing.to_numpy(counters, SPEC).any(), lengths


def test_a_launch_that_fails_part_way_leaves_no_tile_mid_count(monkeypatch):
    """Blocks run in index order (seed 0): split 0 of sequence 0's tiles counts, then sequence 1's
    first block faults on a protected K row. The plan zeroes its counters, so the next run merges
    at the right block; left mid-count, sequence 0 would merge after its first split."""
    from cupykv.backends import emulator as E
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    cache, oracle = filled("emulator")
    q_host = queries(np.random.default_rng(8), 1)
    q, out = cache.to_device(q_host), cache.to_device(np.zeros_like(q_host))
    plan = cupykv.AttentionPlan(cache, 1, N_HEADS, num_splits=SPLITS)
    sequence_bytes = SPEC.max_seq * SPEC.n_kv_heads * SPEC.head_dim * 4   # layer 0, sequence 1: one page run
    with E.protected(cache.k, sequence_bytes, 2 * sequence_bytes), pytest.raises(E.EmulatorFault):
        plan.run(q, 0, out=out)
    assert not testing.to_numpy(workspace(plan)[3], SPEC).any()
    plan.run(q, 0, out=out)
    assert_attention_matches(cache, oracle, q_host, out)


def test_an_unsplit_plan_owns_no_workspace_bytes():
    cache, _ = filled("emulator")
    plan = cupykv.AttentionPlan(cache, 1, N_HEADS)
    assert plan.num_splits == 1 and plan.workspace_bytes == 0
    # an unsplit launch never touches them: each buffer is a one-element stand-in, not a split's size
    assert [b.size for b in workspace(plan)] == [1, 1, 1, 1]


def test_a_max_seq_of_one_key_chunk_allows_one_split():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=128, batch=1, dtype="float32")
    cache = cupykv.KVCache(spec, backend="emulator")
    assert attention_plan.max_splits(128) == 1 and attention_plan.max_splits(129) == 2
    assert cupykv.AttentionPlan(cache, 1, 1, num_splits=1).num_splits == 1
    with pytest.raises(ValueError, match=r"^num_splits: expected an int in 1\.\.1, got 2$"):
        cupykv.AttentionPlan(cache, 1, 1, num_splits=2)


def test_the_split_plan_counts_every_resident_block_of_every_sm(monkeypatch):
    """The blocks that fill a device are its SMs times the blocks one SM holds (the backend's occupancy
    query): 4 SMs of 3 blocks over 2 query tiles want 6 splits, not the 2 that one block per SM would."""
    from cupykv.backends.emulator_backend import EmulatorBackend
    monkeypatch.setenv("CUPYKV_EMULATOR_SMS", "4")
    monkeypatch.setattr(EmulatorBackend, "occupancy", lambda self, op, instance, threads, shared: 3)
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=64, max_seq=4096, batch=1, dtype="bfloat16")
    plan = cupykv.AttentionPlan(cupykv.KVCache(spec, backend="emulator"), 1, 8)
    assert plan.num_splits == attention_plan.plan_splits(spec, 1, 8, 12) == 6


def test_two_plans_share_no_scratch_memory():
    cache, _ = filled("emulator")
    first = cupykv.AttentionPlan(cache, 2, N_HEADS, num_splits=SPLITS)
    second = cupykv.AttentionPlan(cache, 2, N_HEADS, num_splits=SPLITS)
    for a in workspace(first):
        assert not any(np.shares_memory(a, b) for b in workspace(second))


def test_interleaved_plans_of_different_shapes_each_stay_correct():
    cache, oracle = filled("emulator")
    rng = np.random.default_rng(1)
    plans = {q_len: cupykv.AttentionPlan(cache, q_len, N_HEADS, num_splits=SPLITS) for q_len in (1, 5)}
    for q_len in (1, 5, 1, 5):
        q_host = queries(rng, q_len)
        out = plans[q_len].run(cache.to_device(q_host), 1)
        assert_attention_matches(cache, oracle, q_host, out, 1)


def test_run_refuses_queries_of_another_shape_before_launching(monkeypatch):
    cache, _ = filled("emulator")
    plan = cupykv.AttentionPlan(cache, 2, N_HEADS)
    # patched on the class: pytest < 9.1 "restores" an instance attribute by leaving the bound method in the
    # shared backend's __dict__, which then hides every later class-level patch of Backend.launch
    monkeypatch.setattr(Backend, "launch", lambda *a, **k: pytest.fail("launched"))
    q = cache.to_device(queries(np.random.default_rng(1), 3))
    with pytest.raises(ValueError, match=r"^q: expected the plan's shape \(2, 2, 4, 8\), got \(2, 3, 4, 8\)"):
        plan.run(q, 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(q_len=0, n_heads=N_HEADS), r"^q_len: expected an int in 1\.\."),
    (dict(q_len=1, n_heads=3), r"^n_heads: expected a multiple of n_kv_heads=2, got 3"),
    (dict(q_len=1, n_heads=0), r"^n_heads: expected an int in 1\.\."),
    (dict(q_len=1, n_heads=N_HEADS, num_splits=3), r"^num_splits: expected an int in 1\.\.2, got 3"),
    (dict(q_len=1, n_heads=N_HEADS, scale=-1.0), r"^scale: "),
    (dict(q_len=1, n_heads=N_HEADS, window=0), r"^window: expected an int in 1\.\.2147483647, got 0$"),
    (dict(q_len=1, n_heads=N_HEADS, softcap=0.0), r"^softcap: expected a float in .*, got 0\.0$"),
    (dict(q_len=1, n_heads=N_HEADS, rope=10000.0), r"^rope: expected None or a cupykv\.Rope, got 10000\.0"),
])
def test_bad_plan_arguments_are_refused_before_any_allocation(monkeypatch, kwargs, message):
    cache, _ = filled("emulator")
    monkeypatch.setattr(type(cache._backend), "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises((TypeError, ValueError), match=message):
        cupykv.AttentionPlan(cache, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_making_a_plan_inside_a_captured_step_is_refused(backend):
    cache, _ = filled(backend)
    q = cache.to_device(queries(np.random.default_rng(1), 1))
    calls = iter([False, True])

    def step():
        if next(calls):
            cupykv.AttentionPlan(cache, 1, N_HEADS, num_splits=SPLITS)   # only while recording
        cache.advance(0)

    with pytest.raises(cupykv.CaptureError, match="making an AttentionPlan .* make plans before capture"):
        cupykv.capture(step)
    del q


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_captured_step_runs_a_plan_made_on_its_warm_up_run(backend):
    cache, oracle = filled(backend)
    q_host = queries(np.random.default_rng(1), 1)
    q, out = cache.to_device(q_host), cache.to_device(np.zeros(q_host.shape, np.float32))
    graph = cupykv.capture(lambda: cupykv.attention(q, cache, 0, num_splits=SPLITS, out=out))
    cache._backend.upload(out, np.zeros(q_host.shape, np.float32))
    graph.replay()
    assert_attention_matches(cache, oracle, q_host, out)


def test_the_convenience_form_reuses_its_plan_and_allocates_nothing_on_later_calls(monkeypatch):
    cache, _ = filled("emulator")
    q_host = queries(np.random.default_rng(1), 2)
    q, out = cache.to_device(q_host), cache.to_device(np.zeros(q_host.shape, np.float32))
    cupykv.attention(q, cache, 0, num_splits=SPLITS, out=out)
    monkeypatch.setattr(type(cache._backend), "zeros", lambda *a, **k: pytest.fail("allocated"))
    cupykv.attention(q, cache, 1, num_splits=SPLITS, out=out)


# Calls on one cache that differ from the first only in one option: each must get a plan of its own.
OPTION_VARIANTS = [{}, {"rope": cupykv.Rope(theta=500.0)}, {"window": 5}, {"softcap": 3.0}, {"scale": 0.3},
                   {"num_splits": SPLITS}, {"split_keys": 128}, {}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_convenience_form_never_reuses_a_plan_made_for_other_options(backend):
    """attention() keeps plans per cache by their static options: a call that differs in one option
    (rope, window, softcap, scale, splits) must run a plan with that option, so its result is the
    reference's for that option, and the plan it ran says so; the first options then get their plan again."""
    cache, oracle = filled(backend)
    q_host = queries(np.random.default_rng(2), 3)
    q = cache.to_device(q_host)
    value_scale = float(np.abs(oracle.v[0]).max())
    for options in OPTION_VARIANTS:
        got = cupykv.attention(q, cache, 0, **options)
        want = reference.attention(q_host, oracle, 0, **{k: v for k, v in options.items()
                                                         if k not in ("num_splits", "split_keys")})
        testing.assert_attention_close(testing.to_numpy(got, SPEC), want, SPEC.dtype, value_scale, context=str(options))
        used = next(reversed(attention_module._plans[cache].values()))   # the plan the call ran
        assert (used.rope, used.window, used.softcap, used.split_keys) == (
            options.get("rope"), options.get("window"), options.get("softcap"), options.get("split_keys")), options
        assert used.scale == np.float32(options.get("scale", 1 / np.sqrt(SPEC.head_dim))), options
        if "num_splits" in options:
            assert used.num_splits == options["num_splits"]
    assert len(attention_module._plans[cache]) == len(OPTION_VARIANTS) - 1


def test_the_convenience_form_keeps_a_bounded_number_of_plans_per_cache():
    cache, _ = filled("emulator")
    rng = np.random.default_rng(1)
    limit = attention_module.PLANS_PER_CACHE
    made = []
    for q_len in range(1, limit + 4):
        cupykv.attention(cache.to_device(queries(rng, q_len)), cache, 0, num_splits=SPLITS)
        made.append(weakref.ref(next(reversed(attention_module._plans[cache].values()))))
    assert [plan.q_len for plan in attention_module._plans[cache].values()] == list(range(4, limit + 4))
    gc.collect()
    assert [ref() is not None for ref in made] == [False] * 3 + [True] * limit   # dropped plans are freed


def test_the_convenience_form_drops_its_least_recently_used_plan():
    """A plan used again moves to the back of the queue: the next new shape drops the oldest unused one."""
    cache, _ = filled("emulator")
    rng = np.random.default_rng(1)
    limit = attention_module.PLANS_PER_CACHE

    def attend(q_len):
        cupykv.attention(cache.to_device(queries(rng, q_len)), cache, 0, num_splits=SPLITS)

    for q_len in range(1, limit + 1):
        attend(q_len)
    attend(1)              # the oldest, used again
    attend(limit + 1)      # a new shape: q_len 2 is now the least recently used
    assert [plan.q_len for plan in attention_module._plans[cache].values()] == [*range(3, limit + 1), 1, limit + 1]


def test_the_default_scale_named_or_left_out_runs_one_plan():
    """Plans are kept by the checked options: ``scale=None`` is ``1/sqrt(head_dim)``, so naming that
    value reuses the plan (and its workspace) that leaving it out made; a call that names another
    scale still gets its own plan."""
    cache, _ = filled("emulator")
    q = cache.to_device(queries(np.random.default_rng(1), 2))
    cupykv.attention(q, cache, 0, num_splits=SPLITS)
    first = next(iter(attention_module._plans[cache].values()))
    cupykv.attention(q, cache, 0, num_splits=SPLITS, scale=1 / np.sqrt(SPEC.head_dim))
    assert list(attention_module._plans[cache].values()) == [first]
    cupykv.attention(q, cache, 0, num_splits=SPLITS, scale=0.5)
    assert len(attention_module._plans[cache]) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_may_not_write_into_a_plans_workspace(backend):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=256, batch=1)
    cache = cupykv.KVCache(spec, backend=backend)
    q = cache.to_device(np.ones((1, 1, 1, 8), np.float32))
    plan = cupykv.AttentionPlan(cache, 1, 1, num_splits=2)
    partial_out = plan._workspace.partial_out
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap an AttentionPlan's "
                                         r"attention plan workspace, got one that shares 32 bytes with it$"):
        plan.run(q, 0, out=partial_out.reshape(-1)[:8].reshape(1, 1, 1, 8))


def test_the_tiling_is_read_from_the_kernel_source():
    constants = attention_plan.KERNELS["attention"].constants("attention_tiling")
    assert (attention_plan.THREADS, attention_plan.TILE_ROWS, attention_plan.CHUNK) == \
        (constants["kThreads"], constants["kTileRows"], constants["kChunk"])


def test_parse_constants_reads_literals_and_arithmetic_on_earlier_constants():
    source = """
namespace tiling {
constexpr int kThreads = 256;   // a comment
constexpr int kWarps = kThreads / 32;
constexpr int kRows = (kWarps + 1) * 2 - 3;
}  // namespace tiling
namespace other {
constexpr int kThreads = 1;
}  // namespace other
"""
    assert parse_constants(source, "tiling") == {"kThreads": 256, "kWarps": 8, "kRows": 15}
    assert parse_constants(source, "other") == {"kThreads": 1}


@pytest.mark.parametrize("source, message", [
    ("namespace t {\nconstexpr int kA = kB;\n}  // namespace t", "unknown name 'kB'"),
    ("namespace t {\nint kA = 1;\n}  // namespace t", "expected 'constexpr int NAME = EXPR;'"),
    ("namespace t {\nconstexpr int kA = sizeof(float);\n}  // namespace t", "not an integer constant expression"),
    ("namespace u {\n}  // namespace u", "no 'namespace t"),
])
def test_parse_constants_refuses_what_it_cannot_read(source, message):
    with pytest.raises(ValueError, match=message):
        parse_constants(source, "t")


# -- split_keys: splits at fixed positions, so a row does not depend on the query shape -------------------
# float32 outputs: rounding to a 16-bit output could hide a difference in the fp32 sums
LONG = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=16, max_seq=1024, batch=2, dtype="float32")


def rows_alone_and_together(split_kwargs, q_len=5, lengths=(700, 333)):
    """Attention of ``q_len`` queries in one pass, and of each query alone at its own length (same cache rows)."""
    cache, oracle = cupykv.KVCache(LONG, backend="emulator"), reference.KVCache(LONG)
    rng = np.random.default_rng(3)
    testing.fill(cache, oracle, [n + q_len for n in lengths], rng)    # every row a pass may read is written
    q_host = testing.random_rows(rng, LONG, (LONG.batch, q_len, 4, LONG.head_dim))
    cache.set_lengths(list(lengths))
    together = testing.to_numpy(cupykv.attention(cache.to_device(q_host), cache, 0, **split_kwargs), LONG)
    alone = []
    for i in range(q_len):
        cache.set_lengths([n + i for n in lengths])
        out = cupykv.attention(cache.to_device(np.ascontiguousarray(q_host[:, i:i + 1])), cache, 0, **split_kwargs)
        alone.append(testing.to_numpy(out, LONG)[:, 0])
    return together, np.stack(alone, axis=1)


@pytest.mark.parametrize("split_keys", [128, 256, 384])
@pytest.mark.parametrize("lengths", [(700, 333), (765, 383)])
def test_with_split_keys_a_row_of_a_pass_equals_the_row_alone_bit_for_bit(split_keys, lengths):
    together, alone = rows_alone_and_together({"split_keys": split_keys}, lengths=lengths)
    assert together.tobytes() == alone.tobytes()


def test_equal_splits_of_the_tile_range_do_not_give_that_guarantee():
    # Why split_keys exists: with num_splits the cut points follow the tile's last query.
    # lengths where the tile's range (L + 5) rounds to a larger per-split size than a row alone (L + 1 + i)
    together, alone = rows_alone_and_together({"num_splits": 3}, lengths=(765, 383))
    assert together.tobytes() != alone.tobytes()
    assert np.allclose(together, alone, rtol=1e-5, atol=1e-6)   # the same within rounding, not bit for bit


def test_split_keys_sets_the_split_count_and_reaches_the_kernel():
    cache = cupykv.KVCache(LONG, backend="emulator")
    plan = cupykv.AttentionPlan(cache, 2, 4, split_keys=256)
    assert (plan.split_keys, plan.num_splits, plan.grid[1]) == (256, 4, 4)
    assert "split_keys=256" in repr(plan)


@pytest.mark.parametrize("kwargs, message", [
    (dict(split_keys=200), r"^split_keys: expected a multiple of 128 \(the kernel's key chunk\), got 200$"),
    (dict(split_keys=64), r"^split_keys: expected an int in 128\.\.1024, got 64$"),
    (dict(split_keys=1), r"^split_keys: expected an int in 128\.\.1024, got 1$"),
    (dict(split_keys=0), r"^split_keys: expected an int in 128\.\.1024, got 0$"),
    (dict(split_keys=2048), r"^split_keys: expected an int in 128\.\.1024, got 2048$"),
    (dict(split_keys=256, num_splits=4), r"^num_splits: expected None with split_keys"),
])
@pytest.mark.parametrize("form", ["plan", "attention"])
def test_bad_split_keys_are_refused(monkeypatch, form, kwargs, message):
    """By the plan and by the convenience form, with the same message, before anything is allocated."""
    cache = cupykv.KVCache(LONG, backend="emulator")
    q = cache.to_device(np.zeros((LONG.batch, 1, 4, LONG.head_dim), np.float32))
    monkeypatch.setattr(type(cache._backend), "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ValueError, match=message):
        if form == "plan":
            cupykv.AttentionPlan(cache, 1, 4, **kwargs)
        else:
            cupykv.attention(q, cache, 0, **kwargs)


def test_split_keys_that_need_more_splits_than_a_grid_holds_are_refused_as_split_keys():
    """CUDA's grid y holds 65535 splits: at max_seq 128 * 65535 + 1, split_keys 128 would need 65536, so
    the smallest allowed is 256 (the error names split_keys, not the num_splits it implies)."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=1, max_seq=128 * 65535 + 1, batch=1)
    cache = cupykv.KVCache(spec, backend="emulator")   # zero pages: nothing is committed
    with pytest.raises(ValueError, match=r"^split_keys: expected an int in 256\.\.8388608, got 128$"):
        cupykv.AttentionPlan(cache, 1, 1, split_keys=128)
    assert cupykv.AttentionPlan(cache, 1, 1, split_keys=256).num_splits == 32768


# -- a stated device: the emulator plans as a GPU with that many SMs would ----------------------------
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float32", 64), ("float8_e4m3", 64)])
def test_a_stated_h200_gets_a_gpu_split_plan_that_the_emulator_runs_and_checks(monkeypatch, dtype, head_dim):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=4096, batch=1, dtype=dtype)
    assert cupykv.AttentionPlan(cupykv.KVCache(spec, backend="emulator"), 1, 8).num_splits == 1   # one SM
    monkeypatch.setenv("CUPYKV_EMULATOR_SMS", "132")
    cache, oracle = cupykv.KVCache(spec, backend="emulator"), reference.KVCache(spec)
    assert cache.device_info().multiprocessor_count == 132
    plan = cupykv.AttentionPlan(cache, 1, 8)
    # 132 resident blocks over 2 query tiles (batch 1 x 2 kv heads): 66 splits wanted, 4096 // 256 = 16 allowed
    assert plan.num_splits == attention_plan.plan_splits(spec, 1, 8, 132) == 16
    rng = np.random.default_rng(3)
    for live in (1, 256 * 16 - 1, 16 * 128 + 1):   # one key; the last position; an uneven last split
        testing.fill(cache, oracle, [live - 1], rng)
        q_host = testing.random_rows(rng, spec, (1, 1, 8, head_dim))
        out = plan.run(cache.to_device(q_host), 0)
        want = reference.attention(q_host, oracle, 0)
        testing.assert_attention_close(testing.to_numpy(out, spec, io=True), want, spec.io_dtype,
                                       testing.value_scale(oracle, 0))
    assert not cache._backend.to_host(plan._workspace.split_counters).any()


def test_a_bad_stated_sm_count_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("CUPYKV_EMULATOR_SMS", "many")
    with pytest.raises(ValueError, match=r"^CUPYKV_EMULATOR_SMS: expected an int in 1\.\.65535 .* got 'many'$"):
        cupykv.KVCache(SPEC, backend="emulator").device_info()


def test_rows_per_block_is_checked_by_name():
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=128, max_seq=256, batch=1, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend="emulator")
    assert attention_plan.block_row_choices("bfloat16", 128) == (16, 32, 64)
    with pytest.raises(ValueError, match=r"^rows_per_block: expected one of 16, 32, 64 \(blocks of the tensor-core "
                                         r"kernel\) or None, got 48$"):
        attention_plan.AttentionPlan(cache, 9, 8, rows_per_block=48)
    with pytest.raises(TypeError, match=r"^rows_per_block: expected an int >= 1, got True \(bool\)$"):
        attention_plan.AttentionPlan(cache, 9, 8, rows_per_block=True)
    with pytest.raises(ValueError, match=r"^rows_per_block: expected an int >= 1, got 0$"):
        attention_plan.AttentionPlan(cache, 9, 8, rows_per_block=0)
    wide = attention_plan.AttentionPlan(cache, 1, 2, rows_per_block=64)   # 1 row in a block of 64
    assert wide.kernel.rows_per_block == 64 and wide.grid == (2, wide.num_splits) and wide.block == (128,)
    fp32 = cupykv.KVCache(cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=128, max_seq=256, batch=1,
                                           dtype="float32"), backend="emulator")
    assert attention_plan.block_row_choices("float32", 128) == (16,)
    with pytest.raises(ValueError, match=r"^rows_per_block: expected 16 \(blocks of the CUDA-core kernel, which a "
                                         r"float32 cache at head_dim 128 runs\) or None, got 32$"):
        attention_plan.AttentionPlan(fp32, 9, 8, rows_per_block=32)
    assert attention_plan.AttentionPlan(fp32, 9, 8, rows_per_block=16).kernel.rows_per_block == 16
    wide_heads = cupykv.KVCache(cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=256, max_seq=256, batch=1,
                                                 dtype="float16"), backend="emulator")
    assert attention_plan.block_row_choices("float16", 256) == (16, 32)
    with pytest.raises(ValueError, match=r"^rows_per_block: expected one of 16, 32 \(blocks of the tensor-core "
                                         r"kernel\) or None, got 64$"):
        attention_plan.AttentionPlan(wide_heads, 9, 8, rows_per_block=64)


def test_a_plan_opts_in_to_its_shared_memory_before_it_asks_for_the_occupancy(monkeypatch):
    """On CuPy the occupancy query of a kernel that has not opted in to more than 48 KiB counts 0
    blocks; the plan must raise the kernel's limit first (and only past 48 KiB)."""
    from cupykv.backends.emulator_backend import EmulatorBackend
    calls = []
    monkeypatch.setattr(EmulatorBackend, "opt_in_shared_memory",
                        lambda self, op, instance, nbytes: calls.append(("opt-in", instance, nbytes)))
    monkeypatch.setattr(EmulatorBackend, "occupancy",
                        lambda self, op, instance, threads, shared: calls.append(("occupancy", instance, shared)) or 1)
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=128, max_seq=1024, batch=1, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend="emulator")
    plan = attention_plan.AttentionPlan(cache, 4, 16)   # 32 rows per kv head: two row tiles, 60928 bytes
    instance = "cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 2>"
    assert plan.kernel.instance == instance and plan.shared_mem_bytes == 60928
    assert calls[:2] == [("opt-in", instance, 60928), ("occupancy", instance, 60928)]
    calls.clear()
    plan = attention_plan.AttentionPlan(cache, 9, 8)   # 36 rows per kv head: four row tiles, 87040 bytes
    wide = "cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 4>"
    assert plan.kernel.instance == wide and plan.shared_mem_bytes == 87040
    assert calls[:2] == [("opt-in", wide, 87040), ("occupancy", wide, 87040)]
    calls.clear()
    attention_plan.AttentionPlan(cache, 2, 8)   # 8 rows: one tile, 47872 bytes, no opt-in
    assert [call[0] for call in calls] == ["occupancy"]
    calls.clear()
    plan = attention_plan.AttentionPlan(cache, 4, 16, num_splits=2)   # no occupancy query: still opted in
    assert calls == [("opt-in", instance, 60928)]
