// attention_mma.cu: masked multi-query attention over one layer of a 16-bit or fp8 cache on tensor
// cores, with K/V tiles staged through shared memory by asynchronous copies.
//
// The same contract, arguments, launch grid and split-KV workspace as cupykv_attention
// (attention.cu), for head_dim 64, 96, 128 or 256, and for a smaller head_dim (a multiple of 8, fp8: 16) on the
// next of those up, its extra dims zeros (step 1 and the copies). cupykv_attention_mma<T, TI, HEAD_DIM>: the cache stores
// T, q and out have the io type TI (kv_codec.cuh): T == TI for __half and __nv_bfloat16 caches;
// T = __nv_fp8_e4m3 with TI __nv_bfloat16, __half or float, each element standing for
// code * k_scales[layer, kv_head] (v_scales for V). For sequence b, query i (position
// p = lengths[b] + i) and head h of kv head g = h / group,
//     s_j = scale * q[b,i,h] . k[b,j,g]    (q rotated at p when use_rope; softcap when > 0)
//     attended j: j <= p, j < max_seq, and j > p - window (when window > 0)
//     out[b,i,h] = sum_j softmax(s)_j * v[b,j,g], or zeros if no j is attended.
// The plan (cupykv/attention_plan.py) picks this kernel for those caches. With num_splits > 1 the
// last block of a tile to finish merges the splits into `out` (attention_merge.cuh).
//
// Design (docs/performance.md has the budget):
// - A block owns 16 * ROW_TILES query rows (query x head of one GQA group: one, two or four m16
//   tiles) and the keys of its split (attention_keys.cuh). The plan takes ROW_TILES = 2 past 16 rows
//   per sequence and kv head and 4 past 32 (speculative verification, wide GQA), so that the block
//   reads each K/V row of its keys once for up to 64 rows. Its kWarps key warps take 16-key steps
//   of that range in turn (key warp w: steps w, w + kWarps, ...), each with its own online-softmax
//   state per tile, and merge at the end in a fixed order. Each step's K and V fragments are loaded
//   once and used for every tile of the warp. A tile past the block's rows (the last block of a
//   sequence and kv head) is computed on zero queries and never stored, as long as in a full
//   block: a warp-uniform skip cost a WARPSYNC before every mma of every step (80 to 140 issued
//   instructions a step on sm_90) in every block.
// - A warp holds at most kMaxWarpTiles = 2 tiles (their accumulators take most of its registers),
//   or kMaxWarpTiles256 = 1 at head_dim 256 (one tile's accumulators are 128 registers a lane).
//   Four tiles are two row groups of 2 tiles: warp (group g, key warp w) computes tiles 2g and
//   2g + 1 over key warp w's steps, from a stage that the two warps of key warp w fill together
//   and share; at head_dim 256 two tiles are two row groups of one. A row's sums are thus those
//   of the same row in a one-tile block: the same steps, in the same order, merged in the same
//   key-warp order. Head_dim 256 takes one or two tiles per block: four would need 132 KiB of
//   shared memory, past the 99 KiB a block may have on sm_86 and sm_89.
// - Each key warp double-buffers its steps (16-bit caches; fp8 below): the K and V rows of step
//   n + kWarps are copied with 16-byte cp.async (.cg, L2 only) while step n is computed. Sixteen
//   lanes read one 256-byte row (8 for head_dim 64, the whole warp a 512-byte row at 256), so a
//   warp request covers whole rows; at head_dim 96 (192-byte rows, 12 copies) the warp's 32
//   copies run on across row ends, 512 contiguous bytes of whole 32-byte sectors. Keys past the
//   split are zero-filled, never read, so a stale row (NaN) past the live length cannot reach a
//   product. One row group: no barrier runs inside
//   the key loop (__syncwarp orders a warp's own stage). Two row groups: the key loop runs in
//   block-uniform rounds (round n: step n * kWarps + w of each key warp w), with a block barrier
//   once a round's copies have landed and another once every warp is done with its stage.
// - S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32 accumulation on operands of type
//   M = mma_type<T, TI> (T for 16-bit caches, __half for fp8 caches). The operands are split into
//   16-bit pieces whose sum is the fp32 value: q is exact in M unless rotated or float (rope or TI
//   float: three pieces, all 24 bits of the row's largest element), and P = hi + lo (16
//   bits in bf16, 22 in half), so the products carry close to fp32 precision, as on the CUDA-core
//   kernel, and the stated tolerances hold unchanged. Half operands have a narrow range: P's pieces
//   are taken of p * 2^15 (kPLog2Factor, unscaled when published), and q rows that are not exact
//   halves (bf16 or float io of fp8 caches, or rotated by rope) are brought into [2^14, 2^15) by a
//   power of two per row (scaled_q; step 1): neither past the half's 65504 nor into its subnormals.
// - Masks only where a step can hold a masked key (the split's last step, the diagonal of a
//   verification tile, a window's first keys): a block-uniform test per step, no integer division
//   in the loop. Rows past the tile (q_len * group < 16) are zero queries, computed, never stored.
// - Per step, only the work the step needs: the softmax weights are base-2 exponentials, one
//   MUFU.EX2 each (exp_shifted, common.cuh); a tile's accumulators are rescaled only when a warp
//   vote finds a row whose max moved in the step (a multiply by exactly 1 skipped, so exact); the
//   S loop is compiled for one q piece and for three, so unrotated 16-bit q issues no
//   predicated-off mma. docs/performance.md counts the common path's instructions.
// - A non-finite V element reaches only the rows that attend it: in a masked step of rows at several
//   positions, where a weight of 0 would multiply it, the stage is checked, such elements zeroed, and
//   each row that attends one (weight above 0) marked to return NaN (step 4).
// - A row's result depends only on its own query and the split's keys (the mma sums each output
//   element over its own row), so with split_keys a row is bit-identical for every q_len.
//
// The fp8 load path (T = __nv_fp8_e4m3): the same steps, copies and masks, with K/V staged as raw
// codes. A row is head_dim bytes, copied 16 codes per cp.async (8 lanes on a 128-byte row, 4 at
// head_dim 64, 16 at 256; at 96, 6 copies a row, a warp's copies across row ends) into a stage row of head_dim + 16 bytes; a warp keeps kStagesFp8 = 3
// stages, so steps n + kWarps and n + 2 kWarps are in flight while n is computed: as many bytes as
// the 16-bit path's one step. The mma B fragments are built from the bytes (no ldmatrix, no M
// tile), with the head dims permuted so that each lane reads whole 32-bit words of codes: for
// S = Q K^T, the k slots 2t, 2t + 1, 8 + 2t, 9 + 2t that lane (g = lane / 4, t = lane % 4) holds
// in each 16 are dims 4t .. 4t + 3 (fp8_q_slot; q is stored in slot order), one word of key g and
// one of key 8 + g;
// for P V, output column g of n8 block b is dim 32 (b / 4) + 4g + b % 4 (fp8_v_column), so lane g
// reads one word of each of keys 2t, 2t + 1, 8 + 2t and 9 + 2t per 32 dims and pairs up the two
// keys' codes with a byte permute; the accumulators stay in column order until the final write
// reads each dim from its column. Each word is widened exactly to two pairs of M = __half
// (widen_fp8_word: one instruction a pair on sm_89 and later, no shift for the high pair; before
// sm_89 about seven, a byte permute, five integer operations and one HMUL2; a widen to bf16 would
// take four). At the stage row stride every word read is free of bank conflicts (lanes of a warp hit
// 32 different banks).
// The scales stay out of the loop: the logits are (scale * k_scale) * (q . codes), and the
// output (unnormalised, before the partial write or the normalised store) is multiplied by v_scale,
// so the split merge is unchanged. The smaller stages also hold the row max and sum at the end, and
// let 4 blocks share an SM (attention_mma_min_blocks).
//
// Launch geometry: block (kWarps * row groups * 32); grid (batch * n_kv * tiles, num_splits), tiles =
// ceil(q_len * group / (16 * ROW_TILES)), block x = (b * n_kv + kv_head) * tiles + tile, y = split.
// Dynamic shared memory (attention_mma_tiling): ROW_TILES * kQTile<HEAD_DIM> + kStages<HEAD_DIM>
// (16-bit caches) or kStages<HEAD_DIM>Fp8 (fp8 caches), at least ROW_TILES * kAccTile<HEAD_DIM>;
// past 48 KiB (two or four row tiles, but for fp8 caches with two at head_dim 64) the launch needs
// the kernel's opt-in, which the plan makes.
//
// Device-resident arguments: lengths [batch] int32, k_scales / v_scales [layers, n_kv] float32, q,
// k/v cache (read), out, the partial_* workspace and split_counters (written), run_if [1] int32
// (read first: 0 makes the launch return at once, before any cp.async, barrier or counter, reading
// nothing else and writing nothing; common.cuh). Every other argument is fixed per launch, so a
// captured graph replays correctly as lengths and scales change.
#include "common.cuh"
#include "async_copy.cuh"
#include "attention_keys.cuh"
#include "attention_merge.cuh"
#include "kv_codec.cuh"
#include "mma.cuh"
#include "shared_layout.cuh"

