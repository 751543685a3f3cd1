// async_copy.cuh: asynchronous global -> shared memory copies (cp.async, sm_80 and later).
//
// One wrapper per PTX instruction, each with two bodies: inline PTX on the GPU, and cupykv's
// CPU emulator (CUPYKV_EMULATOR), which completes a copy only at the wait that covers it and
// fails loudly (AsyncCopyError, naming both call sites) when anything touches its destination
// before then. Kernels use these wrappers and never write cp.async themselves.
//
//   cp_async<BYTES>(dst, src, src_bytes)   start copying BYTES (4, 8 or 16) bytes from global
//                                          `src` to shared `dst`; only the first src_bytes
//                                          (0..BYTES) are read, the rest of dst is zero-filled
//                                          (the boundary of a tile: pass 0 past the live rows)
//   cp_async_16(dst, src, src_bytes = 16)  the 16-byte form, cached in L2 only (.cg): K/V tiles
//   cp_async_commit()                      close this thread's copies since the last commit into
//                                          a group (an empty group when there were none)
//   cp_async_wait<N>()                     wait until at most the N most recent groups of this
//                                          thread are pending: all older ones have landed
//   cp_async_wait_all()                    commit, then wait for every group
//
// Semantics (PTX ISA, "Data Movement and Conversion Instructions: cp.async", "cp.async.commit_group",
// "cp.async.wait_group / cp.async.wait_all"): groups are per thread, and a wait makes the copies
// visible to the issuing thread only; other threads read them after a __syncthreads() that
// follows every issuing thread's wait. Both addresses must be aligned to BYTES, dst must be
// shared memory and src global memory; two pending copies must not write the same bytes. A
// src_bytes above BYTES is undefined on the GPU (an error on the emulator). 4- and 8-byte copies
// use .ca (cached in L1 too), the only mode PTX allows for them.
//
// Two-stage use (one thread's view):
//     cp_async_16(stage[0] + i, k + ...);  cp_async_commit();        // tile 0 in flight
//     for (t = 0; t < tiles; ++t) {
//         if (t + 1 < tiles) cp_async_16(stage[(t + 1) % 2] + i, k + ...);
//         cp_async_commit();                                         // tile t + 1 (maybe empty)
//         cp_async_wait<1>();                                        // tile t landed (this thread)
//         __syncthreads();                                           // ... and every thread's
//         compute(stage[t % 2]);
//         __syncthreads();                                           // before stage t % 2 is refilled
//     }
#pragma once

namespace cupykv {

template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#ifdef CUPYKV_EMULATOR
    cuemu_cp_async(dst, src, BYTES, (unsigned)src_bytes);
#else
    const unsigned dst_shared = (unsigned)__cvta_generic_to_shared(dst);
    if constexpr (BYTES == 16) {
        asm volatile("{\n\t.reg .u64 src_global;\n\tcvta.to.global.u64 src_global, %1;\n\t"
                     "cp.async.cg.shared.global [%0], [src_global], 16, %2;\n}\n"
                     :: "r"(dst_shared), "l"(src), "r"(src_bytes) : "memory");
    } else {
        asm volatile("{\n\t.reg .u64 src_global;\n\tcvta.to.global.u64 src_global, %1;\n\t"
                     "cp.async.ca.shared.global [%0], [src_global], %2, %3;\n}\n"
                     :: "r"(dst_shared), "l"(src), "n"(BYTES), "r"(src_bytes) : "memory");
    }
#endif
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes = 16) {
    cp_async<16>(dst, src, src_bytes);
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef CUPYKV_EMULATOR
    cuemu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(N >= 0, "cp.async.wait_group takes a count of groups left pending");
#ifdef CUPYKV_EMULATOR
    cuemu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#ifdef CUPYKV_EMULATOR
    cuemu_cp_async_wait_all();
#else
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace cupykv
