// mma.cuh: tensor-core fragments: mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate) and ldmatrix.
//
// One wrapper per PTX instruction, each with two bodies: inline PTX on the GPU (sm_80 and later),
// and cupykv's CPU emulator (CUPYKV_EMULATOR), which runs them as collectives of the warp's 32
// lanes with the fragment layouts of the PTX ISA tables. Kernels use these wrappers and never
// write mma or ldmatrix themselves. Every lane of the warp must call a wrapper at the same call
// site (.sync.aligned); none may have exited.
//
//   mma_m16n8k16<T>(d, a, b, c)   D = A x B + C on one 16x16x8 tile, T = __half or __nv_bfloat16
//       a: unsigned[4], this lane's A elements a0..a7 (A is 16x16, row-major ".row")
//       b: unsigned[2], this lane's B elements b0..b3 (B is 16x8, column-major ".col")
//       c, d: float[4], this lane's C / D elements c0..c3 (16x8); d may alias c
//     Two 16-bit elements per register, the lower-numbered one in the low half. With
//     group = lane / 4 and t = lane % 4 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
//     floating point type"):
//       A: a0,a1 at (group,   2t..2t+1)   a2,a3 at (group+8, 2t..2t+1)
//          a4,a5 at (group, 2t+8..2t+9)   a6,a7 at (group+8, 2t+8..2t+9)
//       B: b0,b1 at (2t..2t+1, group)     b2,b3 at (2t+8..2t+9, group)
//       C/D: c0,c1 at (group, 2t..2t+1)   c2,c3 at (group+8, 2t..2t+1)
//     Accumulation is fp32; the order of the 16 additions is unspecified by the ISA (the emulator
//     adds in k order, rounding each addition to nearest).
//
//   ldmatrix_x1/x2/x4(r, row)        load 1, 2 or 4 8x8 matrices of 16-bit elements from shared
//   ldmatrix_x1/x2/x4_trans(r, row)  memory: lanes 8m..8m+7 pass the addresses of rows 0..7 of
//       matrix m (16 bytes each, 16-byte aligned; the other lanes' addresses are ignored); r[m] of
//       lane l gets row l / 4, columns 2(l % 4) and 2(l % 4) + 1 of matrix m (low half first);
//       with _trans, rows 2(l % 4) and 2(l % 4) + 1 of column l / 4 (PTX ISA, "Warp-level matrix
//       load instruction: ldmatrix"). The three loads an attention tile needs, lane l passing:
//         A fragment of a row-major 16x16 tile X (ldmatrix_x4):       &X[l % 16][(l / 16) * 8]
//         B fragment of K^T from K rows [8 keys][16 dims] (ldmatrix_x2): &K[l % 8][(l / 8) * 8]
//         B fragment of V from V rows [16 keys][8 dims] (ldmatrix_x2_trans): &V[l % 16][0]
//     Neither instruction orders memory between lanes: shared memory written by other lanes
//     needs a __syncwarp() or __syncthreads() before the ldmatrix that reads it.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "type_traits.cuh"

namespace cupykv {

#ifdef CUPYKV_EMULATOR
// The emulator runs a fragment instruction as a collective that writes each lane's WORDS result
// registers through `words`. A guard word after them, checked on return, makes a runtime that wrote
// one too many trap at the call (a check on the emulator itself), where it would have overwritten
// the next variable on the fiber's stack unseen.
constexpr unsigned kFragmentGuard = 0x9e3779b9u;
template <int WORDS>
__device__ __forceinline__ void emulated_fragment(int op, int arg, const void* in, unsigned (&words)[WORDS],
                                                  const char* file, int line) {
    unsigned out[WORDS + 1];
    out[WORDS] = kFragmentGuard;
    cuemu_warp_fragment(op, arg, in, out, file, line);
    if (out[WORDS] != kFragmentGuard)
        cuemu_trap("the emulator wrote past this fragment instruction's result registers (an emulator bug)", file,
                   line);
    for (int i = 0; i < WORDS; ++i) words[i] = out[i];
}
#endif

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
    constexpr bool kBfloat16 = same_type<T, __nv_bfloat16>::value;
    static_assert(kBfloat16 || same_type<T, __half>::value, "mma_m16n8k16 multiplies __half or __nv_bfloat16");
#ifdef CUPYKV_EMULATOR
    const cuemu_mma_in in = {{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}};
    unsigned out[4];
    emulated_fragment(kBfloat16 ? CUEMU_MMA_BF16 : CUEMU_MMA_F16, 0, &in, out, __FILE__, __LINE__);
    for (int i = 0; i < 4; ++i) d[i] = __uint_as_float(out[i]);
#else
    if constexpr (kBfloat16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
#endif
}

// ldmatrix of MATRICES (1, 2, 4) 8x8 matrices, transposed when TRANS.
template <int MATRICES, bool TRANS>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[MATRICES], const void* row) {
    static_assert(MATRICES == 1 || MATRICES == 2 || MATRICES == 4, "ldmatrix loads 1, 2 or 4 matrices");
#ifdef CUPYKV_EMULATOR
    emulated_fragment(CUEMU_LDMATRIX, MATRICES | (TRANS ? CUEMU_LDMATRIX_TRANS : 0), &row, r, __FILE__, __LINE__);
#else
    const unsigned address = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (MATRICES == 1 && !TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address) : "memory");
    } else if constexpr (MATRICES == 1) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(address)
                     : "memory");
    } else if constexpr (MATRICES == 2 && !TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1])
                     : "r"(address) : "memory");
    } else if constexpr (MATRICES == 2) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1])
                     : "r"(address) : "memory");
    } else if constexpr (!TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
    }
#endif
}

__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* row) { ldmatrix<1, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) { ldmatrix<2, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) { ldmatrix<4, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) { ldmatrix<1, true>(r, row); }
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { ldmatrix<2, true>(r, row); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ldmatrix<4, true>(r, row); }

}  // namespace cupykv
