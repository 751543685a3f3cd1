// good.cu: correct kernels for the emulator self-tests (tests/test_emulator.py).
// Each kernel has a NumPy model in the test; the same file must also compile with
// NVRTC (sm_80, C++17), which the test checks when libnvrtc is available.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common.cuh"

// Block sum: warp shuffles, then one value per warp through static shared memory.
// x: [n], out: [gridDim.x]; block size a multiple of 32, up to 1024.
__global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  __shared__ float warp_sums[32];
  float v = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    v += x[i];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

// Every lane's result of the four shuffles for a given offset and width.
// out: [4, 32] int: idx, up, down, xor.
__global__ void shuffles(int* out, int offset, int width) {
  const int lane = threadIdx.x;
  const int v = 100 + lane;
  out[0 * 32 + lane] = __shfl_sync(0xffffffffu, v, offset, width);
  out[1 * 32 + lane] = __shfl_up_sync(0xffffffffu, v, offset, width);
  out[2 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, offset, width);
  out[3 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, offset, width);
}

// The four shuffles with each lane's own width, widths[lane] (PTX takes the width operand per
// thread: a lane's segment, and so its source lane, follow its own width). out: as in shuffles.
__global__ void shuffles_per_lane_width(int* out, int offset, const int* widths) {
  const int lane = threadIdx.x, width = widths[lane];
  const int v = 100 + lane;
  out[0 * 32 + lane] = __shfl_sync(0xffffffffu, v, offset, width);
  out[1 * 32 + lane] = __shfl_up_sync(0xffffffffu, v, offset, width);
  out[2 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, offset, width);
  out[3 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, offset, width);
}

// Shuffles of 8-byte values and default widths, votes and match; `lone` is the one lane that votes
// apart from the others in rows 1, 2 and 4.
// out_d: [32] double, out_u: [5, 32] unsigned.
__global__ void warp_votes(double* out_d, unsigned* out_u, int lone) {
  const int lane = threadIdx.x;
  out_d[lane] = __shfl_down_sync(0xffffffffu, 0.5 * lane, 1);
  out_u[0 * 32 + lane] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  out_u[1 * 32 + lane] = __any_sync(0xffffffffu, lane == lone);
  out_u[2 * 32 + lane] = __all_sync(0xffffffffu, lane != lone);
  out_u[3 * 32 + lane] = __match_any_sync(0xffffffffu, lane / 4);
  out_u[4 * 32 + lane] = __ballot_sync(0xffffffffu, lane == lone);
  __syncwarp();
}

// Warp reductions (sm_80) over the lanes of `mask`; the other lanes return first. Rows of out_i:
// add, min, max of the values as int; of out_u: add, min, max, and, or, xor of them as unsigned.
// values: [32] int, out_i: [3, 32] int, out_u: [6, 32] unsigned.
__global__ void warp_reductions(const int* values, int* out_i, unsigned* out_u, unsigned mask) {
  const int lane = threadIdx.x;
  if (!(mask >> lane & 1u)) return;
  const int v = values[lane];
  const unsigned u = (unsigned)v;
  out_i[0 * 32 + lane] = __reduce_add_sync(mask, v);
  out_i[1 * 32 + lane] = __reduce_min_sync(mask, v);
  out_i[2 * 32 + lane] = __reduce_max_sync(mask, v);
  out_u[0 * 32 + lane] = __reduce_add_sync(mask, u);
  out_u[1 * 32 + lane] = __reduce_min_sync(mask, u);
  out_u[2 * 32 + lane] = __reduce_max_sync(mask, u);
  out_u[3 * 32 + lane] = __reduce_and_sync(mask, u);
  out_u[4 * 32 + lane] = __reduce_or_sync(mask, u);
  out_u[5 * 32 + lane] = __reduce_xor_sync(mask, u);
}

// A half-warp shuffle inside a branch: lanes 0-15 only, with a matching mask.
// out: [32] int.
__global__ void half_warp(int* out) {
  const int lane = threadIdx.x;
  int v = lane;
  if (lane < 16) v = __shfl_down_sync(0x0000ffffu, v, 8, 16);
  out[lane] = v;
}

// Atomics from every thread of every block. The CAS loop starts from an atomic read: a plain
// read of a word other threads update atomically is a data race (the race checker says so).
// ints: [7] int: add, max, min, or, and, cas counter, exch; f: [1] float; u64: [1] ull.
__global__ void atomics(int* ints, float* f, unsigned long long* u64) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&ints[0], 1);
  atomicMax(&ints[1], t);
  atomicMin(&ints[2], -t);
  atomicOr(&ints[3], 1 << (t % 31));
  atomicAnd(&ints[4], ~(1 << (t % 7)));
  int old = atomicAdd(&ints[5], 0), assumed;
  do {
    assumed = old;
    old = atomicCAS(&ints[5], assumed, assumed + 2);
  } while (old != assumed);
  atomicAdd(f, 0.5f);
  atomicAdd(u64, 1ull << 32);
  atomicExch(&ints[6], 7);
}

