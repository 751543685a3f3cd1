"""attention's split-KV workspace: bounded buffers per cache, grown outside capture, kept alive by graphs."""
import gc
import weakref

import numpy as np
import pytest

import cupykv
from cupykv import reference, testing
from backends import BACKENDS

N_HEADS = 4
SPLITS = 2     # forced: the emulator's plan picks 1, and max_seq 256 allows 2
SPEC = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=8, max_seq=256, batch=2, dtype="float32")


def filled(backend):
    cache, oracle = cupykv.KVCache(SPEC, backend=backend), reference.KVCache(SPEC)
    testing.fill(cache, oracle, [200, 7], np.random.default_rng(0))
    return cache, oracle


def workspace_sizes(q_len):
    """float32 values of partial_out, partial_max and partial_sum for a split launch with ``q_len`` queries."""
    rows = SPEC.batch * q_len * N_HEADS
    return (SPLITS * rows * SPEC.head_dim, SPLITS * rows, SPLITS * rows)


def buffer_sizes(cache):
    return tuple(buffer.size for buffer in cache._workspace.buffers)


def attend(cache, q_host, out):
    return cupykv.attention(cache.to_device(q_host), cache, 0, num_splits=SPLITS, out=out)


def assert_attention_matches(cache, oracle, q_host, out):
    want = reference.attention(q_host, oracle, 0)
    scale = float(np.abs(oracle.v[0]).max())
    testing.assert_attention_close(testing.to_numpy(out, SPEC), want, SPEC.dtype, scale)


def queries(rng, q_len):
    return testing.random_rows(rng, SPEC, (SPEC.batch, q_len, N_HEADS, SPEC.head_dim))


def test_many_query_lengths_leave_one_workspace_of_the_largest_size():
    cache, oracle = filled("emulator")
    rng = np.random.default_rng(1)
    q_lens = (1, 3, 8, 2, 5, 8, 1)
    for q_len in q_lens:
        q = queries(rng, q_len)
        out = cache._backend.zeros(q.shape, np.float32)
        attend(cache, q, out)
        assert_attention_matches(cache, oracle, q, out)
    assert buffer_sizes(cache) == workspace_sizes(max(q_lens))


def test_a_grown_workspace_frees_the_smaller_one():
    cache, _ = filled("emulator")
    rng = np.random.default_rng(1)
    for q_len in (1, 4):
        q = queries(rng, q_len)
        attend(cache, q, cache._backend.zeros(q.shape, np.float32))
        if q_len == 1:
            smaller = [weakref.ref(buffer) for buffer in cache._workspace.buffers]
    gc.collect()
    assert [ref() for ref in smaller] == [None, None, None]
    assert buffer_sizes(cache) == workspace_sizes(4)


def test_calls_no_larger_than_the_largest_so_far_allocate_nothing(monkeypatch):
    cache, _ = filled("emulator")
    rng = np.random.default_rng(1)
    big, small = queries(rng, 6), queries(rng, 2)
    outs = [cache._backend.zeros(q.shape, np.float32) for q in (big, small)]
    attend(cache, big, outs[0])
    allocations = []
    real_zeros = cache._backend.zeros

    def counting_zeros(shape, dtype):
        allocations.append((shape, dtype))
        return real_zeros(shape, dtype)

    monkeypatch.setattr(cache._backend, "zeros", counting_zeros)
    attend(cache, small, outs[1])
    attend(cache, big, outs[0])
    assert allocations == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_replays_correctly_after_an_eager_call_grew_the_workspace(backend):
    cache, oracle = filled(backend)
    rng = np.random.default_rng(1)
    q_host = queries(rng, 1)
    q = cache.to_device(q_host)
    out = cache._backend.zeros(q_host.shape, np.float32)
    graph = cupykv.capture(lambda: cupykv.attention(q, cache, 0, num_splits=SPLITS, out=out))
    captured_with = cache._workspace.buffers

    longer = queries(rng, 8)                        # needs a larger workspace: the cache drops the old one
    longer_out = cache._backend.zeros(longer.shape, np.float32)
    attend(cache, longer, longer_out)
    assert not any(new is old for new, old in zip(cache._workspace.buffers, captured_with))
    del captured_with
    gc.collect()

    cache._backend.upload(out, np.zeros(q_host.shape, np.float32))
    graph.replay()                                  # uses the buffer it was captured with, kept alive by the graph
    assert_attention_matches(cache, oracle, q_host, out)
    assert_attention_matches(cache, oracle, longer, longer_out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_growing_the_workspace_inside_a_captured_step_is_refused(backend):
    cache, _ = filled(backend)
    rng = np.random.default_rng(1)
    short, long = queries(rng, 1), queries(rng, 4)
    arrays = {q_len: (cache.to_device(q), cache._backend.zeros(q.shape, np.float32))
              for q_len, q in ((1, short), (4, long))}
    q_lens = iter([1, 4])                           # warm-up with 1 query, capture with 4: a larger workspace

    def step():
        q, out = arrays[next(q_lens)]
        cupykv.attention(q, cache, 0, num_splits=SPLITS, out=out)

    with pytest.raises(cupykv.CaptureError, match="growing attention's split-KV workspace"):
        cupykv.capture(step)


def test_the_first_call_allocates_three_exact_buffers():
    # Exact sizes and no shared memory: an emulated overrun of one view hits that buffer's guard page.
    cache, _ = filled("emulator")
    q = queries(np.random.default_rng(1), 3)
    attend(cache, q, cache._backend.zeros(q.shape, np.float32))
    assert buffer_sizes(cache) == workspace_sizes(3)
    first, second, third = cache._workspace.buffers
    assert not (np.shares_memory(first, second) or np.shares_memory(second, third)
                or np.shares_memory(first, third))