namespace attention_mma_tiling {
constexpr int kTileRows = 16;      // query rows of one m16 tile: the m of mma.m16n8k16
constexpr int kMaxRowTiles = 4;    // m16 tiles per block: 1 (up to 16 rows), 2 (32) or 4 (more; ROW_TILES)
constexpr int kMaxWarpTiles = 2;   // m16 tiles per warp: four tiles per block are two row groups of warps
constexpr int kMaxWarpTiles256 = 1;   // at head_dim 256: two tiles per block are two row groups
constexpr int kStepKeys = 16;      // keys of one warp step: two n8 blocks of S, the k16 of P.V
constexpr int kSplitAlign = 128;   // split boundaries (num_splits mode) fall on multiples of this
constexpr int kStages = 2;         // K/V buffers per warp: one computed while the next lands
constexpr int kStagesFp8 = 3;      // fp8 caches: one computed while the next two land
constexpr int kQPieces = 3;        // 16-bit pieces of a rotated (or float) q
constexpr int kRowPad = 8;         // elements after each shared row: ldmatrix reads 8 rows conflict-free
constexpr int kRowPadFp8 = 16;     // bytes after each fp8 stage row: 16-byte rows, conflict-free fragments
constexpr int kAccPad = 8;         // floats after each accumulator row: the 8-byte stores of step 5 conflict-free
// Key warps per block: 4 at head_dim 64, 2 at 96 and 128, 1 at 256, whatever the row tiles (they split
// the keys, so a row's sums follow their count: it must not change with q_len). Each row group (four
// row tiles; two at head_dim 256) takes that many warps. At head_dim 256 one warp's stages are 33 KB,
// and its 16-key step in flight 16 KB: a second key warp would leave an sm_80 SM one block.
constexpr int kWarps64 = 4;
constexpr int kWarps96 = 2;
constexpr int kWarps128 = 2;
constexpr int kWarps256 = 1;
// Dynamic shared memory, bytes: the q pieces, [kQPieces][16 * ROW_TILES][head_dim + pad] M, that is
// ROW_TILES times kQTile<head_dim>; then the K and V stages, [key warps][stages][2][16][row] T.
// After the key loop both are overwritten by the key warps' fp32 accumulators [key warps]
// [16 * ROW_TILES][head_dim + kAccPad] and row max and sum [2][key warps][16 * ROW_TILES]: ROW_TILES
// times kAccTile<head_dim>, which four tiles at head_dim 64 need beyond the q pieces and stages.
constexpr int kQTile64 = kQPieces * kTileRows * (64 + kRowPad) * 2;
constexpr int kQTile96 = kQPieces * kTileRows * (96 + kRowPad) * 2;
constexpr int kQTile128 = kQPieces * kTileRows * (128 + kRowPad) * 2;
constexpr int kQTile256 = kQPieces * kTileRows * (256 + kRowPad) * 2;
constexpr int kStages64 = kWarps64 * kStages * 2 * kStepKeys * (64 + kRowPad) * 2;
constexpr int kStages96 = kWarps96 * kStages * 2 * kStepKeys * (96 + kRowPad) * 2;
constexpr int kStages128 = kWarps128 * kStages * 2 * kStepKeys * (128 + kRowPad) * 2;
constexpr int kStages256 = kWarps256 * kStages * 2 * kStepKeys * (256 + kRowPad) * 2;
constexpr int kStages64Fp8 = kWarps64 * kStagesFp8 * 2 * kStepKeys * (64 + kRowPadFp8);
constexpr int kStages96Fp8 = kWarps96 * kStagesFp8 * 2 * kStepKeys * (96 + kRowPadFp8);
constexpr int kStages128Fp8 = kWarps128 * kStagesFp8 * 2 * kStepKeys * (128 + kRowPadFp8);
constexpr int kStages256Fp8 = kWarps256 * kStagesFp8 * 2 * kStepKeys * (256 + kRowPadFp8);
constexpr int kAccTile64 = kWarps64 * kTileRows * (64 + kAccPad + 2) * 4;
constexpr int kAccTile96 = kWarps96 * kTileRows * (96 + kAccPad + 2) * 4;
constexpr int kAccTile128 = kWarps128 * kTileRows * (128 + kAccPad + 2) * 4;
constexpr int kAccTile256 = kWarps256 * kTileRows * (256 + kAccPad + 2) * 4;
// Past 48 KiB a launch needs the kernel's opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize);
// two and four row tiles take it (but fp8 caches with two at head_dim 64), and every instance at
// head_dim 256. kMaxShared: the most any instance
// asks, within the opt-in limit of every target (99 KiB on sm_86 and sm_89).
constexpr int kMaxShared = 99 * 1024;
}  // namespace attention_mma_tiling

// One of four values by head_dim (64, 96, 128 or 256): the tiling constants of that size.
template <int HEAD_DIM> constexpr int attention_mma_by_head_dim(int at64, int at96, int at128, int at256) {
    return HEAD_DIM == 64 ? at64 : HEAD_DIM == 96 ? at96 : HEAD_DIM == 128 ? at128 : at256;
}

template <int HEAD_DIM> constexpr int attention_mma_warps() {   // key warps (per row group)
    using namespace attention_mma_tiling;
    return attention_mma_by_head_dim<HEAD_DIM>(kWarps64, kWarps96, kWarps128, kWarps256);
}

