// cuemu_abi.h: the binary interface between kernel modules and the emulator runtime.
//
// Included by cuemu.h (kernel side) and by runtime.cpp. Everything here is plain C
// layout so that Python can mirror the launch structs with ctypes.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct uint3 {
  unsigned int x, y, z;
};

extern "C" {

// Per-fiber view of the built-in variables; the scheduler rewrites it on every switch.
struct cuemu_ctx_t {
  uint3 thread_idx;
  uint3 block_idx;
  uint3 block_dim;
  uint3 grid_dim;
  char* dyn_smem;  // dynamic shared memory of the running block
};

// Warp operation codes (cuemu_warp_op).
enum {
  CUEMU_SHFL_IDX = 0,
  CUEMU_SHFL_UP = 1,
  CUEMU_SHFL_DOWN = 2,
  CUEMU_SHFL_XOR = 3,
  CUEMU_BALLOT = 4,
  CUEMU_ALL = 5,
  CUEMU_ANY = 6,
  CUEMU_SYNCWARP = 7,
  CUEMU_ACTIVEMASK = 8,
  CUEMU_MATCH_ANY = 9,
  CUEMU_REDUCE_ADD = 10,
  CUEMU_REDUCE_MIN = 11,   // signed
  CUEMU_REDUCE_MAX = 12,   // signed
  CUEMU_REDUCE_UMIN = 13,
  CUEMU_REDUCE_UMAX = 14,
  CUEMU_REDUCE_AND = 15,
  CUEMU_REDUCE_OR = 16,
  CUEMU_REDUCE_XOR = 17,
  // Tensor-core fragment instructions (cuemu_warp_fragment): collectives of all 32 lanes.
  CUEMU_MMA_F16 = 32,      // mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
  CUEMU_MMA_BF16 = 33,     // mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
  CUEMU_LDMATRIX = 34,     // ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
};

// cuemu_warp_fragment's operands. mma: `in` is a cuemu_mma_in, `out` float[4] (D). ldmatrix:
// `in` points to the lane's row address (a const void*), `out` is uint32_t[matrices]; `arg` is
// the number of matrices (1, 2 or 4), plus CUEMU_LDMATRIX_TRANS for .trans.
struct cuemu_mma_in {
  uint32_t a[4];   // A fragment: a0..a7, two 16-bit elements per register, low half first
  uint32_t b[2];   // B fragment: b0..b3
  float c[4];      // C fragment: c0..c3
};
enum { CUEMU_LDMATRIX_TRANS = 16 };

// Barrier flavours (cuemu_barrier).
enum { CUEMU_BAR_SYNC = 0, CUEMU_BAR_COUNT = 1, CUEMU_BAR_AND = 2, CUEMU_BAR_OR = 3 };

// Launch status codes (cuemu_launch's return value and cuemu_result.kind).
enum {
  CUEMU_OK = 0,
  CUEMU_ERR_FAULT = 1,      // SIGSEGV/SIGBUS: addr, is_write
  CUEMU_ERR_SYNC = 2,       // barrier or warp-op misuse, deadlock
  CUEMU_ERR_ASSERT = 3,     // device assert
  CUEMU_ERR_TRAP = 4,       // __trap(), integer division by zero, ...
  CUEMU_ERR_STACK = 5,      // fiber stack overflow
  CUEMU_ERR_SETUP = 6,      // the runtime could not prepare the launch (out of memory)
  CUEMU_ERR_INTERRUPTED = 7,  // Ctrl-C (SIGINT) stopped the launch (CUEMU_STOP_ON_SIGINT)
  CUEMU_ERR_ASYNC_COPY = 8,   // cp.async misuse: a pending destination touched, bad size/address
  CUEMU_ERR_FRAGMENT = 9,     // ldmatrix / mma misuse: a row address outside shared memory, ...
  CUEMU_ERR_BAD_ACCESS = 10,  // an access a GPU faults on that no guard page catches: outside a
                              // static __shared__ variable (into its guard bytes), or misaligned
  CUEMU_ERR_TIME_LIMIT = 11,  // the launch used more CPU time than cuemu_launch_params.time_limit_s
  CUEMU_ERR_LAUNCH_BOUNDS = 12,  // a block of more threads than the kernel's __launch_bounds__ allow
                                //  (checked by its first thread, before anything else runs)
};

// Guard bytes before and after each static __shared__ variable of a function (source.py's box).
enum { CUEMU_STATIC_SHARED_GUARD = 16 };

// Dynamic shared memory carved into arrays by cupykv::SharedLayout (kernels/shared_layout.cuh).
// In the emulator the i-th array a layout takes starts i * CUEMU_SHARED_ARRAY_GAP bytes past its
// place on a GPU (a multiple of 128: every byte keeps its bank), so an index run past an array's
// end lands in the gap after it, which no array holds, and fails (access.cpp). Launches of a module
// that carves get CUEMU_SHARED_ARRAYS_MAX gaps of room beyond the bytes they asked for.
enum { CUEMU_SHARED_ARRAY_GAP = 4096, CUEMU_SHARED_ARRAYS_MAX = 8 };

// Memory spaces of the regions a launch's accesses are sorted into (cuemu_hazard.region).
enum { CUEMU_GLOBAL = 0, CUEMU_SHARED_DYNAMIC = 1, CUEMU_SHARED_STATIC = 2, CUEMU_GUARD = 3 };

// One array argument's bytes (overlapping arguments are merged into one region by launch.py).
struct cuemu_region {
  uint64_t lo, hi;     // [lo, hi)
  uint32_t writable;   // 1: some argument over these bytes is a non-const pointer (races are checked)
  uint32_t sector_phase;  // (lo - its allocation's start) % 32: where lo sits in a 32-byte sector
};

// Launch options (cuemu_launch_params.options). CUEMU_STOP_ON_SIGINT: the runtime takes SIGINT
// while the launch runs, stops it and returns CUEMU_ERR_INTERRUPTED (launch.py sets it when
// Python's default SIGINT handler is installed and the launch runs on the main thread).
enum { CUEMU_STOP_ON_SIGINT = 1 };

// Checks a launch can turn on (cuemu_launch_params.checks).
enum { CUEMU_CHECK_RACES = 1, CUEMU_CHECK_TRAFFIC = 2, CUEMU_CHECK_BANKS = 4 };

// The shared-memory bank wavefronts of one (call site, kind, region) in one launch (banks.cpp).
struct cuemu_bank_site {
  uint32_t site;        // call site: return address - module base
  uint32_t kind;        // 0 load, 1 store, 2 atomic
  uint32_t region;      // 0 dynamic shared memory, 1 static __shared__ variables
  uint32_t reserved;
  uint64_t accesses;    // accesses of single threads
  uint64_t bytes;       // bytes accessed, repeats included
  uint64_t requests;    // warp-level requests
  uint64_t wavefronts;  // bank wavefronts of those requests, summed
  uint64_t ideal;       // the wavefronts the same requests need without bank conflicts
  uint64_t extent;      // the highest offset (from the region's start) + size of an access here
};

// The memory traffic of one region in one launch (traffic.cpp), per kind of access:
// [0] loads, [1] stores, [2] atomics. Regions are numbered as in cuemu_hazard.region.
struct cuemu_traffic {
  uint64_t bytes[3];            // bytes accessed, repeats included
  uint64_t accesses[3];         // accesses of single threads
  uint64_t requests[3];         // warp-level requests (global regions; see traffic.cpp)
  uint64_t request_sectors[3];  // distinct 32-byte sectors of each request, summed
  const uint64_t* bits[3];      // global regions: bit i set = byte i - sector_phase touched; else null
  uint64_t nbits;               // sector_phase + the region's bytes
};

// How often the threads of one launch evaluated one run-time test that a kernel marks
// CUPYKV_COMMON_PATH (kernels/common.cuh) to one value (traffic.cpp; inside emulator.traffic()).
struct cuemu_path_outcome {
  const char* file;    // the test's __FILE__ (a string of the kernel's module)
  uint32_t line;       // the test's __LINE__
  uint32_t reserved;
  int64_t value;       // what the test gave (a bool as 0 or 1)
  uint64_t count;      // evaluations by single threads that gave it
};

// The tensor-core mma instructions (mma.sync, one per warp and instruction) one warp of one launch
// issued (traffic.cpp; inside emulator.traffic()).
struct cuemu_warp_mma {
  uint64_t block;      // the linear block index, x fastest
  uint32_t warp;       // the warp of the block (thread index / 32)
  uint32_t reserved;
  uint64_t count;      // its mma.sync instructions
};

struct cuemu_launch_params {
  void (*invoke)(void**);
  void** args;
  uint32_t grid[3];
  uint32_t block[3];
  char* dyn_smem;
  uint64_t dyn_smem_size;
  uint32_t poison;  // byte written over dynamic shared memory before each block; > 255: none
  uint32_t checks;  // CUEMU_CHECK_* bits
  uint64_t seed;    // schedule seed: 0 runs blocks and threads in index order, else a seeded shuffle
  const cuemu_region* regions;   // the array arguments
  uint32_t nregions;
  uint32_t options;   // CUEMU_STOP_ON_SIGINT
  void* (*tls_probe)(void);      // the module's cuemu_module_tls_probe (finds static __shared__)
  // The bytes of the arguments' and the dynamic shared memory's mappings that belong to no buffer,
  // between a guard page and a buffer's start or end (alignment padding: an access there ends
  // the launch as a fault at that address, as the guard page would).
  const cuemu_region* guards;
  uint32_t nguards;
  // The bytes mapped at dyn_smem: dyn_smem_size, plus the gaps of a module that carves its dynamic
  // shared memory into arrays (CUEMU_SHARED_ARRAY_GAP)
  uint64_t dyn_smem_room;
  // CPU seconds the launching thread may spend in the launch (its kernel, the scheduler, the
  // checkers); past them the launch stops with CUEMU_ERR_TIME_LIMIT. 0: no limit.
  double time_limit_s;
  // The module's .text section, as offsets from its load base (0, 0: unknown): the kernels' code,
  // which a stop (Ctrl-C, the time limit) may leave at once, without the PLT stubs before it,
  // whose pc names no line (the hook they jump to polls instead).
  uint64_t text_lo, text_hi;
  // KiB of stack for each fiber (CUPYKV_EMULATOR_STACK_KIB, read by launch.py at every launch): the
  // stacks are remapped when it differs from the last launch's
  uint32_t stack_kib;
};

// Hazard kinds (cuemu_hazard.kind).
// CUEMU_UNINIT: not a race; a read (or atomic) of shared memory that no thread of the block had
// written (both sides are that access).
enum { CUEMU_RAW = 0, CUEMU_WAR = 1, CUEMU_WAW = 2, CUEMU_UNINIT = 3 };

// A data race found by the race checker: the first pair of accesses between two call sites.
// Index 0 is the earlier access, 1 the later one. Region 0 is the dynamic shared memory,
// 1 the module's static __shared__ variables, 2 + i the launch's regions[i].
struct cuemu_hazard {
  int32_t kind;
  int32_t region;
  uint64_t offset;      // byte offset in the region
  uint64_t block[2];    // linear block index (x fastest)
  uint32_t thread[2];   // linear thread index in the block (x fastest)
  uint32_t site[2];     // return address of the instrumentation call - module base
  uint32_t atomic[2];   // 1: an atomic read-modify-write
  uint64_t count;       // hazards of this kind between the same two call sites
};

struct cuemu_result {
  int32_t kind;
  int32_t has_thread;  // thread_idx is meaningful
  uint32_t block_idx[3];
  uint32_t thread_idx[3];
  uint64_t addr;       // fault address
  int32_t is_write;    // 1 write, 0 read, -1 unknown
  int32_t signo;
  uint32_t fault_site;      // the faulting access as a call site (offset in the module + 1, as a
  int32_t has_fault_site;   // return address would be), when it lies in the kernel's code
  char msg[8192];
};

// Kernel-side entry points, defined by the runtime.
extern cuemu_ctx_t cuemu_ctx;
int cuemu_barrier(int kind, int pred, const char* file, int line);
unsigned long long cuemu_warp_op(int op, unsigned mask, unsigned long long value, int size,
                                 int arg, int width, const char* file, int line);
[[noreturn]] void cuemu_device_assert(const char* expr, const char* file, unsigned line,
                                      const char* func);
[[noreturn]] void cuemu_trap(const char* what, const char* file, int line);
[[noreturn]] void cuemu_launch_bounds_exceeded(const char* bounds, long long max_threads);
long long cuemu_clock64(void);
// Atomics report their read-modify-write here (they are not instrumented themselves), and say when
// it is done: a fault in between is the atomic's, reported at the kernel's line `site`.
void cuemu_atomic_access(void* addr, unsigned size, void* site);
void cuemu_atomic_done(void);
// __threadfence() and __threadfence_system(): a fence of the calling thread, which the race
// checker pairs with the thread's atomics into a release (fence, then atomic) or an acquire
// (atomic, then fence) between blocks.
void cuemu_threadfence(void);
// A static __shared__ variable's declaration, reached by a fiber (cuemu::static_shared): the
// variable lives in `box`, CUEMU_STATIC_SHARED_GUARD guard bytes, then value_size bytes of the
// value, then guard bytes to box_size. The first fiber of a block to reach it fills the value with
// the launch's poison byte; accesses outside the value but inside the box fail (access.cpp).
void cuemu_static_shared(void* box, size_t value_size, size_t box_size);
// cupykv::SharedLayout in the emulator: the calling thread begins a layout of the block's dynamic
// shared memory (its first, or the next after a barrier, over memory the last one no longer uses),
// and takes its arrays in order: the index-th, `bytes` long at `offset` on a GPU (a multiple of the
// element's `align`), named `name` (a string literal). Every thread of the block must take the same
// arrays of a layout. Returns where the array lies here; an access by the thread outside its
// layout's arrays fails (access.cpp).
void cuemu_shared_layout_begin(void);
void* cuemu_shared_array(void* base, unsigned long long offset, unsigned long long bytes, unsigned long long align,
                         unsigned index, const char* name);
// A CUPYKV_COMMON_PATH test evaluated by the calling thread, to `value` (counted in traffic launches).
void cuemu_count_path_outcome(const char* file, int line, long long value);
// Asynchronous copies (cp.async; async_copy.cpp). Per thread, as in PTX: a copy belongs to the
// group its thread's next commit closes; wait(n) completes all but the n most recent groups.
void cuemu_cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size);
void cuemu_cp_async_commit(void);
void cuemu_cp_async_wait(unsigned pending);
void cuemu_cp_async_wait_all(void);
// A tensor-core fragment instruction of the calling warp (CUEMU_MMA_*, CUEMU_LDMATRIX): every
// lane passes its operands; the results are written to each lane's `out` once all 32 arrived.
void cuemu_warp_fragment(int op, int arg, const void* in, void* out, const char* file, int line);

// One kernel instance in a module's registry.
struct cuemu_entry {
  const char* name;
  void (*invoke)(void**);
  unsigned nparams;
  const unsigned long long* sizes;
  const char* kinds;               // one char per parameter: p f i u b o
  const char* const* type_names;   // __PRETTY_FUNCTION__ strings carrying the type
};
}
