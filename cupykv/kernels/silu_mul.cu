// silu_mul.cu: the SwiGLU gate, out = silu(gate) * up, elementwise.
//
// Computes, for every element i of n (gate, up and out have the same shape,
// contiguous), in fp32:
//     out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
// rounded once to T. out may be gate or up (in place).
//
// Launch geometry: grid (blocks), block (threads), any sizes: the grid-stride
// loop of elementwise.cuh (16-byte vectors when sizes and alignment allow).
// The host uses up to 256 threads and enough blocks to cover n (at most 1024).
//
// Device-resident arguments: gate, up (read), out (written), run_if [1] int32 (read first:
// 0 makes the launch return at once, reading nothing else and writing nothing; common.cuh).
// n is fixed per launch.
#include "elementwise.cuh"

namespace silu_mul_detail {
struct SiluTimes {
    __device__ __forceinline__ float operator()(float gate, float up) const {
        return gate / (1.0f + expf(-gate)) * up;
    }
};
}  // namespace silu_mul_detail

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_silu_mul(
    T* out,               // [n]; may alias gate or up
    const T* gate,        // [n]
    const T* up,          // [n]
    long long n,
    const int* __restrict__ run_if) {   // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    cupykv::binary_elementwise(out, gate, up, n, silu_mul_detail::SiluTimes());
}
