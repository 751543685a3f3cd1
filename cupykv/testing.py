"""Public test helpers: check a cupykv backend, or your own pipeline, against the reference.

Needs the ``test`` extra (hypothesis). The pieces:

- :func:`specs`, :func:`lengths`, :func:`row_shapes`, :func:`query_shapes` and
  :func:`operations`: hypothesis strategies for specs, shapes and operation
  sequences (:func:`apply_operation` runs one on a cache and the reference);
- :func:`to_numpy`, :func:`random_rows`: move data between host and a cache's backend;
- :func:`fill`: give a backend cache and a reference cache the same committed rows;
- :func:`poison_tail`: write NaN past the live rows, to prove a kernel never reads them;
- :func:`assert_matches_reference`: lengths, overflow flags and the whole K/V cache;
- :func:`~cupykv.tolerances.assert_attention_close`: attention within the tolerance of :mod:`cupykv.tolerances`;
- :class:`CacheMachine`: a hypothesis state machine that interleaves every
  operation, capture and replay included, on a backend and on the reference.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Sequence, Tuple, Union, cast

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cupykv import reference
from cupykv._typing import ArrayLike, DeviceArray, HostArray
from cupykv.rope import Rope
from cupykv.spec import DTYPES, FP8_DTYPE, IO_DTYPES, LAYOUTS, CacheSpec
from cupykv.tolerances import assert_attention_close as assert_attention_close   # re-exported
from cupykv.tolerances import ulp_distance as ulp_distance                       # re-exported

if TYPE_CHECKING:   # the fast path is imported lazily: importing testing stays cheap
    from cupykv.backends.base import Backend
    from cupykv.backends.emulator.accounting import Traffic
    from cupykv.cache import KVCache

#: one cache operation from :func:`operations`: ``(name, argument)``
Operation = Tuple[str, Union[Tuple[int, int], int, Sequence[int], Sequence[float], npt.NDArray[Any], None]]


@st.composite
def specs(draw: st.DrawFn, *, max_layers: int = 2, kv_heads: Sequence[int] = (1, 2, 4),
          head_dims: Sequence[int] = (2, 4, 8, 16, 64, 128),
          max_seqs: tuple[int, ...] | st.SearchStrategy[int] = (1, 4, 16), max_batch: int = 3,
          dtypes: Sequence[str] = IO_DTYPES, layouts: Sequence[str] = LAYOUTS) -> CacheSpec:
    """Strategy for CacheSpec over the given choices (defaults keep examples small).

    ``dtypes`` defaults to the 16- and 32-bit dtypes; include ``"float8_e4m3"`` (``cupykv.spec.DTYPES``
    has every dtype) for fp8 caches, whose io dtype is then drawn too. Code that uses such specs gives
    rows and queries in ``spec.io_np_dtype``.
    """
    dtype = draw(st.sampled_from(dtypes))
    return CacheSpec(
        n_layers=draw(st.integers(1, max_layers)),
        n_kv_heads=draw(st.sampled_from(kv_heads)),
        head_dim=draw(st.sampled_from(head_dims)),
        max_seq=draw(st.sampled_from(max_seqs)) if isinstance(max_seqs, tuple) else draw(max_seqs),
        batch=draw(st.integers(1, max_batch)),
        dtype=dtype,
        layout=draw(st.sampled_from(layouts)),
        io_dtype=draw(st.sampled_from(IO_DTYPES)) if dtype == FP8_DTYPE else "",
    )


def lengths(spec: CacheSpec) -> st.SearchStrategy[list[int]]:
    """Strategy for committed lengths ``[batch]``, weighted to 0, 1, capacity-1 and capacity."""
    boundary = st.sampled_from(sorted({0, 1, max(spec.max_seq - 1, 0), spec.max_seq} - {spec.max_seq + 1}))
    one = boundary | st.integers(0, spec.max_seq)
    return st.lists(one, min_size=spec.batch, max_size=spec.batch)


def row_shapes(spec: CacheSpec, max_new: int = 8) -> st.SearchStrategy[tuple[int, int, int, int]]:
    """Strategy for append's ``k``/``v`` shape ``[batch, n_new, n_kv_heads, head_dim]``."""
    return st.integers(1, max_new).map(lambda n: (spec.batch, n, spec.n_kv_heads, spec.head_dim))


