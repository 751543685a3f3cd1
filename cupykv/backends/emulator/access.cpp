// access.cpp: the instrumentation hooks of kernel modules, and the dispatch of their accesses.
//
// build.py compiles kernels with GCC's -fsanitize=thread and links them without its runtime
// library: every read and write of memory that GCC cannot prove private (locals kept in
// registers, or whose address never escapes, are not instrumented) calls a hook defined here,
// __tsan_{read,write}{1,2,4,8,16}(addr) or __tsan_{read,write}_range(addr, size) (sizes that
// are not a power of two, or accesses less aligned than their size). Each access has its own
// call, both halves of a read-modify-write (`x[i] += v`) included. A sized hook first fails an
// address that is not a multiple of its size (misaligned(): the GPU faults on it); every hook
// then polls for Ctrl-C, reads one shadow byte, *((addr >> 3) + kShadowOffset), and returns at
// once when it is zero: this file maps the shadow (16 TiB reserved, backed only where written) when the
// runtime loads and sets the shadow bytes of the regions observers watch, so accesses to
// everything else (local memory, read-only arguments, cuemu_ctx) cost a call and two loads.
// memcpy, memmove and memset calls come here through -Wl,--wrap, the atomics of cuemu.h
// (not instrumented themselves) through cuemu_atomic_access, and the emulated cp.async and
// ldmatrix (async_copy.cpp, fragments.cpp) through trace_access. For each access that reaches
// it, record():
//   1. returns at once unless a launch runs whose accesses are watched (observers, guard spans,
//      asynchronous copies, a static __shared__ variable reached, dynamic shared memory that the
//      module carves into arrays), or for a fiber stack;
//   2. finds the watched region: dynamic shared memory, the module's static __shared__
//      variables (its thread-local storage block, located through cuemu_module_tls_probe), or
//      an array argument; anything else sharing an 8-byte shadow granule is ignored; an access
//      to static shared memory must stay inside one variable (check_static_bounds), and one
//      whose first or last byte lies in a guard span (the padding and slack beside a buffer,
//      watched in every launch) ends it as a fault there (check_guards);
//   3. builds one Access (thread, address, size, kind, call site as an offset into the module),
//      lets the asynchronous-copy tracker check it while copies are pending (shared memory only),
//      and hands it to each observer.
// See cuemu_trace.h for the observer interface.
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <vector>

#include "cuemu_signals.h"
#include "cuemu_trace.h"

#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace cuemu {
namespace {

constexpr uint32_t kMaxObservers = 4;
// Shadow byte of address a: kShadowOffset + (a >> 3), read by the hooks below.
// [16 TiB, 32 TiB) lies between the low mappings (program, heap) and the high ones (libraries,
// mmap) of an x86-64 Linux process with 47-bit addresses.
constexpr uintptr_t kShadowOffset = 0x100000000000ull;
constexpr size_t kShadowSize = 1ull << 44;
constexpr uint8_t kWatchedGranule = 0xFF;  // not zero: accesses that start in the granule go on

// A watched region, laid out for the lookup every access makes.
struct Watch {
  uintptr_t lo, len;
  const Region* region;
};

struct TraceState {
  bool active = false;        // a launch with at least one observer is running
  bool settle = false;        // an observer asked for settle() before the next event
  uint32_t tid = 0;           // the running fiber
  uintptr_t stack_lo = 0, stack_len = 0;
  uintptr_t module_base = 0;
  uint32_t poison = 256;      // the launch's poison byte for shared memory; > 255: none
  const Watch* watch = nullptr;
  uint32_t nwatch = 0;
  Observer* observers[kMaxObservers];
  uint32_t nobservers = 0;
};

TraceState T;
std::vector<Region> g_regions;
std::vector<Watch> g_watch;
std::vector<Region> g_guards;  // the launch's guard spans (cuemu_launch_params.guards), watched last
}  // namespace

uint32_t copy_site = 0;
uint32_t atomic_site = 0;

