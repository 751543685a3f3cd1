// racecheck.cpp: the data-race checker, an Observer of the access layer (cuemu_trace.h).
//
// It decides, for every pair of accesses to one byte by two different threads of a launch,
// whether something orders them (happens-before), independently of the order in which the
// emulator happened to run the fibers:
//  * Shadow state: every byte of shared memory (dynamic and static) and of every writable
//    array argument has a Cell: its last write and the latest reads of two different threads.
//    Each is a Rec: thread, epoch, warp clock, call site, plain or atomic. The four bytes of an
//    aligned word share one Cell until a narrower access splits them (see Shadow).
//  * Epochs: one counter, bumped when a block starts and when a __syncthreads() completes.
//    Two accesses of one block in different epochs are ordered by a barrier.
//  * Warps: each thread has a vector clock over the 32 lanes of its warp. A completed warp
//    collective (__syncwarp, a shuffle, a vote, ...) joins the clocks of its lanes. In one
//    epoch, an access of lane a at clock c is ordered before thread t when t's entry for a
//    exceeds c. Threads of different warps are ordered only by barriers.
//  * Blocks: global accesses of different blocks are ordered only through a hand-off (below);
//    shared memory of an earlier block belongs to that block, so its records are ignored.
//  * Hand-offs between blocks (the "last block" pattern of the CUDA programming guide): a
//    thread that runs __threadfence() and then an atomic on address X releases, into X, every
//    access of its block in earlier epochs (before the barrier that preceded the fence), its
//    own accesses, and those of the lanes of its warp ordered before it by warp collectives
//    (__syncwarp() orders memory among the lanes it syncs); a thread of a later block that runs
//    an atomic on X and then __threadfence() acquires every release into X made so far (the
//    atomics of X are totally ordered, and the emulator runs them in that order). From the
//    acquiring fence on, that thread's accesses, those of the lanes of its warp that a warp
//    collective orders after the fence, and every access of its block after the next
//    __syncthreads(), are ordered after the released ones. A fence on the other side only, an
//    atomic without a fence, or a reader that neither passes a barrier nor syncs its warp with
//    the acquiring lane after the acquire stays a race. Hand-offs chain (happens-before is
//    transitive): a release also carries every acquire ordered before it (by the releasing
//    thread itself, by a lane of its warp synced with it since, or by its block before the
//    barrier that preceded the release), so a block that acquires from a relay acquires from
//    the relay's sources too, whatever addresses they used.
// Shared memory only: a read (or atomic) of a byte that no thread of the block has written is
// reported too (CUEMU_UNINIT), since its last write, if any, belongs to an earlier block.
// A hazard: different threads, at least one write, not ordered, not both atomic. Reads and
// writes against an atomic read-modify-write count (as in the CUDA memory model). Two plain
// writes of the same bytes with the same value are benign (a flag set by many threads): such a
// write is judged in settle(), once its store has completed. The first example of each
// (kind, region, call site pair) is kept, with a count; cuemu_race_hazards() returns them.
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

#include "cuemu_trace.h"
#include "cuemu_warp_clocks.h"

#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace cuemu {
namespace {

enum : uint8_t { REC_NONE = 0, REC_PLAIN = 1, REC_ATOMIC = 2 };

struct Rec {
  uint32_t epoch;
  uint32_t clock;   // the thread's own warp clock at the access
  uint32_t site;
  uint16_t tid;
  uint8_t kind;
  uint8_t unused;
};

struct Cell {
  Rec write;
  Rec read[2];      // the latest reads of two different threads, newest first
};
static_assert(sizeof(Cell) == 48, "a shadow cell is 48 bytes");

constexpr size_t kMaxHazards = 64;       // distinct (kind, region, site pair) kept per launch
constexpr uint32_t kMaxPendingBytes = 64;
constexpr uint32_t kEpochLimit = 0xF0000000u;

// The shadow of a region of memory: a cell per 4-byte granule, used while the granule's four
// bytes share one state (accesses of whole aligned words keep them so), and a cell per byte
// for granules that a narrower access has split; a full-granule access that leaves the four
// byte cells equal merges them again. One anonymous mapping holds the granule cells, the byte
// cells and the split flags, backed by memory only where touched. Offsets are from the
// region's start.
struct Shadow {
  Cell* granules = nullptr;
  Cell* bytes = nullptr;
  uint8_t* split = nullptr;
  void* base = nullptr;
  size_t capacity = 0;  // bytes of memory it covers
  size_t mapped = 0;

