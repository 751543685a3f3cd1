"""linear on tensor cores (kernels/linear_mma.cu) for 16-bit x and weight: which launches take it, its split
of in_features, every tile, step and split edge against ops_reference, and the independence of rows and
outputs that speculative decoding relies on, bit for bit.

The tolerance is test_ops.assert_linear_close's: the final rounding plus (in_features + 8) u32 of fp32
accumulation error relative to sum_k |x_k w_k|, a bound recursive fp32 summation meets in any order.
The emulator adds each mma's products in k order, one rounding per addition (tests/test_fragments.py).
"""
import numpy as np
import pytest

from cupykv import ops, ops_reference as reference
from cupykv.kernels import CUDA_TYPES, KERNELS, LINEAR_MMA_DTYPES, LINEAR_ROW_TILES
from cupykv.validate_launches import recording_launches
from backends import BACKENDS
from test_ops import NP_DTYPES, assert_linear_close, device, random, to_host
from test_traffic import linear_launch

TILING = KERNELS["linear_mma"].constants("linear_mma_tiling")

# (out_features, in_features) -> split_k, chosen to reach every split with uneven parts, partial last steps
# and parts of kAhead - 1 to kAhead + 1 steps (kAhead: 8 steps at ROW_TILE 8, 4 at 16; a step is 32 features)
EDGE_SHAPES = {
    (9, 32 * 33): 8,          # 33 steps over 8 parts of 5: the last part empty
    (2, 32 * 64 + 8): 8,      # 65 steps, the last holding one vector: parts of 9 (kAhead + 1 at ROW_TILE 8)
    (130, 32 * 17 - 24): 4,   # 65 vectors: 17 steps over parts of 5, the last of 2
    (33, 32 * 12): 2,         # one block holds 4 groups of 8 outputs: 33 spills into a second block
    (65, 200): 1,             # 7 steps, fewer than one kAhead batch; 65 outputs over 2 blocks of 64
    (7, 8): 1,                # one vector
}
ROWS = (1, 7, 8, 9, 16, 17, 33)   # tiles of 8 and 16, and 16 + 16 + 1


def test_split_k_depends_on_the_weights_shape_alone():
    assert {shape: ops.linear_mma_split_k(*shape) for shape in EDGE_SHAPES} == EDGE_SHAPES
    # an 8B LLaMA's projections: the narrow ones split 8 ways, the LM head not at all
    llama_8b = {(1024, 4096): 8, (4096, 4096): 4, (14336, 4096): 2, (4096, 14336): 4, (128256, 4096): 1}
    assert {shape: ops.linear_mma_split_k(*shape) for shape in llama_8b} == llama_8b
    # SmolLM2-135M (hidden 576 = 18 steps): every part keeps at least LINEAR_MMA_MIN_STEPS steps
    assert ops.linear_mma_split_k(576, 576) == ops.linear_mma_split_k(192, 576) == 4
    assert ops.linear_mma_split_k(49152, 576) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_16_bit_aligned_projections_run_on_tensor_cores_and_the_rest_on_cuda_cores(backend):
    rng = np.random.default_rng(3)
    cases = [("float16", 64, True), ("bfloat16", 40, True), ("float32", 64, False), ("bfloat16", 100, False)]
    for dtype, in_features, tensor_cores in cases:
        for rows, tile in ((1, 8), (8, 8), (9, 16), (33, 16)):
            x, weight = random(rng, (rows, in_features), dtype), random(rng, (5, in_features), dtype)
            with recording_launches() as launched:
                ops.linear(device(backend, x), device(backend, weight))
            ctype = CUDA_TYPES[dtype]
            cuda_core_tile = next((t for t in LINEAR_ROW_TILES if t >= rows), LINEAR_ROW_TILES[-1])
            want = f"cupykv_linear_mma<{ctype}, {tile}>" if tensor_cores else f"cupykv_linear<{ctype}, {cuda_core_tile}>"
            assert launched == [("linear_mma" if tensor_cores else "linear", want)], (dtype, in_features, rows)
    # a view one element into its buffer is not 16-byte aligned: CUDA cores, and still the right result
    x, weight = random(rng, (3, 64), "bfloat16"), random(rng, (10, 64), "bfloat16")
    buffer = device(backend, np.zeros(weight.size + 1, weight.dtype))
    view = buffer[1:].reshape(weight.shape)
    view[...] = device(backend, weight)
    assert not ops.linear_uses_tensor_cores("bfloat16", device(backend, x), view)
    with recording_launches() as launched:
        got = ops.linear(device(backend, x), view)
    assert [op for op, _ in launched] == ["linear"]
    assert_linear_close(to_host(backend, got, "bfloat16"), x, weight, reference.linear(x, weight), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LINEAR_MMA_DTYPES)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=[f"out{o}-in{i}" for o, i in EDGE_SHAPES])
