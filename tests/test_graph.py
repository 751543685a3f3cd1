"""capture / replay: replays equal eager steps equal the reference, with state advancing on the device."""
import gc
import sys

import numpy as np
import pytest

import cupykv
from cupykv.backends.stream_capture import capture_on
from cupykv import graph as cupykv_graph, reference, testing
from backends import BACKENDS

N_HEADS = 4


class DecodeStep:
    """One decode step over preallocated device buffers: append to every layer, attention, advance(1)."""

    def __init__(self, cache, rng, rope=None):
        spec = cache.spec
        self.cache, self.rope = cache, rope
        self.k_host = testing.random_rows(rng, spec, (spec.n_layers, spec.batch, 1, spec.n_kv_heads, spec.head_dim))
        self.v_host = testing.random_rows(rng, spec, (spec.n_layers, spec.batch, 1, spec.n_kv_heads, spec.head_dim))
        self.q_host = testing.random_rows(rng, spec, (spec.n_layers, spec.batch, 1, N_HEADS, spec.head_dim))
        to_device = cache._backend.asarray
        self.k = [to_device(x) for x in self.k_host]
        self.v = [to_device(x) for x in self.v_host]
        self.q = [to_device(x) for x in self.q_host]
        self.out = [cache._backend.zeros((spec.batch, 1, N_HEADS, spec.head_dim), cache._backend.storage_dtype(spec.dtype))
                    for _ in range(spec.n_layers)]

    def __call__(self):
        for layer in range(self.cache.spec.n_layers):
            self.cache.append(layer, self.k[layer], self.v[layer], rope=self.rope)
            cupykv.attention(self.q[layer], self.cache, layer, rope=self.rope, out=self.out[layer])
        self.cache.advance(1)

    def on_reference(self, oracle):
        """The same step on the reference; returns the attention outputs per layer."""
        outs = []
        for layer in range(oracle.spec.n_layers):
            oracle.append(layer, self.k_host[layer], self.v_host[layer], rope=self.rope)
            outs.append(reference.attention(self.q_host[layer], oracle, layer, rope=self.rope))
        oracle.advance(1)
        return outs

    def outputs(self):
        return [testing.to_numpy(o, self.cache.spec) for o in self.out]


def make(backend, dtype="float16", max_seq=16, lengths=(3, 0), layout="NHD", seed=0, rope=None):
    spec = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=16, max_seq=max_seq, batch=2, dtype=dtype, layout=layout)
    rng = np.random.default_rng(seed)
    cache, oracle = cupykv.KVCache(spec, backend=backend), reference.KVCache(spec)
    testing.fill(cache, oracle, list(lengths), rng, rope=rope)
    return cache, oracle, DecodeStep(cache, rng, rope=rope)


def assert_outputs_match(step, want, oracle):
    for layer, (got, expected) in enumerate(zip(step.outputs(), want)):
        scale = float(np.abs(oracle.v[layer].astype(np.float64)).max())
        testing.assert_attention_close(got, expected, oracle.spec.dtype, scale, context=f"layer {layer}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replays_equal_eager_steps_equal_the_reference(backend, dtype):
    rope = cupykv.Rope(theta=10000.0)
    graph_cache, oracle, graph_step = make(backend, dtype, rope=rope)
    eager_cache, _, eager_step = make(backend, dtype, rope=rope)
    graph = cupykv.capture(graph_step)          # warm-up: the first real step
    want = graph_step.on_reference(oracle)
    eager_step()
    for _ in range(5):
        graph.replay()                          # positions advance on the device only
        eager_step()
        want = graph_step.on_reference(oracle)
    testing.assert_matches_reference(graph_cache, oracle, rope_used=True)
    testing.assert_matches_reference(eager_cache, oracle, rope_used=True)
    assert_outputs_match(graph_step, want, oracle)
    for got, eager in zip(graph_step.outputs(), eager_step.outputs()):
        assert np.array_equal(testing.bits(got), testing.bits(eager))  # same kernels, same inputs: bitwise
    assert graph_cache.lengths_host().tolist() == [9, 6]


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_n_runs_n_steps(backend):
    cache, oracle, step = make(backend)
    graph = cupykv.capture(step)
    graph.replay(4)
    for _ in range(5):
        step.on_reference(oracle)
    testing.assert_matches_reference(cache, oracle)
    assert graph.num_launches == 2 * cache.spec.n_layers + 1
    graph.replay(0)                                    # zero replays: nothing runs
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, error, shown", [(-1, ValueError, "-1"), (1.5, TypeError, r"1\.5 \(float\)"),
                                               (True, TypeError, r"True \(bool\)"), ("2", TypeError, r"'2' \(str\)")],
                         ids=["negative", "float", "bool", "str"])
