// linear_mma.cu: y = x @ W.T for a few rows of 16-bit x on tensor cores (the decode projection).
//
// Computes, as linear.cu does, for every row r and output feature o:
//     out[r, o] = sum_k x[r, k] * weight[o, k]
// with fp32 accumulation, rounded once to T, for T = __half or __nv_bfloat16 when in_features is
// a multiple of 8 and x and weight are 16-byte aligned (the host's choice, cupykv.ops.linear,
// made from the arrays alone, never from the number of rows; fp32 and the other shapes run
// linear.cu). weight is [out_features, in_features] row-major, x [rows, in_features], out
// [rows, out_features].
//
// Versions: cupykv_linear_mma<T, ROW_TILE> with ROW_TILE 8 (1 to 8 rows) or 16 (more; above 16
// rows the block loops over 16-row tiles). Both run the same mma chain on the rows they hold.
//
// The tile: one mma.sync m16n8k16 multiplies 16 rows of x (A; rows past the tile are zero) by 8
// weight rows (B, i.e. 8 outputs) over 16 of in_features. The fragments come straight from
// 16-byte global loads, with no shared memory and no ldmatrix: lane l, with g = l / 4 and
// t = l % 4, loads the 8 elements at k0 + 8t .. k0 + 8t + 7 of weight row o0 + g and of x rows
// g (and g + 8 for ROW_TILE 16). The first mma takes elements 0-1 as fragment columns 2t, 2t + 1
// and elements 2-3 as columns 2t + 8, 2t + 9; the second, elements 4-5 and 6-7. A and B are
// permuted along k alike, so each product pairs x[r, k] with weight[o, k]. One warp step is 32 of
// in_features for 8 outputs: 512 bytes of weight in one request of 16 sectors (64 contiguous
// bytes of each of 8 rows), two mma instructions, and 1 or 2 loads of x (L1/L2-resident).
//
// Launch geometry: block (256) = 8 warps. Each warp owns 8 consecutive outputs; split_k (1, 2,
// 4 or 8: the host's choice from the weight's shape alone, cupykv.ops.linear_mma_split_k) warps
// share them, each taking a contiguous range of in_features steps (split so that narrow
// projections still run enough warps: 1024 outputs give 1024 warps at split 8). A block holds
// 8 / split_k such groups; grid ceil(out_features / (8 * 8 / split_k)). A warp issues the loads
// of kAhead steps (8 at ROW_TILE 8, 4 at 16) before its first mma: 4 KB (2 KB) of weight in
// flight per warp, 64 KB per SM at the design occupancy of 2 blocks. Weight rows past
// out_features and steps past in_features load nothing and multiply zeros.
//
// Summation order: each warp chains its mma instructions in k order; the split_k partial sums
// are added in shared memory, first part first. The order depends on the weight's shape only,
// and an mma computes each output row from that row of A alone, so a row's output is the same
// whether it comes alone or with 15 others (speculative verification equals greedy decoding).
//
// __launch_bounds__(256, 2) caps registers at 128 (python -m cupykv check: no spills).
//
// Device-resident arguments: x and weight (read), out (written), run_if [1] int32 (read first:
// 0 makes the launch return at once, reading nothing else and writing nothing; common.cuh).
// rows, in_features, out_features and split_k are fixed per launch.
#include "common.cuh"
#include "mma.cuh"

namespace linear_mma_tiling {
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kOutsPerWarp = 8;                 // an mma's n
constexpr int kMaxSplitK = 8;                   // warps sharing 8 outputs, at most
constexpr int kVec = 8;                         // 16-bit elements per 16-byte load
constexpr int kStepFeatures = 4 * kVec;         // in_features per warp step: 4 lanes of a group
}  // namespace linear_mma_tiling

