"""The graph-safety statements of the docstrings are true, checked with real captures.

For every callable of the device API (``GRAPH_API`` in tests/test_docs.py) the
table below holds the call in its graph-safe form, its refused form, or both,
as its docstring says: "Graph-safe: yes" has a safe form only, "yes, with ..."
(or "unless ...") both, "no" a refused form only. A safe form must capture
and replay; a refused form must raise CaptureError when the step is recorded.
Each step also launches ``advance(0)``, so that a step whose call launches
nothing still has something to capture.
"""
import numpy as np
import pytest

import cupykv
from cupykv import CaptureError, ops
from cupykv.backends import get_backend
from cupykv.models import Llama, LlamaConfig
from cupykv.models.gguf import GGUFCheckpoint
from backends import BACKENDS
from test_docs import GRAPH_API, graph_safety

SPEC = cupykv.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8, max_seq=32, batch=2)
CONFIG = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=32, vocab_size=32)
MODEL = dict(max_seq=16, batch=2)


class Env:
    """Everything the calls of one backend need, made once per module: a cache, a plan, a graph, a model,
    and preallocated device operands (``out`` buffers included)."""

    def __init__(self, backend, npz_path):
        self.name, self.backend, self.npz_path = backend, get_backend(backend), npz_path
        rng = np.random.default_rng(0)
        self.cache = cupykv.KVCache(SPEC, backend=backend)
        dev = self.cache.to_device

        def rand(*shape):
            return dev(rng.standard_normal(shape).astype(np.float32))

        def zeros(*shape, dtype=np.float32):
            return dev(np.zeros(shape, dtype))

        self.k1, self.v1 = rand(2, 1, 2, 8), rand(2, 1, 2, 8)                 # [batch, n_new, n_kv, head_dim]
        self.q, self.out = rand(2, 1, 4, 8), zeros(2, 1, 4, 8)                # [batch, q_len, n_heads, head_dim]
        self.positions, self.positions_out = dev(np.array([[3], [4]], np.int32)), zeros(2, 1, dtype=np.int32)
        self.lengths, self.steps = dev(np.array([1, 2], np.int32)), zeros(2, dtype=np.int32)
        self.mask, self.scratch = dev(np.array([1, 0], np.int32)), zeros(2, dtype=np.int32)
        self.mask_out = zeros(2, 1, 1, SPEC.max_seq)                           # [batch, 1, q_len, max_seq]
        self.plan = cupykv.AttentionPlan(self.cache, q_len=1, n_heads=4)
        self.graph = cupykv.capture(self.cache.advance, 0)
        self.x, self.x2, self.x_out = rand(2, 8), rand(2, 8), zeros(2, 8)     # [rows, hidden]
        self.weight, self.y = rand(4, 8), zeros(2, 4)                         # [out, in], [rows, out]
        self.norm_weight = rand(8)
        self.ids, self.table, self.flag = dev(np.array([1, 2], np.int32)), rand(16, 8), zeros(1, dtype=np.int32)
        self.logits, self.ids_out = rand(2, 16), zeros(2, dtype=np.int32)
        self.weights = CONFIG.random_weights(0)
        self.model = Llama(CONFIG, self.weights, backend=backend, **MODEL)
        self.fp8_model = Llama(CONFIG, self.weights, backend=backend, kv_dtype="float8_e4m3", **MODEL)

    def launch_advance(self):
        """``Backend.launch`` of advance.cu by hand: what ``cache.advance(self.steps)`` launches."""
        cache = self.cache
        self.backend.launch("advance", "cupykv_advance", (1,), (256,),
                            (cache.lengths, cache.overflow, self.steps, np.int32(1), np.int32(0),
                             np.int32(SPEC.batch), np.int32(SPEC.max_seq)))


