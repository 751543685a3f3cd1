"""Decoding loops on the device: N steps per replay give the tokens of one, and sequences stop on the device.

Each property compares a loop against plain decoding of the same tiny model
(one step per replay, no stop ids) with its list cut after the first stop
id: the loops must give exactly those tokens. The two bookkeeping kernels
are checked against NumPy statements of their rules, written here.
"""
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cupykv import testing
from cupykv.models import Llama, LlamaConfig
from cupykv.models import decoding
from backends import BACKENDS
from test_ops import read_only

TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
            vocab_size=40)
MAX_SEQ = 16
#: each example runs a tiny model a few times on the emulator
EXAMPLES = max(10, settings.default.max_examples // 10)   # each example decodes whole prompts on the emulator


@functools.lru_cache(maxsize=None)
def tiny(batch: int, backend: str = "emulator", seed: int = 0, max_seq: int = MAX_SEQ) -> Llama:
    return Llama.random(LlamaConfig(**TINY), seed=seed, max_seq=max_seq, batch=batch, backend=backend)


def cut(tokens, stops):
    """``tokens`` up to and including the first stop id."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


@st.composite
def runs(draw, max_batch=3, max_new=8):
    """(model, prompts, max_new_tokens): 1..batch prompts of different lengths that fit MAX_SEQ."""
    batch = draw(st.integers(1, max_batch))
    new = draw(st.integers(1, max_new))
    prompts = draw(st.lists(st.lists(st.integers(0, TINY["vocab_size"] - 1), min_size=1, max_size=MAX_SEQ - new),
                            min_size=1, max_size=batch))
    return tiny(batch), prompts, new


@settings(max_examples=EXAMPLES)
@given(run=runs(), n_steps=st.integers(1, 8), use_graph=st.booleans(), data=st.data())
def test_n_steps_per_replay_give_the_tokens_of_one(run, n_steps, use_graph, data):
    model, prompts, new = run
    plain = model.generate(prompts, new)
    # stop ids drawn from what plain decoding emits, so that sequences stop mid-replay
    emitted = sorted({t for row in plain for t in row})
    stops = data.draw(st.lists(st.sampled_from(emitted), max_size=2))
    tokens = model.generate(prompts, new, tokens_per_replay=n_steps, eos_token_id=stops, use_graph=use_graph)
    assert tokens == [cut(row, stops) for row in plain]
    # a stopped sequence's length is frozen: the prompt and every token but the last are committed
    lengths = model.cache.lengths_host()
    assert [lengths[b] for b in range(len(prompts))] == [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
    model.cache.check()
    assert model.next_tokens()[: len(prompts)] == [t[-1] for t in tokens]   # a stopped sequence's ids are frozen
    stats = model.stats
    assert stats.steps == stats.replays * n_steps and stats.tokens == sum(map(len, tokens))
    assert stats.replays == -(-(max(map(len, tokens)) - 1) // n_steps)   # no replay once all have stopped


def test_stopped_sequences_write_no_row_past_their_last_token():
    """The cache is poisoned with NaN; after decoding, only rows up to each sequence's last token changed."""
    model = tiny(3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    plain = model.generate(prompts, 8)
    stops = [plain[0][1], plain[2][4]]
    spec = model.cache.spec
    for buffer in (model.cache.k, model.cache.v):
        model.backend.upload(buffer, np.full(spec.shape, np.nan, np.float32))
    tokens = model.generate(prompts, 8, eos_token_id=stops, tokens_per_replay=5)
    assert tokens == [cut(row, stops) for row in plain]
    lengths = model.cache.lengths_host()
    assert lengths.tolist() == [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
    for buffer in (model.cache.k, model.cache.v):
        host = model.backend.to_host(buffer)                         # [layers, batch, max_seq, n_kv, head_dim]
        for b, length in enumerate(lengths):
            assert not np.isnan(host[:, b, :max(length, 3)]).any()    # live rows (and the padded prefill's)
            # the last token's pending row at `length`: written by the steps after the sequence stopped while
            # another still decoded, not by steps after every sequence stopped (they exit at entry)
            if length >= 3:                                            # past the padded prefill: all or nothing
                pending = np.isnan(host[:, b, length])
                assert pending.all() or not pending.any()
            assert np.isnan(host[:, b, max(length + 1, 3):]).all()    # nothing past them
    model.cache.check()


def test_logits_and_streaming_match_one_step_per_replay():
    model = tiny(2)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    plain, plain_logits = model.generate(prompts, 7, return_logits=True)
    stops = [plain[1][2]]
    seen, progress = [], []
    tokens, logits = model.generate(prompts, 7, return_logits=True, tokens_per_replay=4, stop_ids=stops,
                                    on_token=seen.append, progress=lambda done, total: progress.append((done, total)))
    assert tokens == [plain[0], cut(plain[1], stops)]
    assert logits.shape == plain_logits.shape
    assert np.array_equal(logits[:, 0], plain_logits[:, 0])           # the same kernels on the same inputs: bitwise
    assert np.array_equal(logits[:3, 1], plain_logits[:3, 1]) and not logits[3:, 1].any()   # zeros past the stop
    assert [step[0] for step in seen] == tokens[0]
    assert [step[1] for step in seen] == tokens[1] + [None] * (len(tokens[0]) - len(tokens[1]))
    assert progress == [(i, 7) for i in range(1, 8)]


def test_each_logits_row_is_that_of_the_token_emitted_there_id_0_included():
    # greedy: row i of a prompt's logits has the prompt's token i as its argmax. Sequence 1 emits id 0
    # as its third token: the loop marks a stopped sequence's steps with -1, and 0 is a token, whose
    # logits row must be kept like any other (dropping it shifts every later row by one).
    model = tiny(2)
    prompts = [[28, 35, 2], [21, 14, 26, 22, 10]]
    for tokens_per_replay in (1, 4):
        tokens, logits = model.generate(prompts, 7, return_logits=True, tokens_per_replay=tokens_per_replay)
        assert tokens[1][2] == 0 and logits.shape == (7, 2, TINY["vocab_size"])
        for b in range(2):
            assert logits[:, b].argmax(axis=-1).tolist() == tokens[b], (tokens_per_replay, b)


def test_max_new_tokens_and_capacity_stop_on_the_device():
    model = tiny(2)
    prompts = [[1] * 10, [2] * 4]
    plain = model.generate(prompts, MAX_SEQ - 10)                       # the fullest call generate accepts
    assert model.cache.lengths_host().tolist()[0] == MAX_SEQ - 1
    model.cache.check()
    # past what generate accepts, capacity stops the first sequence on the device, at a full cache
    padded = [list(p) for p in prompts]
    model._prefill(padded)
    loop = decoding.GreedyLoop(model, 4)
    tokens, _, _ = decoding.decode(model, loop, padded, 2, 12, [], use_graph=True, return_logits=False)
    assert tokens[0] == plain[0] and len(tokens[1]) == 12
    assert model.cache.lengths_host().tolist() == [MAX_SEQ - 1, 4 + 11]
    model.cache.check()
    # a prompt of MAX_SEQ - 1 tokens has room for no pending row past its first token: it never
    # decodes, while the other sequence does
    padded = [[1] * (MAX_SEQ - 1), [2] * 4]
    model._prefill(padded)
    tokens, _, stats = decoding.decode(model, decoding.GreedyLoop(model, 4), padded, 2, 12, [], use_graph=False,
                                       return_logits=False)
    assert [len(t) for t in tokens] == [1, 12] and stats.replays == 3
    assert model.cache.lengths_host().tolist() == [MAX_SEQ - 1, 4 + 11]
    model.cache.check()
    # the longest prompt generate accepts with 2 new tokens still decodes its second one on the device
    tokens = model.generate([[3] * (MAX_SEQ - 2)], 2)
    assert len(tokens[0]) == 2 and model.cache.lengths_host().tolist()[0] == MAX_SEQ - 1
    model.cache.check()


@pytest.mark.parametrize("tokens_per_replay", [1, 3])
def test_a_stop_state_that_never_clears_fails_instead_of_looping(monkeypatch, tokens_per_replay):
    """The host loop reads the device's stop state once a pass. Were it never to clear (a broken
    decode_commit), the loop would replay forever; every pass emits a token of each decoding sequence,
    so a pass past max_new_tokens - 1 is an error naming the sequences."""
    model = tiny(2)
    monkeypatch.setattr(decoding.StopState, "active_host", lambda self: np.ones(self.active.shape[0], bool))
    with pytest.raises(RuntimeError, match=r"sequences \[0, 1\] still decode after 4 passes, the most "
                                           r"max_new_tokens=5 allows .* stop state is broken"):
        model.generate([[1, 2], [3]], 5, tokens_per_replay=tokens_per_replay)


def test_a_budget_the_device_does_not_keep_fails(monkeypatch):
    """A device that emits past a sequence's budget (here: budgets 3 larger than max_new_tokens allows)
    is refused after the pass that shows it, naming the prompts and their counts, rather than
    returning more tokens than asked for."""
    model = tiny(2)
    start = decoding.StopState.start
    monkeypatch.setattr(decoding.StopState, "start", lambda self, budgets, stops, active:
                        start(self, [n + 3 for n in budgets], stops, active))
    with pytest.raises(RuntimeError, match=r"prompts \[0, 1\] emitted \[5, 5\] tokens, past "
                                           r"max_new_tokens=3: the device's budget was not kept"):
        model.generate([[1, 2], [3]], 3, tokens_per_replay=4)
    monkeypatch.undo()
    assert list(map(len, model.generate([[1, 2], [3]], 3, tokens_per_replay=4))) == [3, 3]   # the real budget holds


def test_the_four_most_recent_loop_shapes_keep_their_graphs():
    model = Llama.random(LlamaConfig(**TINY), seed=0, max_seq=MAX_SEQ, batch=1, backend="emulator")
    for n in (1, 2, 3, 4, 5):
        model.generate([[1, 2]], 3, tokens_per_replay=n)
    assert list(model._loops) == [("greedy", n) for n in (2, 3, 4, 5)]   # the least recently used went
    graph = model._loops[("greedy", 2)].graph
    model.generate([[1, 2]], 3, tokens_per_replay=2)          # replayed, not captured again; now the newest
    assert model._loops[("greedy", 2)].graph is graph and list(model._loops)[-1] == ("greedy", 2)
    model.generate([[1, 2]], 3, tokens_per_replay=6)
    assert list(model._loops) == [("greedy", n) for n in (4, 5, 2, 6)]


def test_a_replay_of_n_steps_launches_n_decode_steps():
    model = tiny(1)
    model.generate([[1, 2]], 3)
    one = model._graph.num_launches
    layers = model.config.num_hidden_layers
    assert one == 14 * layers + 6                                       # decode_step, then decode_commit
    model.generate([[1, 2]], 3, tokens_per_replay=5)
    assert model._graph.num_launches == 5 * one


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_and_eager_loops_agree(backend):
    model = tiny(3, backend)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12]]
    eager = model.generate(prompts, 6, use_graph=False, tokens_per_replay=3, eos_token_id=11)
    assert model.generate(prompts, 6, tokens_per_replay=3, eos_token_id=11) == eager


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(tokens_per_replay=0), ValueError, r"^tokens_per_replay: expected an int in 1\.\.1024, got 0$"),
    (dict(tokens_per_replay=2.0), TypeError, r"^tokens_per_replay: expected an int in 1\.\.1024, got 2\.0 \(float\)$"),
    (dict(eos_token_id=40), ValueError, r"^eos_token_id: expected token ids in 0\.\.39, got 40$"),
    (dict(eos_token_id=[1, -1]), ValueError, r"^eos_token_id: expected token ids in 0\.\.39, got \[1, -1\]$"),
    (dict(on_token=5), TypeError, r"^on_token: expected None or a callable, got 5 \(int\)$"),
])
def test_bad_loop_arguments_are_named_before_anything_runs(kwargs, error, message):
    model = tiny(2)
    model.cache.reset()
    with pytest.raises(error, match=message):
        model.generate([[1, 2]], 3, **kwargs)
    assert model.cache.lengths_host().tolist() == [0, 0]