  bool map(size_t n) {
    const size_t g = n / 4 + 1, len = (g + n) * sizeof(Cell) + g;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return false;
    base = p;
    mapped = len;
    capacity = n;
    granules = static_cast<Cell*>(p);
    bytes = granules + g;
    split = reinterpret_cast<uint8_t*>(bytes + n);
    return true;
  }
  void unmap() {
    if (base) munmap(base, mapped);
    *this = Shadow();
  }
  bool reserve(size_t n) {  // for shadows reused by every launch (shared memory)
    if (n <= capacity) return true;
    unmap();
    return map(std::max(n, (size_t)4096));
  }
  void clear() {  // zero again, without committing the untouched pages
    if (base) madvise(base, mapped, MADV_DONTNEED);
  }
};

// A release into an atomic's address: the releasing block (its first epoch), the epoch of the
// release, the releasing thread and how far it knew the clocks of its warp's lanes then; and
// the releases of other blocks that it carries on, those its block acquired in an order before
// it: carried_[carried_begin, carried_end) of the launch (unused in the carried copies).
struct Release {
  uint32_t block_epoch0;
  uint32_t epoch;
  uint16_t tid;
  uint32_t carried_begin, carried_end;
  uint32_t knew[32];   // knew[l]: the releasing thread's entry for lane l of its warp
};

// What the running block acquired from one earlier block, and where it acquired it.
struct Acquired {
  Release from;
  uint32_t epoch;   // epoch of the acquiring fence
  uint32_t clock;   // the acquiring thread's own warp clock at the fence
  uint16_t tid;     // the acquiring thread
};

// Whether an access of thread t at (epoch e, warp clock c) comes before one of thread later_t at
// later_e, in one block: a barrier, program order, or a chain of warp collectives between them.
// knows(lane) is later_t's entry for a lane of its warp; it is asked only inside one warp.
template <class Knows>
bool ordered_before(uint32_t e, uint16_t t, uint32_t c, uint32_t later_e, uint16_t later_t, Knows knows) {
  if (e != later_e) return e < later_e;
  if (t == later_t) return true;
  return !((t ^ later_t) >> 5) && knows(t & 31u) > c;
}

// A plain write that conflicts with an earlier plain write, waiting for its store to complete.
struct PendingWrite {
  bool active = false;
  const uint8_t* addr;
  uint32_t size;
  uint64_t bytes;    // bit i: byte i conflicts
  uint8_t old[kMaxPendingBytes];
  Rec first, second;
  uint32_t region;
  uint64_t offset;
};

// A thread's entries for the lanes of its warp, as they are now (for ordered_before).
struct KnownBy {
  const WarpClocks* clocks;
  uint32_t tid;
  uint32_t operator()(uint32_t lane) const { return clocks->known(tid, lane); }
};

class RaceCheck final : public Observer {
 public:
  bool launch_begin(const LaunchInfo& info) override;
  void block_begin(uint64_t block_linear) override;
  void access(const Access& a) override;
  void barrier() override { epoch_ = ++last_epoch_; }
  void warp_sync(uint32_t warp, uint32_t lanes) override;
  void fence(uint32_t tid) override;
  void settle() override;
  void launch_end() override;
  // Test hook: the next launch starts past the limit, so the one after it restarts the epochs.
  uint32_t jump_to_epoch_limit() { return last_epoch_ = kEpochLimit; }
  uint32_t last_epoch() const { return last_epoch_; }

  std::vector<cuemu_hazard> hazards;
  uint64_t dropped = 0;            // hazards beyond kMaxHazards distinct ones
  uint64_t same_value_writes = 0;  // benign write-after-write pairs

