"""Builders of fuzzed public calls: the cache's methods, attention, and the constructors (see test_fuzz_api).

Each ``build_<call>(draw, env)`` draws the arguments of one call, labels the
call valid or not by the contract (cross-argument rules, shapes and aliasing
included) and returns a :class:`fuzz_args.Call` that runs it on the emulator
and checks an accepted result against the reference.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

import cupykv
from cupykv import reference, testing
from cupykv.tolerances import logit_error_bound
from fuzz_args import (Arg, Call, arg, arguments, arrays, cache_view, choices, floats, host, ints, invalid, make_rope,
                       maybe_bad,
                       normal_float32, overlapping, per_sequence, rope_theta_contract, ropes, same_memory, shape_of,
                       softcap_contract, storage_view)

INT32_MAX = 2**31 - 1
MAX_NEW = 2**30 - 1


# -- cache methods ----------------------------------------------------------------------------------------
@arguments("layer", "k", "v", "rope")
def build_append(draw, env):
    spec = env.spec
    n_new = draw(st.integers(1, 3))
    shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    layer = arg(draw, "layer", ints(0, spec.n_layers - 1))
    k = arg(draw, "k", arrays(env, shape, spec.dtype))
    if maybe_bad(draw, "k") and draw(st.booleans()):
        k = Arg(cache_view(env, shape, env.cache.k.dtype, draw(st.sampled_from(("k", "v")))), False, "the cache's")
        k = k if k.value is not None else Arg(env.device(env.random(shape, spec.dtype)), True, "device")
    v = arg(draw, "v", arrays(env, shape_of(k) or shape, spec.dtype))
    rope = arg(draw, "rope", ropes(spec.head_dim))
    args = dict(layer=layer, k=k, v=v, rope=rope)
    k_shape, v_shape = shape_of(k), shape_of(v)
    if k_shape is None or k_shape[:1] + k_shape[2:] != shape[:1] + shape[2:] or not 1 <= k_shape[1] <= MAX_NEW \
            or v_shape != k_shape:
        args["shapes"] = invalid(f"k {k_shape}, v {v_shape}")
    before = {name: storage_view(args[name].value, env) for name in ("k", "v") if shape_of(args[name])}

    def check(_):
        env.oracle.append(layer.value, before["k"], before["v"], rope=make_rope(rope.value))
        testing.assert_matches_reference(env.cache, env.oracle, rope_used=rope.value is not None)

    return Call("append", ("layer", "k", "v", "rope", "Rope.theta"), args,
                lambda: env.cache.append(layer.value, k.value, v.value, rope=make_rope(rope.value)), check)


def _host_in_range(arg, env, lo, hi):
    """Whether a host per-sequence value lies in lo..hi (hi per sequence or one for all)."""
    values = np.broadcast_to(np.array(arg.value, dtype=object), (env.spec.batch,)) if arg.valid else None
    his = np.broadcast_to(np.asarray(hi, dtype=object), (env.spec.batch,))
    return values is not None and all(lo <= int(v) <= int(h) for v, h in zip(values, his))


@arguments("n")
def build_advance(draw, env):
    n = arg(draw, "n", per_sequence(env, 0, INT32_MAX))
    device = isinstance(n.value, np.ndarray) and env.backend.is_device_array(n.value)
    if n.valid and not device and not _host_in_range(n, env, 0, INT32_MAX):
        n = Arg(n.value, False, n.how)
    steps = host(n.value) if device else n.value

    def check(_):
        env.oracle.advance(np.maximum(steps, 0) if device else steps)   # advance.cu: a negative device step is 0
        testing.assert_matches_reference(env.cache, env.oracle)

    return Call("advance", ("n",), dict(n=n), lambda: env.cache.advance(n.value), check)


@arguments("new_lengths")
def build_truncate(draw, env):
    new = arg(draw, "new_lengths", per_sequence(env, 0, int(env.oracle.lengths.max())))
    device = isinstance(new.value, np.ndarray) and env.backend.is_device_array(new.value)
    if new.valid and not device and not _host_in_range(new, env, 0, env.oracle.lengths):
        new = Arg(new.value, False, new.how)
    targets = host(new.value) if device else new.value

    def check(_):
        env.oracle.truncate(np.minimum(env.oracle.lengths, np.maximum(targets, 0)) if device else targets)
        testing.assert_matches_reference(env.cache, env.oracle)

    return Call("truncate", ("new_lengths",), dict(new_lengths=new), lambda: env.cache.truncate(new.value), check)


@arguments("new_lengths")
def build_set_lengths(draw, env):
    new = arg(draw, "new_lengths", per_sequence(env, 0, INT32_MAX))
    device = isinstance(new.value, np.ndarray) and env.backend.is_device_array(new.value)
    if new.valid and not device and not _host_in_range(new, env, 0, INT32_MAX):
        new = Arg(new.value, False, new.how)
    values = host(new.value) if device else new.value

    def check(_):
        env.oracle.set_lengths(np.maximum(values, 0) if device else values)   # set_lengths.cu: negative device -> 0
        testing.assert_matches_reference(env.cache, env.oracle)

    return Call("set_lengths", ("new_lengths",), dict(new_lengths=new), lambda: env.cache.set_lengths(new.value),
                check)


@st.composite
def write_positions(draw, env, n_new):
    """``write``'s positions for ``n_new`` rows: device int32 ``[batch, n_new]`` (or ``[batch]``), host ints
    (a list or a NumPy array; valid without two in-range rows of a sequence at one position), the cache's own
    lengths (valid for one row), or bad forms: strided, int64, the cache's flags or K, a wrong shape, junk."""
    batch, max_seq = env.spec.batch, env.spec.max_seq
    values = env.rng.integers(-2, max_seq + 3, (batch, n_new)).astype(np.int32)   # repeats included
    bad = maybe_bad(draw)
    how = draw(st.sampled_from(("device", "device", "one row", "list", "numpy", "lengths")
                               + (("strided", "int64", "overflow", "k", "wrong shape", "past int32", "junk")
                                  if bad else ())))
    if how == "device":
        return Arg(env.device(values), True, f"device {values.tolist()}")
    if how == "one row":
        return Arg(env.device(values[:, 0].copy()), n_new == 1, f"device [batch] {values[:, 0].tolist()}")
    if how == "lengths":
        return Arg(env.cache.lengths, n_new == 1, "the cache's lengths")
    if how in ("list", "numpy", "past int32"):
        if how == "past int32":
            values = values.astype(np.int64)
            values[0, 0] = draw(st.sampled_from((2**31, -2**31 - 1)))
        distinct = all(len(set(r)) == len(r) for r in ([p for p in row if 0 <= p < max_seq] for row in values.tolist()))
        value = values.tolist() if how == "list" else values.astype(np.int64)
        return Arg(value, how != "past int32" and distinct, f"{how} {values.tolist()}")
    if how == "strided":
        array = env.device(np.repeat(values, 2, axis=1))[:, ::2]
        return Arg(array, _c_contiguous_ints(array), "device strided")
    if how == "int64":
        return Arg(env.device(values.astype(np.int64)), False, "device int64")
    if how == "overflow":
        return Arg(env.cache.overflow, False, "the cache's overflow flags")
    if how == "k":
        view = cache_view(env, (batch, n_new), np.int32, "k")
        return Arg(view, False, "a view of the cache's k") if view is not None else Arg("1", False, "junk")
    if how == "wrong shape":
        return Arg(env.device(np.zeros((batch, n_new + 1), np.int32)), False, "device wrong shape")
    return Arg(draw(st.sampled_from(("1", None, 1.0, [[0.5] * n_new] * batch, [[True] * n_new] * batch))), False,
               "junk")


