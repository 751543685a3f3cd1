// speculative.cu: the device-side bookkeeping of one greedy speculative-decoding cycle
// (a draft model proposes k tokens, the target verifies them in one pass of q_len k + 1).
//
// cupykv_speculative_gather: a strided copy of int32 token ids,
//     out[r * cols + c] = src[offset + r * row_stride + c * col_stride]
// for r < rows, c < cols. It moves ids between the layouts the steps of a cycle use: the
// draft's last proposal of a q_len-2 step (rows = batch, cols = 1, offset 1, row_stride 2)
// and the chain [k + 1, batch] of (last token, proposals) into the verify pass's ids
// [batch, k + 1] (row_stride 1, col_stride batch).
// Launch geometry: grid (ceil(rows * cols / 256)), block (256), one thread per element.
//
// cupykv_speculative_accept: per sequence b, after the verify pass. c = verify_ids[b] are the
// k + 1 ids it embedded (last token, then proposals d_0..d_{k-1}) at positions L..L + k, where
// L = lengths[b] - (k + 1) is the committed length before the pass; p = target_ids[b] its
// greedy tokens, p_i following c_0..c_i.
//     active[b] == 0:  emitted nothing; tokens[b, :] = -1, accepted[b] = -1,
//                      target_lengths[b] = L, draft_lengths[b] = L - 1.
//     otherwise:       n = the longest prefix with d_i == p_i (0..k), accepted[b] = n.
//                      p_0..p_n are the target's own greedy tokens; emit them in order into
//                      tokens[b, :] (the rest -1), stopping after e of them at the first of:
//                      a stop id, budget[b] reaching 0, L + e reaching max_length.
//                      target_lengths[b] = L + e   (keeps c_0..c_{e-1}: those rows are right)
//                      draft_lengths[b]  = L + e - 1
//                      chain[b] = p_{e-1}           (the new last token)
//                      draft_pair[b] = (c_{e-1}, p_{e-1})
//                      active[b] = 0 if it stopped.
// The cycle then truncates both caches to these lengths (graph-safe, from device arrays).
// The draft holds one row less than the target: its next q_len-2 step re-embeds the last
// committed token with the new one, which also covers a fully accepted cycle (the draft never
// embedded d_{k-1}). A stopped sequence keeps its lengths, and its later cycles rewrite the
// same pending rows; max_length = min(target max_seq - k - 1, draft max_seq - k) keeps
// those rows inside both caches, so nothing overflows.
// Launch geometry: grid (ceil(batch / 256)), block (256), one thread per sequence.
//
// Cost: both kernels touch a few ints per sequence (accept: about 4 (k + 1) + 12 per sequence),
// so they are latency-bound; a cycle makes three such launches besides the model's.
//
// Device-resident arguments: every pointer; k, n_stop, batch and max_length are fixed per
// launch. stop_ids [n_stop] is padded with -1 (a negative entry ends the list).
__global__ void __launch_bounds__(256) cupykv_speculative_gather(
    int* __restrict__ out,                 // [rows, cols]
    const int* __restrict__ src,
    int rows, int cols, int offset, int row_stride, int col_stride) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (long long)rows * cols) return;
    const int r = (int)(e / cols), c = (int)(e - (long long)r * cols);
    out[e] = src[offset + (long long)r * row_stride + (long long)c * col_stride];
}

__global__ void __launch_bounds__(256) cupykv_speculative_accept(
    int* __restrict__ tokens,              // [batch, k + 1], emitted tokens, -1 padded
    int* __restrict__ accepted,            // [batch], n, or -1 where inactive
    int* __restrict__ target_lengths,      // [batch], truncate the target to these
    int* __restrict__ draft_lengths,       // [batch], truncate the draft to these
    int* __restrict__ chain,               // [batch], row 0 of the chain: the last token
    int* __restrict__ draft_pair,          // [batch, 2], the draft's next q_len-2 input
    int* __restrict__ active,              // [batch], 1 while the sequence decodes
    int* __restrict__ budget,              // [batch], tokens it may still emit
    const int* __restrict__ verify_ids,    // [batch, k + 1]
    const int* __restrict__ target_ids,    // [batch, k + 1], argmax of the verify logits
    const int* __restrict__ lengths,       // [batch], the target's lengths after advance(k + 1)
    const int* __restrict__ stop_ids,      // [n_stop], padded with -1
    int k, int n_stop, int batch, int max_length) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    const long long row = (long long)b * (k + 1);
    const int base = lengths[b] - (k + 1);
    if (!active[b]) {
        for (int i = 0; i <= k; ++i) tokens[row + i] = -1;
        accepted[b] = -1;
        target_lengths[b] = base;
        draft_lengths[b] = base - 1;
        return;
    }
    int n = 0;
    while (n < k && verify_ids[row + n + 1] == target_ids[row + n]) ++n;
    accepted[b] = n;
    int left = budget[b], emitted = 0;
    bool stop = false;
    while (emitted <= n && !stop) {
        const int t = target_ids[row + emitted];
        tokens[row + emitted] = t;
        ++emitted;
        --left;
        stop = left <= 0 || base + emitted >= max_length;
        for (int s = 0; s < n_stop && stop_ids[s] >= 0 && !stop; ++s) stop = stop_ids[s] == t;
    }
    for (int i = emitted; i <= k; ++i) tokens[row + i] = -1;
    budget[b] = left;
    const int length = base + emitted;
    target_lengths[b] = length;
    draft_lengths[b] = length - 1;
    chain[b] = target_ids[row + emitted - 1];
    draft_pair[2 * b] = verify_ids[row + emitted - 1];
    draft_pair[2 * b + 1] = target_ids[row + emitted - 1];
    active[b] = stop ? 0 : 1;
}
