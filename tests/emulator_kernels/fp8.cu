// fp8.cu: the E4M3 conversions of cuda_fp8.h, element by element, for tests/test_fp8_conversions.py.
// The same source is built by the emulator (its cuda_fp8.h shim) and, as fp8_oracle.cpp includes
// it, by g++ against the CUDA toolkit's own header: the two must agree bit for bit.
#include <cuda_fp8.h>

// out[i]: the E4M3 code of x[i] converted from `source`: 0 double, 1 float (x[i] rounded to float
// first), 2 __half and 3 __nv_bfloat16 (likewise), 4 the __nv_fp8_e4m3 constructor from float.
// saturate: __NV_SATFINITE when 1, __NV_NOSAT when 0 (sources 0 and 1; the others saturate).
__host__ __device__ inline unsigned char fp8_encode_one(double x, int source, int saturate) {
  const __nv_saturation_t mode = saturate ? __NV_SATFINITE : __NV_NOSAT;
  switch (source) {
    case 0: return __nv_cvt_double_to_fp8(x, mode, __NV_E4M3);
    case 1: return __nv_cvt_float_to_fp8((float)x, mode, __NV_E4M3);
    case 2: return __nv_fp8_e4m3(__half((float)x)).__x;
    case 3: return __nv_fp8_e4m3(__nv_bfloat16((float)x)).__x;
    default: return __nv_fp8_e4m3((float)x).__x;
  }
}

// half_bits[c], as_float[c]: every code c in 0..255 converted back.
__host__ __device__ inline void fp8_decode_one(unsigned char code, unsigned short* half_bits, float* as_float) {
  half_bits[0] = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3).x;
  __nv_fp8_e4m3 value;
  value.__x = code;
  *as_float = static_cast<float>(value);
}

#ifndef FP8_ORACLE
__global__ void fp8_encode(const double* x, unsigned char* out, int n, int source, int saturate) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fp8_encode_one(x[i], source, saturate);
}

__global__ void fp8_decode(unsigned short* half_bits, float* as_float) {
  const int code = blockIdx.x * blockDim.x + threadIdx.x;
  if (code < 256) fp8_decode_one((unsigned char)code, half_bits + code, as_float + code);
}
#endif
