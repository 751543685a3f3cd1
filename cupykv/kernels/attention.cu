// attention.cu: masked multi-query attention over one layer of the cache on CUDA cores, the generic
// path for the head sizes the other two kernels do not take, with split-KV (flash-decoding), merged
// inside the launch.
//
// Computes, for sequence b, query i (position p = lengths[b] + i) and head h
// (kv head g = h / (n_heads / n_kv)):
//     s_j = scale * q[b,i,h] . k[b,j,g]        (q rotated at p when use_rope)
//     s_j = softcap * tanh(s_j / softcap)      (when softcap > 0)
//     attended j: j <= p, j < max_seq, and j > p - window (when window > 0)
//     out[b,i,h] = sum_j softmax(s)_j * v[b,j,g], or zeros if no j is attended.
// This is reference.attention, exactly; accumulation is fp32.
//
// Versions: cupykv_attention<T, TI, 0>: the cache stores T; q and out are of the io type TI; any
// head_dim in 1..256, scalar loads (HEAD_DIM = 0 is the only instance). Caches of float, __half and
// __nv_bfloat16 have T == TI. float32 caches whose head_dim is a multiple of 4 from 20 to 256 run
// attention_f32.cu (staged K/V), and 16-bit and fp8 caches whose rows are whole 16-byte copies attention_mma.cu (tensor
// cores); this kernel takes the rest. An fp8 cache (T = __nv_fp8_e4m3; TI = __nv_bfloat16,
// __half or float) holds codes that stand for code * scale, one fp32
// scale per layer and kv head in k_scales / v_scales [n_layers, n_kv] (device-resident,
// read at run time; kv_codec.cuh). Its K and V are read as raw codes and the scales applied
// once instead: the dot product is multiplied by scale * k_scale (s_j = (scale * k_scale) *
// (q . code_j)), and the output by v_scale before it is normalised or written as a split's
// partial, so the merge is that of any cache. Caches with T == TI never read the scales.
// A logit is the float32 dot product q . k times one float32 factor (scale, or scale * k_scale),
// as on the tensor cores: q is not pre-multiplied, which would overflow for a large scale (and a
// q of a few units) where the logit itself fits float32.
//
// Launch geometry of cupykv_attention: block (128); grid (batch * n_kv * tiles,
// num_splits) where group = n_heads / n_kv and tiles = ceil(q_len * group / 16):
// block x = (b * n_kv + kv_head) * tiles + tile, block y = split. Sequences, heads
// and tiles share grid x (up to 2**31 - 1 blocks), so no realistic batch or head
// count reaches CUDA's 65535 limit on y; num_splits <= 65535 is the host's bound.
// A block owns up to 16 query rows (query x head of one GQA group) and reads each live
// K/V row of its split once. Keys are processed in chunks of 128: one key per
// thread for the scores, a warp per row for the online-softmax update, one
// head dimension per thread for P.V. Dynamic shared memory:
//     (16 * head_dim + 16 * 128 + 3 * 16) * 4 bytes.
// The key range of a block is [kv_begin, kv_end) from the device lengths, cut
// into num_splits equal, chunk-aligned pieces (or, with split_keys > 0, into
// the fixed positions [s * split_keys, (s + 1) * split_keys), which make a row's
// result independent of the query shape), so work follows the live length
// and positions past it are never read. With num_splits == 1 the block writes
// `out`; otherwise it writes unnormalised fp32 partial results, and the last
// block of the tile to finish merges them into `out` (attention_merge.cuh).
//
// Device-resident arguments: lengths [batch] int32, k_scales / v_scales (fp8), q, k/v cache
// (read), out, the partial_* workspace and split_counters (written), run_if [1] int32 (read
// first: 0 makes the launch return at once, reading nothing else and writing nothing, so the
// split counters stay at 0; common.cuh). Every other argument is fixed per launch, so a
// captured graph replays correctly as lengths change.
#include "common.cuh"
#include "attention_keys.cuh"
#include "attention_merge.cuh"
#include "kv_codec.cuh"
#include "shared_layout.cuh"

