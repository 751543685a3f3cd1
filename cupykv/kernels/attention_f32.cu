// attention_f32.cu: masked multi-query attention over one layer of a float32 cache at head_dim 32, 64,
// 128 or 256 (or a multiple of 4 from 20 up, padded onto the next of those), on CUDA cores, with K/V
// tiles staged through shared memory by asynchronous copies.
//
// The same contract, arguments, launch grid and split-KV workspace as cupykv_attention
// (attention.cu). For sequence b, query i (position p = lengths[b] + i) and head h of kv head
// g = h / group,
//     s_j = scale * q[b,i,h] . k[b,j,g]    (q rotated at p when use_rope; softcap when > 0)
//     attended j: j <= p, j < max_seq, and j > p - window (when window > 0)
//     out[b,i,h] = sum_j softmax(s)_j * v[b,j,g], or zeros if no j is attended.
// The plan (cupykv/attention_plan.py) picks this kernel for float32 caches of those sizes
// (cupykv.kernels.attention_f32_head_dim); other float32 head sizes run attention.cu. A smaller head
// runs on the instance of the next size up: the cache's head_dim (head_dim_runtime) sets every stride
// and what is read and written, the instance's the tiling; its extra dims are zeros in q and in the
// stages (copies that read nothing), so they add arithmetic, never bytes. With num_splits > 1 the
// last block of a tile to finish merges the splits into `out` (attention_merge.cuh). fp32
// throughout; the k_scales, v_scales and layer arguments (fp8 caches) are not read.
//
// Design (docs/performance.md has the budget):
// - A block of 4 warps owns up to 16 query rows (query x head of one GQA group) and the keys of its
//   split (attention_keys.cuh), in steps of 32 keys (16 at head_dim 256, so that two stages fit two
//   blocks in an sm_80 SM). Warp w owns rows w, w + 4, w + 8, w + 12 of the
//   tile: it computes their scores, their online softmax and their P.V by itself, so the only
//   barriers in the key loop are the two a staged step needs. A warp's live rows (0 to 4) are a
//   compile-time count in the step's code (Count<ROWS>, one branch per step); a warp with none only
//   copies and meets the barriers.
// - The K and V rows of step n + 1 are copied with 16-byte cp.async (.cg) while step n is computed
//   (two stages). A warp's copy instruction covers 512 contiguous bytes of rows: half a row (256
//   dims), a whole row (128), two (64) or four (32): 16 sectors a request. Keys past the split are
//   zero-filled, never read. A stage row is HEAD_DIM + 4 floats, so the lanes of a quarter-warp
//   reading 16 bytes of eight different rows (scores) hit 32 different banks; a row read by
//   consecutive lanes (P.V) is conflict-free as well.
// - Scores: lane l takes key l of the step (at head_dim 256, lanes l and l + 16 take key l, each over
//   half the dims, and add their halves), four partial sums per row over the dims (the float4
//   components: k from its stage row, q broadcast from the q tile), added pairwise, times the logit
//   scale. Softmax: warp max and sum per row over the step's keys, base-2 exponentials
//   (exp_shifted); the row's accumulators are rescaled only when its max moved (a multiply by
//   exactly 1 skipped).
// - P.V: lane l holds dims 4l .. 4l + 3 (head_dim 128), and 4l + 128 .. at 256; at 64 dims 4(l % 16)
//   .. of the step's even keys (l < 16) or odd keys, at 32 dims 4(l % 8) .. of the keys equal to l / 8
//   mod 4, the partial sums added across the warp at the end. A key's weight comes from the lane
//   that scored it (__shfl_sync).
// - Masks only where a step can hold a key that some live row does not attend (the split's last
//   step, the diagonal of a verification tile, a window's first keys): a block-uniform test per step,
//   no integer division in the loop. In those steps a weight of 0 skips its key, so a NaN or an
//   infinity in a V row a row does not attend (a pending row past its query) cannot reach it.
// - A row's result depends only on its own query and the split's keys, so with split_keys it is
//   bit-identical for every q_len.
//
// Launch geometry: block (kThreads); grid (batch * n_kv * tiles, num_splits), tiles =
// ceil(q_len * group / 16), block x = (b * n_kv + kv_head) * tiles + tile, y = split. Dynamic shared
// memory: kShared<HEAD_DIM> bytes, the q tile [16][HEAD_DIM] and the stages [2][K, V][step keys][HEAD_DIM + 4]
// (the last row's padding, never read, not allocated); past 48 KiB at head_dim 128 and 256, so those
// launches need the kernel's opt-in, which the plan makes.
//
// Device-resident arguments: lengths [batch] int32, q, k/v cache (read), out, the partial_* workspace
// and split_counters (written), run_if [1] int32 (read first: 0 makes the launch return at once,
// reading nothing else and writing nothing; common.cuh). Every other argument is fixed per launch, so
// a captured graph replays correctly as lengths change.
#include "common.cuh"
#include "async_copy.cuh"
#include "attention_keys.cuh"
#include "attention_merge.cuh"
#include "shared_layout.cuh"

