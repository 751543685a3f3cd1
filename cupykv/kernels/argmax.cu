// argmax.cu: greedy sampling, the index of each row's largest logit.
//
// Computes, for every row r of logits [rows, vocab]:
//     out_ids[r] = the lowest k with logits[r, k] == max_j logits[r, j]
// as int32, with NaN ranked above every number, as NumPy's and PyTorch's argmax rank it: a row
// holding a NaN gives its first NaN (a row of NaN gives 0), a row of -inf gives 0. out_ids is
// device memory, so the next replay of a captured decode step can read it
// (embedding's ids).
//
// Launch geometry: grid (rows), block (threads), threads a multiple of 32 up to
// 1024 (the host uses min(512, vocab rounded up to 32)). Each thread scans its
// elements in increasing index order (16-byte vectors when vocab is a multiple
// of 16 / sizeof(T) and logits is 16-byte aligned, single elements otherwise)
// keeping the first maximum; (value, index) pairs are then merged by a warp
// butterfly and across warps through shared memory (one __syncthreads),
// preferring NaN, then the larger value and, on ties, the lower index.
//
// Device-resident arguments: logits (read), out_ids [rows] int32 (written),
// run_if [1] int32 (read first: 0 makes the launch return at once, reading
// nothing else and writing nothing; common.cuh). vocab is fixed per launch.
#include "common.cuh"

namespace argmax_detail {
// Whether (value_b, index_b) beats (value_a, index_a): NaN above every number, then the larger
// value, then (equal values, or two NaN) the lower index.
__device__ __forceinline__ bool better(float value_b, int index_b, float value_a, int index_a) {
    const bool nan_b = value_b != value_b, nan_a = value_a != value_a;
    if (nan_b != nan_a) return nan_b;
    return value_b > value_a || ((value_b == value_a || nan_b) && index_b < index_a);
}
}  // namespace argmax_detail

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_argmax(
    int* __restrict__ out_ids,         // [rows], device-resident
    const T* __restrict__ logits,      // [rows, vocab]
    int vocab,
    const int* __restrict__ run_if) {  // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    constexpr int kVec = 16 / (int)sizeof(T);
    constexpr int kNoIndex = 0x7fffffff;
    __shared__ float warp_values[32];
    __shared__ int warp_indices[32];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_warps = blockDim.x / 32;
    const T* row = logits + (long long)blockIdx.x * vocab;
    float best = cupykv::neg_infinity();
    int best_index = kNoIndex;
    const bool vector_loads = vocab % kVec == 0 && (reinterpret_cast<unsigned long long>(logits) % 16) == 0;
    if (vector_loads) {
        for (int v = tid; v < vocab / kVec; v += blockDim.x) {
            const uint4 packed = reinterpret_cast<const uint4*>(row)[v];
            T raw[kVec];
            memcpy(raw, &packed, 16);
            for (int e = 0; e < kVec; ++e) {
                const float value = cupykv::to_float(raw[e]);
                if (argmax_detail::better(value, v * kVec + e, best, best_index)) {
                    best = value;
                    best_index = v * kVec + e;
                }
            }
        }
    } else {
        for (int k = tid; k < vocab; k += blockDim.x) {
            const float value = cupykv::to_float(row[k]);
            if (argmax_detail::better(value, k, best, best_index)) {
                best = value;
                best_index = k;
            }
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        if (argmax_detail::better(other, other_index, best, best_index)) {
            best = other;
            best_index = other_index;
        }
    }
    if (lane == 0) {
        warp_values[warp] = best;
        warp_indices[warp] = best_index;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < n_warps; ++w)
            if (argmax_detail::better(warp_values[w], warp_indices[w], best, best_index)) {
                best = warp_values[w];
                best_index = warp_indices[w];
            }
        out_ids[blockIdx.x] = best_index == kNoIndex ? 0 : best_index;
    }
}
