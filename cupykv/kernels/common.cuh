// common.cuh: helpers shared by every cupykv kernel.
//
// - storage-type conversions (float, __half, __nv_bfloat16) through fp32,
//   round-to-nearest-even on the way back;
// - warp-wide max/sum by butterfly shuffles (and a paired sum of two values);
// - the half-split rotary embedding (LLaMA / GPT-NeoX), computed in double
//   so that the angle pos * theta^(-2i/d) stays accurate at long positions;
// - the launch gate (gated_off): the run_if word every op kernel reads first;
// - the float constants NVRTC does not define;
// - the online-softmax weight e^(x - max) on the base-2 exponential (exp_shifted);
// - Count<N>, a compile-time count passed to a generic lambda;
// - CUPYKV_COMMON_PATH, the mark on a hot loop's run-time tests that the instruction count fixes.
//
// Compiles under NVRTC (sm_80, sm_90) and under cupykv's CPU emulator, which
// supplies its own <cuda_fp16.h> and <cuda_bf16.h>.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupykv {

// The launch gate of the op kernels (their trailing `run_if` argument): a device-resident int32
// word, read at run time, so a captured graph sees its value at every replay. 0 means "do
// nothing": the kernel's first statement is `if (cupykv::gated_off(run_if)) return;`, before
// any barrier, shared memory, atomic or other global access, so a gated-off launch reads these
// 4 bytes and nothing else, and writes nothing. Every thread of the grid reads the same word,
// which no launch writes (the host refuses a run_if overlapping an output), so the return is
// uniform across each block: no thread is left waiting at a barrier. The host passes
// Backend.always_run() (a word holding 1) when the caller gives no run_if.
__device__ __forceinline__ bool gated_off(const int* __restrict__ run_if) { return *run_if == 0; }

__device__ __forceinline__ float neg_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// A device-resident argument read once more where it is needed, instead of held in a register from
// an earlier read through a long loop (volatile: the compiler may not reuse that read). Only for
// words that no thread writes during the launch, such as the lengths attention reads.
__device__ __forceinline__ int read_again(const int* word) { return *static_cast<const volatile int*>(word); }

// A compile-time count as a value: a generic lambda called with Count<1>{} or Count<3>{} is
// compiled once for each, with decltype(arg)::value a constant (NVRTC has no <type_traits>).
template <int N> struct Count { static constexpr int value = N; };

// CUPYKV_COMMON_PATH(test, common_outcome) marks a run-time test of a kernel's hot loop. Every real
// build evaluates `test`. The instruction count (cupykv.step_instructions, `python -m cupykv check
// --steps`) defines CUPYKV_COUNT_COMMON_PATH and compiles `common_outcome` instead, a constant, so
// that the loop it disassembles is the one a step on the common path issues, without the branches
// it does not take. `common_outcome` may name CUPYKV_STEP_RESCALES (0 or 1), which the count also
// defines, for a test whose outcome it counts both ways, or CUPYKV_STEP_ROWS (attention_f32.cu: a
// warp's live rows, 0 to 4), which it defines for each count.
#if defined(CUPYKV_COUNT_COMMON_PATH)
#define CUPYKV_COMMON_PATH(test, common_outcome) (common_outcome)
#elif defined(CUPYKV_EMULATOR)
// The emulator counts each thread's outcome inside emulator.traffic() (LaunchTraffic.path_outcomes).
#define CUPYKV_COMMON_PATH(test, common_outcome) (cupykv::counted_outcome((test), __FILE__, __LINE__))
template <typename V>
__device__ __forceinline__ V counted_outcome(V value, const char* file, int line) {
    cuemu_count_path_outcome(file, line, (long long)value);
    return value;
}
#else
#define CUPYKV_COMMON_PATH(test, common_outcome) (test)
#endif

// The online-softmax weight e^(x - max), x <= max, times 2^log2_factor, as
// 2^((x - max) log2 e + log2_factor): the difference is rounded first, so x == max gives exactly
// 2^log2_factor and a large max adds no error of its own (folding log2 e into the logits would round
// max * log2 e instead); a power-of-two factor (0 by default) moves a weight's range, not its bits,
// in the same FFMA. exp2f is one MUFU.EX2 under -ftz=true, which CuPy always passes, against about
// eight instructions for expf; its 2 ulp and the product's rounding (relative |x - max| 2^-24) stay
// far inside the stated fp32 accumulation term. x = -inf (a masked key) gives 0; the caller handles
// max = -inf (no key attended).
__device__ __forceinline__ float exp_shifted(float x, float max, float log2_factor = 0.0f) {
    return exp2f(fmaf(x - max, 1.4426950408889634f, log2_factor));
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The max and the sum of x over each group of LANES consecutive lanes (a power of two up to 32: the
// whole warp by default), returned to every lane of the group.
template <int LANES = 32> __device__ __forceinline__ float warp_max(float x) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "warp_max: lanes a power of two");
    for (int offset = LANES / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

template <int LANES = 32> __device__ __forceinline__ float warp_sum(float x) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "warp_sum: lanes a power of two");
    for (int offset = LANES / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Sums two values over the warp with five exchanges instead of ten: the first exchange leaves
// partial sums of `first` in lanes 0-15 and of `second` in lanes 16-31, then each half-warp
// finishes its own. Lane 0 returns the total of `first`, lane 16 that of `second`.
__device__ __forceinline__ float warp_sum_pair(float first, float second) {
    const bool upper = (threadIdx.x & 16) != 0;
    float x = (upper ? second : first) + __shfl_xor_sync(0xffffffffu, upper ? first : second, 16);
    for (int offset = 8; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Rotates the pair (x[i], x[i + head_dim/2]) of a row at position `pos`.
// On return *lo and *hi hold the rotated pair.
__device__ __forceinline__ void rope_rotate_pair(float* lo, float* hi, int pos, int i, int head_dim,
                                                 double theta) {
    const double inv_freq = pow(theta, -2.0 * (double)i / (double)head_dim);
    double sin_a, cos_a;
    sincos((double)pos * inv_freq, &sin_a, &cos_a);
    const double x_lo = *lo, x_hi = *hi;
    *lo = (float)(x_lo * cos_a - x_hi * sin_a);
    *hi = (float)(x_hi * cos_a + x_lo * sin_a);
}

}  // namespace cupykv