// Reverses each block's chunk through dynamic shared memory (declared in common.cuh).
// x, y: [gridDim.x * blockDim.x].
__global__ void reverse_chunks(const float* x, float* y) {
  float* s = dyn_smem_floats();
  const int base = blockIdx.x * blockDim.x;
  s[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  y[base + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// The same through a local extern __shared__ declaration of float4 with alignment.
// x, y: [gridDim.x * blockDim.x] float4.
__global__ void reverse_float4(const float4* x, float4* y) {
  extern __shared__ __align__(16) float4 s4[];
  const int base = blockIdx.x * blockDim.x;
  s4[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  y[base + threadIdx.x] = s4[blockDim.x - 1 - threadIdx.x];
}

// Writes (blockIdx, threadIdx, blockDim, gridDim) per thread of a 3-D launch.
// out: [total threads, 12] int, row = linear global thread id.
__global__ void indices3d(int* out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* row = out + 12 * (b * (blockDim.x * blockDim.y * blockDim.z) + t);
  const uint3 bi = blockIdx, ti = threadIdx;
  const dim3 bd = blockDim, gd = gridDim;
  int v[12] = {(int)bi.x, (int)bi.y, (int)bi.z, (int)ti.x, (int)ti.y, (int)ti.z,
               (int)bd.x, (int)bd.y, (int)bd.z, (int)gd.x, (int)gd.y, (int)gd.z};
  for (int i = 0; i < 12; ++i) row[i] = v[i];
}

// y = a * x + y in storage type T with float math, rounded once on store.
template <typename T>
__global__ void axpy(const T* x, T* y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = T(a * static_cast<float>(x[i]) + static_cast<float>(y[i]));
}

// Conversions under test: float -> half / bf16 bits and back.
// x: [n] float; h, b: [n] unsigned short; hf, bf: [n] float.
__global__ void convert(const float* x, unsigned short* h, unsigned short* b, float* hf,
                        float* bf, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half hv = __float2half_rn(x[i]);
  const __nv_bfloat16 bv = __float2bfloat16_rn(x[i]);
  h[i] = __half_as_ushort(hv);
  b[i] = __bfloat16_as_ushort(bv);
  hf[i] = __half2float(__ushort_as_half(h[i]));
  bf[i] = __bfloat162float(__ushort_as_bfloat16(b[i]));
}

// Barrier predicates (each of and / or with a true and a false outcome) and a warp-level
// activemask inside a branch. out: [6] int (block 0 writes).
__global__ void barrier_preds(int* out) {
  const int c = __syncthreads_count(threadIdx.x % 2 == 0);
  const int a = __syncthreads_and(threadIdx.x < blockDim.x);
  const int o = __syncthreads_or(threadIdx.x == 5);
  const int a_false = __syncthreads_and(threadIdx.x != 3);
  const int o_false = __syncthreads_or(threadIdx.x > blockDim.x);
  unsigned m = 0;
  if (threadIdx.x < 8) m = __activemask();
  if (threadIdx.x == 0) {
    out[0] = c;
    out[1] = a;
    out[2] = o;
    out[3] = (int)m;
    out[4] = a_false;
    out[5] = o_false;
  }
}

// __match_any_sync over each half-warp's own mask: values repeat across the halves, and a
// lane matches only lanes of its mask. out: [32] unsigned.
__global__ void match_in_halves(unsigned* out) {
  const int lane = threadIdx.x;
  out[lane] = __match_any_sync(lane < 16 ? 0x0000ffffu : 0xffff0000u, lane % 4 == 0 ? 7 : 9);
}

// __activemask() in both arms of a branch that splits off each warp's lane 0: each arm's lanes
// get the mask of that arm. out: [blockDim.x] unsigned.
__global__ void activemask_in_two_arms(unsigned* out) {
  unsigned m;
  if (threadIdx.x % 32 == 0)
    m = __activemask();
  else
    m = __activemask();
  out[threadIdx.x] = m;
}

// Scalars of every packing rule: CuPy passes a Python int as long long, a Python
// float as double, a bool as one byte.
// out: [4] double.
__global__ void scalars(double* out, long long i, double d, bool b, float f) {
  out[0] = (double)i;
  out[1] = d;
  out[2] = b ? 1.0 : 0.0;
  out[3] = f;
}

// Writes through a null-able pointer.
__global__ void maybe_null(float* p, float* flag) { flag[0] = p == nullptr ? 1.f : 0.f; }

// Math functions the kernels use, for a smoke test against NumPy.
// x: [n] float in (0, 2); y: [n, 8] float.
__global__ void math(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  float s, c;
  sincosf(v, &s, &c);
  float r[8] = {expf(v), __expf(v), logf(v), rsqrtf(v), tanhf(v), s, c,
                fmaxf(min(v, 1.5f), max(0.25f, v * 0.5f))};
  for (int k = 0; k < 8; ++k) y[i * 8 + k] = r[k];
}

// Device printf.
__global__ void hello(int tag) {
  if (threadIdx.x == 1) printf("hello from block %d thread %d tag %d\n", (int)blockIdx.x,
                               (int)threadIdx.x, tag);
}

// Many barriers and shuffles: the representative load for the speed test.
// x: [4096] float; out: [gridDim.x] float; block of 128.
__global__ void __launch_bounds__(128) busy(const float* x, float* out, int iters) {
  __shared__ float partial[4];
  float acc = 0.f;
  for (int it = 0; it < iters; ++it) {
    float v = x[(blockIdx.x * blockDim.x + threadIdx.x + it) & 4095];
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    acc += partial[0] + partial[1] + partial[2] + partial[3];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// One use of each emulated intrinsic, to prove the API surface compiles for both
// targets; a few results are checked. x: [4] float = (0.5, 2, -3, 7); out: [32] float.
__device__ __forceinline__ float twice(float v) { return 2.f * v; }
__device__ __noinline__ double thrice(double v) { return 3.0 * v; }
struct __align__(16) Pair { float a, b; };
__global__ void intrinsics(const float* x, float* out) {
  if (threadIdx.x != 0) return;
  const float a = x[0], b = x[1], c = x[2];
  float s, co;
  double sd, cd;
  sincosf(a, &s, &co);
  sincos((double)a, &sd, &cd);
  const float2 f2 = make_float2(a, b);
  const float4 f4 = make_float4(a, b, c, x[3]);
  const int2 i2 = make_int2(3, -4);
  const uint4 u4 = make_uint4(1u, 2u, 3u, 4u);
  const Pair p = {a, b};
  const __half h = __float2half(b);
  const __nv_bfloat16 bf = __float2bfloat16(c);
  float r[32] = {
      expf(a), exp2f(b), __expf(a), logf(b), __logf(b), tanhf(a), sqrtf(b), rsqrtf(b),
      fmaxf(a, c), fminf(a, c), fabsf(c), fmaf(a, b, c), __fdividef(b, a), __frcp_rn(b),
      floorf(c + 0.5f), ceilf(c + 0.5f), sinf(a) - s, cosf(a) - co,
      (float)(exp((double)a) + sin(sd) * 0.0 + cos(cd) * 0.0 + pow(2.0, 3.0) + sqrt(4.0) +
              fma(1.0, 2.0, 3.0)),
      __int_as_float(__float_as_int(a)) + __uint_as_float(__float_as_uint(b)),
      (float)(min(3, -4) + max(3u, 4u) + min(5ll, 6ll)) + min(a, b) + max(a, b),
      f2.x + f2.y + f4.w + (float)(i2.x + i2.y) + (float)(u4.x + u4.w) + p.a + p.b,
      __half2float(h) + __bfloat162float(bf) + (float)__half_as_ushort(__ushort_as_half(1)) +
          (float)__bfloat16_as_ushort(__ushort_as_bfloat16(2)) + __half2float(__float2half_rn(a)) +
          __bfloat162float(__float2bfloat16_rn(a)) + (float)h + (float)__nv_bfloat16(1.5f),
      twice(a) + (float)thrice(1.0), (float)warpSize, (float)__popc(0xF0u) + (float)__clz(1),
      0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  __threadfence();
  for (int i = 0; i < 32; ++i) out[i] = r[i];
}

// 16-bit arithmetic operators (each result rounded once to T).
// a, b: [n]; out: [4, n]: a + b, a - b, a * b, a / b.
template <typename T>
__global__ void fp16_ops(const T* a, const T* b, T* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[0 * n + i] = a[i] + b[i];
  out[1 * n + i] = a[i] - b[i];
  out[2 * n + i] = __hmul(a[i], b[i]);
  out[3 * n + i] = a[i] / b[i];
}

// Each block's thread 0 takes the next slot of a counter and writes its block index there,
// so order[k] is the k-th block to run (tests/test_schedules.py). order: [gridDim.x] unsigned,
// next: [1] unsigned (zeroed).
__global__ void record_block_order(unsigned* order, unsigned* next) {
  if (threadIdx.x == 0) order[atomicAdd(next, 1u)] = blockIdx.x;
}