def test_more_stop_ids_than_the_device_list_holds_are_refused():
    model = Llama.random(LlamaConfig(**dict(TINY, vocab_size=100)), max_seq=8, backend="emulator")
    with pytest.raises(ValueError, match=r"^stop_ids: expected at most 64 distinct stop ids .*got 65$"):
        model.generate([[1]], 2, stop_ids=list(range(30)), eos_token_id=list(range(30, 65)))
    # a full list of 64 is taken, and its last id stops a sequence like any other
    plain = model.generate([[1]], 7)[0]
    last = plain[1]
    others = [t for t in range(100) if t not in plain][:63]
    tokens = model.generate([[1]], 7, stop_ids=others[:30], eos_token_id=others[30:] + [last])[0]
    assert tokens == plain[:2]


# -- the bookkeeping kernels against NumPy statements of their rules ---------------------------
def commit_rule(ids, active, budget, next_ids, lengths, stops, max_length):
    """NumPy decode_commit: returns (ids, tokens, advance_by, active, budget)."""
    ids, active, budget = ids.copy(), active.copy(), budget.copy()
    tokens = np.full_like(ids, -1)
    advance_by = active.copy()
    live = active == 1
    ids[live] = tokens[live] = next_ids[live]
    budget[live] -= 1
    stopped = (budget <= 0) | (lengths + 1 >= max_length) | np.isin(next_ids, stops)
    active[live & stopped] = 0
    return ids, tokens, advance_by, active, budget


