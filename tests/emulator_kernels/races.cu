// races.cu: planted data races and synchronisation misuse for the emulator's race checker
// (tests/test_races.py). Each kernel takes a switch: 0 plants the bug, 1 runs the correct
// version of the same code, which the checker must accept. They compile for NVRTC too.

// Lanes exchange values through shared memory: lane l reads what lane l ^ 1 wrote. Without
// the __syncwarp() the read races with the neighbour's write (lanes of one warp are not
// ordered under independent thread scheduling). out: [blockDim.x] int.
__global__ void warp_exchange(int* out, int synced) {
  __shared__ int slots[256];
  const int tid = threadIdx.x;
  slots[tid] = 10 * tid;
  if (synced) __syncwarp();
  out[tid] = slots[tid ^ 1];
}

// Every block writes one output element (its own index + 1): unless blocks write separate
// elements, two blocks race on out[0]. out: [gridDim.x] float.
__global__ void blocks_share_output(float* out, int separate) {
  if (threadIdx.x == 0) out[separate ? blockIdx.x : 0] = (float)(blockIdx.x + 1);
}

// Every thread of every block sets the same flag to the same value: benign, not reported.
// With distinct values (different = 1) it is a race. flag: [1] int.
__global__ void set_flag(int* flag, int different) {
  flag[0] = different ? (int)(blockIdx.x * blockDim.x + threadIdx.x) : 1;
}

// Threads count themselves with a shared-memory atomic; thread 0 reads the count. Without
// the second barrier the plain read races with the other threads' atomics. out: [1] int.
__global__ void atomic_count(int* out, int synced) {
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1);
  if (synced) __syncthreads();
  if (threadIdx.x == 0) out[0] = count;
}

// A block-wide sum whose result is read before the barrier that publishes it:
// warp 0's lane 0 writes the total, every thread reads it. out: [blockDim.x] float.
__global__ void publish_total(const float* x, float* out, int synced) {
  __shared__ float total;
  __shared__ float partial[32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  float v = x[tid];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (tid == 0) {
    float t = 0.f;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) t += partial[w];
    total = t;
  }
  if (synced) __syncthreads();
  out[tid] = total;
}

// A shuffle whose mask leaves out the calling lanes 16-31 (all 32 lanes call it).
// out: [32] int.
__global__ void shuffle_mask_misses_callers(int* out, int full_mask) {
  const unsigned mask = full_mask ? 0xffffffffu : 0x0000ffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, (int)threadIdx.x, 1);
}

// Lane 0 passes 0x0000ffff and lanes 1-31 pass 0xffffffff at the same shuffle: the masks
// name each other but differ. out: [32] int.
__global__ void shuffle_masks_differ(int* out, int same_masks) {
  const unsigned mask = (threadIdx.x == 0 && !same_masks) ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, (int)threadIdx.x, 1);
}

// __syncwarp with a mask that leaves out the calling lane 0. out: [32] int.
__global__ void syncwarp_mask_misses_caller(int* out, int full_mask) {
  __syncwarp(full_mask ? 0xffffffffu : 0xfffffffeu);
  out[threadIdx.x] = 1;
}

// Lanes 0-15 exchange through shared memory ordered by a half-warp __syncwarp; lanes 16-31
// take no part. Without it the half-warp exchange races. out: [32] int.
__global__ void half_warp_exchange(int* out, int synced) {
  __shared__ int halves[16];
  const int lane = threadIdx.x;
  int v = -1;
  if (lane < 16) {
    halves[lane] = 3 * lane;
    if (synced) __syncwarp(0x0000ffffu);
    v = halves[lane ^ 8];
  }
  out[lane] = v;
}