def query_shapes(spec: CacheSpec, groups: Sequence[int] = (1, 2, 4, 8),
                 max_q_len: int = 8) -> st.SearchStrategy[tuple[int, int, int, int]]:
    """Strategy for attention's ``q`` shape ``[batch, q_len, n_heads, head_dim]`` (n_heads = group * n_kv)."""
    return st.tuples(st.integers(1, max_q_len), st.sampled_from(groups)).map(
        lambda t: (spec.batch, t[0], t[1] * spec.n_kv_heads, spec.head_dim))


def operations(spec: CacheSpec, max_size: int = 12) -> st.SearchStrategy[list[Operation]]:
    """Strategy for sequences of cache operations, as ``(name, argument)`` pairs.

    ``("append", (layer, n_new))``, ``("advance", n)``, ``("set_lengths", values)``
    (``n`` and ``values``: one int or one per sequence, up to ``max_seq + 3``),
    ``("truncate", fractions [batch])`` (a fraction of each current length, so
    always a valid rollback) and ``("reset", None or slots)``; run them with
    :func:`apply_operation`. Steps and lengths past capacity are included on
    purpose. A per-sequence argument drawn as a NumPy array goes to the cache
    as a device int32 array (the graph-safe path, read by the kernel at run
    time) and to the reference as host values; a list goes to both as is.
    """
    batch, cap = spec.batch, spec.max_seq
    per_seq = st.lists(st.integers(0, cap + 3), min_size=batch, max_size=batch)
    per_seq_on_device = per_seq.map(lambda values: np.array(values, np.int32))
    fractions = st.lists(st.floats(0, 1), min_size=batch, max_size=batch)
    return st.lists(st.one_of(
        st.tuples(st.just("append"), st.tuples(st.integers(0, spec.n_layers - 1), st.integers(1, 4))),
        st.tuples(st.just("advance"), st.integers(0, cap + 3) | per_seq | per_seq_on_device),
        st.tuples(st.just("set_lengths"), st.integers(0, cap + 3) | per_seq | per_seq_on_device),
        st.tuples(st.just("truncate"), fractions | fractions.map(np.array)),
        st.tuples(st.just("reset"), st.none() | st.lists(st.integers(0, batch - 1), unique=True, max_size=batch)),
    ), max_size=max_size)


def apply_operation(cache: KVCache, oracle: reference.KVCache, operation: Operation, rng: np.random.Generator) -> None:
    """Apply one ``(name, argument)`` from :func:`operations` to a backend cache and the reference.

    A NumPy array argument reaches the cache as a device int32 array, and the reference as host values.
    """
    name, argument = operation
    if name == "append":
        layer, n_new = cast(Tuple[int, int], argument)
        shape = (cache.spec.batch, n_new, cache.spec.n_kv_heads, cache.spec.head_dim)
        k, v = random_rows(rng, cache.spec, shape), random_rows(rng, cache.spec, shape)
        cache.append(layer, cache.to_device(k), cache.to_device(v))
        oracle.append(layer, k, v)
        return
    if name == "truncate":
        targets = [int(f * n) for f, n in zip(cast(Sequence[float], argument), oracle.lengths)]
        argument = np.array(targets, np.int32) if isinstance(argument, np.ndarray) else targets
    on_cache = cache.to_device(np.asarray(argument, np.int32)) if isinstance(argument, np.ndarray) else argument
    getattr(cache, name)(on_cache)
    getattr(oracle, name)(argument)


def to_numpy(array: ArrayLike, spec: CacheSpec, *, io: bool = False) -> HostArray:
    """Host copy of a backend array that holds cache-dtype values, viewed as ``spec.np_dtype``
    (``io=True``: io-dtype values, such as attention's output, viewed as ``spec.io_np_dtype``)."""
    host: HostArray = array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)
    dtype = spec.io_np_dtype if io else spec.np_dtype
    return np.array(host, copy=True).view(dtype) if host.dtype.itemsize == dtype.itemsize else host


def value_scale(oracle: reference.KVCache, layer: int) -> float:
    """``max |v|`` over every stored V row of ``layer`` (the values an fp8 cache's codes stand for):
    the ``value_scale`` of :func:`cupykv.tolerances.assert_attention_close`."""
    values = [np.abs(oracle._values(oracle.v, layer, b)) for b in range(oracle.spec.batch)]
    return float(max(np.nanmax(v, initial=0.0) for v in values))


