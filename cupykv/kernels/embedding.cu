// embedding.cu: gather rows of an embedding table at device-resident token ids.
//
// Computes, for every row r:
//     0 <= ids[r] < vocab: out[r, :] = table[ids[r], :]   (bit for bit)
//     otherwise:           out[r, :] = 0 and error_flag[0] = 1
// Out-of-range ids are not clamped (that would silently embed the wrong
// token); the flag is sticky, the caller clears it.
//
// Launch geometry: grid (rows), block (128); a block copies one row of
// `hidden` elements, in 16-byte words when the row size is a multiple of 16
// bytes and table and out are 16-byte aligned, else element by element. Any
// block size >= 1 works; 128 is what the host uses.
//
// Device-resident arguments: ids [rows] int32 (read: the next token of a
// captured decode step, e.g. written by argmax), table (read), out (written),
// error_flag [1] int32 (set to 1 on a bad id), run_if [1] int32 (read first: 0
// makes the launch return at once, reading nothing else and writing nothing;
// common.cuh). vocab and hidden are fixed per launch.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(1024) cupykv_embedding(
    T* __restrict__ out,               // [rows, hidden]
    const T* __restrict__ table,       // [vocab, hidden]
    const int* __restrict__ ids,       // [rows], device-resident
    int* __restrict__ error_flag,      // [1], device-resident, set to 1 on an id out of range
    int vocab, int hidden,
    const int* __restrict__ run_if) {  // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    const int r = blockIdx.x;
    const int id = ids[r];
    const bool valid = id >= 0 && id < vocab;
    if (!valid && threadIdx.x == 0) *error_flag = 1;
    T* dst = out + (long long)r * hidden;
    const T* src = table + (long long)(valid ? id : 0) * hidden;
    constexpr int kVec = 16 / (int)sizeof(T);
    const bool vector_copy = hidden % kVec == 0 &&
                             (reinterpret_cast<unsigned long long>(out) % 16) == 0 &&
                             (reinterpret_cast<unsigned long long>(table) % 16) == 0;
    if (vector_copy) {
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (int v = threadIdx.x; v < hidden / kVec; v += blockDim.x)
            reinterpret_cast<uint4*>(dst)[v] = valid ? reinterpret_cast<const uint4*>(src)[v] : zero;
    } else {
        for (int e = threadIdx.x; e < hidden; e += blockDim.x)
            dst[e] = valid ? src[e] : cupykv::from_float<T>(0.0f);
    }
}