# name: (the graph-safe call, the refused call); None where the docstring says there is none
CALLS = {
    "cupykv.KVCache": (None, lambda e: cupykv.KVCache(SPEC, backend=e.name)),
    "cupykv.KVCache.append": (lambda e: (e.cache.append(0, e.k1, e.v1),
                                         e.cache.append(1, e.k1, e.v1, positions_out=e.positions_out)),
                              lambda e: e.cache.append(0, e.k1, e.v1, return_positions=True)),
    "cupykv.KVCache.write": (lambda e: e.cache.write(0, e.positions, e.k1, e.v1, positions_out=e.positions_out),
                             lambda e: e.cache.write(0, [[3], [4]], e.k1, e.v1)),
    "cupykv.KVCache.advance": (lambda e: (e.cache.advance(1), e.cache.advance(e.steps)),
                               lambda e: e.cache.advance([1, 0])),
    "cupykv.KVCache.truncate": (lambda e: e.cache.truncate(e.lengths), lambda e: e.cache.truncate(0)),
    "cupykv.KVCache.set_lengths": (lambda e: (e.cache.set_lengths(3), e.cache.set_lengths(e.lengths)),
                                   lambda e: e.cache.set_lengths([1, 2])),
    "cupykv.KVCache.reset": (lambda e: (e.cache.reset(), e.cache.reset(e.mask)), lambda e: e.cache.reset([0])),
    "cupykv.KVCache.additive_mask": (lambda e: e.cache.additive_mask(1, out=e.mask_out),
                                     lambda e: e.cache.additive_mask(1)),
    "cupykv.KVCache.check": (None, lambda e: e.cache.check()),
    "cupykv.KVCache.lengths_host": (None, lambda e: e.cache.lengths_host()),
    "cupykv.KVCache.to_device": (None, lambda e: e.cache.to_device(np.zeros(2, np.int32))),
    "cupykv.KVCache.kernel_view": (lambda e: e.cache.kernel_view(1), None),
    "cupykv.KVCache.owned_ranges": (lambda e: e.cache.owned_ranges(), None),
    "cupykv.KVCache.device_info": (lambda e: e.cache.device_info(), None),
    "cupykv.KVCache.layer": (lambda e: (e.cache.layer(0), e.cache.layer(1, "HND")), None),
    "cupykv.KVCache.live": (None, lambda e: e.cache.live(0, 0)),
    "cupykv.KVCache.remaining_capacity": (None, lambda e: e.cache.remaining_capacity()),
    "cupykv.KVCache.has_capacity": (None, lambda e: e.cache.has_capacity(1)),
    "cupykv.KernelView.layout_args": (lambda e: e.cache.kernel_view(0).layout_args(), None),
    "cupykv.KernelView.scale_args": (lambda e: e.cache.kernel_view(1).scale_args(), None),
    "cupykv.KVCache.set_scales": (None, lambda e: e.cache.set_scales(1.0, 1.0)),
    "cupykv.KVCache.scales_host": (None, lambda e: e.cache.scales_host()),
    "cupykv.calibrate_scales": (None, lambda e: cupykv.calibrate_scales(e.cache.k)),
    "cupykv.AttentionPlan": (None, lambda e: cupykv.AttentionPlan(e.cache, q_len=1, n_heads=4)),
    "cupykv.AttentionPlan.run": (lambda e: e.plan.run(e.q, 1, out=e.out), lambda e: e.plan.run(e.q, 1)),
    "cupykv.AttentionPlan.owned_ranges": (lambda e: e.plan.owned_ranges(), None),
    "cupykv.attention": (lambda e: cupykv.attention(e.q, e.cache, 0, out=e.out),
                         lambda e: cupykv.attention(e.q, e.cache, 0)),
    "cupykv.capture": (None, lambda e: cupykv.capture(e.cache.advance, 0)),
    "cupykv.Graph.replay": (None, lambda e: e.graph.replay()),
    "cupykv.ops.linear": (lambda e: ops.linear(e.x, e.weight, out=e.y), lambda e: ops.linear(e.x, e.weight)),
    "cupykv.ops.embedding": (lambda e: ops.embedding(e.ids, e.table, out=e.x_out, error_flag=e.flag),
                             lambda e: ops.embedding(e.ids, e.table, out=e.x_out)),
    "cupykv.ops.rmsnorm": (lambda e: ops.rmsnorm(e.x, e.norm_weight, 1e-6, out=e.x_out),
                           lambda e: ops.rmsnorm(e.x, e.norm_weight, 1e-6)),
    "cupykv.ops.silu_mul": (lambda e: ops.silu_mul(e.x, e.x2, out=e.x_out), lambda e: ops.silu_mul(e.x, e.x2)),
    "cupykv.ops.add": (lambda e: ops.add(e.x, e.x2, out=e.x_out), lambda e: ops.add(e.x, e.x2)),
    "cupykv.ops.argmax": (lambda e: ops.argmax(e.logits, out=e.ids_out), lambda e: ops.argmax(e.logits)),
    "cupykv.models.Llama": (None, lambda e: Llama(CONFIG, e.weights, backend=e.name, **MODEL)),
    "cupykv.models.Llama.random": (None, lambda e: Llama.random(CONFIG, backend=e.name, **MODEL)),
    "cupykv.models.Llama.from_safetensors": (None, lambda e: Llama.from_safetensors(CONFIG, e.npz_path,
                                                                                    backend=e.name, **MODEL)),
    "cupykv.models.Llama.from_gguf": (None, lambda e: Llama.from_gguf(GGUFCheckpoint(CONFIG, e.weights, {}, {}),
                                                                      backend=e.name, **MODEL)),
    "cupykv.models.Llama.first_layers": (None, lambda e: e.model.first_layers(1)),
    "cupykv.models.Llama.decode_step": (lambda e: e.model.decode_step(), None),
    "cupykv.models.Llama.feed": (None, lambda e: e.model.feed([1, 2])),
    "cupykv.models.Llama.next_tokens": (None, lambda e: e.model.next_tokens()),
    "cupykv.models.Llama.generate": (None, lambda e: e.model.generate([[1, 2], [3]], 2, use_graph=False)),
    "cupykv.models.Llama.calibrate_kv_scales": (None, lambda e: e.fp8_model.calibrate_kv_scales([[1, 2]])),
    "cupykv.backends.base.Backend.launch": (lambda e: e.launch_advance(), None),
    "cupykv.backends.base.Backend.zeros": (None, lambda e: e.backend.zeros((2,), np.int32)),
    "cupykv.backends.base.Backend.asarray": (None, lambda e: e.backend.asarray(np.zeros(2, np.int32))),
    "cupykv.backends.base.Backend.to_host": (None, lambda e: e.backend.to_host(e.lengths)),
    "cupykv.backends.base.Backend.upload": (None, lambda e: e.backend.upload(e.scratch, np.zeros(2, np.int32))),
    "cupykv.backends.base.Backend.copy": (None, lambda e: e.backend.copy(e.scratch, e.lengths)),
    "cupykv.backends.base.Backend.synchronize": (None, lambda e: e.backend.synchronize()),
    # a new backend object has made no word yet: its first use allocates (the shared backend's was made long before)
    "cupykv.backends.base.Backend.always_run": (lambda e: ops.add(e.x, e.x2, out=e.x_out, run_if=e.backend.always_run()),
                                                lambda e: type(e.backend)().always_run()),
    "cupykv.backends.base.Backend.owned_ranges": (lambda e: e.backend.owned_ranges(), None),
}


