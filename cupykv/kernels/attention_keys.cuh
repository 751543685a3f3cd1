// attention_keys.cuh: the keys one attention block reads, shared by attention.cu (CUDA cores) and
// attention_mma.cu (tensor cores), so that both kernels split a sequence at the same positions.
//
// A block owns query rows [first_row, first_row + tile_rows) of one sequence and kv head, where
// row = i * group + g (query i, head g of the GQA group). Query i sits at position length + i and
// attends to keys j <= position, j < max_seq, and j > position - window when window > 0. The
// tile's keys are [kv_begin, kv_end); split `split` of `num_splits` holds:
//   split_keys == 0: one of num_splits equal pieces of the tile's own range, each a multiple of
//                    `align` keys (so where the splits fall depends on the query shape);
//   split_keys > 0 (a multiple of align): the fixed positions [split * split_keys,
//                    (split + 1) * split_keys), the same for every tile and q_len, so that
//                    without a window a query row is summed in the same order whatever the
//                    query shape (what speculative verification needs to equal greedy decoding).
// The range is uniform across the block and may be empty (begin == end).
//
// The length a block attends with is the stored one clamped to [0, max_seq] (live_length): the
// cache's own ops keep it there, but a device word written by anything else must still not move a
// read outside the cache.
#pragma once

namespace cupykv {

// Sequence b's live length as attention reads it: `stored` (its lengths[b]) clamped to [0, max_seq].
__device__ __forceinline__ int live_length(int stored, int max_seq) { return min(max(stored, 0), max_seq); }

struct KeyRange {
    int begin;   // first key of this block's split
    int end;     // one past its last key
};

__device__ __forceinline__ KeyRange attention_split_keys(int length, int first_row, int tile_rows, int group,
                                                         int max_seq, int window, int split, int num_splits,
                                                         int split_keys, int align) {
    const int first_query = first_row / group;
    const int last_query = (first_row + max(tile_rows, 1) - 1) / group;
    const int kv_end = min(max_seq, length + last_query + 1);
    const int kv_begin = min(kv_end, window > 0 ? max(0, length + first_query - window + 1) : 0);
    if (split_keys > 0) {
        const int begin = min(kv_end, max(kv_begin, split * split_keys));
        return {begin, min(kv_end, (split + 1) * split_keys)};
    }
    const int per_split = ((kv_end - kv_begin + num_splits - 1) / num_splits + align - 1) / align * align;
    const int begin = min(kv_end, kv_begin + split * per_split);
    return {begin, min(kv_end, begin + per_split)};
}

}  // namespace cupykv
