"""run_if: a launch whose device word holds 0 returns at once (issue 18).

A decoding loop that captures N decode steps in one graph clears one device
word once every sequence has stopped; every kernel of the remaining steps reads
it first and does nothing. For each call that takes ``run_if`` (the six ops,
``KVCache.append`` and ``write``, ``attention`` and ``AttentionPlan.run``):

- a word holding 0 leaves every output (poisoned with NaN or -77 first, so a
  stray write shows), the cache (K, V, lengths, overflow flags) and the plan's
  split counters bit for bit as they were;
- a word holding 1 (or any other nonzero value) gives the bytes of
  ``run_if=None`` exactly;
- the emulator's traffic counter sees a gated-off launch load its 4-byte word
  and touch nothing else;
- a captured graph follows the word as it is flipped between replays;
- a bad word is refused with a named error before anything is launched.

The reference cache takes the same ``run_if`` (a NumPy int32 ``[1]``) and
agrees with the fast path, ``return_positions`` included.
"""
import dataclasses

import numpy as np
import pytest

import cupykv
from cupykv import CaptureError, ops, reference, testing
from cupykv.backends import get_backend
from cupykv.validate_launches import recording_launches
from backends import BACKENDS

# max_seq past 2 * 128 keys, so that a plan can split a sequence of 260 live rows three ways
# (head_dim 6: 12-byte rows, not whole 16-byte copies, so a 16-bit cache stays on CUDA cores)
SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=6, max_seq=300, batch=2, dtype="float16")
# the attention kernels: CUDA cores (SPEC), tensor cores, and tensor cores over fp8 codes; the ops run in the io dtype
SPECS = {"cuda-cores": SPEC,
         "tensor-cores": cupykv.CacheSpec(n_layers=2, n_kv_heads=1, head_dim=64, max_seq=300, batch=2,
                                          dtype="bfloat16"),
         "fp8": cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=64, max_seq=300, batch=2, dtype="float8_e4m3",
                                 io_dtype="float16", layout="HND")}
LENGTHS = [130, 260]
HIDDEN, OUT_FEATURES, VOCAB, ROWS = 64, 24, 40, 2
POISON_INT = -77


class Env:
    """A filled cache, its plan, operands and poisoned outputs for every call that takes ``run_if``.

    Two envs made with one ``spec`` and ``seed`` hold the same bytes, so a call made
    on each with different words can be compared bit for bit.
    """

    def __init__(self, backend, spec=SPEC, seed=0):
        rng = np.random.default_rng(seed)
        self.backend = get_backend(backend)
        self.spec = spec
        self.cache = cupykv.KVCache(spec, backend=backend)
        testing.fill(self.cache, reference.KVCache(spec), LENGTHS, rng)
        dev = self.cache.to_device
        io = spec.io_np_dtype

        def rand(*shape):
            return dev((rng.standard_normal(shape) * 0.5).astype(io))

        self._poison = {}   # id(output) -> its poison on the host

        def poisoned(*shape, dtype=io):
            host = np.full(shape, POISON_INT if np.dtype(dtype) == np.int32 else np.nan, dtype)
            out = dev(host)
            self._poison[id(out)] = host
            return out

        rows = (spec.batch, 3, spec.n_kv_heads, spec.head_dim)            # [batch, n_new, n_kv, head_dim]
        self.k, self.v = rand(*rows), rand(*rows)
        self.positions = dev(np.array([[4, 299, 300], [-1, 7, 8]], np.int32))   # 300 and -1 overflow
        self.appended, self.written = poisoned(2, 3, dtype=np.int32), poisoned(2, 3, dtype=np.int32)
        q_shape = (spec.batch, 2, 2 * spec.n_kv_heads, spec.head_dim)    # [batch, q_len, n_heads, head_dim]
        self.q, self.attended, self.planned = rand(*q_shape), poisoned(*q_shape), poisoned(*q_shape)
        self.plan = cupykv.AttentionPlan(self.cache, q_len=2, n_heads=2 * spec.n_kv_heads, num_splits=3)
        self.x, self.x2 = rand(ROWS, HIDDEN), rand(ROWS, HIDDEN)           # [rows, hidden]
        self.weight, self.norm_weight = rand(OUT_FEATURES, HIDDEN), rand(HIDDEN)
        self.table, self.ids = rand(VOCAB, HIDDEN), dev(np.array([3, VOCAB], np.int32))   # one id out of range
        self.logits = rand(ROWS, VOCAB)
        self.projected = poisoned(ROWS, OUT_FEATURES)
        self.embedded, self.flag = poisoned(ROWS, HIDDEN), dev(np.zeros(1, np.int32))
        self.normed, self.gated, self.summed = (poisoned(ROWS, HIDDEN) for _ in range(3))
        self.tokens = poisoned(ROWS, dtype=np.int32)

    def outputs(self):
        """The op outputs and positions_out arrays (not the cache): what a step's launches overwrite."""
        return [self.appended, self.written, self.attended, self.planned, self.projected, self.embedded,
                self.normed, self.gated, self.summed, self.tokens]

    def poison(self):
        """Refill every output with its poison (NaN, or -77 for int32), as the env began."""
        for out in self.outputs():
            self.backend.copy(out, self.cache.to_device(self._poison[id(out)]))

    def word(self, value):
        """A device int32 ``[1]`` holding ``value``."""
        return self.cache.to_device(np.array([value], np.int32))

    def snapshot(self):
        """The bytes of everything a call may write: the cache, the plan's workspace and every output."""
        arrays = [self.cache.k, self.cache.v, self.cache.lengths, self.cache.overflow,
                  *self.plan._workspace.buffers, self.flag, *self.outputs()]
        return [np.ascontiguousarray(self.backend.to_host(a)).view(np.uint8).copy() for a in arrays]


