// cuemu_requests.h: warp-level requests out of single-thread accesses, for the observers that
// count per request (traffic.cpp: global sectors; banks.cpp: shared-memory wavefronts).
//
// Runtime-internal. A request is one dynamic instance of one memory instruction across the lanes
// of a warp. Lanes run as separate fibers, so a lane's access is matched to its warp's other lanes
// by (call site, kind, how often this lane has reached that site since its last warp collective
// or barrier): the n-th visit of a site by every lane is one request. Lanes that diverge at a site
// without a warp collective in between (one lane visits it more often than another, then they
// reconverge) are paired by visit count, not by the branch they took: an approximation.
#pragma once
#include <stdint.h>
#include <string.h>

#include <vector>

namespace cuemu {

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// An open-addressing hash table of up to three 64-bit words per key with a 32-bit value,
// emptied in O(1) by bumping a generation (each block starts a new one).
class KeyTable {
 public:
  // The slot of the key, created (value 0) when absent; *fresh tells which.
  uint32_t* find(uint64_t a, uint64_t b, uint64_t c, bool* fresh) {
    if (2 * (used_ + 1) > cap_) grow();
    const uint64_t mask = cap_ - 1;
    const uint64_t h = mix64(a ^ b * 0x9e3779b97f4a7c15ull ^ c * 0xc2b2ae3d27d4eb4full);
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.gen != gen_) {
        s = Slot{a, b, c, 0, gen_};
        ++used_;
        *fresh = true;
        return &s.value;
      }
      if (s.a == a && s.b == b && s.c == c) {
        *fresh = false;
        return &s.value;
      }
    }
  }
  void clear() {
    used_ = 0;
    if (++gen_ == 0) {  // wrapped: stale slots could look current
      for (Slot& s : slots_) s.gen = 0;
      gen_ = 1;
    }
  }

 private:
  struct Slot {
    uint64_t a, b, c;
    uint32_t value, gen;
  };
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    cap_ = cap_ ? 2 * cap_ : 4096;
    slots_.assign(cap_, Slot{0, 0, 0, 0, 0});
    const uint32_t gen = gen_;
    gen_ = 1;
    used_ = 0;
    for (const Slot& s : old)
      if (s.gen == gen) {
        bool fresh;
        *find(s.a, s.b, s.c, &fresh) = s.value;
      }
  }
  std::vector<Slot> slots_;
  uint64_t cap_ = 0, used_ = 0;
  uint32_t gen_ = 1;
};

// Which request of its warp an access belongs to. An observer calls launch_begin, block_begin,
// barrier and warp_sync from its own Observer methods, and of() for each access it counts.
class WarpRequests {
 public:
  // One request: the same (key, instance) for the lanes of one warp instruction.
  struct Request {
    uint64_t key;       // call site, kind, warp and region
    uint64_t instance;  // the epoch and the visit
  };
  void launch_begin(uint32_t nthreads) { epoch_.assign(nthreads, 0); }
  void block_begin() {
    visits_.clear();
    memset(epoch_.data(), 0, epoch_.size() * sizeof(uint32_t));
  }
  // A barrier sets every thread's epoch to one value above all of them, so the lanes of a warp
  // agree again after one.
  void barrier() {
    uint32_t next = 0;
    for (uint32_t e : epoch_) next = e > next ? e : next;
    ++next;
    for (uint32_t& e : epoch_) e = next;
  }
  // A warp collective bumps the epoch of the lanes that took part.
  void warp_sync(uint32_t warp, uint32_t lanes) {
    for (uint32_t l = 0; l < 32; ++l)
      if (lanes >> l & 1 && warp * 32 + l < epoch_.size()) ++epoch_[warp * 32 + l];
  }
  // The request of thread tid's access at `site` of `kind` (0..3) to region `region`.
  Request of(uint32_t site, uint32_t kind, uint32_t tid, uint32_t region) {
    bool fresh;
    const uint64_t thread_site = (uint64_t)site | (uint64_t)kind << 32 | (uint64_t)tid << 34;
    const uint64_t epoch = epoch_[tid];
    const uint64_t n = (*visits_.find(thread_site, epoch, 0, &fresh))++;
    return Request{(uint64_t)site | (uint64_t)kind << 32 | (uint64_t)(tid >> 5) << 34 | (uint64_t)region << 40,
                   epoch << 32 | n};
  }

 private:
  std::vector<uint32_t> epoch_;  // per thread: bumped by each warp collective it takes part in
  KeyTable visits_;              // (thread, site, kind; epoch) -> visits, of the running block
};

}  // namespace cuemu
