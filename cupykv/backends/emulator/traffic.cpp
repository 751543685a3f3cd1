// traffic.cpp: the memory-traffic counter, an Observer of the access layer (cuemu_trace.h).
//
// On for launches with CUEMU_CHECK_TRAFFIC (launch.py sets it inside emulator.traffic()).
// Per global region of the launch (array arguments; shared memory is not watched) and per kind
// of access (load, store, atomic) it counts:
//  * bytes and accesses of single threads, repeats included;
//  * which bytes were touched, one bit per byte, so that the set of distinct 32-byte sectors
//    (and exactly which rows of an array) can be read back. Sectors are counted from the
//    region's allocation start (cuemu_region.sector_phase), as a GPU allocation starts on a
//    sector boundary, not from the region's first byte;
//  * warp-level requests and the distinct sectors each one touches, the figure
//    Nsight Compute reports as sectors per request. A request is one dynamic instance of one
//    memory instruction across the lanes of a warp. Lanes run as separate fibers here, so a
//    lane's access is matched to its warp's other lanes by (call site, kind, how often this
//    lane has reached that site since its last warp collective or barrier): the n-th visit of
//    a site by every lane is one request. Lanes that diverge at a site without a warp
//    collective in between (one lane visits it more often than another, then they reconverge)
//    are paired by visit count, not by the branch they took: an approximation.
// cuemu_traffic() returns the results of the last launch; they stay valid until the next one.
//
// Traffic launches also count the outcomes of the run-time tests that kernels mark
// CUPYKV_COMMON_PATH (kernels/common.cuh: the tests whose common outcome `python -m cupykv check
// --steps` assumes): per (source line, value), how many thread evaluations gave it. So a test can
// hold how often a kernel leaves its common path (a step masked, a rescale) at run time.
#include <string.h>
#include <sys/mman.h>

#include <map>
#include <tuple>
#include <vector>

#include "cuemu_requests.h"
#include "cuemu_trace.h"

#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace cuemu {
namespace {

constexpr uint64_t kRequestMark = ~0ull;  // the sector word of a request's own entry

class Traffic final : public Observer {
 public:
  bool launch_begin(const LaunchInfo& info) override;
  void block_begin(uint64_t) override;
  void access(const Access& a) override;
  void barrier() override;
  void warp_sync(uint32_t warp, uint32_t lanes) override;

  std::vector<cuemu_traffic> results;

 private:
  uint64_t* map_bits(size_t words);
  void unmap_bits();

