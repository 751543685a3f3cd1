// cuemu.h: CUDA device-code emulation for the host (force-included with -include).
//
// A kernel .cu file compiles unmodified with g++ once this header is included first:
// every CUDA thread runs as a fiber of the emulator runtime (runtime.cpp), so
// __syncthreads() and the warp intrinsics have their real meaning and are checked.
//
// What kernel authors must know:
//  * Dynamic shared memory is `extern __shared__ T name[];` (alignment qualifiers
//    allowed); the Python builder rewrites that line into a pointer to the launch's
//    dynamic shared memory, keeping line numbers.
//  * Static `__shared__` variables are thread_local storage shared by the fibers of
//    the running block. Inside a function each one is boxed between guard bytes and reached
//    through a reference (the builder rewrites the declarations; see cuemu::static_shared): its
//    bytes are poisoned before the block's first fiber reaches the declaration, and an access
//    to the guards fails, as past the end of dynamic shared memory.
//  * Barriers and warp operations are identified by call site (__FILE__:__LINE__).
//  * The builder compiles kernels with GCC's ThreadSanitizer instrumentation (without its
//    runtime library): every read and write of memory calls a hook of the runtime
//    (access.cpp), which feeds the race checker and the traffic counter. Accesses to locals
//    that stay in registers cost nothing.
//  * __CUDA_ARCH__ and __CUDACC__ are NOT defined; CUPYKV_EMULATOR is.
#pragma once
#define CUPYKV_EMULATOR 1

#include <assert.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "cuemu_abi.h"

// ---- qualifiers -------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __shared__ thread_local
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)   // its arguments move into the kernel's body (CUEMU_LAUNCH_BOUNDS)
#define __maxnreg__(...)
#define __cluster_dims__(...)

// ---- vector types -----------------------------------------------------------------
#define CUEMU_VEC2(T, N, A)                                         \
  struct __attribute__((aligned(A))) N { T x, y; };                 \
  static inline N make_##N(T x, T y) { return N{x, y}; }
#define CUEMU_VEC3(T, N)                                            \
  struct N { T x, y, z; };                                          \
  static inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define CUEMU_VEC4(T, N, A)                                         \
  struct __attribute__((aligned(A))) N { T x, y, z, w; };           \
  static inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }

CUEMU_VEC2(float, float2, 8)
CUEMU_VEC3(float, float3)
CUEMU_VEC4(float, float4, 16)
CUEMU_VEC2(int, int2, 8)
CUEMU_VEC3(int, int3)
CUEMU_VEC4(int, int4, 16)
CUEMU_VEC2(unsigned int, uint2, 8)
CUEMU_VEC4(unsigned int, uint4, 16)
CUEMU_VEC2(double, double2, 16)
CUEMU_VEC2(long long, longlong2, 16)
CUEMU_VEC2(unsigned long long, ulonglong2, 16)
CUEMU_VEC2(short, short2, 4)
CUEMU_VEC2(unsigned short, ushort2, 4)
CUEMU_VEC4(short, short4, 8)
CUEMU_VEC4(unsigned short, ushort4, 8)
CUEMU_VEC2(char, char2, 2)
CUEMU_VEC4(char, char4, 4)
CUEMU_VEC2(unsigned char, uchar2, 2)
CUEMU_VEC4(unsigned char, uchar4, 4)
static inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) {
  return uint3{x, y, z};
}
#undef CUEMU_VEC2
#undef CUEMU_VEC3
#undef CUEMU_VEC4

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---- built-in variables (per fiber; read-only) ---------------------------------------
#define threadIdx (static_cast<const uint3&>(::cuemu_ctx.thread_idx))
#define blockIdx (static_cast<const uint3&>(::cuemu_ctx.block_idx))
#define blockDim (static_cast<const uint3&>(::cuemu_ctx.block_dim))
#define gridDim (static_cast<const uint3&>(::cuemu_ctx.grid_dim))
constexpr int warpSize = 32;

