// bugs.cu: kernels with planted bugs; the emulator must report each one clearly
// (tests/test_emulator.py). They compile for NVRTC too: the bugs are run-time bugs.
// assert needs no include: NVRTC provides it, and so does the emulator.

// (a) __syncthreads inside a branch taken by the first warp only.
__global__ void barrier_in_branch(float* y) {
  if (threadIdx.x < 32) {
    __syncthreads();
  }
  y[threadIdx.x] = 1.f;
}

// (b) early return by some threads, then a barrier.
__global__ void early_return(float* y, int n) {
  if ((int)threadIdx.x >= n) return;
  __syncthreads();
  y[threadIdx.x] = 1.f;
}

// Odd threads return and even threads wait at a barrier: the threads' states alternate at every
// thread, more ranges than a report lists. y: [blockDim.x] float.
__global__ void barrier_after_odd_threads_return(float* y) {
  if (threadIdx.x % 2) return;
  __syncthreads();
  y[threadIdx.x] = 1.f;
}

// Two barriers at different call sites in the two halves of an if/else.
__global__ void split_barriers(float* y) {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  y[threadIdx.x] = 1.f;
}

// (c) reads one element past the end of x (the last thread).
__global__ void read_past_end(const float* x, float* y) {
  y[threadIdx.x] = x[threadIdx.x + 1];
}

// (d) writes one element past the end of y.
__global__ void write_past_end(float* y) { y[threadIdx.x + 1] = 2.f; }

// (e) writes just before the start of y (in the slack before it: caught at once by the
// instrumentation, and by the canary after the launch where modules are not instrumented).
__global__ void write_before_start(float* y) {
  if (threadIdx.x == 3) y[-1] = 3.f;
}

// (f) dynamic shared memory indexed one past its end.
__global__ void smem_past_end(float* y) {
  extern __shared__ float s[];
  s[threadIdx.x + 1] = 1.f;
  __syncthreads();
  y[threadIdx.x] = s[threadIdx.x];
}

// (g) declares at most 64 threads per block.
__global__ void __launch_bounds__(64) small_blocks(float* y) { y[threadIdx.x] = 0.f; }

// (i) takes an int: a Python int (8-byte long long) does not fit.
__global__ void takes_int(float* y, int n) {
  if ((int)threadIdx.x < n) y[threadIdx.x] = 4.f;
}

// (j) a device assert that fails for thread 5.
__global__ void failing_assert(const int* x) { assert(x[threadIdx.x] != 5); }

// (j') a trap in one thread (tx, ty) of one block (bx, by, bz) of a 3D grid.
__global__ void trap_at(int bx, int by, int bz, int tx, int ty) {
  const bool here = blockIdx.x == bx && blockIdx.y == by && blockIdx.z == bz;
  if (here && threadIdx.x == tx && threadIdx.y == ty) __trap();
}

// (k) lanes 16-31 exit, lanes 0-15 then shuffle with a full mask.
__global__ void shuffle_exited_lane(float* y) {
  if (threadIdx.x >= 16) return;
  y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

// A shuffle that reads lane 16 while the mask names lanes 0-15 only.
__global__ void shuffle_outside_mask(int* y) {
  if (threadIdx.x < 16) y[threadIdx.x] = __shfl_down_sync(0x0000ffffu, (int)threadIdx.x, 8);
}

// Every thread of the block reads lane 0 of its segment of `width` lanes under `mask`: wrong for a
// width that is not a power of two in 1..32, or a mask naming lanes the block lacks.
__global__ void shuffle_width_and_mask(float* y, int width, unsigned mask) {
  y[threadIdx.x] = __shfl_sync(mask, (float)threadIdx.x, 0, width);
}

// Lanes of one mask at different shuffle call sites.
__global__ void shuffle_split_sites(int* y) {
  int v = threadIdx.x;
  if (threadIdx.x % 2) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else v = __shfl_xor_sync(0xffffffffu, v, 1);
  y[threadIdx.x] = v;
}

// (l) a huge local array: overflows the fiber stack.
__global__ void huge_local(float* y, int n) {
  volatile float big[200000];
  for (int i = 0; i < n; ++i) big[i] = (float)i;
  y[threadIdx.x] = big[n - 1];
}

// A null pointer dereference.
__global__ void null_deref(float* y) { y[threadIdx.x] = 1.f; }

// Integer division by zero (the GPU returns garbage; the emulator reports it).
__global__ void divide_by_zero(int* y, int d) { y[threadIdx.x] = 100 / d; }

// An illegal instruction in the threads that read 3: g++'s __builtin_trap is x86's ud2 (SIGILL);
// NVRTC has no __builtin_trap; CUDA code writes __trap, which the emulator reports itself
// (trap_at above).
__global__ void illegal_instruction(const int* x) {
  if (x[blockIdx.x * blockDim.x + threadIdx.x] != 3) return;
#ifdef CUPYKV_EMULATOR
  __builtin_trap();
#else
  __trap();
#endif
}

// (m) a static __shared__ array written one past its end through a pointer (an index into the
// array itself is caught by its bound first, kernels below): one slot per warp, off by one.
__global__ void static_smem_past_end(float* y) {
  __shared__ float warp_totals[4];
  float* const slots = warp_totals;
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32 + 1] = 1.f;
  __syncthreads();
  y[threadIdx.x] = warp_totals[threadIdx.x % 4];
}

