// reset.cu: empty sequence slots so they can take new sequences.
//
// Computes, for every sequence b with slot_mask[b] != 0 (every b when
// use_mask is 0):  lengths[b] = 0, overflow[b] = 0.
// Stored rows are not cleared: with length 0 nothing reads them.
//
// Launch geometry: grid (ceil(batch / 256)), block (256).
// Device-resident arguments: lengths, overflow [batch] int32 (written),
// slot_mask [batch] int32 (read when use_mask).
__global__ void __launch_bounds__(256) cupykv_reset(
    int* __restrict__ lengths, int* __restrict__ overflow, const int* __restrict__ slot_mask, int use_mask, int batch) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    if (use_mask && !slot_mask[b]) return;
    lengths[b] = 0;
    overflow[b] = 0;
}
