// banks.cpp: the shared-memory bank counter, an Observer of the access layer (cuemu_trace.h).
//
// On for launches with CUEMU_CHECK_BANKS (launch.py sets it inside emulator.traffic(banks=True)).
// Shared memory has 32 banks of 4-byte words; a warp's request is served in wavefronts, and a
// wavefront reads or writes at most one word of each bank (lanes that touch the same word share
// it: a broadcast, or one of the writes). The model of sm_80 and sm_90 that this counts:
//  * a request of 4-byte (or narrower) accesses is one phase of 32 lanes; of 8-byte accesses two
//    phases (lanes 0-15, 16-31); of wider ones (16-byte vectors, ldmatrix rows, cp.async
//    destinations) four phases of 8 lanes, each phase at most 128 bytes;
//  * a phase takes as many wavefronts as the most distinct words any one bank holds among its
//    lanes' accesses; the request takes the sum over its phases. Its ideal is, per phase, the
//    distinct words / 32 rounded up: what it needs with no two words in one bank.
// A bank is the word's offset from the region's start, modulo 32: shared memory is taken to start
// on a 128-byte boundary (as dynamic shared memory does on sm_80 and sm_90 in a kernel without
// static __shared__ variables; the emulator boxes static variables between guard bytes, so their
// banks are approximate). Requests are matched from the lanes' accesses as for global traffic
// (cuemu_requests.h). Counted: loads, stores and atomics of shared memory by the kernel, ldmatrix
// rows, and each cp.async destination at its issue (not again where it lands). Results are per
// (call site, kind, region), so a report can name the line whose requests conflict; each also
// keeps the highest byte its accesses reached (extent; of dynamic shared memory carved into arrays,
// as on a GPU, without the emulator's gaps), which shows shared memory declared unused.
//
// Adjacent scalar accesses: modules keep a float4 copy one 16-byte access (build.py's
// KEEP_VECTORS_WHOLE), but nvcc also merges adjacent scalar accesses of one aligned piece
// (`p[2 i] = a; p[2 i + 1] = b;`) into one vector instruction where it can prove the alignment,
// which g++ leaves as two calls of the hooks from two call sites. So a thread's 4-byte accesses
// that follow one another (no other shared-memory access of the thread between them) with the
// same kind, each starting where the last ended, are joined; when they cover exactly one aligned
// 8- or 16-byte piece they count as one access of that size at the first one's call site,
// otherwise one by one.
// Such an access is counted when the thread's next one does not join it, and at every warp
// collective it takes part in, barrier and block end, so its request is that of its own epoch.
// cuemu_bank_results() returns the last launch's; they stay valid until the next one.
#include <unordered_map>
#include <vector>

#include "cuemu_requests.h"
#include "cuemu_trace.h"

#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace cuemu {
namespace {

// Tags of the third word of a request's keys in state_ (the low bits are phase, bank or word).
constexpr uint64_t kWordTag = 0ull << 62, kBankTag = 1ull << 62, kMaxTag = 2ull << 62, kPhaseWordsTag = 3ull << 62;
constexpr uint64_t kRequestMark = ~0ull;

class Banks final : public Observer {
 public:
  bool launch_begin(const LaunchInfo& info) override;
  void block_begin(uint64_t) override;
  void access(const Access& a) override;
  void barrier() override {
    flush_all();
    requests_.barrier();
  }
  void warp_sync(uint32_t warp, uint32_t lanes) override {
    for (uint32_t l = 0; l < 32; ++l)
      if (lanes >> l & 1 && warp * 32 + l < pending_.size()) flush(warp * 32 + l);
    requests_.warp_sync(warp, lanes);
  }
  void block_end() override { flush_all(); }

  std::vector<cuemu_bank_site> results;

 private:
  // A thread's accesses not counted yet: 4-byte pieces that may be one vector access (see above).
  struct Pending {
    uintptr_t start = 0;   // offset in the region of the first piece
    uint32_t pieces = 0;   // 0: nothing pending
    uint32_t kind = 0, region = 0;
    uint32_t sites[4] = {0, 0, 0, 0};
  };
  void flush(uint32_t tid);
  void flush_all() {
    for (uint32_t t = 0; t < pending_.size(); ++t) flush(t);
  }
  // Counts one access of `size` bytes at `offset` of its region.
  void count(uint32_t tid, uint32_t site, uint32_t kind, uint32_t region, uint64_t offset, uint32_t size);
  cuemu_bank_site& site_counts(uint32_t site, uint32_t kind, uint32_t region);
  // Counts one more key of a request in state_ and returns the new count.
  uint32_t bump(const WarpRequests::Request& r, uint64_t key) {
    bool fresh;
    return ++*state_.find(r.key, r.instance, key, &fresh);
  }

