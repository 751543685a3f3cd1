"""Builders of fuzzed ``cupykv.ops`` calls (see test_fuzz_api).

An op takes the float dtype of its first operand; every other float operand
and ``out`` must have it. ``out`` (and ``embedding``'s ``error_flag``) must
share no memory with another argument, except that ``out`` may be exactly an
input where the op documents in-place use (``add``, ``silu_mul``: either
input; ``rmsnorm``: ``x``). Accepted results are checked against
``cupykv.ops_reference`` within the tolerances of ``test_ops``.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from cupykv import ops, ops_reference, testing
from fuzz_args import (STORAGE, Arg, Call, arg, arguments, arrays, cache_view, float_dtype, floats, host, invalid,
                       maybe_bad, normal_float32, overlapping, same_memory, shape_of, shares_memory, storage_view)
from test_ops import assert_linear_close, assert_within_ulps, fp32_error_ulps

NONE = Arg(None, True, "none")


def draw_output(draw, env, inputs, shape, dtype):
    """Draw ``out`` for an op reading ``inputs`` (name -> Arg; an input rebuilt under ``out`` is replaced there).

    None, a fresh array, one of the inputs itself, a view one element over an input, or a view of the
    example's cache (no op may write there).
    """
    candidates = [name for name, drawn in inputs.items() if shape_of(drawn) and drawn.valid]
    how = draw(st.sampled_from(("none", "array", "array", "input itself") +
                               (("over an input", "the cache's") if maybe_bad(draw, "out") else ())))
    if how == "the cache's":
        view = cache_view(env, shape, STORAGE.get(dtype, dtype), draw(st.sampled_from(("k", "v", "lengths"))))
        return NONE if view is None else Arg(view, False, "the cache's")
    if how == "none" or (how != "array" and not candidates):
        return NONE
    if how == "array":
        return arg(draw, "out", arrays(env, shape, dtype, output=True, judge_dtype=False))
    name = draw(st.sampled_from(candidates))
    if how == "input itself":
        same = inputs[name]
        return Arg(same.value, same.value.flags.writeable, f"{name} itself")
    first, over = overlapping(env, host(inputs[name].value), shape, STORAGE.get(dtype, dtype))
    inputs[name] = Arg(first, True, inputs[name].how + ", under out")
    return Arg(over, True, f"over {name}")


def cross_checks(args, dtype, float_shapes, int_shapes=None, written=("out",), in_place=()):
    """Pseudo-arguments for what breaks a cross-argument rule: shapes, dtypes and aliasing.

    ``float_shapes``/``int_shapes``: name -> the shape that array must have (float arrays of ``dtype``, int32
    arrays); arguments that are not arrays are judged by their own Arg.
    """
    problems = {}
    for names, want in ((float_shapes, dtype), (int_shapes or {}, "int32")):
        for name, shape in names.items():
            drawn = args[name]
            if not isinstance(drawn.value, np.ndarray):
                continue
            have = "int32" if drawn.value.dtype == np.int32 else float_dtype(drawn)
            if shape_of(drawn) != shape or have != want:
                problems[f"{name} form"] = invalid(f"{name} {drawn.value.dtype} {shape_of(drawn)}, "
                                                   f"expected {want} {shape}")
    for name in written:
        target = args.get(name, NONE).value
        for other, drawn in args.items():
            if other != name and isinstance(target, np.ndarray) and shares_memory(target, drawn.value) and \
                    not (other in in_place and same_memory(target, drawn.value)):
                problems[f"{name} over {other}"] = invalid(f"{name} overlaps {other}")
    return problems


def _rows_and_dtype(draw):
    return draw(st.sampled_from(("float32", "float16", "bfloat16"))), draw(st.integers(1, 3))


def _two_d(shape):
    return shape is not None and len(shape) == 2 and min(shape) >= 1


@arguments("x", "weight", "out")
def build_linear(draw, env):
    dtype, rows = _rows_and_dtype(draw)
    in_features, out_features = draw(st.sampled_from((1, 3, 8))), draw(st.sampled_from((1, 5)))
    args = dict(x=arg(draw, "x", arrays(env, (rows, in_features), dtype, judge_dtype=False)))
    x_shape = shape_of(args["x"]) or (rows, in_features)
    args["weight"] = arg(draw, "weight", arrays(env, (out_features, x_shape[-1] if x_shape else 1), dtype,
                                                judge_dtype=False))
    w_shape = shape_of(args["weight"]) or (out_features, in_features)
    op_dtype = float_dtype(args["x"]) or dtype
    args["out"] = draw_output(draw, env, args, (x_shape[0] if x_shape else rows, w_shape[0] if w_shape else 1),
                              op_dtype)
    if _two_d(x_shape) and _two_d(w_shape) and w_shape[1] == x_shape[1]:
        args.update(cross_checks(args, op_dtype, dict(x=x_shape, weight=w_shape, out=(x_shape[0], w_shape[0]))))
    else:
        args["shapes"] = invalid(f"x {x_shape}, weight {w_shape}")
    x, weight = (storage_view(args[n].value, env) if shape_of(args[n]) else None for n in ("x", "weight"))

    def check(result):
        assert args["out"].value is None or same_memory(result, args["out"].value)
        want = ops_reference.linear(x, weight)
        assert_linear_close(storage_view(result, env).view(want.dtype), x, weight, want, op_dtype, "(fuzz)")

    return Call("linear", ("x", "weight", "out"), args,
                lambda: ops.linear(args["x"].value, args["weight"].value, out=args["out"].value), check)


@arguments("ids", "table", "error_flag", "out")
def build_embedding(draw, env):
    dtype, rows = _rows_and_dtype(draw)
    vocab, hidden = draw(st.sampled_from((1, 4))), draw(st.sampled_from((1, 8)))
    args = dict(ids=arg(draw, "ids", arrays(env, (rows,), np.int32, judge_dtype=False)),
                table=arg(draw, "table", arrays(env, (vocab, hidden), dtype, judge_dtype=False)),
                error_flag=arg(draw, "error_flag", st.just(NONE) | arrays(env, (1,), np.int32, output=True,
                                                                          judge_dtype=False)))
    ids_shape, table_shape = shape_of(args["ids"]), shape_of(args["table"])
    op_dtype = float_dtype(args["table"]) or dtype
    args["out"] = draw_output(draw, env, args, (ids_shape[0] if ids_shape else rows,
                                                table_shape[-1] if table_shape else hidden), op_dtype)
    if ids_shape is not None and len(ids_shape) == 1 and ids_shape[0] >= 1 and _two_d(table_shape):
        args.update(cross_checks(args, op_dtype, dict(table=table_shape, out=(ids_shape[0], table_shape[1])),
                                 dict(ids=ids_shape, error_flag=(1,)), written=("out", "error_flag")))
    else:
        args["shapes"] = invalid(f"ids {ids_shape}, table {table_shape}")
    ids, table = (host(args[n].value) if shape_of(args[n]) else None for n in ("ids", "table"))
    flag = host(args["error_flag"].value) if shape_of(args["error_flag"]) else np.zeros(1, np.int32)

    def check(result):
        want = ops_reference.embedding(ids, storage_view(table, env), error_flag=flag)
        assert np.array_equal(testing.bits(storage_view(result, env)), testing.bits(want))
        if args["error_flag"].value is not None:
            assert host(args["error_flag"].value).tolist() == flag.tolist()

    return Call("embedding", ("ids", "table", "out", "error_flag"), args,
                lambda: ops.embedding(args["ids"].value, args["table"].value, out=args["out"].value,
                                      error_flag=args["error_flag"].value), check)


@arguments("x", "weight", "eps", "out")
def build_rmsnorm(draw, env):
    dtype, rows = _rows_and_dtype(draw)
    hidden = draw(st.sampled_from((1, 8, 9)))
    args = dict(x=arg(draw, "x", arrays(env, (rows, hidden), dtype, judge_dtype=False)))
    x_shape = shape_of(args["x"])
    args["weight"] = arg(draw, "weight", arrays(env, (x_shape[-1] if x_shape else hidden,), dtype, judge_dtype=False))
    args["eps"] = arg(draw, "eps", floats(normal_float32, st.sampled_from((1e-6, 1e-5, 0.5))))
    op_dtype = float_dtype(args["x"]) or dtype
    args["out"] = draw_output(draw, env, args, x_shape or (rows, hidden), op_dtype)
    if _two_d(x_shape):
        args.update(cross_checks(args, op_dtype, dict(x=x_shape, weight=(x_shape[1],), out=x_shape),
                                 in_place=("x",)))
    else:
        args["shapes"] = invalid(f"x {x_shape}")
    x, weight = (storage_view(args[n].value, env) if shape_of(args[n]) else None for n in ("x", "weight"))

    def check(result):
        want = ops_reference.rmsnorm(x, weight, args["eps"].value)
        ulps = fp32_error_ulps(op_dtype, x.shape[1] / 2 + 15)
        assert_within_ulps(storage_view(result, env).view(want.dtype), want, ulps, "rmsnorm (fuzz)")

    return Call("rmsnorm", ("x", "weight", "eps", "out"), args,
                lambda: ops.rmsnorm(args["x"].value, args["weight"].value, args["eps"].value, out=args["out"].value),
                check)


def elementwise(op, first, second):
    """The builder of ``add`` (a, b) or ``silu_mul`` (gate, up): one shape of any rank, ``out`` may be an input."""
    @arguments(first, second, "out")
    def build(draw, env):
        dtype = draw(st.sampled_from(("float32", "float16", "bfloat16")))
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        args = {first: arg(draw, first, arrays(env, shape, dtype, judge_dtype=False))}
        a_shape = shape_of(args[first])
        args[second] = arg(draw, second, arrays(env, a_shape or shape, dtype, judge_dtype=False))
        op_dtype = float_dtype(args[first]) or dtype
        args["out"] = draw_output(draw, env, args, a_shape or shape, op_dtype)
        if a_shape and min(a_shape) >= 1:
            args.update(cross_checks(args, op_dtype, {first: a_shape, second: a_shape, "out": a_shape},
                                     in_place=(first, second)))
        else:
            args["shapes"] = invalid(f"{first} {a_shape}")
        a, b = (storage_view(args[n].value, env) if shape_of(args[n]) else None for n in (first, second))

        def check(result):
            want = getattr(ops_reference, op)(a, b)
            ulps = 1 if op == "add" else fp32_error_ulps(op_dtype, 7)
            assert_within_ulps(storage_view(result, env).view(want.dtype), want, ulps, f"{op} (fuzz)")

        return Call(op, (first, second, "out"), args,
                    lambda: getattr(ops, op)(args[first].value, args[second].value, out=args["out"].value), check)
    return build


@arguments("logits", "out")
def build_argmax(draw, env):
    dtype, rows = _rows_and_dtype(draw)
    vocab = draw(st.sampled_from((1, 7)))
    args = dict(logits=arg(draw, "logits", arrays(env, (rows, vocab), dtype, judge_dtype=False)))
    l_shape = shape_of(args["logits"])
    op_dtype = float_dtype(args["logits"]) or dtype
    args["out"] = draw_output(draw, env, args, (l_shape[0] if l_shape else rows,), np.int32)
    if _two_d(l_shape):
        args.update(cross_checks(args, op_dtype, dict(logits=l_shape), dict(out=l_shape[:1])))
    else:
        args["shapes"] = invalid(f"logits {l_shape}")
    logits = storage_view(args["logits"].value, env) if l_shape else None

    def check(result):
        assert host(result).tolist() == ops_reference.argmax(logits).tolist()

    return Call("argmax", ("logits", "out"), args, lambda: ops.argmax(args["logits"].value, out=args["out"].value),
                check)


BUILDERS = {"linear": build_linear, "embedding": build_embedding, "rmsnorm": build_rmsnorm,
            "add": elementwise("add", "a", "b"), "silu_mul": elementwise("silu_mul", "gate", "up"),
            "argmax": build_argmax}
