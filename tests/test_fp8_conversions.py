"""The emulator's E4M3 conversions (include/cuda_fp8.h) against the CUDA toolkit's own cuda_fp8.h.

tests/emulator_kernels/fp8.cu converts element by element; the emulator builds it with its shim,
and g++ builds it (fp8_oracle.cpp) against the toolkit's header, whose host code is the same
arithmetic as the device code below sm_89. They must agree bit for bit at every code (decoding)
and at every rounding tie of E4M3, one step either side of each tie, every subnormal, the
saturation boundary and NaN, from double, float, __half and __nv_bfloat16, saturating or not.
ml_dtypes' float8_e4m3fn, the reference's format, is checked against the same codes.
"""
import os
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv.backends import emulator as E

KERNELS = Path(__file__).parent / "emulator_kernels"
TOOLKIT_INCLUDE = next((Path(root) / "include" for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                                                            "/usr/local/cuda") if root
                        and (Path(root) / "include" / "cuda_fp8.h").exists()), None)
SOURCES = ("double", "float", "half", "bfloat16", "fp8 struct")
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)


def inputs():
    """Doubles at every edge of E4M3 rounding: each finite value, each midpoint between neighbours
    (a tie) and the doubles and floats next to it, the underflow and overflow boundaries, NaN."""
    values = E4M3.astype(np.float64)
    finite = np.unique(values[np.isfinite(values)])                         # -448 .. 448
    ties = (finite[1:] + finite[:-1]) / 2
    near = [np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf),
            np.nextafter(ties.astype(np.float32), np.float32(np.inf)).astype(np.float64),
            np.nextafter(ties.astype(np.float32), np.float32(-np.inf)).astype(np.float64)]
    edges = np.array([2.0 ** -10, 2.0 ** -9, 1.5 * 2.0 ** -10, 2.0 ** -6, 448.0, 464.0, 480.0, 1e9, np.inf])
    edges = np.concatenate([edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf)])
    rng = np.random.default_rng(0)
    random = rng.standard_normal(2000) * np.exp2(rng.integers(-12, 10, 2000))
    return np.concatenate([finite, ties, *near, edges, -edges, random, [0.0, -0.0, np.nan, -np.nan]])


@pytest.fixture(scope="module")
def emulated():
    module = E.Module((KERNELS / "fp8.cu").read_text(), ["fp8_encode", "fp8_decode"],
                      filename=str(KERNELS / "fp8.cu"))
    x = inputs()
    codes = {}
    for source in range(5):
        for saturate in ((1, 0) if source < 2 else (1,)):
            out = E.zeros(x.size, np.uint8)
            module.get_function("fp8_encode")(((x.size + 127) // 128,), (128,),
                                              (E.asarray(x), out, np.int32(x.size), np.int32(source),
                                               np.int32(saturate)))
            codes[source, saturate] = np.array(out)
    half_bits, as_float = E.zeros(256, np.uint16), E.zeros(256, np.float32)
    module.get_function("fp8_decode")((2,), (128,), (half_bits, as_float))
    return x, codes, np.array(half_bits), np.array(as_float)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    if TOOLKIT_INCLUDE is None:
        pytest.skip("no CUDA toolkit headers (cuda_fp8.h under $CUDA_PATH, $CUDA_HOME or /usr/local/cuda)")
    binary = tmp_path_factory.mktemp("fp8") / "oracle"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{TOOLKIT_INCLUDE}", f"-I{KERNELS}",
                    str(KERNELS / "fp8_oracle.cpp"), "-o", str(binary)], check=True, capture_output=True, timeout=300)
    x = inputs()
    printed = subprocess.run([str(binary)], input="\n".join(f"{b:016x}" for b in x.view(np.uint64)), text=True,
                             capture_output=True, check=True, timeout=60).stdout.split("\n")
    rows = [line.split() for line in printed[:x.size]]
    codes = {(source, 1): np.array([int(row[source], 16) for row in rows], np.uint8) for source in range(5)}
    codes[0, 0] = np.array([int(row[5], 16) for row in rows], np.uint8)
    codes[1, 0] = np.array([int(row[6], 16) for row in rows], np.uint8)
    decoded = [line.split()[1:] for line in printed[x.size:x.size + 256]]
    half_bits = np.array([int(h, 16) for h, _ in decoded], np.uint16)
    float_bits = np.array([int(f, 16) for _, f in decoded], np.uint32)
    return codes, half_bits, float_bits