def _c_contiguous_ints(array) -> bool:
    return bool(array.flags.c_contiguous)


@arguments("layer", "positions", "k", "v", "rope")
def build_write(draw, env):
    spec = env.spec
    n_new = draw(st.integers(1, 3))
    shape = (spec.batch, n_new, spec.n_kv_heads, spec.head_dim)
    layer = arg(draw, "layer", ints(0, spec.n_layers - 1))
    positions = arg(draw, "positions", write_positions(env, n_new))
    k = arg(draw, "k", arrays(env, shape, spec.dtype))
    v = arg(draw, "v", arrays(env, shape_of(k) or shape, spec.dtype))
    rope = arg(draw, "rope", ropes(spec.head_dim))
    args = dict(layer=layer, positions=positions, k=k, v=v, rope=rope)
    if shape_of(k) != shape or shape_of(v) != shape:   # positions were drawn for n_new rows of this shape
        args["shapes"] = invalid(f"k {shape_of(k)}, v {shape_of(v)}")
    before = {name: storage_view(args[name].value, env) for name in ("k", "v") if shape_of(args[name])}
    rows = np.array(host(positions.value)).reshape(spec.batch, n_new) if positions.valid else None

    def check(_):
        for i in range(n_new):   # one row at a time: a later row at one position wins, as write.cu does
            env.oracle.write(layer.value, rows[:, i], before["k"][:, i : i + 1], before["v"][:, i : i + 1],
                             rope=make_rope(rope.value))
        testing.assert_matches_reference(env.cache, env.oracle, rope_used=rope.value is not None)

    return Call("write", ("layer", "positions", "k", "v", "rope", "Rope.theta"), args,
                lambda: env.cache.write(layer.value, positions.value, k.value, v.value, rope=make_rope(rope.value)),
                check)


