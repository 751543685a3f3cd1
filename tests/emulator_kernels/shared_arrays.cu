// shared_arrays.cu: planted misuses of cupykv::SharedLayout (kernels/shared_layout.cuh), for
// tests/test_shared_layout.py. Each kernel is right with its reach (or n) argument at 0.
#include "shared_layout.cuh"

// Two arrays of blockDim.x floats. Each thread writes its slot of `second`, then the slot `reach`
// past its own in `first`: with reach 1 the last thread writes one float past the end of `first`,
// which on a GPU is second[0].
__global__ void write_past_first(float* out, int reach) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* first = layout.take<float>(blockDim.x, "first");
    float* second = layout.take<float>(blockDim.x, "second");
    second[threadIdx.x] = 2.0f;
    first[threadIdx.x + reach] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = first[threadIdx.x] + second[threadIdx.x];
}

// A float4 read over the end of `first`, blockDim.x + 2 floats: thread 0 reads the 4 floats from
// first[blockDim.x - 4 + 4 * reach], so with reach 1 it starts 2 floats before the end and runs 8
// bytes past it.
__global__ void vector_runs_past_first(float* out, int reach) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* first = layout.take<float>(blockDim.x + 2, "first");
    first[threadIdx.x] = 1.0f;
    if (threadIdx.x < 2) first[blockDim.x + threadIdx.x] = 1.0f;
    __syncthreads();
    const unsigned start = threadIdx.x == 0 ? blockDim.x - 4 + 4 * reach : 0;
    const float4 v = *reinterpret_cast<const float4*>(&first[start]);
    out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

// Reads `second` from `reach` before each thread's slot: thread 0 at reach 1 reads second[-1],
// the last float of `first` on a GPU.
__global__ void read_before_second(float* out, int reach) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* first = layout.take<float>(blockDim.x, "first");
    float* second = layout.take<float>(blockDim.x, "second");
    first[threadIdx.x] = 1.0f;
    second[threadIdx.x] = 2.0f;
    __syncthreads();
    out[threadIdx.x] = second[(int)threadIdx.x - reach];
}

// A tile of blockDim.x + extra floats: past the launch's 4 * blockDim.x bytes when extra > 0.
__global__ void tile_past_the_launch(float* out, int extra) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* tile = layout.take<float>(blockDim.x + extra, "tile");
    tile[threadIdx.x] = 1.0f;
    out[threadIdx.x] = tile[threadIdx.x];
}

// Two phases over the same bytes: `values` and `weights` (blockDim.x floats each), then, after a
// barrier, `sums` over both (2 blockDim.x floats), written at `reach` past each thread's slot of
// its second half: at reach 0 the last thread writes the last float, at 1 one past the end.
__global__ void two_phases(float* out, int reach) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n = blockDim.x, t = threadIdx.x;
    cupykv::SharedLayout loop_memory(smem);
    float* values = loop_memory.take<float>(n, "values");
    float* weights = loop_memory.take<float>(n, "weights");
    values[t] = (float)t;
    weights[t] = 2.0f;
    __syncthreads();
    const float product = values[(t + 1) % n] * weights[t];
    __syncthreads();
    cupykv::SharedLayout merge_memory(smem);
    float* sums = merge_memory.take<float>(2 * n, "sums");
    sums[t] = product;
    sums[n + t + reach] = 1.0f;
    __syncthreads();
    out[t] = sums[n - 1 - t] + sums[n + t];
}

// A pointer of the first phase used after the second began: weights[t] is sums[n + t] on a GPU.
__global__ void stale_pointer(float* out, int n_unused) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n = blockDim.x, t = threadIdx.x;
    cupykv::SharedLayout loop_memory(smem);
    float* values = loop_memory.take<float>(n, "values");
    float* weights = loop_memory.take<float>(n, "weights");
    values[t] = 1.0f;
    weights[t] = 2.0f;
    __syncthreads();
    cupykv::SharedLayout merge_memory(smem);
    float* sums = merge_memory.take<float>(2 * n, "sums");
    sums[t] = values[t];
    weights[t] = 3.0f;
    __syncthreads();
    out[t] = sums[t] + (float)n_unused;
}

// Threads that take different arrays: warp 0 a tile of 2 blockDim.x floats, the others blockDim.x.
__global__ void disagreeing_threads(float* out, int n_unused) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* tile = layout.take<float>(threadIdx.x < 32 ? 2 * blockDim.x : blockDim.x, "tile");
    tile[threadIdx.x] = 1.0f;
    out[threadIdx.x] = tile[threadIdx.x] + (float)n_unused;
}

// An array of floats after 3 bytes of flags: not 4-byte aligned.
__global__ void misaligned_array(float* out, int n_unused) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    unsigned char* flags = layout.take<unsigned char>(3, "flags");
    float* values = layout.take<float>(blockDim.x, "values");
    if (threadIdx.x < 3) flags[threadIdx.x] = 1;
    values[threadIdx.x] = 1.0f;
    out[threadIdx.x] = values[threadIdx.x] + (float)n_unused;
}

// Uses the dynamic shared memory raw, without a layout: each thread writes the float `reach` past its
// own, the last thread one past the launch's 4 * blockDim.x bytes at reach 1.
__global__ void raw_before_layout(float* out, int reach) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* raw = reinterpret_cast<float*>(smem);
    raw[threadIdx.x + reach] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = raw[threadIdx.x];
}

// Block b takes a tile of (b + 1) * blockDim.x floats and writes its own slice of it: each block carves
// its layout anew, whatever the blocks before it took.
__global__ void tile_per_block(float* out, int n_unused) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* tile = layout.take<float>((blockIdx.x + 1) * blockDim.x, "tile");
    const unsigned slot = blockIdx.x * blockDim.x + threadIdx.x;
    tile[slot] = (float)blockIdx.x;
    out[slot] = tile[slot] + (float)n_unused;
}

// A layout that starts 16 bytes into the dynamic shared memory at shift 1: the emulator places a
// layout's arrays from the extern __shared__ array's own start, and refuses any other base.
__global__ void layout_past_the_base(float* out, int shift) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem + 16 * shift);
    float* tile = layout.take<float>(blockDim.x, "tile");
    tile[threadIdx.x] = 1.0f;
    out[threadIdx.x] = tile[threadIdx.x];
}

// Eight arrays of blockDim.x floats, nine at extra 1: more than a layout may hold
// (CUEMU_SHARED_ARRAYS_MAX). Each thread uses the last one.
__global__ void nine_arrays(float* out, int extra) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* last = nullptr;
    for (int i = 0; i < 8 + extra; ++i) last = layout.take<float>(blockDim.x, "slice");
    last[threadIdx.x] = 1.0f;
    out[threadIdx.x] = last[threadIdx.x];
}

// Threads 0 and 1 write different values to totals[1] with nothing between them: a race.
__global__ void race_on_array(float* out, int n_unused) {
    extern __shared__ __align__(16) unsigned char smem[];
    cupykv::SharedLayout layout(smem);
    float* scratch = layout.take<float>(blockDim.x, "scratch");
    float* totals = layout.take<float>(4, "totals");
    scratch[threadIdx.x] = 1.0f;
    if (threadIdx.x == 0) totals[1] = 0.0f;
    __syncthreads();
    if (threadIdx.x < 2) totals[1] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = totals[1] + scratch[threadIdx.x] + (float)n_unused;
}
