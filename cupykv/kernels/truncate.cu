// truncate.cu: roll sequences back to shorter device-resident lengths
// (speculative-decoding rollback).
//
// Computes, for every sequence b:
//     lengths[b] = min(lengths[b], max(new_lengths[b], 0))
// It only ever shortens; the host validates host-given lengths before launch,
// and device-given ones are clamped here so a bad value cannot grow a sequence.
// Stored rows are left as they are; they are simply no longer live.
//
// Launch geometry: grid (ceil(batch / 256)), block (256).
// Device-resident arguments: lengths [batch] int32 (read, written),
// new_lengths [batch] int32 (read).
__global__ void __launch_bounds__(256) cupykv_truncate(
    int* __restrict__ lengths, const int* __restrict__ new_lengths, int batch) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    lengths[b] = min(lengths[b], max(new_lengths[b], 0));
}