def bits(array: npt.ArrayLike) -> npt.NDArray[np.unsignedinteger[Any]]:
    """The raw bit patterns of a float array (uint16 or uint32), for exact comparisons."""
    array = np.asarray(array)
    patterns: npt.NDArray[np.unsignedinteger[Any]] = array.view(np.dtype(f"u{array.dtype.itemsize}"))
    return patterns


def random_rows(rng: np.random.Generator, spec: CacheSpec, shape: Sequence[int], scale: float = 1.0) -> HostArray:
    """Normal random values in the cache's io dtype (what append takes and attention's q is), ``shape`` as given."""
    rows: HostArray = (rng.standard_normal(shape) * scale).astype(spec.io_np_dtype)
    return rows


def fill(cache: KVCache, oracle: reference.KVCache, lengths: npt.ArrayLike, rng: np.random.Generator,
         rope: Rope | None = None) -> None:
    """Reset both caches and give them identical committed rows, ``lengths[b]`` per sequence.

    Goes through the public API only (reset, append at every layer, advance
    per sequence), so it works on any backend.
    """
    spec = cache.spec
    committed = np.asarray(lengths, dtype=np.int64)
    cache.reset()
    oracle.reset()
    rows = int(committed.max(initial=0))
    if rows:
        shape = (spec.batch, rows, spec.n_kv_heads, spec.head_dim)
        for layer in range(spec.n_layers):
            k, v = random_rows(rng, spec, shape), random_rows(rng, spec, shape)
            cache.append(layer, cache.to_device(k), cache.to_device(v), rope=rope)
            oracle.append(layer, k, v, rope=rope)
    cache.advance(committed)
    oracle.advance(committed)


def poison_tail(cache: KVCache, start: npt.ArrayLike) -> None:
    """Write NaN into every layer of K and V at positions ``>= start[b]`` of sequence ``b``."""
    spec = cache.spec
    nan = np.array(np.nan, dtype=spec.np_dtype)
    nan_value: object = nan.view(cache.k.dtype)[()] if cache.k.dtype != nan.dtype else nan   # bit patterns on CuPy
    for b, first in enumerate(np.asarray(start).tolist()):
        first = max(0, min(int(first), spec.max_seq))
        index = (slice(None), b, slice(first, None)) if spec.layout == "NHD" else \
            (slice(None), b, slice(None), slice(first, None))
        cache.k[index] = nan_value
        cache.v[index] = nan_value


def assert_matches_reference(cache: KVCache, oracle: reference.KVCache, *, rope_used: bool = False) -> None:
    """Assert that a backend cache holds exactly what the reference holds.

    Compares lengths and overflow flags exactly, the whole V cache bit for bit,
    and the whole K cache bit for bit (within 1 ulp where keys were rotated by
    rope, see :mod:`cupykv.tolerances`).
    """
    spec = cache.spec
    lengths = np.asarray(cache.lengths_host())
    assert np.array_equal(lengths, oracle.lengths), f"lengths {lengths.tolist()} != reference {oracle.lengths.tolist()}"
    overflow = np.asarray(cache._backend.to_host(cache.overflow)).astype(bool)
    assert np.array_equal(overflow, oracle.overflow), \
        f"overflow {overflow.tolist()} != reference {oracle.overflow.tolist()}"
    for name, stored, want in (("v", cache.v, oracle.v), ("k", cache.k, oracle.k)):
        got = to_numpy(stored, spec)
        if name == "k" and rope_used:
            distance = np.where(bits(got) == bits(want), 0, ulp_distance(got, want))   # equal NaNs match
            if distance.max(initial=0) > 1:
                where = np.argwhere(distance > 1)[:5].tolist()
                raise AssertionError(f"k differs from the reference by more than 1 ulp at {where}")
        elif not np.array_equal(bits(got), bits(want)):
            where = np.argwhere(bits(got) != bits(want))[:5].tolist()
            raise AssertionError(f"{name} differs from the reference (bitwise) at {where} "
                                 f"(indices into {spec.layout} shape {spec.shape})")