namespace {

// The static __shared__ variables whose declaration a fiber of the launch reached
// (cuemu_static_shared), each boxed between guard bytes; `block` is the serial number of the
// last block that reached it. Blocks run on the launching thread, one at a time.
struct StaticVariable {
  uintptr_t box_lo, value_lo, value_hi, box_hi;
  uint64_t block;
};
std::vector<StaticVariable> g_static_variables;
uint64_t g_block_serial = 0;  // counts every block of every launch

// Dynamic shared memory carved by cupykv::SharedLayout (cuemu_shared_array): the running block's
// layouts in the order its threads began them, and per thread how many it has begun (its own is the
// last of those; 0: none, so its accesses may touch the dynamic_size bytes the launch asked for).
struct SharedArray {
  uint64_t offset, bytes;  // where it lies on a GPU
  uintptr_t lo, hi;        // where it lies here
  const char* name;
};
std::vector<std::vector<SharedArray>> g_layouts;
std::vector<uint32_t> g_thread_layout;
uint64_t g_dynamic_size = 0;  // the dynamic shared memory the launch asked for
bool g_dynamic_carvable = false;  // mapped with gaps beyond it (the module carves it)

// The array of `layout` that holds all of [addr, addr + size), or null.
const SharedArray* array_holding(const std::vector<SharedArray>& layout, uintptr_t addr, size_t size = 1) {
  for (const SharedArray& a : layout)
    if (addr >= a.lo && addr + size <= a.hi) return &a;
  return nullptr;
}

// The layout thread `tid` began last, or null before it began one.
const std::vector<SharedArray>* thread_layout(uint32_t tid) {
  const uint32_t begun = tid < g_thread_layout.size() ? g_thread_layout[tid] : 0;
  return begun ? &g_layouts[begun - 1] : nullptr;
}

// ---- shadow bytes ---------------------------------------------------------------------
bool g_shadow_ready = false;

__attribute__((constructor)) void map_shadow() {
  void* want = reinterpret_cast<void*>(kShadowOffset);
  void* got = mmap(want, kShadowSize, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (got == MAP_FAILED) return;
  if (got != want) {  // a kernel without MAP_FIXED_NOREPLACE placed it elsewhere
    munmap(got, kShadowSize);
    return;
  }
  madvise(got, kShadowSize, MADV_NOHUGEPAGE);  // marking a few bytes must not commit 2 MiB
  g_shadow_ready = true;
}

// Shadow bytes [lo, hi) of a set of granules.
struct Span {
  uintptr_t lo, hi;
  bool operator==(const Span& o) const { return lo == o.lo && hi == o.hi; }
  bool overlaps(const Span& o) const { return lo < o.hi && o.lo < hi; }
};
std::vector<Span> g_marked;  // spans marked now (kept across launches: most launches repeat)

bool contains(const std::vector<Span>& spans, const Span& s) {
  for (const Span& t : spans)
    if (t == s) return true;
  return false;
}

void set_span(const Span& s, uint8_t value) {
  constexpr uintptr_t kPage = 4096, kRelease = 1u << 20;
  const uintptr_t inner_lo = (s.lo + kPage - 1) & ~(kPage - 1), inner_hi = s.hi & ~(kPage - 1);
  if (value == 0 && inner_hi > inner_lo && inner_hi - inner_lo >= kRelease) {
    // Large spans go back to the kernel: they read as zero again without staying committed.
    memset(reinterpret_cast<void*>(s.lo), 0, inner_lo - s.lo);
    madvise(reinterpret_cast<void*>(inner_lo), inner_hi - inner_lo, MADV_DONTNEED);
    memset(reinterpret_cast<void*>(inner_hi), 0, s.hi - inner_hi);
    return;
  }
  memset(reinterpret_cast<void*>(s.lo), value, s.hi - s.lo);
}

// The largest sized access (a 16-byte vector). A guard span's granules are marked from this many
// bytes minus one before it, so that an access starting in the buffer and ending in the guard (a
// uint4 load over an array's last 8 bytes and 8 of padding) reaches record() and check_guards().
constexpr uintptr_t kLargestSizedAccess = 16;

// Marks the watched regions' granules, clearing those of the last launch that are not watched.
void mark_watched(const std::vector<Watch>& watch) {
  std::vector<Span> next;
  for (const Watch& w : watch) {
    const uintptr_t lo = w.region->space == CUEMU_GUARD ? w.lo - (kLargestSizedAccess - 1) : w.lo;
    next.push_back(Span{kShadowOffset + (lo >> 3), kShadowOffset + ((w.lo + w.len + 7) >> 3)});
  }
  std::vector<Span> cleared;
  for (const Span& s : g_marked)
    if (!contains(next, s)) {
      set_span(s, 0);
      cleared.push_back(s);
    }
  for (const Span& s : next) {
    bool mark = !contains(g_marked, s);
    for (const Span& c : cleared) mark = mark || s.overlaps(c);
    if (mark) set_span(s, kWatchedGranule);
  }
  g_marked.swap(next);
}

inline const Region* find_region(uintptr_t addr) {
  for (uint32_t i = 0; i < T.nwatch; ++i)
    if (addr - T.watch[i].lo < T.watch[i].len) return T.watch[i].region;
  return nullptr;
}

void settle_observers() {
  T.settle = false;
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->settle();
}

const char* access_word(uint8_t kind) {
  return kind & ACCESS_ATOMIC ? "atomic" : kind & ACCESS_WRITE ? "write" : "read";
}

// Ends the launch when [addr, addr + size) leaves the value of the static __shared__ variable
// whose box holds addr (its guard bytes, or the padding after them). Bytes of static shared
// memory outside every box (a variable at namespace scope, or declared with others) go unchecked.
void check_static_bounds(const Region& stat, uintptr_t addr, size_t size, uint8_t kind, const void* ra) {
  for (const StaticVariable& v : g_static_variables) {
    if (v.block != g_block_serial || addr < v.box_lo || addr >= v.box_hi) continue;
    if (addr >= v.value_lo && addr + size <= v.value_hi) return;
    char where[96];
    if (addr >= v.value_hi) {
      if (addr == v.value_hi) snprintf(where, sizeof where, "the first byte past the end");
      else snprintf(where, sizeof where, "%llu bytes past the end", (unsigned long long)(addr - v.value_hi));
    } else if (addr < v.value_lo) {
      snprintf(where, sizeof where, "%llu bytes before the start", (unsigned long long)(v.value_lo - addr));
    } else {
      snprintf(where, sizeof where, "running %llu bytes past the end",
               (unsigned long long)(addr + size - v.value_hi));
    }
    char size_text[64];
    snprintf(size_text, sizeof size_text, " of %llu bytes at ", (unsigned long long)size);
    char bytes_text[48];
    snprintf(bytes_text, sizeof bytes_text, " of the variable's %llu bytes) at ",
             (unsigned long long)(v.value_hi - v.value_lo));
    const std::string msg = std::string("out-of-bounds ") + access_word(kind) + size_text +
                            place_text(1, addr - stat.lo) + " (" + where + bytes_text +
                            site_text((uint32_t)((uintptr_t)ra - T.module_base));
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg.c_str());
  }
}

// Where [addr, addr + size) of the dynamic shared memory lies, in words: in an array of `layout`, or
// in the gap between two: past the end of the one before, or before the start of the one after,
// whichever is nearer (an index run on from the first, or back from the second); each array with
// its bytes on a GPU.
std::string dynamic_place(const std::vector<SharedArray>& layout, uintptr_t addr, size_t size) {
  const SharedArray* before = nullptr;  // the last array that starts at or before addr
  const SharedArray* after = nullptr;   // the first that starts after it
  for (const SharedArray& a : layout) {
    if (a.lo <= addr && (!before || a.lo > before->lo)) before = &a;
    if (a.lo > addr && (!after || a.lo < after->lo)) after = &a;
  }
  auto named = [](const SharedArray& a) {
    return "shared array '" + std::string(a.name) + "' (" + std::to_string(a.bytes) + " bytes at [" +
           std::to_string(a.offset) + ", " + std::to_string(a.offset + a.bytes) + ") of the dynamic shared memory)";
  };
  std::string text;
  if (before && addr < before->hi) {
    text = "byte offset " + std::to_string(addr - before->lo) + " of " + named(*before) + ", running " +
           byte_count_text(addr + size - before->hi) + " past its end";
  } else if (before && (!after || addr - before->hi < after->lo - addr)) {  // nearer the end of one
    text = (addr == before->hi ? std::string("the first byte") : byte_count_text(addr - before->hi)) +
           " past the end of " + named(*before);
  } else if (after) {                                                        // than the start of the next
    text = byte_count_text(after->lo - addr) + " before the start of " + named(*after);
  } else {
    text = "dynamic shared memory byte offset " + std::to_string(addr - g_regions[0].lo);
  }
  return text;
}

// Ends the launch when [addr, addr + size) leaves the arrays of the running thread's layout of the
// dynamic shared memory (SharedLayout), or, before it began one, the bytes the launch asked for.
void check_dynamic_bounds(const Region& dyn, uintptr_t addr, size_t size, uint8_t kind, const void* ra) {
  const std::vector<SharedArray>* layout = thread_layout(T.tid);
  if (layout ? array_holding(*layout, addr, size) != nullptr : addr + size <= dyn.lo + g_dynamic_size) return;
  char size_text[64];
  snprintf(size_text, sizeof size_text, " of %llu bytes at ", (unsigned long long)size);
  const std::string where = layout ? dynamic_place(*layout, addr, size)
                                   : std::string("dynamic shared memory byte offset ") +
                                         std::to_string(addr - dyn.lo) + " (past the end of the " +
                                         std::to_string(g_dynamic_size) + " bytes the launch asked for)";
  const std::string msg = std::string("out-of-bounds ") + access_word(kind) + size_text + where + " at " +
                          site_text((uint32_t)((uintptr_t)ra - T.module_base));
  fail_launch(CUEMU_ERR_BAD_ACCESS, msg.c_str());
}

// An access whose first or last byte lies in a guard span ends the launch as a fault there.
inline void check_guards(const Region* first, uintptr_t addr, size_t size, uint8_t kind, const void* ra) {
  const Region* last = first && addr + size <= first->hi ? first : find_region(addr + size - 1);
  const Region* hit = first && first->space == CUEMU_GUARD ? first
                      : last && last->space == CUEMU_GUARD ? last : nullptr;
  if (!hit) return;
  const uintptr_t at = hit == first ? addr : hit->lo;
  fail_with_fault(at, kind & (ACCESS_WRITE | ACCESS_ATOMIC) ? 1 : 0, (uint32_t)((uintptr_t)ra - T.module_base));
}

inline void record(uintptr_t addr, size_t size, uint8_t kind, const void* ra) {
  poll_interrupt(ra);  // Ctrl-C or the time limit while a kernel busy-waits on watched memory
  if (!T.active || size == 0) return;
  if (addr - T.stack_lo < T.stack_len) return;  // local memory
  // A store completes before the thread's next store or atomic (or sync point), but g++
  // instruments an aggregate copy (`out[i] = in[j]`, a uint4) store first: reads wait.
  if (T.settle && (kind & (ACCESS_WRITE | ACCESS_ATOMIC))) settle_observers();
  const Region* r = find_region(addr);
  if (!g_guards.empty()) check_guards(r, addr, size, kind, ra);
  if (!r) return;
  if (r->space == CUEMU_SHARED_STATIC) check_static_bounds(*r, addr, size, kind, ra);
  if (r->space == CUEMU_SHARED_DYNAMIC && g_dynamic_carvable) check_dynamic_bounds(*r, addr, size, kind, ra);
  const size_t room = r->hi - addr;
  Access a;
  a.addr = addr;
  a.size = (uint32_t)(size < room ? size : room);
  a.kind = kind;
  a.region = r;
  a.tid = T.tid;
  a.site = (uint32_t)((uintptr_t)ra - T.module_base);
  if (async_pending_bytes && r->space != CUEMU_GLOBAL) async_check(a);  // may end the launch
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->access(a);
}

// The watched regions of g_regions, in the layout record() searches.
void rebuild_watch() {
  g_watch.clear();
  for (const Region& r : g_regions)
    if (r.watched && r.hi > r.lo) g_watch.push_back(Watch{r.lo, r.hi - r.lo, &r});
  for (const Region& r : g_guards) g_watch.push_back(Watch{r.lo, r.hi - r.lo, &r});
  if (g_shadow_ready && (!g_watch.empty() || !g_marked.empty())) mark_watched(g_watch);
  T.watch = g_watch.data();
  T.nwatch = (uint32_t)g_watch.size();
}

// ---- locating a module and its static __shared__ variables ----------------------------
struct TlsQuery {
  uintptr_t base;
  uintptr_t lo;
  size_t size;
};

int find_tls_block(dl_phdr_info* info, size_t, void* data) {
  TlsQuery* q = static_cast<TlsQuery*>(data);
  if ((uintptr_t)info->dlpi_addr != q->base) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      q->size = info->dlpi_phdr[i].p_memsz;
      q->lo = (uintptr_t)info->dlpi_tls_data;
    }
  return 1;
}