#: what follows the stop ids in the device list: nothing (the last entry is a stop id), or -1 (which
#: ends the list, so the 5 after it is not a stop id).
STOP_PADDINGS = ([], [-1], [-1, 5])


@settings(max_examples=EXAMPLES)
@given(data=st.data(), batch=st.integers(1, 300))
def test_decode_commit_follows_its_rule(data, batch):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    stops = data.draw(st.lists(st.integers(0, 9), max_size=4))
    device_stops = (stops + data.draw(st.sampled_from(STOP_PADDINGS))) or [-1]   # unpadded: a stop id ends the list
    assert_decode_commit_follows_its_rule(rng, batch, stops, device_stops, data.draw(st.integers(0, 14)))


def test_decode_commit_reaches_the_last_sequence_of_a_partial_block():
    """One thread per sequence in blocks of 256: batch 257 puts sequence 256 alone in a second block."""
    assert_decode_commit_follows_its_rule(np.random.default_rng(7), 257, [0, 3], [0, 3, -1], 9)   # id 0 stops


def assert_decode_commit_follows_its_rule(rng, batch, stops, device_stops, max_length):
    model = tiny(1)
    ints = lambda lo, hi: rng.integers(lo, hi, batch).astype(np.int32)   # noqa: E731
    ids, active, budget, next_ids, lengths = ints(0, 9), ints(0, 2), ints(0, 4), ints(0, 9), ints(0, 12)
    active[-1] = 1   # the last sequence takes part: its ids, tokens, budget and advance_by are written
    n_active = np.array([active.sum() + 1000], np.int32)   # any count: the kernel subtracts the stops
    device = [model.backend.asarray(a) for a in (ids, np.zeros_like(ids), np.zeros_like(ids), active, budget,
                                                 next_ids, lengths, np.array(device_stops, np.int32), n_active)]
    decoding.decode_commit(*device, max_length=max_length)
    got = [model.backend.to_host(a) for a in device[:5]]
    want = commit_rule(ids, active, budget, next_ids, lengths, stops, max_length)
    for name, g, w in zip(("ids", "tokens", "advance_by", "active", "budget"), got, want):
        assert np.array_equal(g, w), name
    stopped_now = int(((active == 1) & (want[3] == 0)).sum())
    assert model.backend.to_host(device[8])[0] == n_active[0] - stopped_now   # one decrement per stop