 private:
  bool stale(const Rec& r, bool shared) const {
    return r.kind == REC_NONE || r.epoch < launch_epoch0_ || (shared && r.epoch < block_epoch0_);
  }
  // Whether the earlier access r and the current access cur form a hazard pair (when one writes).
  bool unordered(const Rec& r, const Rec& cur, bool shared) const {
    if (r.kind == REC_NONE || r.epoch < launch_epoch0_) return false;
    if (r.epoch < block_epoch0_) return !shared && !handed_off(r, cur);  // an earlier block
    return !ordered_before(r.epoch, r.tid, r.clock, cur.epoch, cur.tid, knows(cur.tid));
  }
  // Thread tid's entries for the lanes of its warp, as they are now.
  KnownBy knows(uint32_t tid) const { return KnownBy{&clocks_, tid}; }
  // Check one cell against the current access and update it; true: a write that may repeat
  // the value of an unordered earlier write (judged in settle()).
  bool read(Cell& c, const Rec& cur, bool shared, const Access& a, uint64_t offset);
  // A read of a byte of shared memory that no thread of the running block has written: the GPU
  // returns what an earlier block (or launch) left there. Reported as CUEMU_UNINIT.
  void check_initialized(const Cell& c, const Rec& cur, bool shared, const Access& a, uint64_t offset);
  bool write(Cell& c, const Rec& cur, bool shared, const Access& a, uint64_t offset);
  void report(int kind, const Rec& first, const Rec& second, uint32_t region, uint64_t offset);
  // The (first epoch, linear block) entry of the block that ran `epoch`; the running block's when
  // none is recorded yet.
  std::pair<uint32_t, uint64_t> block_entry(uint32_t epoch) const;
  uint64_t block_of(uint32_t epoch) const { return block_entry(epoch).second; }
  // Whether r, an access of an earlier block, was released to the running block before cur.
  bool handed_off(const Rec& r, const Rec& cur) const;
  // A fenced atomic of thread tid on addr: a release into addr, carrying on the acquires ordered
  // before it (the thread's, a lane's it synced with since, its block's before the last barrier).
  void release(uint32_t tid, uintptr_t addr);

