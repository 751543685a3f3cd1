// cache_row.cuh: store one new K/V row into the cache, the step append.cu and write.cu share.
//
// store_cache_row writes row `src_row` of k_new / v_new ([.., n_kv, head_dim], contiguous) to
// the cache element offset `dst_row` (layer, sequence and position already applied; heads
// `stride_head` apart), with the threads of one block striding over the row's elements.
// V (and K without rope) is copied bit for bit. With rope, each half-split pair of K is
// rotated at position `pos` in double precision (common.cuh's rope_rotate_pair), rounded
// once to fp32 and then to the storage type. No barrier: callers may return before it.
#pragma once
#include "common.cuh"

namespace cupykv {

template <typename T>
__device__ __forceinline__ void store_cache_row(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                const T* __restrict__ k_new, const T* __restrict__ v_new,
                                                long long src_row, long long dst_row, long long stride_head,
                                                int n_kv, int head_dim, int pos, int use_rope, double rope_theta) {
    const int row_elems = n_kv * head_dim;
    for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
        const int h = e / head_dim, d = e - h * head_dim;
        v_cache[dst_row + h * stride_head + d] = v_new[src_row + e];
    }
    if (!use_rope) {
        for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
            const int h = e / head_dim, d = e - h * head_dim;
            k_cache[dst_row + h * stride_head + d] = k_new[src_row + e];
        }
        return;
    }
    const int half_dim = head_dim / 2;
    for (int e = threadIdx.x; e < n_kv * half_dim; e += blockDim.x) {
        const int h = e / half_dim, d = e - h * half_dim;
        float lo = to_float(k_new[src_row + h * head_dim + d]);
        float hi = to_float(k_new[src_row + h * head_dim + d + half_dim]);
        rope_rotate_pair(&lo, &hi, pos, d, head_dim, rope_theta);
        k_cache[dst_row + h * stride_head + d] = from_float<T>(lo);
        k_cache[dst_row + h * stride_head + d + half_dim] = from_float<T>(hi);
    }
}

}  // namespace cupykv