def test_decode_commit_stops_on_the_last_entry_of_an_unpadded_stop_list():
    """n_stop counts every entry: with no -1 padding, the last entry is a stop id like the others."""
    model = tiny(1)
    device = [model.backend.asarray(np.array(values, np.int32)) for values in
              ([0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1], [5, 5, 5], [3, 7, 5], [1, 1, 1], [3, 7], [3])]
    decoding.decode_commit(*device, max_length=10)
    assert model.backend.to_host(device[3]).tolist() == [0, 0, 1]     # active: 3 and 7 stop, 5 goes on
    assert model.backend.to_host(device[1]).tolist() == [3, 7, 5]     # tokens
    assert model.backend.to_host(device[8]).tolist() == [1]           # n_active: one decrement per stop


def test_decode_commit_arguments_are_named():
    model = tiny(1)
    a = model.backend.zeros((2,), np.int32)
    b, c, d, e, f, g, h = (model.backend.zeros((2,), np.int32) for _ in range(7))
    n = model.backend.zeros((1,), np.int32)
    with pytest.raises(ValueError, match=r"^tokens: expected shape \(2,\), got \(3,\)$"):
        decoding.decode_commit(a, model.backend.zeros((3,), np.int32), b, c, d, e, f, g, n, max_length=4)
    with pytest.raises(ValueError, match=r"^ids: expected an array that does not overlap active"):
        decoding.decode_commit(a, b, c, a, d, e, f, g, n, max_length=4)
    with pytest.raises(TypeError, match=r"^lengths: expected dtype int32, got float32$"):
        decoding.decode_commit(a, b, c, d, e, f, model.backend.zeros((2,), np.float32), g, n, max_length=4)
    with pytest.raises(ValueError, match=r"^n_active: expected shape \(1,\), got \(2,\)$"):
        decoding.decode_commit(a, b, c, d, e, f, g, h, a, max_length=4)
    with pytest.raises(ValueError, match=r"^max_length: expected an int in 0\.\.2147483647, got -1$"):
        decoding.decode_commit(a, b, c, d, e, f, g, h, n, max_length=-1)
    frozen, frozen_word = read_only(model.backend.zeros((2,), np.int32)), read_only(model.backend.zeros((1,), np.int32))
    with pytest.raises(ValueError, match=r"^budget: expected a writeable array, got a read-only one"):
        decoding.decode_commit(a, b, c, d, frozen, f, g, h, n, max_length=4)
    with pytest.raises(ValueError, match=r"^n_active: expected a writeable array, got a read-only one"):
        decoding.decode_commit(a, b, c, d, e, f, g, h, frozen_word, max_length=4)