namespace attention_f32_tiling {
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 16;      // query rows per block; warp w owns rows w, w + kWarps, ...
constexpr int kRowsPerWarp = kTileRows / kWarps;
constexpr int kStepKeys = 32;      // keys per step up to head_dim 128: one per lane in the scores
constexpr int kWideHeadDim = 256;  // the head_dim whose steps are kWideStepKeys keys, two lanes a key in the
constexpr int kWideStepKeys = 16;  // scores: at 32 keys two stages would take 149 KB, one block per SM
constexpr int kStages = 2;         // one step computed while the next lands
constexpr int kRowPad = 4;         // floats after each stage row: conflict-free 16-byte reads of 8 rows
constexpr int kSplitAlign = 128;   // split boundaries (num_splits mode) fall on multiples of this
// Dynamic shared memory per instance: the q tile, then the stages' rows less the last row's padding
constexpr int kShared32 = (kTileRows * 32 + (kStages * 2 * kStepKeys - 1) * (32 + kRowPad) + 32) * 4;
constexpr int kShared64 = (kTileRows * 64 + (kStages * 2 * kStepKeys - 1) * (64 + kRowPad) + 64) * 4;
constexpr int kShared128 = (kTileRows * 128 + (kStages * 2 * kStepKeys - 1) * (128 + kRowPad) + 128) * 4;
constexpr int kShared256 = (kTileRows * 256 + (kStages * 2 * kWideStepKeys - 1) * (256 + kRowPad) + 256) * 4;
}  // namespace attention_f32_tiling

// Blocks per SM the design assumes (__launch_bounds__; `python -m cupykv check` holds each instance to
// it): what sm_80's shared memory (164 KB, less 1 KB reserved per block) and a register cap of 128 fit:
// 4 at head_dim 32 and 64 (20 and 39 KB a block), 2 at 128 (74 KB) and at 256 (81 KB: 16-key steps).
template <int HEAD_DIM> constexpr int attention_f32_min_blocks() { return HEAD_DIM <= 64 ? 4 : 2; }

