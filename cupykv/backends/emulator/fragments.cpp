// fragments.cpp: the tensor-core fragment instructions, computed when a warp's 32 lanes arrived.
//
// runtime.cpp gathers a warp at cuemu_warp_fragment (every lane at the same call site, none
// exited, as .sync.aligned requires) and calls fragment_release with each lane's operands. The
// lane <-> element maps are the PTX ISA's tables (Parallel Thread Execution ISA, section "Warp
// Level Matrix Multiply-Accumulate Instructions"); with groupID = lane >> 2 and
// threadID_in_group (tig) = lane % 4:
//   * mma.m16n8k16, .f16/.bf16 multiplicands, .f32 accumulators ("Matrix Fragments for
//     mma.m16n8k16 with floating point type"):
//       A (16x16, row), a0..a7, two per .b32 register, low half first (figure "MMA .m16n8k16
//         fragment layout for matrix A with .f16/.bf16 type"):
//         row = groupID for i in {0,1,4,5}, groupID + 8 otherwise;
//         col = tig * 2 + (i & 1), + 8 for i >= 4
//       B (16x8, col), b0..b3 (figure "... for matrix B with .f16/.bf16 type"):
//         row = tig * 2 + (i & 1), + 8 for i >= 2;  col = groupID
//       C, D (16x8), c0..c3 (figure "... for accumulator matrix C/D with .f32 type"):
//         row = groupID for i < 2, groupID + 8 otherwise;  col = tig * 2 + (i & 1)
//   * ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 ("Warp-level matrix load
//     instruction: ldmatrix"): lanes 8m..8m+7 give the row addresses of matrix m (16 bytes each,
//     16-byte aligned, in shared memory; lanes beyond 8 x matrices are ignored); register m of lane
//     l holds row groupID, columns 2 tig and 2 tig + 1 of matrix m (figure "ldmatrix fragment
//     layout"), low half first; with .trans, rows 2 tig and 2 tig + 1 of column groupID.
//
// Accumulation (the ISA leaves order and internal precision unspecified): the emulator computes
// D[i][j] = C[i][j] + A[i][0] B[0][j] + ... + A[i][15] B[15][j] in fp32, k ascending, one
// rounding (to nearest even) per addition. Products of two fp16 or two bf16 values are exact in
// fp32, so only the 16 additions round. Fibers run with fp32 flush-to-zero, as CuPy's kernels
// do, so bf16 subnormal inputs and subnormal results are flushed (the GPU may keep them).
//
// ldmatrix reads are reported to the race checker as loads of the lane that gave the row address,
// at its call site. Neither instruction orders memory between lanes: a lane's store before an
// ldmatrix that another lane's row reads still needs a __syncwarp() (or __syncthreads()).
#include <stdio.h>
#include <string.h>

#include <string>

#include "cuemu_fp.h"
#include "cuemu_signals.h"
#include "cuemu_trace.h"