# -- replays of multi-step graphs interleaved with truncate, reset and new budgets -----------------
@functools.lru_cache(maxsize=None)
def greedy_next(history: tuple) -> int:
    """The greedy token after ``history``, from a prefill of all of it (rows are computed alike at any q_len)."""
    oracle = tiny(1, seed=0)
    oracle._prefill([list(history)])
    return oracle.next_tokens()[0]


class LoopMachine(RuleBasedStateMachine):
    """One model (batch 2) decoding through captured N-step graphs while its cache is rolled back and reset.

    Per slot the host keeps the token history (prompt and new tokens; every token but the last is
    committed), the budget and whether it still decodes. Each replay must emit exactly the greedy
    continuation of every live slot, stop slots whose budget runs out or whose cache is full, and leave
    the device lengths at ``len(history) - 1`` with no overflow flag.
    """

    @initialize(n_steps=st.sampled_from([1, 2, 4]),
                prompts=st.lists(st.lists(st.integers(0, 39), min_size=1, max_size=6), min_size=2, max_size=2),
                budgets=st.lists(st.integers(0, 12), min_size=2, max_size=2))
    def start(self, n_steps, prompts, budgets):
        self.model = model = tiny(2)
        self.loop = model._loop(("greedy", n_steps), lambda: decoding.GreedyLoop(model, n_steps))
        model._prefill(prompts)
        self.history = [p + [t] for p, t in zip(prompts, model.next_tokens())]
        self.refill(budgets)

    @rule(budgets=st.lists(st.integers(0, 12), min_size=2, max_size=2))
    def refill(self, budgets):
        self.budget = list(budgets)
        self.active = [n > 0 and len(h) - 1 + 1 <= self.loop.max_length for n, h in zip(budgets, self.history)]
        self.loop.state.start(self.budget, [], self.active)

    @rule()
    def replay(self):
        decoding.run_pass(self.model, self.loop, use_graph=True)
        got = self.model.backend.to_host(self.loop.tokens)          # [n_steps, batch]
        for step in range(self.loop.n_steps):
            for b, history in enumerate(self.history):
                if not self.active[b]:
                    assert got[step, b] == -1
                    continue
                assert got[step, b] == greedy_next(tuple(history))
                history.append(int(got[step, b]))
                self.budget[b] -= 1
                self.active[b] = self.budget[b] > 0 and len(history) < self.loop.max_length + 1

    @rule(slot=st.integers(0, 1), fraction=st.floats(0, 1))
    def truncate(self, slot, fraction):
        keep = int(fraction * (len(self.history[slot]) - 1))         # committed rows to keep
        self.history[slot] = self.history[slot][: keep + 1]
        lengths = [len(h) - 1 for h in self.history]
        self.model.cache.truncate(self.model.cache.to_device(np.array(lengths, np.int32)))
        self.model.feed([h[-1] for h in self.history])              # the last token is embedded next

    @rule(slot=st.integers(0, 1))
    def reset(self, slot):
        self.model.cache.reset([slot])
        self.history[slot] = self.history[slot][-1:]                 # decoding goes on from its last token alone

    @invariant()
    def lengths_and_flags_follow_the_history(self):
        if not hasattr(self, "history"):
            return
        assert self.model.cache.lengths_host().tolist() == [len(h) - 1 for h in self.history]
        assert self.model.backend.to_host(self.loop.state.active).tolist() == [int(a) for a in self.active]
        self.model.cache.check()


