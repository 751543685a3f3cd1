// additive_mask.cu: fill a caller's float32 mask [batch, 1, q_len, max_seq]
// from the device-resident lengths, for attention implementations that add a
// mask to full-axis logits.
//
// Computes out[b, 0, i, j] = 0 if j <= lengths[b] + i, else mask_value.
//
// Launch geometry: grid (ceil(max_seq / 256), min(batch * q_len, 1024)), block (256).
// Grid x covers a row's positions (at most 2**30 / 256 blocks); grid y strides over
// the batch * q_len rows, so no batch or q_len reaches CUDA's 65535 limit on y.
// Device-resident arguments: lengths [batch] int32 (read), out (written).
__global__ void __launch_bounds__(256) cupykv_additive_mask(
    float* __restrict__ out, const int* __restrict__ lengths, int batch, int q_len, int max_seq,
    float mask_value) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= max_seq) return;
    const long long rows = (long long)batch * q_len;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {   // row = b * q_len + i
        const int b = (int)(row / q_len), i = (int)(row - (long long)b * q_len);
        const long long position = (long long)lengths[b] + i;
        out[row * max_seq + j] = (j <= position) ? 0.0f : mask_value;
    }
}
