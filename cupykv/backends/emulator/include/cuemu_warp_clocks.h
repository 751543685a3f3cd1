// cuemu_warp_clocks.h: vector clocks over the lanes of each warp (runtime-internal; used by
// racecheck.cpp). Happens-before between two lanes of one warp within a barrier interval comes
// only from warp collectives that both took part in, directly or through other lanes.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace cuemu {

constexpr uint32_t kMaxBlockThreads = 1024;

// Vector clocks of the lanes of each warp of the running block. Lane t knows lane a up to
// clock known(t, a); its own clock is own(t). A collective over every lane of a warp (the usual
// case: full-mask shuffles) leaves every lane knowing exactly the lanes' own clocks, which is
// kept as one shared vector per warp, O(32) instead of O(32 x 32).
class WarpClocks {
 public:
  void reset(uint32_t nthreads) {
    nthreads_ = nthreads;
    const uint32_t nwarps = (nthreads + 31) / 32;
    memset(full_, 0, sizeof(full_[0]) * nwarps);
    memset(full_gen_, 0, sizeof(full_gen_[0]) * nwarps);
    memset(own_, 0, sizeof(own_[0]) * nthreads);
    memset(row_gen_, 0, sizeof(row_gen_[0]) * nthreads);
    memset(row_, 0, sizeof(row_[0]) * nthreads);
  }
  uint32_t own(uint32_t tid) const { return own_[tid]; }
  uint32_t known(uint32_t tid, uint32_t lane) const {
    const uint32_t w = tid >> 5;
    return row_gen_[tid] == full_gen_[w] ? row_[tid][lane] : full_[w][lane];
  }
  // The lanes of `lanes` in warp `warp` completed a collective together.
  void sync(uint32_t warp, uint32_t lanes) {
    const uint32_t base = warp * 32u, count = std::min(32u, nthreads_ - base);
    const uint32_t present = count == 32 ? ~0u : (1u << count) - 1u;
    if (lanes == present) {
      for (uint32_t l = 0; l < count; ++l) full_[warp][l] = ++own_[base + l];
      ++full_gen_[warp];
      return;
    }
    uint32_t join[32] = {0};
    for (uint32_t l = 0; l < 32; ++l) {
      if (!(lanes >> l & 1)) continue;
      const uint32_t t = base + l;
      if (row_gen_[t] != full_gen_[warp]) {
        memcpy(row_[t], full_[warp], sizeof row_[t]);
        row_gen_[t] = full_gen_[warp];
      }
      row_[t][l] = ++own_[t];
      for (uint32_t k = 0; k < 32; ++k) join[k] = std::max(join[k], row_[t][k]);
    }
    for (uint32_t l = 0; l < 32; ++l)
      if (lanes >> l & 1) memcpy(row_[base + l], join, sizeof join);
  }

 private:
  uint32_t nthreads_ = 0;
  uint32_t own_[kMaxBlockThreads], row_gen_[kMaxBlockThreads], row_[kMaxBlockThreads][32];
  uint32_t full_[kMaxBlockThreads / 32][32], full_gen_[kMaxBlockThreads / 32];
};

}  // namespace cuemu
