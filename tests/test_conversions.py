"""The emulator's conversions to float16 and bfloat16 from double and int round once, as the GPU does.

Going through float first rounds twice: a value just off a tie of the 16-bit type (closer
than half an fp32 ulp, 2^-25 to 2^-24 relative) becomes the tie in float, and the tie then
goes to even, which may be the wrong way. Only such operands show it, so the inputs are ties,
ties one double ulp off either way, ties 2^-30 (relative) off, ties 2^-20 off (beyond fp32's
reach: both roundings agree) and ordinary values; about 130 of the 4000 per type tell one
rounding from two.
The expectations are computed exactly here with fractions (not with ml_dtypes, which itself
goes from float64 through float32 to bfloat16). Kernels: tests/emulator_kernels/conversions.cu.
"""
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E

SOURCE = Path(__file__).parent / "emulator_kernels" / "conversions.cu"


class Format:
    """A binary floating-point format: ``precision`` significand bits, normal exponents ``emin..emax``."""

    def __init__(self, name, precision, emin, emax, dtype):
        self.name, self.precision, self.emin, self.emax, self.dtype = name, precision, emin, emax, dtype

    def ulp(self, exponent):
        return Fraction(2) ** (max(exponent, self.emin) - self.precision + 1)

    def round(self, x: float) -> int:
        """Bit pattern of ``x`` rounded once to nearest even (overflow to infinity, NaN to 0x7fff)."""
        if x != x:
            return 0x7FFF   # CUDA's canonical NaN, whatever the sign
        if x in (float("inf"), float("-inf")):
            return self._bits(x)
        exact = abs(Fraction(x))
        if exact == 0:
            return self._bits(x)
        exponent = exact.numerator.bit_length() - exact.denominator.bit_length()   # floor(log2), or one more
        if Fraction(2) ** exponent > exact:
            exponent -= 1
        ulp = self.ulp(exponent)
        rounded = round(exact / ulp) * ulp             # round() of a Fraction: ties to even
        if rounded >= Fraction(2) ** (self.emax + 1):
            rounded = float("inf")
        return self._bits(float(rounded) if x > 0 else -float(rounded))

    def _bits(self, representable: float) -> int:
        # exact: the value is representable, so float64 -> float32 -> 16-bit conversions do not round
        return int(np.array(representable, np.float32).astype(self.dtype).view(np.uint16))

    def ties(self):
        """Midpoints between neighbours of this format, over its range (subnormal, normal, the top)."""
        out = []
        for exponent in (self.emin - 1, self.emin, -1, 0, 3, 10, self.emax):   # emin - 1: subnormals
            ulp = self.ulp(exponent)
            base = Fraction(2) ** exponent if exponent >= self.emin else 0
            for m in (0, 1, 2, 5, 2 ** (self.precision - 1) - 1):   # even and odd neighbours below
                value = base + m * ulp + ulp / 2
                if value < Fraction(2) ** (self.emax + 1):
                    out.append(float(value))
        return out


HALF = Format("float16", 11, -14, 15, np.float16)
BF16 = Format("bfloat16", 8, -126, 127, ml_dtypes.bfloat16)


def _near_ties(ties):
    """Each tie, one double ulp either side, 2^-30 and 2^-20 relative either side, both signs."""
    values = []
    for t in ties:
        values += [t, np.nextafter(t, np.inf), np.nextafter(t, -np.inf)]
        values += [t * (1 + s * 2.0 ** e) for s in (1, -1) for e in (-30, -20)]
    return values + [-v for v in values]


def _inputs():
    rng = np.random.default_rng(11)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 65504.0, 65520.0, 65519.999, 1e300, -1e-300,
               2.0 ** -24, 2.0 ** -25, 2.0 ** -133, 2.0 ** -134, 3.4e38, 3.3961e38]
    random = rng.standard_normal(3000) * np.exp2(rng.integers(-30, 30, 3000))
    return np.array(special + _near_ties(HALF.ties()) + _near_ties(BF16.ties()) + random.tolist(), np.float64)


@pytest.fixture(scope="module")
def module():
    return E.Module(SOURCE.read_text(), ["from_double", "from_int"], filename=str(SOURCE))


def test_the_expectations_are_single_roundings():
    # Cross-checks of the exact rounding above: NumPy converts float64 to float16 in one step,
    # and float32 -> bfloat16 is a single rounding.
    x = _inputs()
    finite = np.isfinite(x)
    with np.errstate(over="ignore"):
        numpy_half = x[finite].astype(np.float16).view(np.uint16)
        x32 = x[finite].astype(np.float32).astype(np.float64)
    assert [HALF.round(v) for v in x[finite]] == numpy_half.tolist()
    with np.errstate(over="ignore"):
        ml_bf16 = x32.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert [BF16.round(v) for v in x32] == ml_bf16.tolist()
    assert HALF.round(65520.0) == 0x7C00 and HALF.round(np.nextafter(65520.0, 0)) == 0x7BFF
    assert BF16.round(1 + 2.0 ** -8) == 0x3F80 and BF16.round(np.nextafter(1 + 2.0 ** -8, 2)) == 0x3F81


@pytest.mark.parametrize("fmt", [HALF, BF16], ids=["float16", "bfloat16"])
def test_double_rounds_once(module, fmt):
    x = _inputs()
    n = x.size
    half_bits, bf16_bits = E.zeros(n, np.uint16), E.zeros(n, np.uint16)
    module.get_function("from_double")((n + 127) // 128, 128, (E.asarray(x), half_bits, bf16_bits, np.int32(n)))
    got = (half_bits if fmt is HALF else bf16_bits).tolist()
    want = [fmt.round(v) for v in x]
    # Left out: bfloat16 results below 2^-126, which pass through an fp32 subnormal that the
    # emulator flushes to zero, as fp32 arithmetic is under CuPy's -ftz=true (test_subnormals.py).
    kept = [not (fmt is BF16 and 0 < abs(v) < 2.0 ** -126) for v in x]
    wrong = [(float(v), hex(g), hex(w)) for v, g, w, k in zip(x, got, want, kept) if k and g != w]
    assert not wrong, f"{len(wrong)} of {n} double -> {fmt.name} conversions wrong, e.g. (x, got, want) {wrong[:4]}"


def test_int_rounds_once_to_bfloat16(module):
    # 2^30 + 2^22 is a bfloat16 tie; +1 is above it but rounds to the tie in float.
    base = [2**30 + 2**22, 2**30 + 3 * 2**22, 2**24 + 2**16, 2**31 - 1, 2**30 + 2**23, 1 << 8, 257, 0, 7]
    x = np.array([s * (b + d) for b in base for d in (-1, 0, 1) for s in (1, -1) if abs(b + d) < 2**31], np.int64)
    x = np.append(x, -(2**31)).astype(np.int32)
    out = E.zeros(x.size, np.uint16)
    module.get_function("from_int")(1, 128, (E.asarray(x), out, np.int32(x.size)))
    assert out.tolist() == [BF16.round(float(v)) for v in x.tolist()]


def test_conversions_source_compiles_with_nvrtc():
    """The test kernels are real CUDA: NVRTC compiles them unchanged for sm_80."""
    nvrtc = nvrtc_check.load_nvrtc()
    nvrtc_check.compile_file(nvrtc, SOURCE.name, SOURCE.read_text(), [], "sm_80")