uintptr_t module_base_of(const void* code) {
  static const void* last_code = nullptr;
  static uintptr_t last_base = 0;
  if (code != last_code) {
    Dl_info info;
    last_base = dladdr(code, &info) ? (uintptr_t)info.dli_fbase : 0;
    last_code = code;
  }
  return last_base;
}

// The calling OS thread's TLS block of the module at `base`: static __shared__ variables are
// thread_local, and every thread_local of a module is one (plus the registry's probe byte).
struct TlsCacheEntry {
  uintptr_t base, lo;
  size_t size;
};
thread_local TlsCacheEntry t_tls_cache[16];
thread_local uint32_t t_tls_count = 0;

void static_shared_range(const cuemu_launch_params* p, uintptr_t base, uintptr_t* lo, size_t* size) {
  *lo = 0;
  *size = 0;
  if (!p->tls_probe || !base) return;
  for (uint32_t i = 0; i < t_tls_count; ++i)
    if (t_tls_cache[i].base == base) {
      *lo = t_tls_cache[i].lo;
      *size = t_tls_cache[i].size;
      return;
    }
  p->tls_probe();  // allocates this thread's block (glibc allocates dynamic TLS lazily)
  TlsQuery q{base, 0, 0};
  dl_iterate_phdr(find_tls_block, &q);
  if (!q.lo) q.size = 0;
  t_tls_cache[t_tls_count % 16] = TlsCacheEntry{base, q.lo, q.size};
  ++t_tls_count;
  *lo = q.lo;
  *size = q.size;
}

}  // namespace