template <int HEAD_DIM>
__global__ void __launch_bounds__(attention_f32_tiling::kThreads, attention_f32_min_blocks<HEAD_DIM>())
cupykv_attention_f32(
    float* __restrict__ out,              // [batch, q_len, n_heads, head_dim] (num_splits == 1)
    float* __restrict__ partial_out,      // [num_splits, batch * q_len * n_heads, head_dim]
    float* __restrict__ partial_max,      // [num_splits, batch * q_len * n_heads]
    float* __restrict__ partial_sum,      // [num_splits, batch * q_len * n_heads]
    unsigned* __restrict__ split_counters,  // [batch * n_kv * tiles], 0 before the first launch (and after each)
    const float* __restrict__ q,          // [batch, q_len, n_heads, head_dim], contiguous
    const float* __restrict__ k_cache,    // cache base, strides below; rows 16-byte aligned
    const float* __restrict__ v_cache,
    const int* __restrict__ lengths,      // [batch], device-resident
    const float* __restrict__ k_scales,   // not read (fp8 caches only)
    const float* __restrict__ v_scales,   // not read
    int layer,                            // not read
    long long layer_offset, long long stride_batch, long long stride_seq, long long stride_head,
    int q_len, int n_heads, int n_kv, int head_dim_runtime, int max_seq, int num_splits, int split_keys,
    float scale, float softcap, int window, int use_rope, double rope_theta,
    const int* __restrict__ run_if) {     // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    using namespace attention_f32_tiling;
    static_assert(HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == kWideHeadDim,
                  "attention_f32: head_dim 32, 64, 128 or 256");
    (void)k_scales, (void)v_scales, (void)layer;
    const int head_dim = head_dim_runtime;            // <= HEAD_DIM, a multiple of 4: the cache's rows
    constexpr int kRow = HEAD_DIM + kRowPad;          // floats per stage row
    constexpr int kKeys = HEAD_DIM == kWideHeadDim ? kWideStepKeys : kStepKeys;   // keys per step
    constexpr int kScoreLanes = 32 / kKeys;           // scores: lanes per key (1, or 2 at 256), each over
    constexpr int kScoreDims = HEAD_DIM / kScoreLanes;   // this many dims
    constexpr int kTile = kKeys * kRow;               // floats per K (or V) stage
    constexpr int kPieces = HEAD_DIM / 4;             // 16-byte copies per row
    constexpr int kDimsPerLane = HEAD_DIM > 128 ? HEAD_DIM / 32 : 4;   // P.V: dims a lane holds (4, 8 at 256)
    constexpr int kLanesPerRow = HEAD_DIM / kDimsPerLane;   // P.V: lanes holding one key's dims (8 to 32)
    constexpr int kKeysPerPass = 32 / kLanesPerRow;   // P.V: keys a warp takes at once (4, 2, 1, 1)
    constexpr int kCopiesPerThread = kKeys * kPieces / kThreads;
    static_assert(kThreads % kPieces == 0 && kKeys * kPieces % kThreads == 0, "whole rows per pass");
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

    const int group = n_heads / n_kv;
    const int tiles = (q_len * group - 1) / kTileRows + 1;
    const int head_of_batch = blockIdx.x / tiles;                    // b * n_kv + kv_head
    const int b = head_of_batch / n_kv, kv_head = head_of_batch % n_kv;
    const int split = blockIdx.y;
    const int first_row = (blockIdx.x - head_of_batch * tiles) * kTileRows;   // row = i * group + g
    const int tile_rows = min(kTileRows, q_len * group - first_row);

    extern __shared__ __align__(16) float smem[];
    cupykv::SharedLayout shared_memory(reinterpret_cast<unsigned char*>(smem));
    float* q_tile = shared_memory.take<float>(kTileRows * HEAD_DIM, "q_tile");   // [kTileRows][HEAD_DIM]
    // [kStages][K, V][kKeys][kRow], the last row without its padding (kShared<HEAD_DIM>)
    float* stages = shared_memory.take<float>((kStages * 2 * kKeys - 1) * kRow + HEAD_DIM, "stages");

    const int length = cupykv::live_length(lengths[b], max_seq);
    // 1. The tile's q rows, rotated at their position, unscaled; rows past the tile are zeros (never read).
    const cupykv::QueryTile tile = {b, q_len, n_heads, group, kv_head, first_row, tile_rows, length, max_seq, window};
    tile.load_q<float>(q_tile, q, kTileRows, head_dim, HEAD_DIM, use_rope, rope_theta);

    const cupykv::KeyRange keys = cupykv::attention_split_keys(length, first_row, tile_rows, group, max_seq, window,
                                                               split, num_splits, split_keys, kSplitAlign);
    const int steps = (keys.end - keys.begin + kKeys - 1) / kKeys;   // block-uniform
    const long long head_base = layer_offset + b * stride_batch + kv_head * stride_head;

    // Copies the K and V rows of step `step` into stage `stage`: thread t issues copies t, t + kThreads,
    // ... of the step's kKeys x kPieces, so its column is fixed and its keys kThreads / kPieces apart.
    // A column past a smaller head_dim is zero-filled, reading nothing (its source: the row's start).
    const int copy_key = tid / kPieces, copy_column = (tid % kPieces) * 4;
    const bool column_live = copy_column < head_dim;
    const int source_column = column_live ? copy_column : 0;
    auto load_step = [&](int step, int stage) {
        float* k_stage = stages + stage * 2 * kTile + copy_key * kRow + copy_column;
        const int first_key = keys.begin + step * kKeys + copy_key;
#pragma unroll
        for (int i = 0; i < kCopiesPerThread; ++i) {
            const int key = first_key + i * (kThreads / kPieces);
            const bool live = key < keys.end && column_live;
            const long long offset = head_base + (long long)(live ? key : keys.begin) * stride_seq + source_column;
            cupykv::cp_async_16(k_stage + i * (kThreads / kPieces) * kRow, k_cache + offset, live ? 16 : 0);
            cupykv::cp_async_16(k_stage + kTile + i * (kThreads / kPieces) * kRow, v_cache + offset, live ? 16 : 0);
        }
    };

    // This warp's rows (w + kWarps m, m < warp_rows) and their positions; division only here.
    const int warp_rows = min(kRowsPerWarp, max(0, (tile_rows - warp + kWarps - 1) / kWarps));
    int position[kRowsPerWarp];
    for (int m = 0; m < kRowsPerWarp; ++m) position[m] = length + (first_row + warp + kWarps * m) / group;
    // Every live row attends every key of a step in [first_open, last_open]: no mask needed there.
    const int last_query = (first_row + max(tile_rows, 1) - 1) / group;
    const int first_open = window > 0 ? length + last_query - window + 1 : 0;
    const int last_open = min(keys.end - 1, length + first_row / group);

    float acc[kRowsPerWarp][kDimsPerLane];   // this lane's dims of each row (head_dim 32, 64: of its keys)
    float row_max[kRowsPerWarp], row_sum[kRowsPerWarp];   // uniform across the warp
    for (int m = 0; m < kRowsPerWarp; ++m) {
        for (int c = 0; c < kDimsPerLane; ++c) acc[m][c] = 0.0f;
        row_max[m] = cupykv::neg_infinity();
        row_sum[m] = 0.0f;
    }

    // One step of this warp's ROWS rows over the stage at k_stage (V at k_stage + kTile). MASKED: the
    // step may hold keys some row does not attend.
    auto compute_step = [&](auto rows_count, auto masked_flag, const float* k_stage, int first_key) {
        constexpr int ROWS = decltype(rows_count)::value;
        constexpr bool MASKED = decltype(masked_flag)::value != 0;
        const float* v_stage = k_stage + kTile;
        // 2. Scores of key first_key + score_key for each row: four partial sums over this lane's dims.
        const int score_key = lane % kKeys, score_part = lane / kKeys;   // part: which kScoreDims dims
        float dot[ROWS][4];
#pragma unroll
        for (int m = 0; m < ROWS; ++m)
            for (int c = 0; c < 4; ++c) dot[m][c] = 0.0f;
        const float* k_row = k_stage + score_key * kRow + score_part * kScoreDims;
        const float* q_part = q_tile + score_part * kScoreDims;
#pragma unroll 4   // at 8, NVRTC 13.5 spilled 4 bytes at head_dim 64 on sm_90 (128 registers for 4 blocks/SM)
        for (int d = 0; d < kScoreDims; d += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(k_row + d);
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                const float4 q4 = *reinterpret_cast<const float4*>(q_part + (warp + kWarps * m) * HEAD_DIM + d);
                dot[m][0] = fmaf(q4.x, k4.x, dot[m][0]);
                dot[m][1] = fmaf(q4.y, k4.y, dot[m][1]);
                dot[m][2] = fmaf(q4.z, k4.z, dot[m][2]);
                dot[m][3] = fmaf(q4.w, k4.w, dot[m][3]);
            }
        }
        // 3. Scale, cap, mask (MASKED steps only), online softmax per row.
        float p[ROWS];
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            float s = (dot[m][0] + dot[m][1]) + (dot[m][2] + dot[m][3]);
            if constexpr (kScoreLanes == 2) s += __shfl_xor_sync(0xffffffffu, s, kKeys);   // the other half's dims
            s *= scale;
            if (CUPYKV_COMMON_PATH(softcap > 0.0f, false)) s = softcap * tanhf(s / softcap);
            if constexpr (MASKED) {
                const int j = first_key + score_key;
                const bool attended = j < keys.end && j <= position[m] && (window <= 0 || j > position[m] - window);
                if (!attended) s = cupykv::neg_infinity();
            }
            // over the step's kKeys keys: at 256 the two half-warps hold the same keys' weights
            const float new_max = fmaxf(row_max[m], cupykv::warp_max<kKeys>(s));
            const bool any = new_max != cupykv::neg_infinity();
            // a NaN logit stays NaN (its weight, the sum, the row) even as the only one so far
            p[m] = cupykv::exp_shifted(s, any ? new_max : 0.0f);
            const float step_sum = cupykv::warp_sum<kKeys>(p[m]);
            // warp-uniform; NaN compares unequal, so a NaN max rescales
            if (CUPYKV_COMMON_PATH(new_max != row_max[m], CUPYKV_STEP_RESCALES)) {
                const float rescale = any ? cupykv::exp_shifted(row_max[m], new_max) : 1.0f;
                for (int c = 0; c < kDimsPerLane; ++c) acc[m][c] *= rescale;
                row_sum[m] *= rescale;
                row_max[m] = new_max;
            }
            row_sum[m] += step_sum;
        }
        // 4. acc += P . V: key c's weight from lane c. In MASKED steps a weight of 0 skips the key. A lane's
        //    dims are kDimsPerLane / 4 pieces of four, kLanesPerRow * 4 dims apart.
        const int lane_key = lane / kLanesPerRow, lane_dim = (lane % kLanesPerRow) * 4;