@arguments("slots")
def build_reset(draw, env):
    batch = env.spec.batch
    how = draw(st.sampled_from(("none", "int", "list", "device") + (("junk",) if maybe_bad(draw, "slots") else ())))
    if how == "none":
        slots = Arg(None, True, "all")
    elif how == "int":
        slots = arg(draw, "slots", ints(0, batch - 1, junk=False))
    elif how == "list":
        elements = arg(draw, "slots", st.lists(ints(0, batch - 1, junk=False), max_size=batch + 1,
                                                unique_by=None if maybe_bad(draw, "slots") else lambda a: int(a.value)))
        values = [e.value for e in elements]
        slots = Arg(values, all(e.valid for e in elements) and len({int(v) for v in values}) == len(values),
                    f"list {values}")
    elif how == "device":
        mask = env.rng.integers(0, 2, batch).astype(np.int32)
        slots = Arg(env.device(mask), True, f"device mask {mask.tolist()}")
    else:
        slots = Arg(draw(st.sampled_from(("all", 1.0, [0.5], env.cache.lengths))), False, "junk")
    wanted = np.flatnonzero(host(slots.value)) if how == "device" else slots.value

    def check(_):
        env.oracle.reset(wanted)
        testing.assert_matches_reference(env.cache, env.oracle)

    return Call("reset", ("slots",), dict(slots=slots), lambda: env.cache.reset(slots.value), check)


@arguments("q_len", "out")
def build_additive_mask(draw, env):
    spec = env.spec
    q_len = arg(draw, "q_len", ints(1, MAX_NEW))
    if q_len.valid and int(q_len.value) > 6:
        q_len = Arg(np.int64(draw(st.integers(1, 6))), True, "small")   # a large valid q_len only costs time
    shape = (spec.batch, 1, int(q_len.value) if q_len.valid else 1, spec.max_seq)
    out = arg(draw, "out", st.just(Arg(None, True, "none")) | arrays(env, shape, np.float32, output=True))
    if maybe_bad(draw, "out") and draw(st.booleans()):
        view = cache_view(env, shape, np.float32, draw(st.sampled_from(("k", "v", "lengths"))))
        out = Arg(view, False, "the cache's") if view is not None else out
    args = dict(q_len=q_len, out=out)
    if out.value is not None and isinstance(out.value, np.ndarray) and shape_of(out) != shape:
        args["shapes"] = invalid(f"out {shape_of(out)}")

    def check(result):
        assert out.value is None or same_memory(result, out.value)   # out itself, or its storage-dtype view
        assert np.array_equal(host(result), env.oracle.additive_mask(q_len.value))

    return Call("additive_mask", ("q_len", "out"), args, lambda: env.cache.additive_mask(q_len.value, out=out.value),
                check)