# name: (the call, with its word; an output it writes, viewed as int32 [1] for the overlap check)
CALLS = {
    "linear": (lambda e, w: ops.linear(e.x, e.weight, out=e.projected, run_if=w),
               lambda e: e.projected.reshape(-1).view(np.int32)[:1]),
    "embedding": (lambda e, w: ops.embedding(e.ids, e.table, out=e.embedded, error_flag=e.flag, run_if=w),
                  lambda e: e.flag),
    "rmsnorm": (lambda e, w: ops.rmsnorm(e.x, e.norm_weight, 1e-6, out=e.normed, run_if=w),
                lambda e: e.normed.reshape(-1).view(np.int32)[3:4]),
    "silu_mul": (lambda e, w: ops.silu_mul(e.x, e.x2, out=e.gated, run_if=w),
                 lambda e: e.gated.reshape(-1).view(np.int32)[:1]),
    "add": (lambda e, w: ops.add(e.x, e.x2, out=e.summed, run_if=w),
            lambda e: e.summed.reshape(-1).view(np.int32)[:1]),
    "argmax": (lambda e, w: ops.argmax(e.logits, out=e.tokens, run_if=w), lambda e: e.tokens[1:]),
    "append": (lambda e, w: e.cache.append(1, e.k, e.v, rope=cupykv.Rope(), positions_out=e.appended, run_if=w),
               lambda e: e.appended.reshape(-1)[5:]),
    "write": (lambda e, w: e.cache.write(0, e.positions, e.k, e.v, positions_out=e.written, run_if=w),
              lambda e: e.written.reshape(-1)[:1]),
    "attention": (lambda e, w: cupykv.attention(e.q, e.cache, 1, out=e.attended, num_splits=2, run_if=w),
                  lambda e: e.attended.reshape(-1).view(np.int32)[:1]),
    "AttentionPlan.run": (lambda e, w: e.plan.run(e.q, 0, out=e.planned, run_if=w),
                          lambda e: e.planned.reshape(-1).view(np.int32)[:1]),
}
NAMES = list(CALLS)


def step(env, word):
    """Every call of CALLS once, each gated by ``word``: one decode step's worth of launches."""
    for call, _ in CALLS.values():
        call(env, word)


# -- one launch --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("name", NAMES)
def test_a_word_holding_zero_leaves_every_byte_as_it_was(backend, spec, name):
    env = Env(backend, spec)
    before = env.snapshot()
    CALLS[name][0](env, env.word(0))
    assert all(np.array_equal(a, b) for a, b in zip(before, env.snapshot())), f"{name} wrote while gated off"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [1, 7, -1])