// ---- scheduler interface --------------------------------------------------------------
// The region table is built for every launch (the emulated asynchronous copies and ldmatrix check
// addresses against it); observers, and the shadow bytes that route accesses to them, only when
// the launch checks something.
bool trace_launch_begin(const cuemu_launch_params* p, uint32_t nthreads, uintptr_t stacks_lo,
                        size_t stacks_len) {
  T = TraceState();
  atomic_site = 0;   // a launch that ended in an atomic's fault left it set
  if (p->checks & CUEMU_CHECK_RACES) T.observers[T.nobservers++] = racecheck_observer();
  if (p->checks & CUEMU_CHECK_TRAFFIC) T.observers[T.nobservers++] = traffic_observer();
  count_launch_paths((p->checks & CUEMU_CHECK_TRAFFIC) != 0);
  if (p->checks & CUEMU_CHECK_BANKS) T.observers[T.nobservers++] = banks_observer();
  T.module_base = module_base_of((const void*)p->invoke);
  T.poison = p->poison;
  g_static_variables.clear();
  T.stack_lo = stacks_lo;
  T.stack_len = stacks_len;
  g_regions.assign(2 + p->nregions, Region());
  Region& dyn = g_regions[0];
  dyn.lo = (uintptr_t)p->dyn_smem;
  g_dynamic_size = p->dyn_smem_size;
  g_dynamic_carvable = p->dyn_smem_room > p->dyn_smem_size;
  dyn.hi = dyn.lo + (g_dynamic_carvable ? p->dyn_smem_room : p->dyn_smem_size);
  dyn.space = CUEMU_SHARED_DYNAMIC;
  g_layouts.clear();
  g_thread_layout.assign(nthreads, 0);
  Region& stat = g_regions[1];
  size_t static_size;
  static_shared_range(p, T.module_base, &stat.lo, &static_size);
  stat.hi = stat.lo + static_size;
  stat.space = CUEMU_SHARED_STATIC;
  for (uint32_t i = 0; i < p->nregions; ++i) {
    Region& g = g_regions[2 + i];
    g.lo = p->regions[i].lo;
    g.hi = p->regions[i].hi;
    g.space = CUEMU_GLOBAL;
    g.writable = p->regions[i].writable != 0;
    g.sector_phase = p->regions[i].sector_phase;
  }
  for (uint32_t i = 0; i < g_regions.size(); ++i) g_regions[i].index = i;
  g_guards.clear();
  if (g_shadow_ready)  // only the instrumentation sees accesses there (no fault would)
    for (uint32_t i = 0; i < p->nguards; ++i) {
      Region g = Region();
      g.lo = p->guards[i].lo;
      g.hi = p->guards[i].hi;
      g.space = CUEMU_GUARD;
      g.index = UINT32_MAX;
      if (g.hi > g.lo) g_guards.push_back(g);
    }
  async_launch_begin(nthreads);
  if (T.nobservers) {
    LaunchInfo info;
    for (int d = 0; d < 3; ++d) {
      info.grid[d] = p->grid[d];
      info.block[d] = p->block[d];
    }
    info.nthreads = nthreads;
    info.regions = g_regions.data();
    info.nregions = (uint32_t)g_regions.size();
    for (uint32_t i = 0; i < T.nobservers; ++i)
      if (!T.observers[i]->launch_begin(info)) {
        for (uint32_t j = 0; j <= i; ++j) T.observers[j]->launch_end();
        T.nobservers = 0;
        return false;
      }
  }
  // A module that carves its dynamic shared memory has room mapped past the bytes the launch asked
  // for, which no guard covers: every access of the region is checked (check_dynamic_bounds), an
  // access before the thread's first layout included, with or without observers.
  if (g_dynamic_carvable && g_shadow_ready && dyn.hi > dyn.lo) dyn.watched = true;
  // Without observers only the guards (and carved shared memory) are watched; the last launch's
  // other shadow bytes are cleared.
  rebuild_watch();
  T.active = T.nobservers > 0 || !g_guards.empty() || dyn.watched;
  return true;
}

