// cuemu_trace.h: the runtime's access-event layer, between the scheduler and the checkers.
//
// Runtime-internal (kernels never include it). Kernel modules are compiled with GCC's
// ThreadSanitizer instrumentation, without its runtime library, so every read and write of a
// kernel calls a hook (__tsan_read4(addr), __tsan_write_range(addr, size), ...), and memcpy,
// memmove and memset calls are redirected to wrappers (-Wl,--wrap). access.cpp implements those
// hooks: it drops accesses to fiber stacks (local memory), sorts the rest into the launch's
// memory regions (dynamic shared memory, static __shared__ variables, array arguments) and
// hands one Access record to every Observer of the launch. The scheduler (runtime.cpp) tells
// the same observers when blocks start and end, when a __syncthreads() completes and when a
// warp collective completes.
//
// Observers: the race checker (racecheck.cpp), the memory-traffic counter (traffic.cpp:
// bytes and 32-byte sectors per region, sectors per warp instruction grouped by call site) and
// the shared-memory bank counter (banks.cpp: bank wavefronts per warp instruction and call site),
// chosen per launch by cuemu_launch_params.checks in trace_launch_begin(). Beside them, the
// asynchronous-copy tracker (async_copy.cpp) sees every shared-memory access while copies are
// pending; the emulated instructions that touch memory in the runtime (cp.async, ldmatrix)
// report their accesses through trace_access().
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <string>

#include "cuemu_abi.h"

