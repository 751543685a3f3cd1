"""kv_codec.cuh's widen_fp8_word (four E4M3 codes to two pairs of __half) at every pair of codes, and
load_kv (one code to float) at every code.

The tensor-core attention builds its fp8 B fragments with widen_fp8_word; the CUDA-core attention
reads each code with load_kv. Before sm_89, and on the emulator, both widen by bit moves and one
multiply by 2^8 (widen_fp8_pair_by_bits); from sm_89 on by ``cvt.rn.f16x2.e4m3x2``. Both must give
the exact half of every code, -0.0 and the subnormal codes included, and a NaN for each of the two
NaN codes; ml_dtypes' float8_e4m3fn, the reference's format (checked against the toolkit's
conversions in tests/test_fp8_conversions.py), gives the expected values. Each pair of codes
appears in the low and in the high half of a word, so each of the widen's two byte permutes sees
all 65536 pairs.
"""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E
from cupykv.kernels import KERNEL_DIR, cuda_include_dirs

KERNELS = Path(__file__).parent / "emulator_kernels"
SOURCE = KERNELS / "fp8_widen.cu"
NAME = "fp8_widen_words"
LOAD = "fp8_load_codes"
BY_BITS = "-DCUPYKV_FP8_WIDEN_BY_BITS"
HALF_OF_CODE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)


def every_pair_twice() -> np.ndarray:
    """65536 words: pair i in the low half and pair 40503 i mod 2^16 (a bijection) in the high half."""
    pairs = np.arange(1 << 16, dtype=np.uint32)
    return pairs | (((pairs * 40503) & 0xFFFF) << 16)


def expected_halves(words: np.ndarray) -> np.ndarray:
    """[words, 4] float16: the half of each code, in the order low_pair.x, low_pair.y, high_pair.x, .y."""
    codes = words.view(np.uint8).reshape(-1, 4)   # little-endian: the code at the lowest address first
    return HALF_OF_CODE[codes]


def widened_halves(low_pairs: np.ndarray, high_pairs: np.ndarray) -> np.ndarray:
    """The kernel's [words] low and high pairs as [words, 4] float16, in expected_halves' order."""
    return np.stack([low_pairs, high_pairs], axis=1).astype(np.uint32).view(np.uint16).view(np.float16).reshape(-1, 4)


