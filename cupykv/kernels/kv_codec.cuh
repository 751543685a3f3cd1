// kv_codec.cuh: how a cache element type stores and loads K/V values, for caches whose storage type
// T differs from the io type TI of the rows given to append and of q / out in attention.
//
// - float, __half, __nv_bfloat16 caches store values of their own type (T == TI): a store rounds
//   fp32 to T (round-to-nearest-even), a load widens it; the per-head scales are 1 and unused.
// - __nv_fp8_e4m3 caches (the float8_e4m3 dtype) store E4M3(x / scale), rounded to nearest even
//   and saturated to +-448 (cuda_fp8.h's __NV_SATFINITE; NaN stays NaN), with one fp32 scale per
//   layer and kv head; the value a code stands for is code * scale. Every E4M3 value is exact in
//   __half and in __nv_bfloat16, so the tensor-core path widens codes without rounding and applies
//   the scale to its fp32 results (attention_mma.cu).
//
// Compiles under NVRTC (sm_80, sm_90) and under the emulator. A store converts with cuda_fp8.h (in
// hardware from sm_89; the emulator's shim is bit-exact against the toolkit's header,
// tests/test_fp8_conversions.py). A load widens with the conversion instruction from sm_89 on, and by
// bit moves before sm_89 and on the emulator (widen_fp8_pair_by_bits, tests/test_fp8_widen.py).
#pragma once
#include "common.cuh"
#include "type_traits.cuh"
#include <cuda_fp8.h>

// 1 where E4M3 codes widen with the conversion instruction (a GPU from sm_89 on); 0 where they widen
// by bit moves (widen_fp8_pair_by_bits): before sm_89, on the emulator, and wherever
// CUPYKV_FP8_WIDEN_BY_BITS is defined (tests/test_fp8_widen.py runs the bit moves on a GPU that way).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(CUPYKV_EMULATOR) && !defined(CUPYKV_FP8_WIDEN_BY_BITS)
#define CUPYKV_FP8_WIDEN_BY_CVT 1
#else
#define CUPYKV_FP8_WIDEN_BY_CVT 0
#endif

namespace cupykv {

template <typename T> struct is_fp8 { static constexpr bool value = false; };
template <> struct is_fp8<__nv_fp8_e4m3> { static constexpr bool value = true; };

// Two E4M3 codes, in bits 8-15 and 24-31 of `spread` (bits 0-7 and 16-23 are ignored), widened exactly
// to a pair of __half by moving bits: no table, no branch, no loop. Within each 16-bit lane:
// - the code's seven magnitude bits shifted right by one (exponent into bits 13-10, mantissa into 9-7)
//   are the bits of a __half worth code / 2^8, subnormal codes included: E4M3's bias is 7, half's 15,
//   and a subnormal code's mantissa lands on the same fraction of a half subnormal;
// - the sign stays in bit 15;
// - the NaN codes (magnitude 0x7f, the only magnitude with all seven bits set; E4M3 has no infinity)
//   would read as 480: adding 1 at the magnitude's lowest bit carries into bit 14 for them only, and
//   that bit turns the half's exponent to all ones with a nonzero mantissa, a NaN.
// One multiply by 2^8 (exact: the largest code, 448, and the smallest, 2^-9, are normal halves) then
// restores the value. About seven instructions a pair where cuda_fp8.h's conversion before sm_89
// takes a loop over subnormals and some forty instructions a code.
__device__ __forceinline__ unsigned widen_fp8_pair_by_bits(unsigned spread) {
    const unsigned magnitude = (spread & 0x7f007f00u) >> 1;            // bits 7-13 of each lane
    const unsigned nan_exponent = (magnitude + 0x00800080u) & 0x40004000u;   // bit 14 iff all seven set
    const unsigned bits = (spread & 0x80008000u) | magnitude | nan_exponent;
    // The word is the pair as it is (memcpy, not two halves packed: packing costs ptxas byte permutes).
    const unsigned two_pow8_bits = 0x5c005c00u;                          // 256.0 in each half
    __half2 pair, two_pow8;
    memcpy(&pair, &bits, 4);
    memcpy(&two_pow8, &two_pow8_bits, 4);
    const __half2 widened = __hmul2(pair, two_pow8);
    unsigned widened_bits;
    memcpy(&widened_bits, &widened, 4);
    return widened_bits;
}

// The raw value of a stored element, without its scale.
template <typename T> __device__ __forceinline__ float load_kv(T x) { return to_float<T>(x); }
// An fp8 code widens as widen_fp8_word's do: cuda_fp8.h's conversion from sm_89 on (one instruction),
// bit moves before sm_89 and on the emulator.
template <> __device__ __forceinline__ float load_kv<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) {
#if CUPYKV_FP8_WIDEN_BY_CVT
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3)));
#else
    return __half2float(__ushort_as_half((unsigned short)(widen_fp8_pair_by_bits((unsigned)x.__x << 8) & 0xffffu)));
#endif
}

