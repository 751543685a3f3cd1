// additive_mask.cu: fill a caller's float32 mask [batch, 1, q_len, max_seq]
// from the device-resident lengths, for attention implementations that add a
// mask to full-axis logits.
//
// Computes out[b, 0, i, j] = 0 if j <= lengths[b] + i, else mask_value.
//
// Launch geometry: grid (ceil(max_seq / 256), q_len, batch), block (256).
// Device-resident arguments: lengths [batch] int32 (read), out (written).
__global__ void __launch_bounds__(256) cupykv_additive_mask(
    float* __restrict__ out, const int* __restrict__ lengths, int q_len, int max_seq, float mask_value) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y;
    const int b = blockIdx.z;
    if (j >= max_seq) return;
    const long long position = (long long)lengths[b] + i;
    out[((long long)b * q_len + i) * max_seq + j] = (j <= position) ? 0.0f : mask_value;
}
