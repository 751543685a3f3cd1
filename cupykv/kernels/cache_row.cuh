// cache_row.cuh: store one new K/V row into the cache, the step append.cu and write.cu share.
//
// store_cache_row writes row `src_row` of k_new / v_new ([.., n_kv, head_dim], contiguous, io
// type TI) to the cache element offset `dst_row` (layer, sequence and position already applied;
// heads `stride_head` apart), with the threads of one block striding over the row's elements.
// When the cache stores TI itself, V (and K without rope) is copied bit for bit. An fp8 cache
// stores E4M3(x / scale) of each fp32 value x, with the head's scale (kv_codec.cuh). With rope,
// each half-split pair of K is rotated at position `pos` in double precision (common.cuh's
// rope_rotate_pair), rounded once to fp32 and then stored: rotation comes before quantization.
// No barrier: callers may return before it.
#pragma once
#include "common.cuh"
#include "kv_codec.cuh"

namespace cupykv {

// One element of a new row as the cache stores it: bit for bit when T is TI, else quantized.
template <typename T, typename TI> __device__ __forceinline__ T stored_element(TI x, float scale) {
    if constexpr (same_type<T, TI>::value) {
        (void)scale;
        return x;
    } else {
        return store_kv<T>(to_float<TI>(x), scale);
    }
}

// scales: k_scales / v_scales [n_layers * n_kv] float32 (device), this layer's heads at scale_row.
template <typename T, typename TI>
__device__ __forceinline__ void store_cache_row(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                const TI* __restrict__ k_new, const TI* __restrict__ v_new,
                                                const float* __restrict__ k_scales,
                                                const float* __restrict__ v_scales, long long scale_row,
                                                long long src_row, long long dst_row, long long stride_head,
                                                int n_kv, int head_dim, int pos, int use_rope, double rope_theta) {
    const int row_elems = n_kv * head_dim;
    for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
        const int h = e / head_dim, d = e - h * head_dim;
        v_cache[dst_row + h * stride_head + d] = stored_element<T>(v_new[src_row + e], v_scales[scale_row + h]);
    }
    if (!use_rope) {
        for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
            const int h = e / head_dim, d = e - h * head_dim;
            k_cache[dst_row + h * stride_head + d] = stored_element<T>(k_new[src_row + e], k_scales[scale_row + h]);
        }
        return;
    }
    const int half_dim = head_dim / 2;
    for (int e = threadIdx.x; e < n_kv * half_dim; e += blockDim.x) {
        const int h = e / half_dim, d = e - h * half_dim;
        float lo = to_float(k_new[src_row + h * head_dim + d]);
        float hi = to_float(k_new[src_row + h * head_dim + d + half_dim]);
        rope_rotate_pair(&lo, &hi, pos, d, head_dim, rope_theta);
        const float head_scale = k_scales[scale_row + h];
        k_cache[dst_row + h * stride_head + d] = store_kv<T>(lo, head_scale);
        k_cache[dst_row + h * stride_head + d + half_dim] = store_kv<T>(hi, head_scale);
    }
}

}  // namespace cupykv
