// schedule.cpp: the seeded order of blocks and fibers (see include/cuemu_schedule.h).
//
// Blocks: a Fisher-Yates permutation of up to 2^22 blocks; larger grids use an affine
// bijection k -> (a * k + c) mod n with a coprime to n. Warps: a Fisher-Yates permutation
// at each block start and barrier. Lanes: one of 64 permutations of 0..31 drawn at the start
// of the launch, picked at random at each release (one random number per warp collective).
#include <vector>

#include "cuemu_schedule.h"

namespace cuemu {
namespace {

constexpr uint64_t kMaxPermutedBlocks = 1u << 22;
constexpr uint32_t kLaneOrders = 64;

uint64_t g_state = 0;
bool g_shuffled = false;
uint64_t g_nblocks = 0;
std::vector<uint32_t> g_block_order;
uint64_t g_affine_a = 1, g_affine_c = 0;
uint8_t g_lane_orders[kLaneOrders][32];

uint64_t next_random() {  // splitmix64
  uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t gcd(uint64_t a, uint64_t b) {
  while (b) {
    const uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

}  // namespace

void schedule_begin(uint64_t seed, uint64_t nblocks) {
  g_state = seed;
  g_shuffled = seed != 0;
  g_nblocks = nblocks;
  g_block_order.clear();
  if (!g_shuffled) return;
  for (auto& order : g_lane_orders) {
    uint32_t lanes[32];
    for (uint32_t l = 0; l < 32; ++l) lanes[l] = l;
    schedule_shuffle(lanes, 32);
    for (uint32_t l = 0; l < 32; ++l) order[l] = (uint8_t)lanes[l];
  }
  if (nblocks < 2) return;
  if (nblocks <= kMaxPermutedBlocks) {
    g_block_order.resize(nblocks);
    for (uint32_t i = 0; i < nblocks; ++i) g_block_order[i] = i;
    for (uint64_t i = nblocks - 1; i > 0; --i) {
      const uint64_t j = next_random() % (i + 1);
      const uint32_t t = g_block_order[i];
      g_block_order[i] = g_block_order[j];
      g_block_order[j] = t;
    }
    return;
  }
  do g_affine_a = next_random() % nblocks; while (g_affine_a == 0 || gcd(g_affine_a, nblocks) != 1);
  g_affine_c = next_random() % nblocks;
}

bool schedule_shuffled() { return g_shuffled; }

void schedule_shuffle(uint32_t* ids, uint32_t n) {
  for (uint32_t i = n; i > 1; --i) {
    const uint32_t j = (uint32_t)(next_random() % i);
    const uint32_t t = ids[i - 1];
    ids[i - 1] = ids[j];
    ids[j] = t;
  }
}

const uint8_t* schedule_lane_order() {
  return g_shuffled ? g_lane_orders[next_random() % kLaneOrders] : nullptr;
}

uint64_t schedule_block(uint64_t k) {
  if (!g_shuffled || g_nblocks < 2) return k;
  if (!g_block_order.empty()) return g_block_order[k];
  return (uint64_t)(((unsigned __int128)g_affine_a * k + g_affine_c) % g_nblocks);
}

}  // namespace cuemu
