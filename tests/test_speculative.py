"""Greedy speculative decoding gives exactly the target's greedy tokens, with the whole cycle in one graph.

Drafts range from the target's own weights (every proposal accepted) through
noisy copies (some accepted) to an unrelated smaller model (almost none), so
the accept kernel sees every prefix length 0..k. The accept kernel is also
checked against a NumPy statement of its rule, written here.
"""
import functools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupykv.models import Llama, LlamaConfig
from cupykv.models import decoding
from backends import BACKENDS
from test_ops import read_only

TARGET = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
              vocab_size=40)
SMALL = dict(TARGET, num_hidden_layers=1, intermediate_size=16)
MAX_SEQ = 24          # longest prompt 5 + max_new_tokens 8 + k 8 fits, with room to spare
#: each example runs two tiny models a few times on the emulator
EXAMPLES = max(10, settings.default.max_examples // 10)   # each example decodes whole prompts on the emulator
NOISES = (0.0, 0.03, 0.1, None)   # draft weights: the target's plus this much noise, or (None) unrelated


@functools.lru_cache(maxsize=None)
def target(batch: int, seed: int = 0, backend: str = "emulator") -> Llama:
    return Llama.random(LlamaConfig(**TARGET), seed=seed, max_seq=MAX_SEQ, batch=batch, backend=backend)


@functools.lru_cache(maxsize=None)
def draft(batch: int, seed: int, noise, backend: str = "emulator") -> Llama:
    if noise is None:
        return Llama.random(LlamaConfig(**SMALL), seed=seed + 100, max_seq=MAX_SEQ, batch=batch, backend=backend)
    config = LlamaConfig(**TARGET)
    rng = np.random.default_rng(seed)
    weights = {name: w + noise * w.std() * rng.standard_normal(w.shape).astype(w.dtype) if w.ndim == 2 else w
               for name, w in config.random_weights(seed).items()}
    return Llama(config, weights, max_seq=MAX_SEQ, batch=batch, backend=backend)


def cut(tokens, stops):
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


@settings(max_examples=EXAMPLES)
@given(batch=st.integers(1, 4), seed=st.integers(0, 2), noise=st.sampled_from(NOISES), k=st.integers(1, 8),
       new=st.integers(1, 8), use_graph=st.booleans(), data=st.data())
def test_speculative_decoding_gives_the_targets_greedy_tokens(batch, seed, noise, k, new, use_graph, data):
    model, helper = target(batch, seed), draft(batch, seed, noise)
    prompts = data.draw(st.lists(st.lists(st.integers(0, TARGET["vocab_size"] - 1), min_size=1, max_size=5),
                                 min_size=1, max_size=batch))
    plain = model.generate(prompts, new)
    stops = data.draw(st.lists(st.sampled_from(sorted({t for row in plain for t in row})), max_size=2))
    tokens = model.generate(prompts, new, draft=helper, num_speculative=k, eos_token_id=stops, use_graph=use_graph)
    assert tokens == [cut(row, stops) for row in plain]
    # both caches hold the prompt and every token but the last (the draft one row less); nothing overflowed
    want = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
    assert model.cache.lengths_host()[: len(prompts)].tolist() == want
    assert helper.cache.lengths_host()[: len(prompts)].tolist() == [n - 1 for n in want]
    model.cache.check()
    helper.cache.check()
    assert model.next_tokens()[: len(prompts)] == [t[-1] for t in tokens]
    stats = model.stats
    assert stats.proposed == k * stats.cycles and 0 <= stats.accepted <= stats.proposed
    assert stats.cycle_tokens == sum(map(len, tokens)) - len(prompts)
    if noise == 0.0 and not stops:     # the target's own weights: every proposal is accepted
        assert stats.acceptance_rate == 1.0 or stats.cycles == 0


def test_a_stop_state_that_never_clears_fails_instead_of_cycling(monkeypatch):
    """As for the greedy loop (test_decode_loops.py): each cycle emits a token of every decoding
    sequence, so a cycle past max_new_tokens - 1 with the device's stop state still set is an error."""
    model, same = target(2), draft(2, 0, 0.0)
    monkeypatch.setattr(decoding.StopState, "active_host", lambda self: np.ones(self.active.shape[0], bool))
    with pytest.raises(RuntimeError, match=r"still decode after 5 passes, the most max_new_tokens=6 allows"):
        model.generate([[1, 2, 3], [4]], 6, draft=same, num_speculative=3)


def test_acceptance_rate_and_tokens_per_cycle():
    model, same = target(2), draft(2, 0, 0.0)
    tokens = model.generate([[1, 2, 3], [4]], 9, draft=same, num_speculative=3)   # 8 tokens after the prefill's
    assert tokens == model.generate([[1, 2, 3], [4]], 9)
    model.generate([[1, 2, 3], [4]], 9, draft=same, num_speculative=3)
    stats = model.stats
    # two passes of one cycle each; in each, both sequences proposed 3 tokens and all were accepted
    assert (stats.replays, stats.steps, stats.cycles, stats.proposed, stats.accepted) == (2, 2, 4, 12, 12)
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_cycle == 4.0
    unrelated = draft(2, 0, None)
    model.generate([[1, 2, 3], [4]], 9, draft=unrelated, num_speculative=3)
    assert 1.0 <= model.stats.tokens_per_cycle < 4.0 and model.stats.acceptance_rate < 1.0


def test_a_stopped_sequence_counts_in_no_cycle_of_the_stats():
    # Sequence 0's first token (39, from the prefill) is a stop id; sequence 1 never emits it and runs
    # two fully accepted cycles (the draft has the target's weights). The stopped sequence's accept
    # kernel writes accepted = -1 in each cycle, which the stats must leave out.
    model, same = target(2), draft(2, 0, 0.0)
    plain = model.generate([[1, 2, 3], [4]], 9)
    stop = plain[0][0]
    assert stop not in plain[1]
    tokens = model.generate([[1, 2, 3], [4]], 9, draft=same, num_speculative=3, stop_ids=[stop])
    assert tokens == [[stop], plain[1]]
    stats = model.stats
    assert (stats.replays, stats.steps, stats.cycles, stats.proposed, stats.accepted) == (2, 2, 2, 6, 6)
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_cycle == 4.0


@pytest.mark.parametrize("target_rows, draft_rows, max_length", [(24, 18, 15), (18, 24, 14)],
                         ids=["the draft binds", "the target binds"])
def test_capacity_stops_a_speculative_sequence_where_both_caches_rows_still_fit(target_rows, draft_rows,
                                                                                max_length):
    # With k = 3, max_length = min(target rows - 3 - 1, draft rows - 3): 15 when the draft holds 18
    # rows and the target 24, 14 the other way round. With budgets past what generate accepts,
    # sequence 0 (10 prompt tokens) stops at that committed length on the device; sequence 1 keeps
    # cycling, and each later cycle rewrites sequence 0's pending rows up to the last row of the cache
    # that binds (target: 14 + 3 + 1 - 1 = 17, its verify pass writes k + 1 rows; draft: 15 + 3 - 1 = 17),
    # and never past it.
    config = LlamaConfig(**TARGET)
    model = Llama(config, config.random_weights(0), max_seq=target_rows, batch=2, backend="emulator")
    helper = Llama(config, config.random_weights(0), max_seq=draft_rows, batch=2, backend="emulator")
    prompts = [list(range(1, 11)), [4]]
    plain = [model.generate([prompt], target_rows - len(prompt))[0] for prompt in prompts]
    padded = [list(p) for p in prompts]
    model._prefill(padded)
    helper._prefill(padded)
    loop = decoding.SpeculativeLoop(model, helper, 3)
    assert loop.max_length == max_length
    tokens, _, _ = decoding.decode(model, loop, padded, 2, 30, [], use_graph=True, return_logits=False)
    # committed = prompt + tokens - 1 = max_length
    assert [len(t) for t in tokens] == [max_length - 10 + 1, max_length - 1 + 1]
    assert tokens == [plain[0][: len(tokens[0])], plain[1][: len(tokens[1])]]
    assert model.cache.lengths_host().tolist() == [max_length] * 2
    assert helper.cache.lengths_host().tolist() == [max_length - 1] * 2
    model.cache.check()
    helper.cache.check()


def test_logits_and_streaming_match_plain_decoding():
    model, helper = target(2), draft(2, 0, 0.03)
    prompts = [[5, 6, 7, 8], [9]]
    plain, plain_logits = model.generate(prompts, 8, return_logits=True)
    seen = []
    tokens, logits = model.generate(prompts, 8, draft=helper, num_speculative=4, return_logits=True,
                                    on_token=seen.append)
    assert tokens == plain
    assert np.array_equal(logits, plain_logits)      # verify rows are the decode step's rows, bit for bit
    for b in range(2):
        assert [step[b] for step in seen if step[b] is not None] == tokens[b]


def test_one_graph_per_cycle():
    model, helper = target(1), draft(1, 0, None)
    model.generate([[1, 2]], 6, draft=helper, num_speculative=3)
    layers, draft_layers = model.config.num_hidden_layers, helper.config.num_hidden_layers
    # k draft forwards (with head and advance), two gathers, the verify forward, accept and two truncates
    assert model._graph.num_launches == 3 * (14 * draft_layers + 5) + 2 + (14 * layers + 5) + 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_and_eager_cycles_agree(backend):
    model, helper = target(3, 1, backend), draft(3, 1, 0.03, backend)
    prompts = [[1], [2, 3, 4, 5, 6], [7, 8]]
    eager = model.generate(prompts, 8, draft=helper, num_speculative=2, use_graph=False, stop_ids=[11])
    assert model.generate(prompts, 8, draft=helper, num_speculative=2, stop_ids=[11]) == eager
    assert eager == [cut(row, [11]) for row in model.generate(prompts, 8)]


def test_bad_draft_arguments_are_named_before_anything_runs():
    model = target(2)
    model.cache.reset()
    cases = [
        (dict(num_speculative=2), ValueError, r"^num_speculative: expected None without a draft, got 2$"),
        (dict(draft="small"), TypeError, r"^draft: expected None or a Llama, got str$"),
        (dict(draft=model), ValueError, r"^draft: expected another Llama with its own cache"),
        (dict(draft=draft(1, 0, None)), ValueError, r"^draft: expected a Llama with batch=2 \(this model's\), got batch=1$"),
        (dict(draft=Llama.random(LlamaConfig(**dict(SMALL, vocab_size=41)), max_seq=MAX_SEQ, batch=2,
                                 backend="emulator")),
         ValueError, r"^draft: expected a Llama with vocab_size=40 \(this model's\), got vocab_size=41$"),
        (dict(draft=draft(2, 0, None), num_speculative=0), ValueError,
         r"^num_speculative: expected an int in 1\.\.64, got 0$"),
        (dict(draft=draft(2, 0, None), tokens_per_replay=2), ValueError,
         r"^tokens_per_replay: expected an int in 1\.\.1, got 2$"),
        (dict(draft=draft(2, 0, None), num_speculative=8), ValueError,
         r"^prompts\[0\]: expected len\(prompt\) \+ max_new_tokens \+ num_speculative <= max_seq=24, got 10 \+ 8 \+ 8$"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model.generate([[1] * 10], 8, **kwargs)
        assert model.cache.lengths_host().tolist() == [0, 0]


def test_the_draft_needs_one_row_less_than_the_target():
    model = target(1)
    short = Llama.random(LlamaConfig(**SMALL), max_seq=12, batch=1, backend="emulator")
    assert len(model.generate([[1] * 4], 6, draft=short, num_speculative=3)[0]) == 6    # 4 + 6 + 3 <= 12 + 1
    with pytest.raises(ValueError, match=r"^prompts\[0\]: expected len\(prompt\) \+ max_new_tokens \+ "
                                         r"num_speculative <= the draft's max_seq \+ 1=13, got 4 \+ 7 \+ 3$"):
        model.generate([[1] * 4], 7, draft=short, num_speculative=3)


def test_self_speculative_drafts_from_the_first_layers():
    model = Llama.random(LlamaConfig(**dict(TARGET, num_hidden_layers=3)), seed=5, max_seq=MAX_SEQ, batch=2,
                         backend="emulator")
    prompts = [[1, 2, 3], [4]]
    plain = model.generate(prompts, 9)
    for n_layers in (1, 2, 3):
        head = model.first_layers(n_layers)
        assert head.config.num_hidden_layers == n_layers and head.cache is not model.cache
        assert all(head.weights[name] is model.weights[name] for name in head.weights)   # shared, not copied
        assert model.generate(prompts, 9, draft=head, num_speculative=3) == plain
    assert model.stats.acceptance_rate == 1.0                # all layers: the draft is the target
    with pytest.raises(ValueError, match=r"^n_layers: expected an int in 1\.\.3, got 4$"):
        model.first_layers(4)


@pytest.mark.gpu
@pytest.mark.slow
def test_smollm2_self_speculative_text_is_plain_greedy_text():
    """SmolLM2-135M drafting for itself from its first 8 layers (unsplit attention: max_seq < 512)."""
    from cupykv.models.generate import find_model_file
    from cupykv.models.gguf import read_gguf
    from cupykv.models.tokenizer import Tokenizer
    try:
        checkpoint = read_gguf(find_model_file("smollm2"))
    except ValueError as missing:
        pytest.skip(str(missing))
    tokenizer = Tokenizer.from_gguf(checkpoint.metadata)
    model = Llama.from_gguf(checkpoint, dtype="bfloat16", max_seq=128, batch=2, backend="cupy")
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "Water boils at a temperature of")]
    plain = model.generate(prompts, 48, stop_ids=tokenizer.stop_ids)
    for k in (2, 4):
        tokens = model.generate(prompts, 48, draft=model.first_layers(8), num_speculative=k,
                                stop_ids=tokenizer.stop_ids)
        assert [tokenizer.decode(t) for t in tokens] == [tokenizer.decode(t) for t in plain]
        assert tokens == plain and model.stats.cycles > 0


# -- the accept kernel against a NumPy statement of its rule ----------------------------------
def accept_rule(active, budget, verify_ids, target_ids, lengths, stops, max_length):
    """NumPy speculative_accept: (tokens, accepted, target_lengths, draft_lengths, chain, pair, active, budget)."""
    batch, width = verify_ids.shape
    k = width - 1
    tokens = np.full((batch, width), -1, np.int32)
    accepted = np.full(batch, -1, np.int32)
    base = lengths - width
    new_lengths = base.copy()
    chain, pair = np.zeros(batch, np.int32), np.zeros((batch, 2), np.int32)   # left as they were where inactive
    active, budget = active.copy(), budget.copy()
    for b in range(batch):
        if not active[b]:
            continue
        n = 0
        while n < k and verify_ids[b, n + 1] == target_ids[b, n]:
            n += 1
        accepted[b] = n
        for e in range(1, n + 2):
            token = target_ids[b, e - 1]
            tokens[b, e - 1] = token
            budget[b] -= 1
            if budget[b] <= 0 or base[b] + e >= max_length or token in stops:
                active[b] = 0
                break
        new_lengths[b] = base[b] + e
        chain[b], pair[b] = target_ids[b, e - 1], (verify_ids[b, e - 1], target_ids[b, e - 1])
    return tokens, accepted, new_lengths, new_lengths - 1, chain, pair, active, budget


@settings(max_examples=EXAMPLES)
@given(data=st.data(), batch=st.integers(1, 300), k=st.integers(1, 8))
def test_speculative_accept_follows_its_rule(data, batch, k):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    stops = data.draw(st.lists(st.integers(0, 3), max_size=2))
    device_stops = (stops + data.draw(st.sampled_from(([], [-1], [-1, 2])))) or [-1]   # unpadded: a stop id ends it
    assert_speculative_accept_follows_its_rule(rng, batch, k, stops, device_stops, data.draw(st.integers(1, 32)))


def test_speculative_accept_reaches_the_last_sequence_of_a_partial_block():
    """257 sequences: two blocks of 256 threads, the second holding one sequence, which takes part."""
    assert_speculative_accept_follows_its_rule(np.random.default_rng(5), 257, 3, [0, 2], [0, 2, -1], 20)   # id 0 stops


def assert_speculative_accept_follows_its_rule(rng, batch, k, stops, device_stops, max_length):
    backend = target(1).backend
    verify_ids = rng.integers(0, 3, (batch, k + 1)).astype(np.int32)     # few ids: long accepted prefixes happen
    target_ids = rng.integers(0, 3, (batch, k + 1)).astype(np.int32)
    active, budget = rng.integers(0, 2, batch).astype(np.int32), rng.integers(1, 10, batch).astype(np.int32)
    active[-1] = 1   # the last sequence takes part: every output of it is written
    lengths = rng.integers(k + 2, 30, batch).astype(np.int32)
    outputs = [backend.zeros(shape, np.int32) for shape in
               ((batch, k + 1), (batch,), (batch,), (batch,), (batch,), (batch, 2))]
    state = [backend.asarray(a) for a in (active, budget)]
    decoding.speculative_accept(*outputs, *state, backend.asarray(verify_ids), backend.asarray(target_ids),
                                backend.asarray(lengths), backend.asarray(np.array(device_stops, np.int32)),
                                max_length=max_length)
    got = [backend.to_host(a) for a in outputs + state]
    want = accept_rule(active, budget, verify_ids, target_ids, lengths, stops, max_length)
    live = active == 1
    for i, name in enumerate(("tokens", "accepted", "target_lengths", "draft_lengths", "chain", "draft_pair",
                              "active", "budget")):
        g, w = (got[i][live], want[i][live]) if name in ("chain", "draft_pair") else (got[i], want[i])
        assert np.array_equal(g, w), name


def test_speculative_accept_stops_on_the_last_entry_of_an_unpadded_stop_list():
    """Sequence 0 emits 1 then 2 (its proposal 1 is accepted); 2, the last entry of the stop list [9, 2]
    (no -1 padding), stops it there. Sequence 1 emits 1 then 3 and goes on."""
    backend = target(1).backend
    ints = lambda values: backend.asarray(np.array(values, np.int32))   # noqa: E731
    outputs = [backend.zeros(shape, np.int32) for shape in ((2, 3), (2,), (2,), (2,), (2,), (2, 2))]
    active, budget = ints([1, 1]), ints([9, 9])
    decoding.speculative_accept(*outputs, active, budget, ints([[4, 1, 0], [4, 1, 0]]), ints([[1, 2, 0], [1, 3, 0]]),
                                ints([10, 10]), ints([9, 2]), max_length=32)
    tokens, accepted, target_lengths = (backend.to_host(a).tolist() for a in outputs[:3])
    assert accepted == [1, 1] and tokens == [[1, 2, -1], [1, 3, -1]] and target_lengths == [9, 9]
    assert backend.to_host(active).tolist() == [0, 1]


def test_speculative_accept_arguments_are_named():
    """Each bad argument is refused by name before the launch, and no output or state changes."""
    backend = target(1).backend
    ints = lambda shape: backend.asarray(np.full(shape, 7, np.int32))   # noqa: E731
    outputs = [ints(shape) for shape in ((2, 3), (2,), (2,), (2,), (2,), (2, 2))]
    state, ids, lengths, stops = [ints((2,)), ints((2,))], [ints((2, 3)), ints((2, 3))], ints((2,)), ints((1,))

    def refused(error, message, *args, max_length=8):
        with pytest.raises(error, match=message):
            decoding.speculative_accept(*args, max_length=max_length)
        assert all(np.all(backend.to_host(a) == 7) for a in outputs + state)

    one_column = [ints((2, 1)), *outputs[1:]]   # k = 0: nothing to verify
    refused(ValueError, r"^tokens: expected shape \(batch, k \+ 1\) with k >= 1, got \(2, 1\)$",
            *one_column, *state, ints((2, 1)), ints((2, 1)), lengths, stops)
    refused(ValueError, r"^draft_pair: expected shape \(2, 2\), got \(2, 3\)$",
            *outputs[:5], ints((2, 3)), *state, *ids, lengths, stops)
    refused(ValueError, r"^target_ids: expected shape \(2, 3\), got \(2, 4\)$",
            *outputs, *state, ids[0], ints((2, 4)), lengths, stops)
    refused(ValueError, r"^accepted: expected an array that does not overlap budget",
            *outputs[:1], state[1], *outputs[2:], *state, *ids, lengths, stops)
    refused(ValueError, r"^chain: expected an array that does not overlap lengths",
            *outputs[:4], lengths, *outputs[5:], *state, *ids, lengths, stops)
    refused(TypeError, r"^stop_ids: expected dtype int32, got float32$",
            *outputs, *state, *ids, lengths, backend.zeros((1,), np.float32))
    refused(ValueError, r"^max_length: expected an int in 0\.\.2147483647, got -1$",
            *outputs, *state, *ids, lengths, stops, max_length=-1)
    # tokens is written: a read-only array, or one holding a cache's lengths, is refused like any output
    refused(ValueError, r"^tokens: expected a writeable array, got a read-only one",
            read_only(ints((2, 3))), *outputs[1:], *state, *ids, lengths, stops)
    cache_lengths = target(6).cache.lengths.reshape(2, 3)
    refused(ValueError, r"^tokens: expected an array that does not overlap a KVCache's lengths, got one that shares "
                        r"24 bytes with it$", cache_lengths, *outputs[1:], *state, *ids, lengths, stops)


def test_speculative_gather_reads_only_inside_src():
    backend = target(1).backend
    src = backend.asarray(np.arange(6, dtype=np.int32))
    out = backend.zeros((3,), np.int32)
    decoding.speculative_gather(out, src, offset=1, row_stride=2)
    assert backend.to_host(out).tolist() == [1, 3, 5]
    grid = backend.zeros((2, 3), np.int32)
    decoding.speculative_gather(grid, src, row_stride=1, col_stride=2)
    assert backend.to_host(grid).tolist() == [[0, 2, 4], [1, 3, 5]]
    many = backend.zeros((3, 100), np.int32)   # 300 elements: two blocks of 256 threads
    wide = np.arange(1000, dtype=np.int32)
    decoding.speculative_gather(many, backend.asarray(wide), offset=5, row_stride=3, col_stride=7)
    assert np.array_equal(backend.to_host(many), wide[5 + 3 * np.arange(3)[:, None] + 7 * np.arange(100)])
    with pytest.raises(ValueError, match=r"^src: expected at least 7 elements .*got 6$"):
        decoding.speculative_gather(out, src, offset=2, row_stride=2)
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap src"):
        decoding.speculative_gather(src[:2], src, offset=3, row_stride=1)


def test_speculative_gather_arguments_are_named():
    backend = target(1).backend
    src = backend.asarray(np.arange(6, dtype=np.int32))
    for shape in ((0,), (2, 0), (1, 2, 2)):
        with pytest.raises(ValueError, match=r"^out: expected shape \(rows,\) or \(rows, cols\) with sizes >= 1, "
                                             rf"got {re.escape(str(shape))}$"):
            decoding.speculative_gather(backend.zeros(shape, np.int32), src, row_stride=1)
    with pytest.raises(TypeError, match=r"^out: expected dtype int32, got float32$"):
        decoding.speculative_gather(backend.zeros((3,), np.float32), src, row_stride=1)
    with pytest.raises(ValueError, match=r"^out: expected a writeable array, got a read-only one"):
        decoding.speculative_gather(read_only(backend.zeros((3,), np.int32)), src, row_stride=1)
    with pytest.raises(ValueError, match=r"^out: expected an array that does not overlap a KVCache's lengths"):
        decoding.speculative_gather(target(3).cache.lengths, src, row_stride=1)
    with pytest.raises(TypeError, match=r"^src: expected dtype int32, got float32$"):
        decoding.speculative_gather(backend.zeros((3,), np.int32), backend.zeros((6,), np.float32), row_stride=1)


@pytest.mark.parametrize("sms, splits, split_keys", [("1", 1, None), ("2", 2, 5 * 128), ("4", 4, 3 * 128)])
def test_fixed_split_positions_make_no_more_splits_than_a_decode_plan(monkeypatch, sms, splits, split_keys):
    # A stated device of 4 SMs splits a decode step of a 1025-row cache 4 ways (257 keys a split). The
    # fixed split size is that rounded up to the key chunk: 384, 3 splits. Rounding 1025 / 4 down first
    # would give 256, and a fifth split: more blocks than the plan found room for. At 2 SMs: 513 keys a
    # split, rounded up to 640. At 1 SM the plan does not split, and neither do the fixed positions (None).
    from cupykv.attention_plan import CHUNK, AttentionPlan
    monkeypatch.setenv("CUPYKV_EMULATOR_SMS", sms)
    model = Llama.random(LlamaConfig(**TARGET), seed=0, max_seq=1025, batch=1, backend="emulator")
    assert CHUNK == 128
    assert AttentionPlan(model.cache, 1, TARGET["num_attention_heads"]).num_splits == splits
    assert model._decode_split_keys() == split_keys
    if split_keys is not None:
        assert 1025 % splits and 1025 // splits % CHUNK == 0        # the case where rounding matters
        assert split_keys % CHUNK == 0 and -(-1025 // split_keys) <= splits
        assert split_keys - CHUNK < 1025 / splits <= split_keys    # the smallest such multiple of CHUNK


def test_passes_of_up_to_exact_q_len_queries_split_at_fixed_positions(monkeypatch):
    # A verification pass of num_speculative = 64 has EXACT_Q_LEN = 65 queries: it still takes the fixed
    # split positions; a longer pass (a prefill) plans its own.
    import importlib
    from cupykv.models.llama import EXACT_Q_LEN
    attention_module = importlib.import_module("cupykv.attention")
    monkeypatch.setattr(Llama, "_decode_split_keys", lambda self: 128)
    model = Llama.random(LlamaConfig(**TARGET), seed=0, max_seq=256, batch=1, backend="emulator")
    for q_len in (EXACT_Q_LEN, EXACT_Q_LEN + 1):
        model.cache.reset()
        model._forward(model._activations(q_len))
    used = {plan.q_len: plan.split_keys for plan in attention_module._plans[model.cache].values()}
    assert used[EXACT_Q_LEN] == 128 and used[EXACT_Q_LEN + 1] is None


def test_speculative_tokens_equal_greedy_with_keys_split_at_fixed_positions(monkeypatch):
    # On a GPU a long cache splits its keys; Llama then splits decode and verification passes at fixed
    # positions (split_keys), so both sum a row's keys in the same order. Forced here on the emulator.
    import importlib
    attention_module = importlib.import_module("cupykv.attention")
    monkeypatch.setattr(Llama, "_decode_split_keys", lambda self: 128)
    config = LlamaConfig(**TARGET)
    model = Llama(config, config.random_weights(5), max_seq=640, batch=2, backend="emulator")
    weights = {name: w + 0.05 * w.std() * np.random.default_rng(6).standard_normal(w.shape).astype(w.dtype)
               if w.ndim == 2 else w for name, w in config.random_weights(5).items()}
    helper = Llama(config, weights, max_seq=640, batch=2, backend="emulator")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (300, 170)]   # 3 and 2 splits live
    greedy = model.generate(prompts, 10, use_graph=True)
    speculative = model.generate(prompts, 10, use_graph=True, draft=helper, num_speculative=4)
    assert speculative == greedy
    assert 0 < model.stats.accepted < model.stats.proposed            # some proposals rejected: rollbacks ran
    used = {plan.q_len: plan.split_keys for plan in attention_module._plans[model.cache].values()}
    assert used[1] == used[5] == 128                                  # decode and verification passes
