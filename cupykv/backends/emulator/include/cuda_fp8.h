// cuda_fp8.h (cupykv emulator shim): the E4M3 8-bit float of CUDA's cuda_fp8.h for host
// emulation: the storage types, __nv_fp8_e4m3, and the conversions a kernel needs, bit for bit
// as the toolkit's header computes them (tests/test_fp8_conversions.py compares every code and
// every rounding tie with a program built against that header):
//   to E4M3: round to nearest even. Past the largest finite value (448; from 464 = 448 + half a
//     step up, infinities included) __NV_SATFINITE gives +-448 and __NV_NOSAT NaN. At most
//     2^-10 (half the smallest subnormal) in magnitude gives a zero of the input's sign. A NaN
//     double gives 0x7F with its sign bit; a NaN float is made canonical first, so 0x7F (as are
//     __half, __nv_bfloat16 and the __nv_fp8_e4m3 constructors, which go through float).
//   from E4M3: exact (every E4M3 value is a binary16 value); both NaN codes, 0x7F and 0xFF, give
//     the canonical half NaN 0x7FFF.
// E5M2 is not emulated: asking for it stops the launch with a named error.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short int __nv_fp8x2_storage_t;
typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;

namespace cuemu {
namespace fp {

// double -> E4M3 bits.
inline uint8_t f64_to_e4m3(double x, bool saturate) {
  uint64_t bits;
  memcpy(&bits, &x, 8);
  const uint8_t sign = (uint8_t)((bits >> 56) & 0x80u);
  const double magnitude = fabs(x);
  if (magnitude != magnitude) return (uint8_t)(0x7Fu | sign);                    // NaN
  if (magnitude > 464.0) return (uint8_t)((saturate ? 0x7Eu : 0x7Fu) | sign);  // past 448 + half a step
  if (magnitude <= 0x1p-10) return sign;                                        // rounds to zero
  int binary_exponent;
  frexp(magnitude, &binary_exponent);   // magnitude in [2^(binary_exponent - 1), 2^binary_exponent)
  const int exponent = binary_exponent - 1;
  if (exponent < -6)                    // subnormal: steps of 2^-9; 8 steps is the smallest normal, 0x08
    return (uint8_t)(sign | (uint8_t)nearbyint(ldexp(magnitude, 9)));
  // 8..16 eighths of 2^exponent, rounded to nearest even; 16 carries into the next exponent
  const int eighths = (int)nearbyint(ldexp(magnitude, 3 - exponent));
  return (uint8_t)(sign | (uint8_t)(((exponent + 7) << 3) + eighths - 8));
}

// E4M3 bits -> binary16 bits (exact).
inline uint16_t e4m3_to_f16(uint8_t code) {
  const unsigned body = code & 0x7Fu;
  if (body == 0x7Fu) return 0x7FFFu;                                             // NaN, sign dropped
  const unsigned exponent = body >> 3, mantissa = body & 7u;
  const float magnitude = exponent ? ldexpf((float)(8u + mantissa), (int)exponent - 10)
                                   : ldexpf((float)mantissa, -9);
  return (uint16_t)(f32_to_f16(magnitude) | ((code & 0x80u) << 8));
}

}  // namespace fp
}  // namespace cuemu

static inline void cuemu_fp8_require_e4m3(__nv_fp8_interpretation_t kind) {
  if (kind != __NV_E4M3) cuemu_trap("cuda_fp8.h: E5M2 is not emulated (only __NV_E4M3)", __FILE__, __LINE__);
}

static inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t saturate,
                                                        __nv_fp8_interpretation_t kind) {
  cuemu_fp8_require_e4m3(kind);
  return cuemu::fp::f64_to_e4m3(x, saturate == __NV_SATFINITE);
}
static inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t saturate,
                                                       __nv_fp8_interpretation_t kind) {
  return __nv_cvt_double_to_fp8(x != x ? (double)NAN : (double)x, saturate, kind);   // NaN made canonical
}
static inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t saturate,
                                                            __nv_fp8_interpretation_t kind) {
  return (__nv_fp8x2_storage_t)(__nv_cvt_float_to_fp8(x.x, saturate, kind) |
                                (__nv_cvt_float_to_fp8(x.y, saturate, kind) << 8));
}
static inline __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw x, __nv_saturation_t saturate,
                                                         __nv_fp8_interpretation_t kind) {
  return __nv_cvt_float_to_fp8(::cuemu::fp::f16_to_f32(x.x), saturate, kind);
}
static inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw x, __nv_saturation_t saturate,
                                                             __nv_fp8_interpretation_t kind) {
  return __nv_cvt_float_to_fp8(::cuemu::fp::bf16_to_f32(x.x), saturate, kind);
}
static inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
  cuemu_fp8_require_e4m3(kind);
  return __half_raw{::cuemu::fp::e4m3_to_f16(x)};
}
static inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t kind) {
  return __half2_raw{__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x & 0xFFu), kind).x,
                     __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x >> 8), kind).x};
}

// One E4M3 value; conversions in are round-to-nearest-even with __NV_SATFINITE, as CUDA's.
struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e4m3() = default;
  explicit __nv_fp8_e4m3(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)) {}
  explicit __nv_fp8_e4m3(double f) : __x(__nv_cvt_double_to_fp8(f, __NV_SATFINITE, __NV_E4M3)) {}
  explicit __nv_fp8_e4m3(__half f) : __x(__nv_cvt_halfraw_to_fp8(__half_raw{f.__x}, __NV_SATFINITE, __NV_E4M3)) {}
  explicit __nv_fp8_e4m3(__nv_bfloat16 f)
      : __x(__nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw{f.__x}, __NV_SATFINITE, __NV_E4M3)) {}
  explicit operator __half() const { return __half(__nv_cvt_fp8_to_halfraw(__x, __NV_E4M3)); }
  explicit operator float() const { return ::cuemu::fp::f16_to_f32(::cuemu::fp::e4m3_to_f16(__x)); }
  explicit operator __nv_bfloat16() const { return __nv_bfloat16(static_cast<float>(*this)); }
};
