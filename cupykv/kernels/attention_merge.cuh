// attention_merge.cuh: the split-KV merge inside the attention launch, shared by attention.cu,
// attention_f32.cu and attention_mma.cu, and the query rows of a block (QueryTile), whose q tile the
// two CUDA-core kernels load with it.
//
// With num_splits > 1, every block of a query tile writes its split's fp32 partial rows (the
// unnormalised output relative to the split's row max, the max, and the sum of weights), then
// counts itself on the tile's device counter. The block that counts last merges the tile's rows
// over every split and writes `out`:
//     M = max over splits with sum != 0 of max_s,   out = sum_s e^(max_s - M) acc_s / sum_s e^(max_s - M) sum_s
// the reduction of cupykv.reference in split order (normalised_output: zeros for a row that attends
// nothing). A split whose sum is NaN (a NaN or +inf logit) takes part, so the row comes out NaN.
// The hand-off is the CUDA programming guide's "last block" pattern: a fence, then the count
// (release); the count, then a fence (acquire), and a barrier for the rest of the block. The
// count is atomicInc with wrap-around at num_splits - 1, so it returns to 0 as the last block
// counts: a captured graph replays with every counter at 0, and nothing resets them.
#pragma once
#include "common.cuh"

namespace cupykv {

// The query rows of one block: row r of the tile is query i = (first_row + r) / group, head
// h = kv_head * group + (first_row + r) % group of sequence b.
struct QueryTile {
    int b, q_len, n_heads, group, kv_head, first_row, rows;
    int length, max_seq, window;   // the sequence's length (query i sits at length + i) and the mask's bounds

    // Query (index in q_len) of tile row r.
    __device__ __forceinline__ int query(int r) const { return (first_row + r) / group; }

    // Row of [batch * q_len * n_heads] that tile row r writes.
    __device__ __forceinline__ long long out_row(int r) const {
        const int h = kv_head * group + (first_row + r) % group;
        return ((long long)b * q_len + query(r)) * n_heads + h;
    }

    // Whether tile row r attends any key: its first key, position - window + 1, lies below max_seq.
    __device__ __forceinline__ bool attends_a_key(int r) const {
        return window <= 0 || (long long)length + query(r) - window + 1 < max_seq;
    }

    // The CUDA-core kernels' q tile: q_tile[r * row_floats + d] (capacity rows; row_floats >= head_dim)
    // = row r's q in fp32, rotated at its position when use_rope, unscaled; rows past the tile, and dims
    // from head_dim to row_floats (a head padded onto a larger instance), are zeros. q is
    // [batch, q_len, n_heads, head_dim] of the io type TI. Every thread of the block calls it; a
    // barrier must follow before any thread reads the tile.
    template <typename TI>
    __device__ __forceinline__ void load_q(float* q_tile, const TI* q, int capacity, int head_dim, int row_floats,
                                           int use_rope, double rope_theta) const {
        const int half_dim = head_dim / 2;
        for (int e = threadIdx.x; e < capacity * row_floats; e += blockDim.x) {
            const int r = e / row_floats, d = e - r * row_floats;
            float value = 0.0f;
            if (r < rows && d < head_dim && (!use_rope || d < half_dim)) {
                const long long base = out_row(r) * head_dim;   // q and out share a layout
                value = to_float<TI>(q[base + d]);
                if (use_rope) {
                    float partner = to_float<TI>(q[base + d + half_dim]);
                    rope_rotate_pair(&value, &partner, length + query(r), d, head_dim, rope_theta);
                    q_tile[r * row_floats + d + half_dim] = partner;
                }
            }
            if (!use_rope || d < half_dim || d >= head_dim || r >= rows) q_tile[e] = value;
        }
    }
};

// A row's output from its weighted sum of values and its sum of weights. A sum of 0 means no weight
// was summed: zeros for a row that attends nothing (the contract), NaN for one whose every attended
// logit was -inf (a non-finite q or K), as the reference's softmax e^(-inf - (-inf)) is. A NaN sum
// (a NaN or +inf logit) gives NaN through the division.
__device__ __forceinline__ float normalised_output(float value, float sum, bool attends_a_key) {
    return sum != 0.0f ? value / sum : attends_a_key ? quiet_nan() : 0.0f;
}

// Whether this block is the last of its tile's num_splits to finish; every thread gets the
// answer. Call after the block's partial writes, from every thread (it holds barriers).
__device__ __forceinline__ bool attention_last_split(unsigned* tile_counter, int num_splits, int* is_last) {
    __syncthreads();   // every thread's partial writes come before the releasing fence
    if (threadIdx.x == 0) {
        __threadfence();
        *is_last = atomicInc(tile_counter, (unsigned)num_splits - 1u) == (unsigned)num_splits - 1u;
        __threadfence();
    }
    __syncthreads();
    return *is_last != 0;
}

// Merges every split of the tile's rows into `out` (the last block of the tile; all threads).
template <typename T>
__device__ __forceinline__ void attention_merge_splits(T* out, const float* partial_out, const float* partial_max,
                                                       const float* partial_sum, const QueryTile& tile,
                                                       long long rows_total, int num_splits, int head_dim) {
    for (int e = threadIdx.x; e < tile.rows * head_dim; e += blockDim.x) {
        const int r = e / head_dim, d = e - r * head_dim;
        const long long row = tile.out_row(r);
        float top = neg_infinity();
        for (int s = 0; s < num_splits; ++s)
            if (partial_sum[s * rows_total + row] != 0.0f) top = fmaxf(top, partial_max[s * rows_total + row]);
        float total = 0.0f, value = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const long long part = s * rows_total + row;
            const float sum = partial_sum[part];
            if (sum != 0.0f) {
                const float weight = expf(partial_max[part] - top);
                total += sum * weight;
                value += partial_out[part * head_dim + d] * weight;
            }
        }
        out[row * head_dim + d] = from_float<T>(normalised_output(value, total, tile.attends_a_key(r)));
    }
}

}  // namespace cupykv