def run_emulator(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """widen_fp8_word of each word (low pairs, high pairs) and load_kv of codes 0..255."""
    module = E.Module(SOURCE.read_text(), [NAME, LOAD], include_dirs=[KERNELS, KERNEL_DIR], filename=str(SOURCE))
    low, high, values = E.zeros(words.size, np.uint32), E.zeros(words.size, np.uint32), E.zeros(256, np.float32)
    module.get_function(NAME)(((words.size + 255) // 256,), (256,), (E.asarray(words), low, high,
                                                                       np.int32(words.size)))
    module.get_function(LOAD)((1,), (256,), (values,))
    return np.array(low), np.array(high), np.array(values)


def run_gpu(words: np.ndarray, extra_options: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import cupy

    includes = tuple(f"-I{d}" for d in (KERNEL_DIR, str(KERNELS), *cuda_include_dirs()[:1]))
    module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17", *includes, *extra_options))
    low, high = cupy.zeros(words.size, cupy.uint32), cupy.zeros(words.size, cupy.uint32)
    values = cupy.zeros(256, cupy.float32)
    module.get_function(NAME)(((words.size + 255) // 256,), (256,), (cupy.asarray(words), low, high,
                                                                       np.int32(words.size)))
    module.get_function(LOAD)((1,), (256,), (values,))
    return cupy.asnumpy(low), cupy.asnumpy(high), cupy.asnumpy(values)


def assert_exact_halves(got: np.ndarray, want: np.ndarray, words: np.ndarray) -> None:
    """Bit for bit wherever the code is a number (so -0.0 stays -0.0); a NaN exactly where it is NaN."""
    nan = np.isnan(want)
    assert nan.any() and (~nan).any()
    differs = ((got.view(np.uint16) != want.view(np.uint16)) & ~nan) | (np.isnan(got) != nan)
    rows = np.flatnonzero(differs.any(axis=1))
    assert rows.size == 0, (f"{rows.size} words widen wrongly; first: word {words[rows[0]]:#010x} -> "
                            f"{[hex(h) for h in got[rows[0]].view(np.uint16)]}, want "
                            f"{[hex(h) for h in want[rows[0]].view(np.uint16)]}")


@pytest.mark.parametrize("runner", [
    "emulator",
    pytest.param("gpu cvt (sm_89 on)", marks=pytest.mark.gpu),
    pytest.param("gpu bit moves", marks=pytest.mark.gpu),
])
def test_every_pair_of_codes_widens_to_its_exact_half(runner):
    words = every_pair_twice()
    if runner == "emulator":
        low, high, values = run_emulator(words)
    else:
        low, high, values = run_gpu(words, (BY_BITS,) if runner == "gpu bit moves" else ())
    assert_exact_halves(widened_halves(low, high), expected_halves(words), words)
    # load_kv: each code's value as float, bit for bit (-0.0 included), NaN for the two NaN codes
    want = HALF_OF_CODE.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(values), nan)
    assert np.array_equal(values[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_the_expected_table_is_every_e4m3_value():
    """The oracle itself: 254 distinct numbers, +-448 the largest, 2^-9 the smallest, two NaN codes."""
    finite = HALF_OF_CODE[~np.isnan(HALF_OF_CODE)]
    assert np.isnan(HALF_OF_CODE).sum() == 2 and np.isnan(HALF_OF_CODE[[0x7F, 0xFF]]).all()
    assert finite.max() == 448 and finite.min() == -448 and np.abs(finite[finite != 0]).min() == 2.0 ** -9
    assert HALF_OF_CODE.view(np.uint16)[0x80] == 0x8000                     # -0.0
    words = np.array([0x807F0100], np.uint32)                               # codes 0x00, 0x01, 0x7f, 0x80
    assert expected_halves(words).view(np.uint16)[0, [0, 1, 3]].tolist() == [0x0000, 0x1800, 0x8000]
    assert np.isnan(expected_halves(words)[0, 2])


@pytest.mark.parametrize("arch", nvrtc_check.ARCHS)
@pytest.mark.parametrize("by_bits", [False, True], ids=["default", "bits forced"])
def test_nvrtc_widens_with_the_intended_instructions(arch, by_bits):
    """sm_80: bit moves and one f16x2 multiply a pair, no loop; sm_90: the cvt, unless bits are forced.

    Three of either: two in widen_fp8_word (a pair each), one in load_kv."""
    nvrtc = nvrtc_check.load_nvrtc()
    program = nvrtc_check.compile_program(nvrtc, SOURCE.name, SOURCE.read_text(), [NAME, LOAD], arch,
                                          include_dirs=(str(KERNELS), KERNEL_DIR),
                                          extra_options=(BY_BITS,) if by_bits else ())
    cvt = program.ptx.count("cvt.rn.f16x2.e4m3x2")
    multiplies = program.ptx.count("mul.rn.f16x2") + program.ptx.count("mul.f16x2")
    assert (cvt, multiplies) == ((3, 0) if arch == "sm_90" and not by_bits else (0, 3))
    # CuPy's -ftz=true flushes fp32 only: a flushing f16 multiply would zero every code of exponent 0,
    # whose bits are a half subnormal before the multiply
    assert "ftz.f16" not in program.ptx
    assert program.ptx.count("bra") == 2          # the bounds tests: no loop, no branch over codes
    assert not [report for report in nvrtc_check.parse_ptxas_log(program.log, program.lowered, arch) if report.spills]