namespace cuemu {
namespace {

template <bool BF16>
float element(uint32_t reg, int half) {
  const uint16_t bits = (uint16_t)(reg >> (16 * half));
  return BF16 ? fp::bf16_to_f32(bits) : fp::f16_to_f32(bits);
}

template <bool BF16>
void mma_m16n8k16(const FragmentLane* lanes) {
  float a[16][16], b[16][8], c[16][8];
  for (int lane = 0; lane < 32; ++lane) {   // the layouts above, register by register
    const cuemu_mma_in* in = static_cast<const cuemu_mma_in*>(lanes[lane].in);
    const int group = lane >> 2, col = 2 * (lane & 3);
    for (int half = 0; half < 2; ++half) {
      a[group][col + half] = element<BF16>(in->a[0], half);
      a[group + 8][col + half] = element<BF16>(in->a[1], half);
      a[group][col + 8 + half] = element<BF16>(in->a[2], half);
      a[group + 8][col + 8 + half] = element<BF16>(in->a[3], half);
      b[col + half][group] = element<BF16>(in->b[0], half);
      b[col + 8 + half][group] = element<BF16>(in->b[1], half);
      c[group][col + half] = in->c[half];
      c[group + 8][col + half] = in->c[2 + half];
    }
  }
  // A row of A that is all zeros (the padding of a tile with fewer than 16 rows) adds only zero
  // products when B is finite, so its sums are known without the 16 additions: c unchanged where
  // c is not zero; where it is, -0 only if c and every product are -0 (round to nearest adds
  // -0 + -0 = -0 and any other pair of zeros to +0). B with an inf or NaN takes the full sum.
  bool b_finite = true;
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < 8; ++j) b_finite = b_finite && isfinite(b[k][j]);
  // d = c + the products in k order, an exact product and one rounding per add, for each output. The
  // loop over an output row's 8 columns is innermost: each column's additions keep their order, and the
  // 8 chains run side by side (vectorised) instead of one after another.
  float d[16][8];
  for (int i = 0; i < 16; ++i) {
    bool zero_row = b_finite;
    for (int k = 0; k < 16 && zero_row; ++k) zero_row = a[i][k] == 0.0f;
    float* acc = d[i];
    for (int j = 0; j < 8; ++j) acc[j] = c[i][j];
    if (!zero_row) {
      for (int k = 0; k < 16; ++k)
        for (int j = 0; j < 8; ++j) acc[j] += a[i][k] * b[k][j];
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      if (acc[j] != 0.0f) continue;   // a nonzero c plus zeros stays c
      bool all_negative = signbit(acc[j]);
      for (int k = 0; k < 16 && all_negative; ++k) all_negative = signbit(a[i][k]) != signbit(b[k][j]);
      acc[j] = all_negative ? -0.0f : 0.0f;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* out = static_cast<float*>(lanes[lane].out);
    const int group = lane >> 2, col = 2 * (lane & 3);
    out[0] = d[group][col];
    out[1] = d[group][col + 1];
    out[2] = d[group + 8][col];
    out[3] = d[group + 8][col + 1];
  }
}

// Returns the lane to blame (with *msg) or -1.
int ldmatrix(int arg, uint32_t base_tid, const FragmentLane* lanes, std::string* msg) {
  const int matrices = arg & 7;
  const bool trans = (arg & CUEMU_LDMATRIX_TRANS) != 0;
  uint16_t rows[4][8][8];  // [matrix][row][column]
  for (int lane = 0; lane < 8 * matrices; ++lane) {
    const uintptr_t addr = (uintptr_t) * static_cast<const void* const*>(lanes[lane].in);
    char buf[256];
    if (addr % 16) {
      snprintf(buf, sizeof buf, "row address 0x%llx of lane %d (matrix %d, row %d) is not 16-byte aligned "
               "(a row is 16 bytes, loaded by four lanes)", (unsigned long long)addr, lane, lane / 8, lane % 8);
      *msg = buf;
      return lane;
    }
    const int region = trace_region_of(addr, 16);
    if (region != 0 && region != 1) {
      const Region* r = trace_region_at(addr);
      const char* why = r && r->index <= 1 ? "runs past the end of shared memory"
                                           : "is not in shared memory (ldmatrix reads shared memory only)";
      snprintf(buf, sizeof buf, "row address 0x%llx of lane %d (matrix %d, row %d) %s", (unsigned long long)addr,
               lane, lane / 8, lane % 8, why);
      *msg = buf;
      return lane;
    }
    trace_access_as(base_tid + lane, addr, 16, ACCESS_READ, lanes[lane].ra);
    cuemu_copy(rows[lane / 8][lane % 8], reinterpret_cast<const void*>(addr), 16);
  }
  for (int lane = 0; lane < 32; ++lane) {
    uint32_t* out = static_cast<uint32_t*>(lanes[lane].out);
    const int group = lane >> 2, tig = lane & 3;
    for (int m = 0; m < matrices; ++m) {
      const uint16_t lo = trans ? rows[m][2 * tig][group] : rows[m][group][2 * tig];
      const uint16_t hi = trans ? rows[m][2 * tig + 1][group] : rows[m][group][2 * tig + 1];
      out[m] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
  }
  return -1;
}

}  // namespace

int fragment_release(int op, int arg, uint32_t base_tid, const FragmentLane* lanes, std::string* msg) {
  switch (op) {
    case CUEMU_MMA_F16: mma_m16n8k16<false>(lanes); return -1;
    case CUEMU_MMA_BF16: mma_m16n8k16<true>(lanes); return -1;
    case CUEMU_LDMATRIX: return ldmatrix(arg, base_tid, lanes, msg);
  }
  *msg = "unknown fragment instruction";
  return 0;
}

}  // namespace cuemu
