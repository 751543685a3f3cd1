"""Tensor-core fragments on the emulator (cupykv/kernels/mma.cuh): mma.sync m16n8k16 and ldmatrix,
table-driven from the PTX ISA.

The lane <-> element tables below are the ISA's ("Matrix Fragments for mma.m16n8k16 with
floating point type": the fragment layouts of A, B and C/D for .f16/.bf16 with .f32
accumulators; "Warp-level matrix load instruction: ldmatrix": which lanes give row addresses and
the fragment each lane receives), written out here independently of the emulator
(fragments.cpp). The kernels (tests/emulator_kernels/fragments.cu) only move registers, so each
test checks the emulator's tables against these.

Accumulation: the ISA leaves the order of mma's additions unspecified. The emulator adds
C + A[i][0] B[0][j] + ... + A[i][15] B[15][j] in fp32, k ascending, rounding each addition to
nearest (products of 16-bit values are exact in fp32). Integer-valued inputs make every order
exact, so those tests compare bit for bit with a float64 matmul; random inputs are compared bit
for bit with that stated order, and within 2 (K + 1) 2^-24 (|C| + sum |A||B|) of float64, a
bound any fp32 summation order (truncating or rounding) meets.

The emulator never runs the wrappers' inline PTX, so its operand order is read from NVRTC's PTX:
each operand register traced to the constant it holds or the store that takes it.
"""
import functools
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E
from cupykv.kernels import KERNEL_DIR
from compile_refusals import assert_refused_by_both_compilers
from source_lines import source_site

KERNELS = Path(__file__).parent / "emulator_kernels"
SOURCE = KERNELS / "fragments.cu"
HEADER = Path(KERNEL_DIR) / "mma.cuh"
DTYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
LDMATRIX = [f"ldmatrix_lanes<{m}, {t}>" for m in (1, 2, 4) for t in ("false", "true")]
NAMES = [f"mma_lanes<{t}>" for t in DTYPES] + LDMATRIX + [f"tile_products<{t}>" for t in DTYPES]
K = 16


line = functools.partial(source_site, SOURCE)   # 'fragments.cu:LINE' of a needle


# ---- the PTX ISA's fragment tables (groupID = lane >> 2, threadID_in_group = lane % 4) ----------
def a_position(lane, i):
    """Figure "MMA .m16n8k16 fragment layout for matrix A with .f16/.bf16 type": element a_i of a lane."""
    group, tig = lane >> 2, lane % 4
    row = group if i < 2 or 4 <= i < 6 else group + 8
    return row, tig * 2 + (i & 1) + (8 if i >= 4 else 0)


def b_position(lane, i):
    """Figure "MMA .m16n8k16 fragment layout for matrix B with .f16/.bf16 type": element b_i."""
    group, tig = lane >> 2, lane % 4
    return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group


def c_position(lane, i):
    """Figure "MMA .m16n8k16 fragment layout for accumulator matrix C/D with .f32 type": element c_i."""
    group, tig = lane >> 2, lane % 4
    return group if i < 2 else group + 8, tig * 2 + (i & 1)