// Lane 0 writes, syncs with lane 1, which syncs with lane 2, which reads: ordered through the
// chain. Without the second __syncwarp lane 2's read races with lane 0's write. out: [1] int.
__global__ void sync_chain(int* out, int chained) {
  __shared__ int shared_value;
  const int lane = threadIdx.x;
  if (lane == 0) shared_value = 42;
  if (lane <= 1) __syncwarp(0x3u);
  if (chained && (lane == 1 || lane == 2)) __syncwarp(0x6u);
  if (lane == 2) out[0] = shared_value;
}

// The "last block" hand-off: every block publishes a column of partial results, its thread 0
// then publishes the column's first element once more (in the epoch of its release: the releasing
// thread's own accesses are released with it), counts the block on a device counter, and the
// block that counts last sums every block's column and those firsts, then resets the counter.
// `steps` switches its four synchronisations: bit 0 the releasing fence before the count, bit 1
// the acquiring fence after it, bit 2 the barrier that makes the acquire the whole block's, bit 3
// the barrier that makes the release the whole block's. All four (15): no race.
// partial: [gridDim.x * (blockDim.x + 1)] float, out: [blockDim.x + 1] float, counter: [1] int
// (0 before the launch, and after it).
__global__ void last_block_sums(const float* x, float* partial, float* out, int* counter, int steps) {
  __shared__ int is_last;
  const int column = threadIdx.x;
  float* firsts = partial + gridDim.x * blockDim.x;
  partial[blockIdx.x * blockDim.x + column] = x[blockIdx.x * blockDim.x + column] * 2.0f;
  if (steps & 8) __syncthreads();
  if (column == 0) {
    firsts[blockIdx.x] = x[blockIdx.x * blockDim.x];
    if (steps & 1) __threadfence();
    is_last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    if (steps & 2) __threadfence();
  }
  if (steps & 4) __syncthreads();
  else __syncwarp();
  if (is_last) {
    float sum = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += partial[b * blockDim.x + column];
    out[column] = sum;
    if (column == 0) {
      float first_sum = 0.0f;
      for (unsigned b = 0; b < gridDim.x; ++b) first_sum += firsts[b];
      out[blockDim.x] = first_sum;
      atomicExch(counter, 0);
    }
  }
}

// A hand-off to some blocks only: the block that counts first on counters[0] publishes `data`
// and releases it into counters[1] (barrier, fence, atomic); each later block counts on
// counters[1] and reads data, acquiring it (atomic, fence, barrier) only where bit `place` of
// `acquirers` is set, place being its turn in the count. What a block acquired is its own: a
// later block that did not acquire races with the publisher although an earlier one acquired.
// data: [blockDim.x] float, out: [gridDim.x * blockDim.x] float, counters: [2] int (zeros),
// order: [gridDim.x] int (order[place]: the block that counted at that turn).
__global__ void hand_off_to_some_blocks(float* data, float* out, int* counters, int* order, int acquirers) {
  __shared__ int place;
  if (threadIdx.x == 0) place = atomicAdd(&counters[0], 1);
  __syncthreads();
  if (place == 0) {
    data[threadIdx.x] = (float)(threadIdx.x + 1);
    __syncthreads();
    if (threadIdx.x == 0) {
      order[0] = blockIdx.x;
      __threadfence();
      atomicAdd(&counters[1], 1);
    }
    return;
  }
  if (threadIdx.x == 0) {
    order[place] = blockIdx.x;
    atomicAdd(&counters[1], 1);
    if (acquirers >> place & 1) __threadfence();
  }
  __syncthreads();
  out[place * blockDim.x + threadIdx.x] = data[threadIdx.x];
}

