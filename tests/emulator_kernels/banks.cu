// banks.cu: kernels whose shared-memory bank wavefronts are known, for the emulator's bank
// counter (tests/test_banks.py; the model is in cupykv/backends/emulator/banks.cpp). Each
// comment says what one warp request takes. They compile with NVRTC for sm_80 and sm_90 too.
#include "async_copy.cuh"
#include "mma.cuh"

using namespace cupykv;

// One warp. Lane l stores tile[l * stride] and, after __syncwarp(), loads it back (4-byte words,
// dynamic shared memory of 32 * stride + 1 floats): the store and the load each take `stride`
// wavefronts for stride 1, 2, 4, ..., 32 (lanes l and l + 32 / stride share a bank), 1 for an
// odd stride (33: the padded transpose) and 1 for stride 0 (one word, every lane writing 0 there:
// one write, then a broadcast).
__global__ void strided_words(float* __restrict__ out, int stride) {
    extern __shared__ float tile[];
    const int lane = threadIdx.x;
    tile[lane * stride] = (float)(stride ? lane : 0);
    __syncwarp();
    out[lane] = tile[lane * stride];
}

// strided_words over a static __shared__ array (stride 0 to 2): the same wavefronts.
__global__ void static_strided_words(float* __restrict__ out, int stride) {
    __shared__ float tile[2 * 32 + 1];
    const int lane = threadIdx.x;
    tile[lane * stride] = (float)(stride ? lane : 0);
    __syncwarp();
    out[lane] = tile[lane * stride];
}

// One warp. Lane l loads the 16-byte vector vectors[l * stride] (dynamic shared memory of
// 32 * stride uint4, zeroed first by the same lane): four phases of 8 lanes, each one wavefront
// for stride 1 (128 contiguous bytes), two for stride 2, eight for stride 8 (every lane of a
// phase in the same four banks).
__global__ void strided_vectors(uint4* __restrict__ out, int stride) {
    extern __shared__ uint4 vectors[];
    const int lane = threadIdx.x;
    vectors[lane * stride] = make_uint4(lane, lane, lane, lane);
    __syncwarp();
    out[lane] = vectors[lane * stride];
}

// One warp. Lane l loads the 8-byte pair pairs[l * stride]: two phases of 16 lanes, each one
// wavefront for stride 1 and two for stride 2.
__global__ void strided_pairs(uint2* __restrict__ out, int stride) {
    extern __shared__ uint2 pairs[];
    const int lane = threadIdx.x;
    pairs[lane * stride] = make_uint2(lane, lane);
    __syncwarp();
    out[lane] = pairs[lane * stride];
}

// One warp. ldmatrix_x4 of a 16 x 16 tile of 16-bit values whose rows lie row_stride elements
// apart (dynamic shared memory of 16 * row_stride elements, zeroed by the warp first): each 8x8
// matrix is one phase of 8 rows of 16 bytes. Rows 128 bytes apart (row_stride 64) all fall in the
// same four banks, eight wavefronts a matrix; padded by 16 bytes (row_stride 72), one.
__global__ void ldmatrix_rows(unsigned* __restrict__ out, int row_stride) {
    extern __shared__ __align__(16) unsigned short rows[];
    const int lane = threadIdx.x;
    for (int i = lane; i < 16 * row_stride; i += 32) rows[i] = (unsigned short)i;
    __syncwarp();
    unsigned r[4];
    ldmatrix_x4(r, rows + (lane % 16) * row_stride + (lane / 16) * 8);
    for (int k = 0; k < 4; ++k) out[4 * lane + k] = r[k];
}

// One warp. Lane l copies 16 bytes of src into stage[l * stride] (uint4 units) with cp.async,
// waits, and copies them out: the copy's shared-memory write counts at its issue (four phases,
// each one wavefront for stride 1, eight for stride 8) and not where it lands.
__global__ void async_stage(const uint4* __restrict__ src, uint4* __restrict__ out, int stride) {
    extern __shared__ __align__(16) uint4 stage[];
    const int lane = threadIdx.x;
    cp_async_16(stage + lane * stride, src + lane);
    cp_async_commit();
    cp_async_wait<0>();
    out[lane] = stage[lane * stride];
}

// One warp. Lane l adds the float4 quads[l * stride] up, component by component (nvcc copies it with
// one 16-byte load, and so does g++ under build.py's -fno-tree-sra, which would otherwise make four
// 4-byte loads): four phases, one wavefront each at stride 1, eight at stride 8. Dynamic shared
// memory of 32 * stride float4.
__global__ void vector_components(float* __restrict__ out, int stride) {
    extern __shared__ __align__(16) float4 quads[];
    const int lane = threadIdx.x;
    quads[lane * stride] = make_float4(lane, 1.0f, 2.0f, 3.0f);
    __syncwarp();
    const float4 q = quads[lane * stride];
    out[lane] = q.x + q.y + q.z + q.w;
}

