// rmsnorm.cu: root-mean-square layer norm (LLaMA), one row per block.
//
// Computes, for every row r, in fp32:
//     inv_rms  = rsqrt(sum_k x[r, k]^2 / hidden + eps)
//     out[r, k] = x[r, k] * inv_rms * weight[k]
// rounded once to T. (Hugging Face's LlamaRMSNorm rounds x * inv_rms to the
// storage type before multiplying by weight; this kernel keeps fp32 until the
// end, the deviation is at most one rounding of T.) out may be x (in place).
//
// Launch geometry: grid (rows), block (threads), threads a multiple of 32 up to
// 1024 (the host uses min(256, hidden rounded up to 32)). Two passes over the
// row: the sum of squares (per-thread fp32 partial sums, warp_sum, then the
// warp totals through shared memory, one __syncthreads), then the scaled
// write. Both use 16-byte vectors when hidden is a multiple of 16 / sizeof(T)
// and x, weight and out are 16-byte aligned; single elements otherwise.
//
// Device-resident arguments: x, weight (read), out (written), run_if [1] int32
// (read first: 0 makes the launch return at once, reading nothing else and
// writing nothing; common.cuh). hidden and eps are fixed per launch.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_rmsnorm(
    T* out,                            // [rows, hidden]; may alias x
    const T* x,                        // [rows, hidden]
    const T* __restrict__ weight,      // [hidden]
    int hidden, float eps,
    const int* __restrict__ run_if) {  // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    constexpr int kVec = 16 / (int)sizeof(T);
    __shared__ float warp_totals[32];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_warps = blockDim.x / 32;
    const T* x_row = x + (long long)blockIdx.x * hidden;
    T* out_row = out + (long long)blockIdx.x * hidden;
    const bool vector_loads = hidden % kVec == 0 &&
                              ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(out) |
                                reinterpret_cast<unsigned long long>(weight)) % 16) == 0;

    float sum_sq = 0.0f;
    if (vector_loads) {
        for (int v = tid; v < hidden / kVec; v += blockDim.x) {
            const uint4 packed = reinterpret_cast<const uint4*>(x_row)[v];
            T raw[kVec];
            memcpy(raw, &packed, 16);
            for (int e = 0; e < kVec; ++e) {
                const float value = cupykv::to_float(raw[e]);
                sum_sq = fmaf(value, value, sum_sq);
            }
        }
    } else {
        for (int k = tid; k < hidden; k += blockDim.x) {
            const float value = cupykv::to_float(x_row[k]);
            sum_sq = fmaf(value, value, sum_sq);
        }
    }
    sum_sq = cupykv::warp_sum(sum_sq);
    if (lane == 0) warp_totals[warp] = sum_sq;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < n_warps; ++w) total += warp_totals[w];
    const float inv_rms = rsqrtf(total / (float)hidden + eps);

    if (vector_loads) {
        for (int v = tid; v < hidden / kVec; v += blockDim.x) {
            const uint4 x_packed = reinterpret_cast<const uint4*>(x_row)[v];
            const uint4 w_packed = reinterpret_cast<const uint4*>(weight)[v];
            T x_raw[kVec], w_raw[kVec], result[kVec];
            memcpy(x_raw, &x_packed, 16);
            memcpy(w_raw, &w_packed, 16);
            for (int e = 0; e < kVec; ++e)
                result[e] = cupykv::from_float<T>(cupykv::to_float(x_raw[e]) * inv_rms * cupykv::to_float(w_raw[e]));
            uint4 packed;
            memcpy(&packed, result, 16);
            reinterpret_cast<uint4*>(out_row)[v] = packed;
        }
    } else {
        for (int k = tid; k < hidden; k += blockDim.x)
            out_row[k] = cupykv::from_float<T>(cupykv::to_float(x_row[k]) * inv_rms * cupykv::to_float(weight[k]));
    }
}