// A hand-off relayed along a chain of blocks, each link through its own counter: the block
// that counts first on counters[0] publishes `data` and releases it into counters[1]; the block
// at turn p (1 <= p < gridDim.x - 1) acquires from counters[p] and releases into counters[p + 1];
// the last block acquires from counters[gridDim.x - 1] and reads data. Happens-before is
// transitive, so the reader is ordered after the publisher although they share no address.
// In each relay, thread 0 acquires and thread `releaser` releases: thread 0 itself (program
// order), thread 32 of another warp, which is ordered after the acquire only when bit 0 of
// `steps` puts a barrier between them, or lane 1, ordered after it by a __syncwarp() (bit 2)
// as well. Bit 1 of `steps` skips the acquire of turn 1 (its relay releases what it never
// acquired). Bit 3: the publisher releases twice, each warp's elements in turn, and the first
// relay carries on both releases. data: [blockDim.x] float, out: [blockDim.x] float,
// counters: [gridDim.x + 1] int (zeros).
__global__ void relayed_hand_off(float* data, float* out, int* counters, int releaser, int steps) {
  __shared__ int place;
  if (threadIdx.x == 0) place = atomicAdd(&counters[0], 1);
  __syncthreads();
  if (place == 0) {
    const int rounds = (steps & 8) ? 2 : 1;
    for (int round = 0; round < rounds; ++round) {
      if (rounds == 1 || (int)(threadIdx.x >> 5) == round) data[threadIdx.x] = (float)(threadIdx.x + 2);  // published
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&counters[1], 1);
      }
    }
    return;
  }
  if (place + 1 < (int)gridDim.x) {
    const bool acquire = !(place == 1 && (steps & 2));
    if (threadIdx.x == 0 && acquire) {
      atomicAdd(&counters[place], 1);
      __threadfence();
    }
    if (steps & 1) __syncthreads();
    if ((steps & 4) && threadIdx.x < 32) __syncwarp();
    if (threadIdx.x == releaser) {
      __threadfence();
      atomicAdd(&counters[place + 1], 1);
    }
    return;
  }
  if (threadIdx.x == 0) {
    atomicAdd(&counters[place], 1);
    __threadfence();
  }
  __syncthreads();
  const unsigned column = threadIdx.x;
  out[column] = data[column];  // relayed
}

// A hand-off between one-warp blocks, ordered inside each warp by __syncwarp() instead of a
// barrier: the block that counts first on counters[0] publishes `data` (every lane writes its
// element) and its lane 0 releases it into counters[1]; the next block's lane 0 acquires it
// there and every lane reads `data`. __syncwarp() orders memory among the lanes it syncs, so
// the release carries the lanes that synced with lane 0 before it, and the acquire reaches the
// lanes that synced with lane 0 after it. Bit 0 of `steps`: the publisher syncs its lanes in
// `publisher_lanes` with lane 0 before the release; bit 1: the reader syncs all its lanes
// after the acquire. Syncs on the wrong side order nothing: bit 2, the reader's lanes sync
// before the acquire; bit 3, the publisher's before they write. data: [32] float,
// out: [32] float, counters: [2] int (zeros).
__global__ void warp_hand_off(float* data, float* out, int* counters, unsigned publisher_lanes, int steps) {
  __shared__ int place;
  const unsigned lane = threadIdx.x;
  if (lane == 0) place = atomicAdd(&counters[0], 1);
  __syncthreads();
  if (place == 0) {
    if (steps & 8) __syncwarp();
    data[lane] = (float)(lane + 3);  // warp-published
    if ((steps & 1) && (publisher_lanes >> lane & 1)) __syncwarp(publisher_lanes);
    if (lane == 0) {
      __threadfence();
      atomicAdd(&counters[1], 1);
    }
    return;
  }
  if (steps & 4) __syncwarp();
  if (lane == 0) {
    atomicAdd(&counters[1], 1);
    __threadfence();
  }
  if (steps & 2) __syncwarp();
  out[lane] = data[lane];  // warp-read
}

// Two races of one kind on one array, between different pairs of lines: thread 0 writes both
// words of `pair`, thread 32 (another warp) reads them, with nothing between. The report keeps
// each pair of lines apart. pair: [2] int, out: [2] int.
__global__ void two_races_one_array(int* pair, int* out) {
  if (threadIdx.x == 0) pair[0] = 1;
  if (threadIdx.x == 0) pair[1] = 2;
  if (threadIdx.x == 32) out[0] = pair[0];
  if (threadIdx.x == 32) out[1] = pair[1];
}