@pytest.fixture(scope="module", params=BACKENDS)
def env(request, tmp_path_factory):
    npz_path = tmp_path_factory.mktemp("graph_safety") / "weights.npz"
    np.savez(npz_path, **CONFIG.random_weights(0))
    return Env(request.param, npz_path)


def test_the_table_says_what_the_docstrings_say():
    assert set(CALLS) == set(GRAPH_API)
    for name in GRAPH_API:
        verdict, condition = graph_safety(name)
        safe, refused = CALLS[name]
        documented = (verdict == "yes", verdict == "no" or condition is not None)
        assert (safe is not None, refused is not None) == documented, \
            f"{name}: documented graph-safe {verdict!r}{', ' + condition if condition else ''}; the table has " \
            f"a safe form: {safe is not None}, a refused form: {refused is not None}"


@pytest.mark.parametrize("name", [name for name in GRAPH_API if CALLS[name][0] is not None])
def test_a_graph_safe_call_captures_and_replays(env, name):
    safe, _ = CALLS[name]
    env.cache.reset()
    env.model.cache.reset()

    def step():
        env.cache.advance(0)
        safe(env)

    graph = cupykv.capture(step)
    assert graph.num_launches >= 1
    graph.replay(2)
    env.backend.synchronize()


@pytest.mark.parametrize("name", [name for name in GRAPH_API if CALLS[name][1] is not None])
def test_a_refused_call_raises_capture_error_when_recorded(env, name):
    _, refused = CALLS[name]
    env.cache.reset()
    env.model.cache.reset()

    def step():
        env.cache.advance(0)
        refused(env)

    with pytest.raises(CaptureError, match="inside a captured step"):
        cupykv.capture(step)
    env.cache.advance(0)    # the backend still launches after the refused capture
    env.backend.synchronize()