template <typename T, int ROW_TILE>
__global__ void __launch_bounds__(linear_mma_tiling::kThreads, 2) cupykv_linear_mma(
    T* __restrict__ out,               // [rows, out_features]
    const T* __restrict__ x,           // [rows, in_features]
    const T* __restrict__ weight,      // [out_features, in_features]
    int rows, int in_features, int out_features, int split_k,
    const int* __restrict__ run_if) {  // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    using namespace linear_mma_tiling;
    static_assert(sizeof(T) == 2, "tensor-core linear multiplies __half or __nv_bfloat16");
    static_assert(ROW_TILE == 8 || ROW_TILE == 16, "an mma holds 16 rows: tiles of 8 (half empty) or 16");
    constexpr bool kHighRows = ROW_TILE == 16;   // fragment rows 8..15 carry x rows
    constexpr int kAhead = kHighRows ? 4 : 8;    // steps whose loads are issued before the first mma
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int group = lane / 4, t = lane % 4;
    const int slot = warp / split_k, part = warp % split_k;     // split_k divides kWarps
    const int first_out = (blockIdx.x * (kWarps / split_k) + slot) * kOutsPerWarp;
    const bool warp_live = first_out < out_features;            // uniform in the warp
    const bool has_out = first_out + group < out_features;      // this lane's weight row exists
    const T* w_row = weight + (long long)min(first_out + group, out_features - 1) * in_features;
    __shared__ float partial[kWarps][ROW_TILE][kOutsPerWarp];    // each warp's sums

    // This warp's steps of in_features: [step_begin, step_end), contiguous, split_k parts.
    const int vectors = in_features / kVec;
    const int steps = (in_features + kStepFeatures - 1) / kStepFeatures;
    const int per_part = (steps + split_k - 1) / split_k;
    const int step_begin = min(steps, part * per_part), step_end = min(steps, step_begin + per_part);

    for (int row0 = 0; row0 < rows; row0 += ROW_TILE) {
        const int tile_rows = min(ROW_TILE, rows - row0);
        const bool low_live = group < tile_rows, high_live = kHighRows && group + 8 < tile_rows;
        const T* x_low = x + (long long)(row0 + (low_live ? group : 0)) * in_features;
        const T* x_high = x + (long long)(row0 + (high_live ? group + 8 : 0)) * in_features;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // rows g, g (cols 2t, 2t+1); rows g + 8, g + 8

        for (int s0 = step_begin; warp_live && s0 < step_end; s0 += kAhead) {
            uint4 w[kAhead], a_low[kAhead], a_high[kAhead];   // a_high: constant zeros at ROW_TILE 8
#pragma unroll
            for (int a = 0; a < kAhead; ++a) {   // every load of kAhead steps, then the mmas
                const int v = (s0 + a) * 4 + t;
                const bool live = s0 + a < step_end && v < vectors;
                // three load sites, one per operand (a warp's request is its lanes at one site)
                const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                w[a] = live && has_out ? *reinterpret_cast<const uint4*>(w_row + (long long)v * kVec) : zero;
                a_low[a] = live && low_live ? *reinterpret_cast<const uint4*>(x_low + (long long)v * kVec) : zero;
                a_high[a] = live && high_live ? *reinterpret_cast<const uint4*>(x_high + (long long)v * kVec) : zero;
            }
#pragma unroll
            for (int a = 0; a < kAhead; ++a) {
                if (s0 + a >= step_end) continue;   // uniform in the warp, as .sync.aligned requires
                const unsigned first_a[4] = {a_low[a].x, a_high[a].x, a_low[a].y, a_high[a].y};   // elements 0-3
                const unsigned first_b[2] = {w[a].x, w[a].y};
                cupykv::mma_m16n8k16<T>(acc, first_a, first_b, acc);
                const unsigned second_a[4] = {a_low[a].z, a_high[a].z, a_low[a].w, a_high[a].w};  // elements 4-7
                const unsigned second_b[2] = {w[a].z, w[a].w};
                cupykv::mma_m16n8k16<T>(acc, second_a, second_b, acc);
            }
        }

        partial[warp][group][2 * t] = acc[0];
        partial[warp][group][2 * t + 1] = acc[1];
        if constexpr (kHighRows) {
            partial[warp][group + 8][2 * t] = acc[2];
            partial[warp][group + 8][2 * t + 1] = acc[3];
        }
        __syncthreads();
        if (part == 0 && warp_live) {
            for (int half = 0; half < (kHighRows ? 2 : 1); ++half) {
                const int r = group + 8 * half;
                if (r >= tile_rows) continue;
                for (int c = 0; c < 2; ++c) {
                    const int o = first_out + 2 * t + c;
                    if (o >= out_features) continue;
                    float sum = partial[warp][r][2 * t + c];
                    for (int h = 1; h < split_k; ++h) sum += partial[warp + h][r][2 * t + c];
                    out[(long long)(row0 + r) * out_features + o] = cupykv::from_float<T>(sum);
                }
            }
        }
        __syncthreads();   // partial is refilled by the next row tile
    }
}