// Races the shadow keeps byte by byte, between two one-thread blocks: the block that runs first
// (turn 0 on `counter`) accesses `bytes` as `scenario` says, the other then reads byte `target`
// with nothing ordering the two, so that the race is a read-after-write whatever the order of
// the blocks. Scenario 0: a 4-byte write of word 0, then a write of its byte 0 (the word's
// record split into bytes). 1: a write of byte 4, then of byte 1 (each word split on its own).
// 2: a write of byte `target`, then a 4-byte read of word 0 (its bytes' records differ after
// it). bytes: [8] unsigned char, counter: [1] int (zero), out: [2] int.
__global__ void byte_races(unsigned char* bytes, int* counter, int* out, int scenario, int target) {
  if (atomicAdd(counter, 1) != 0) {
    out[0] = bytes[target];
    return;
  }
  if (scenario == 0) {
    *reinterpret_cast<unsigned*>(bytes) = 0x01010101u;
    bytes[0] = 2;
  } else if (scenario == 1) {
    bytes[4] = 3;
    bytes[1] = 4;
  } else {
    bytes[target] = 5;
    out[1] = (int)*reinterpret_cast<const unsigned*>(bytes);
  }
}

// Block 0 writes byte 0 of `bytes` (one char), block 1 its last 4-byte word (bytes: [4 n_words]
// unsigned char, n_words >= 2): unordered, but never the same bytes, so no race.
__global__ void first_byte_and_last_word(unsigned char* bytes, int n_words) {
  if (blockIdx.x == 0) bytes[0] = 7;
  else reinterpret_cast<unsigned*>(bytes)[n_words - 1] = 0x01020304u;
}

// Two read records of one word: the one-thread block that runs first (turn 0 on `counter`) reads
// it; the other reads it, synchronises its warp (a new clock), reads it again, then writes it.
// Its second read replaces its own first record, not the other block's, so the write races with
// the other block's read. word: [1] int, counter: [1] int (zero), out: [1] int.
__global__ void reread_then_write(int* word, int* counter, int* out) {
  if (atomicAdd(counter, 1) == 0) {
    out[0] = word[0];
    return;
  }
  int seen = word[0];
  __syncwarp(1u);
  seen += word[0];
  word[0] = seen + 1;
}

// Two blocks store one 8-byte word, unordered: a race unless both store the same bytes (benign,
// as for a flag). `differ` 1: block 1's value differs in its top byte only. word: [1].
__global__ void store_one_word(unsigned long long* word, int differ) {
  const unsigned long long value = 0x0000000100000001ull;
  *word = blockIdx.x == 1 && differ ? value | 0x0100000000000000ull : value;
}

// Block 0 stores the low word of an 8-byte pair (1), block 1 the whole pair with the same low word and
// a new high word (5): unordered, but the only bytes both write hold the same value (benign), and
// the high word has no earlier writer. pair: [1].
__global__ void word_then_wider_store(unsigned long long* pair) {
  if (blockIdx.x == 0) *reinterpret_cast<unsigned*>(pair) = 1u;
  else *pair = 0x0000000500000001ull;
}

// The same a byte at a time: block 0 stores byte 0 (7), block 1 the 2-byte pair over it, with
// byte 0 the same (7, or 8 when `differ`) and a new byte 1 (5). Only byte 0 is shared, so only
// byte 0's value decides: byte 1 has no earlier writer. bytes: [4] (zeros).
__global__ void byte_then_halfword(unsigned char* bytes, int differ) {
  if (blockIdx.x == 0) bytes[0] = 7;
  else *reinterpret_cast<unsigned short*>(bytes) = differ ? 0x0508 : 0x0507;
}

