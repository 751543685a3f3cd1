// cuemu_abi.h: the binary interface between kernel modules and the emulator runtime.
//
// Included by cuemu.h (kernel side) and by runtime.cpp. Everything here is plain C
// layout so that Python can mirror the launch structs with ctypes.
#pragma once
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
};

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
};

struct cuemu_launch_params {
  void (*invoke)(void**);
  void** args;
  uint32_t grid[3];
  uint32_t block[3];
  char* dyn_smem;
  uint64_t dyn_smem_size;
  uint32_t poison;  // byte written over dynamic shared memory before each block; > 255: none
  uint32_t reserved;
};

struct cuemu_result {
  int32_t kind;
  int32_t has_thread;  // thread_idx is meaningful
  uint32_t block_idx[3];
  uint32_t thread_idx[3];
  uint64_t addr;       // fault address
  int32_t is_write;    // 1 write, 0 read, -1 unknown
  int32_t signo;
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
long long cuemu_clock64(void);

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
