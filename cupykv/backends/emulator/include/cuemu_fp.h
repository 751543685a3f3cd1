// cuemu_fp.h: bit-exact 16-bit float conversions shared by the cuda_fp16.h and
// cuda_bf16.h shims. Round to nearest even, subnormals kept, overflow to infinity,
// NaN to CUDA's canonical 0x7fff (the sign of a NaN is dropped, as on the GPU).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace cuemu {
namespace fp {

inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// float -> IEEE binary16 bits.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;                   // NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                 // normal half (>= 2^-14)
    const uint32_t r = a - (112u << 23);                  // rebias 127 -> 15
    uint32_t h = r >> 13;
    const uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
  }
  const uint32_t e = a >> 23;
  if (e < 102u) return (uint16_t)sign;                    // below 2^-25: rounds to zero
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;                         // 14..24
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (h & 1u))) ++h;        // may carry into the min normal
  return (uint16_t)(sign | h);
}

// IEEE binary16 bits -> float (exact; NaN becomes the canonical 0x7fffffff).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) return bits_f32(m ? 0x7fffffffu : (sign | 0x7f800000u));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    int k = 0;  // normalise the subnormal
    while (!(m & 0x400u)) { m <<= 1; ++k; }
    return bits_f32(sign | ((uint32_t)(113 - k) << 23) | ((m & 0x3ffu) << 13));
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// float -> bfloat16 bits.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// double -> float rounded to odd: a second rounding to a narrower format then equals
// one correct rounding of the double (float keeps more than two extra bits).
inline float f64_to_f32_odd(double d) {
  float f = (float)d;
  if ((double)f == d || d != d) return f;
  uint32_t u = f32_bits(f);
  if (fabs((double)f) > fabs(d)) --u;  // step toward zero: truncation
  return bits_f32(u | 1u);
}

inline uint16_t f64_to_f16(double d) { return f32_to_f16(f64_to_f32_odd(d)); }
inline uint16_t f64_to_bf16(double d) { return f32_to_bf16(f64_to_f32_odd(d)); }

}  // namespace fp
}  // namespace cuemu

