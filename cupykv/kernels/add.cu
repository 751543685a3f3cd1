// add.cu: elementwise sum, out = a + b (the residual connection).
//
// Computes, for every element i of n (a, b and out have the same shape,
// contiguous), in fp32:
//     out[i] = a[i] + b[i]
// rounded once to T. out may be a or b (in place).
//
// Launch geometry: grid (blocks), block (threads), any sizes: a grid-stride
// loop over 16-byte vectors of 16 / sizeof(T) elements when n is a multiple of
// that and all three arrays are 16-byte aligned, over single elements
// otherwise. The host uses 256 threads and enough blocks to cover n (at most 1024).
//
// Device-resident arguments: a, b (read), out (written). n is fixed per launch.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_add(
    T* out,               // [n]; may alias a or b
    const T* a,           // [n]
    const T* b,           // [n]
    long long n) {
    constexpr int kVec = 16 / (int)sizeof(T);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vector_loads = n % kVec == 0 &&
                              ((reinterpret_cast<unsigned long long>(out) | reinterpret_cast<unsigned long long>(a) |
                                reinterpret_cast<unsigned long long>(b)) % 16) == 0;
    if (vector_loads) {
        for (long long v = first; v < n / kVec; v += stride) {
            const uint4 a_packed = reinterpret_cast<const uint4*>(a)[v];
            const uint4 b_packed = reinterpret_cast<const uint4*>(b)[v];
            T a_raw[kVec], b_raw[kVec], result[kVec];
            memcpy(a_raw, &a_packed, 16);
            memcpy(b_raw, &b_packed, 16);
            for (int e = 0; e < kVec; ++e)
                result[e] = cupykv::from_float<T>(cupykv::to_float(a_raw[e]) + cupykv::to_float(b_raw[e]));
            uint4 packed;
            memcpy(&packed, result, 16);
            reinterpret_cast<uint4*>(out)[v] = packed;
        }
    } else {
        for (long long i = first; i < n; i += stride)
            out[i] = cupykv::from_float<T>(cupykv::to_float(a[i]) + cupykv::to_float(b[i]));
    }
}