  std::vector<uint32_t> phase_;   // per region: sector_phase (global regions)
  WarpRequests requests_;
  KeyTable sectors_;              // (request, instance, sector) and (request, instance, mark)
  void* bits_ = nullptr;
  size_t bits_len_ = 0;
};

uint64_t* Traffic::map_bits(size_t words) {
  if (!words) return nullptr;
  void* p = mmap(nullptr, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return nullptr;
  bits_ = p;
  bits_len_ = words * 8;
  return static_cast<uint64_t*>(p);
}

void Traffic::unmap_bits() {
  if (bits_) munmap(bits_, bits_len_);
  bits_ = nullptr;
  bits_len_ = 0;
}

bool Traffic::launch_begin(const LaunchInfo& info) {
  unmap_bits();  // the previous launch's results go now
  results.assign(info.nregions, cuemu_traffic());
  phase_.assign(info.nregions, 0);
  requests_.launch_begin(info.nthreads);
  // One mapping holds three bitmaps per global region (committed only where touched).
  size_t words = 0;
  std::vector<size_t> first(info.nregions, 0);
  for (uint32_t i = 0; i < info.nregions; ++i) {
    Region& r = info.regions[i];
    if (r.hi == r.lo || r.space != CUEMU_GLOBAL) continue;
    r.watched = true;
    phase_[i] = (uint32_t)(r.sector_phase % 32);
    results[i].nbits = phase_[i] + (r.hi - r.lo);
    first[i] = words;
    words += 3 * ((results[i].nbits + 63) / 64);
  }
  uint64_t* bits = map_bits(words);
  if (words && !bits) return false;
  for (uint32_t i = 0; i < info.nregions; ++i) {
    const size_t n = (results[i].nbits + 63) / 64;
    if (!n) continue;
    for (int k = 0; k < 3; ++k) results[i].bits[k] = bits + first[i] + k * n;
  }
  return true;
}

void Traffic::block_begin(uint64_t) {
  requests_.block_begin();
  sectors_.clear();
}

void Traffic::barrier() { requests_.barrier(); }

void Traffic::warp_sync(uint32_t warp, uint32_t lanes) { requests_.warp_sync(warp, lanes); }

void Traffic::access(const Access& a) {
  const uint32_t region = a.region->index;
  cuemu_traffic& t = results[region];
  const int kind = (a.kind & ACCESS_ATOMIC) ? 2 : (a.kind & ACCESS_WRITE) ? 1 : 0;
  uint64_t* bits = const_cast<uint64_t*>(t.bits[kind]);
  if (!bits || !a.size) return;  // shared memory (watched by the race checker): not counted
  t.bytes[kind] += a.size;
  ++t.accesses[kind];

  // The bytes touched, counted from the sector boundary before the region's start.
  const uint64_t first = a.addr - a.region->lo + phase_[region], end = first + a.size;
  for (uint64_t w = first >> 6; w <= (end - 1) >> 6; ++w) {
    const uint64_t lo = w << 6 > first ? 0 : first & 63, hi = (w + 1) << 6 < end ? 64 : end - (w << 6);
    bits[w] |= (hi - lo == 64 ? ~0ull : ((1ull << (hi - lo)) - 1)) << lo;
  }

  // Which request of its warp this access belongs to: the lane's n-th visit of the site.
  bool fresh;
  const WarpRequests::Request r = requests_.of(a.site, kind, a.tid, region);
  sectors_.find(r.key, r.instance, kRequestMark, &fresh);
  if (fresh) ++t.requests[kind];
  for (uint64_t s = first >> 5; s <= (end - 1) >> 5; ++s) {
    sectors_.find(r.key, r.instance, s, &fresh);
    if (fresh) ++t.request_sectors[kind];
  }
}

Traffic* g_traffic = nullptr;

// Outcome counts of the current (or last) traffic launch, by (file, line, value), and its
// tensor-core mma instructions, by (linear block index, warp of the block).
bool g_counting_paths = false;
std::map<std::tuple<const char*, int, long long>, uint64_t> g_outcome_counts;
std::vector<cuemu_path_outcome> g_outcome_results;
std::map<std::pair<uint64_t, uint32_t>, uint64_t> g_mma_counts;
std::vector<cuemu_warp_mma> g_mma_results;

}  // namespace

void count_launch_paths(bool on) {
  g_counting_paths = on;
  if (on) {
    g_outcome_counts.clear();
    g_mma_counts.clear();
  }
}

void count_warp_mma(uint64_t block, uint32_t warp) {
  if (g_counting_paths) ++g_mma_counts[std::make_pair(block, warp)];
}

Observer* traffic_observer() {
  if (!g_traffic) g_traffic = new Traffic();
  return g_traffic;
}

}  // namespace cuemu

// The traffic of every region of the last launch that counted it (cuemu_traffic, one per region:
// dynamic shared memory, static __shared__ variables, then the argument regions); valid until
// the next launch.
CUEMU_EXPORT uint32_t cuemu_traffic_results(const cuemu_traffic** out) {
  cuemu::Traffic* t = cuemu::g_traffic;
  if (!t) {
    *out = nullptr;
    return 0;
  }
  *out = t->results.data();
  return (uint32_t)t->results.size();
}

CUEMU_EXPORT void cuemu_count_path_outcome(const char* file, int line, long long value) {
  if (cuemu::g_counting_paths) ++cuemu::g_outcome_counts[std::make_tuple(file, line, value)];
}

// The outcome counts of the last traffic launch (cuemu_path_outcome, one per (file, line, value));
// valid until the next call.
CUEMU_EXPORT uint32_t cuemu_path_outcome_results(const cuemu_path_outcome** out) {
  auto& results = cuemu::g_outcome_results;
  results.clear();
  for (const auto& entry : cuemu::g_outcome_counts) {
    cuemu_path_outcome r = cuemu_path_outcome();
    r.file = std::get<0>(entry.first);
    r.line = (uint32_t)std::get<1>(entry.first);
    r.value = std::get<2>(entry.first);
    r.count = entry.second;
    results.push_back(r);
  }
  *out = results.data();
  return (uint32_t)results.size();
}

// The mma instructions of the last traffic launch (cuemu_warp_mma, one per warp that issued any, by
// block then warp); valid until the next call.
CUEMU_EXPORT uint32_t cuemu_warp_mma_results(const cuemu_warp_mma** out) {
  auto& results = cuemu::g_mma_results;
  results.clear();
  for (const auto& entry : cuemu::g_mma_counts) {
    cuemu_warp_mma r = cuemu_warp_mma();
    r.block = entry.first.first;
    r.warp = entry.first.second;
    r.count = entry.second;
    results.push_back(r);
  }
  *out = results.data();
  return (uint32_t)results.size();
}