// A kernel's __launch_bounds__ arguments, which source.py moves to the top of its body: compiled in
// the kernel's scope, as NVRTC compiles them (an ill-formed bound fails the build here too), and
// checked there per instance, template arguments included: a block of more threads than the first
// argument allows fails the launch, as on a GPU, at its first thread, before anything else ran.
#define CUEMU_LAUNCH_BOUNDS(...) ::cuemu_check_launch_bounds(#__VA_ARGS__, __VA_ARGS__)
static inline void cuemu_check_launch_bounds(const char* bounds, long long max_threads, long long = 0, long long = 0) {
  if ((long long)blockDim.x * blockDim.y * blockDim.z > max_threads) ::cuemu_launch_bounds_exceeded(bounds, max_threads);
}

namespace cuemu {
inline char* dynamic_shared() { return ::cuemu_ctx.dyn_smem; }

// The builder declares each static __shared__ variable of a function in a box with guard bytes,
//   thread_local struct { unsigned char lo[16]; T value[N]; unsigned char hi[16]; } cuemu_shared_x{};
//   auto& x = *::cuemu::static_shared(&cuemu_shared_x);
// (the prefix lets sites.py name it). static_shared() tells the runtime where the value lies, which
// poisons it once per block and fails an access to the guards (the runtime's call also hides the
// address from GCC, so that accesses through the reference are instrumented like any other).
template <class T>
__attribute__((always_inline)) inline T* opaque(T* p) {
  asm("" : "+r"(p));
  return p;
}

template <class Box>
__attribute__((always_inline)) inline auto* static_shared(Box* box) {
  static_assert(__builtin_offsetof(Box, value) == CUEMU_STATIC_SHARED_GUARD,
                "a static __shared__ variable aligned to more than 16 bytes");
  cuemu_static_shared(box, sizeof(box->value), sizeof(Box));
  return opaque(&box->value);
}

template <class T>
struct promoted {  // CUDA's warp intrinsics take int for small integers
  using type = typename std::conditional<std::is_integral<T>::value && (sizeof(T) < 4), int,
                                         T>::type;
};

// A call site; the warp intrinsics are member functions so that the optional
// arguments (width, mask) keep CUDA's defaults.
struct Site {
  const char* file;
  int line;

  template <class T>
  typename promoted<T>::type op(int code, unsigned mask, T v, int arg, int width) const {
    using U = typename promoted<T>::type;
    static_assert(std::is_trivially_copyable<U>::value &&
                      (sizeof(U) == 2 || sizeof(U) == 4 || sizeof(U) == 8),
                  "warp intrinsics take 2-, 4- or 8-byte values");
    U u = static_cast<U>(v);
    unsigned long long bits = 0;
    memcpy(&bits, &u, sizeof(U));
    bits = cuemu_warp_op(code, mask, bits, (int)sizeof(U), arg, width, file, line);
    memcpy(&u, &bits, sizeof(U));
    return u;
  }
  template <class T>
  typename promoted<T>::type shfl(unsigned mask, T v, int src, int width = 32) const {
    return op(CUEMU_SHFL_IDX, mask, v, src, width);
  }
  template <class T>
  typename promoted<T>::type shfl_up(unsigned mask, T v, unsigned d, int width = 32) const {
    return op(CUEMU_SHFL_UP, mask, v, (int)d, width);
  }
  template <class T>
  typename promoted<T>::type shfl_down(unsigned mask, T v, unsigned d, int width = 32) const {
    return op(CUEMU_SHFL_DOWN, mask, v, (int)d, width);
  }
  template <class T>
  typename promoted<T>::type shfl_xor(unsigned mask, T v, int lane_mask, int width = 32) const {
    return op(CUEMU_SHFL_XOR, mask, v, lane_mask, width);
  }
  unsigned ballot(unsigned mask, int pred) const {
    return (unsigned)cuemu_warp_op(CUEMU_BALLOT, mask, pred != 0, 4, 0, 32, file, line);
  }
  int all(unsigned mask, int pred) const {
    return (int)cuemu_warp_op(CUEMU_ALL, mask, pred != 0, 4, 0, 32, file, line);
  }
  int any(unsigned mask, int pred) const {
    return (int)cuemu_warp_op(CUEMU_ANY, mask, pred != 0, 4, 0, 32, file, line);
  }
  void syncwarp(unsigned mask = 0xffffffffu) const {
    cuemu_warp_op(CUEMU_SYNCWARP, mask, 0, 4, 0, 32, file, line);
  }
  unsigned activemask() const {
    return (unsigned)cuemu_warp_op(CUEMU_ACTIVEMASK, 0, 0, 4, 0, 32, file, line);
  }
  template <class T>
  unsigned match_any(unsigned mask, T v) const {
    static_assert(std::is_integral<T>::value && (sizeof(T) == 4 || sizeof(T) == 8),
                  "__match_any_sync takes 4- or 8-byte integers");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    return (unsigned)cuemu_warp_op(CUEMU_MATCH_ANY, mask, bits, (int)sizeof(T), 0, 32, file,
                                   line);
  }
  unsigned reduce(int code, unsigned mask, unsigned v) const {
    return (unsigned)cuemu_warp_op(code, mask, v, 4, 0, 32, file, line);
  }
  int reduce(int code, unsigned mask, int v) const {
    if (code == CUEMU_REDUCE_UMIN) code = CUEMU_REDUCE_MIN;
    if (code == CUEMU_REDUCE_UMAX) code = CUEMU_REDUCE_MAX;
    return (int)(unsigned)cuemu_warp_op(code, mask, (unsigned)v, 4, 0, 32, file, line);
  }
};
}  // namespace cuemu

