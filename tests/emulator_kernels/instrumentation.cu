// instrumentation.cu: kernels for the emulator's instrumentation (tests/test_instrumentation.py).
// Each memory access of a kernel calls a hook of the emulator (GCC's ThreadSanitizer pass, see
// cupykv/backends/emulator/access.cpp): the load and the store of a read-modify-write each get
// their own call, and every size and alignment has a hook. The same file must also compile with
// NVRTC (sm_80, C++17).
#include <cuda_fp16.h>

// Every thread adds 1 to out[0]: with atomic = 0 a plain read-modify-write, a data race (each
// thread's load and store against the other threads' stores); with atomic = 1 atomicAdd, none.
// out: [1] int.
extern "C" __global__ void add_one(int* out, int atomic) {
    if (atomic)
        atomicAdd(&out[0], 1);
    else
        out[0] += 1;
}

// Every thread adds 1 to out[0] and to both halves of pair[0] with the __half and __half2
// atomicAdd. out: [1] __half; pair: [1] __half2.
extern "C" __global__ void add_one_half(__half* out, __half2* pair) {
    atomicAdd(out, __float2half(1.0f));
    atomicAdd(pair, __floats2half2_rn(1.0f, 2.0f));
}

// lengths[b] = lengths[b] + n for b < batch, a thread per sequence (kernels/advance.cu's update
// without its cap): one 4-byte load and one 4-byte store per sequence. lengths: [batch] int.
extern "C" __global__ void grow(int* lengths, int n, int batch) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < batch) lengths[b] = lengths[b] + n;
}

// Thread 0 of every block copies its block's 16-byte row of `rows` to out[0]: a write-after-write
// race between blocks, benign only when every row holds the same value. g++ instruments the store
// of this copy before its load (rows is watched: a writable argument). rows: [gridDim.x] uint4.
extern "C" __global__ void copy_row(uint4* rows, uint4* out) {
    if (threadIdx.x == 0) out[0] = rows[blockIdx.x];
}

// One thread copies element 0 of each inN to outN, each copy one load and one store of its kind:
// 1, 2, 4, 8 and 16 bytes (uint4); 12 bytes (float3: a size that is no power of two); 4 bytes at
// byte offset 1 of `unaligned_in` / `unaligned_out` (less aligned than its size); and
// `copy_bytes` bytes by a memcpy whose length only the launch knows (a library call).
extern "C" __global__ void every_access(const unsigned char* __restrict__ in1, unsigned char* __restrict__ out1,
                                        const unsigned short* __restrict__ in2, unsigned short* __restrict__ out2,
                                        const unsigned* __restrict__ in4, unsigned* __restrict__ out4,
                                        const unsigned long long* __restrict__ in8,
                                        unsigned long long* __restrict__ out8, const uint4* __restrict__ in16,
                                        uint4* __restrict__ out16, const float3* __restrict__ in12,
                                        float3* __restrict__ out12, const unsigned char* __restrict__ unaligned_in,
                                        unsigned char* __restrict__ unaligned_out,
                                        const unsigned char* __restrict__ copy_in,
                                        unsigned char* __restrict__ copy_out, int copy_bytes) {
    out1[0] = in1[0];
    out2[0] = in2[0];
    out4[0] = in4[0];
    out8[0] = in8[0];
    out16[0] = in16[0];
    out12[0] = in12[0];
    unsigned word;
    memcpy(&word, unaligned_in + 1, 4);
    memcpy(unaligned_out + 1, &word, 4);
    memcpy(copy_out, copy_in, copy_bytes);
}