void trace_launch_end() {
  if (T.settle) settle_observers();
  T.active = false;
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->launch_end();
}

void trace_block_begin(uint64_t block_linear) {
  ++g_block_serial;  // every static __shared__ variable is poisoned again when first reached
  if (g_dynamic_carvable) {  // each block carves its dynamic shared memory anew
    g_layouts.clear();
    std::fill(g_thread_layout.begin(), g_thread_layout.end(), 0u);
  }
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->block_begin(block_linear);
}

void trace_block_end() {
  if (T.settle) settle_observers();
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->block_end();
}

void trace_set_thread(uint32_t tid) { T.tid = tid; }

void trace_sync_point() {
  if (T.settle) settle_observers();
}

void trace_barrier() {
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->barrier();
}

void trace_warp_sync(uint32_t warp, uint32_t lanes) {
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->warp_sync(warp, lanes);
}

void trace_fence() {
  if (!T.active) return;
  if (T.settle) settle_observers();   // the thread's last store has completed at its fence
  for (uint32_t i = 0; i < T.nobservers; ++i) T.observers[i]->fence(T.tid);
}

void request_settle() { T.settle = true; }

void trace_access(uintptr_t addr, size_t size, uint8_t kind, const void* ra) { record(addr, size, kind, ra); }

void trace_access_as(uint32_t tid, uintptr_t addr, size_t size, uint8_t kind, const void* ra) {
  const uint32_t running = T.tid;
  T.tid = tid;
  record(addr, size, kind, ra);
  T.tid = running;
}

uint32_t trace_thread() { return T.tid; }

uint8_t trace_poison() { return T.poison <= 255 ? (uint8_t)T.poison : 0xFF; }

uint32_t trace_site(const void* ra) { return (uint32_t)((uintptr_t)ra - T.module_base); }

int trace_region_of(uintptr_t addr, size_t size) {
  for (const Region& r : g_regions)
    if (addr >= r.lo && addr < r.hi && size <= r.hi - addr) return (int)r.index;
  return -1;
}

const Region* trace_region(uint32_t index) { return &g_regions[index]; }

const Region* trace_region_at(uintptr_t addr) {
  for (const Region& r : g_regions)
    if (addr >= r.lo && addr < r.hi) return &r;
  return nullptr;
}

// A fiber reached the declaration of the static __shared__ variable boxed at box_lo: the block's
// first one poisons the value, and from then on the static shared memory is watched (in an
// instrumented module), so that record() checks each access against the boxes.
void static_shared_reached(uintptr_t box_lo, size_t value_size, size_t box_size) {
  StaticVariable* v = nullptr;
  for (StaticVariable& s : g_static_variables)
    if (s.box_lo == box_lo) v = &s;
  if (!v) {
    g_static_variables.push_back(StaticVariable{box_lo, box_lo + CUEMU_STATIC_SHARED_GUARD,
                                                box_lo + CUEMU_STATIC_SHARED_GUARD + value_size,
                                                box_lo + box_size, 0});
    v = &g_static_variables.back();
  }
  if (v->block == g_block_serial) return;
  v->block = g_block_serial;
  if (T.poison <= 255) memset(reinterpret_cast<void*>(v->value_lo), (int)T.poison, value_size);
  Region& stat = g_regions[1];
  if (g_shadow_ready && !stat.watched && stat.hi > stat.lo) {
    stat.watched = true;
    rebuild_watch();
    T.active = true;
  }
}

uint64_t dynamic_shared_gpu_offset(uint32_t tid, uint64_t offset) {
  if (!g_dynamic_carvable || g_layouts.empty()) return offset;
  const uintptr_t addr = g_regions[0].lo + offset;
  const std::vector<SharedArray>* own = thread_layout(tid);  // the thread's own layout first, then any
  const SharedArray* a = own ? array_holding(*own, addr) : nullptr;
  for (size_t i = 0; !a && i < g_layouts.size(); ++i) a = array_holding(g_layouts[i], addr);
  return a ? a->offset + (addr - a->lo) : offset;
}

