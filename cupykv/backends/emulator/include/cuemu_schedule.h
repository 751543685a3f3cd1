// cuemu_schedule.h: seeded schedule perturbation (runtime-internal; schedule.cpp).
//
// With seed 0 the scheduler runs blocks in index order (x fastest) and fibers first-in,
// first-out, in thread order: today's order. With another seed, blocks run in a seeded random
// order; when a block starts or a barrier completes, its warps become ready in a seeded random
// order, each warp's lanes in a seeded random order; when a warp collective completes, its
// lanes become ready in a seeded random order; and the fiber that completed the barrier or
// collective queues among them instead of running on. The ready queue stays first-in,
// first-out: picking a random fiber from all of a block's threads at every switch would
// scatter the accesses over every fiber stack and double the cost. Fibers still switch only
// at barriers, warp intrinsics and exit. The same seed gives the same order.
#pragma once
#include <stdint.h>

namespace cuemu {

void schedule_begin(uint64_t seed, uint64_t nblocks);
bool schedule_shuffled();                      // a seed other than 0
void schedule_shuffle(uint32_t* ids, uint32_t n);  // a seeded permutation of ids[0..n)
const uint8_t* schedule_lane_order();          // a seeded order of lanes 0..31; null: lane order
uint64_t schedule_block(uint64_t k);           // linear index of the k-th block to run

}  // namespace cuemu