def test_every_tile_step_and_split_edge_matches_the_reference(backend, dtype, shape):
    out_features, in_features = shape
    rng = np.random.default_rng(out_features * 7919 + in_features)
    weight = random(rng, (out_features, in_features), dtype)
    for rows in ROWS:
        x = random(rng, (rows, in_features), dtype)
        out = device(backend, np.full((rows, out_features), np.nan, NP_DTYPES[dtype]))   # every element written
        got = ops.linear(device(backend, x), device(backend, weight), out=out)
        assert_linear_close(to_host(backend, got, dtype), x, weight, reference.linear(x, weight), dtype,
                            f"({dtype}, rows {rows}, in {in_features}, out {out_features}, "
                            f"split {EDGE_SHAPES[shape]})")


@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=[f"out{o}-in{i}" for o, i in EDGE_SHAPES])
def test_each_step_is_multiplied_once_by_warps_splitting_it_evenly(shape):
    """The split_k warps of 8 outputs take contiguous parts of ceil(steps / split_k) 32-feature steps
    (the last part the rest), each step two mma per row tile: every step once, no empty step
    multiplied, no warp with more than its share (the slowest warp sets the time), and no mma in a
    warp whose outputs are all past out_features. Neither an extra step of zeros nor an uneven split
    changes the output or the traffic; the emulator's count of each warp's mma shows them."""
    out_features, in_features = shape
    split = EDGE_SHAPES[shape]
    steps = -(-in_features // TILING["kStepFeatures"])
    share = -(-steps // split)
    for rows in (1, 8, 9, 33):
        launch, *_ = linear_launch(rows, in_features, out_features, "bfloat16")
        row_tiles = -(-rows // (8 if rows <= 8 else 16))
        warps = TILING["kWarps"]
        want = {}
        for block in range(launch.grid[0]):
            for warp in range(warps):
                slot, part = divmod(warp, split)
                first_out = (block * (warps // split) + slot) * TILING["kOutsPerWarp"]
                part_steps = max(0, min(steps, (part + 1) * share) - part * share)
                if first_out < out_features and part_steps:
                    want[(block, warp)] = 2 * part_steps * row_tiles
        got = launch.mma_per_warp()
        assert got == want, (rows, split)
        live_slots = {(block, warp // split) for block, warp in got}
        assert sum(got.values()) == 2 * steps * row_tiles * len(live_slots)   # each step once per slot
        assert max(got.values()) == 2 * share * row_tiles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LINEAR_MMA_DTYPES)
@pytest.mark.parametrize("shape", [(9, 32 * 33), (65, 200)], ids=["split-8", "split-1"])
def test_each_row_is_the_same_at_any_place_in_any_tile(backend, dtype, shape):
    """Row r of a 33-row call (tile rows 0-7, 8-15 of a 16-row tile, later tiles) equals that row alone."""
    out_features, in_features = shape
    rng = np.random.default_rng(5)
    x, weight = random(rng, (33, in_features), dtype), device(backend, random(rng, shape, dtype))
    together = to_host(backend, ops.linear(device(backend, x), weight), dtype)
    for r in range(33):
        alone = to_host(backend, ops.linear(device(backend, np.ascontiguousarray(x[r:r + 1])), weight), dtype)
        assert np.array_equal(alone.view(np.uint16), together[r:r + 1].view(np.uint16)), r


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LINEAR_MMA_DTYPES)
def test_non_finite_values_stay_in_their_row_and_output(backend, dtype):
    """inf or NaN in rows of x and in a weight row spoils only those rows and that output: a
    fragment that mixed rows or outputs up would spread it."""
    rng = np.random.default_rng(9)
    rows, out_features, in_features = 16, 20, 32 * 9
    x, weight = random(rng, (rows, in_features), dtype), random(rng, (out_features, in_features), dtype)
    clean = to_host(backend, ops.linear(device(backend, x), device(backend, weight)), dtype)
    x[3, 17], x[11, 200], weight[13, 5] = np.inf, np.nan, np.nan   # rows 3 and 11 (low and high halves)
    got = to_host(backend, ops.linear(device(backend, x), device(backend, weight)), dtype)
    spoiled = np.zeros(got.shape, bool)
    spoiled[[3, 11], :], spoiled[:, 13] = True, True
    assert np.isnan(got[:, 13]).all() and np.isnan(got[11]).all()
    assert not np.isfinite(got[3]).any()
    assert np.array_equal(got[~spoiled].view(np.uint16), clean[~spoiled].view(np.uint16))