// The element that stores fp32 value x of a head with scale `scale` (ignored unless T is fp8).
template <typename T> __device__ __forceinline__ T store_kv(float x, float scale) {
    (void)scale;
    return from_float<T>(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 store_kv<__nv_fp8_e4m3>(float x, float scale) {
    __nv_fp8_e4m3 code;
    code.__x = __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3);
    return code;
}

// The operand type of the tensor-core path: T itself for 16-bit caches; __half for fp8 caches, whatever
// the io type: it holds every E4M3 value exactly, a code widens to it in one instruction on sm_89 and
// later (four for __nv_bfloat16), and P's pieces keep 22 bits (16 in bf16). attention_mma.cu brings q
// rows that are not exact halves (bf16 or float io, or rotated) into its range by a power of two.
template <typename T, typename TI> struct mma_type { using type = T; };
template <typename TI> struct mma_type<__nv_fp8_e4m3, TI> { using type = __half; };

// Two 16-bit values in one register, `low` in the low half (the mma and ldmatrix element order).
template <typename T> __device__ __forceinline__ unsigned pack_pair(T low, T high) {
    return (unsigned)*reinterpret_cast<const unsigned short*>(&low) |
           ((unsigned)*reinterpret_cast<const unsigned short*>(&high) << 16);
}

// Four E4M3 codes of one word (the code at the lowest address in bits 0-7) widened exactly to M, two
// packed pairs: codes 0, 1 into `low_pair` and codes 2, 3 into `high_pair`, the first code of each in
// the low half (the mma fragment's element order). From sm_89 on, one cvt.rn.f16x2.e4m3x2 per pair,
// each reading its half of the word in place: the SASS conversion takes the high half as an operand,
// where a 16-bit argument (cuda_fp8.h's __nv_cvt_fp8x2_to_halfraw2) costs a shift first. Before sm_89
// and on the emulator, a byte permute spreads each pair's codes for widen_fp8_pair_by_bits (the
// emulator runs it, so every fp8 test checks it; tests/test_fp8_widen.py checks it at every pair of
// codes, on a GPU against the cvt too).
template <typename M> __device__ __forceinline__ void widen_fp8_word(unsigned word, unsigned& low_pair,
                                                                     unsigned& high_pair);
template <> __device__ __forceinline__ void widen_fp8_word<__half>(unsigned word, unsigned& low_pair,
                                                                   unsigned& high_pair) {
#if CUPYKV_FP8_WIDEN_BY_CVT
    asm("{\n\t.reg .b16 low, high;\n\tmov.b32 {low, high}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, low;\n\tcvt.rn.f16x2.e4m3x2 %1, high;\n\t}"
        : "=r"(low_pair), "=r"(high_pair) : "r"(word));
#else
    low_pair = widen_fp8_pair_by_bits(__byte_perm(word, 0u, 0x1000u));    // codes 0, 1 into bytes 1, 3
    high_pair = widen_fp8_pair_by_bits(__byte_perm(word, 0u, 0x3020u));   // codes 2, 3 into bytes 1, 3
#endif
}

// The bits that are all ones in a NaN or infinite element of T (E4M3: its NaN codes; it has no
// infinity).
template <typename T> struct non_finite_bits;
template <> struct non_finite_bits<__half> { static constexpr unsigned value = 0x7c00u; };
template <> struct non_finite_bits<__nv_bfloat16> { static constexpr unsigned value = 0x7f80u; };
template <> struct non_finite_bits<__nv_fp8_e4m3> { static constexpr unsigned value = 0x7fu; };

// A word of T (__half, __nv_bfloat16 or fp8 codes) with each NaN or infinite element zeroed.
template <typename T> __device__ __forceinline__ unsigned zero_non_finite_word(unsigned word) {
    static_assert(sizeof(T) <= 2, "zero_non_finite_word: elements of 16 or 8 bits");
    constexpr unsigned kBits = non_finite_bits<T>::value, kElementBits = 8 * sizeof(T);
    constexpr unsigned kMask = (1u << kElementBits) - 1;
    unsigned kept = word;
    for (unsigned shift = 0; shift < 32; shift += kElementBits)
        if ((word >> shift & kBits) == kBits) kept &= ~(kMask << shift);
    return kept;
}

// Whether any element of a 32-bit word of T is NaN or infinite (such an element is never all zeros).
template <typename T> __device__ __forceinline__ bool word_has_non_finite(unsigned word) {
    return zero_non_finite_word<T>(word) != word;
}

// The keys (bit k: row k) of a K/V stage's 16 rows (HEAD_DIM elements each, rows `stage_row` elements
// apart, 16-byte aligned) that hold a NaN or infinite element; the warp reads it a word a lane at a
// time and agrees on the mask.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ unsigned stage_non_finite_keys(const T* stage, int stage_row, int lane) {
    constexpr int kWordsPerRow = HEAD_DIM * (int)sizeof(T) / 4;
    unsigned keys = 0;
#pragma unroll 1   // a word at a time: in the key loop, beside the accumulators
    for (int e = lane; e < 16 * kWordsPerRow; e += 32) {
        const int key = e / kWordsPerRow;
        if (word_has_non_finite<T>(reinterpret_cast<const unsigned*>(stage + key * stage_row)[e % kWordsPerRow]))
            keys |= 1u << key;
    }
    for (int offset = 16; offset > 0; offset /= 2) keys |= __shfl_xor_sync(0xffffffffu, keys, offset);
    return keys;
}

// The elements of a K/V stage's 16 rows (as stage_non_finite_keys reads them) that are NaN or
// infinite, set to zero; each lane rewrites the words it reads.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void zero_non_finite_elements(T* stage, int stage_row, int lane) {
    constexpr int kWordsPerRow = HEAD_DIM * (int)sizeof(T) / 4;
#pragma unroll 1
    for (int e = lane; e < 16 * kWordsPerRow; e += 32) {
        unsigned* word = reinterpret_cast<unsigned*>(stage + (e / kWordsPerRow) * stage_row) + e % kWordsPerRow;
        *word = zero_non_finite_word<T>(*word);
    }
}

}  // namespace cupykv
