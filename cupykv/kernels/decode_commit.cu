// decode_commit.cu: the end of one greedy step of a decoding loop that runs on the device
// (several steps per graph replay, sequences stopping on their own).
//
// Runs after argmax has written next_ids and before cache.advance(advance_by). For every
// sequence b, with was = active[b] (the sequence took part in this step):
//     advance_by[b] = was                     commit the row this step appended, or nothing
//     was == 1:  t = next_ids[b]
//                ids[b] = t                   the next step embeds it (argmax -> embedding hand-off)
//                tokens[b] = t                the host reads it once per replay
//                budget[b] -= 1
//                active[b] = t is not one of stop_ids[0..n_stop)  (a negative entry ends the list)
//                            and budget[b] > 0
//                            and lengths[b] + 1 < max_length     (the committed length after this
//                                                                 step leaves room for one more)
//     was == 0:  tokens[b] = -1; ids, budget and active unchanged.
//     n_active[0] -= 1 for every sequence that stops in this step (active 1 -> 0), so it counts the
//     sequences still decoding: the decode step's kernels read it as their run_if word and exit at
//     entry once it is 0 (the rest of a replay after the last sequence stopped does no work). This
//     kernel is never gated: it writes tokens[b] = -1 for every later step of the replay.
// A stopped sequence keeps embedding its last token at its frozen length: its later steps
// rewrite the one pending row at lengths[b] (that token's own K/V), commit nothing and emit
// nothing. max_length (at most max_seq - 1) is the longest committed length at which that
// pending row still fits, so a stopped sequence never writes past capacity and never sets an
// overflow flag.
//
// Launch geometry: grid (ceil(batch / 256)), block (256), one thread per sequence.
// Cost: per sequence 4 int reads and 5 int writes plus the stop list (read through L1): under
// 1 KiB for a batch of 32, so the launch is latency-bound (a few microseconds in a graph).
// Device-resident arguments: next_ids, lengths, stop_ids (read); ids, active, budget
// (read, written); tokens, advance_by (written), all int32 [batch] but stop_ids [n_stop];
// n_active [1] (atomically decremented).
// n_stop, batch and max_length are fixed per launch.
__global__ void __launch_bounds__(256) cupykv_decode_commit(
    int* __restrict__ ids,                 // [batch], the token each sequence embeds next
    int* __restrict__ tokens,              // [batch], this step's new token, -1 where none
    int* __restrict__ advance_by,          // [batch], 0 or 1, read by the advance that follows
    int* __restrict__ active,              // [batch], 1 while the sequence decodes
    int* __restrict__ budget,              // [batch], tokens it may still emit
    const int* __restrict__ next_ids,      // [batch], argmax of this step's logits
    const int* __restrict__ lengths,       // [batch], the cache's committed lengths (before the advance)
    const int* __restrict__ stop_ids,      // [n_stop], padded with -1
    int* __restrict__ n_active,            // [1], sequences still decoding
    int n_stop, int batch, int max_length) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    const int was = active[b];
    advance_by[b] = was;
    if (!was) {
        tokens[b] = -1;
        return;
    }
    const int t = next_ids[b];
    ids[b] = t;
    tokens[b] = t;
    const int left = budget[b] - 1;
    budget[b] = left;
    bool stop = left <= 0 || lengths[b] + 1 >= max_length;
    for (int s = 0; s < n_stop && stop_ids[s] >= 0 && !stop; ++s) stop = stop_ids[s] == t;
    active[b] = stop ? 0 : 1;
    if (stop) atomicAdd(n_active, -1);
}