# -- attention ------------------------------------------------------------------------------------------------
@arguments("q", "layer", "scale", "softcap", "window", "num_splits", "rope", "out")
def build_attention(draw, env):
    spec = env.spec
    group, q_len = draw(st.sampled_from((1, 2))), draw(st.integers(1, 3))
    shape = (spec.batch, q_len, group * spec.n_kv_heads, spec.head_dim)
    q = arg(draw, "q", arrays(env, shape, spec.dtype))
    layer = arg(draw, "layer", ints(0, spec.n_layers - 1))
    scale = arg(draw, "scale", st.just(Arg(None, True, "default")) | floats(normal_float32, none_ok=True))
    softcap = arg(draw, "softcap", st.just(Arg(None, True, "none")) | floats(softcap_contract, none_ok=True))
    window = arg(draw, "window", st.just(Arg(None, True, "none")) | ints(1, INT32_MAX, none_ok=True))
    splits = arg(draw, "num_splits", st.just(Arg(None, True, "planned")) |
                 ints(1, max(1, min(math.ceil(spec.max_seq / 128), 65535)), none_ok=True))
    rope = arg(draw, "rope", ropes(spec.head_dim))
    q_shape = shape_of(q)
    out_shape = q_shape or shape
    out_how = draw(st.sampled_from(("none", "array") + (("q itself", "over q", "the cache's")
                                                        if maybe_bad(draw, "out") else ())))
    if out_how == "none":
        out = Arg(None, True, "none")
    elif out_how == "array":
        out = arg(draw, "out", arrays(env, out_shape, spec.dtype, output=True))
    elif out_how == "q itself":
        out = Arg(q.value, False, "q itself")
    elif out_how == "over q" and q_shape and q.valid:
        first = storage_view(q.value, env)
        shift = 4   # overlapping() puts q 4 bytes into the buffer and out at byte 0
        q_values, over = overlapping(env, first, out_shape, env.cache.k.dtype, shift_bytes=shift)
        shared = min(shift + first.nbytes, over.nbytes) - shift   # a q of 4 bytes or less shares none
        q, out = Arg(q_values, True, q.how), Arg(over, shared <= 0, "over q")
    else:
        view = cache_view(env, out_shape, env.cache.k.dtype, draw(st.sampled_from(("k", "v"))))
        out = Arg(view, False, "the cache's") if view is not None else Arg(None, True, "none")
    args = dict(q=q, layer=layer, scale=scale, window=window, softcap=softcap, rope=rope, out=out,
                num_splits=splits)
    if q_shape is None or len(q_shape) != 4 or q_shape[0] != spec.batch or not 1 <= q_shape[1] <= MAX_NEW \
            or q_shape[2] < 1 or q_shape[2] % spec.n_kv_heads or q_shape[3] != spec.head_dim:
        args["shapes"] = invalid(f"q {q_shape}")
    elif isinstance(out.value, np.ndarray) and shape_of(out) != q_shape:
        args["shapes"] = invalid(f"out {shape_of(out)}")
    before = storage_view(q.value, env) if q_shape else None
    call_kwargs = lambda: dict(scale=scale.value, window=window.value, softcap=softcap.value,  # noqa: E731
                               rope=make_rope(rope.value))

    def check(result):
        assert out.value is None or same_memory(result, out.value)   # out itself, or its storage-dtype view
        testing.assert_matches_reference(env.cache, env.oracle, rope_used=False)
        want = reference.attention(before, env.oracle, layer.value, **call_kwargs())
        # logits are computed in float32: compare where they cannot overflow it
        logit_bound = (scale.value or 1.0) * np.abs(before.astype(np.float64)).max() * spec.head_dim * \
            np.abs(env.oracle.k.astype(np.float64)).max()
        if logit_bound < 1e30:   # a large scale makes softmax ill-conditioned: the tolerance takes its logit error
            scale_value = spec.head_dim ** -0.5 if scale.value is None else float(scale.value)
            testing.assert_attention_close(testing.to_numpy(result, spec), want, spec.dtype,
                                           float(np.abs(env.oracle.v[layer.value].astype(np.float64)).max()),
                                           logit_error=logit_error_bound(before, env.oracle.k[layer.value],
                                                                         scale_value))

    return Call("attention", ("q", "layer", "scale", "window", "softcap", "rope", "Rope.theta", "out", "num_splits"),
                args, lambda: cupykv.attention(q.value, env.cache, layer.value, out=out.value,
                                               num_splits=splits.value, **call_kwargs()), check)