def test_a_nonzero_word_gives_the_bytes_of_run_if_none(backend, spec, name, value):
    plain, gated = Env(backend, spec), Env(backend, spec)
    before = plain.snapshot()
    CALLS[name][0](plain, None)
    CALLS[name][0](gated, gated.word(value))
    ran, got = plain.snapshot(), gated.snapshot()
    assert any(not np.array_equal(a, b) for a, b in zip(before, ran)), f"{name} changed nothing: a vacuous test"
    assert all(np.array_equal(a, b) for a, b in zip(ran, got)), f"{name} with run_if=[{value}] differs from None"


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("name", NAMES)
def test_a_gated_off_launch_reads_its_word_and_touches_nothing_else(spec, name):
    env = Env("emulator", spec)
    word = env.word(0)
    with testing.traffic("emulator") as t:
        CALLS[name][0](env, word)
    (launch,) = t.launches
    loads = launch.of(word).counts("load")
    assert loads.touched_bytes == 4 and loads.bytes == loads.accesses * 4 > 0
    assert launch.total("load").touched_bytes == 4, launch.report()    # the word, and no other byte
    assert launch.total("store").bytes == launch.total("atomic").bytes == 0, launch.report()


@pytest.mark.parametrize("dtype, kernel", [("float16", "linear_mma"), ("float32", "linear")],
                         ids=["tensor-cores", "cuda-cores"])
def test_a_gated_off_linear_reads_no_weight_byte(dtype, kernel):
    env = Env("emulator", dataclasses.replace(SPEC, dtype=dtype, io_dtype=dtype))
    with testing.traffic("emulator") as t, recording_launches() as launched:
        ops.linear(env.x, env.weight, out=env.projected, run_if=env.word(0))
    with testing.traffic("emulator") as ran:
        ops.linear(env.x, env.weight, out=env.projected, run_if=env.word(1))
    assert [op for op, _ in launched] == [kernel]
    assert t.launches[0].of(env.weight).bytes_loaded == 0
    assert ran.launches[0].of(env.weight).bytes_loaded == env.weight.nbytes   # the same launch, not gated


# -- split-KV attention --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_split_attention_gated_off_then_on_still_merges(backend, spec):
    """A gated-off launch leaves the tile counters at 0, so the next launch's last block still merges."""
    plain, gated = Env(backend, spec), Env(backend, spec)
    assert plain.plan.num_splits == 3 and plain.plan.kernel.tensor_cores == (spec.head_dim == 64)
    before = gated.snapshot()
    off, on = gated.word(0), gated.word(1)
    for _ in range(2):
        gated.plan.run(gated.q, 0, out=gated.planned, run_if=off)
    assert all(np.array_equal(a, b) for a, b in zip(before, gated.snapshot()))
    gated.plan.run(gated.q, 0, out=gated.planned, run_if=on)
    plain.plan.run(plain.q, 0, out=plain.planned)
    counters = gated.backend.to_host(gated.plan._workspace.split_counters)
    assert not counters.any()
    assert np.array_equal(gated.backend.to_host(gated.planned).view(np.uint8),
                          plain.backend.to_host(plain.planned).view(np.uint8))
    assert not np.isnan(gated.backend.to_host(gated.planned).astype(np.float32)).any()


# -- graphs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_a_captured_step_follows_the_word_at_every_replay(backend, spec):
    env, twin = Env(backend, spec), Env(backend, spec)
    word = env.word(1)
    graph = cupykv.capture(step, env, word)     # the warm-up run is a step: the word holds 1
    step(twin, None)
    assert graph.num_launches == len(CALLS)
    for value in (0, 1, 0, 5):
        env.backend.upload(word, np.array([value], np.int32))
        env.poison()
        twin.poison()
        before = env.snapshot()
        graph.replay(2)
        for _ in range(2 if value else 0):
            step(twin, None)
        after = env.snapshot()
        same = all(np.array_equal(a, b) for a, b in zip(before, after))
        assert same == (value == 0), f"word {value}: the replays {'wrote' if same else 'wrote nothing'}"
        assert all(np.array_equal(a, b) for a, b in zip(twin.snapshot(), after)), f"after word {value}"


