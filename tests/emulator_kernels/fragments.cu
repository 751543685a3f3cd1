// fragments.cu: kernels for the emulator's tensor-core fragment instructions
// (tests/test_fragments.py), through the wrappers of cupykv/kernels/mma.cuh. The tests build the
// per-lane fragments from the PTX ISA tables in NumPy; these kernels only move registers. They
// compile with NVRTC for sm_80 and sm_90 too.
#include "async_copy.cuh"
#include "mma.cuh"

using namespace cupykv;

// One mma per warp from per-thread registers: a [threads][4], b [threads][2], c [threads][4]
// (floats), d [threads][4]. mode: 0 every lane at one call; 1 lanes 16-31 call from another
// line (divergent); 2 lane 31 exits first.
template <typename T>
__global__ void mma_lanes(const unsigned* __restrict__ a, const unsigned* __restrict__ b, const float* __restrict__ c,
                          float* __restrict__ d, int mode) {
    const int t = threadIdx.x, lane = t % 32;
    if (mode == 2 && lane == 31) return;
    const unsigned ra[4] = {a[4 * t], a[4 * t + 1], a[4 * t + 2], a[4 * t + 3]};
    const unsigned rb[2] = {b[2 * t], b[2 * t + 1]};
    const float rc[4] = {c[4 * t], c[4 * t + 1], c[4 * t + 2], c[4 * t + 3]};
    float rd[4];
    if (mode == 1 && lane >= 16)
        mma_m16n8k16<T>(rd, ra, rb, rc);
    else
        mma_m16n8k16<T>(rd, ra, rb, rc);
    for (int i = 0; i < 4; ++i) d[4 * t + i] = rd[i];
}

// ldmatrix of MATRICES 8x8 matrices (transposed when TRANS) from a shared copy of `tile`
// (`elements` 16-bit values, a multiple of 8): lane l passes the row address tile + offsets[l]
// (in elements). out: [threads][4]. mode: 0 plain stores, __syncthreads(); 1 plain stores, no
// synchronisation; 2 the row addresses point into global memory; 3 plain stores, __syncwarp();
// 4 cp.async fill, ldmatrix before the wait; 5 cp.async fill, wait, __syncthreads().
template <int MATRICES, bool TRANS>
__global__ void ldmatrix_lanes(const unsigned short* __restrict__ tile, int elements, const int* __restrict__ offsets,
                               unsigned* __restrict__ out, int mode) {
    extern __shared__ __align__(16) unsigned short smem_tile[];
    const int t = threadIdx.x;
    if (mode == 4 || mode == 5) {
        for (int i = 8 * t; i < elements; i += 8 * blockDim.x) cp_async_16(smem_tile + i, tile + i);
        if (mode == 5) cp_async_wait_all();
    } else {
        for (int i = t; i < elements; i += blockDim.x) smem_tile[i] = tile[i];
    }
    if (mode == 0 || mode == 5) __syncthreads();
    if (mode == 3) __syncwarp();
    const void* row = mode == 2 ? (const void*)(tile + offsets[t]) : (const void*)(smem_tile + offsets[t]);
    unsigned r[MATRICES];
    ldmatrix<MATRICES, TRANS>(r, row);
    for (int m = 0; m < MATRICES; ++m) out[4 * t + m] = r[m];
    if (mode == 4) cp_async_wait_all();
}

// The three fragment loads of an attention tile, end to end for one warp: S = X K^T and
// O = X V with X [16][16], K [8][16] (keys x dims), V [16][8] (keys x dims), T elements,
// row-major. The tiles reach static shared memory by cp.async, the fragments come from
// ldmatrix with the addresses mma.cuh documents. s, o: [16][8] floats.
template <typename T>
__global__ void tile_products(const T* __restrict__ x, const T* __restrict__ k, const T* __restrict__ v,
                              float* __restrict__ s, float* __restrict__ o) {
    __shared__ __align__(16) T xs[16 * 16];
    __shared__ __align__(16) T ks[8 * 16];
    __shared__ __align__(16) T vs[16 * 8];
    const int lane = threadIdx.x;
    cp_async_16(xs + 8 * lane, x + 8 * lane);   // 8 elements = 16 bytes per copy
    if (lane < 16) {
        cp_async_16(ks + 8 * lane, k + 8 * lane);
        cp_async_16(vs + 8 * lane, v + 8 * lane);
    }
    cp_async_wait_all();
    __syncwarp();
    unsigned a[4], b_keys[2], b_values[2];
    ldmatrix_x4(a, xs + (lane % 16) * 16 + (lane / 16) * 8);
    ldmatrix_x2(b_keys, ks + (lane % 8) * 16 + (lane / 8 % 2) * 8);
    ldmatrix_x2_trans(b_values, vs + (lane % 16) * 8);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float scores[4], values[4];
    mma_m16n8k16<T>(scores, a, b_keys, zero);
    mma_m16n8k16<T>(values, a, b_values, zero);
    const int group = lane / 4, pair = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? group : group + 8, col = 2 * pair + (i & 1);
        s[row * 8 + col] = scores[i];
        o[row * 8 + col] = values[i];
    }
}

// The operand order of mma.cuh's inline PTX, read from the PTX itself (the emulator never runs
// it): each input register holds its own constant and each output is stored to its own slot of
// out, so a swapped, repeated or misnumbered operand shows as a constant or a store in the wrong
// place. Not launched; NVRTC only.
template <typename T>
__global__ void mma_operand_order(float* __restrict__ out) {
    const unsigned a[4] = {0xA0A0u, 0xA1A1u, 0xA2A2u, 0xA3A3u};
    const unsigned b[2] = {0xB0B0u, 0xB1B1u};
    const float c[4] = {0.5f, 1.5f, 2.5f, 3.5f};
    float d[4];
    mma_m16n8k16<T>(d, a, b, c);
    for (int i = 0; i < 4; ++i) out[i] = d[i];
}

template <int MATRICES, bool TRANS>
__global__ void ldmatrix_operand_order(unsigned* __restrict__ out) {
    __shared__ __align__(16) unsigned short rows[4 * 8 * 8];
    unsigned r[MATRICES];
    ldmatrix<MATRICES, TRANS>(r, rows + 8 * (threadIdx.x % 32));
    for (int m = 0; m < MATRICES; ++m) out[m] = r[m];
}