def test_replay_refuses_a_count_that_is_not_an_int_at_least_0_and_runs_nothing(backend, bad, error, shown):
    # unchecked, True would replay once through range(), and -1 nothing at all, both without an error
    cache, oracle, step = make(backend)
    graph = cupykv.capture(step)
    step.on_reference(oracle)                          # the capture's warm-up step
    with pytest.raises(error, match=rf"^n: expected an int >= 0, got {shown}$"):
        graph.replay(bad)
    testing.assert_matches_reference(cache, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_names_the_backend_that_recorded_it(backend):
    cache, _, step = make(backend)
    assert cupykv.capture(step).backend == cache.backend


@pytest.mark.parametrize("step", [3, None, "step"], ids=["int", "None", "str"])
def test_capture_refuses_a_step_that_is_not_callable_by_its_type(step):
    with pytest.raises(TypeError, match=rf"^step: expected a callable, got {type(step).__name__}$"):
        cupykv.capture(step)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_during_replay_writes_nothing_past_capacity_and_check_raises(backend):
    cache, oracle, step = make(backend, max_seq=8, lengths=(5, 0))
    graph = cupykv.capture(step)
    step.on_reference(oracle)
    stored_before = testing.bits(testing.to_numpy(cache.k, cache.spec))[:, 0, :6].copy()
    graph.replay(5)                             # sequence 0 reaches 8 after 2 replays, then overflows
    for _ in range(5):
        step.on_reference(oracle)
    testing.assert_matches_reference(cache, oracle)     # whole cache: nothing written out of place
    assert np.array_equal(testing.bits(testing.to_numpy(cache.k, cache.spec))[:, 0, :6], stored_before)
    assert cache.lengths_host().tolist() == [8, 6]
    with pytest.raises(cupykv.CacheOverflowError, match=r"sequences \[0\]"):
        cache.check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncate_then_replay_continues_from_the_shorter_length(backend):
    cache, oracle, step = make(backend, lengths=(6, 2))
    graph = cupykv.capture(step)
    step.on_reference(oracle)
    graph.replay(3)
    for _ in range(3):
        step.on_reference(oracle)
    cache.truncate([4, 5])                      # speculative rollback
    oracle.truncate([4, 5])
    graph.replay(2)
    for _ in range(2):
        want = step.on_reference(oracle)
    testing.assert_matches_reference(cache, oracle)
    assert cache.lengths_host().tolist() == [6, 7]
    assert_outputs_match(step, want, oracle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_keeps_its_buffers_alive(backend):
    cache, oracle, step = make(backend)
    graph = cupykv.capture(step)
    step.on_reference(oracle)
    del step
    gc.collect()
    graph.replay(2)
    assert cache.lengths_host().tolist() == [6, 3]


def _bad_steps(cache, step):
    spec = cache.spec
    host_lengths = [1] * spec.batch
    return {
        "allocation": (lambda: cupykv.attention(step.q[0], cache, 0), "allocat"),
        "check": (lambda: (step(), cache.check()), "synchronisation"),
        "lengths_host": (lambda: (step(), cache.lengths_host()), "synchronisation"),
        "host advance": (lambda: (step(), cache.advance(host_lengths)), "host values"),
        "host truncate": (lambda: (step(), cache.truncate(0)), "synchronisation"),
        "host reset slots": (lambda: (step(), cache.reset([0])), "host values"),
        "backend synchronize": (lambda: (step(), cache._backend.synchronize()), r"backend\.synchronize\(\)"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["allocation", "check", "lengths_host", "host advance", "host truncate",
                                  "host reset slots", "backend synchronize"])
def test_capture_refuses_what_a_graph_cannot_replay(backend, case):
    cache, _, step = make(backend)
    bad, message = _bad_steps(cache, step)[case]
    with pytest.raises(cupykv.CaptureError, match=message):
        cupykv.capture(bad)


def test_numpy_math_on_emulator_device_arrays_is_refused_in_capture():
    cache, _, step = make("emulator")
    with pytest.raises(cupykv.CaptureError, match="numpy.multiply"):
        cupykv.capture(lambda: (step(), step.out[0] * 2))


def test_views_of_emulator_device_arrays_are_allowed_in_capture_but_host_reads_are_not():
    cache, _, step = make("emulator")
    cupykv.capture(lambda: (step(), step.out[0][:, :1].reshape(-1)))    # a view moves no data, as on CuPy
    with pytest.raises(cupykv.CaptureError, match="reading an emulator device array"):
        cupykv.capture(lambda: (step(), step.out[0][0, 0, 0, 0]))
    with pytest.raises(cupykv.CaptureError, match="a gather on the host"):
        cupykv.capture(lambda: (step(), step.out[0][[0, 1]]))


def test_a_step_without_cupykv_launches_cannot_be_captured():
    with pytest.raises(cupykv.CaptureError, match="no cupykv kernel"):
        cupykv.capture(lambda: None)


def test_a_step_on_two_backends_cannot_be_captured():
    # a second emulator backend object has its own memory and launches: a graph cannot hold both
    from cupykv.backends.emulator_backend import EmulatorBackend
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=8, max_seq=4, batch=1, dtype="float32")
    first = cupykv.KVCache(spec, backend="emulator")
    second = cupykv.KVCache(spec, backend=EmulatorBackend())
    with pytest.raises(cupykv.CaptureError, match=r"several backends \['emulator', 'emulator'\]: a graph belongs "
                                                  r"to one backend"):
        cupykv.capture(lambda: (first.advance(1), second.advance(1)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_side_truncate_and_reset_are_graph_safe(backend):
    cache, oracle, step = make(backend, lengths=(6, 4))
    targets = cache._backend.asarray(np.array([2, 1], dtype=np.int32))
    mask = cache._backend.asarray(np.array([0, 1], dtype=np.int32))

    def rollback_then_step():
        cache.truncate(targets)
        cache.reset(mask)
        step()

    graph = cupykv.capture(rollback_then_step)
    graph.replay(2)
    for _ in range(3):
        oracle.truncate(np.minimum(oracle.lengths, [2, 1]))
        oracle.reset([1])
        step.on_reference(oracle)
    testing.assert_matches_reference(cache, oracle)
    assert cache.lengths_host().tolist() == [3, 1]


# -- ending a CUDA stream capture (cupykv.backends.stream_capture.capture_on), with a stand-in for cupy.cuda.Stream --------
class FakeStream:
    """begin_capture / end_capture as on cupy.cuda.Stream; ``end_error`` makes end_capture fail as CUDA does."""

    def __init__(self, end_error=None):
        self.end_error = end_error
        self.calls = []

    def begin_capture(self):
        self.calls.append("begin_capture")

    def end_capture(self):
        self.calls.append("end_capture")
        if self.end_error is not None:
            raise self.end_error
        return "the graph"


def invalidated():
    return RuntimeError("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture")


def raise_value_error():
    raise ValueError("the step's own error")


def test_a_step_error_is_not_replaced_by_the_failure_to_end_the_invalidated_capture():
    stream = FakeStream(end_error=invalidated())
    with pytest.raises(ValueError, match="the step's own error") as caught:
        capture_on(stream, raise_value_error)
    assert stream.calls == ["begin_capture", "end_capture"]
    if sys.version_info >= (3, 11):     # the end_capture failure is kept as a note
        assert any("cudaErrorStreamCaptureInvalidated" in note for note in caught.value.__notes__)


def test_a_step_error_propagates_and_the_capture_is_ended_when_it_ends_cleanly():
    stream = FakeStream()
    with pytest.raises(ValueError, match="the step's own error") as caught:
        capture_on(stream, raise_value_error)
    assert stream.calls == ["begin_capture", "end_capture"]
    assert not getattr(caught.value, "__notes__", [])


def test_a_capture_invalidated_by_a_step_that_raised_nothing_is_a_capture_error_with_the_likely_cause():
    cause = invalidated()
    with pytest.raises(cupykv.CaptureError, match="invalidated .* host synchronisation") as caught:
        capture_on(FakeStream(end_error=cause), lambda: None)
    assert caught.value.__cause__ is cause
    assert "cudaErrorStreamCaptureInvalidated" in str(caught.value)


def test_a_clean_capture_returns_the_graph_end_capture_made():
    stream = FakeStream()
    assert capture_on(stream, lambda: None) == "the graph"
    assert stream.calls == ["begin_capture", "end_capture"]


def _invalidate_the_capture():
    """Synchronise the capturing stream, a call CUDA refuses during capture, and swallow the refusal."""
    import cupy
    try:
        cupy.cuda.runtime.streamSynchronize(cupy.cuda.get_current_stream().ptr)
    except cupy.cuda.runtime.CUDARuntimeError:
        pass


def _step_that_misbehaves_at_capture(step, misbehave):
    """``step``, then ``misbehave()`` on the second call only (the capture; the first is the warm-up)."""
    calls = []

    def run():
        step()
        calls.append(None)
        if len(calls) == 2:
            misbehave()
    return run


@pytest.mark.gpu
def test_a_step_error_inside_a_cupy_capture_reaches_the_caller_not_the_capture_error():
    _, _, step = make("cupy")

    def invalidate_then_fail():
        _invalidate_the_capture()
        raise_value_error()

    with pytest.raises(ValueError, match="the step's own error") as caught:
        cupykv.capture(_step_that_misbehaves_at_capture(step, invalidate_then_fail))
    if sys.version_info >= (3, 11):     # proves the capture really was invalidated, as the test intends
        assert any("cudaErrorStreamCaptureInvalidated" in note for note in caught.value.__notes__)


@pytest.mark.gpu
def test_a_cupy_capture_invalidated_by_a_step_that_raised_nothing_is_a_capture_error():
    _, _, step = make("cupy")
    with pytest.raises(cupykv.CaptureError, match="invalidated"):
        cupykv.capture(_step_that_misbehaves_at_capture(step, _invalidate_the_capture))


def test_a_recorded_launch_keeps_its_arguments_as_they_were_when_it_was_recorded():
    """CUDA copies a kernel's parameters when it records the launch. The emulator's recorder does the
    same, so a step that reuses one argument list and changes it between launches replays each launch
    with the values it was recorded with."""
    from cupykv.backends.capture import Recorder
    ran = []
    recorder = Recorder(execute=False, capturing=True)
    args = [3, "first"]
    backend = cupykv.backends.get_backend("emulator")
    for value in ("first", "second"):
        args[1] = value
        recorder.launch(backend, lambda grid, block, a, shared_mem=0: ran.append(tuple(a)), (1,), (32,), args, 0)
    args[1] = "changed after recording"
    for fn, grid, block, frozen, shared_mem in recorder.launches:
        fn(grid, block, frozen, shared_mem=shared_mem)
    assert ran == [(3, "first"), (3, "second")]
