// async_copy.cpp: cp.async on the emulator: copies that complete only at their wait.
//
// PTX semantics (ISA, "Data Movement and Conversion Instructions: cp.async", ".commit_group",
// ".wait_group / .wait_all"): cp.async starts copying cp-size (4, 8 or 16) bytes from global to
// shared memory, reading only the first src-size bytes and zero-filling the rest. Copies are
// per thread: commit_group closes the thread's uncommitted copies into a new group (an empty
// group when there are none); wait_group N waits until at most the N most recent groups are
// pending; wait_all is commit_group + wait_group 0. The writes become visible to the issuing
// thread at that wait, and to other threads only through synchronisation after it. Two pending
// copies to the same bytes are undefined, and so is a src-size above cp-size.
//
// The emulator makes every way of depending on an unfinished copy fail at once:
//   * At the issue, the source bytes are read (a load of the issuing thread at the call site:
//     checked for faults, counted by the traffic counter, seen by the race checker) into the
//     copy's private buffer, and the destination is filled with the launch's poison and marked
//     pending, byte by byte.
//   * Any access to a pending byte, by any thread, a plain load or store, memcpy, another copy or
//     ldmatrix, ends the launch with AsyncCopyError naming both call sites (access.cpp routes
//     every shared-memory access here while copies are pending: the first copy of a launch
//     turns on the watching of shared memory, see trace_watch_shared).
//   * At the wait that completes a copy, its bytes land in shared memory: a store of the issuing
//     thread at the wait's call site, so the race checker demands a __syncthreads() (or a warp
//     collective within a warp) before another thread reads them. The issue is reported to the
//     race checker as a store too, so a copy into bytes other threads still read races.
//   * A thread that exits with copies not waited for is an error.
// Sizes, alignment (both addresses aligned to cp-size), the destination in shared memory and a
// source read past the end of its array argument are checked at the issue.
//
// Not detected: a copy whose source is written by another thread of the launch after the issue
// and before the wait reads the value at the issue (the race checker judges the read);
// modules built without instrumentation (no shadow memory) still complete copies only at the
// wait, but cannot see an early read, which then reads the poison.
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#include "cuemu_signals.h"
#include "cuemu_trace.h"

#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace cuemu {

uint64_t async_pending_bytes = 0;

namespace {

constexpr uint32_t kUncommitted = 0xFFFFFFFFu;

struct Copy {
  uintptr_t dst;
  uint32_t size;     // cp-size
  uint32_t group;    // the thread's group number, kUncommitted until its commit
  uint32_t site;     // the issuing call site
  uint8_t data[16];  // the source bytes read at the issue, zero-filled past src-size
};

struct ThreadCopies {
  std::vector<Copy> copies;   // pending, in issue order
  uint32_t committed = 0;     // groups committed so far in this block
};

struct Tracker {
  uint32_t nthreads = 0;
  std::vector<ThreadCopies> threads;
  // Per byte of dynamic (0) and static (1) shared memory: the issuing thread + 1 of the pending
  // copy writing it, 0 when none. Sized at the launch's first copy.
  std::vector<uint16_t> owner[2];
  bool sized = false;       // the launch issued a copy: shared memory is watched, maps sized
  bool issuing = false;    // the access async_check sees is a new copy's destination
};

Tracker g;

// Per launch: the waits (wait_group N), those after which the waiting thread still had copies in
// flight, and the bytes those copies held: the overlap of copies and compute a pipeline keeps.
uint64_t g_wait_counts[3];

std::string thread_text(uint32_t tid) {
  const uint3 b = cuemu_ctx.block_dim;
  char buf[64];
  snprintf(buf, sizeof buf, "(%u,%u,%u)", tid % b.x, tid / b.x % b.y, tid / (b.x * b.y));
  return buf;
}

std::string copies_text(size_t n) {
  return std::to_string(n) + (n == 1 ? " asynchronous copy" : " asynchronous copies");
}

[[noreturn]] void fail(const std::string& msg) { fail_launch(CUEMU_ERR_ASYNC_COPY, msg.c_str()); }

// The launch's first copy: shared memory is watched from now on, and the pending maps sized.
void start_tracking() {
  g.sized = true;
  trace_watch_shared();  // false in an uninstrumented module: early accesses then go unseen
  for (uint32_t i = 0; i < 2; ++i) {
    const Region* r = trace_region(i);
    g.owner[i].assign(r->hi - r->lo, 0);
  }
}

uint16_t* owner_of(int region, uintptr_t addr, uintptr_t lo) { return &g.owner[region][addr - lo]; }

const Copy* find_copy(uint32_t tid, uintptr_t addr) {
  for (const Copy& c : g.threads[tid].copies)
    if (addr - c.dst < c.size) return &c;
  return nullptr;
}

// Completes the copies of thread `tid` whose group is older than `keep` most recent groups.
void complete(uint32_t tid, uint32_t keep, const void* ra) {
  ThreadCopies& t = g.threads[tid];
  const uint32_t limit = t.committed > keep ? t.committed - keep : 0;  // groups [0, limit) complete
  size_t kept = 0;
  for (size_t i = 0; i < t.copies.size(); ++i) {
    Copy c = t.copies[i];
    if (c.group == kUncommitted || c.group >= limit) {
      t.copies[kept++] = c;
      continue;
    }
    const Region* r = trace_region_at(c.dst);  // checked at the issue: shared memory
    for (uint32_t k = 0; k < c.size; ++k) *owner_of((int)r->index, c.dst + k, r->lo) = 0;
    async_pending_bytes -= c.size;
    trace_access(c.dst, c.size, ACCESS_WRITE | ACCESS_LANDING, ra);  // the copy lands: a store at the wait
    cuemu_copy(reinterpret_cast<void*>(c.dst), c.data, c.size);
  }
  t.copies.resize(kept);
}

}  // namespace