namespace cuemu {

// Access kinds (bits of Access::kind).
// ACCESS_LANDING marks the store of a cp.async that lands at its wait (with ACCESS_WRITE): the
// bank counter has seen that copy's shared-memory write at its issue already.
enum : uint8_t { ACCESS_READ = 1, ACCESS_WRITE = 2, ACCESS_ATOMIC = 4, ACCESS_LANDING = 8 };

// One contiguous range of memory a launch can touch. Indexing matches cuemu_hazard.region:
// 0 dynamic shared memory, 1 static __shared__ variables, 2 + i the launch's regions[i].
struct Region {
  uintptr_t lo, hi;    // [lo, hi); empty when lo == hi
  int space;           // CUEMU_GLOBAL, CUEMU_SHARED_DYNAMIC, CUEMU_SHARED_STATIC (or CUEMU_GUARD:
                       // padding beside a buffer, watched by access.cpp and never given to observers)
  bool writable;       // global: some argument over it is a non-const pointer
  uint32_t sector_phase;  // global: (lo - its allocation's start) % 32
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
  virtual void fence(uint32_t tid) { (void)tid; }            // thread tid ran __threadfence()
  // Called after request_settle(), before the running thread's next write or atomic access,
  // before it blocks or exits, and at the end of the block: the store the observer saw last has
  // completed by then, so its value can be read (racecheck's same-value writes). Not before a
  // read: the hooks of one statement may come before its store (g++ instruments the store of
  // an aggregate copy before its load).
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
void trace_fence();                       // the running fiber ran __threadfence()

// ---- for observers ------------------------------------------------------------------
void request_settle();

// ---- for the emulated instructions that touch memory themselves (async_copy.cpp, fragments.cpp)
// One access by the running thread (or by thread `tid` of the block), with the call site given
// by a return address into the kernel's module: what an instrumented load or store reports.
void trace_access(uintptr_t addr, size_t size, uint8_t kind, const void* ra);
void trace_access_as(uint32_t tid, uintptr_t addr, size_t size, uint8_t kind, const void* ra);
uint32_t trace_thread();                  // linear id of the running thread in its block
uint8_t trace_poison();                   // the launch's poison byte (0xFF when it has none)
uint32_t trace_site(const void* ra);      // a return address as a call site (offset in the module)
// The place tokens of messages, which launch.py spells out (_TOKEN): a call site (trace_site's
// offset, as file:line), a static shared memory offset (its variable), an argument region's byte.
#define CUEMU_SITE_TOKEN "@site(0x%x)"
#define CUEMU_STATIC_TOKEN "@static(0x%llx)"
#define CUEMU_ARG_TOKEN "@arg(%u,0x%llx)"
// The launch's memory: the region of the table holding [addr, addr + size) entirely (0 dynamic
// shared memory, 1 static shared memory, 2 + i regions[i]), -1 when none does; and the region
// holding addr alone, or null.
int trace_region_of(uintptr_t addr, size_t size);
const Region* trace_region_at(uintptr_t addr);
const Region* trace_region(uint32_t index);
// Watches both shared memory regions from now until the launch ends, so that every access to
// them reaches trace hooks (the asynchronous-copy tracker needs them); false when the module is
// not instrumented (no shadow memory) and accesses cannot be seen.
bool trace_watch_shared();

// The asynchronous-copy tracker (async_copy.cpp), driven by the scheduler and by access.cpp.
void async_launch_begin(uint32_t nthreads);
void async_block_begin();
extern uint64_t async_pending_bytes;      // bytes of shared memory pending copies will write
void async_check(const Access& a);        // an access to shared memory while copies are pending
void async_thread_exit(uint32_t tid);     // fails the launch when the thread has copies pending

// The tensor-core fragment instructions (fragments.cpp): one lane's operands, and the results of
// a complete warp (all 32 lanes, from thread base_tid). Returns -1, or the lane to blame with
// *msg set (a bad ldmatrix row address).
struct FragmentLane {
  const void* in;
  void* out;
  const void* ra;   // return address of the lane's call: its call site
};
int fragment_release(int op, int arg, uint32_t base_tid, const FragmentLane* lanes, std::string* msg);

// Words for error messages, with tokens that launch.py spells out: a call site (an offset into
// the module) as file:line; a region of shared memory (0 dynamic, 1 static) and a byte offset in
// it, a static variable by name; an address as shared memory, an argument's element, or a number;
// a count of bytes ("1 byte", "12 bytes").
std::string site_text(uint32_t site);
std::string place_text(int region, uint64_t offset);
std::string address_text(uintptr_t addr);
std::string byte_count_text(uint64_t n);

// A byte offset into the dynamic shared memory as on a GPU: where a kernel carves it into arrays
// (SharedLayout), the emulator places each a gap further on; this takes the gaps out, by the layout
// of thread `tid` (access.cpp).
uint64_t dynamic_shared_gpu_offset(uint32_t tid, uint64_t offset);

// The call site of the kernel's memcpy, memmove or memset that runs now (set by its wrapper in
// access.cpp): a fault inside the copy is reported at that line.
extern uint32_t copy_site;

// The kernel's call site of the atomic whose own read and write run now (set by
// cuemu_atomic_access, cleared by cuemu_atomic_done; 0 otherwise): a fault in the atomic helper,
// which is the emulator's code, is reported at that line, as a write.
extern uint32_t atomic_site;

// Ends the launch from the running fiber as a fault at `addr` (is_write 1, 0, or -1: unknown) by the
// access at call site `site`, as if a guard page had been touched there (runtime.cpp).
[[noreturn]] void fail_with_fault(uint64_t addr, int is_write, uint32_t site);

// Ends the launch from the running fiber with an error of `kind` (CUEMU_ERR_*) and message
// `msg` (runtime.cpp); the running thread is blamed.
[[noreturn]] void fail_launch(int kind, const char* msg);

// The race checker (racecheck.cpp).
Observer* racecheck_observer();
// The memory-traffic counter (traffic.cpp).
Observer* traffic_observer();
// Whether this launch counts the outcomes of CUPYKV_COMMON_PATH tests and each warp's mma
// instructions (a traffic launch); forgets the last launch's counts when it does (traffic.cpp).
void count_launch_paths(bool on);
// A warp's mma.sync, counted when the launch counts paths: `block` the linear block index (x
// fastest), `warp` the warp of the block (runtime.cpp's release_fragment).
void count_warp_mma(uint64_t block, uint32_t warp);
// The shared-memory bank counter (banks.cpp).
Observer* banks_observer();

}  // namespace cuemu