class CacheMachine(RuleBasedStateMachine):
    """Drives a backend ``KVCache`` and the reference side by side and checks they never diverge.

    Rules: append (with and without rope, overflow included), advance (an int
    or per sequence), attention (GQA, q_len 1..4, window, softcap), truncate,
    reset, and capture-then-replay of a whole decode step. After every rule,
    lengths and overflow flags must be equal and the whole K/V cache must match
    (:func:`assert_matches_reference`); attention must be within the stated
    tolerance.

    Subclass it to choose the backend or the specs (any batch, capacity and
    shape), and run it with
    ``run_state_machine_as_test`` or ``TestCase = MyMachine.TestCase``::

        class OnGPU(CacheMachine):
            backend = "cupy"
        TestOnGPU = OnGPU.TestCase
    """

    backend: str | None = "emulator"
    spec_strategy: st.SearchStrategy[CacheSpec] = specs(max_seqs=(4, 9, 16), head_dims=(2, 8, 16, 64), dtypes=DTYPES)
    # made by the initialize rule ``create``
    spec: CacheSpec
    rng: np.random.Generator
    cache: KVCache
    oracle: reference.KVCache

    def __init__(self) -> None:
        super().__init__()
        self.rope_used = False

    @initialize(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def create(self, data: st.DataObject, seed: int) -> None:
        """Draw a spec and make the backend cache and the reference cache."""
        from cupykv.cache import KVCache  # the fast path is imported lazily: importing testing stays cheap

        self.spec = spec = data.draw(self.spec_strategy, label="spec")
        self.rng = np.random.default_rng(seed)
        scales = {}
        if spec.quantized:   # per-head scales around the rows' magnitude (standard normal): some saturate
            choices = st.sampled_from([1.0, 0.25, 1 / 64, 2.0 ** -10])
            shape = (spec.n_layers, spec.n_kv_heads)
            scales = {name: np.array(data.draw(st.lists(choices, min_size=shape[0] * shape[1],
                                                        max_size=shape[0] * shape[1]), label=name)).reshape(shape)
                      for name in ("k_scale", "v_scale")}
        self.cache = KVCache(spec, backend=self.backend, **scales)
        self.oracle = reference.KVCache(spec, **scales)

    # -- helpers ---------------------------------------------------------------
    def _rows(self, n_new: int, heads: int | None = None) -> HostArray:
        spec = self.spec
        return random_rows(self.rng, spec, (spec.batch, n_new, heads or spec.n_kv_heads, spec.head_dim))

    def _rope(self, use: bool) -> Rope | None:
        if use and self.spec.head_dim % 2 == 0:
            self.rope_used = True
            return Rope(theta=1000.0)
        return None

    def _device(self, host: HostArray) -> DeviceArray:
        return self.cache.to_device(host)

    # -- rules -----------------------------------------------------------------
    @rule(layer=st.integers(0, 7), n_new=st.integers(1, 5), use_rope=st.booleans())
    def append(self, layer: int, n_new: int, use_rope: bool) -> None:
        """Append random rows to one layer of both caches."""
        layer %= self.spec.n_layers
        rope = self._rope(use_rope)
        k, v = self._rows(n_new), self._rows(n_new)
        self.cache.append(layer, self._device(k), self._device(v), rope=rope)
        self.oracle.append(layer, k, v, rope=rope)

    # Per-sequence arguments are drawn once the spec is known, sized [batch], so that a
    # subclass may use any batch.
    def _per_sequence(self, data: st.DataObject, element: st.SearchStrategy[Any], label: str) -> list[Any]:
        batch = self.spec.batch
        return data.draw(st.lists(element, min_size=batch, max_size=batch), label=label)

    @rule(data=st.data(), per_sequence=st.booleans())
    def advance(self, data: st.DataObject, per_sequence: bool) -> None:
        """Advance both caches by an int or per sequence."""
        steps = st.integers(0, 4)
        n: int | list[int] = self._per_sequence(data, steps, "n") if per_sequence else data.draw(steps, label="n")
        self.cache.advance(n)
        self.oracle.advance(n)

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Roll both caches back to a fraction of each length."""
        fractions = self._per_sequence(data, st.floats(0, 1), "fractions")
        targets = [int(f * n) for f, n in zip(fractions, self.oracle.lengths)]
        self.cache.truncate(targets)
        self.oracle.truncate(targets)

    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        """Reset all slots, or some, of both caches."""
        batch = self.spec.batch
        slots = data.draw(st.none() | st.lists(st.integers(0, batch - 1), unique=True, max_size=batch),
                          label="slots")
        self.cache.reset(slots)
        self.oracle.reset(slots)

    @rule(layer=st.integers(0, 7), q_len=st.integers(1, 4), group=st.sampled_from((1, 2, 4)),
          window=st.none() | st.integers(1, 6), softcap=st.none() | st.just(5.0), use_rope=st.booleans())
    def attention(self, layer: int, q_len: int, group: int, window: int | None, softcap: float | None,
                  use_rope: bool) -> None:
        """Attention on the backend within the stated tolerance of the reference."""
        from cupykv import attention

        layer %= self.spec.n_layers
        rope = self._rope(use_rope)
        q = self._rows(q_len, heads=group * self.spec.n_kv_heads)
        got = attention(self._device(q), self.cache, layer, window=window, softcap=softcap, rope=rope)
        want = reference.attention(q, self.oracle, layer, window=window, softcap=softcap, rope=rope)
        assert_attention_close(to_numpy(got, self.spec, io=True), want, self.spec.io_dtype,
                               value_scale(self.oracle, layer))

    @rule(replays=st.integers(0, 3))
    def capture_and_replay(self, replays: int) -> None:
        """Capture a decode step (append to every layer, attention, advance(1)) and replay it."""
        from cupykv import attention, capture

        spec, backend = self.spec, self.cache._backend
        ks = [self._rows(1) for _ in range(spec.n_layers)]
        vs = [self._rows(1) for _ in range(spec.n_layers)]
        q = self._rows(1, heads=spec.n_kv_heads)
        k_dev, v_dev, q_dev = [self._device(x) for x in ks], [self._device(x) for x in vs], self._device(q)
        out = backend.zeros(q.shape, backend.storage_dtype(spec.io_dtype))

        def step() -> None:
            for layer in range(spec.n_layers):
                self.cache.append(layer, k_dev[layer], v_dev[layer])
                attention(q_dev, self.cache, layer, out=out)
            self.cache.advance(1)

        graph = capture(step)
        graph.replay(replays)
        for _ in range(replays + 1):
            for layer in range(spec.n_layers):
                self.oracle.append(layer, ks[layer], vs[layer])
                want = reference.attention(q, self.oracle, layer)
            self.oracle.advance(1)
        assert_attention_close(to_numpy(out, spec, io=True), want, spec.io_dtype,
                               value_scale(self.oracle, spec.n_layers - 1))

    @invariant()
    def matches_reference(self) -> None:
        """Lengths, overflow flags and the whole K/V cache equal the reference's."""
        if getattr(self, "cache", None) is not None:
            assert_matches_reference(self.cache, self.oracle, rope_used=self.rope_used)


def traffic(backend_or_cache: KVCache | str | Backend | None = None, banks: bool = False
            ) -> AbstractContextManager[Traffic]:
    """Count the memory traffic of the emulator launches of a ``with`` block.

    ``with testing.traffic(cache) as t:`` yields a collector whose ``launches`` holds one
    :class:`~cupykv.backends.emulator.accounting.LaunchTraffic` per kernel launch: per array
    argument (``t.launches[0].of(cache.k)``), the bytes loaded and stored, the distinct 32-byte
    sectors, exactly which bytes were touched, and warp-level sectors per request; and per
    ``CUPYKV_COMMON_PATH`` test of the kernels, how many thread evaluations gave each value
    (``t.launches[0].outcomes("attention_mma.cu:LINE")``: how often a hot loop left its common path);
    what each asynchronous-copy wait left in flight (``copy_waits``); and each warp's tensor-core
    ``mma`` instructions (``t.launches[0].mma_per_warp()``: ``{(block, warp): count}``).

    Parameters
    ----------
    backend_or_cache : KVCache, backend name or Backend, optional
        Must be (or live on) the emulator; ``None`` accepts any default, as the count
        sees only emulator launches.
    banks : bool
        Also count shared-memory bank wavefronts per call site
        (``launch.shared_sites``, ``launch.bank_conflicts()``) and the shared memory the
        accesses reached (``launch.shared_extent()``); launches run slower.

    Raises
    ------
    ValueError
        The backend is not the emulator: only the emulator sees every access.
    """
    from cupykv.backends import get_backend
    from cupykv.cache import KVCache

    backend = backend_or_cache._backend if isinstance(backend_or_cache, KVCache) else get_backend(backend_or_cache)
    return backend.traffic(banks=banks)
