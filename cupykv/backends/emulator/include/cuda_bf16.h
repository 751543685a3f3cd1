// cuda_bf16.h (cupykv emulator shim): __nv_bfloat16 and __nv_bfloat162 for host
// emulation. Conversions match the GPU bit for bit (round to nearest even, NaN -> 0x7fff).
#pragma once
#include "cuemu_fp.h"

CUEMU_DEFINE_FP16_TYPE(__nv_bfloat16, __nv_bfloat16_raw, __nv_bfloat162,
                       ::cuemu::fp::f32_to_bf16, ::cuemu::fp::bf16_to_f32,
                       ::cuemu::fp::f64_to_bf16)

struct __nv_bfloat162_raw {
  unsigned short x, y;
};

static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
static inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  return __nv_bfloat16(__nv_bfloat16_raw{u});
}
static inline __nv_bfloat16 __short_as_bfloat16(short s) {
  return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)s});
}
static inline __nv_bfloat16 __int2bfloat16_rn(int i) { return __nv_bfloat16(i); }
static inline int __bfloat162int_rz(__nv_bfloat16 h) { return (int)(float)h; }
static inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) {
  return __nv_bfloat162{x, y};
}
static inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) {
  return __nv_bfloat162{x, y};
}
static inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 x) { return __nv_bfloat162{x, x}; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float x, float y) {
  return __nv_bfloat162{__nv_bfloat16(x), __nv_bfloat16(y)};
}
static inline __nv_bfloat162 __float2bfloat162_rn(float x) {
  return __nv_bfloat162{__nv_bfloat16(x), __nv_bfloat16(x)};
}
static inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return make_float2((float)h.x, (float)h.y);
}
