// traffic.cu: kernels whose memory traffic is known, for the emulator's traffic counter
// (tests/test_traffic.py). Each comment says what one warp request touches. The same file
// must also compile with NVRTC (sm_80, C++17).

// Lane i reads x[i * stride] and writes out[i] (float). One warp request of the load touches
// 4 sectors with stride 1 (128 contiguous bytes), 32 with stride 8 (a sector per lane) and
// 1 with stride 0 (every lane reads x[0]).
extern "C" __global__ void strided_copy(const float* __restrict__ x, float* __restrict__ out, int stride,
                                        int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[(long long)i * stride];
}

// Each thread copies one 16-byte vector: 16 sectors per request of a full warp.
extern "C" __global__ void vector_copy(const uint4* __restrict__ x, uint4* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i];
}

// out[c] = sum of rows [0, rows) of m [*, row_len] (one block, a thread per column). With
// rows = live + 1 it reads one row too far: the planted over-read of tests/test_traffic.py.
extern "C" __global__ void sum_rows(const float* __restrict__ m, float* __restrict__ out, int rows,
                                    int row_len) {
  for (int c = threadIdx.x; c < row_len; c += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < rows; ++r) acc += m[(long long)r * row_len + c];
    out[c] = acc;
  }
}

// One warp. Lane l reads x[l] once, and odd lanes read x[32 + l] too, at the same call site
// in a second trip of the loop: two requests (4 sectors, then 4 sectors of 16 lanes).
extern "C" __global__ void uneven_trips(const float* __restrict__ x, float* __restrict__ out) {
  const int lane = threadIdx.x;
  float acc = 0.f;
  for (int k = 0; k <= lane % 2; ++k) acc += x[k * 32 + lane];
  out[lane] = acc;
}

// One warp, two rounds separated by __syncwarp(). Round 0: every lane reads x[lane] and
// lane 0 alone x[32] in a second trip (extra = 1); round 1: every lane reads x[64 + lane].
// Pairing lanes by their visits since the last warp collective gives three requests (4, 1
// and 4 sectors); counting visits over the whole launch would split round 1 between lane 0
// and the others. (`extra` is an argument so that g++ cannot compile lane 0's trips as
// separate code: a call site is an instruction of the host compiler's code.)
extern "C" __global__ void realigned_trips(const float* __restrict__ x, float* __restrict__ out, int extra) {
  const int lane = threadIdx.x;
  float acc = 0.f;
  for (int round = 0; round < 2; ++round) {
    const int trips = round == 0 && lane == 0 ? 1 + extra : 1;
    for (int k = 0; k < trips; ++k) acc += x[round * 64 + k * 32 + lane];
    __syncwarp();
  }
  out[lane] = acc;
}

// Every thread adds 1 to count[0] (atomic) and copies 16 bytes with memcpy.
extern "C" __global__ void count_and_copy(int* __restrict__ count, const float* __restrict__ x,
                                          float* __restrict__ out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(count, 1);
  memcpy(out + 4 * i, x + 4 * i, 16);
}

// Threads 1..7 each load a[t] and b[t] and add them to a[0] and b[0] (atomic): each array of 8 ints
// is loaded at bytes 4..31 and updated atomically at bytes 0..3, so every one of its byte maps
// holds a different set of bytes.
extern "C" __global__ void gather_into_first(int* a, int* b) {
  const int t = threadIdx.x;
  if (t == 0) return;
  atomicAdd(&a[0], a[t]);
  atomicAdd(&b[0], b[t]);
}

// Thread t copies lengths[t] bytes from src + starts[t] to dst + starts[t] with memcpy (a run-time
// size, so one access of that many bytes each, read and written): spans of any length and
// alignment for the counter's byte map and sectors; the spans are disjoint.
extern "C" __global__ void copy_byte_spans(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                           const int* __restrict__ starts, const int* __restrict__ lengths) {
  const int t = threadIdx.x;
  memcpy(dst + starts[t], src + starts[t], lengths[t]);
}

// One thread: bytes[to] = bytes[from], a load and a store of one array of single bytes.
extern "C" __global__ void move_byte(unsigned char* bytes, int from, int to) { bytes[to] = bytes[from]; }

// Two warps, two rounds separated by __syncthreads(). Round 0: thread t reads x[t], and thread 0
// alone x[64] in a second trip (extra = 1); round 1: thread t reads x[128 + t]. The barrier
// realigns the lanes' visits as a warp collective does: requests of 4 and 1 sectors (warp 0)
// and 4 (warp 1) in round 0, 4 and 4 in round 1. Without the realignment, lane 0's round-1
// read would pair with the other lanes' read of round 0's second trip.
extern "C" __global__ void realigned_by_barrier(const float* __restrict__ x, float* __restrict__ out, int extra) {
  const int t = threadIdx.x;
  float acc = 0.f;
  for (int round = 0; round < 2; ++round) {
    const int trips = round == 0 && t == 0 ? 1 + extra : 1;
    for (int k = 0; k < trips; ++k) acc += x[round * 128 + k * 64 + t];
    __syncthreads();
  }
  out[t] = acc;
}

// One warp. Lanes 0-15 meet at __syncwarp(0xffff) (a collective of half the warp), then every
// lane reads x[lane] at one call site. Lanes 0-15 have passed a collective that lanes 16-31
// have not, so the counter makes two requests (2 sectors each) whatever order the threads
// run in (a GPU, reconverged, would issue one of 4 sectors).
extern "C" __global__ void half_warp_collective(const float* __restrict__ x, float* __restrict__ out) {
  const int lane = threadIdx.x;
  if (lane < 16) __syncwarp(0xffffu);
  out[lane] = x[lane];
}

// out[i] = a[i] + b[i] for i < n: a and b may overlap (tests pass one array and its prefix).
extern "C" __global__ void add_pair(const float* a, const float* b, float* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// One warp; each access below is one call site whose lanes touch two places:
//  * lanes 0-15 read a[lane] and lanes 16-31 read b[lane - 16] through one pointer: one load
//    instruction over two arrays, so one request of 2 sectors in each array;
//  * each lane copies nbytes (16; an argument, so that memcpy stays a library call, one site)
//    from buf[4 lane] to buf[128 + 4 lane]: a call that loads and stores buf at one site, so one
//    load request and one store request of buf, 16 sectors each.
extern "C" __global__ void one_site_two_places(const float* a, const float* b, float* buf, float* __restrict__ out,
                                               int nbytes) {
  const int lane = threadIdx.x;
  const float* from = (lane < 16 ? a : b) + lane % 16;
  out[lane] = *from;
  memcpy(buf + 128 + 4 * lane, buf + 4 * lane, nbytes);
}
