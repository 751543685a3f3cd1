// advance.cu: commit pending rows by growing the device-resident lengths.
//
// Computes, for every sequence b:
//     step = use_per_seq ? max(per_seq_steps[b], 0) : steps
//     lengths[b] += step, clamped to max_seq; a clamp sets overflow[b] = 1.
//
// Launch geometry: grid (ceil(batch / 256)), block (256).
// Device-resident arguments: lengths [batch] int32 (read, written), overflow
// [batch] int32 (set), per_seq_steps [batch] int32 (read when use_per_seq). `steps`
// is a launch constant, the same on every replay (a decode step advances by 1).
__global__ void __launch_bounds__(256) cupykv_advance(
    int* __restrict__ lengths, int* __restrict__ overflow, const int* __restrict__ per_seq_steps,
    int use_per_seq, int steps, int batch, int max_seq) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    const int step = use_per_seq ? max(per_seq_steps[b], 0) : steps;
    long long grown = (long long)lengths[b] + step;
    if (grown > max_seq) {
        grown = max_seq;
        overflow[b] = 1;
    }
    lengths[b] = (int)grown;
}