  uint32_t last_epoch_ = 0;
  uint32_t launch_epoch0_ = 1, block_epoch0_ = 1, epoch_ = 1;
  uint64_t block_ = 0;
  uint32_t nthreads_ = 0;
  uint32_t reported_ = 0;          // hazard kinds already reported for the current access
  bool waw_seen_ = false;          // the current access has a write-after-write candidate
  Rec waw_first_;                  // the earlier write of its first such byte
  std::vector<std::pair<uint32_t, uint64_t>> blocks_;   // (first epoch, linear block) of the launch
  std::vector<Shadow> launch_shadows_;   // writable arguments' shadows, unmapped at the end
  Shadow dynamic_shadow_, static_shadow_;  // reused: records of earlier launches are stale
  PendingWrite pending_;
  WarpClocks clocks_;
  std::unordered_map<uintptr_t, std::vector<Release>> releases_;   // by atomic address, this launch
  std::vector<Release> carried_;   // what each release carries on from earlier blocks, this launch
  std::vector<Acquired> acquired_;                                  // by the running block
  bool fenced_[kMaxBlockThreads];          // a fence since the thread's last atomic
  uintptr_t acquiring_[kMaxBlockThreads];  // the address of the thread's last atomic, until a fence
};

bool RaceCheck::launch_begin(const LaunchInfo& info) {
  if (last_epoch_ > kEpochLimit) {
    last_epoch_ = 0;
    dynamic_shadow_.clear();
    static_shadow_.clear();
  }
  launch_epoch0_ = block_epoch0_ = epoch_ = last_epoch_ + 1;
  nthreads_ = info.nthreads;
  clocks_.reset(nthreads_);
  hazards.clear();
  dropped = same_value_writes = 0;
  blocks_.clear();
  releases_.clear();
  carried_.clear();
  pending_.active = false;
  launch_shadows_.clear();
  launch_shadows_.reserve(info.nregions);  // Region::shadow points into it: no reallocation
  for (uint32_t i = 0; i < info.nregions; ++i) {
    Region& r = info.regions[i];
    const size_t n = r.hi - r.lo;
    r.shadow = nullptr;
    if (!n) continue;
    if (r.space == CUEMU_SHARED_DYNAMIC) {
      if (!dynamic_shadow_.reserve(n)) return false;
      r.shadow = &dynamic_shadow_;
    } else if (r.space == CUEMU_SHARED_STATIC) {
      if (!static_shadow_.reserve(n)) return false;
      r.shadow = &static_shadow_;
    } else if (r.writable) {
      launch_shadows_.emplace_back();
      if (!launch_shadows_.back().map(n)) return false;
      r.shadow = &launch_shadows_.back();
    } else {
      continue;  // read-only arguments: reads of bytes nobody writes cannot race
    }
    r.watched = true;
  }
  return true;
}

void RaceCheck::launch_end() {
  for (Shadow& shadow : launch_shadows_) shadow.unmap();
  launch_shadows_.clear();
}

void RaceCheck::block_begin(uint64_t block_linear) {
  epoch_ = block_epoch0_ = ++last_epoch_;
  block_ = block_linear;
  blocks_.emplace_back(epoch_, block_linear);
  acquired_.clear();
  memset(fenced_, 0, sizeof(fenced_[0]) * nthreads_);
  memset(acquiring_, 0, sizeof(acquiring_[0]) * nthreads_);
}

std::pair<uint32_t, uint64_t> RaceCheck::block_entry(uint32_t epoch) const {
  auto it = std::upper_bound(blocks_.begin(), blocks_.end(), epoch,
                             [](uint32_t e, const std::pair<uint32_t, uint64_t>& b) { return e < b.first; });
  return it == blocks_.begin() ? std::make_pair(block_epoch0_, block_) : *std::prev(it);
}

bool RaceCheck::handed_off(const Rec& r, const Rec& cur) const {
  if (acquired_.empty()) return false;
  const uint32_t source = block_entry(r.epoch).first;
  for (const Acquired& a : acquired_) {
    if (a.from.block_epoch0 != source) continue;
    const Release& rel = a.from;
    const bool released = ordered_before(r.epoch, r.tid, r.clock, rel.epoch, rel.tid,
                                         [&rel](uint32_t lane) { return rel.knew[lane]; });
    if (released && ordered_before(a.epoch, a.tid, a.clock, cur.epoch, cur.tid, knows(cur.tid))) return true;
  }
  return false;
}

void RaceCheck::fence(uint32_t tid) {
  if (acquiring_[tid]) {   // atomic, then fence: acquire every release into that address so far,
    auto it = releases_.find(acquiring_[tid]);   // and what each carried on from its own sources
    const uint32_t clock = clocks_.own(tid);
    auto take = [&](const Release& from) {   // a release of this block coming back is no hand-off
      if (from.block_epoch0 != block_epoch0_) acquired_.push_back(Acquired{from, epoch_, clock, (uint16_t)tid});
    };
    if (it != releases_.end())
      for (const Release& rel : it->second) {
        take(rel);
        for (uint32_t i = rel.carried_begin; i < rel.carried_end; ++i) take(carried_[i]);
      }
    acquiring_[tid] = 0;
  }
  fenced_[tid] = true;
}

void RaceCheck::release(uint32_t tid, uintptr_t addr) {
  Release rel{block_epoch0_, epoch_, (uint16_t)tid, (uint32_t)carried_.size(), 0, {}};
  for (uint32_t lane = 0; lane < 32; ++lane) rel.knew[lane] = clocks_.known(tid, lane);
  for (const Acquired& a : acquired_) {
    if (!ordered_before(a.epoch, a.tid, a.clock, epoch_, (uint16_t)tid, knows(tid))) continue;  // not after it
    const bool known = std::any_of(carried_.begin() + rel.carried_begin, carried_.end(), [&](const Release& c) {
      return c.block_epoch0 == a.from.block_epoch0 && c.epoch == a.from.epoch && c.tid == a.from.tid &&
             !memcmp(c.knew, a.from.knew, sizeof c.knew);
    });
    if (!known) carried_.push_back(a.from);
  }
  rel.carried_end = (uint32_t)carried_.size();
  releases_[addr].push_back(rel);
}

void RaceCheck::warp_sync(uint32_t warp, uint32_t lanes) { clocks_.sync(warp, lanes); }

void RaceCheck::report(int kind, const Rec& first, const Rec& second, uint32_t region,
                       uint64_t offset) {
  for (cuemu_hazard& h : hazards)
    if (h.kind == kind && h.region == (int32_t)region && h.site[0] == first.site &&
        h.site[1] == second.site) {
      ++h.count;
      return;
    }
  if (hazards.size() >= kMaxHazards) {
    ++dropped;
    return;
  }
  cuemu_hazard h;
  memset(&h, 0, sizeof h);
  h.kind = kind;
  h.region = (int32_t)region;
  h.offset = offset;
  h.block[0] = block_of(first.epoch);
  h.block[1] = block_;
  h.thread[0] = first.tid;
  h.thread[1] = second.tid;
  h.site[0] = first.site;
  h.site[1] = second.site;
  h.atomic[0] = first.kind == REC_ATOMIC;
  h.atomic[1] = second.kind == REC_ATOMIC;
  h.count = 1;
  hazards.push_back(h);
}

void RaceCheck::check_initialized(const Cell& c, const Rec& cur, bool shared, const Access& a,
                                  uint64_t offset) {
  if (shared && stale(c.write, true) && !(reported_ & (1u << CUEMU_UNINIT))) {
    reported_ |= 1u << CUEMU_UNINIT;
    report(CUEMU_UNINIT, cur, cur, a.region->index, offset);
  }
}

bool RaceCheck::read(Cell& c, const Rec& cur, bool shared, const Access& a, uint64_t offset) {
  check_initialized(c, cur, shared, a, offset);
  if (unordered(c.write, cur, shared) && !(reported_ & (1u << CUEMU_RAW))) {
    reported_ |= 1u << CUEMU_RAW;
    report(CUEMU_RAW, c.write, cur, a.region->index, offset);
  }
  Rec& r0 = c.read[0];
  const Rec& r1 = c.read[1];
  if (r0.epoch == cur.epoch && r0.kind != REC_NONE && r0.tid == cur.tid && r0.clock == cur.clock)
    return false;  // this thread's read since its last synchronisation is on record already
  if (r0.epoch == cur.epoch && r1.epoch == cur.epoch && r0.kind != REC_NONE &&
      r1.kind != REC_NONE && ((r0.tid ^ r1.tid) >> 5))
    return false;  // readers of two warps in this epoch: any write of this epoch races already
  if (stale(r0, shared) || (r0.tid == cur.tid && r0.epoch >= block_epoch0_)) {
    r0 = cur;  // a thread's newer read subsumes its older one
  } else {
    c.read[1] = r0;
    r0 = cur;
  }
  return false;
}

bool RaceCheck::write(Cell& c, const Rec& cur, bool shared, const Access& a, uint64_t offset) {
  if (cur.kind == REC_ATOMIC) check_initialized(c, cur, shared, a, offset);  // it reads first
  bool same_value_candidate = false;
  if (unordered(c.write, cur, shared)) {
    if (c.write.kind == REC_PLAIN && cur.kind == REC_PLAIN) {
      same_value_candidate = true;
      if (!waw_seen_) waw_first_ = c.write;
      waw_seen_ = true;
    } else if (!(c.write.kind == REC_ATOMIC && cur.kind == REC_ATOMIC) &&
               !(reported_ & (1u << CUEMU_WAW))) {
      reported_ |= 1u << CUEMU_WAW;
      report(CUEMU_WAW, c.write, cur, a.region->index, offset);
    }
  }
  for (const Rec& r : c.read)
    if (unordered(r, cur, shared)) {
      if (!(reported_ & (1u << CUEMU_WAR))) {
        reported_ |= 1u << CUEMU_WAR;
        report(CUEMU_WAR, r, cur, a.region->index, offset);
      }
      break;
    }
  // The reads stay on record: a later write unordered with this one may repeat its value (a
  // benign pair), and must still be checked against the reads that only this one was after.
  c.write = cur;
  return same_value_candidate;
}

void RaceCheck::access(const Access& a) {
  if (a.kind & ACCESS_ATOMIC) {   // fence, then atomic: a release into the atomic's address
    if (fenced_[a.tid]) release(a.tid, a.addr);
    fenced_[a.tid] = false;
    acquiring_[a.tid] = a.addr;
  }
  Shadow* shadow = static_cast<Shadow*>(a.region->shadow);
  if (!shadow) return;
  const bool shared = a.region->space != CUEMU_GLOBAL;
  const bool is_write = a.kind & (ACCESS_WRITE | ACCESS_ATOMIC);
  Rec cur;
  cur.epoch = epoch_;
  cur.clock = clocks_.own(a.tid);
  cur.site = a.site;
  cur.tid = (uint16_t)a.tid;
  cur.kind = (a.kind & ACCESS_ATOMIC) ? REC_ATOMIC : REC_PLAIN;
  cur.unused = 0;
  reported_ = 0;
  waw_seen_ = false;
  uint64_t waw_bytes = 0;  // bit k: byte k of the access may be a same-value write
  uint64_t waw_offset = 0;
  const uint64_t first = a.addr - a.region->lo, end = first + a.size;
  auto check = [&](Cell& c, uint64_t offset, uint64_t n) {
    if (!(is_write ? write(c, cur, shared, a, offset) : read(c, cur, shared, a, offset))) return;
    if (!waw_bytes) waw_offset = offset;
    const uint64_t k = offset - first;
    waw_bytes |= (k + n >= kMaxPendingBytes ? ~0ull << std::min(k, (uint64_t)63) : ((1ull << n) - 1) << k);
  };
  for (uint64_t g = first >> 2; (g << 2) < end; ++g) {
    const uint64_t g0 = g << 2, lo = std::max(first, g0), hi = std::min(end, g0 + 4);
    Cell* bytes = shadow->bytes + g0;
    if (!shadow->split[g]) {
      if (hi - lo == 4) {  // a whole granule in one state: decided once
        check(shadow->granules[g], g0, 4);
        continue;
      }
      for (int k = 0; k < 4; ++k) bytes[k] = shadow->granules[g];
      shadow->split[g] = 1;
    }
    for (uint64_t b = lo; b < hi; ++b) check(bytes[b - g0], b, 1);
    if (hi - lo == 4 && !memcmp(&bytes[0], &bytes[1], sizeof(Cell)) &&
        !memcmp(&bytes[0], &bytes[2], sizeof(Cell)) && !memcmp(&bytes[0], &bytes[3], sizeof(Cell))) {
      shadow->granules[g] = bytes[0];
      shadow->split[g] = 0;
    }
  }
  if (!waw_bytes) return;
  if (a.size > kMaxPendingBytes) {
    report(CUEMU_WAW, waw_first_, cur, a.region->index, waw_offset);
    return;
  }
  pending_.active = true;
  pending_.addr = reinterpret_cast<const uint8_t*>(a.addr);
  pending_.size = a.size;
  pending_.bytes = waw_bytes;
  memcpy(pending_.old, pending_.addr, a.size);  // the store has not happened yet
  pending_.first = waw_first_;
  pending_.second = cur;
  pending_.region = a.region->index;
  pending_.offset = waw_offset;
  request_settle();
}

void RaceCheck::settle() {
  if (!pending_.active) return;
  pending_.active = false;
  for (uint32_t i = 0; i < pending_.size; ++i)
    if ((pending_.bytes >> i & 1) && pending_.addr[i] != pending_.old[i]) {
      report(CUEMU_WAW, pending_.first, pending_.second, pending_.region, pending_.offset);
      return;
    }
  ++same_value_writes;
}

RaceCheck* g_racecheck = nullptr;

}  // namespace