template <int HEAD_DIM, int ROW_TILES> constexpr int attention_mma_row_groups() {   // warps per key warp
    using namespace attention_mma_tiling;
    constexpr int kMost = HEAD_DIM == 256 ? kMaxWarpTiles256 : kMaxWarpTiles;
    return ROW_TILES > kMost ? ROW_TILES / kMost : 1;
}

// Blocks per SM the design assumes (__launch_bounds__; `python -m cupykv check` holds every instance
// to it). One row tile: 3 for 16-bit caches, whose stages bind shared memory; 4 for fp8 caches, whose
// stages are smaller: what sm_80's shared memory (164 KB) fits. At head_dim 64 (128 threads) that caps
// registers at 128; at 128 (64 threads) it caps nothing. (It was 5 from sm_90 on, whose 228 KB fit
// five, until the check for non-finite V in step 4 took fp8 head_dim 64 past the 96 registers five
// allow: it spilled there.) Two row tiles: 2, what sm_80's shared memory gives at head_dim 128 (the
// registers may grow to 255 for the second tile's accumulators). Four: 1, what sm_80's shared memory
// gives at head_dim 128 (a warp's registers as with two tiles). Head_dim 256, whose q pieces and stage
// rows are twice as wide, and one key warp: 2 with one tile and 1 with two, what sm_80 gives 16-bit
// caches.
template <typename T, int HEAD_DIM, int ROW_TILES> constexpr int attention_mma_min_blocks() {
    return HEAD_DIM == 256 ? (ROW_TILES == 1 ? 2 : 1)
         : ROW_TILES == 4 ? 1 : ROW_TILES == 2 ? 2
         : cupykv::is_fp8<T>::value ? 4 : 3;
}

namespace cupykv {

// fp8 caches: the k slot of the mma that head dim d takes in S = Q K^T. Within each 16 dims, lane
// t = quad_col of a B fragment holds slots 2t, 2t + 1, 8 + 2t and 9 + 2t; they take dims 4t .. 4t + 3,
// so that the lane's four codes of a key are one 32-bit word of its stage row. q is stored in slot
// order, so S is the same dot product, its terms summed in another order.
__device__ __forceinline__ int fp8_q_slot(int d) {
    const int within = d % 16, t = within / 4, h = (within / 2) % 2, e = within % 2;
    return d - within + 8 * h + 2 * t + e;
}

// fp8 caches: the output column of P V (n8 block b, column g of the block: c = 8 b + g) that head
// dim d takes. Column c stands for dim 32 (b / 4) + 4 g + b % 4, so that the V codes a B fragment's
// lane g needs for blocks 4v .. 4v + 3 of a key are one 32-bit word of its stage row. The
// accumulators keep column order; the final write reads dim d from its column.
__device__ __forceinline__ int fp8_v_column(int d) {
    const int within = d % 32;
    return 8 * (4 * (d / 32) + within % 4) + within / 4;
}

// Half operands, q not exact in one half: the k of a q row's factor 2^k, which brings its largest |q|
// (`largest`, finite and positive, else k = 0) into [2^14, 2^15): the half's range keeps 11 bits down
// to 2^-28 of it, and the largest piece stays below the half's 65504. k is kept within +-112, so
// that 2^k and 2^-k are normal floats.
__device__ __forceinline__ int half_q_exponent(float largest) {
    if (!(largest > 0.0f) || isinf(largest)) return 0;
    const int floor_log2 = ((__float_as_int(largest) >> 23) & 0xff) - 127;   // a normal float (ftz)
    return min(max(14 - floor_log2, -112), 112);
}

// 2^k as a float, for |k| <= 126.
__device__ __forceinline__ float power_of_two(int k) { return __int_as_float((k + 127) << 23); }

// Four fp8 codes of shared memory (the lowest address in the low byte) as one 32-bit load.
__device__ __forceinline__ unsigned fp8_code_word(const unsigned char* at) {
    return *reinterpret_cast<const unsigned*>(at);
}

}  // namespace cupykv