// (n) a static __shared__ array written one before its start through a pointer.
__global__ void static_smem_before_start(float* y) {
  __shared__ float counts[8];
  __shared__ int flag;
  flag = 0;
  float* const slots = counts;
  if (threadIdx.x % 32 == 0) slots[(int)(threadIdx.x / 32) - 1] = 1.f;
  __syncthreads();
  y[threadIdx.x] = counts[threadIdx.x % 8] + (float)flag;
}

// (o) reads every slot of a static __shared__ array, of which each block's warps wrote only
// their own two: block b's warps write slots 2b and 2b + 1. The other slots hold poison, also
// those that the previous block wrote.
__global__ void static_smem_unwritten(float* y) {
  __shared__ float slots[8];
  if (threadIdx.x % 32 == 0) slots[2 * blockIdx.x + threadIdx.x / 32] = (float)(blockIdx.x + 1);
  __syncthreads();
  if (threadIdx.x < 8) y[8 * blockIdx.x + threadIdx.x] = slots[threadIdx.x];
}

// (p) a 16-byte vector load one float past a 16-byte boundary (an offset the caller forgot).
__global__ void misaligned_vector_load(float* y, const float* x) {
  const uint4 packed = reinterpret_cast<const uint4*>(x + 1)[threadIdx.x];
  float values[4];
  memcpy(values, &packed, 16);
  y[threadIdx.x] = values[0] + values[1] + values[2] + values[3];
}

// (p2) the same offset on a float4 whose components are then used one by one, the usual idiom; g++
// would turn the copy into four aligned 4-byte loads unless told to keep it whole (build.py).
__global__ void misaligned_float4_components(float* y, const float* x) {
  const float4 v = reinterpret_cast<const float4*>(x + 1)[threadIdx.x];
  y[threadIdx.x] = v.x + v.y + v.z + v.w;
}

// (q) an atomicAdd on an int at an odd byte address.
__global__ void misaligned_atomic(int* counts) {
  atomicAdd(reinterpret_cast<int*>(reinterpret_cast<char*>(counts) + 2), 1);
}

// (r) every thread reads its neighbour's slot of dynamic shared memory, which only even threads wrote.
__global__ void dyn_smem_half_written(float* y) {
  extern __shared__ float slots[];
  if (threadIdx.x % 2 == 0) slots[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  y[threadIdx.x] = slots[threadIdx.x ^ 1u];
}

// (s) counts the block's threads in a static __shared__ counter that nobody set to zero.
__global__ void uncleared_counter(int* y) {
  __shared__ int count;
  atomicAdd(&count, 1);
  __syncthreads();
  y[threadIdx.x] = count;
}

// (s2) every thread loads 16 bytes of dynamic shared memory that no thread wrote: one read each,
// although it spans four words. y: [blockDim.x] float.
__global__ void dyn_smem_vector_unwritten(float* y) {
  extern __shared__ uint4 quads[];
  const uint4 quad = quads[threadIdx.x];
  y[threadIdx.x] = __uint_as_float(quad.x) + __uint_as_float(quad.w);
}

// (t) reads one element before the start of x (thread 0).
__global__ void read_before_start(const float* x, float* y) {
  y[threadIdx.x] = x[(int)threadIdx.x - 1];
}

// (u) out and x declared __restrict__: a caller must not pass overlapping arrays (in place).
__global__ void scale_restricted(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w) {
  out[threadIdx.x] = 2.f * x[threadIdx.x] * w[threadIdx.x];
}

// (v) a memcpy of `bytes` bytes from the last element of x: past the end, inside the copy.
__global__ void copy_past_end(float* y, const float* x, int n, int bytes) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  memcpy(&v, x + n - 1, (size_t)bytes);
  y[threadIdx.x] = v.x;
}

// (v2) memcpy and memset of sizes known when compiling that g++ expands into plain moves (12 bytes
// is not one load and one store; no memset is), each one element past the end of a 6-float array
// (24 bytes: the padding after it, not a guard page). y, x: [6] float.
__global__ void constant_copies_past_end(float* y, const float* x, int which) {
  float three[3] = {0.f, 0.f, 0.f};
  if (which == 0) memcpy(three, x + 4, sizeof three);
  if (which == 1) memcpy(y + 4, three, sizeof three);
  if (which == 2) memset(y, 0, 28);
  y[0] = three[0];
}

