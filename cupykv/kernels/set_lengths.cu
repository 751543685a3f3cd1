// set_lengths.cu: set the device-resident lengths to new values, growing or shrinking them.
//
// Computes, for every sequence b:
//     want = use_per_seq ? new_lengths[b] : value
//     lengths[b] = min(max(want, 0), max_seq); want > max_seq sets overflow[b] = 1.
// Unlike truncate it may grow a sequence: rows between the old and the new length become
// live as they are stored (written earlier by append or write, or zeros). A negative
// device value (the host refuses negative host values) is clamped to 0 without a flag.
//
// Launch geometry: grid (ceil(batch / 256)), block (256).
// Device-resident arguments: lengths [batch] int32 (written), overflow [batch] int32
// (set), new_lengths [batch] int32 (read when use_per_seq). `value` is a launch constant,
// the same on every replay.
__global__ void __launch_bounds__(256) cupykv_set_lengths(
    int* __restrict__ lengths, int* __restrict__ overflow, const int* __restrict__ new_lengths,
    int use_per_seq, int value, int batch, int max_seq) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    const int want = use_per_seq ? new_lengths[b] : value;
    if (want > max_seq) overflow[b] = 1;
    lengths[b] = min(max(want, 0), max_seq);
}
