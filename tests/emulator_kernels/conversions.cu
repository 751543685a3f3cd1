// conversions.cu: conversions to __half and __nv_bfloat16 from double and from int, for
// tests/test_conversions.py. Each must round once, to nearest even, as the GPU does; going
// through float first would round twice. The same file compiles with NVRTC (sm_80).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// x: [n] double; half_bits, bf16_bits: [n] (the 16-bit patterns of x rounded once).
// Three spellings of each conversion: the intrinsic, the constructor and the assignment.
__global__ void from_double(const double* x, unsigned short* half_bits, unsigned short* bf16_bits, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int form = i % 3;
  __half h;
  __nv_bfloat16 b;
  if (form == 0) {
    h = __double2half(x[i]);
    b = __double2bfloat16(x[i]);
  } else if (form == 1) {
    h = __half(x[i]);
    b = __nv_bfloat16(x[i]);
  } else {
    h = x[i];
    b = x[i];
  }
  half_bits[i] = __half_as_ushort(h);
  bf16_bits[i] = __bfloat16_as_ushort(b);
}

// x: [n] int; bf16_bits: [n]. An int has 31 bits: more than float's 24, so float first rounds twice.
__global__ void from_int(const int* x, unsigned short* bf16_bits, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  bf16_bits[i] = __bfloat16_as_ushort(__int2bfloat16_rn(x[i]));
}