// The calling thread begins its next layout of the dynamic shared memory (cuemu_shared_layout_begin).
void shared_layout_begun() {
  if (T.tid >= g_thread_layout.size()) return;
  const uint32_t begun = ++g_thread_layout[T.tid];
  if (begun > g_layouts.size()) g_layouts.emplace_back();
}

// The calling thread takes array `index` of its layout (cuemu_shared_array); the first thread to
// take it places it, the others must take the same one. Returns its address here.
uintptr_t shared_array_taken(uintptr_t base, uint64_t offset, uint64_t bytes, uint64_t align, uint32_t index,
                             const char* name, const void* ra) {
  const uint32_t begun = T.tid < g_thread_layout.size() ? g_thread_layout[T.tid] : 0;
  const std::string site = site_text((uint32_t)((uintptr_t)ra - T.module_base));
  char msg[512];
  if (!begun) {
    snprintf(msg, sizeof msg, "shared array '%s' taken outside a SharedLayout at %s", name, site.c_str());
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
  }
  if (!g_dynamic_carvable || base != g_regions[0].lo) {
    snprintf(msg, sizeof msg, "shared array '%s' carved from %s at %s: a SharedLayout carves the dynamic "
             "shared memory (extern __shared__) of a module that includes shared_layout.cuh", name,
             base == g_regions[0].lo ? "dynamic shared memory mapped without gaps" : "another address", site.c_str());
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
  }
  if (align && offset % align) {
    snprintf(msg, sizeof msg, "shared array '%s' starts at byte offset %llu, not a multiple of its element's "
             "alignment (%llu bytes), at %s", name, (unsigned long long)offset, (unsigned long long)align,
             site.c_str());
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
  }
  std::vector<SharedArray>& layout = g_layouts[begun - 1];
  if (index < layout.size()) {
    const SharedArray& a = layout[index];
    if (a.offset != offset || a.bytes != bytes || strcmp(a.name, name) != 0) {
      snprintf(msg, sizeof msg, "shared array %u of layout %u taken as '%s' (%llu bytes at %llu) at %s, but "
               "another thread of the block took it as '%s' (%llu bytes at %llu)", index, begun, name,
               (unsigned long long)bytes, (unsigned long long)offset, site.c_str(), a.name,
               (unsigned long long)a.bytes, (unsigned long long)a.offset);
      fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
    }
    return a.lo;
  }
  if (offset + bytes > g_dynamic_size) {
    snprintf(msg, sizeof msg, "shared array '%s' (%llu bytes at byte offset %llu) ends past the %llu bytes of "
             "dynamic shared memory the launch asked for, at %s", name, (unsigned long long)bytes,
             (unsigned long long)offset, (unsigned long long)g_dynamic_size, site.c_str());
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
  }
  if (index != layout.size() || index >= CUEMU_SHARED_ARRAYS_MAX) {
    snprintf(msg, sizeof msg, "shared array '%s' taken as array %u of layout %u (%zu taken; at most %d) at %s",
             name, index, begun, layout.size(), (int)CUEMU_SHARED_ARRAYS_MAX, site.c_str());
    fail_launch(CUEMU_ERR_BAD_ACCESS, msg);
  }
  const uintptr_t lo = base + offset + (uintptr_t)index * CUEMU_SHARED_ARRAY_GAP;
  layout.push_back(SharedArray{offset, bytes, lo, lo + bytes, name});
  return lo;
}

// ---- words for reports (launch.py spells out the @ tokens) ------------------------------
std::string site_text(uint32_t site) {
  char buf[32];
  snprintf(buf, sizeof buf, CUEMU_SITE_TOKEN, site);  // file:line
  return buf;
}

std::string byte_count_text(uint64_t n) { return n == 1 ? std::string("1 byte") : std::to_string(n) + " bytes"; }

std::string place_text(int region, uint64_t offset) {
  char buf[96];
  if (region == 0) snprintf(buf, sizeof buf, "dynamic shared memory byte offset %llu", (unsigned long long)offset);
  else snprintf(buf, sizeof buf, CUEMU_STATIC_TOKEN, (unsigned long long)offset);  // the variable's name
  return buf;
}

std::string address_text(uintptr_t addr) {
  const Region* r = trace_region_at(addr);
  char buf[64];
  if (r && r->index <= 1) return place_text((int)r->index, addr - r->lo);
  if (r) snprintf(buf, sizeof buf, CUEMU_ARG_TOKEN, r->index - 2, (unsigned long long)(addr - r->lo));
  else snprintf(buf, sizeof buf, "address 0x%llx", (unsigned long long)addr);
  return buf;
}

bool trace_watch_shared() {
  if (!g_shadow_ready) return false;
  bool changed = false;
  for (int i = 0; i < 2; ++i) {
    Region& r = g_regions[i];
    if (!r.watched && r.hi > r.lo) r.watched = changed = true;
  }
  if (changed) rebuild_watch();
  T.active = true;
  return true;
}

}  // namespace cuemu

// Whether the shadow is mapped: build.py instruments modules only then (the hooks of an
// instrumented module read the shadow on every access).
CUEMU_EXPORT int cuemu_shadow_ready(void) { return cuemu::g_shadow_ready ? 1 : 0; }

// ---- the hooks kernel modules call ---------------------------------------------------------
using cuemu::ACCESS_ATOMIC;
using cuemu::ACCESS_READ;
using cuemu::ACCESS_WRITE;