#pragma unroll 4
        for (int c = 0; c < kKeys; c += kKeysPerPass) {
            const int key = c + lane_key;
            float4 v4[kDimsPerLane / 4];
#pragma unroll
            for (int piece = 0; piece < kDimsPerLane / 4; ++piece)
                v4[piece] = *reinterpret_cast<const float4*>(v_stage + key * kRow + piece * 4 * kLanesPerRow + lane_dim);
#pragma unroll
            for (int m = 0; m < ROWS; ++m) {
                const float w = __shfl_sync(0xffffffffu, p[m], key);
                if (!MASKED || w != 0.0f) {
#pragma unroll
                    for (int piece = 0; piece < kDimsPerLane / 4; ++piece) {
                        acc[m][4 * piece + 0] = fmaf(w, v4[piece].x, acc[m][4 * piece + 0]);
                        acc[m][4 * piece + 1] = fmaf(w, v4[piece].y, acc[m][4 * piece + 1]);
                        acc[m][4 * piece + 2] = fmaf(w, v4[piece].z, acc[m][4 * piece + 2]);
                        acc[m][4 * piece + 3] = fmaf(w, v4[piece].w, acc[m][4 * piece + 3]);
                    }
                }
            }
        }
    };
    auto compute_rows = [&](auto masked_flag, const float* k_stage, int first_key) {
        switch (CUPYKV_COMMON_PATH(warp_rows, CUPYKV_STEP_ROWS)) {   // the count fixes the rows
            case 1: compute_step(cupykv::Count<1>{}, masked_flag, k_stage, first_key); break;
            case 2: compute_step(cupykv::Count<2>{}, masked_flag, k_stage, first_key); break;
            case 3: compute_step(cupykv::Count<3>{}, masked_flag, k_stage, first_key); break;
            case 4: compute_step(cupykv::Count<4>{}, masked_flag, k_stage, first_key); break;
            default: break;   // no live row: this warp only copies
        }
    };

    if (steps > 0) load_step(0, 0);
    cupykv::cp_async_commit();
    __syncthreads();   // the q tile, written by every thread
    for (int n = 0; n < steps; ++n) {
        if (n + 1 < steps) load_step(n + 1, (n + 1) % kStages);   // its stage was left at the end of step n - 1
        cupykv::cp_async_commit();
        cupykv::cp_async_wait<1>();   // this thread's copies of step n have landed
        __syncthreads();              // ... and every thread's
        const float* k_stage = stages + (n % kStages) * 2 * kTile;
        const int first_key = keys.begin + n * kKeys;
        const bool open = CUPYKV_COMMON_PATH(first_key >= first_open && first_key + kKeys - 1 <= last_open, true);
        if (open) compute_rows(cupykv::Count<0>{}, k_stage, first_key);
        else compute_rows(cupykv::Count<1>{}, k_stage, first_key);
        __syncthreads();              // every warp is done with the stage before step n + 2 refills it
    }

    // 5. At head_dim 64 (32) the lanes kLanesPerRow apart summed different keys: add their sums.
    for (int offset = kLanesPerRow; offset < 32; offset *= 2)
        for (int m = 0; m < kRowsPerWarp; ++m)
            for (int c = 0; c < kDimsPerLane; ++c) acc[m][c] += __shfl_xor_sync(0xffffffffu, acc[m][c], offset);

    // 6. Write out (normalised) or the split's partial result: lanes below kLanesPerRow, each its dims.
    const long long rows_total = (long long)(gridDim.x / tiles) * q_len * group;   // batch * q_len * n_heads