// (w) the largest of x[0..n-1], but the loop runs one element too far. A NaN there vanishes in
// fmaxf, so under the default poison the answer is right by luck; another poison shows it.
__global__ void max_one_too_far(float* y, const float* x, int n) {
  float top = x[0];
  for (int i = 1; i <= n; ++i) top = fmaxf(top, x[i]);
  y[threadIdx.x] = top;
}

// (x) sums x[0..n) four floats at a time, rounding the number of 16-byte loads up: the last load
// runs past the end whenever n is not a multiple of 4, though it starts inside the array.
__global__ void vector_tail_past_end(float* y, const float* x, int n) {
  float sum = 0.f;
  for (int v = 0; v < (n + 3) / 4; ++v) {
    const uint4 packed = reinterpret_cast<const uint4*>(x)[v];
    float four[4];
    memcpy(four, &packed, 16);
    sum += four[0] + four[1] + four[2] + four[3];
  }
  y[threadIdx.x] = sum;
}

// (y) the same eight floats at a time through a packed struct, which g++ instruments as a 32-byte
// range: the last one starts 24 or 28 bytes before the end.
struct __attribute__((packed)) PackedEight { float v[8]; };
__global__ void packed_tail_past_end(float* y, const float* x, int n) {
  float sum = 0.f;
  for (int v = 0; v < (n + 7) / 8; ++v) {
    const PackedEight eight = reinterpret_cast<const PackedEight*>(x)[v];
    for (int e = 0; e < 8; ++e) sum += eight.v[e];
  }
  y[threadIdx.x] = sum;
}

// An index past a static __shared__ array's end by more than its guard bytes, into the array
// declared after it: only the array's bound can tell it from a write to the neighbour.
__global__ void static_smem_into_neighbour(float* y) {
  __shared__ float sums[8];
  __shared__ float counts[8];
  sums[threadIdx.x % 8] = 0.f;
  counts[threadIdx.x % 8] = 0.f;
  __syncthreads();
  if (threadIdx.x == 5) sums[threadIdx.x + 11] = 1.f;
  __syncthreads();
  y[threadIdx.x] = sums[threadIdx.x % 8] + counts[threadIdx.x % 8];
}

// A local array indexed past its end (registers or local memory on the GPU: garbage, no fault).
__global__ void local_array_past_end(float* y, int n) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i <= n; ++i) acc[i] += y[i];
  y[threadIdx.x] = acc[threadIdx.x % 4];
}

// The inner index of a two-dimensional array out of its row, the element still inside the array.
__global__ void row_index_past_row(float* y) {
  __shared__ float tile[4][8];
  tile[threadIdx.x / 8 % 4][threadIdx.x % 8] = (float)threadIdx.x;
  __syncthreads();
  y[threadIdx.x] = tile[0][threadIdx.x % 16];
}

// A local array indexed one before its start by a signed index.
__global__ void local_array_before_start(float* y, int first) {
  float window[4] = {1.f, 2.f, 3.f, 4.f};
  y[threadIdx.x] = window[first + (int)threadIdx.x - 1];
}

// A local array indexed far outside it by a 64-bit index, signed or (as_unsigned nonzero) unsigned.
__global__ void local_array_at_a_64_bit_index(float* y, long long index, int as_unsigned) {
  float window[4] = {1.f, 2.f, 3.f, 4.f};
  y[threadIdx.x] = as_unsigned ? window[(unsigned long long)index] : window[index];
}

// Even threads reach __syncthreads_or and odd ones __syncthreads_and, on one line: one call
// site, two kinds of barrier, which never meet. out: [1] int.
__global__ void barrier_kinds_differ(int* out) {
  const int r = threadIdx.x % 2 ? __syncthreads_and(1) : __syncthreads_or(1);
  if (threadIdx.x == 0) out[0] = r;
}

// Lanes 0-15 return at once; lanes 16-31 shuffle with the full mask, which names the lanes
// that have exited. y: [32] float.
__global__ void shuffle_after_lanes_exited(float* y) {
  const int lane = threadIdx.x;
  if (lane < 16) return;
  y[lane] = __shfl_xor_sync(0xffffffffu, (float)lane, 1);
}

// Lane 0 returns at once; lanes 1-31 meet at a __syncwarp, after which lane 31 returns too and
// lanes 1-30 shuffle with the full mask, which names lanes 0 and 31, both exited (in index order:
// lane 31 completes the __syncwarp and runs on to its return before lanes 1-30 resume). y: [32] float.
__global__ void shuffle_after_first_and_last_lanes_exited(float* y) {
  const int lane = threadIdx.x;
  if (lane == 0) return;
  __syncwarp(0xfffffffeu);
  if (lane == 31) return;
  y[lane] = __shfl_xor_sync(0xffffffffu, (float)lane, 1);
}

