"""Arguments for fuzzing cupykv's public API: good ones, borderline ones and bad ones, each labelled.

Every strategy draws an :class:`Arg`: the value to pass and whether the
documented contract allows it (``valid``). The contract is written here in the
test's own terms (an int range, "a normal float32 > 0", "C-contiguous"),
independently of :mod:`cupykv._args`, so a check that refuses too much or
too little shows up as a disagreement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import cupykv
from cupykv import reference, testing

NUMPY_INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
INT_EDGES = (0, 1, -1, 2, 127, 128, 255, 256, 2**15, 2**16, 2**30 - 1, 2**30, 2**31 - 1, 2**31, 2**32, 2**32 + 1,
             2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -2**31, -2**31 - 1, -2**63, -2**63 - 1)
FLOAT32_TINY = float(np.finfo(np.float32).smallest_normal)
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT_EDGES = (0.0, -0.0, -1.0, 1e-50, 1e-40, FLOAT32_TINY, FLOAT32_TINY / 2, math.nextafter(FLOAT32_TINY, 0.0),
               FLOAT32_MAX, 3.4028235e38, 3.5e38, 1e39, 1e308, math.inf, -math.inf, math.nan, 0.5, 1.0, 2.0,
               math.nextafter(1.0, 0.0), 10000.0, 5e5, 2.0**64, 2.0**64 * (1 + 2.0**-20), 1e30)
NUMPY_FLOATS = (np.float16, np.float32, np.float64, np.longdouble)
# Not numbers, or numbers of the wrong kind: every one is refused where an int or a float is expected.
JUNK = (None, True, np.bool_(False), "1", b"1", [1], (1,), {}, 1 + 0j, np.array(1), object())
STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclass(frozen=True)
class Arg:
    """A drawn argument: its value, whether the contract allows it, and how it was made."""

    value: Any
    valid: bool
    how: str = ""

    def __repr__(self):
        return f"Arg({self.how or type(self.value).__name__}, valid={self.valid})"


@dataclass
class Call:
    """One public call: what it is named, how it runs, and how an accepted result is checked."""

    label: str
    names: tuple                       # argument names an error message may start with
    args: dict                         # name -> Arg, for the report
    run: Callable[[], Any]
    check: Callable[[Any], None] = lambda result: None
    valid: bool = field(init=False)

    def __post_init__(self):
        self.valid = all(arg.valid for arg in self.args.values())


def invalid(reason):
    """A pseudo-argument that makes a call invalid for a reason that spans arguments (shapes, aliasing)."""
    return Arg(reason, False, reason)


def shares_memory(a, b) -> bool:
    return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.shares_memory(a, b)


def same_memory(a, b) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


def storage_view(array, env=None):
    """A host copy of a float array argument, bfloat16 bit patterns (uint16) viewed as bfloat16."""
    copy = host(array)
    return copy.view(STORAGE["bfloat16"]) if copy.dtype == np.uint16 else copy


# -- which arguments may be drawn from the bad ones -------------------------------------------------------
_bad = {"tenths": 3, "target": None, "current": None}


def set_bad_arguments(tenths: int = 0, target: str | None = None) -> None:
    """Choose, for the example about to be built, which arguments may come from the bad side.

    ``target``: only the argument of that name (every other one good).
    Otherwise each argument may be bad with probability ``tenths / 10``.
    """
    _bad.update(tenths=tenths, target=target, current=None)


def maybe_bad(draw, name=None) -> bool:
    """Whether argument ``name`` (by default the one :func:`arg` is drawing) may be drawn from the bad ones."""
    name = name or _bad["current"]
    if _bad["target"] is not None:
        return name == _bad["target"]
    return draw(st.integers(0, 9)) < _bad["tenths"]


def arg(draw, name, strategy):
    """Draw argument ``name`` of a call from ``strategy`` (which asks :func:`maybe_bad` about ``name``)."""
    outer, _bad["current"] = _bad["current"], name
    try:
        return draw(strategy)
    finally:
        _bad["current"] = outer


def arguments(*names):
    """Declare the arguments a builder draws, for the test to pick the one that may be bad."""
    def declare(builder):
        builder.arguments = names
        return builder
    return declare


@st.composite
def choices(draw, good, bad):
    """One of the strings (or values) ``good``, or, when this argument may be bad, one of ``bad``."""
    if maybe_bad(draw) and draw(st.booleans()):
        value = draw(st.sampled_from(bad))
        return Arg(value, False, f"junk {value!r}")
    value = draw(st.sampled_from(good))
    return Arg(value, True, repr(value))


# -- scalars -------------------------------------------------------------------------------------------
@st.composite
def ints(draw, lo, hi, junk=True, none_ok=False):
    """An int for a parameter that accepts ``lo..hi``: inside, at the edges, past them, as any integer type.

    With ``junk``, also things that are not ints (None is valid where ``none_ok``: an optional parameter).
    """
    if not maybe_bad(draw):
        value = draw(st.integers(lo, hi) | st.sampled_from(sorted({lo, hi} | {e for e in INT_EDGES if lo <= e <= hi})))
        kind = draw(st.sampled_from([int, *[t for t in NUMPY_INTS if np.iinfo(t).min <= value <= np.iinfo(t).max]]))
        return Arg(kind(value), True, f"{kind.__name__}({value})")
    choices = [st.integers(lo, hi), st.sampled_from((lo - 1, hi + 1)), st.sampled_from(sorted({*INT_EDGES}))]
    if junk:
        choices.append(st.sampled_from(JUNK + (float(max(lo, 0)), np.float32(1))))
    value = draw(st.one_of(choices))
    if isinstance(value, int) and not isinstance(value, bool):
        holders = [t for t in NUMPY_INTS if np.iinfo(t).min <= value <= np.iinfo(t).max]
        kind = draw(st.sampled_from([int, *holders]))
        return Arg(kind(value), lo <= value <= hi, f"{kind.__name__}({value})")
    return Arg(value, value is None and none_ok, f"junk {value!r}")


def _as_float_type(draw, value):
    kind = draw(st.sampled_from((float, *NUMPY_FLOATS) + ((int,) if math.isfinite(value) and value == int(value)
                                                        else ())))
    with np.errstate(over="ignore", under="ignore"):
        return kind(value), kind


def normal_float32(value) -> bool:
    """The contract of scale, softcap and eps: a real number that float32 holds as a normal number > 0."""
    with np.errstate(over="ignore", under="ignore"):
        in_kernel = float(np.float32(float(value)))
    return FLOAT32_TINY <= in_kernel <= FLOAT32_MAX


@st.composite
def floats(draw, contract, typical=st.floats(1e-3, 1e3), none_ok=False):
    """A float for a parameter whose contract is ``contract(value) -> bool``: typical values and every edge.

    Also things that are not real numbers (None is valid where ``none_ok``).
    """
    if not maybe_bad(draw):
        good = [edge for edge in FLOAT_EDGES if contract(edge)]
        value, kind = _as_float_type(draw, draw(typical | st.sampled_from(good)))
        if contract(value):
            return Arg(value, True, f"{kind.__name__}({value!r})")
    edges = st.sampled_from(FLOAT_EDGES)
    value = draw(st.one_of(typical, edges, edges, edges, st.sampled_from(JUNK)))
    if isinstance(value, float):
        value, kind = _as_float_type(draw, value)
        return Arg(value, bool(contract(value)), f"{kind.__name__}({value!r})")
    return Arg(value, value is None and none_ok, f"junk {value!r}")


def softcap_contract(value) -> bool:
    """The contract of softcap: a normal float32 > 0, at most 2**64 (a larger cap flushes s / softcap to zero)."""
    with np.errstate(over="ignore", under="ignore"):
        return normal_float32(value) and float(np.float32(float(value))) <= 2.0**64


def rope_theta_contract(value) -> bool:
    return math.isfinite(float(value)) and float(value) >= 1.0


@st.composite
def ropes(draw, head_dim):
    """None, ``("Rope", theta)`` (the call builds ``Rope(theta)``, which refuses a bad theta), or not a Rope."""
    bad = maybe_bad(draw)
    kind = draw(st.sampled_from(("none", "rope", "rope", "junk") if bad else
                                ("none", "rope") if head_dim % 2 == 0 else ("none",)))
    if kind == "none":
        return Arg(None, True, "no rope")
    if kind == "junk":
        return Arg(draw(st.sampled_from(("neox", 10000.0, 1))), False, "not a Rope")
    theta = draw(floats(rope_theta_contract, st.floats(1.0, 1e6)))
    return Arg(("Rope", theta.value), theta.valid and head_dim % 2 == 0, f"Rope({theta.how})")


def make_rope(value):
    """The rope a call passes: ``Rope(theta)`` for a drawn ``("Rope", theta)``, else the value itself."""
    return cupykv.Rope(value[1]) if isinstance(value, tuple) and value[:1] == ("Rope",) else value


@st.composite
def per_sequence(draw, env, lo, hi):
    """An ``advance``/``truncate`` argument: an int, ``batch`` ints as a list, tuple or NumPy array, a device
    int32 array (contiguous or not, or the cache's own lengths), or junk.

    ``Arg.valid`` covers the form; the caller checks host values against its range with ``lo`` and ``hi``.
    """
    batch = env.spec.batch
    bad = maybe_bad(draw)
    how = draw(st.sampled_from(("int", "list", "tuple", "numpy", "device view", "device view", "junk") if bad
                               else ("int", "list", "tuple", "numpy", "device")))
    if how == "int":
        return draw(ints(lo, hi, junk=False))
    if how in ("list", "tuple", "numpy"):
        size = draw(st.sampled_from((batch, batch, batch + 1, max(batch - 1, 0)))) if bad else batch
        elements = [draw(ints(lo, hi, junk=False)) for _ in range(size)]
        values = [e.value for e in elements]
        valid = size == batch and all(e.valid for e in elements)
        if how == "numpy":
            kind = draw(st.sampled_from([t for t in NUMPY_INTS if all(np.iinfo(t).min <= int(v) <= np.iinfo(t).max
                                                                      for v in values)] or [object]))
            return Arg(np.array([int(v) for v in values], dtype=kind), valid, f"numpy {np.dtype(kind).name} {values}")
        return Arg(values if how == "list" else tuple(values), valid, f"{how} {values}")
    if how == "junk":
        return Arg(draw(st.sampled_from(("1", None, 1.0, [1.0] * batch, [True] * batch, [[1]] * batch))), False,
                   "junk")
    values = env.rng.integers(-2, env.spec.max_seq + 3, batch).astype(np.int32)
    if how == "device":
        return Arg(env.device(values), True, f"device {values.tolist()}")
    view = draw(st.sampled_from(("strided", "reversed", "int64", "lengths", "overflow", "offset")))
    if view == "strided":
        return Arg(env.device(np.repeat(values, 2))[::2], batch == 1, "device strided")
    if view == "reversed":
        return Arg(env.device(values[::-1].copy())[::-1], batch == 1, "device reversed")
    if view == "int64":
        return Arg(env.device(values.astype(np.int64)), False, "device int64")
    if view == "offset":
        return Arg(env.device(np.concatenate([[7], values]).astype(np.int32))[1:], True, "device offset view")
    return Arg(getattr(env.cache, view), False, f"the cache's {view}")


# -- the cache and the arrays of one example -------------------------------------------------------------
class Env:
    """One example's emulator cache, its reference twin, and every buffer the example made."""

    def __init__(self, spec: cupykv.CacheSpec, lengths, seed: int):
        self.spec = spec
        self.cache = cupykv.KVCache(spec, backend="emulator")
        self.oracle = reference.KVCache(spec)
        self.backend = self.cache._backend
        self.rng = np.random.default_rng(seed)
        testing.fill(self.cache, self.oracle, lengths, self.rng)
        self.made = []   # device and host buffers handed to calls: a refused call must leave them unchanged

    def keep(self, array):
        self.made.append(array)
        return array

    def device(self, host):
        return self.keep(self.backend.asarray(host))

    def random(self, shape, dtype):
        """Host values of a storage dtype (normal random, in that dtype) or of any other dtype."""
        values = self.rng.standard_normal(shape)
        return values.astype(STORAGE.get(dtype, dtype))

    def snapshot(self):
        cache = [testing.bits(np.array(a)).copy() for a in (self.cache.k, self.cache.v, self.cache.lengths,
                                                             self.cache.overflow)]
        return cache + [np.array(a).reshape(-1).view(np.uint8).copy() for a in self.made]   # 0-d arrays too


def host(array):
    """A host copy of what a call was given, viewed as a storage dtype where it holds bfloat16 bits."""
    return np.array(array, copy=True)


def _c_contiguous(array) -> bool:
    """The contract's layout rule: elements in row-major order with no gaps (size-1 axes have no stride)."""
    expected = array.itemsize
    for size, stride in reversed(list(zip(array.shape, array.strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@st.composite
def arrays(draw, env: Env, shape, dtype, *, output=False, required=None, judge_dtype=True):
    """An array argument meant to be ``shape`` of ``dtype``, made in one of many ways, good and bad.

    ``Arg.valid`` says whether it is a device array of the right dtype and layout (a host array is not):
    views into a larger buffer (offset, strided, reversed, transposed) are
    valid exactly when C-contiguous, and an output must be writeable. Its
    shape is the caller's to judge (``shape`` or another), and so is its dtype
    when ``judge_dtype`` is False (an op takes whichever float dtype its first
    operand has). ``required`` (by default: unless ``output``) makes None
    invalid. Values are random, so a result that ignores them shows.
    """
    storage = np.dtype(STORAGE.get(dtype, dtype))
    required = not output if required is None else required   # an output may be None: the op allocates one
    good = ("device", "device", "offset view") + (() if output else ("read-only",)) + \
        (("bfloat16 bits",) if dtype == "bfloat16" else ())
    bad = ("host", "read-only", "strided", "reversed", "transposed", "wrong dtype", "other shape", "zero-size", "list",
           "none", "scalar")
    how = draw(st.sampled_from(good + bad if maybe_bad(draw) else good))
    values = env.random(shape, storage)
    if how in ("device", "bfloat16 bits"):
        return Arg(env.device(values.view(np.uint16) if how == "bfloat16 bits" else values), True, how)
    if how == "offset view":
        buffer = env.device(env.random((math.prod(shape) + 3,), storage))
        return Arg(buffer[3:].reshape(shape), True, how)
    if how == "host":   # a plain NumPy array: every backend, the emulator too, wants its own device arrays
        return Arg(env.keep(values), False, how)
    if how == "read-only":
        array = env.device(values)
        array.flags.writeable = False
        return Arg(array, not output, how)
    if how == "strided":
        array = env.device(env.random(shape[:-1] + (2 * shape[-1],), storage))[..., ::2]
    elif how == "reversed":
        array = env.device(values)[::-1]
    elif how == "transposed":
        array = env.device(np.ascontiguousarray(values.T)).T
    elif how == "wrong dtype":
        other = draw(st.sampled_from([d for d in (np.float64, np.float32, np.float16, np.int32, np.int64)
                                      if np.dtype(d) != storage]))
        return Arg(env.device(env.random(shape, other)), not judge_dtype, f"dtype {np.dtype(other).name}")
    elif how == "other shape":
        axis = draw(st.integers(0, len(shape)))
        other = draw(st.sampled_from((shape[:axis] + (2,) + shape[axis:],
                                      shape[:axis] + (shape[axis] + 1,) + shape[axis + 1:] if axis < len(shape)
                                      else shape[1:])))
        return Arg(env.device(env.random(other, storage)), True, f"shape {other}")
    elif how == "zero-size":
        axis = draw(st.integers(0, len(shape) - 1))
        return Arg(env.device(np.zeros(shape[:axis] + (0,) + shape[axis + 1:], storage)), True, "zero-size")
    elif how == "list":
        return Arg(values.astype(np.float64).tolist(), False, how)
    elif how == "none":
        return Arg(None, not required, how)
    else:
        return Arg(1.0, False, how)
    return Arg(array, _c_contiguous(array) and not (output and not array.flags.writeable), how)


def shape_of(arg: Arg):
    """The shape of an array argument, or None for anything else."""
    return tuple(arg.value.shape) if isinstance(arg.value, np.ndarray) else None


def float_dtype(arg: Arg):
    """The float dtype name an array argument holds (uint16 holds bfloat16 bits), or None."""
    if not isinstance(arg.value, np.ndarray):
        return None
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16",
            STORAGE["bfloat16"]: "bfloat16"}.get(arg.value.dtype)


def overlapping(env: Env, first_host, second_shape, second_dtype, shift_bytes=4):
    """Two views of one device buffer: ``first_host``'s values ``shift_bytes`` in, and ``second`` from byte 0.

    They share every byte but the first ``shift_bytes`` (a view one element off).
    """
    second_nbytes = math.prod(second_shape) * np.dtype(second_dtype).itemsize
    raw = env.device(np.zeros(max(first_host.nbytes, second_nbytes) + 2 * shift_bytes, np.uint8))
    first = raw[shift_bytes: shift_bytes + first_host.nbytes].view(first_host.dtype).reshape(first_host.shape)
    first[...] = env.backend.asarray(first_host)
    second = raw[:second_nbytes].view(second_dtype).reshape(second_shape)
    return first, second


def cache_view(env: Env, shape, dtype, which):
    """A contiguous view of one of the cache's buffers with ``shape`` and ``dtype``, or None if it does not fit."""
    buffer = {"k": env.cache.k, "v": env.cache.v, "lengths": env.cache.lengths, "overflow": env.cache.overflow}[which]
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > buffer.nbytes or nbytes == 0:
        return None
    return buffer.reshape(-1).view(np.uint8)[:nbytes].view(dtype).reshape(shape)
