// cuemu_trace.h: the runtime's access-event layer, between the scheduler and the checkers.
//
// Runtime-internal (kernels never include it). Kernel modules are compiled with GCC's
// address-sanitizer instrumentation in call mode, so every load and store of a kernel calls a
// hook (__asan_load4_noabort(addr), __asan_storeN_noabort(addr, size), ...), and memcpy,
// memmove and memset calls are redirected to wrappers (-Wl,--wrap). access.cpp implements those
// hooks: it drops accesses to fiber stacks (local memory), sorts the rest into the launch's
// memory regions (dynamic shared memory, static __shared__ variables, array arguments) and
// hands one Access record to every Observer of the launch. The scheduler (runtime.cpp) tells
// the same observers when blocks start and end, when a __syncthreads() completes and when a
// warp collective completes.
//
// Observers today: the race checker (racecheck.cpp). A memory-traffic counter (bytes and
// 32-byte sectors per region, sectors per warp instruction grouped by call site) plugs in the
// same way: one more Observer in make_observers().
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "cuemu_abi.h"

namespace cuemu {

// Access kinds (bits of Access::kind).
enum : uint8_t { ACCESS_READ = 1, ACCESS_WRITE = 2, ACCESS_ATOMIC = 4 };

// One contiguous range of memory a launch can touch. Indexing matches cuemu_hazard.region:
// 0 dynamic shared memory, 1 static __shared__ variables, 2 + i the launch's regions[i].
struct Region {
  uintptr_t lo, hi;    // [lo, hi); empty when lo == hi
  int space;           // CUEMU_GLOBAL, CUEMU_SHARED_DYNAMIC or CUEMU_SHARED_STATIC
  bool writable;       // global: some argument over it is a non-const pointer
  uint32_t index;      // position in the launch's region table
  bool watched;        // set by an observer in launch_begin: it wants this region's accesses
  void* shadow;        // racecheck's per-byte state, null when races are not tracked here
};

// One memory access of one thread, clipped to its region.
struct Access {
  uintptr_t addr;
  uint32_t size;       // bytes
  uint8_t kind;        // ACCESS_READ, ACCESS_WRITE, or ACCESS_ATOMIC (a read-modify-write)
  const Region* region;
  uint32_t tid;        // linear thread index in the block
  uint32_t site;       // call site: the hook's return address - module base
};

struct LaunchInfo {
  uint32_t grid[3], block[3];
  uint32_t nthreads;
  Region* regions;     // the launch's region table (observers set watched, and their state)
  uint32_t nregions;
};

// Receives a launch's events, in program order of the emulated machine.
class Observer {
 public:
  virtual ~Observer() {}
  virtual bool launch_begin(const LaunchInfo&) { return true; }  // false: out of memory
  virtual void block_begin(uint64_t block_linear) { (void)block_linear; }
  virtual void access(const Access&) {}
  virtual void barrier() {}                                 // a __syncthreads() completed
  virtual void warp_sync(uint32_t warp, uint32_t lanes) {   // a warp collective completed
    (void)warp; (void)lanes;
  }
  // Called before the next event after request_settle(): the store the observer saw last has
  // completed by then, so its value can be read (racecheck's same-value writes).
  virtual void settle() {}
  virtual void block_end() {}
  virtual void launch_end() {}
};

// ---- called by the scheduler (runtime.cpp) ----------------------------------------------
// stacks_lo/len: the fiber stacks, whose accesses are local memory and ignored.
// Returns false when the launch cannot be prepared (out of memory).
bool trace_launch_begin(const cuemu_launch_params* p, uint32_t nthreads, uintptr_t stacks_lo,
                        size_t stacks_len);
void trace_launch_end();
void trace_block_begin(uint64_t block_linear);
void trace_block_end();
void trace_set_thread(uint32_t tid);      // the fiber that runs from now on
void trace_sync_point();                  // the running fiber is about to block or exit
void trace_barrier();
void trace_warp_sync(uint32_t warp, uint32_t lanes);

// ---- for observers ------------------------------------------------------------------
void request_settle();

// The race checker (racecheck.cpp).
Observer* racecheck_observer();

}  // namespace cuemu
