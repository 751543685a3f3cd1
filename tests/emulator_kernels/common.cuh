// common.cuh: helpers shared by the emulator self-test kernels (tests/test_emulator.py).
// Kept in a header to exercise include_dirs and `extern __shared__` inside a header.
#pragma once

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Dynamic shared memory as float, declared in a header.
__device__ __forceinline__ float* dyn_smem_floats() {
  extern __shared__ __align__(16) float dyn_smem_f[];
  return dyn_smem_f;
}