namespace cuemu {
namespace {

// Whether the granule of addr's first byte is watched: record() looks up the region of the
// first byte only, which lies in a marked granule when there is one. Addresses past the 47 bits
// the shadow covers are nobody's (the access itself faults, in the kernel's code).
inline bool watched(uintptr_t addr, const void* ra) {
  poll_interrupt(ra);  // Ctrl-C or the time limit while a kernel loops on any memory
  return (addr >> 47) == 0 && *reinterpret_cast<const uint8_t*>(kShadowOffset + (addr >> 3)) != 0;
}

inline void hook(const void* addr, size_t size, uint8_t kind, const void* ra) {
  if (__builtin_expect(watched((uintptr_t)addr, ra), 0)) record((uintptr_t)addr, size, kind, ra);
}

// A range (a struct copy, a memcpy g++ instruments whole) may start in unwatched memory and end in
// a guard span: its last byte is looked at too.
inline void range_hook(const void* addr, size_t size, uint8_t kind, const void* ra) {
  const uintptr_t lo = (uintptr_t)addr;
  if (__builtin_expect(watched(lo, ra) || (size > 1 && watched(lo + size - 1, ra)), 0)) record(lo, size, kind, ra);
}

// An access of 2, 4, 8 or 16 bytes whose type g++ takes to be naturally aligned (it instruments
// a less aligned one as a range) at an address that is not a multiple of its size: the GPU ends
// the launch with cudaErrorMisalignedAddress (a uint4 load at an odd element, a 2-byte load of
// fp8 codes at an odd byte), where the CPU would quietly carry it out.
[[noreturn]] __attribute__((noinline, cold)) void misaligned(uintptr_t addr, size_t size, uint8_t kind,
                                                          const void* ra) {
  char head[64];
  snprintf(head, sizeof head, "misaligned %u-byte %s at ", (unsigned)size, access_word(kind));
  char tail[160];
  snprintf(tail, sizeof tail,
           " (%u bytes past a multiple of %u; a GPU ends the launch with cudaErrorMisalignedAddress) at ",
           (unsigned)(addr % size), (unsigned)size);
  const std::string msg =
      head + address_text(addr) + tail + site_text((uint32_t)((uintptr_t)ra - T.module_base));
  fail_launch(CUEMU_ERR_BAD_ACCESS, msg.c_str());
}

inline void check_aligned(const void* addr, size_t size, uint8_t kind, const void* ra) {
  if (__builtin_expect(((uintptr_t)addr & (size - 1)) != 0, 0)) misaligned((uintptr_t)addr, size, kind, ra);
}

inline void aligned_hook(const void* addr, size_t size, uint8_t kind, const void* ra) {
  check_aligned(addr, size, kind, ra);
  hook(addr, size, kind, ra);
}

}  // namespace
}  // namespace cuemu

// What g++ 12's ThreadSanitizer pass emits for cupykv's kernels and the tests' (`nm -u` of a
// module): sized and range accesses, and a constructor calling __tsan_init. Plain __atomic
// builtins would call __tsan_atomic*, which are not defined here (CUDA atomics come from
// cuemu.h, and __threadfence() calls cuemu_threadfence), so such a module fails to load.
#define CUEMU_SIZED_HOOKS(N)                                                              \
  CUEMU_EXPORT void __tsan_read##N(const void* addr) {                                    \
    cuemu::aligned_hook(addr, N, ACCESS_READ, __builtin_return_address(0));               \
  }                                                                                       \
  CUEMU_EXPORT void __tsan_write##N(const void* addr) {                                   \
    cuemu::aligned_hook(addr, N, ACCESS_WRITE, __builtin_return_address(0));              \
  }
CUEMU_SIZED_HOOKS(1)
CUEMU_SIZED_HOOKS(2)
CUEMU_SIZED_HOOKS(4)
CUEMU_SIZED_HOOKS(8)
CUEMU_SIZED_HOOKS(16)
#undef CUEMU_SIZED_HOOKS

CUEMU_EXPORT void __tsan_read_range(const void* addr, size_t size) {
  cuemu::range_hook(addr, size, ACCESS_READ, __builtin_return_address(0));
}
CUEMU_EXPORT void __tsan_write_range(const void* addr, size_t size) {
  cuemu::range_hook(addr, size, ACCESS_WRITE, __builtin_return_address(0));
}
// Called by a constructor of each module; there is no runtime library to start.
CUEMU_EXPORT void __tsan_init(void) {}
// Emitted at every function's entry and exit by g++ 9 and 10, which cannot leave them out
// (build.py passes --param tsan-instrument-func-entry-exit=0 to newer ones); nothing to do.
CUEMU_EXPORT void __tsan_func_entry(void*) {}
CUEMU_EXPORT void __tsan_func_exit(void) {}

CUEMU_EXPORT void* __wrap_memcpy(void* dst, const void* src, size_t n) {
  cuemu::copy_site = cuemu::trace_site(__builtin_return_address(0));
  cuemu::record((uintptr_t)src, n, ACCESS_READ, __builtin_return_address(0));
  cuemu::record((uintptr_t)dst, n, ACCESS_WRITE, __builtin_return_address(0));
  return cuemu_copy(dst, src, n);  // not libc's: a fault in it must end the launch cleanly
}
CUEMU_EXPORT void* __wrap_memmove(void* dst, const void* src, size_t n) {
  cuemu::copy_site = cuemu::trace_site(__builtin_return_address(0));
  cuemu::record((uintptr_t)src, n, ACCESS_READ, __builtin_return_address(0));
  cuemu::record((uintptr_t)dst, n, ACCESS_WRITE, __builtin_return_address(0));
  return cuemu_move(dst, src, n);
}
CUEMU_EXPORT void* __wrap_memset(void* dst, int value, size_t n) {
  cuemu::copy_site = cuemu::trace_site(__builtin_return_address(0));
  cuemu::record((uintptr_t)dst, n, ACCESS_WRITE, __builtin_return_address(0));
  return cuemu_fill(dst, value, n);
}

