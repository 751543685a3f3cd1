// fp8_oracle.cpp: fp8.cu's conversions on the host, built with g++ against the CUDA toolkit's
// cuda_fp8.h (tests/test_fp8_conversions.py). Reads doubles (one hex bit pattern per line) on
// stdin; prints, per input, the five encodings under __NV_SATFINITE and the two of sources 0 and
// 1 under __NV_NOSAT, then every code's half bits and float bits.
#include <cstdio>
#include <cstring>
#define FP8_ORACLE
#define __global__
#include "fp8.cu"

int main() {
  unsigned long long bits;
  while (std::scanf("%llx", &bits) == 1) {
    double x;
    std::memcpy(&x, &bits, 8);
    for (int source = 0; source < 5; ++source) std::printf("%02x ", fp8_encode_one(x, source, 1));
    std::printf("%02x %02x\n", fp8_encode_one(x, 0, 0), fp8_encode_one(x, 1, 0));
  }
  for (int code = 0; code < 256; ++code) {
    unsigned short half_bits;
    float as_float;
    fp8_decode_one((unsigned char)code, &half_bits, &as_float);
    unsigned int float_bits;
    std::memcpy(&float_bits, &as_float, 4);
    std::printf("decode %04x %08x\n", half_bits, float_bits);
  }
}