// One warp. Lane l adds words[2 l + first] and words[2 l + first + 1] (first = 0 or 1; dynamic shared
// memory of 66 floats, written by the warp first). With first 0 the two 4-byte loads are one aligned
// 8-byte piece: two phases of 16 lanes, one wavefront each. With first 1 they are not, and count as
// two 4-byte requests, each 2-way (lanes l and l + 16 read words 32 apart): 4 wavefronts, ideal 2.
__global__ void adjacent_words(float* __restrict__ out, int first) {
    extern __shared__ float words[];
    const int lane = threadIdx.x;
    for (int i = lane; i < 66; i += 32) words[i] = (float)i;
    __syncwarp();
    out[lane] = words[2 * lane + first] + words[2 * lane + first + 1];
}

// One warp. Lane l reads the 16-byte vector vectors[(l % 8) * 8 + l / 8] (dynamic shared memory of 64
// uint4, each lane writing its own first): quarter-warp q reads eight vectors 128 bytes apart in banks
// 4q .. 4q + 3, so each phase of 8 lanes takes 8 wavefronts: 32 in all, against an ideal of 4. (Were
// the phases half-warps the quarters would share them, 16; were the request one phase, 8.)
__global__ void quarter_warp_columns(uint4* __restrict__ out) {
    extern __shared__ uint4 vectors[];
    const int lane = threadIdx.x, at = (lane % 8) * 8 + lane / 8;
    vectors[at] = make_uint4(lane, lane, lane, lane);
    __syncwarp();
    out[lane] = vectors[at];
}

// One warp. Lane l stores the four words quad_words[4 l stride + first + k], k = 0..3, one 4-byte store
// a line, then loads them back the same way (first = 0 or 2; dynamic shared memory of
// 4 (31 stride + 1) + first floats). Stores that follow one another over one aligned 16-byte
// piece are one vector store, as nvcc emits them, counted at the first store's line: with first 0,
// four phases of 8 lanes, 1 wavefront each at stride 1, 8 at stride 8 (every lane's quad in banks
// 0-3). With first 2 the quad is two aligned 8-byte pieces, two vector accesses at two lines.
__global__ void scalar_quads(float* __restrict__ out, int stride, int first) {
    extern __shared__ float quad_words[];
    const int lane = threadIdx.x;
    float* quad = quad_words + 4 * lane * stride + first;
    quad[0] = (float)lane;  // the quad's first store
    quad[1] = (float)(2 * lane);
    quad[2] = (float)(3 * lane);  // the third store
    quad[3] = (float)(4 * lane);
    __syncwarp();
    out[lane] = quad[0] + quad[1] + quad[2] + quad[3];
}

// One warp. Lane l stores pair_words[2 l], waits at a barrier (__syncwarp(), or __syncthreads() when
// block_barrier is nonzero), then stores pair_words[2 l + 1] (dynamic shared memory of 64 floats). The
// barrier orders the two stores, so no compiler joins them into one 8-byte store: each is its own
// request of 4-byte words, 2 wavefronts (lanes l and l + 16 meet in a bank), ideal 1. The loads after
// are one aligned 8-byte piece: two phases of 16 lanes, 1 wavefront each.
__global__ void stores_split_by_a_barrier(float* __restrict__ out, int block_barrier) {
    extern __shared__ float pair_words[];
    const int lane = threadIdx.x;
    pair_words[2 * lane] = (float)lane;  // the store before the barrier
    if (block_barrier) __syncthreads(); else __syncwarp();
    pair_words[2 * lane + 1] = (float)(2 * lane);  // the store after the barrier
    __syncwarp();
    out[lane] = pair_words[2 * lane] + pair_words[2 * lane + 1];
}

// One warp. Lane l zeroes counts[2 l] and counts[2 l + 1], then adds 1 to each with atomicAdd: two
// atomic requests of 4-byte words, 2 wavefronts each (lanes l and l + 16 meet in a bank), never
// joined into one 8-byte access as adjacent loads or stores are.
__global__ void shared_atomics(int* __restrict__ out) {
    extern __shared__ int counts[];
    const int lane = threadIdx.x;
    counts[2 * lane] = 0;
    counts[2 * lane + 1] = 0;
    __syncwarp();
    atomicAdd(&counts[2 * lane], 1);  // the even word's atomic
    atomicAdd(&counts[2 * lane + 1], 2);  // the odd word's atomic
    __syncwarp();
    out[lane] = counts[2 * lane] + counts[2 * lane + 1];
}

// One warp. Lane l writes words[l], then copies it to words[32 + l] with memcpy of nbytes (4; an
// argument, so that the copy stays a library call): one line that loads and stores shared memory,
// counted as one load request and one store request, each 1 wavefront.
__global__ void shared_copy(float* __restrict__ out, int nbytes) {
    extern __shared__ float words[];
    const int lane = threadIdx.x;
    words[lane] = (float)lane;
    __syncwarp();
    memcpy(&words[32 + lane], &words[lane], nbytes);  // the shared-to-shared copy
    __syncwarp();
    out[lane] = words[32 + lane];
}