Observer* racecheck_observer() {
  if (!g_racecheck) g_racecheck = new RaceCheck();
  return g_racecheck;
}

}  // namespace cuemu

// Test hook (tests/test_emulator.py): epochs restart, clearing the shared-memory shadows, at the
// second launch from now, as they do after about 4e9 barriers and block starts. Returns the limit.
CUEMU_EXPORT uint32_t cuemu_race_jump_to_epoch_limit(void) {
  return static_cast<cuemu::RaceCheck*>(cuemu::racecheck_observer())->jump_to_epoch_limit();
}

// Test hook: the last epoch handed out (so a test sees that the restart took place).
CUEMU_EXPORT uint32_t cuemu_race_last_epoch(void) {
  return static_cast<cuemu::RaceCheck*>(cuemu::racecheck_observer())->last_epoch();
}

// The hazards of the last launch that checked races; valid until the next launch.
CUEMU_EXPORT uint32_t cuemu_race_hazards(const cuemu_hazard** out, uint64_t* dropped,
                                         uint64_t* same_value_writes) {
  cuemu::RaceCheck* rc = cuemu::g_racecheck;
  if (!rc) {
    *out = nullptr;
    *dropped = *same_value_writes = 0;
    return 0;
  }
  *out = rc->hazards.data();
  *dropped = rc->dropped;
  *same_value_writes = rc->same_value_writes;
  return (uint32_t)rc->hazards.size();
}