TestLoopMachine = LoopMachine.TestCase
TestLoopMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=10, deadline=None)


# -- the rest of a replay after the last sequence stopped does no work ------------------------------
@pytest.mark.parametrize("use_graph", [False, True])
def test_steps_after_every_sequence_stopped_exit_at_entry(use_graph):
    model, steps = tiny(2), 6
    layers = TINY["num_hidden_layers"]
    prompts = [[1, 2, 3], [4]]
    model.generate(prompts, 2, tokens_per_replay=steps, use_graph=use_graph)   # warm-up: the graph exists
    with testing.traffic(model.cache) as counted:
        tokens = model.generate(prompts, 2, tokens_per_replay=steps, use_graph=use_graph)
    assert [len(row) for row in tokens] == [2, 2]              # both sequences stop after their second token
    per_step = 7 * layers + 1                                   # q, k, v, o, gate, up, down per layer; the head
    linears = [launch.total("load").touched_bytes for launch in counted.launches
               if launch.kernel.startswith("cupykv_linear")]   # distinct bytes loaded
    assert len(linears) >= steps * per_step
    by_step = [linears[len(linears) - (steps - i) * per_step:][:per_step] for i in range(steps)]   # the replay's
    live = [min(loads) > 64 for loads in by_step]               # a live step reads every weight matrix
    idle = [max(loads) <= 4 for loads in by_step]               # an idle one reads the 4-byte run_if word only
    first_idle = live.index(False)
    assert first_idle >= 1 and all(idle[first_idle:]) and all(live[:first_idle]), (live, idle)
    assert steps - first_idle >= 4                              # most of the replay did no work
    attention = [launch.total("load").touched_bytes for launch in counted.launches
                 if launch.kernel.startswith("cupykv_attention")]
    assert all(loads <= 4 for loads in attention[len(attention) - (steps - first_idle) * layers:])
    assert model.cache.check() is None                          # no overflow either
