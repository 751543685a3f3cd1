// linear.cu: y = x @ W.T for a few rows of x, the decode-time projection (GEMV / skinny GEMM).
//
// Computes, for every row r and output feature o:
//     out[r, o] = sum_k x[r, k] * weight[o, k]
// with fp32 accumulation, rounded once to the storage type T. weight is the
// HF / PyTorch layout [out_features, in_features], row-major; x and out are
// row-major [rows, in_features] and [rows, out_features]. Any sizes >= 1.
//
// Versions: cupykv_linear<T, ROW_TILE> with ROW_TILE in {1, 2, 4, 8, 16}: the
// number of rows a warp accumulates at once (fp32 registers: ROW_TILE * 2 per
// thread). The host picks the smallest tile >= rows; above 16 rows the warp
// loops over row tiles.
//
// Launch geometry: block (128) = 4 warps; each warp owns 2 consecutive output
// features, a block 8: grid (ceil(out_features / 8)). The 32 lanes of a warp
// split in_features: with in_features a multiple of 16 / sizeof(T) and
// 16-byte-aligned x and weight, lane l reads the 16-byte vectors l, l + 32, ...
// of each of its two weight rows (a warp reads 512 contiguous bytes per row per
// step) and the matching vectors of every row of x in the tile; otherwise it
// reads single elements k = l, l + 32, ... (scalar fallback for odd sizes).
// Each weight element is loaded from global memory once per row tile, so
// exactly once per launch for rows <= 16, and is used for every row of the
// tile from registers. x is small and is re-read through L1 by every warp.
// Per-lane partial sums of the warp's two outputs are combined by one paired
// butterfly (warp_sum_pair: 5 shuffles per row for both), and lanes 0 and 16
// write them. There is no __syncthreads: warps are independent,
// and a warp whose outputs are all past out_features does no work.
//
// __launch_bounds__(128, 4) caps registers at 128. Without the minimum, NVRTC 13.5 stopped
// <float, 16> on sm_90 at 96 registers and spilled 4 bytes; with it, every instance fits in
// 108 or fewer under NVRTC 13.0 and 13.5 (python -m cupykv check).
//
// Device-resident arguments: x and weight (read), out (written). rows,
// in_features and out_features are fixed per launch; nothing step-dependent.
#include "common.cuh"

namespace linear_tiling {
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kOutsPerWarp = 2;
constexpr int kOutsPerBlock = kWarps * kOutsPerWarp;
}  // namespace linear_tiling

template <typename T, int ROW_TILE>
__global__ void __launch_bounds__(linear_tiling::kThreads, 4) cupykv_linear(
    T* __restrict__ out,               // [rows, out_features]
    const T* __restrict__ x,           // [rows, in_features]
    const T* __restrict__ weight,      // [out_features, in_features]
    int rows, int in_features, int out_features) {
    using namespace linear_tiling;
    constexpr int kVec = 16 / (int)sizeof(T);  // elements per 16-byte vector
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int first_out = blockIdx.x * kOutsPerBlock + warp * kOutsPerWarp;
    if (first_out >= out_features) return;  // warp-uniform; no barriers in this kernel

    // Rows of weight this warp reads; a row past out_features repeats the last
    // valid one (its result is discarded) so that no load goes out of bounds.
    const T* w_row[kOutsPerWarp];
    for (int o = 0; o < kOutsPerWarp; ++o)
        w_row[o] = weight + (long long)min(first_out + o, out_features - 1) * in_features;
    const bool vector_loads = in_features % kVec == 0 &&
                              (reinterpret_cast<unsigned long long>(x) % 16) == 0 &&
                              (reinterpret_cast<unsigned long long>(weight) % 16) == 0;

    for (int row0 = 0; row0 < rows; row0 += ROW_TILE) {
        const int tile_rows = min(ROW_TILE, rows - row0);
        const T* x_tile = x + (long long)row0 * in_features;
        float acc[ROW_TILE][kOutsPerWarp];
        for (int r = 0; r < ROW_TILE; ++r)
            for (int o = 0; o < kOutsPerWarp; ++o) acc[r][o] = 0.0f;

        if (vector_loads) {
            const int n_vec = in_features / kVec;
            for (int v = lane; v < n_vec; v += 32) {
                float w[kOutsPerWarp][kVec];
                for (int o = 0; o < kOutsPerWarp; ++o) {
                    const uint4 packed = *reinterpret_cast<const uint4*>(w_row[o] + v * kVec);
                    T raw[kVec];
                    memcpy(raw, &packed, 16);
                    for (int e = 0; e < kVec; ++e) w[o][e] = cupykv::to_float(raw[e]);
                }
                for (int r = 0; r < ROW_TILE; ++r) {
                    if (r < tile_rows) {
                        const uint4 packed =
                            *reinterpret_cast<const uint4*>(x_tile + (long long)r * in_features + v * kVec);
                        T raw[kVec];
                        memcpy(raw, &packed, 16);
                        for (int e = 0; e < kVec; ++e) {
                            const float xe = cupykv::to_float(raw[e]);
                            for (int o = 0; o < kOutsPerWarp; ++o) acc[r][o] = fmaf(xe, w[o][e], acc[r][o]);
                        }
                    }
                }
            }
        } else {
            for (int k = lane; k < in_features; k += 32) {
                float w[kOutsPerWarp];
                for (int o = 0; o < kOutsPerWarp; ++o) w[o] = cupykv::to_float(w_row[o][k]);
                for (int r = 0; r < ROW_TILE; ++r) {
                    if (r < tile_rows) {
                        const float xk = cupykv::to_float(x_tile[(long long)r * in_features + k]);
                        for (int o = 0; o < kOutsPerWarp; ++o) acc[r][o] = fmaf(xk, w[o], acc[r][o]);
                    }
                }
            }
        }

        static_assert(kOutsPerWarp == 2, "the reduction below sums the warp's two outputs as a pair");
        for (int r = 0; r < ROW_TILE; ++r) {
            if (r < tile_rows) {  // uniform across the warp
                const float sum = cupykv::warp_sum_pair(acc[r][0], acc[r][1]);   // output lane / 16 in lanes 0, 16
                const int o = lane / 16;
                if (lane % 16 == 0 && first_out + o < out_features)
                    out[(long long)(row0 + r) * out_features + first_out + o] = cupykv::from_float<T>(sum);
            }
        }
    }
}
