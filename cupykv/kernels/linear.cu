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
// Launch geometry: block (128) = 4 warps. With split_k = 2 (the host's choice for projections
// narrower than a GPU's worth of warps) the warps form 2 pairs, each pair owns 2 consecutive
// output features (a block 4: grid ceil(out_features / 4)) and its two warps split in_features
// into two contiguous halves, so a narrow projection, 1024 outputs at batch 1, still runs 1024
// warps. With split_k = 1 each warp owns 2 outputs and all of in_features (a block 8: grid
// ceil(out_features / 8)). The 32 lanes of a warp split its part: with in_features a multiple of
// 16 / sizeof(T) and 16-byte-aligned x and weight, lane l reads the 16-byte vectors l, l + 32,
// ... of the half of each of its two weight rows (a warp reads 512 contiguous bytes per row per
// step), kAhead steps at a time: it issues kAhead x 2 vector loads (4 KB per warp) before it uses
// the first, so a warp keeps that much in flight instead of one load. Otherwise it reads single
// elements k = l, l + 32, ... (scalar fallback for odd sizes). Each weight element is loaded from
// global memory once per row tile, so exactly once per launch for rows <= 16, and is used for
// every row of the tile from registers; a pair's second output past out_features loads nothing.
// x is small and is re-read through L1 by every warp. Per-lane partial sums of the warp's two
// outputs are combined by one paired butterfly (warp_sum_pair: 5 shuffles per row for both), the
// split_k parts through shared memory, first part first: every row is summed in the same order
// whatever the row tile (split_k depends on the weight's shape only), so a row's output does not
// depend on how many rows came with it.
//
// __launch_bounds__(128, 4) caps registers at 128 (python -m cupykv check: no spills).
//
// Device-resident arguments: x and weight (read), out (written), run_if [1] int32 (read first:
// 0 makes the launch return at once, reading nothing else and writing nothing; common.cuh).
// rows, in_features, out_features and split_k are fixed per launch.
#include "common.cuh"

namespace linear_tiling {
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kOutsPerWarp = 2;
constexpr int kMaxSplitK = 2;                                 // warps sharing a pair of outputs, at most
constexpr int kAhead = 4;                                     // loads per weight row issued before use
}  // namespace linear_tiling

template <typename T, int ROW_TILE>
__global__ void __launch_bounds__(linear_tiling::kThreads, 4) cupykv_linear(
    T* __restrict__ out,               // [rows, out_features]
    const T* __restrict__ x,           // [rows, in_features]
    const T* __restrict__ weight,      // [out_features, in_features]
    int rows, int in_features, int out_features, int split_k,
    const int* __restrict__ run_if) {  // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    using namespace linear_tiling;
    static_assert(kOutsPerWarp == 2, "the reduction below sums the warp's two outputs as a pair");
    constexpr int kVec = 16 / (int)sizeof(T);  // elements per 16-byte vector
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = warp / split_k, half = warp % split_k;   // split_k is 1 or kMaxSplitK
    const int first_out = blockIdx.x * (kWarps / split_k * kOutsPerWarp) + pair * kOutsPerWarp;
    const int outs = max(0, min(kOutsPerWarp, out_features - first_out));   // uniform in the warp
    __shared__ float halves[kWarps][ROW_TILE][kOutsPerWarp];                 // each warp's sums

    // Rows of weight this warp reads (a row past out_features is never loaded).
    const T* w_row[kOutsPerWarp];
    for (int o = 0; o < kOutsPerWarp; ++o)
        w_row[o] = weight + (long long)min(first_out + o, out_features - 1) * in_features;
    const bool vector_loads = in_features % kVec == 0 &&
                              (reinterpret_cast<unsigned long long>(x) % 16) == 0 &&
                              (reinterpret_cast<unsigned long long>(weight) % 16) == 0;
    // This warp's part of in_features, in vectors (or elements on the scalar path).
    const int units = vector_loads ? in_features / kVec : in_features;
    const int per_half = (units + split_k - 1) / split_k;
    const int begin = min(units, half * per_half), end = min(units, begin + per_half);

    for (int row0 = 0; row0 < rows; row0 += ROW_TILE) {
        const int tile_rows = min(ROW_TILE, rows - row0);
        const T* x_tile = x + (long long)row0 * in_features;
        float acc[ROW_TILE][kOutsPerWarp];
        for (int r = 0; r < ROW_TILE; ++r)
            for (int o = 0; o < kOutsPerWarp; ++o) acc[r][o] = 0.0f;

        if (outs > 0 && vector_loads) {
            for (int v0 = begin + lane; v0 < end; v0 += 32 * kAhead) {
                uint4 packed_w[kAhead][kOutsPerWarp];   // every load of the step issued first
#pragma unroll
                for (int a = 0; a < kAhead; ++a)
#pragma unroll
                    for (int o = 0; o < kOutsPerWarp; ++o)
                        packed_w[a][o] = (v0 + 32 * a < end && o < outs)
                                             ? *reinterpret_cast<const uint4*>(w_row[o] + (v0 + 32 * a) * kVec)
                                             : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int a = 0; a < kAhead; ++a) {
                    const int v = v0 + 32 * a;
                    if (v >= end) continue;   // not break: a fully unrolled loop keeps packed_w in registers
                    float w[kOutsPerWarp][kVec];
                    for (int o = 0; o < kOutsPerWarp; ++o) {
                        T raw[kVec];
                        memcpy(raw, &packed_w[a][o], 16);
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
            }
        } else if (outs > 0) {
            for (int k0 = begin + lane; k0 < end; k0 += 32 * kAhead) {
                float w[kAhead][kOutsPerWarp];
#pragma unroll
                for (int a = 0; a < kAhead; ++a)
#pragma unroll
                    for (int o = 0; o < kOutsPerWarp; ++o)
                        w[a][o] = (k0 + 32 * a < end && o < outs) ? cupykv::to_float(w_row[o][k0 + 32 * a]) : 0.0f;
#pragma unroll
                for (int a = 0; a < kAhead; ++a) {
                    const int k = k0 + 32 * a;
                    if (k >= end) continue;
                    for (int r = 0; r < ROW_TILE; ++r) {
                        if (r < tile_rows) {
                            const float xk = cupykv::to_float(x_tile[(long long)r * in_features + k]);
                            for (int o = 0; o < kOutsPerWarp; ++o) acc[r][o] = fmaf(xk, w[a][o], acc[r][o]);
                        }
                    }
                }
            }
        }

        for (int r = 0; r < ROW_TILE; ++r) {
            if (r < tile_rows) {  // uniform across the block
                const float sum = cupykv::warp_sum_pair(acc[r][0], acc[r][1]);   // output lane / 16 in lanes 0, 16
                if (lane % 16 == 0) halves[warp][r][lane / 16] = sum;
            }
        }
        __syncthreads();
        if (half == 0 && lane % 16 == 0 && lane / 16 < outs) {
            const int o = lane / 16;
            for (int r = 0; r < tile_rows; ++r) {
                float sum = halves[warp][r][o];
                for (int h = 1; h < split_k; ++h) sum += halves[warp + h][r][o];
                out[(long long)(row0 + r) * out_features + first_out + o] = cupykv::from_float<T>(sum);
            }
        }
        __syncthreads();   // halves is refilled by the next row tile
    }
}
