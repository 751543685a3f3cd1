// async_copy.cu: kernels for the emulator's cp.async checks (tests/test_async_copy.py), through
// the wrappers of cupykv/kernels/async_copy.cuh. Each kernel has a switch between correct code and
// a planted misuse that the emulator must report. They compile with NVRTC for sm_80 and sm_90 too.
#include "async_copy.cuh"

using namespace cupykv;

// Thread t copies floats [BYTES/4 * t, BYTES/4 * (t + 1)) of src (n floats) into a static shared
// tile with one cp.async, reading only the live bytes (zero-fill past n), waits, and after a
// barrier writes the tile shifted by one thread's piece (so every value crosses threads).
// out: [blockDim.x * BYTES / 4] floats; blockDim.x <= 64.
// mode: 0 correct; 1 reads its own piece before the wait; 2 no barrier after the wait;
//       3 asks for all BYTES bytes even past n (reads past the end of src when n is not a
//       multiple); 4 writes its own piece before the wait; 5 misaligned destination;
//       6 src_bytes above BYTES; 7 destination in global memory; 8 a second copy into the
//       same bytes while the first is pending; 9 exits without waiting; 10 misaligned source;
//       11 the barrier before the wait instead of after it (every thread but the last then
//       reads the last thread's piece: landed, but unordered with the read).
template <int BYTES>
__global__ void async_roundtrip(const float* __restrict__ src, float* __restrict__ out, int n, int mode) {
    __shared__ __align__(16) float tile[64 * 4];
    constexpr int kFloats = BYTES / 4;
    const int t = threadIdx.x, first = t * kFloats;
    const int live = n - first < 0 ? 0 : (n - first > kFloats ? kFloats : n - first);
    const int src_bytes = mode == 3 ? BYTES : mode == 6 ? BYTES + 4 : live * 4;
    float* dst = mode == 5 ? tile + first + 1 : mode == 7 ? out + first : tile + first;
    const float* from_src = mode == 10 ? src + first + 1 : src + first;
    cp_async<BYTES>(dst, from_src, src_bytes);
    if (mode == 8) cp_async<BYTES>(tile + first, src + first, src_bytes);
    cp_async_commit();
    if (mode == 1) out[first] = tile[first];
    if (mode == 4) tile[first] = 1.0f;
    if (mode == 9) return;
    if (mode == 11) {
        __syncthreads();
        cp_async_wait<0>();   // mode 11: the copy lands here, after the barrier
        if (t != (int)blockDim.x - 1) out[first] = tile[(blockDim.x - 1) * kFloats];
        return;
    }
    cp_async_wait<0>();
    if (mode != 2) __syncthreads();
    const int from = (first + kFloats) % (blockDim.x * kFloats);
    for (int k = 0; k < kFloats; ++k) out[first + k] = tile[(from + k) % (blockDim.x * kFloats)];
}

// A two-stage pipeline over `tiles` tiles of blockDim.x * 4 floats of src, through dynamic shared
// memory [2][blockDim.x * 4]: tile i + 1 is in flight while tile i is read. Each thread writes
// element (4 t + 5) % width of each tile (copied by another thread): out[i][t] = 2 x that.
// mode: 0 correct; 1 waits with wait<2> (tile i may still be in flight); 2 no barrier after the
//       wait; 3 no barrier before a stage is refilled.
__global__ void async_pipeline(const float* __restrict__ src, float* __restrict__ out, int tiles, int mode) {
    extern __shared__ __align__(16) float stages[];
    const int t = threadIdx.x, width = blockDim.x * 4;
    cp_async_16(stages + 4 * t, src + 4 * t);
    cp_async_commit();
    for (int i = 0; i < tiles; ++i) {
        if (i + 1 < tiles)
            cp_async_16(stages + ((i + 1) % 2) * width + 4 * t, src + (long long)(i + 1) * width + 4 * t);
        cp_async_commit();
        if (mode == 1) cp_async_wait<2>();
        else cp_async_wait<1>();
        if (mode != 2) __syncthreads();
        out[(long long)i * blockDim.x + t] = 2.0f * stages[(i % 2) * width + (4 * t + 5) % width];
        if (mode != 3) __syncthreads();
    }
    cp_async_wait_all();
}

// Group accounting: thread t issues one 16-byte copy per group g < n_groups into its slot g
// (none for the groups in empty_mask), one more uncommitted copy into slot n_groups when
// `uncommitted`, then waits with wait_group `wait_n` (0..3; -1: wait_all) and reads slot `probe`.
// Slots: dynamic shared memory [blockDim.x][n_groups + 1][4] floats. out: [blockDim.x] floats;
// src: [(n_groups + 1) * 4] floats.
__global__ void async_groups(const float* __restrict__ src, float* __restrict__ out, int n_groups, int empty_mask,
                             int uncommitted, int wait_n, int probe) {
    extern __shared__ __align__(16) float slots[];
    float* mine = slots + threadIdx.x * (n_groups + 1) * 4;
    for (int g = 0; g < n_groups; ++g) {
        if (!(empty_mask >> g & 1)) cp_async_16(mine + 4 * g, src + 4 * g);
        cp_async_commit();
    }
    if (uncommitted) cp_async_16(mine + 4 * n_groups, src + 4 * n_groups);
    switch (wait_n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        default: cp_async_wait_all(); break;
    }
    out[threadIdx.x] = mine[4 * probe];
    cp_async_wait_all();
}

// One thread copies 16 bytes of src into shared memory and stores what it reads there before the
// wait (out[0..3], a planted misuse) and after it (out[4..7]). An instrumented module stops at the
// early read (AsyncCopyError); an uninstrumented one reads the launch's poison there.
__global__ void async_early_read(const float* __restrict__ src, float* __restrict__ out) {
    __shared__ __align__(16) float tile[4];
    cp_async_16(tile, src);
    cp_async_commit();
    for (int k = 0; k < 4; ++k) out[k] = tile[k];
    cp_async_wait<0>();
    for (int k = 0; k < 4; ++k) out[4 + k] = tile[k];
}

// One thread copies 16 bytes of src into shared memory and reads one of them, byte `at`, before
// the wait (a planted misuse): every byte of a pending copy is pending, its first and last too.
// out: [1] int.
__global__ void async_early_byte(const float* __restrict__ src, int* __restrict__ out, int at) {
    __shared__ __align__(16) unsigned char bytes[16];
    cp_async_16(bytes, src);
    cp_async_commit();
    out[0] = bytes[at];
    cp_async_wait<0>();
}

// One thread copies 16 bytes of src to byte 16 of a 20-byte shared array: static (`dynamic` 0) or
// dynamic shared memory of 20 bytes (`dynamic` 1). The copy starts inside the array, aligned, and
// runs 12 bytes past its end (a planted misuse).
__global__ void async_past_the_end(const float* __restrict__ src, int dynamic) {
    __shared__ __align__(16) float five[5];
    extern __shared__ __align__(16) float five_dynamic[];
    cp_async_16((dynamic ? five_dynamic : five) + 4, src);
    cp_async_wait_all();
}