#define CUEMU_SITE (::cuemu::Site{__FILE__, __LINE__})

// ---- barriers and warp intrinsics (call-site aware macros) ------------------------
#define __syncthreads() ((void)::cuemu_barrier(CUEMU_BAR_SYNC, 0, __FILE__, __LINE__))
#define __syncthreads_count(p) ::cuemu_barrier(CUEMU_BAR_COUNT, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_and(p) ::cuemu_barrier(CUEMU_BAR_AND, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_or(p) ::cuemu_barrier(CUEMU_BAR_OR, (p) != 0, __FILE__, __LINE__)
#define __syncwarp(...) (CUEMU_SITE.syncwarp(__VA_ARGS__))
#define __shfl_sync(...) (CUEMU_SITE.shfl(__VA_ARGS__))
#define __shfl_up_sync(...) (CUEMU_SITE.shfl_up(__VA_ARGS__))
#define __shfl_down_sync(...) (CUEMU_SITE.shfl_down(__VA_ARGS__))
#define __shfl_xor_sync(...) (CUEMU_SITE.shfl_xor(__VA_ARGS__))
#define __ballot_sync(m, p) (CUEMU_SITE.ballot((m), (p)))
#define __all_sync(m, p) (CUEMU_SITE.all((m), (p)))
#define __any_sync(m, p) (CUEMU_SITE.any((m), (p)))
#define __activemask() (CUEMU_SITE.activemask())
#define __match_any_sync(m, v) (CUEMU_SITE.match_any((m), (v)))
#define __reduce_add_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_ADD, (m), (v)))
#define __reduce_min_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_UMIN, (m), (v)))
#define __reduce_max_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_UMAX, (m), (v)))
#define __reduce_and_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_AND, (m), (unsigned)(v)))
#define __reduce_or_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_OR, (m), (unsigned)(v)))
#define __reduce_xor_sync(m, v) (CUEMU_SITE.reduce(CUEMU_REDUCE_XOR, (m), (unsigned)(v)))

#define __trap() ::cuemu_trap("__trap()", __FILE__, __LINE__)
#define __brkpt() ::cuemu_trap("__brkpt()", __FILE__, __LINE__)

// Fibers of a block run one at a time on one OS thread, so fences only need to stop
// the compiler from caching memory across them (an empty asm: __atomic_thread_fence would
// become a __tsan_atomic_thread_fence call under the instrumentation). A device or system fence
// is also told to the race checker (cuemu_threadfence, an opaque call: a compiler barrier too),
// which orders blocks through fence-atomic pairs; a block fence orders nothing between blocks.
static inline void __threadfence() { cuemu_threadfence(); }
static inline void __threadfence_block() { __asm__ __volatile__("" ::: "memory"); }
static inline void __threadfence_system() { cuemu_threadfence(); }
static inline long long clock64() { return cuemu_clock64(); }
static inline void __nanosleep(unsigned) {}

