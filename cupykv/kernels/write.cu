// write.cu: write new K/V rows into one layer of the cache at device-resident positions.
//
// Computes, for every sequence b and new row i (n_new rows per call):
//     pos = positions[b, i]
//     0 <= pos < max_seq, and no later row j > i of sequence b has positions[b, j] == pos:
//         k_cache[layer, b, pos] = rope(k_new[b, i], pos) (or k_new[b, i])
//         v_cache[layer, b, pos] = v_new[b, i]
//     pos < 0 or pos >= max_seq: nothing is written; overflow[b] = 1.
//     return_positions: positions_out[b, i] = pos where the row was written, else -1.
// `lengths` is neither read nor changed: this is append with the positions given by the
// caller instead of lengths[b] + i.
//
// Two rows of one sequence at one position: the last one wins, as if the rows were written
// one after another. Each block therefore scans the positions after its own row
// (threads stride over j > i, then one __syncthreads_or), and a superseded row writes
// nothing, so no two blocks ever store to the same element. The host refuses such
// duplicates when it sees the positions (host values); device positions get this rule.
//
// Launch geometry: grid (batch * n_new), block (128); block r writes row i = r % n_new of
// sequence b = r / n_new, [n_kv, head_dim] of K and of V. Every row is on grid x (up to
// 2**31 - 1 blocks), so no batch reaches CUDA's 65535 limit on y or z.
//
// Bytes per row: 2 * n_kv * head_dim * sizeof(T) read and as many written (as append),
// plus 4 * (n_new - 1 - i) bytes of positions scanned, which stay in L1/L2: 4 * n_new
// bytes a sequence, against the 2 * n_kv * head_dim * sizeof(T) of each of its rows.
// One-row decode writes (n_new = 1) scan nothing.
//
// Device-resident arguments (read or written at run time, so a captured graph stays valid
// when they change): positions [batch, n_new] int32 (read), overflow [batch] int32 (set to
// 1), positions_out [batch, n_new] int32 (written when return_positions), run_if [1] int32
// (read first: 0 makes the launch return at once, reading nothing else and writing nothing;
// common.cuh). Everything else (layer, strides, theta) is fixed per launch.
//
// Strides are in elements, so one kernel serves the NHD and the HND layout. Storage type T,
// io type TI and the fp8 scales as in append.cu; without rope a row of type T is copied bit for
// bit, with rope the key is rotated in double precision and rounded once to fp32, then to the
// storage type (exactly as append.cu does).
#include "cache_row.cuh"

template <typename T, typename TI>
__global__ void __launch_bounds__(1024) cupykv_write(
    T* __restrict__ k_cache,               // [layers, batch, ...] by the strides below
    T* __restrict__ v_cache,               // same shape and strides as k_cache
    const TI* __restrict__ k_new,          // [batch, n_new, n_kv, head_dim], contiguous, io type
    const TI* __restrict__ v_new,          // [batch, n_new, n_kv, head_dim], contiguous, io type
    const int* __restrict__ positions,     // [batch, n_new], device-resident
    int* __restrict__ overflow,            // [batch], device-resident, set to 1 on overflow
    int* __restrict__ positions_out,       // [batch, n_new], written when return_positions
    int return_positions,
    const float* __restrict__ k_scales,    // [layers, n_kv] float32, device-resident (fp8 caches)
    const float* __restrict__ v_scales,    // [layers, n_kv] float32, device-resident (fp8 caches)
    int layer,
    long long layer_offset,                // layer * stride of the layer axis
    long long stride_batch, long long stride_seq, long long stride_head,
    int n_new, int n_kv, int head_dim, int max_seq,
    int use_rope, double rope_theta,
    const int* __restrict__ run_if) {      // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;   // before the __syncthreads_or below
    const int b = blockIdx.x / n_new;
    const int i = blockIdx.x - b * n_new;
    const int* row_positions = positions + (long long)b * n_new;   // [n_new]
    const int pos = row_positions[i];
    const bool in_range = pos >= 0 && pos < max_seq;               // uniform across the block
    bool later_twin = false;
    if (in_range) {
        for (int j = i + 1 + threadIdx.x; j < n_new; j += blockDim.x) later_twin |= row_positions[j] == pos;
    }
    const bool superseded = __syncthreads_or(later_twin) != 0;     // every thread reaches it
    if (threadIdx.x == 0) {
        if (!in_range) overflow[b] = 1;
        if (return_positions) positions_out[(long long)b * n_new + i] = in_range && !superseded ? pos : -1;
    }
    if (!in_range || superseded) return;   // uniform: no barrier below
    const long long src_row = ((long long)b * n_new + i) * n_kv * head_dim;
    const long long dst_row = layer_offset + b * stride_batch + (long long)pos * stride_seq;
    cupykv::store_cache_row(k_cache, v_cache, k_new, v_new, k_scales, v_scales, (long long)layer * n_kv, src_row,
                            dst_row, stride_head, n_kv, head_dim, pos, use_rope, rope_theta);
}