template <typename T, typename TI, int HEAD_DIM, int ROW_TILES>
__global__ void __launch_bounds__(attention_mma_warps<HEAD_DIM>() * attention_mma_row_groups<HEAD_DIM, ROW_TILES>() * 32,
                                  attention_mma_min_blocks<T, HEAD_DIM, ROW_TILES>())
    cupykv_attention_mma(
    TI* __restrict__ out,                 // [batch, q_len, n_heads, head_dim] (num_splits == 1)
    float* __restrict__ partial_out,      // [num_splits, batch * q_len * n_heads, head_dim]
    float* __restrict__ partial_max,      // [num_splits, batch * q_len * n_heads]
    float* __restrict__ partial_sum,      // [num_splits, batch * q_len * n_heads]
    unsigned* __restrict__ split_counters,  // [batch * n_kv * tiles], 0 before the first launch (and after each)
    const TI* __restrict__ q,             // [batch, q_len, n_heads, head_dim], contiguous
    const T* __restrict__ k_cache,        // cache base, strides below
    const T* __restrict__ v_cache,
    const int* __restrict__ lengths,      // [batch], device-resident
    const float* __restrict__ k_scales,   // [layers, n_kv], device-resident (read by fp8 caches only)
    const float* __restrict__ v_scales,   // [layers, n_kv], device-resident (read by fp8 caches only)
    int layer,
    long long layer_offset, long long stride_batch, long long stride_seq, long long stride_head,
    int q_len, int n_heads, int n_kv, int head_dim_runtime, int max_seq, int num_splits, int split_keys,
    float scale, float softcap, int window, int use_rope, double rope_theta,
    const int* __restrict__ run_if) {     // [1], device-resident: 0 = do nothing
    if (cupykv::gated_off(run_if)) return;
    using namespace attention_mma_tiling;
    using M = typename cupykv::mma_type<T, TI>::type;   // the mma operand type
    constexpr bool kFp8 = cupykv::is_fp8<T>::value;
    // q rows scaled into the half's range: half operands of q that are not exact halves (bf16 or float
    // io, or rotated)
    constexpr bool kHalfM = cupykv::same_type<M, __half>::value;
    const bool scaled_q = kHalfM && (!cupykv::same_type<TI, __half>::value || use_rope);
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                  "cupykv_attention_mma: head_dim 64, 96, 128 or 256");
    static_assert(ROW_TILES == 1 || ROW_TILES == 2 || (ROW_TILES == kMaxRowTiles && HEAD_DIM != 256),
                  "cupykv_attention_mma: 1, 2 or 4 row tiles (1 or 2 at head_dim 256)");
    static_assert(kFp8 ? sizeof(T) == 1 : sizeof(T) == 2 && cupykv::same_type<T, TI>::value,
                  "cupykv_attention_mma: __half or __nv_bfloat16 caches of their own type, or __nv_fp8_e4m3");
    constexpr int kWarps = attention_mma_warps<HEAD_DIM>();           // key warps
    constexpr int kRowGroups = attention_mma_row_groups<HEAD_DIM, ROW_TILES>();  // warps sharing each key warp's stages
    constexpr int kWarpTiles = ROW_TILES / kRowGroups;                  // m16 tiles of one warp
    constexpr int kThreads = kWarps * kRowGroups * 32;
    constexpr int kBlockRows = kTileRows * ROW_TILES;   // query rows of the block
    constexpr int kWarpRows = kTileRows * kWarpTiles;   // query rows of one warp (of its row group)
    constexpr int kRow = HEAD_DIM + kRowPad;          // shared q row stride, elements of M
    constexpr int kStageRow = kFp8 ? HEAD_DIM + kRowPadFp8 : kRow;   // shared K/V row stride, elements of T
    constexpr int kTile = kStepKeys * kStageRow;      // one K or V tile of a stage, elements of T
    constexpr int kStageCount = kFp8 ? kStagesFp8 : kStages;
    constexpr int kCodesPerCopy = 16 / (int)sizeof(T);            // elements of one 16-byte copy
    constexpr int kPiecesPerRow = HEAD_DIM / kCodesPerCopy;       // 16-byte copies per K/V row
    constexpr int kDimBlocks = HEAD_DIM / 8;          // n8 blocks of the output
    constexpr int kQBytes = kQPieces * kBlockRows * kRow * (int)sizeof(M);
    constexpr int kStageBytes = kWarps * kStageCount * 2 * kTile * (int)sizeof(T);
    constexpr int kAccRow = HEAD_DIM + kAccPad;       // shared accumulator row stride, floats
    constexpr int kAccBytes = kWarps * kBlockRows * kAccRow * (int)sizeof(float);   // the key warps' accumulators
    constexpr int kStatBytes = 2 * kWarps * kBlockRows * (int)sizeof(float);          // their row max and sum
    constexpr int kLoopBytes = kQBytes + kStageBytes, kMergeBytes = kAccBytes + kStatBytes;
    constexpr int kSharedBytes = kLoopBytes > kMergeBytes ? kLoopBytes : kMergeBytes;
    static_assert(kLoopBytes == ROW_TILES * attention_mma_by_head_dim<HEAD_DIM>(kQTile64, kQTile96, kQTile128, kQTile256)
                                    + (kFp8 ? attention_mma_by_head_dim<HEAD_DIM>(kStages64Fp8, kStages96Fp8, kStages128Fp8,
                                                                                  kStages256Fp8)
                                            : attention_mma_by_head_dim<HEAD_DIM>(kStages64, kStages96, kStages128, kStages256))
                  && kMergeBytes == ROW_TILES * attention_mma_by_head_dim<HEAD_DIM>(kAccTile64, kAccTile96, kAccTile128,
                                                                                    kAccTile256),
                  "attention_mma: the shared memory layout differs from attention_mma_tiling");
    static_assert(kSharedBytes <= kMaxShared, "attention_mma: shared memory past kMaxShared");
    static_assert(kQBytes % 16 == 0 && kStageRow * (int)sizeof(T) % 16 == 0, "attention_mma: 16-byte stage rows");
    // The cache's head size: HEAD_DIM, or a smaller one that the plan runs on the next instance up
    // (a multiple of kCodesPerCopy, so whole copies; attention_mma_head_dim in cupykv/kernels). Dims
    // head_dim .. HEAD_DIM - 1 are zeros in q and in the stages, never read from the cache, never written.
    const int head_dim = head_dim_runtime;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int key_warp = warp % kWarps, row_group = warp / kWarps;
    const int quad_row = lane / 4, quad_col = lane % 4;   // the mma fragment coordinates

    const int group = n_heads / n_kv;
    const int tiles = (q_len * group - 1) / kBlockRows + 1;           // blocks per sequence and kv head
    const int head_of_batch = blockIdx.x / tiles;                    // b * n_kv + kv_head
    const int b = head_of_batch / n_kv, kv_head = head_of_batch % n_kv;
    const int split = blockIdx.y;
    const int first_row = (blockIdx.x - head_of_batch * tiles) * kBlockRows;
    const int block_rows = min(kBlockRows, q_len * group - first_row);
    const int warp_first_row = row_group * kWarpRows;                 // the warp's first row in the block
    const int length = cupykv::live_length(lengths[b], max_seq);
    const int pieces = CUPYKV_COMMON_PATH(use_rope, false) || cupykv::same_type<TI, float>::value ? kQPieces : 1;
    // P's weights as mma operands: with half operands they are taken times 2^15. A half is subnormal
    // below 2^-14, in steps of 2^-24, so unscaled a weight under 2^-25 rounded to zero in both pieces
    // (one key 17.4 above the rest lost all their weights); scaled, a weight keeps 11 bits down to
    // 2^-29 and its pieces are off by at most 2^-40. The row sums carry the same factor, and both are
    // unscaled when published. The largest weight, 2^15, is far below the half's 65504.
    constexpr float kPLog2Factor = kHalfM ? 15.0f : 0.0f, kPUnscale = kHalfM ? 1.0f / 32768.0f : 1.0f;
    // The logit factor and, for fp8 caches, the head's V scale (16-bit caches: scale alone, no scales read).
    float logit_scale = scale, v_scale = 1.0f;
    if constexpr (kFp8) {
        logit_scale = scale * k_scales[layer * n_kv + kv_head];
        v_scale = v_scales[layer * n_kv + kv_head];
    } else {
        (void)k_scales, (void)v_scales, (void)layer, (void)v_scale;
    }

    extern __shared__ __align__(16) unsigned char smem_bytes[];
    cupykv::SharedLayout loop_memory(smem_bytes);   // steps 1-4; the merge reuses the bytes (step 5)
    M* q_tile = loop_memory.take<M>(kQBytes / (int)sizeof(M), "q_tile");                  // [kQPieces][kBlockRows][kRow]
    T* stages = loop_memory.take<T>(kStageBytes / (int)sizeof(T), "stages");  // [key warps][kStageCount][K, V][kTile]

    // 1. The block's queries as 16-bit pieces: q (exact), or q rotated at its position in fp32 (or a
    //    float q) cut into hi + mid + lo. Rows past the block are zeros. Half operands of a q that is
    //    not exact in one half (scaled_q): a row is first multiplied by 2^k so that its largest |q|
    //    lies in [2^14, 2^15) (half_q_exponent), which a half holds with 11 bits down to 2^-28 of it,
    //    and its logits by 2^-k (row_logit_scale below, from the factor kept in the row's padding).
    const int half_dim = head_dim / 2;
    // The pair (d, d + half_dim) of block row r as fp32, rotated when use_rope; zeros past the block.
    auto load_pair = [&](int r, int d, float* lo, float* hi) {
        *lo = 0.0f, *hi = 0.0f;
        if (r < block_rows) {
            const int row = first_row + r, i = row / group, h = kv_head * group + row % group;
            const long long base = (((long long)b * q_len + i) * n_heads + h) * head_dim;
            *lo = cupykv::to_float<TI>(q[base + d]);
            *hi = cupykv::to_float<TI>(q[base + d + half_dim]);
            if (use_rope) cupykv::rope_rotate_pair(lo, hi, length + i, d, head_dim, rope_theta);
        }
    };
    // Its pieces; fp8 caches: each dim goes to its k slot (fp8_q_slot), where K's codes are read from.
    auto store_pieces = [&](int r, int d, float lo, float hi) {
        const int lo_column = kFp8 ? cupykv::fp8_q_slot(d) : d;
        const int hi_column = kFp8 ? cupykv::fp8_q_slot(d + half_dim) : d + half_dim;
        for (int p = 0; p < kQPieces; ++p) {
            const M lo_piece = cupykv::from_float<M>(lo), hi_piece = cupykv::from_float<M>(hi);
            q_tile[(p * kBlockRows + r) * kRow + lo_column] = lo_piece;
            q_tile[(p * kBlockRows + r) * kRow + hi_column] = hi_piece;
            lo -= cupykv::to_float(lo_piece);   // exact: the remainder of a rounding fits in fp32
            hi -= cupykv::to_float(hi_piece);
        }
    };
    // The row's 2^-k, in the padding after its first piece (16 bytes no ldmatrix reads; 16-byte aligned).
    auto q_unscale = [&](int r) -> float& { return *reinterpret_cast<float*>(q_tile + r * kRow + HEAD_DIM); };
    // Beside it, the row's mark: nonzero once a key warp found it attending a NaN or infinite V element (step 4).
    auto row_mark = [&](int r) -> unsigned& { return *reinterpret_cast<unsigned*>(q_tile + r * kRow + HEAD_DIM + 2); };
    for (int r = tid; r < kBlockRows; r += kThreads) row_mark(r) = 0;
    if constexpr (kHalfM) {   // a factor per row: 2^0 where q is exact in one half (half io, no rope)
        constexpr int kPairsPerLane = (HEAD_DIM / 2 + 31) / 32;   // rounded up: at head_dim 96 lanes 0-15 take two
        for (int r = warp; r < kBlockRows; r += kThreads / 32) {   // a warp per row: lanes over its pairs
            float lo[kPairsPerLane], hi[kPairsPerLane], largest = 0.0f;
            for (int j = 0; j < kPairsPerLane; ++j) {
                lo[j] = 0.0f, hi[j] = 0.0f;
                if (lane + 32 * j < half_dim) load_pair(r, lane + 32 * j, &lo[j], &hi[j]);
                largest = fmaxf(largest, fmaxf(fabsf(lo[j]), fabsf(hi[j])));
            }
            const int exponent = scaled_q ? cupykv::half_q_exponent(cupykv::warp_max(largest)) : 0;
            if (lane == 0) q_unscale(r) = cupykv::power_of_two(-exponent);
            const float factor = cupykv::power_of_two(exponent);   // exact products
            for (int j = 0; j < kPairsPerLane; ++j)
                if (lane + 32 * j < half_dim) store_pieces(r, lane + 32 * j, lo[j] * factor, hi[j] * factor);
        }
    } else {
        for (int e = tid; e < kBlockRows * half_dim; e += kThreads) {
            const int r = e / half_dim, d = e - r * half_dim;
            float lo, hi;
            load_pair(r, d, &lo, &hi);
            store_pieces(r, d, lo, hi);
        }
    }
    // A smaller head's padded dims are zeros in every piece (fp8 caches: fp8_q_slot keeps a dim's slot
    // within its 16 dims, and such a head_dim is a multiple of 16).
    const int pad_dims = HEAD_DIM - head_dim;
    for (int e = tid; e < kQPieces * kBlockRows * pad_dims; e += kThreads)
        q_tile[(e / pad_dims) * kRow + head_dim + e % pad_dims] = cupykv::from_float<M>(0.0f);

    const cupykv::KeyRange keys = cupykv::attention_split_keys(length, first_row, block_rows, group, max_seq, window,
                                                               split, num_splits, split_keys, kSplitAlign);
    // Positions of this lane's two rows of each of the warp's tiles (quad_row and quad_row + 8); rows
    // past the block attend nothing.
    int position[kWarpTiles][2];
    for (int t = 0; t < kWarpTiles; ++t)
        for (int half = 0; half < 2; ++half) {
            const int r = warp_first_row + t * kTileRows + quad_row + 8 * half;
            position[t][half] = r < block_rows ? length + (first_row + r) / group : -1;
        }
    // Every live row attends every key of a step in [first_open, last_open]: no mask needed there.
    const int first_open = window > 0 ? length + (first_row + block_rows - 1) / group - window + 1 : 0;
    const int last_open = min(keys.end - 1, length + first_row / group);
    // Whether the block's rows sit at more than one position: only then can a step hold a key that
    // some rows attend and others do not (step 4).
    const bool mixed_positions = first_row / group != (first_row + block_rows - 1) / group;

    const long long head_base = layer_offset + b * stride_batch + kv_head * stride_head;
    T* my_stages = stages + key_warp * kStageCount * 2 * kTile;
    const int steps = (keys.end - keys.begin + kStepKeys - 1) / kStepKeys;
    const int rounds = (steps + kWarps - 1) / kWarps;   // key warp w's steps: n * kWarps + w, n < rounds

    // Copies the K and V rows of step `step` into stage `stage`; keys past the split are zero-filled.
    // The kRowGroups warps of the key warp share them: copy c of the step is (key c / kPiecesPerRow,
    // piece c % kPiecesPerRow), and thread s of those warps (s = 32 * row group + lane) issues copies
    // s, s + kSharers, ...: where a row is a power-of-two count of copies, a fixed column and keys
    // kKeysPerPass apart; at head_dim 96 (12 or 6 copies a row) each copy's key and column, worked
    // out once (kCopiesPerSharer of them, the last maybe past the step's copies). A copy of a padded dim
    // (a column past a smaller head_dim) is zero-filled as a key past the split is, reading nothing: it
    // looks up its key max_seq further on, past any split, and its source is the row's start.
    constexpr int kSharers = 32 * kRowGroups;
    constexpr bool kWholeRowsPerPass = 32 % kPiecesPerRow == 0;
    constexpr int kKeysPerPass = kWholeRowsPerPass ? kSharers / kPiecesPerRow : 1;
    constexpr int kStepCopies = kStepKeys * kPiecesPerRow;
    constexpr int kCopiesPerSharer = (kStepCopies + kSharers - 1) / kSharers;
    static_assert(kStepKeys % kKeysPerPass == 0 && HEAD_DIM % kCodesPerCopy == 0, "attention_mma: whole copies per step");
    const int sharer = 32 * row_group + lane;
    const int lane_key = sharer / kPiecesPerRow, lane_column = (sharer % kPiecesPerRow) * kCodesPerCopy;
    const bool lane_column_live = lane_column < head_dim;
    const int lane_key_lookup = lane_key + (lane_column_live ? 0 : max_seq);   // below 2 max_seq, an int
    const T* k_lane = k_cache + head_base + (lane_column_live ? lane_column : 0);
    const T* v_lane = v_cache + head_base + (lane_column_live ? lane_column : 0);
    // rows of other widths: each copy's key to look up, its place in a stage and its source column
    int copy_key[kCopiesPerSharer], copy_place[kCopiesPerSharer], copy_source[kCopiesPerSharer];
    for (int i = 0; i < kCopiesPerSharer; ++i) {
        const int c = sharer + i * kSharers, key = c / kPiecesPerRow, column = (c % kPiecesPerRow) * kCodesPerCopy;
        copy_key[i] = key + (column < head_dim ? 0 : max_seq), copy_place[i] = key * kStageRow + column;
        copy_source[i] = column < head_dim ? column : 0;
    }
    auto load_step = [&](int step, int stage) {
        const int first_key = keys.begin + step * kStepKeys;
        if constexpr (kWholeRowsPerPass) {
            T* k_stage = my_stages + stage * 2 * kTile + lane_key * kStageRow + lane_column;
            T* v_stage = k_stage + kTile;
#pragma unroll
            for (int pass = 0; pass < kStepKeys / kKeysPerPass; ++pass) {
                const int key = first_key + lane_key_lookup + pass * kKeysPerPass;
                const bool live = key < keys.end;
                const long long offset = (long long)(live ? key : keys.begin) * stride_seq;
                cupykv::cp_async_16(k_stage + pass * kKeysPerPass * kStageRow, k_lane + offset, live ? 16 : 0);
                cupykv::cp_async_16(v_stage + pass * kKeysPerPass * kStageRow, v_lane + offset, live ? 16 : 0);
            }
        } else {
            T* k_stage = my_stages + stage * 2 * kTile;
#pragma unroll
            for (int i = 0; i < kCopiesPerSharer; ++i) {
                if (kStepCopies % kSharers != 0 && sharer + i * kSharers >= kStepCopies) break;
                const int key = first_key + copy_key[i];
                const bool live = key < keys.end;
                const long long offset = head_base + (long long)(live ? key : keys.begin) * stride_seq + copy_source[i];
                T* k_at = k_stage + copy_place[i];
                cupykv::cp_async_16(k_at, k_cache + offset, live ? 16 : 0);
                cupykv::cp_async_16(k_at + kTile, v_cache + offset, live ? 16 : 0);
            }
        }
    };
    (void)copy_key, (void)copy_place, (void)copy_source, (void)lane_key_lookup, (void)k_lane, (void)v_lane;

    float acc[kWarpTiles][kDimBlocks][4];
    float row_max[kWarpTiles][2], row_sum[kWarpTiles][2];   // row_sum: this lane's share (the quad's added at the end)
    for (int t = 0; t < kWarpTiles; ++t) {
        for (int n = 0; n < kDimBlocks; ++n)
            for (int c = 0; c < 4; ++c) acc[t][n][c] = 0.0f;
        for (int half = 0; half < 2; ++half) {
            row_max[t][half] = cupykv::neg_infinity();
            row_sum[t][half] = 0.0f;
        }
    }

    // The warps that share a stage meet: one warp's lanes, or (two row groups) the whole block, whose
    // rounds are block-uniform.
    auto stage_barrier = [] {
        if constexpr (kRowGroups == 1) __syncwarp(); else __syncthreads();
    };
    for (int ahead = 0; ahead + 1 < kStageCount; ++ahead) {   // steps w, w + kWarps, ... in flight
        if (key_warp + ahead * kWarps < steps) load_step(key_warp + ahead * kWarps, ahead);
        cupykv::cp_async_commit();
    }
    __syncthreads();   // the q pieces, written by every thread
    // The logit factor of this lane's rows (quad_row and quad_row + 8 of each tile): scale, times the
    // k_scale of fp8 caches, times 2^-k for a scaled q row (exact: a power of two; 1 when not scaled).
    float row_logit_scale[kWarpTiles][2];
    for (int t = 0; t < kWarpTiles; ++t)
        for (int half = 0; half < 2; ++half)
            row_logit_scale[t][half] =
                kHalfM ? logit_scale * q_unscale(warp_first_row + t * kTileRows + quad_row + 8 * half) : logit_scale;

    for (int n = 0; n < rounds; ++n) {
        const int step = n * kWarps + key_warp;
        if (kRowGroups == 1 && step >= steps) break;   // one row group: the warp's own steps are done
        stage_barrier();   // every sharer is done with the stage the next copies refill (round n - 1's)
        const int next = step + (kStageCount - 1) * kWarps;
        if (next < steps) load_step(next, (n + kStageCount - 1) % kStageCount);
        cupykv::cp_async_commit();
        cupykv::cp_async_wait<kStageCount - 1>();   // this thread's copies of step `step` have landed
        stage_barrier();                            // ... and those of every thread sharing the stage
        if (step >= steps) continue;   // two row groups: a key warp past its last step only meets the block
        const T* k_stage = my_stages + (n % kStageCount) * 2 * kTile;
        const T* v_stage = k_stage + kTile;
        const int first_key = keys.begin + step * kStepKeys;
        // Whether a key of the step may be masked for some row (step 3), and, where rows at several
        // positions may attend different keys of it, which of its V rows hold a NaN or an infinity (step 4).
        const bool open = CUPYKV_COMMON_PATH(first_key >= first_open && first_key + kStepKeys - 1 <= last_open, true);
        const unsigned non_finite_keys = CUPYKV_COMMON_PATH(
            (!open && mixed_positions ? cupykv::stage_non_finite_keys<T, HEAD_DIM>(v_stage, kStageRow, lane) : 0u), 0u);

        // 2. S = Q K^T for each tile's 16 rows x 16 keys: s[tile][n8 block][c], rows quad_row (c < 2)
        //    and quad_row + 8. The K fragments are loaded once for every tile.
        float s[kWarpTiles][2][4];
        for (int t = 0; t < kWarpTiles; ++t)
            for (int nb = 0; nb < 2; ++nb)
                for (int c = 0; c < 4; ++c) s[t][nb][c] = 0.0f;
        // The q pieces are a compile-time count in each of the loop's two copies (one piece without
        // rope, the common case; three with it), so the common path issues no predicated-off mma or
        // ldmatrix for the pieces it does not have. Either copy sums the same terms in the same order.
        auto scores = [&](auto piece_count) {
            constexpr int kPieceCount = decltype(piece_count)::value;
#pragma unroll (kWarpTiles == 1 ? HEAD_DIM / 16 : 2)   // two tiles: two k-steps at a time, or the hoisted fragments spill
            for (int k0 = 0; k0 < HEAD_DIM; k0 += 16) {
                unsigned k_frag[4];   // keys 0-7 (k_frag[0..1]) and 8-15 (k_frag[2..3]), dims k0..k0+15
                if constexpr (kFp8) {
                    // slots 2t, 2t + 1 (k_frag[0]) and 8 + 2t, 9 + 2t ([1]) of keys quad_row and 8 + quad_row
                    // ([2], [3]) are dims k0 + 4t .. k0 + 4t + 3 (fp8_q_slot): one word of each key's row
                    const unsigned char* codes = reinterpret_cast<const unsigned char*>(k_stage)
                                                 + quad_row * kStageRow + k0 + 4 * quad_col;
                    const unsigned key_lo = cupykv::fp8_code_word(codes);
                    const unsigned key_hi = cupykv::fp8_code_word(codes + 8 * kStageRow);
                    cupykv::widen_fp8_word<M>(key_lo, k_frag[0], k_frag[1]);
                    cupykv::widen_fp8_word<M>(key_hi, k_frag[2], k_frag[3]);
                } else {
                    cupykv::ldmatrix_x4(k_frag, k_stage + ((lane / 16) * 8 + lane % 8) * kRow + k0 + ((lane / 8) % 2) * 8);
                }
                const unsigned keys_lo[2] = {k_frag[0], k_frag[1]}, keys_hi[2] = {k_frag[2], k_frag[3]};
#pragma unroll
                for (int t = 0; t < kWarpTiles; ++t) {
#pragma unroll
                    for (int p = 0; p < kPieceCount; ++p) {
                        unsigned q_frag[4];
                        const int q_row = p * kBlockRows + warp_first_row + t * kTileRows + lane % 16;
                        cupykv::ldmatrix_x4(q_frag, q_tile + q_row * kRow + k0 + (lane / 16) * 8);
                        cupykv::mma_m16n8k16<M>(s[t][0], q_frag, keys_lo, s[t][0]);
                        cupykv::mma_m16n8k16<M>(s[t][1], q_frag, keys_hi, s[t][1]);
                    }
                }
            }
        };
        if (pieces == 1) scores(cupykv::Count<1>{}); else scores(cupykv::Count<kQPieces>{});

        // 3. Scale, cap, mask (only in a step that can hold a masked key), online softmax per row.
        unsigned p_hi[kWarpTiles][4], p_lo[kWarpTiles][4];   // P as the A fragments of P.V: S's fragments
#pragma unroll
        for (int t = 0; t < kWarpTiles; ++t) {
            for (int nb = 0; nb < 2; ++nb)
                for (int c = 0; c < 4; ++c) {
                    float value = s[t][nb][c] * row_logit_scale[t][c / 2];
                    if (CUPYKV_COMMON_PATH(softcap > 0.0f, false)) value = softcap * tanhf(value / softcap);
                    if (!open) {
                        const int key = first_key + nb * 8 + 2 * quad_col + (c & 1), pos = position[t][c / 2];
                        const bool attended = key < keys.end && key <= pos && (window <= 0 || key > pos - window);
                        if (!attended) value = cupykv::neg_infinity();
                    }
                    s[t][nb][c] = value;
                }
            float rescale[2];
            for (int half = 0; half < 2; ++half) {
                float step_max = fmaxf(fmaxf(s[t][0][2 * half], s[t][0][2 * half + 1]),
                                       fmaxf(s[t][1][2 * half], s[t][1][2 * half + 1]));
                step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
                step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
                const float new_max = fmaxf(row_max[t][half], step_max);
                // exactly 1 while the row's max stands (no key attended yet included)
                rescale[half] = new_max == row_max[t][half] ? 1.0f : cupykv::exp_shifted(row_max[t][half], new_max);
                row_max[t][half] = new_max;
                // A row with no key attended yet has only -inf logits and a max of -inf: its weights are
                // taken against 0 instead, 2^-inf = 0 each, never (-inf) - (-inf). One select a row, not
                // one a weight.
                const float weight_max = new_max == cupykv::neg_infinity() ? 0.0f : new_max;
                float p[2][2];
                for (int nb = 0; nb < 2; ++nb)
                    for (int e = 0; e < 2; ++e) p[nb][e] = cupykv::exp_shifted(s[t][nb][2 * half + e], weight_max, kPLog2Factor);
                row_sum[t][half] = row_sum[t][half] * rescale[half] + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
                // a0a1: (row, keys 2t..2t+1); a2a3: (row + 8, ...); a4a5: (row, keys 8 + 2t..); a6a7: (row + 8, ...)
                for (int nb = 0; nb < 2; ++nb) {
                    const M hi0 = cupykv::from_float<M>(p[nb][0]), hi1 = cupykv::from_float<M>(p[nb][1]);
                    p_hi[t][2 * nb + half] = cupykv::pack_pair(hi0, hi1);
                    p_lo[t][2 * nb + half] = cupykv::pack_pair(cupykv::from_float<M>(p[nb][0] - cupykv::to_float(hi0)),
                                                               cupykv::from_float<M>(p[nb][1] - cupykv::to_float(hi1)));
                }
            }
            // The tile's accumulators are rescaled only when some row's max moved in this step: once
            // the maxima settle (most steps of a long context) the HEAD_DIM / 2 multiplies per lane
            // are skipped. Skipping a multiply by exactly 1 is exact, so no row's bits depend on the
            // other rows of its warp (the vote is warp-uniform, the arithmetic per row unchanged).
            if (CUPYKV_COMMON_PATH(__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f),
                                   CUPYKV_STEP_RESCALES))
                for (int n8 = 0; n8 < kDimBlocks; ++n8)
                    for (int c = 0; c < 4; ++c) acc[t][n8][c] *= rescale[c / 2];
        }

        // 4. O += P V, 16 dims (two n8 blocks) per V fragment, loaded once for every tile; V rows of
        //    keys past the split are zeros. A masked step of rows at several positions (a verification
        //    tile's diagonal, a window's first keys) may hold a V row that some of its rows attend and
        //    others do not (a pending row past a query). A weight of 0 times a NaN or infinite element
        //    is NaN in an mma, so in those steps only the stage is checked, and where it holds such
        //    elements (rare) the step runs on V with them as zeros, and each of the lane's rows that
        //    gives one of their keys a weight above 0 is marked, to return NaN in every dim (step 5).
        if (non_finite_keys != 0) {
            // lane (quad_row, quad_col) holds the weights of keys 8 nb + 2 quad_col + e of its rows, as the
            // pieces (element e) of pair 2 nb + half; a quad's four lanes hold a row's 16
            for (int t = 0; t < kWarpTiles; ++t)
                for (int half = 0; half < 2; ++half) {
                    unsigned marked = 0;
                    for (int nb = 0; nb < 2; ++nb)
                        for (int e = 0; e < 2; ++e) {
                            const unsigned weight_bits = (p_hi[t][2 * nb + half] | p_lo[t][2 * nb + half]) >> (16 * e);
                            if ((non_finite_keys >> (8 * nb + 2 * quad_col + e) & 1u) && (weight_bits & 0xffffu)) marked = 1;
                        }
                    marked |= __shfl_xor_sync(0xffffffffu, marked, 1);
                    marked |= __shfl_xor_sync(0xffffffffu, marked, 2);
                    if (marked && quad_col == 0)
                        atomicOr(&row_mark(warp_first_row + t * kTileRows + quad_row + 8 * half), 1u);
                }
            // the elements as zeros: in the stage where the warp has it to itself (and the next round's
            // copies refill it only after the barrier that opens the round), else in each fragment below
            if constexpr (kRowGroups == 1) {
                cupykv::zero_non_finite_elements<T, HEAD_DIM>(const_cast<T*>(v_stage), kStageRow, lane);
                __syncwarp();
            }
        }