# -- outputs a call allocates --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_allocated_by_a_gated_off_call(backend):
    """New outputs hold zeros; new positions hold -1 (no row was written), as in the reference."""
    env = Env(backend)
    off = env.word(0)
    host = env.backend.to_host
    assert not host(ops.linear(env.x, env.weight, run_if=off)).astype(np.float32).any()
    assert not host(ops.argmax(env.logits, run_if=off)).any()
    assert not host(cupykv.attention(env.q, env.cache, 1, run_if=off)).astype(np.float32).any()
    for call in (lambda: env.cache.append(0, env.k, env.v, return_positions=True, run_if=off),
                 lambda: env.cache.write(0, env.positions, env.k, env.v, return_positions=True, run_if=off)):
        assert host(call()).tolist() == [[-1, -1, -1], [-1, -1, -1]]
    oracle = reference.KVCache(SPEC)
    k, v = (host(a) for a in (env.k, env.v))
    assert oracle.append(0, k, v, return_positions=True, run_if=np.zeros(1, np.int32)).tolist() == [[-1] * 3] * 2


# -- the reference ----------------------------------------------------------------------------------------
def test_the_reference_takes_the_same_word():
    rng = np.random.default_rng(1)
    shape = (SPEC.batch, 3, SPEC.n_kv_heads, SPEC.head_dim)
    k, v = testing.random_rows(rng, SPEC, shape), testing.random_rows(rng, SPEC, shape)
    positions = np.array([[4, 299, 300], [-1, 7, 8]], np.int32)
    calls = {"append": lambda c, **kw: c.append(1, k, v, rope=cupykv.Rope(), **kw),
             "write": lambda c, **kw: c.write(0, positions, k, v, **kw)}
    for name, call in calls.items():
        plain, gated = reference.KVCache(SPEC), reference.KVCache(SPEC)
        plain.advance(LENGTHS)
        gated.advance(LENGTHS)
        state = lambda c: [a.copy() for a in (c.k, c.v, c.lengths, c.overflow)]   # noqa: E731
        before = state(gated)
        out = np.full((2, 3), POISON_INT, np.int32)
        assert call(gated, positions_out=out, run_if=np.zeros(1, np.int32)) is out
        assert (out == POISON_INT).all(), name
        assert all(np.array_equal(a, b) for a, b in zip(before, state(gated))), name
        want = call(plain, return_positions=True)
        assert np.array_equal(call(gated, return_positions=True, run_if=np.array([3], np.int32)), want), name
        assert all(np.array_equal(a, b) for a, b in zip(state(plain), state(gated))), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fast_path_matches_the_reference_gated_off_and_on(backend):
    env = Env(backend)
    oracle = reference.KVCache(SPEC)
    testing.fill(env.cache, oracle, LENGTHS, np.random.default_rng(0))
    k, v, positions = (env.backend.to_host(a) for a in (env.k, env.v, env.positions))
    for value in (0, 1, 0):
        word, host_word = env.word(value), np.array([value], np.int32)
        got = env.cache.append(1, env.k, env.v, rope=cupykv.Rope(), return_positions=True, run_if=word)
        want = oracle.append(1, k, v, rope=cupykv.Rope(), return_positions=True, run_if=host_word)
        assert np.array_equal(env.backend.to_host(got), want)
        got = env.cache.write(0, env.positions, env.k, env.v, return_positions=True, run_if=word)
        want = oracle.write(0, positions, k, v, return_positions=True, run_if=host_word)
        assert np.array_equal(env.backend.to_host(got), want)
        testing.assert_matches_reference(env.cache, oracle, rope_used=True)


REFERENCE_BAD = [
    ("a list", [1], TypeError, r"^run_if: expected a numpy int32 array, got \[1\] \(list\)$"),
    ("int64", np.ones(1, np.int64), TypeError, r"^run_if: expected a numpy int32 array, got ndarray of dtype int64$"),
    ("shape (2,)", np.ones(2, np.int32), ValueError, r"^run_if: expected shape \(1,\), got \(2,\)$"),
]


@pytest.mark.parametrize("name, word, error, message", REFERENCE_BAD, ids=[case[0] for case in REFERENCE_BAD])
def test_the_reference_refuses_a_bad_word_and_changes_nothing(name, word, error, message):
    oracle = reference.KVCache(SPEC)
    rows = np.zeros((SPEC.batch, 1, SPEC.n_kv_heads, SPEC.head_dim), np.float16)
    with pytest.raises(error, match=message):
        oracle.append(0, rows, rows, run_if=word)
    out = np.zeros((SPEC.batch, 1), np.int32)
    with pytest.raises(ValueError, match=r"^run_if: expected an array that does not overlap positions_out"):
        oracle.write(0, [0, 1], rows, rows, positions_out=out, run_if=out[0])
    assert not oracle.k.any() and not oracle.overflow.any()