#pragma unroll   // constant indices into acc: no local memory
    for (int m = 0; m < kRowsPerWarp; ++m) {
        if (m >= warp_rows) break;
        const int r = warp + kWarps * m;
        const long long out_row = tile.out_row(r);
#pragma unroll
        for (int piece = 0; piece < kDimsPerLane / 4; ++piece) {
            const int dim = piece * 4 * kLanesPerRow + lane * 4;
            // head_dim is a multiple of 4: a lane's four dims are all live or none
            if (lane < kLanesPerRow && dim < head_dim) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    if (num_splits == 1)
                        out[out_row * head_dim + dim + c] =
                            cupykv::normalised_output(acc[m][4 * piece + c], row_sum[m], tile.attends_a_key(r));
                    else
                        partial_out[(split * rows_total + out_row) * head_dim + dim + c] = acc[m][4 * piece + c];
                }
            }
        }
        if (num_splits > 1 && lane == 0) {
            partial_max[split * rows_total + out_row] = row_max[m];
            partial_sum[split * rows_total + out_row] = row_sum[m];
        }
    }
    // 7. The tile's last split to finish merges every split into out (attention_merge.cuh).
    __shared__ int is_last_split;
    if (num_splits > 1 && cupykv::attention_last_split(split_counters + blockIdx.x, num_splits, &is_last_split))
        cupykv::attention_merge_splits(out, partial_out, partial_max, partial_sum, tile, rows_total, num_splits,
                                       head_dim);
}