void async_launch_begin(uint32_t nthreads) {
  g.nthreads = nthreads;
  if (g.threads.size() < nthreads) g.threads.resize(nthreads);
  for (uint64_t& count : g_wait_counts) count = 0;
  async_pending_bytes = 0;  // a failed launch may have left copies pending; the maps are
  g.sized = false;          // zeroed again at this launch's first copy
  g.issuing = false;
  async_block_begin();
}

void async_block_begin() {
  for (uint32_t i = 0; i < g.nthreads; ++i) {
    g.threads[i].copies.clear();
    g.threads[i].committed = 0;
  }
}

void async_check(const Access& a) {
  const int region = (int)a.region->index;
  if (region > 1 || !g.sized) return;
  const uint64_t first = a.addr - a.region->lo;
  for (uint32_t k = 0; k < a.size; ++k) {
    const uint16_t owner = g.owner[region][first + k];
    if (!owner) continue;
    const uint32_t issuer = owner - 1u;
    const Copy* c = find_copy(issuer, a.addr + k);
    const char* what = g.issuing ? "a cp.async into" : (a.kind & ACCESS_ATOMIC) ? "an atomic on"
                       : (a.kind & ACCESS_WRITE) ? "a write to" : "a read of";
    std::string msg = std::string(what) + " " + byte_count_text(a.size) + " of " + place_text(region, first) +
                      " by thread " + thread_text(a.tid) + " at " +
                      site_text(a.site) + " touches bytes that an asynchronous copy still writes (" +
                      std::to_string(c ? c->size : 0) + "-byte cp.async issued by thread " +
                      thread_text(issuer) + " at " + site_text(c ? c->site : 0) + ", ";
    if (!c || c->group == kUncommitted) msg += "not yet committed";
    else msg += "group " + std::to_string(c->group) + " of that thread";
    msg += "). A copy completes only at its own thread's cp_async_wait<N>() that covers its group "
           "(wait_group N leaves the N most recent groups pending) or cp_async_wait_all(); other "
           "threads see the data only after a __syncthreads() that follows that wait.";
    fail(msg);
  }
}

void async_thread_exit(uint32_t tid) {
  if (tid >= g.nthreads || g.threads[tid].copies.empty()) return;
  const ThreadCopies& t = g.threads[tid];
  fail("thread " + thread_text(tid) + " exits with " + copies_text(t.copies.size()) +
       " not waited for (the first issued at " + site_text(t.copies[0].site) +
       "); end with cp_async_wait<0>() or cp_async_wait_all() so that no copy is left in flight.");
}

}  // namespace cuemu

using namespace cuemu;