// ---- array bounds (build.py's BOUNDS_FLAGS: GCC's -fsanitize=bounds, without its runtime) ----
// What UndefinedBehaviorSanitizer passes for an index outside an array's stated bound. The index
// comes inline when its type is at most 64 bits wide (info: log2 of the width, times 2, plus 1 if
// signed); array_type->name is the type as the source spells it ('float [2][4]').
namespace cuemu {
namespace {
struct UbsanSourceLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanTypeDescriptor {
  uint16_t kind, info;
  char name[1];
};
struct UbsanOutOfBoundsData {
  UbsanSourceLocation location;
  const UbsanTypeDescriptor* array_type;
  const UbsanTypeDescriptor* index_type;
};

[[noreturn]] __attribute__((noinline, cold)) void out_of_bounds_index(const UbsanOutOfBoundsData* data,
                                                                      uintptr_t index, const void* ra) {
  const unsigned width = 1u << (data->index_type->info >> 1);
  const bool is_signed = data->index_type->info & 1;
  char index_text[48];
  if (width > 64) {
    snprintf(index_text, sizeof index_text, "a %u-bit index", width);
  } else if (is_signed) {
    const int shift = 64 - (int)width;
    snprintf(index_text, sizeof index_text, "index %lld", (long long)((int64_t)((uint64_t)index << shift) >> shift));
  } else {
    snprintf(index_text, sizeof index_text, "index %llu", (unsigned long long)index);
  }
  char column[32];
  snprintf(column, sizeof column, " (column %u)", (unsigned)data->location.column);
  const std::string msg = std::string("out-of-bounds ") + index_text + " into an array of type " +
                          data->array_type->name + " at " +
                          site_text((uint32_t)((uintptr_t)ra - T.module_base)) + column;
  fail_launch(CUEMU_ERR_BAD_ACCESS, msg.c_str());
}
}  // namespace
}  // namespace cuemu

CUEMU_EXPORT void __ubsan_handle_out_of_bounds_abort(void* data, uintptr_t index) {
  cuemu::out_of_bounds_index(static_cast<const cuemu::UbsanOutOfBoundsData*>(data), index,
                             __builtin_return_address(0));
}
CUEMU_EXPORT void __ubsan_handle_out_of_bounds(void* data, uintptr_t index) {   // a recoverable build's
  cuemu::out_of_bounds_index(static_cast<const cuemu::UbsanOutOfBoundsData*>(data), index,
                             __builtin_return_address(0));
}

CUEMU_EXPORT void cuemu_atomic_access(void* addr, unsigned size, void* site) {
  cuemu::check_aligned(addr, size, ACCESS_ATOMIC, site);
  cuemu::record((uintptr_t)addr, size, ACCESS_ATOMIC, site);
  cuemu::atomic_site = cuemu::trace_site(site);   // the helper's own access comes next
}

CUEMU_EXPORT void cuemu_atomic_done(void) { cuemu::atomic_site = 0; }

CUEMU_EXPORT void cuemu_threadfence(void) { cuemu::trace_fence(); }

CUEMU_EXPORT void cuemu_shared_layout_begin(void) { cuemu::shared_layout_begun(); }

CUEMU_EXPORT void* cuemu_shared_array(void* base, unsigned long long offset, unsigned long long bytes,
                                      unsigned long long align, unsigned index, const char* name) {
  return reinterpret_cast<void*>(
      cuemu::shared_array_taken((uintptr_t)base, offset, bytes, align, index, name, __builtin_return_address(0)));
}

// Names the shared arrays (SharedLayout) of the last block's layouts that hold byte `offset` of the
// dynamic shared memory, for race reports, and returns the byte's offset as on a GPU (by the first
// of them); writes "" and returns `offset` when none does (or nothing was carved).
CUEMU_EXPORT unsigned long long cuemu_dynamic_shared_place(unsigned long long offset, char* out, unsigned size) {
  std::string text;
  unsigned long long gpu_offset = offset;
  const uintptr_t addr = cuemu::g_regions.empty() ? 0 : cuemu::g_regions[0].lo + offset;
  for (size_t i = 0; i < cuemu::g_layouts.size(); ++i)
    if (const cuemu::SharedArray* a = cuemu::array_holding(cuemu::g_layouts[i], addr)) {
      if (text.empty()) gpu_offset = a->offset + (addr - a->lo);
      else text += "; ";
      text += "shared array '" + std::string(a->name) + "' byte offset " + std::to_string(addr - a->lo) +
              (cuemu::g_layouts.size() > 1 ? " (layout " + std::to_string(i + 1) + ")" : "");
    }
  snprintf(out, size, "%s", text.c_str());
  return gpu_offset;
}

CUEMU_EXPORT void cuemu_static_shared(void* box, size_t value_size, size_t box_size) {
  cuemu::static_shared_reached((uintptr_t)box, value_size, box_size);
}
