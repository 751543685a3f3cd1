// silu_mul.cu: the SwiGLU gate, out = silu(gate) * up, elementwise.
//
// Computes, for every element i of n (gate, up and out have the same shape,
// contiguous), in fp32:
//     out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
// rounded once to T. out may be gate or up (in place).
//
// Launch geometry: grid (blocks), block (threads), any sizes: a grid-stride
// loop over 16-byte vectors of 16 / sizeof(T) elements when n is a multiple of
// that and all three arrays are 16-byte aligned, over single elements
// otherwise. The host uses 256 threads and enough blocks to cover n (at most 1024).
//
// Device-resident arguments: gate, up (read), out (written). n is fixed per launch.
#include "common.cuh"

namespace silu_mul_detail {
__device__ __forceinline__ float silu_mul(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}
}  // namespace silu_mul_detail

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_silu_mul(
    T* out,               // [n]; may alias gate or up
    const T* gate,        // [n]
    const T* up,          // [n]
    long long n) {
    constexpr int kVec = 16 / (int)sizeof(T);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vector_loads = n % kVec == 0 &&
                              ((reinterpret_cast<unsigned long long>(out) | reinterpret_cast<unsigned long long>(gate) |
                                reinterpret_cast<unsigned long long>(up)) % 16) == 0;
    if (vector_loads) {
        for (long long v = first; v < n / kVec; v += stride) {
            const uint4 g_packed = reinterpret_cast<const uint4*>(gate)[v];
            const uint4 u_packed = reinterpret_cast<const uint4*>(up)[v];
            T g_raw[kVec], u_raw[kVec], result[kVec];
            memcpy(g_raw, &g_packed, 16);
            memcpy(u_raw, &u_packed, 16);
            for (int e = 0; e < kVec; ++e)
                result[e] = cupykv::from_float<T>(
                    silu_mul_detail::silu_mul(cupykv::to_float(g_raw[e]), cupykv::to_float(u_raw[e])));
            uint4 packed;
            memcpy(&packed, result, 16);
            reinterpret_cast<uint4*>(out)[v] = packed;
        }
    } else {
        for (long long i = first; i < n; i += stride)
            out[i] = cupykv::from_float<T>(
                silu_mul_detail::silu_mul(cupykv::to_float(gate[i]), cupykv::to_float(up[i])));
    }
}
