// add.cu: elementwise sum, out = a + b (the residual connection).
//
// Computes, for every element i of n (a, b and out have the same shape,
// contiguous), in fp32:
//     out[i] = a[i] + b[i]
// rounded once to T. out may be a or b (in place).
//
// Launch geometry: grid (blocks), block (threads), any sizes: the grid-stride
// loop of elementwise.cuh (16-byte vectors when sizes and alignment allow).
// The host uses up to 256 threads and enough blocks to cover n (at most 1024).
//
// Device-resident arguments: a, b (read), out (written), run_if [1] int32 (read first:
// 0 makes the launch return at once, reading nothing else and writing nothing; common.cuh).
// n is fixed per launch.
#include "elementwise.cuh"

namespace add_detail {
struct Sum {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
}  // namespace add_detail

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_add(
    T* out,               // [n]; may alias a or b
    const T* a,           // [n]
    const T* b,           // [n]
    long long n,
    const int* __restrict__ run_if) {   // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    cupykv::binary_elementwise(out, a, b, n, add_detail::Sum());
}