// ---- atomics (plain read-modify-write: fibers never interleave inside one) ---------
// Not instrumented and never inlined: each reports one atomic access at its caller's site to
// the observers (the race checker does not count two atomics as a race; the traffic counter
// counts it as an atomic, neither load nor store), and its own read and write are not seen.
#define CUEMU_ATOMIC_FN static inline __attribute__((noinline, no_sanitize_thread))
#define CUEMU_ATOMIC(NAME, T, EXPR)                                         \
  CUEMU_ATOMIC_FN T NAME(T* address, T val) {                               \
    cuemu_atomic_access(address, sizeof(T), __builtin_return_address(0));   \
    T old = *address;                                                       \
    *address = (EXPR);                                                      \
    cuemu_atomic_done();                                                    \
    return old;                                                             \
  }
CUEMU_ATOMIC(atomicAdd, int, old + val)
CUEMU_ATOMIC(atomicAdd, unsigned int, old + val)
CUEMU_ATOMIC(atomicAdd, unsigned long long, old + val)
CUEMU_ATOMIC(atomicAdd, float, old + val)
CUEMU_ATOMIC(atomicAdd, double, old + val)
CUEMU_ATOMIC(atomicSub, int, old - val)
CUEMU_ATOMIC(atomicSub, unsigned int, old - val)
CUEMU_ATOMIC(atomicExch, int, val)
CUEMU_ATOMIC(atomicExch, unsigned int, val)
CUEMU_ATOMIC(atomicExch, unsigned long long, val)
CUEMU_ATOMIC(atomicExch, float, val)
CUEMU_ATOMIC(atomicMax, int, old > val ? old : val)
CUEMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
CUEMU_ATOMIC(atomicMax, long long, old > val ? old : val)
CUEMU_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
CUEMU_ATOMIC(atomicMin, int, old < val ? old : val)
CUEMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
CUEMU_ATOMIC(atomicMin, long long, old < val ? old : val)
CUEMU_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
CUEMU_ATOMIC(atomicAnd, int, old & val)
CUEMU_ATOMIC(atomicAnd, unsigned int, old & val)
CUEMU_ATOMIC(atomicAnd, unsigned long long, old & val)
CUEMU_ATOMIC(atomicOr, int, old | val)
CUEMU_ATOMIC(atomicOr, unsigned int, old | val)
CUEMU_ATOMIC(atomicOr, unsigned long long, old | val)
CUEMU_ATOMIC(atomicXor, int, old ^ val)
CUEMU_ATOMIC(atomicXor, unsigned int, old ^ val)
CUEMU_ATOMIC(atomicXor, unsigned long long, old ^ val)
CUEMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
CUEMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef CUEMU_ATOMIC
#define CUEMU_ATOMIC_CAS(T)                                                 \
  CUEMU_ATOMIC_FN T atomicCAS(T* address, T compare, T val) {               \
    cuemu_atomic_access(address, sizeof(T), __builtin_return_address(0));   \
    T old = *address;                                                       \
    if (old == compare) *address = val;                                     \
    cuemu_atomic_done();                                                    \
    return old;                                                             \
  }
CUEMU_ATOMIC_CAS(int)
CUEMU_ATOMIC_CAS(unsigned int)
CUEMU_ATOMIC_CAS(unsigned long long)
CUEMU_ATOMIC_CAS(unsigned short)
#undef CUEMU_ATOMIC_CAS
#undef CUEMU_ATOMIC_FN

// ---- bit reinterpretation and conversions ------------------------------------------
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
static inline unsigned int __float_as_uint(float x) { unsigned u; memcpy(&u, &x, 4); return u; }
static inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
static inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)truncf(x); }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }
static inline unsigned int __float2uint_rn(float x) { return (unsigned int)nearbyintf(x); }
static inline unsigned int __float2uint_rz(float x) { return (unsigned int)truncf(x); }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline long long __float2ll_rz(float x) { return (long long)truncf(x); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned int x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }
static inline int __double2int_rz(double x) { return (int)trunc(x); }

