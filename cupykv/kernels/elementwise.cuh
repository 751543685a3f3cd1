// elementwise.cuh: the grid-stride loop shared by the two-input elementwise ops
// (add.cu, silu_mul.cu).
//
// out[i] = op(a[i], b[i]) for i < n, computed in fp32 and rounded once to T.
// It moves 16-byte vectors of 16 / sizeof(T) elements when n is a multiple of
// that and all three arrays are 16-byte aligned, single elements otherwise.
// out may alias a or b (each element is read before it is written, by the
// same thread), so none of the pointers is __restrict__.
#pragma once
#include "common.cuh"

namespace cupykv {

template <typename T, typename Op>
__device__ __forceinline__ void binary_elementwise(T* out, const T* a, const T* b, long long n, Op op) {
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
            for (int e = 0; e < kVec; ++e) result[e] = from_float<T>(op(to_float(a_raw[e]), to_float(b_raw[e])));
            uint4 packed;
            memcpy(&packed, result, 16);
            reinterpret_cast<uint4*>(out)[v] = packed;
        }
    } else {
        for (long long i = first; i < n; i += stride) out[i] = from_float<T>(op(to_float(a[i]), to_float(b[i])));
    }
}

}  // namespace cupykv