# -- constructors ----------------------------------------------------------------------------------------------
@arguments("theta")
def build_rope(draw, env):
    theta = arg(draw, "theta", floats(rope_theta_contract, st.floats(1.0, 1e7)))

    def check(rope):
        assert rope.theta == float(theta.value) and type(rope.theta) is float

    return Call("Rope", ("Rope.theta",), dict(theta=theta), lambda: cupykv.Rope(theta.value), check)


SPEC_BOUNDS = dict(n_layers=INT32_MAX, n_kv_heads=INT32_MAX, head_dim=256, max_seq=2**30, batch=INT32_MAX)


@arguments(*SPEC_BOUNDS, "dtype", "layout")
def build_cache_spec(draw, env):
    fields = {name: arg(draw, name, ints(1, hi)) for name, hi in SPEC_BOUNDS.items()}
    fields["dtype"] = arg(draw, "dtype", choices(("float32", "float16", "bfloat16"), ("float64", "fp16", None,
                                                                                      np.float16)))
    fields["layout"] = arg(draw, "layout", choices(("NHD", "HND"), ("nhd", 0)))
    args = dict(fields)
    if all(a.valid for a in fields.values()):
        n = {name: int(fields[name].value) for name in SPEC_BOUNDS}
        if n["batch"] * n["n_kv_heads"] > INT32_MAX or n["n_kv_heads"] * n["head_dim"] > INT32_MAX:
            args["products"] = invalid("batch * n_kv_heads or n_kv_heads * head_dim past 2**31 - 1")

    def check(spec):
        for name in SPEC_BOUNDS:
            assert getattr(spec, name) == int(fields[name].value) and type(getattr(spec, name)) is int

    return Call("CacheSpec", tuple(f"CacheSpec.{name}" for name in fields), args,
                lambda: cupykv.CacheSpec(**{name: drawn.value for name, drawn in fields.items()}), check)


@arguments("spec", "backend")
def build_kv_cache(draw, env):
    how = draw(st.sampled_from(("small", "huge") + (("junk spec",) if maybe_bad(draw, "spec") else ()) +
                               (("junk backend",) if maybe_bad(draw, "backend") else ())))
    spec = cupykv.CacheSpec(n_layers=2**20, n_kv_heads=8, head_dim=128, max_seq=2**20, batch=1) \
        if how == "huge" else env.spec   # 2**53 bytes: more than any machine gives
    args = dict(spec=Arg({"n_layers": 1} if how == "junk spec" else spec, how != "junk spec", how),
                backend=Arg("tpu" if how == "junk backend" else "emulator", how != "junk backend", how))

    def check(cache):
        assert how == "small" and not cache.lengths_host().any() and not np.array(cache.k).view(np.uint8).any()

    return Call("KVCache", ("spec", "backend"), args,
                lambda: cupykv.KVCache(args["spec"].value, backend=args["backend"].value), check)