// ---- math -------------------------------------------------------------------------
// Standard names (expf, logf, tanhf, sqrtf, fmaf, sinf, cosf, sincosf, exp, pow, ...) come
// from libm and are correctly rounded or close to it; the GPU's may differ in the last
// ulps. The fast exponentials and logarithms below keep the GPU's main error: they go through
// base 2 as its ex2.approx / lg2.approx do, with the fp32 product rounded (x * log2(e) for
// __expf, whose error grows with |x|), so a kernel that trades accuracy for them fails an
// accuracy test here too. The rest map to the accurate functions.
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
// glibc declares (but does not export) __expf & co., so these are renamed by macros.
#define __expf cuemu_expf
#define __exp10f cuemu_exp10f
#define __logf cuemu_logf
#define __log2f cuemu_log2f
#define __log10f cuemu_log10f
#define __sinf cuemu_sinf
#define __cosf cuemu_cosf
#define __tanf cuemu_tanf
#define __sincosf cuemu_sincosf
#define __powf cuemu_powf
static inline float cuemu_fmul_rn(float a, float b) { volatile float product = a * b; return product; }
static inline float cuemu_expf(float x) { return exp2f(cuemu_fmul_rn(x, 1.44269504f)); }
static inline float cuemu_exp10f(float x) { return exp2f(cuemu_fmul_rn(x, 3.32192809f)); }
static inline float cuemu_logf(float x) { return cuemu_fmul_rn(log2f(x), 0.693147181f); }
static inline float cuemu_log2f(float x) { return log2f(x); }
static inline float cuemu_log10f(float x) { return cuemu_fmul_rn(log2f(x), 0.301029996f); }
static inline float cuemu_sinf(float x) { return sinf(x); }
static inline float cuemu_cosf(float x) { return cosf(x); }
static inline float cuemu_tanf(float x) { return tanf(x); }
static inline void cuemu_sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
static inline float cuemu_powf(float x, float y) { return exp2f(cuemu_fmul_rn(y, log2f(x))); }
static inline float __fdividef(float x, float y) { return x / y; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
static inline float __fadd_rn(float x, float y) { return x + y; }
static inline float __fsub_rn(float x, float y) { return x - y; }
static inline float __fmul_rn(float x, float y) { return x * y; }
static inline float __fdiv_rn(float x, float y) { return x / y; }
static inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
static inline double __dadd_rn(double x, double y) { return x + y; }
static inline double __dmul_rn(double x, double y) { return x * y; }
static inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
static inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }

#define CUEMU_MINMAX(A, B, R)                                                   \
  static inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }           \
  static inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
CUEMU_MINMAX(int, int, int)
CUEMU_MINMAX(unsigned int, unsigned int, unsigned int)
CUEMU_MINMAX(int, unsigned int, unsigned int)
CUEMU_MINMAX(unsigned int, int, unsigned int)
CUEMU_MINMAX(long, long, long)
CUEMU_MINMAX(unsigned long, unsigned long, unsigned long)
CUEMU_MINMAX(long long, long long, long long)
CUEMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUEMU_MINMAX(long long, unsigned long long, unsigned long long)
CUEMU_MINMAX(unsigned long long, long long, unsigned long long)
#undef CUEMU_MINMAX
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(float a, double b) { return fmin(a, b); }
static inline double max(float a, double b) { return fmax(a, b); }
static inline double min(double a, float b) { return fmin(a, b); }
static inline double max(double a, float b) { return fmax(a, b); }
static inline unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
static inline unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
static inline long long llmin(long long a, long long b) { return a < b ? a : b; }
static inline long long llmax(long long a, long long b) { return a > b ? a : b; }
static inline unsigned long long ullmin(unsigned long long a, unsigned long long b) {
  return a < b ? a : b;
}
static inline unsigned long long ullmax(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}

