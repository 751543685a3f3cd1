// fp8_widen.cu: kv_codec.cuh's widen_fp8_word (one word of four E4M3 codes per thread) and load_kv, for
// tests/test_fp8_widen.py. The emulator and a GPU below sm_89 widen by bit moves
// (widen_fp8_pair_by_bits); sm_89 and later by cvt.rn.f16x2.e4m3x2, unless the test defines
// CUPYKV_FP8_WIDEN_BY_BITS to run the bit moves on that GPU too.
#include "kv_codec.cuh"

__global__ void fp8_widen_words(const unsigned* words, unsigned* low_pairs, unsigned* high_pairs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) cupykv::widen_fp8_word<__half>(words[i], low_pairs[i], high_pairs[i]);
}

// values[c]: code c (0..255) as load_kv reads one code of the CUDA-core attention, scale not applied.
__global__ void fp8_load_codes(float* values) {
  const int code = blockIdx.x * blockDim.x + threadIdx.x;
  __nv_fp8_e4m3 stored;
  stored.__x = (unsigned char)code;
  if (code < 256) values[code] = cupykv::load_kv<__nv_fp8_e4m3>(stored);
}
