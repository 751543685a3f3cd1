// key_ranges.cu: the key range of each attention split (cupykv/kernels/attention_keys.cuh), one
// case per thread, for tests/test_key_ranges.py. The tests state the ranges from the mask; these
// kernels only call the header. They compile with NVRTC for sm_80 and sm_90 too.
#include "attention_keys.cuh"

using namespace cupykv;

// cases[i] = {length, first_row, tile_rows, group, max_seq, window, split, num_splits, split_keys,
// align}; ranges[i] = {begin, end} of that split.
__global__ void split_ranges(const int* __restrict__ cases, int count, int* __restrict__ ranges) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const int* c = cases + 10 * i;
    const KeyRange range = attention_split_keys(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9]);
    ranges[2 * i] = range.begin;
    ranges[2 * i + 1] = range.end;
}

// lengths[i] = live_length(stored[i], max_seq).
__global__ void live_lengths(const int* __restrict__ stored, int count, int max_seq, int* __restrict__ lengths) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) lengths[i] = live_length(stored[i], max_seq);
}