CUEMU_EXPORT void cuemu_cp_async(void* dst_, const void* src_, unsigned cp_size, unsigned src_size) {
  const void* ra = __builtin_return_address(0);
  poll_interrupt(ra);
  const uint32_t tid = trace_thread(), site = trace_site(ra);
  const uintptr_t dst = (uintptr_t)dst_, src = (uintptr_t)src_;
  const std::string where = "cp.async at " + site_text(site) + " by thread " + thread_text(tid) + ": ";
  if (cp_size != 4 && cp_size != 8 && cp_size != 16)
    fail(where + "copy size " + std::to_string(cp_size) + " (cp.async copies 4, 8 or 16 bytes)");
  if (src_size > cp_size)
    fail(where + "src_bytes " + std::to_string((int)src_size) + " is not in 0.." + std::to_string(cp_size) +
         " (PTX: a src-size above cp-size is undefined)");
  if (dst % cp_size || src % cp_size) {
    const bool at_dst = dst % cp_size != 0;
    fail(where + (at_dst ? "the destination (" : "the source (") + address_text(at_dst ? dst : src) +
         ") is not aligned to the copy size " + std::to_string(cp_size) + " bytes");
  }
  const int dst_region = trace_region_of(dst, cp_size);
  if (dst_region != 0 && dst_region != 1) {
    const Region* r = trace_region_at(dst);
    fail(where + "the destination (" + address_text(dst) +
         (r && r->index <= 1 ? ") runs past the end of shared memory"
                             : ") is not in shared memory (cp.async writes shared memory only)"));
  }
  if (src_size) {
    const Region* r = trace_region_at(src);
    if (r && r->index <= 1)
      fail(where + "the source (" + address_text(src) + ") is shared memory (cp.async reads global memory only)");
    if (r && src_size > r->hi - src) {
      char buf[200];
      snprintf(buf, sizeof buf, "reads %u bytes at " CUEMU_ARG_TOKEN ", %llu past the end of the array", src_size,
               r->index - 2, (unsigned long long)(src - r->lo), (unsigned long long)(src + src_size - r->hi));
      fail(where + buf);
    }
  }
  if (!g.sized) start_tracking();
  Copy c;
  c.dst = dst;
  c.size = cp_size;
  c.group = kUncommitted;
  c.site = site;
  memset(c.data, 0, sizeof c.data);
  if (src_size) {
    trace_access(src, src_size, ACCESS_READ, ra);
    cuemu::copy_site = site;  // a fault in the copy below is reported at the cp.async's call site
    cuemu_copy(c.data, src_, src_size);  // a fault here is an out-of-bounds load of the issuing thread
  }
  g.issuing = true;
  trace_access(dst, cp_size, ACCESS_WRITE, ra);  // fails if another pending copy writes these bytes
  g.issuing = false;
  cuemu_fill(dst_, trace_poison(), cp_size);
  const Region* r = trace_region_at(dst);
  for (uint32_t k = 0; k < cp_size; ++k) *owner_of(dst_region, dst + k, r->lo) = (uint16_t)(tid + 1);
  async_pending_bytes += cp_size;
  g.threads[tid].copies.push_back(c);
}

CUEMU_EXPORT void cuemu_cp_async_commit(void) {
  ThreadCopies& t = g.threads[trace_thread()];
  for (Copy& c : t.copies)
    if (c.group == kUncommitted) c.group = t.committed;
  ++t.committed;
}

CUEMU_EXPORT void cuemu_cp_async_wait(unsigned pending) {
  const void* ra = __builtin_return_address(0);
  poll_interrupt(ra);
  const uint32_t tid = trace_thread();
  complete(tid, pending, ra);
  uint64_t in_flight = 0;
  for (const cuemu::Copy& c : cuemu::g.threads[tid].copies) in_flight += c.size;
  ++cuemu::g_wait_counts[0];
  if (in_flight) {
    ++cuemu::g_wait_counts[1];
    cuemu::g_wait_counts[2] += in_flight;
  }
}

// The last launch's waits: out[0] waits, out[1] waits that left the thread copies in flight,
// out[2] the bytes of those copies, summed over the waits.
CUEMU_EXPORT void cuemu_copy_wait_counts(uint64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = cuemu::g_wait_counts[i];
}

CUEMU_EXPORT void cuemu_cp_async_wait_all(void) {
  const void* ra = __builtin_return_address(0);
  poll_interrupt(ra);
  cuemu_cp_async_commit();
  complete(trace_thread(), 0, ra);
}
