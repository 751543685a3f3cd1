// cuda_fp16.h (cupykv emulator shim): __half and __half2 for host emulation.
// Conversions match the GPU bit for bit (round to nearest even, subnormals,
// overflow to inf, NaN -> 0x7fff).
#pragma once
#include "cuemu_fp.h"

CUEMU_DEFINE_FP16_TYPE(__half, __half_raw, __half2, ::cuemu::fp::f32_to_f16,
                       ::cuemu::fp::f16_to_f32, ::cuemu::fp::f64_to_f16)

struct __half2_raw {
  unsigned short x, y;
};

static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __double2half(double d) { return __half(d); }
static inline float __half2float(__half h) { return (float)h; }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
static inline __half __short_as_half(short s) {
  return __half(__half_raw{(unsigned short)s});
}
static inline __half __int2half_rn(int i) { return __half(i); }
static inline int __half2int_rz(__half h) { return (int)(float)h; }
static inline __half2 make_half2(__half x, __half y) { return __half2{x, y}; }
static inline __half2 __halves2half2(__half x, __half y) { return __half2{x, y}; }
static inline __half2 __half2half2(__half x) { return __half2{x, x}; }
static inline __half2 __floats2half2_rn(float x, float y) { return __half2{__half(x), __half(y)}; }
static inline __half2 __float2half2_rn(float x) { return __half2{__half(x), __half(x)}; }
static inline float2 __half22float2(__half2 h) { return make_float2((float)h.x, (float)h.y); }