  WarpRequests requests_;
  KeyTable state_;  // per request: (word), (phase, bank) -> words, (phase) -> max, (phase) -> words, mark
  std::unordered_map<uint64_t, uint32_t> index_;  // (site, kind, region) -> results index
  std::vector<Pending> pending_;                  // per thread of the block
};

bool Banks::launch_begin(const LaunchInfo& info) {
  results.clear();
  index_.clear();
  requests_.launch_begin(info.nthreads);
  pending_.assign(info.nthreads, Pending());
  for (uint32_t i = 0; i < info.nregions && i < 2; ++i)
    if (info.regions[i].hi > info.regions[i].lo) info.regions[i].watched = true;
  return true;
}

void Banks::block_begin(uint64_t) {
  requests_.block_begin();
  state_.clear();
  for (Pending& p : pending_) p.pieces = 0;
}

cuemu_bank_site& Banks::site_counts(uint32_t site, uint32_t kind, uint32_t region) {
  const uint64_t key = (uint64_t)site | (uint64_t)kind << 32 | (uint64_t)region << 34;
  auto found = index_.find(key);
  if (found != index_.end()) return results[found->second];
  index_.emplace(key, (uint32_t)results.size());
  cuemu_bank_site s = cuemu_bank_site();
  s.site = site;
  s.kind = kind;
  s.region = region;
  results.push_back(s);
  return results.back();
}

void Banks::access(const Access& a) {
  const uint32_t region = a.region->index;
  if (region > 1 || (a.kind & ACCESS_LANDING) || !a.size) return;  // global memory; a landing cp.async
  const uint32_t kind = (a.kind & ACCESS_ATOMIC) ? 2 : (a.kind & ACCESS_WRITE) ? 1 : 0;
  const uint64_t offset = a.addr - a.region->lo;
  Pending& p = pending_[a.tid];
  const bool piece = a.size == 4 && offset % 4 == 0 && kind != 2;
  if (p.pieces && piece && p.kind == kind && p.region == region && p.pieces < 4 &&
      offset == p.start + 4 * p.pieces && offset / 16 == p.start / 16) {
    p.sites[p.pieces++] = a.site;
    return;
  }
  flush(a.tid);
  if (piece) {
    p.start = offset;
    p.pieces = 1;
    p.kind = kind;
    p.region = region;
    p.sites[0] = a.site;
    return;
  }
  count(a.tid, a.site, kind, region, offset, a.size);
}

void Banks::flush(uint32_t tid) {
  Pending& p = pending_[tid];
  if (!p.pieces) return;
  const uint32_t bytes = 4 * p.pieces;
  if ((bytes == 8 || bytes == 16) && p.start % bytes == 0) {
    count(tid, p.sites[0], p.kind, p.region, p.start, bytes);
  } else {
    for (uint32_t i = 0; i < p.pieces; ++i) count(tid, p.sites[i], p.kind, p.region, p.start + 4 * i, 4);
  }
  p.pieces = 0;
}

void Banks::count(uint32_t tid, uint32_t site, uint32_t kind, uint32_t region, uint64_t offset, uint32_t size) {
  cuemu_bank_site& counts = site_counts(site, kind, region);
  ++counts.accesses;
  counts.bytes += size;
  const uint64_t gpu_offset = region == 0 ? dynamic_shared_gpu_offset(tid, offset) : offset;
  if (gpu_offset + size > counts.extent) counts.extent = gpu_offset + size;

  const WarpRequests::Request r = requests_.of(site, kind, tid, region);
  bool fresh;
  state_.find(r.key, r.instance, kRequestMark, &fresh);
  if (fresh) ++counts.requests;
  const uint32_t lanes_per_phase = size <= 4 ? 32 : size <= 8 ? 16 : 8;
  const uint64_t phase = (tid % 32) / lanes_per_phase;
  for (uint64_t word = offset >> 2; word <= (offset + size - 1) >> 2; ++word) {
    state_.find(r.key, r.instance, kWordTag | phase << 56 | word, &fresh);
    if (!fresh) continue;  // another lane's (or this lane's) word already: no new wavefront
    const uint32_t in_bank = bump(r, kBankTag | phase << 8 | word % 32);
    uint32_t* most = state_.find(r.key, r.instance, kMaxTag | phase, &fresh);
    if (in_bank > *most) {
      *most = in_bank;
      ++counts.wavefronts;
    }
    if (bump(r, kPhaseWordsTag | phase) % 32 == 1) ++counts.ideal;  // words 1, 33, 65, ... of the phase
  }
}

Banks* g_banks = nullptr;

}  // namespace

Observer* banks_observer() {
  if (!g_banks) g_banks = new Banks();
  return g_banks;
}

}  // namespace cuemu

// The bank wavefronts of the last launch that counted them, one cuemu_bank_site per (call site,
// kind, region) in the order first seen; valid until the next such launch.
CUEMU_EXPORT uint32_t cuemu_bank_results(const cuemu_bank_site** out) {
  cuemu::Banks* b = cuemu::g_banks;
  if (!b) {
    *out = nullptr;
    return 0;
  }
  *out = b->results.data();
  return (uint32_t)b->results.size();
}