namespace attention_tiling {
constexpr int kThreads = 128;
constexpr int kChunk = 128;       // keys per chunk: one per thread in the score phase
constexpr int kTileRows = 16;     // query rows (query x head of one group) per block
constexpr int kWarps = kThreads / 32;
}  // namespace attention_tiling

// Minimum resident blocks per SM (ptxas's register budget): 4 (<= 128 registers). NVRTC 13.5
// allocates every instance at 92 to 96 registers on sm_80 and sm_90. (Float was 3, <= 168, while
// <float, float, 64> was an instance here: 162 registers on sm_80.) `python -m cupykv check` prints
// every instance's registers.
constexpr int attention_min_blocks() { return 4; }

template <typename T, typename TI, int HEAD_DIM>
__global__ void __launch_bounds__(attention_tiling::kThreads, attention_min_blocks()) cupykv_attention(
    TI* __restrict__ out,                 // [batch, q_len, n_heads, head_dim] (num_splits == 1)
    float* __restrict__ partial_out,      // [num_splits, batch * q_len * n_heads, head_dim]
    float* __restrict__ partial_max,      // [num_splits, batch * q_len * n_heads]
    float* __restrict__ partial_sum,      // [num_splits, batch * q_len * n_heads]
    unsigned* __restrict__ split_counters,  // [batch * n_kv * tiles], 0 before the first launch (and after each)
    const TI* __restrict__ q,             // [batch, q_len, n_heads, head_dim], contiguous
    const T* __restrict__ k_cache,        // cache base, strides below
    const T* __restrict__ v_cache,
    const int* __restrict__ lengths,      // [batch], device-resident
    const float* __restrict__ k_scales,   // [n_layers, n_kv] float32, device-resident (read for fp8 only)
    const float* __restrict__ v_scales,   // [n_layers, n_kv] float32, device-resident (read for fp8 only)
    int layer,                            // the layer of layer_offset: its row of k_scales / v_scales
    long long layer_offset, long long stride_batch, long long stride_seq, long long stride_head,
    int q_len, int n_heads, int n_kv, int head_dim_runtime, int max_seq, int num_splits, int split_keys,
    float scale, float softcap, int window, int use_rope, double rope_theta,
    const int* __restrict__ run_if) {     // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    using namespace attention_tiling;
    constexpr bool kFp8 = cupykv::is_fp8<T>::value;
    static_assert(kFp8 || cupykv::same_type<T, TI>::value, "a 16- or 32-bit cache attends in its own type");
    static_assert(HEAD_DIM == 0, "the generic kernel takes its head_dim at run time");
    constexpr int kDimsPerThread = 2;   // P.V: dims tid and tid + kThreads of every row (head_dim <= 256)
    const int head_dim = head_dim_runtime;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

    const int group = n_heads / n_kv;
    const int tiles = (q_len * group - 1) / kTileRows + 1;           // query-row tiles per sequence and kv head
    const int head_of_batch = blockIdx.x / tiles;                    // b * n_kv + kv_head
    const int b = head_of_batch / n_kv, kv_head = head_of_batch % n_kv;
    const int split = blockIdx.y;
    const int first_row = (blockIdx.x - head_of_batch * tiles) * kTileRows;   // row = i * group + g
    const int tile_rows = min(kTileRows, q_len * group - first_row);

    extern __shared__ float smem[];
    cupykv::SharedLayout shared_memory(reinterpret_cast<unsigned char*>(smem));
    float* q_tile = shared_memory.take<float>(kTileRows * head_dim, "q_tile");        // [kTileRows][head_dim]
    float* scores = shared_memory.take<float>(kTileRows * kChunk, "scores");          // [kTileRows][kChunk]
    float* row_max = shared_memory.take<float>(kTileRows, "row_max");                 // [kTileRows]
    float* row_sum = shared_memory.take<float>(kTileRows, "row_sum");                 // [kTileRows]
    float* row_rescale = shared_memory.take<float>(kTileRows, "row_rescale");         // [kTileRows]

    const int length = cupykv::live_length(lengths[b], max_seq);
    // The logit factor: scale (fp8: scale * k_scale, so that it turns the dot product with raw codes
    // into the logit). The q rows of this tile, rotated at their position, are kept unscaled.
    float logit_scale = scale;
    if constexpr (kFp8) logit_scale = scale * k_scales[(long long)layer * n_kv + kv_head];
    const cupykv::QueryTile tile = {b, q_len, n_heads, group, kv_head, first_row, tile_rows, length, max_seq, window};
    tile.load_q<TI>(q_tile, q, kTileRows, head_dim, head_dim, use_rope, rope_theta);
    if (tid < kTileRows) {
        row_max[tid] = cupykv::neg_infinity();
        row_sum[tid] = 0.0f;
    }
    float acc[kTileRows][kDimsPerThread];   // rows r of the tile, dims tid + k * kThreads
    for (int m = 0; m < kTileRows; ++m)
        for (int k = 0; k < kDimsPerThread; ++k) acc[m][k] = 0.0f;
    __syncthreads();

    // Key range of this split (uniform across the block): see attention_keys.cuh.
    const cupykv::KeyRange keys = cupykv::attention_split_keys(length, first_row, tile_rows, group, max_seq, window,
                                                               split, num_splits, split_keys, kChunk);
    const int split_begin = keys.begin, split_end = keys.end;

    const long long head_base = layer_offset + b * stride_batch + kv_head * stride_head;
    for (int chunk = split_begin; chunk < split_end; chunk += kChunk) {
        // 1. scores[r][t] for key j = chunk + t.
        const int j = chunk + tid;
        float dot[kTileRows];
        for (int r = 0; r < kTileRows; ++r) dot[r] = 0.0f;
        if (j < split_end) {
            const T* k_row = k_cache + head_base + (long long)j * stride_seq;
            for (int d = 0; d < head_dim; ++d) {
                const float k_val = cupykv::load_kv<T>(k_row[d]);   // fp8: the raw code
                for (int r = 0; r < kTileRows; ++r)
                    if (r < tile_rows) dot[r] = fmaf(q_tile[r * head_dim + d], k_val, dot[r]);
            }
        }
        for (int r = 0; r < kTileRows; ++r) {
            const int position = length + (first_row + r) / group;
            const bool attended = r < tile_rows && j < split_end && j <= position &&
                                  (window <= 0 || j > position - window);
            float s = dot[r] * logit_scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            scores[r * kChunk + tid] = attended ? s : cupykv::neg_infinity();
        }
        __syncthreads();

        // 2. online-softmax update, one warp per row.
        for (int r = warp; r < kTileRows; r += kWarps) {
            float* row = scores + r * kChunk;
            float chunk_max = cupykv::neg_infinity();
            for (int c = lane; c < kChunk; c += 32) chunk_max = fmaxf(chunk_max, row[c]);
            chunk_max = cupykv::warp_max(chunk_max);
            const float old_max = row_max[r];
            const float new_max = fmaxf(old_max, chunk_max);
            const bool any = new_max != cupykv::neg_infinity();
            float chunk_sum = 0.0f;
            for (int c = lane; c < kChunk; c += 32) {
                // masked: exp(-inf) = 0; a NaN logit stays NaN even as the only one so far (see step 4)
                const float p = expf(row[c] - (any ? new_max : 0.0f));
                row[c] = p;
                chunk_sum += p;
            }
            chunk_sum = cupykv::warp_sum(chunk_sum);
            if (lane == 0) {
                const float rescale = any ? expf(old_max - new_max) : 1.0f;
                row_rescale[r] = rescale;
                row_sum[r] = row_sum[r] * rescale + chunk_sum;
                row_max[r] = new_max;
            }
        }
        __syncthreads();

        // 3. acc = acc * rescale + P . V for every row and this thread's dims.
        for (int r = 0; r < kTileRows; ++r) {
            const float rescale = row_rescale[r];
            for (int k = 0; k < kDimsPerThread; ++k) acc[r][k] *= rescale;
        }
        const int chunk_keys = min(kChunk, split_end - chunk);
        const T* v_chunk = v_cache + head_base + (long long)chunk * stride_seq;
        int c = 0;
        for (; c + 4 <= chunk_keys; c += 4) {   // four keys at a time: one 16-byte score load per row
            float v_val[4][kDimsPerThread];
            for (int key = 0; key < 4; ++key)
                for (int k = 0; k < kDimsPerThread; ++k) {
                    const int d = tid + k * kThreads;
                    v_val[key][k] =
                        d < head_dim ? cupykv::load_kv<T>(v_chunk[(long long)(c + key) * stride_seq + d]) : 0.0f;
                }
            for (int r = 0; r < kTileRows; ++r) {   // r a compile-time index of acc: no local memory
                if (r >= tile_rows) break;
                const float4 p = *reinterpret_cast<const float4*>(scores + r * kChunk + c);
                const float p_key[4] = {p.x, p.y, p.z, p.w};
                // p == 0 (masked or underflowed) never touches v: a stale NaN row stays out.
                for (int key = 0; key < 4; ++key)
                    for (int k = 0; k < kDimsPerThread; ++k)
                        acc[r][k] = p_key[key] != 0.0f ? fmaf(p_key[key], v_val[key][k], acc[r][k]) : acc[r][k];
            }
        }
        for (; c < chunk_keys; ++c) {
            float v_val[kDimsPerThread];
            for (int k = 0; k < kDimsPerThread; ++k) {
                const int d = tid + k * kThreads;
                v_val[k] = d < head_dim ? cupykv::load_kv<T>(v_chunk[(long long)c * stride_seq + d]) : 0.0f;
            }
            for (int r = 0; r < kTileRows; ++r) {   // r a compile-time index of acc: no local memory
                if (r >= tile_rows) break;
                const float p = scores[r * kChunk + c];
                for (int k = 0; k < kDimsPerThread; ++k)
                    acc[r][k] = p != 0.0f ? fmaf(p, v_val[k], acc[r][k]) : acc[r][k];
            }
        }
        __syncthreads();
    }

    // 4. write out (normalised) or the split's partial result; fp8: acc sums p * code, times v_scale.
    float v_scale = 1.0f;
    if constexpr (kFp8) v_scale = v_scales[(long long)layer * n_kv + kv_head];
    const long long rows_total = (long long)(gridDim.x / tiles) * q_len * group;   // batch * q_len * n_heads
    for (int r = 0; r < kTileRows; ++r) {
        if (r >= tile_rows) break;
        const long long out_row = tile.out_row(r);
        const float sum = row_sum[r];
        const bool attends_a_key = tile.attends_a_key(r);
        for (int k = 0; k < kDimsPerThread; ++k) {
            const int d = tid + k * kThreads;
            if (d >= head_dim) continue;
            float value = acc[r][k];
            if constexpr (kFp8) value *= v_scale;
            if (num_splits == 1) {
                out[out_row * head_dim + d] = cupykv::from_float<TI>(cupykv::normalised_output(value, sum, attends_a_key));
            } else {
                partial_out[(split * rows_total + out_row) * head_dim + d] = value;
            }
        }
        if (num_splits > 1 && tid == 0) {
            partial_max[split * rows_total + out_row] = row_max[r];
            partial_sum[split * rows_total + out_row] = sum;
        }
    }
    // 5. The tile's last split to finish merges every split into out (attention_merge.cuh).
    __shared__ int is_last_split;
    if (num_splits > 1 && cupykv::attention_last_split(split_counters + blockIdx.x, num_splits, &is_last_split))
        cupykv::attention_merge_splits(out, partial_out, partial_max, partial_sum, tile, rows_total, num_splits,
                                       head_dim);
}