def test_every_encoding_matches_the_toolkit_bit_for_bit(emulated, oracle):
    x, codes, _, _ = emulated
    want, _, _ = oracle
    assert x.size > 3000
    for (source, saturate), got in codes.items():
        bad = np.flatnonzero(got != want[source, saturate])
        assert bad.size == 0, (f"{SOURCES[source]} ({'satfinite' if saturate else 'nosat'}): {bad.size} codes differ, "
                               f"first x={x[bad[0]]!r}: emulator {got[bad[0]]:#04x}, toolkit "
                               f"{want[source, saturate][bad[0]]:#04x}")


def test_every_code_decodes_like_the_toolkit(emulated, oracle):
    _, _, half_bits, as_float = emulated
    _, want_half, want_float = oracle
    assert np.array_equal(half_bits, want_half)
    assert np.array_equal(as_float.view(np.uint32), want_float)


def test_every_code_decodes_to_ml_dtypes_value(emulated):
    """The reference's E4M3 (ml_dtypes.float8_e4m3fn) is the same format: same values, same NaNs."""
    _, _, half_bits, as_float = emulated
    want = E4M3.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(as_float), nan) and nan.sum() == 2
    assert np.array_equal(as_float[~nan].view(np.uint32), want[~nan].view(np.uint32))   # -0.0 included
    assert np.array_equal(half_bits[~nan].view(np.float16).astype(np.float32), want[~nan])


def rounded_once(x):
    """E4M3 codes of clamp(x, -448, 448) rounded once to nearest, ties to the even code, found by comparing
    |x| with the midpoint of its two neighbouring values, which a float64 holds exactly. Not through
    ml_dtypes, whose float64 conversion went through float32 (rounding twice) before version 0.7 and
    rounds once from 0.7 on."""
    positive = E4M3[:0x7F].astype(np.float64)   # codes 0 .. 126: 0 .. 448, ascending
    magnitude = np.minimum(np.abs(x), 448.0)
    above = np.minimum(np.searchsorted(positive, magnitude), 0x7E)   # the first value >= |x|
    below = np.maximum(above - 1, 0)
    middle = (positive[below] + positive[above]) / 2
    code = np.where(magnitude < middle, below,
                    np.where(magnitude > middle, above, np.where(below % 2 == 0, below, above)))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def test_saturating_float_encodings_are_ml_dtypes_of_the_clamped_value(emulated):
    """E4M3(clamp(x, -448, 448)) from float32, rounded to nearest even: the reference's quantizer.

    From double the kernels' conversion rounds once; from float32 it rounds x's float32 value, so a
    double just past a tie (which float32 rounds onto the tie) can take the other code. The kernels
    quantize float32 values, and so does the reference.
    """
    x, codes, _, _ = emulated
    with np.errstate(over="ignore"):   # the largest doubles become float infinities, as in the kernel
        as_float = x.astype(np.float32)
    finite = ~np.isnan(as_float)
    want = np.clip(as_float[finite], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes[1, 1][finite], want)
    assert np.array_equal(codes[0, 1][finite], rounded_once(x[finite]))
    assert np.array_equal(rounded_once(as_float[finite].astype(np.float64)), want)
    twice = x[finite][codes[0, 1][finite] != codes[1, 1][finite]]
    assert twice.size and np.all(np.abs(twice) != np.abs(twice.astype(np.float32)))   # the double rounding