# -- bad words ------------------------------------------------------------------------------------------------
BAD_WORDS = [
    ("int64", lambda e, output: e.cache.to_device(np.ones(1, np.int64)), TypeError,
     r"^run_if: expected dtype int32, got int64$"),
    ("float32", lambda e, output: e.cache.to_device(np.ones(1, np.float32)), TypeError,
     r"^run_if: expected dtype int32, got float32$"),
    ("shape (2,)", lambda e, output: e.cache.to_device(np.ones(2, np.int32)), ValueError,
     r"^run_if: expected shape \(1,\), got \(2,\)$"),
    ("shape ()", lambda e, output: e.cache.to_device(np.ones(1, np.int32)).reshape(()), ValueError,
     r"^run_if: expected shape \(1,\), got \(\)$"),
    ("a host array", lambda e, output: np.ones(1, np.int32), TypeError, r"^run_if: expected a device array"),
    ("a Python list", lambda e, output: [1], TypeError, r"^run_if: expected a device array"),
    ("an output of the call", lambda e, output: output, ValueError,
     r"^run_if: expected an array that does not overlap (out|error_flag|positions_out), got one that shares 4 bytes"),
    ("the cache's lengths", lambda e, output: e.cache.lengths[1:], ValueError,
     r"^run_if: expected an array that does not overlap (the cache's|a KVCache's) lengths"),
    ("a plan's split counters", lambda e, output: e.plan._workspace.split_counters.view(np.int32)[:1], ValueError,
     r"^run_if: expected an array that does not overlap an AttentionPlan's attention plan workspace"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, make, error, message", BAD_WORDS, ids=[case[0] for case in BAD_WORDS])
@pytest.mark.parametrize("name", NAMES)
def test_a_bad_word_is_refused_before_any_launch(backend, name, bad, make, error, message):
    env = Env(backend)
    call, output = CALLS[name]
    word = make(env, output(env))
    before = env.snapshot()
    with recording_launches() as launched, pytest.raises(error, match=message):
        call(env, word)
    assert launched == []
    assert all(np.array_equal(a, b) for a, b in zip(before, env.snapshot()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_always_run_word_may_be_passed_but_not_written(backend):
    env = Env(backend)
    always = env.backend.always_run()
    assert always is env.backend.always_run() and env.backend.to_host(always).tolist() == [1]
    plain = Env(backend)
    CALLS["linear"][0](plain, None)
    CALLS["linear"][0](env, always)
    assert np.array_equal(plain.backend.to_host(plain.projected), env.backend.to_host(env.projected))
    one_row = env.cache.to_device(np.zeros((1, VOCAB), np.float16))
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap an \w+Backend's always-run word"):
        ops.argmax(one_row, out=always)
    assert env.backend.to_host(always).tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_always_run_word_is_made_outside_capture(backend):
    """First use inside a recorded step is refused with a message that says what to do; the warm-up run of
    capture() makes the word of the backend a step launches on, so a step never meets this."""
    env = Env(backend)
    fresh = type(env.backend)

    def recorded_step():
        env.cache.advance(0)
        fresh().always_run()     # a new backend at every run: its first use, at recording too

    with pytest.raises(CaptureError, match=r"^allocating the always-run word of device \d+ \(Backend\.always_run.*"
                                           r"inside a captured step: launch one op with run_if=None"):
        cupykv.capture(recorded_step)


def test_the_always_run_word_is_refused_under_a_graph_capture_cupykv_did_not_start():
    """On CuPy, a stream captured by the caller's own cupy.cuda.Graph: the upload would invalidate it."""
    from cupykv.backends.emulator_backend import EmulatorBackend

    class Capturing(EmulatorBackend):   # what the CuPy backend reports while its current stream captures
        def _stream_capturing(self):
            return True

    with pytest.raises(CaptureError, match=r"^allocating the always-run word of device 0 .* while the current "
                                           r"stream is being captured: launch one op with run_if=None"):
        Capturing().always_run()