#pragma unroll
        for (int d0 = 0; d0 < HEAD_DIM; d0 += 16) {
            unsigned v_frag[4];   // columns d0..d0+7 (v_frag[0..1]) and d0+8..d0+15 (v_frag[2..3])
            if constexpr (kFp8) {
                // keys 2t, 2t + 1 ([0], [2]) and 8 + 2t, 9 + 2t ([1], [3]) of columns d0 + g and d0 + 8 + g:
                // the dims of blocks d0 / 8 and d0 / 8 + 1 (fp8_v_column) are bytes 0, 1 (or 2, 3) of the word
                // at 32 (d0 / 32) + 4g of each key's row; the byte permutes pair up the keys' codes
                const unsigned char* codes = reinterpret_cast<const unsigned char*>(v_stage)
                                             + 2 * quad_col * kStageRow + (d0 / 32) * 32 + 4 * quad_row;
                const unsigned selector = d0 % 32 == 0 ? 0x5140u : 0x7362u;
                const unsigned keys_lo = __byte_perm(cupykv::fp8_code_word(codes),
                                                     cupykv::fp8_code_word(codes + kStageRow), selector);
                const unsigned keys_hi = __byte_perm(cupykv::fp8_code_word(codes + 8 * kStageRow),
                                                     cupykv::fp8_code_word(codes + 9 * kStageRow), selector);
                cupykv::widen_fp8_word<M>(keys_lo, v_frag[0], v_frag[2]);
                cupykv::widen_fp8_word<M>(keys_hi, v_frag[1], v_frag[3]);
            } else {
                cupykv::ldmatrix_x4_trans(v_frag, v_stage + (lane % 16) * kRow + d0 + (lane / 16) * 8);
            }
            if constexpr (kRowGroups > 1)
                if (non_finite_keys != 0)
                    for (int i = 0; i < 4; ++i) v_frag[i] = cupykv::zero_non_finite_word<M>(v_frag[i]);
            const unsigned dims_lo[2] = {v_frag[0], v_frag[1]}, dims_hi[2] = {v_frag[2], v_frag[3]};
#pragma unroll
            for (int t = 0; t < kWarpTiles; ++t) {
                cupykv::mma_m16n8k16<M>(acc[t][d0 / 8], p_hi[t], dims_lo, acc[t][d0 / 8]);
                cupykv::mma_m16n8k16<M>(acc[t][d0 / 8], p_lo[t], dims_lo, acc[t][d0 / 8]);
                cupykv::mma_m16n8k16<M>(acc[t][d0 / 8 + 1], p_hi[t], dims_hi, acc[t][d0 / 8 + 1]);
                cupykv::mma_m16n8k16<M>(acc[t][d0 / 8 + 1], p_lo[t], dims_hi, acc[t][d0 / 8 + 1]);
            }
        }
    }
    cupykv::cp_async_wait_all();

    // 5. Merge the key warps in order: each warp publishes its rows' max, sum and accumulators.
    for (int t = 0; t < kWarpTiles; ++t)
        for (int half = 0; half < 2; ++half) {
            row_sum[t][half] += __shfl_xor_sync(0xffffffffu, row_sum[t][half], 1);
            row_sum[t][half] += __shfl_xor_sync(0xffffffffu, row_sum[t][half], 2);
            row_sum[t][half] *= kPUnscale;   // exact: a power of two
        }
    __syncthreads();   // every key warp has marked its rows (step 4)
    unsigned marked_rows = 0;   // bit 2 t + half: the lane's row attends a NaN or infinite V element
    for (int t = 0; t < kWarpTiles; ++t)
        for (int half = 0; half < 2; ++half)
            marked_rows |= (row_mark(warp_first_row + t * kTileRows + quad_row + 8 * half) != 0 ? 1u : 0u) << (2 * t + half);
    __syncthreads();   // every warp is done with the q pieces and its stages: they become the accumulators
    cupykv::SharedLayout merge_memory(smem_bytes);
    float* warp_acc = merge_memory.take<float>(kAccBytes / (int)sizeof(float), "warp_acc");   // [key warps][kBlockRows][kAccRow]
    float* warp_max = merge_memory.take<float>(kWarps * kBlockRows, "warp_max");              // [key warps][kBlockRows]
    float* warp_sum = merge_memory.take<float>(kWarps * kBlockRows, "warp_sum");              // [key warps][kBlockRows]
    for (int t = 0; t < kWarpTiles; ++t)
        for (int half = 0; half < 2; ++half) {
            const int r = warp_first_row + t * kTileRows + quad_row + 8 * half;
            if (quad_col == 0) {
                warp_max[key_warp * kBlockRows + r] = row_max[t][half];
                warp_sum[key_warp * kBlockRows + r] = row_sum[t][half];
            }
            // a row marked in step 4 publishes NaN (its unscale), so its output is NaN in every dim
            const float unscale = marked_rows >> (2 * t + half) & 1u ? cupykv::quiet_nan() : kPUnscale;
            // In column order (fp8 caches: fp8_v_column), 8 bytes a lane: the 16 lanes of a half-warp
            // store rows quad_row .. + 3, kAccRow = 8 (mod 32) words apart, so 8 banks each: conflict-free
            // (at HEAD_DIM apart, a multiple of 32 words, the four rows took the same 8 banks: 4-way).
            for (int n8 = 0; n8 < kDimBlocks; ++n8)
                *reinterpret_cast<float2*>(warp_acc + (key_warp * kBlockRows + r) * kAccRow + n8 * 8 + 2 * quad_col) =
                    make_float2(acc[t][n8][2 * half] * unscale, acc[t][n8][2 * half + 1] * unscale);
        }
    __syncthreads();

    // 6. Write out (normalised) or the split's partial result, as cupykv_attention does.
    const long long rows_total = (long long)(gridDim.x / tiles) * q_len * group;   // batch * q_len * n_heads
    // the length is read again rather than held through the key loop: at head_dim 256 that register
    // is the one spill NVRTC 13.0 would make
    const int tile_length = cupykv::live_length(cupykv::read_again(lengths + b), max_seq);
    const cupykv::QueryTile tile = {b, q_len, n_heads, group, kv_head, first_row, block_rows, tile_length, max_seq,
                                    window};
    for (int e = tid; e < kBlockRows * HEAD_DIM; e += kThreads) {
        const int r = e / HEAD_DIM, d = e - r * HEAD_DIM;
        if (r >= block_rows || d >= head_dim) continue;   // past the block, or a smaller head's padded dim
        const int column = kFp8 ? cupykv::fp8_v_column(d) : d;   // where the warps left dim d
        float top = cupykv::neg_infinity();
        for (int w = 0; w < kWarps; ++w)
            if (warp_sum[w * kBlockRows + r] != 0.0f) top = fmaxf(top, warp_max[w * kBlockRows + r]);
        float sum = 0.0f, value = 0.0f;
        for (int w = 0; w < kWarps; ++w) {
            const float part = warp_sum[w * kBlockRows + r];
            if (part != 0.0f) {   // NaN too: a non-finite logit's sum is never dropped
                const float weight = expf(warp_max[w * kBlockRows + r] - top);
                sum += part * weight;
                value += warp_acc[(w * kBlockRows + r) * kAccRow + column] * weight;
            }
        }
        if constexpr (kFp8) value *= v_scale;   // the codes' sum times the head's scale
        const long long out_row = tile.out_row(r);
        if (num_splits == 1) {
            out[out_row * head_dim + d] = cupykv::from_float<TI>(cupykv::normalised_output(value, sum, tile.attends_a_key(r)));
        } else {
            partial_out[(split * rows_total + out_row) * head_dim + d] = value;
            if (d == 0) {
                partial_max[split * rows_total + out_row] = top;
                partial_sum[split * rows_total + out_row] = sum;
            }
        }
    }
    // 7. The block's last split to finish merges every split into out (attention_merge.cuh).
    __shared__ int is_last_split;
    if (num_splits > 1 && cupykv::attention_last_split(split_counters + blockIdx.x, num_splits, &is_last_split))
        cupykv::attention_merge_splits(out, partial_out, partial_max, partial_sum, tile, rows_total, num_splits,
                                       head_dim);
}