// Lanes 0 and 31 return at once; lanes 1-30 shuffle under the mask 0xfffffffe, which names lane 31:
// in index order lanes 1-30 are waiting when lane 31 exits. y: [32] float.
__global__ void shuffle_waiting_for_the_last_lane(float* y) {
  const int lane = threadIdx.x;
  if (lane == 0 || lane == 31) return;
  y[lane] = __shfl_sync(0xfffffffeu, (float)lane, 2);
}

// Lane 0 returns at once; lanes 1-31 shuffle, lane 5 under the mask 0x0000fffe (unless
// same_masks) and the others under 0xfffffffe: two masks that name each other's lanes but differ,
// so neither group completes (lane 0, in neither mask, takes no part). y: [32] float.
__global__ void shuffle_masks_differ_past_lane_0(float* y, int same_masks) {
  const int lane = threadIdx.x;
  if (lane == 0) return;
  const unsigned mask = lane == 5 && !same_masks ? 0x0000fffeu : 0xfffffffeu;
  y[lane] = __shfl_sync(mask, (float)lane, 2);
}

// Lanes 0, 2 and 3 shuffle, lane 0 under the mask 0x5 (lanes 0 and 2) and lanes 2 and 3 under
// 0xd (lanes 0, 2 and 3): lanes 0 and 2 name each other but pass different masks. No mask names
// the lane after either of them, so only the right bits explain it. y: [32] float.
__global__ void shuffle_sparse_masks_differ(float* y) {
  const int lane = threadIdx.x;
  if (lane == 1 || lane > 3) return;
  const unsigned mask = lane == 0 ? 0x5u : 0xdu;
  y[lane] = __shfl_sync(mask, (float)lane, 0);
}

// Lanes 0-15 shuffle under the mask 0xffffffff at one call site and lanes 16-31 under 0xfffffffe
// at another: the masks name each other's lanes and differ, but the lanes are not at one site, so
// the sites (not the masks) are what keeps them apart. y: [32] int.
__global__ void shuffle_sites_and_masks_differ(int* y) {
  const int lane = threadIdx.x;
  int v = lane;
  if (lane < 16) v = __shfl_sync(0xffffffffu, v, 1);
  else v = __shfl_sync(0xfffffffeu, v, 1);
  y[lane] = v;
}

// A 32-byte packed struct (a range g++ instruments whole) read from `shift` floats before x: with
// shift 2 it starts in the guard before the array and ends inside it. y: [1] float.
__global__ void packed_head_before_start(float* y, const float* x, int shift) {
  const PackedEight eight = *reinterpret_cast<const PackedEight*>(x - shift);
  float sum = 0.f;
  for (int e = 0; e < 8; ++e) sum += eight.v[e];
  y[threadIdx.x] = sum;
}

// An atomic one element past the end of its array, landing on the guard page after it (the
// emulator's atomic helper faults, not the kernel's code): the report names the kernel's line.
// The second ends the kernel with the atomic. counter: [n] int.
__global__ void atomic_past_end(int* counter, int n) {
  const int old = atomicAdd(&counter[n], 1);
  counter[0] = old;
}
__global__ void atomic_past_end_last(int* counter, int n) {
  atomicMax(&counter[n], 1);
}

// Writes its slots of static and of dynamic shared memory only when `write` is set, then reads
// them back: with write = 0, every read is of bytes no thread of the launch wrote, whatever an
// earlier launch left there. y: [2 * blockDim.x] float, blockDim.x <= 64.
__global__ void smem_written_when_asked(float* y, int write) {
  __shared__ float fixed[64];
  extern __shared__ float dynamic[];
  if (write) {
    fixed[threadIdx.x] = 1.0f;
    dynamic[threadIdx.x] = 2.0f;
  }
  __syncthreads();
  y[threadIdx.x] = fixed[threadIdx.x];
  y[blockDim.x + threadIdx.x] = dynamic[threadIdx.x];
}

// Lanes 0-15 shuffle an int and lanes 16-31 a double, at one call site (one template, two
// types): different intrinsics under one mask, which never complete together. y: [32] double.
template <class T> __device__ T broadcast_lane_0(T v) { return __shfl_sync(0xffffffffu, v, 0); }
__global__ void shuffle_value_sizes_differ(double* y) {
  const int lane = threadIdx.x;
  y[lane] = lane < 16 ? (double)broadcast_lane_0<int>(lane) : broadcast_lane_0<double>(0.5 * lane);
}