// ---- integer intrinsics -----------------------------------------------------------
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
static inline unsigned long long __brevll(unsigned long long x) {
  return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline long long __mul64hi(long long a, long long b) {
  return (long long)(((__int128)a * b) >> 64);
}
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __mul24(int a, int b) {
  return (int)((long long)((a << 8) >> 8) * ((b << 8) >> 8));
}
static inline unsigned int __umul24(unsigned int a, unsigned int b) {
  return (a & 0xffffffu) * (b & 0xffffffu);
}

// ---- cache-hinted loads and stores: plain accesses ---------------------------------
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline T __ldcv(const T* p) { return *p; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwb(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// ---- registry support (used by the translation unit the builder appends) ----------
namespace cuemu {
namespace reg {
template <class T>
const char* type_name() { return __PRETTY_FUNCTION__; }

template <class T>
constexpr char kind() {
  return std::is_pointer<T>::value         ? 'p'
         : std::is_same<T, bool>::value    ? 'b'
         : std::is_floating_point<T>::value ? 'f'
         : std::is_integral<T>::value       ? (std::is_signed<T>::value ? 'i' : 'u')
                                            : 'o';
}

template <class F>
struct sig;
template <class... P>
struct sig<void (*)(P...)> {
  static constexpr unsigned n = sizeof...(P);
  static constexpr unsigned long long sizes[sizeof...(P) + 1] = {sizeof(P)..., 0};
  static constexpr char kinds[sizeof...(P) + 1] = {kind<P>()..., '\0'};
  static inline const char* const names[sizeof...(P) + 1] = {type_name<P>()..., nullptr};
  template <void (*F)(P...), size_t... I>
  static void call(void** a, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<P>*>(a[I])...);
  }
  template <void (*F)(P...)>
  static void invoke(void** a) {
    call<F>(a, std::index_sequence_for<P...>{});
  }
};

template <auto F>
cuemu_entry entry(const char* name) {
  using S = sig<decltype(F)>;
  return cuemu_entry{name, &S::template invoke<F>, S::n, S::sizes, S::kinds, S::names};
}
}  // namespace reg
}  // namespace cuemu

// ---- memcpy, memmove and memset of a constant size ------------------------------------------------
// g++'s ThreadSanitizer pass sees such a call only where it folds the call into one load and one
// store: memcpy and memmove of 1, 2, 4, 8 or 16 bytes. Any other constant size (3, 12, 32, ...), and
// every memset, it leaves to be expanded later into plain moves, which no check sees: not the
// bounds, the race, the traffic nor the unwritten-shared-memory one. In instrumented modules those
// calls go out of line instead, to the runtime's checked copies (access.cpp), where -Wl,--wrap
// sends every call of a size known only at run time. Macros, so that the call stays on the
// caller's line for the reports and for g++'s own findings of a copy past an object (the access
// attributes keep those: COPY_SIZE_ERRORS in build.py). Kernels name them unqualified, as NVRTC,
// which has no <cstring>, requires.
#if defined(__SANITIZE_THREAD__)
extern "C" void* __wrap_memcpy(void* dst, const void* src, size_t n)
    __attribute__((access(write_only, 1, 3), access(read_only, 2, 3)));
extern "C" void* __wrap_memmove(void* dst, const void* src, size_t n)
    __attribute__((access(write_only, 1, 3), access(read_only, 2, 3)));
extern "C" void* __wrap_memset(void* dst, int value, size_t n) __attribute__((access(write_only, 1, 3)));
namespace cuemu {
constexpr bool folded_copy_size(size_t n) { return n == 1 || n == 2 || n == 4 || n == 8 || n == 16; }
}  // namespace cuemu
#define memcpy(dst, src, n)                                                                        \
  (__builtin_constant_p(n) && ::cuemu::folded_copy_size(n) ? __builtin_memcpy((dst), (src), (n)) \
                                                           : __wrap_memcpy((dst), (src), (n)))
#define memmove(dst, src, n)                                                                        \
  (__builtin_constant_p(n) && ::cuemu::folded_copy_size(n) ? __builtin_memmove((dst), (src), (n)) \
                                                           : __wrap_memmove((dst), (src), (n)))
#define memset(dst, value, n) __wrap_memset((dst), (value), (n))
#endif