// The same with a 64-byte memcpy, the widest store whose bytes are compared (a wider one is a race
// whatever it stores). words: [16] unsigned.
__global__ void copy_64_bytes(unsigned* words, int differ) {
  unsigned value[16];
  for (int i = 0; i < 16; ++i) value[i] = 1u;
  if (blockIdx.x == 1 && differ) value[15] |= 0x01000000u;
  memcpy(words, value, sizeof value);
}

// Block 0 stores the low half of a word, block 1 its high half, block 2 the whole word with other
// bytes: unordered, so block 2's store races with both halves, one access over two earlier writes.
// word: [1].
__global__ void halves_then_word(unsigned* word) {
  unsigned short* halves = reinterpret_cast<unsigned short*>(word);
  if (blockIdx.x == 0) halves[0] = 1;
  if (blockIdx.x == 1) halves[1] = 2;
  if (blockIdx.x == 2) word[0] = 0x00070007u;
}

// Every thread reads a shared word, then thread `writer` overwrites it. `sync` 0: no barrier;
// 1: only a __syncwarp, which orders the writer's own warp and no other; 2: a __syncthreads,
// correct. The race is found through one of the two read records the checker keeps per word,
// whichever holds an unordered reader. out: [blockDim.x] int.
__global__ void overwrite_after_reads(int* out, int sync, int writer) {
  __shared__ int word;
  if (threadIdx.x == 0) word = 7;
  __syncthreads();
  out[threadIdx.x] = word;
  if (sync == 1) __syncwarp();
  if (sync == 2) __syncthreads();
  if ((int)threadIdx.x == writer) word = 8;
}

// Lane 0 reads a flag; after a __syncwarp(), lane 1 of its warp sets it to 1, and so does
// thread 32 of the next warp, with nothing between it and lane 0's read. The two stores of 1
// are a benign pair, but lane 0's read races with thread 32's store (it may see 0 or 1): the
// read stays on record past lane 1's store. flag: [1] int (zero), out: [1] int.
__global__ void read_then_flag_set_twice(int* flag, int* out) {
  if (threadIdx.x == 0) out[0] = flag[0];
  __syncwarp();
  if (threadIdx.x == 1) flag[0] = 1;  // ordered after lane 0's read
  if (threadIdx.x == 32) flag[0] = 1;  // not ordered after it
}

// Thread 0 clears a shared tally with a plain store while the other threads add `increment`
// to it with atomics: without the barrier between, the plain store races with the atomics. A
// plain write and an atomic are never a benign pair, even where both leave the same value
// (increment 0). out: [1] int.
__global__ void clear_while_counting(int* out, int synced, int increment) {
  __shared__ int tally;
  if (threadIdx.x == 0) tally = 0;
  if (synced) __syncthreads();
  if (threadIdx.x != 0) atomicAdd(&tally, increment);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = tally;
}

// The threads of warps 1 and 2 read a word in global memory, then thread `writer` of warp 1
// overwrites it. With only a __syncwarp between (synced 0) the write is ordered after its own
// warp's reads and races with warp 2's; the checker keeps two read records a word, and must keep a
// warp-2 reader although the first two it saw are of one warp that is not warp 0. synced 1: a
// __syncthreads, correct. word: [1] int, out: [blockDim.x] int.
__global__ void late_warps_read_then_write(int* word, int* out, int synced, int writer) {
  if (threadIdx.x >= 32) out[threadIdx.x] = *word;
  if (synced) __syncthreads(); else __syncwarp();
  if ((int)threadIdx.x == writer) *word = 8;
}

// One 16-byte access against another, four granules of shadow state: the one-thread block that
// runs first (turn 0 on `counter`) reads the int4, the other overwrites it. One access pair is
// one hazard, however many granules it spans. data: [1] int4, counter: [1] int (zero), out: [1] int4.
__global__ void wide_read_then_overwrite(int4* data, int* counter, int4* out) {
  if (atomicAdd(counter, 1) == 0) {
    out[0] = data[0];
    return;
  }
  data[0] = make_int4(1, 2, 3, 4);
}
