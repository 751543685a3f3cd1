// append.cu: write new K/V rows into one layer of the cache at device-resident positions.
//
// Computes, for every sequence b and new row i (n_new rows per call):
//     pos = lengths[b] + i
//     pos <  max_seq: k_cache[layer, b, pos] = rope(k_new[b, i], pos) (or k_new[b, i])
//                     v_cache[layer, b, pos] = v_new[b, i]
//     pos >= max_seq: nothing is written; overflow[b] = 1.
//     return_positions: positions_out[b, i] = pos where the row was written, else -1.
// `lengths` is not changed (the rows stay pending until advance).
//
// Launch geometry: grid (batch * n_new), block (128); block r writes row i = r % n_new
// of sequence b = r / n_new, [n_kv, head_dim] of K and of V. Every row is on grid x
// (up to 2**31 - 1 blocks), so no batch reaches CUDA's 65535 limit on y or z.
// Any block size >= 1 works; 128 is what the host uses.
//
// Device-resident arguments (read or written at run time, so a captured graph
// stays valid when they change): lengths [batch] int32 (read), overflow [batch]
// int32 (set to 1), positions_out [batch, n_new] int32 (written when
// return_positions), run_if [1] int32 (read first: 0 makes the launch return at
// once, reading nothing else and writing nothing; common.cuh). Everything else
// (layer, strides, theta) is fixed per launch.
//
// Strides are in elements, so one kernel serves the NHD and the HND layout.
// cupykv_append<T, TI>: the cache stores T, the new rows come as TI (T itself, or for an fp8
// cache its io dtype). Without rope a row of type T is copied bit for bit. With rope the key
// is rotated in double precision and rounded once to fp32, then to the storage type. An fp8
// cache stores E4M3(x / scale) with the head's scale from k_scales / v_scales
// ([layers, n_kv] float32, device-resident, so set_scales reaches a captured graph).
#include "cache_row.cuh"

template <typename T, typename TI>
__global__ void __launch_bounds__(1024) cupykv_append(
    T* __restrict__ k_cache,               // [layers, batch, ...] by the strides below
    T* __restrict__ v_cache,               // same shape and strides as k_cache
    const TI* __restrict__ k_new,          // [batch, n_new, n_kv, head_dim], contiguous, io type
    const TI* __restrict__ v_new,          // [batch, n_new, n_kv, head_dim], contiguous, io type
    const int* __restrict__ lengths,       // [batch], device-resident
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
    if (cupykv::gated_off(run_if)) return;
    const int b = blockIdx.x / n_new;
    const int i = blockIdx.x - b * n_new;
    const int pos = lengths[b] + i;
    const bool in_range = pos >= 0 && pos < max_seq;   // uniform across the block: no barrier below
    if (threadIdx.x == 0) {
        if (!in_range) overflow[b] = 1;
        if (return_positions) positions_out[(long long)b * n_new + i] = in_range ? pos : -1;
    }
    if (!in_range) return;
    const long long src_row = ((long long)b * n_new + i) * n_kv * head_dim;
    const long long dst_row = layer_offset + b * stride_batch + (long long)pos * stride_seq;
    cupykv::store_cache_row(k_cache, v_cache, k_new, v_new, k_scales, v_scales, (long long)layer * n_kv, src_row,
                            dst_row, stride_head, n_kv, head_dim, pos, use_rope, rope_theta);
}