// Defines a 16-bit storage type T (raw struct RAW, pair T2) with CUDA's constructors,
// conversions and arithmetic operators. Arithmetic is done in double and rounded once
// (exact for +, -, *; correctly rounded for /), which matches the GPU's f16/bf16 units.
#define CUEMU_DEFINE_FP16_TYPE(T, RAW, T2, FROM_F32, TO_F32, FROM_F64)                   \
  struct RAW {                                                                           \
    unsigned short x;                                                                    \
  };                                                                                     \
  struct __attribute__((aligned(2))) T {                                                 \
    unsigned short __x;                                                                  \
    T() = default;                                                                       \
    T(const RAW& r) : __x(r.x) {}                                                        \
    T& operator=(const RAW& r) { __x = r.x; return *this; }                              \
    operator RAW() const { return RAW{__x}; }                                            \
    T(float f) : __x(FROM_F32(f)) {}                                                     \
    T(double d) : __x(FROM_F64(d)) {}                                                    \
    T(int i) : __x(FROM_F64((double)i)) {}                                               \
    T(unsigned int i) : __x(FROM_F64((double)i)) {}                                      \
    T(short i) : __x(FROM_F64((double)i)) {}                                             \
    T(unsigned short i) : __x(FROM_F64((double)i)) {}                                    \
    T(long long i) : __x(FROM_F64((double)i)) {}                                         \
    T(unsigned long long i) : __x(FROM_F64((double)i)) {}                                \
    T& operator=(float f) { __x = FROM_F32(f); return *this; }                           \
    T& operator=(double d) { __x = FROM_F64(d); return *this; }                          \
    operator float() const { return TO_F32(__x); }                                       \
  };                                                                                     \
  struct __attribute__((aligned(4))) T2 {                                                \
    T x, y;                                                                              \
  };                                                                                     \
  static inline T cuemu_make_##T(double d) { RAW r{FROM_F64(d)}; return T(r); }          \
  static inline double cuemu_f64(T h) { return (double)TO_F32(h.__x); }                  \
  static inline T operator+(const T& a, const T& b) { return cuemu_make_##T(cuemu_f64(a) + cuemu_f64(b)); } \
  static inline T operator-(const T& a, const T& b) { return cuemu_make_##T(cuemu_f64(a) - cuemu_f64(b)); } \
  static inline T operator*(const T& a, const T& b) { return cuemu_make_##T(cuemu_f64(a) * cuemu_f64(b)); } \
  static inline T operator/(const T& a, const T& b) { return cuemu_make_##T(cuemu_f64(a) / cuemu_f64(b)); } \
  static inline T& operator+=(T& a, const T& b) { return a = a + b; }                    \
  static inline T& operator-=(T& a, const T& b) { return a = a - b; }                    \
  static inline T& operator*=(T& a, const T& b) { return a = a * b; }                    \
  static inline T& operator/=(T& a, const T& b) { return a = a / b; }                    \
  static inline T operator+(const T& a) { return a; }                                    \
  static inline T operator-(const T& a) { RAW r{(unsigned short)(a.__x ^ 0x8000u)}; return T(r); } \
  static inline bool operator==(const T& a, const T& b) { return cuemu_f64(a) == cuemu_f64(b); } \
  static inline bool operator!=(const T& a, const T& b) { return cuemu_f64(a) != cuemu_f64(b); } \
  static inline bool operator<(const T& a, const T& b) { return cuemu_f64(a) < cuemu_f64(b); }   \
  static inline bool operator>(const T& a, const T& b) { return cuemu_f64(a) > cuemu_f64(b); }   \
  static inline bool operator<=(const T& a, const T& b) { return cuemu_f64(a) <= cuemu_f64(b); } \
  static inline bool operator>=(const T& a, const T& b) { return cuemu_f64(a) >= cuemu_f64(b); } \
  static inline T __hadd(T a, T b) { return a + b; }                                     \
  static inline T __hsub(T a, T b) { return a - b; }                                     \
  static inline T __hmul(T a, T b) { return a * b; }                                     \
  static inline T __hdiv(T a, T b) { return a / b; }                                     \
  static inline T __hfma(T a, T b, T c) {                                                \
    return cuemu_make_##T(fma(cuemu_f64(a), cuemu_f64(b), cuemu_f64(c)));                \
  }                                                                                      \
  static inline T __hneg(T a) { return -a; }                                             \
  static inline T __habs(T a) { RAW r{(unsigned short)(a.__x & 0x7fffu)}; return T(r); } \
  static inline bool __hisnan(T a) { return cuemu_f64(a) != cuemu_f64(a); }                                                                       \
  static inline int __hisinf(T a) {                                                      \
    double d = cuemu_f64(a);                                                             \
    return d == HUGE_VAL ? 1 : (d == -HUGE_VAL ? -1 : 0);                                \
  }                                                                                      \
  static inline T __hmax(T a, T b) {                                                     \
    if (__hisnan(a)) return __hisnan(b) ? cuemu_make_##T(NAN) : b;                       \
    if (__hisnan(b)) return a;                                                           \
    return a > b ? a : b;                                                                \
  }                                                                                      \
  static inline T __hmin(T a, T b) {                                                     \
    if (__hisnan(a)) return __hisnan(b) ? cuemu_make_##T(NAN) : b;                       \
    if (__hisnan(b)) return a;                                                           \
    return a < b ? a : b;                                                                \
  }                                                                                      \
  static inline bool __heq(T a, T b) { return a == b; }                                  \
  static inline bool __hne(T a, T b) { return a != b; }                                  \
  static inline bool __hlt(T a, T b) { return a < b; }                                   \
  static inline bool __hle(T a, T b) { return a <= b; }                                  \
  static inline bool __hgt(T a, T b) { return a > b; }                                   \
  static inline bool __hge(T a, T b) { return a >= b; }                                  \
  static inline float __low2float(T2 a) { return (float)a.x; }                           \
  static inline float __high2float(T2 a) { return (float)a.y; }                          \
  static inline T __low2half(T2 a) { return a.x; }                                       \
  static inline T __high2half(T2 a) { return a.y; }                                     \
  static inline T2 __hadd2(T2 a, T2 b) { return T2{a.x + b.x, a.y + b.y}; }              \
  static inline T2 __hsub2(T2 a, T2 b) { return T2{a.x - b.x, a.y - b.y}; }              \
  static inline T2 __hmul2(T2 a, T2 b) { return T2{a.x * b.x, a.y * b.y}; }              \
  static inline T2 __hfma2(T2 a, T2 b, T2 c) {                                           \
    return T2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)};                             \
  }                                                                                      \
  static inline T2 operator+(const T2& a, const T2& b) { return __hadd2(a, b); }         \
  static inline T2 operator-(const T2& a, const T2& b) { return __hsub2(a, b); }         \
  static inline T2 operator*(const T2& a, const T2& b) { return __hmul2(a, b); }         \
  /* one atomic access each, not instrumented themselves (as cuemu.h's atomics) */        \
  static inline __attribute__((noinline, no_sanitize_thread)) T atomicAdd(T* p, T v) {    \
    cuemu_atomic_access(p, sizeof(T), __builtin_return_address(0));                      \
    T old = *p;                                                                          \
    *p = old + v;                                                                        \
    return old;                                                                          \
  }                                                                                      \
  static inline __attribute__((noinline, no_sanitize_thread)) T2 atomicAdd(T2* p, T2 v) { \
    cuemu_atomic_access(p, sizeof(T2), __builtin_return_address(0));                     \
    T2 old = *p;                                                                         \
    *p = old + v;                                                                        \
    return old;                                                                          \
  }