def pack(matrix, position, count):
    """[32, count // 2] uint32 registers of one 16-bit matrix: elements 2r (low half) and 2r + 1."""
    bits = matrix.view(np.uint16)
    regs = np.zeros((32, count // 2), np.uint32)
    for lane in range(32):
        for i in range(count):
            regs[lane, i // 2] |= np.uint32(bits[position(lane, i)]) << np.uint32(16 * (i & 1))
    return regs


def scatter(matrix, position, count):
    """[32, count] floats of a float32 matrix, element c_i of each lane."""
    return np.array([[matrix[position(lane, i)] for i in range(count)] for lane in range(32)], np.float32)


def gather(regs, position, shape):
    out = np.full(shape, np.nan, np.float32)
    for lane in range(32):
        for i in range(regs.shape[1]):
            out[position(lane, i)] = regs[lane, i]
    return out


@pytest.mark.parametrize("position, count, shape", [(a_position, 8, (16, 16)), (b_position, 4, (16, 8)),
                                                    (c_position, 4, (16, 8))], ids=["A", "B", "C"])
def test_each_table_gives_every_element_to_exactly_one_lane(position, count, shape):
    seen = sorted(position(lane, i) for lane in range(32) for i in range(count))
    assert seen == sorted((r, c) for r in range(shape[0]) for c in range(shape[1]))


# ---- mma ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module():
    return E.Module(SOURCE.read_text(), NAMES, include_dirs=[KERNELS, KERNEL_DIR], filename=str(SOURCE))


def run_mma(module, cuda_type, a, b, c, mode=0, threads=None):
    """a [warps, 16, 16], b [warps, 16, 8] (16-bit), c [warps, 16, 8] float32 -> D [warps, 16, 8]."""
    warps = a.shape[0]
    a_regs = E.asarray(np.concatenate([pack(a[w], a_position, 8) for w in range(warps)]))
    b_regs = E.asarray(np.concatenate([pack(b[w], b_position, 4) for w in range(warps)]))
    c_regs = E.asarray(np.concatenate([scatter(c[w], c_position, 4) for w in range(warps)]))
    d_regs = E.zeros((warps * 32, 4), np.float32)
    module.get_function(f"mma_lanes<{cuda_type}>")(1, threads or warps * 32, (a_regs, b_regs, c_regs, d_regs,
                                                                              np.int32(mode)))
    return np.stack([gather(d_regs[32 * w:32 * (w + 1)], c_position, (16, 8)) for w in range(warps)])


def stated_order(a, b, c):
    """The emulator's stated accumulation: fp32, k ascending, one rounding per addition."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    acc = c.astype(np.float32).copy()
    for k in range(K):
        acc = (acc + a32[..., :, k, None] * b32[..., None, k, :]).astype(np.float32)
    return acc


@pytest.mark.parametrize("cuda_type", DTYPES)
def test_mma_follows_the_isa_tables_exactly(module, cuda_type):
    rng = np.random.default_rng(7)
    dtype = DTYPES[cuda_type]
    warps = 3   # each warp its own tile: warps are independent
    a = rng.integers(-8, 9, (warps, 16, 16)).astype(dtype)
    b = rng.integers(-8, 9, (warps, 16, 8)).astype(dtype)
    c = rng.integers(-100, 101, (warps, 16, 8)).astype(np.float32)
    d = run_mma(module, cuda_type, a, b, c)
    np.testing.assert_array_equal(d, a.astype(np.float64) @ b.astype(np.float64) + c)


@pytest.mark.parametrize("cuda_type", DTYPES)
def test_mma_accumulates_in_fp32_in_the_stated_order(module, cuda_type):
    rng = np.random.default_rng(11)
    dtype = DTYPES[cuda_type]
    a = rng.standard_normal((2, 16, 16)).astype(dtype)
    b = rng.standard_normal((2, 16, 8)).astype(dtype)
    c = rng.standard_normal((2, 16, 8)).astype(np.float32)
    d = run_mma(module, cuda_type, a, b, c)
    np.testing.assert_array_equal(d, stated_order(a, b, c))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = 2 * (K + 1) * 2.0**-24 * (np.abs(c) + np.abs(a64) @ np.abs(b64))
    error = np.abs(d - (a64 @ b64 + c))
    assert (error <= bound).all(), f"max error {error.max():.3g}, mean {error.mean():.3g}"


@pytest.mark.parametrize("cuda_type", DTYPES)
def test_mma_rows_of_zeros_give_the_stated_orders_bits(module, cuda_type):
    """The emulator skips the additions of an all-zero row of A (a short tile's padding, as in
    kernels/linear_mma.cu); its results must still be the stated order's, bit for bit: the sign
    of a zero sum from zeros of either sign in A and C, NaN in C, and inf or NaN in B."""
    rng = np.random.default_rng(13)
    dtype = DTYPES[cuda_type]
    a = rng.standard_normal((6, 16, 16)).astype(dtype)
    a[:, 3:] = 0.0
    a[:, 5:9] = -0.0
    a[:, 9, ::2] = -0.0
    a[4, :4] = -0.0                      # rows that are zero but in their first or last element:
    a[4, 0, 0] = a[4, 1, 15] = 0.0       # one +0 product among -0 ones sums to +0
    a[4, 2, 0] = a[4, 3, 15] = 1.0       # not a zero row
    b = rng.standard_normal((6, 16, 8)).astype(dtype)
    b[1] = np.abs(b[1])                  # -0 rows of A times positive B: every product -0
    b[4] = np.abs(b[4]) + 1
    b[2, 4, 1] = np.inf                  # 0 * inf = NaN: the column's zero rows are NaN
    b[3, 0, 0] = np.nan
    b[5, 15, 7] = -np.inf                # the last element of B
    c = rng.standard_normal((6, 16, 8)).astype(np.float32)
    c[:, 3:10, :4] = -0.0
    c[:, 10:, 4:] = 0.0
    c[:, 12, 2] = np.nan
    c[4, :2] = -0.0
    d = run_mma(module, cuda_type, a, b, c)
    with np.errstate(invalid="ignore"):   # 0 * inf, on purpose
        want = stated_order(a, b, c)
    assert np.array_equal(np.isnan(d), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(d[finite].view(np.uint32), want[finite].view(np.uint32))
    assert (np.signbit(d[1, 5:9, :4]) & (d[1, 5:9, :4] == 0)).all()   # the -0 case is there to be checked
    assert (~np.signbit(d[4, :2]) & (d[4, :2] == 0)).all()            # and the +0 one
    assert np.isnan(d[5, 3:, 7]).all()


def test_mma_needs_every_lane_of_the_warp(module):
    a = np.zeros((1, 16, 16), np.float16)
    b = np.zeros((1, 16, 8), np.float16)
    c = np.zeros((1, 16, 8), np.float32)
    with pytest.raises(E.BarrierError, match=r"mma.sync.m16n8k16 \(f16\) at mma.cuh:\d+ \(inlined into "
                                             r"fragments.cu:\d+\) in warp 0: needs all 32 lanes of the warp"):
        run_mma(module, "__half", a, b, c, threads=16)
    with pytest.raises(E.BarrierError, match="which exited"):
        run_mma(module, "__half", a, b, c, mode=2)
    with pytest.raises(E.BarrierError) as caught:   # lanes 16-31 call from another line of the kernel
        run_mma(module, "__half", a, b, c, mode=1)
    message = str(caught.value)
    calls = [i + 1 for i, text in enumerate(SOURCE.read_text().splitlines())
             if text.strip() == "mma_m16n8k16<T>(rd, ra, rb, rc);"]
    assert "deadlock" in message and len(calls) == 2
    for call in calls:
        assert f"(inlined into {SOURCE.name}:{call})" in message, message
    d = run_mma(module, "__half", np.ones((1, 16, 16), np.float16), np.ones((1, 16, 8), np.float16), c)
    assert (d == 16).all()   # the emulator still works


# ---- ldmatrix -------------------------------------------------------------------------------------
def expected_ldmatrix(tile, offsets, matrices, trans):
    """[threads, matrices] uint32 per the ISA: lanes 8m..8m+7 give matrix m's rows; a lane gets row
    lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1 (low half first); .trans: those rows of
    column lane / 4."""
    threads = offsets.size
    out = np.zeros((threads, matrices), np.uint32)
    for t in range(threads):
        warp, lane = divmod(t, 32)
        rows = offsets[32 * warp:32 * warp + 32]
        for m in range(matrices):
            if trans:
                lo = tile[rows[8 * m + 2 * (lane % 4)] + lane // 4]
                hi = tile[rows[8 * m + 2 * (lane % 4) + 1] + lane // 4]
            else:
                lo = tile[rows[8 * m + lane // 4] + 2 * (lane % 4)]
                hi = tile[rows[8 * m + lane // 4] + 2 * (lane % 4) + 1]
            out[t, m] = int(lo) | int(hi) << 16
    return out


def run_ldmatrix(module, matrices, trans, offsets, mode=0, rows=40, extra_shared=0):
    tile = np.arange(rows * 8, dtype=np.uint16) * np.uint16(3) + np.uint16(1)   # distinct values
    out = E.zeros((offsets.size, 4), np.uint32)
    module.get_function(f"ldmatrix_lanes<{matrices}, {'true' if trans else 'false'}>")(
        1, offsets.size, (E.asarray(tile), np.int32(tile.size), E.asarray(offsets.astype(np.int32)), out,
                          np.int32(mode)), shared_mem=tile.size * 2 + extra_shared)
    return tile, out[:, :matrices]


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("matrices", [1, 2, 4])
def test_ldmatrix_gives_each_lane_the_isa_fragment(module, matrices, trans):
    rng = np.random.default_rng(matrices + 10 * trans)
    threads, rows = 64, 40
    offsets = np.concatenate([rng.permutation(rows)[:32] * 8 for _ in range(threads // 32)])
    for warp in range(threads // 32):   # lanes that give no row address: ignored, even misaligned
        offsets[32 * warp + 8 * matrices:32 * warp + 32] = 3
    tile, got = run_ldmatrix(module, matrices, trans, offsets, rows=rows)
    np.testing.assert_array_equal(got, expected_ldmatrix(tile, offsets, matrices, trans))


def ldmatrix_call():
    return line("ldmatrix<MATRICES, TRANS>(r, row);")


def test_ldmatrix_of_rows_other_lanes_wrote_needs_synchronisation(module):
    offsets = np.arange(32) * 8
    with pytest.raises(E.RaceError) as caught:   # ldmatrix orders nothing between lanes
        run_ldmatrix(module, 4, False, offsets, mode=1)
    assert f"(inlined into {ldmatrix_call()})" in str(caught.value)
    assert line("for (int i = t; i < elements; i += blockDim.x) smem_tile[i] = tile[i];") in str(caught.value)
    tile, got = run_ldmatrix(module, 4, False, offsets, mode=3)   # __syncwarp() orders the lanes
    np.testing.assert_array_equal(got, expected_ldmatrix(tile, offsets, 4, False))


@pytest.mark.parametrize("case, match", [
    ("misaligned", r"row address 0x[0-9a-f]+ of lane 22 \(matrix 2, row 6\) is not 16-byte aligned"),
    ("global", r"row address 0x[0-9a-f]+ of lane 0 \(matrix 0, row 0\) is not in shared memory"),
    ("past-the-end", r"row address 0x[0-9a-f]+ of lane 31 \(matrix 3, row 7\) runs past the end of shared memory"),
    ("last-byte-past-the-end", r"row address 0x[0-9a-f]+ of lane 17 \(matrix 2, row 1\) runs past the end of "
                               r"shared memory"),
])
def test_ldmatrix_row_addresses_the_gpu_would_not_accept_fail(module, case, match):
    offsets = np.arange(32) * 8
    mode, extra = 0, 0
    if case == "misaligned":
        offsets[22] += 4   # lane 22 is matrix 2, row 6: a wrong divisor names another matrix or row
    elif case == "global":
        mode = 2
    elif case == "past-the-end":
        offsets[31] = 40 * 8   # the first byte past the tile: 8 bytes of shared memory are left there
        extra = 8
    else:
        offsets[17] = 40 * 8   # the row's last byte only lies past the end
        extra = 15
    with pytest.raises(E.FragmentError, match=rf"ldmatrix.sync.m8n8 at mma.cuh:\d+ \(inlined into "
                                              rf"{ldmatrix_call()}\) in warp 0: {match}"):
        run_ldmatrix(module, 4, False, offsets, mode=mode, extra_shared=extra)


def test_an_mma_short_of_lanes_names_its_own_warp(module):
    """Warps 0-15 are whole and their mma completes; warp 16 has 16 lanes (threads 512-527). The
    report names warp 16 for whichever of its lanes reports (thread // 32, not another divisor)."""
    warps = 17
    a = np.zeros((warps, 16, 16), np.float16)
    b = np.zeros((warps, 16, 8), np.float16)
    c = np.zeros((warps, 16, 8), np.float32)
    with pytest.raises(E.BarrierError, match=r"mma.sync.m16n8k16 \(f16\) at mma.cuh:\d+ \(inlined into "
                                             r"fragments.cu:\d+\) in warp 16: needs all 32 lanes of the warp"):
        run_mma(module, "__half", a, b, c, threads=16 * 32 + 16)


def test_an_ldmatrix_row_address_fault_names_its_own_warp(module):
    """17 warps, every row address good but lane 22 of warp 16's: the report names warp 16 and the
    lane within it."""
    offsets = np.tile(np.arange(32) * 8, 17)
    offsets[16 * 32 + 22] += 4
    with pytest.raises(E.FragmentError, match=rf"ldmatrix.sync.m8n8 at mma.cuh:\d+ \(inlined into "
                                              rf"{ldmatrix_call()}\) in warp 16: row address 0x[0-9a-f]+ of lane 22 "
                                              r"\(matrix 2, row 6\) is not 16-byte aligned"):
        run_ldmatrix(module, 4, False, offsets)


def test_ldmatrix_of_a_copy_in_flight_fails_and_after_the_wait_reads_it(module):
    offsets = np.arange(32) * 8
    read = (rf"a read of 16 bytes of dynamic shared memory byte offset \d+ by thread \(\d+,0,0\) at mma.cuh:\d+ "
            rf"\(inlined into {ldmatrix_call()}\)")
    with pytest.raises(E.AsyncCopyError, match=read):
        run_ldmatrix(module, 4, True, offsets, mode=4)
    tile, got = run_ldmatrix(module, 4, True, offsets, mode=5)
    np.testing.assert_array_equal(got, expected_ldmatrix(tile, offsets, 4, True))


# ---- the three loads of an attention tile, end to end ----------------------------------------------
@pytest.mark.parametrize("cuda_type", DTYPES)
def test_the_documented_tile_addresses_give_q_k_transpose_and_p_v(module, cuda_type):
    rng = np.random.default_rng(3)
    dtype = DTYPES[cuda_type]
    x = rng.integers(-4, 5, (16, 16)).astype(dtype)
    k = rng.integers(-4, 5, (8, 16)).astype(dtype)
    v = rng.integers(-4, 5, (16, 8)).astype(dtype)
    s, o = E.zeros((16, 8), np.float32), E.zeros((16, 8), np.float32)
    module.get_function(f"tile_products<{cuda_type}>")(1, 32, (E.asarray(x), E.asarray(k), E.asarray(v), s, o))
    x64 = x.astype(np.float64)
    np.testing.assert_array_equal(s, x64 @ k.astype(np.float64).T)
    np.testing.assert_array_equal(o, x64 @ v.astype(np.float64))


@pytest.mark.parametrize("seed", ["0", "2"])
def test_verdicts_do_not_depend_on_the_schedule(module, monkeypatch, seed):
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", seed)
    for cuda_type in DTYPES:
        test_the_documented_tile_addresses_give_q_k_transpose_and_p_v(module, cuda_type)
        test_mma_accumulates_in_fp32_in_the_stated_order(module, cuda_type)
    test_ldmatrix_gives_each_lane_the_isa_fragment(module, 4, True)
    test_ldmatrix_of_rows_other_lanes_wrote_needs_synchronisation(module)


@pytest.mark.parametrize("call, message", [
    ("mma_m16n8k16<float>(d, a, b, d);", "mma_m16n8k16 multiplies __half or __nv_bfloat16"),
    ("mma_m16n8k16<short>(d, a, b, d);", "mma_m16n8k16 multiplies __half or __nv_bfloat16"),
    ("ldmatrix<3, false>(r, row);", "ldmatrix loads 1, 2 or 4 matrices"),
], ids=["float", "short", "three-matrices"])
def test_a_type_or_count_the_instruction_has_no_form_for_fails_to_compile(call, message):
    # a 16-bit integer has the size of a half but would be multiplied as one: only the two types compile
    source = ("#include \"mma.cuh\"\n"
              "__global__ void misuse(float* out) {\n"
              "    __shared__ __align__(16) unsigned short row[8];\n"
              "    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};\n"
              "    float d[4] = {0, 0, 0, 0};\n"
              "    unsigned r[3];\n"
              f"    cupykv::{call}\n"
              "    out[threadIdx.x] = d[0] + (float)r[0];\n"
              "}\n")
    assert_refused_by_both_compilers(source, "misuse", message)


# ---- the same source is real CUDA ----------------------------------------------------------------
def entry_ptx(program, instance):
    """The PTX of one instance's entry."""
    mangled = next(name for name, inst in program.lowered.items() if inst == instance)
    start = program.ptx.index(f".entry {mangled}(")
    end = program.ptx.find(".entry ", start + 1)
    return program.ptx[start:end if end >= 0 else None]


@pytest.mark.parametrize("arch", nvrtc_check.ARCHS)
def test_the_kernels_compile_with_nvrtc_to_the_intended_instructions_without_spills(arch):
    nvrtc = nvrtc_check.load_nvrtc()
    program = nvrtc_check.compile_program(nvrtc, SOURCE.name, SOURCE.read_text(), NAMES, arch,
                                          include_dirs=(str(KERNELS), KERNEL_DIR))
    reports = nvrtc_check.parse_ptxas_log(program.log, program.lowered, arch)
    assert {r.instance for r in reports} == set(NAMES)
    assert [r.instance for r in reports if r.spills] == []
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in entry_ptx(program, "mma_lanes<__half>")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in entry_ptx(program, "mma_lanes<__nv_bfloat16>")
    for matrices in (1, 2, 4):
        for trans in (False, True):
            body = entry_ptx(program, f"ldmatrix_lanes<{matrices}, {'true' if trans else 'false'}>")
            assert f"ldmatrix.sync.aligned.m8n8.x{matrices}{'.trans' if trans else ''}.shared.b16" in body


# ---- the inline PTX binds its operands in fragment order (the emulator never runs it) ------------
OPERAND_ORDER = [f"mma_operand_order<{t}>" for t in DTYPES] + [
    f"ldmatrix_operand_order<{m}, {t}>" for m in (1, 2, 4) for t in ("false", "true")]


def registers(operand_list):
    return re.findall(r"%\w+", operand_list)


def definition(body, register):
    """The one instruction of an entry's PTX that writes `register`."""
    found = re.findall(rf"^\s*([\w.]+\s+{re.escape(register)},[^;]*);", body, re.MULTILINE)
    assert len(found) == 1, (register, found)
    return found[0]


def constant_of(body, register):
    move = re.fullmatch(r"mov\.(?:u32|b32|f32)\s+%\w+,\s*(0f[0-9A-F]{8}|\d+)", definition(body, register))
    return move and move.group(1)


def stored_offsets(body):
    """register -> byte offset of its st.global into the kernel's one output pointer."""
    return {register: int(offset or 0)
            for offset, register in re.findall(r"st\.global\.\w+\s+\[%rd\d+(?:\+(\d+))?\],\s*(%\w+);", body)}


def float_bits(x):
    return f"0f{int(np.float32(x).view(np.uint32)):08X}"


@pytest.fixture(scope="module", params=nvrtc_check.ARCHS)
def operand_program(request):
    return nvrtc_check.compile_program(nvrtc_check.load_nvrtc(), SOURCE.name, SOURCE.read_text(), OPERAND_ORDER,
                                       request.param, include_dirs=(str(KERNELS), KERNEL_DIR))


@pytest.mark.parametrize("cuda_type", DTYPES)
def test_mma_ptx_takes_a_b_c_and_gives_d_in_fragment_order(operand_program, cuda_type):
    """mma_operand_order puts constants 0xA0A0..0xA3A3 in a0..a3, 0xB0B0, 0xB1B1 in b0, b1 and
    0.5..3.5 in c0..c3, and stores d0..d3 to out[0..3]."""
    body = entry_ptx(operand_program, f"mma_operand_order<{cuda_type}>")
    (d, a, b, c), = re.findall(r"\n\s*mma\.sync\.aligned\.\S+\s+\{([^}]*)\},\s*\{([^}]*)\},\s*\{([^}]*)\},"
                               r"\s*\{([^}]*)\};", body)
    assert [constant_of(body, r) for r in registers(a)] == [str(0xA0A0), str(0xA1A1), str(0xA2A2), str(0xA3A3)]
    assert [constant_of(body, r) for r in registers(b)] == [str(0xB0B0), str(0xB1B1)]
    assert [constant_of(body, r) for r in registers(c)] == [float_bits(x) for x in (0.5, 1.5, 2.5, 3.5)]
    offsets = stored_offsets(body)
    assert [offsets.get(r) for r in registers(d)] == [0, 4, 8, 12]


@pytest.mark.parametrize("matrices", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_ptx_gives_r_in_matrix_order_from_a_shared_address(operand_program, matrices, trans):
    """ldmatrix_operand_order stores r[m] to out[m]; the row address is a 32-bit offset into the
    shared tile (cvta-to-shared of its generic address), not a generic 64-bit pointer."""
    instance = f"ldmatrix_operand_order<{matrices}, {'true' if trans else 'false'}>"
    body = entry_ptx(operand_program, instance)
    (r, address), = re.findall(r"\n\s*ldmatrix\.sync\.aligned\.\S+\s+\{([^}]*)\},\s*\[([^\]]*)\];", body)
    offsets = stored_offsets(body)
    assert [offsets.get(x) for x in registers(r)] == [4 * m for m in range(matrices)]
    assert re.fullmatch(r"%r\d+", address), address
    tile = re.search(r"\.shared\s.*?(\w+rows)\[", body).group(1)
    sources = registers(definition(body, address).split(",", 1)[1])
    assert any(re.search(rf"mov\.u32\s+%r\d+,\s*{tile}$", definition(body, s)) for s in sources), \
        definition(body, address)
