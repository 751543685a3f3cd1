"""The emulator's count of tensor-core mma instructions per warp (runtime.cpp, traffic.cpp).

Inside ``emulator.traffic()`` every launch counts the ``mma.sync`` instructions of each warp
(``LaunchTraffic.mma_per_warp``: ``{(linear block, warp): count}``). The tensor-core kernels hold
with it how their work is spread: the split of in_features over a linear's warps
(test_linear_mma.py), the steps of each key warp and the q pieces of the attention
(test_attention_mma.py). A step nobody needs, or an uneven split, changes no output and no memory
traffic. Here a tiny kernel pins the counter itself: exact counts per warp of a 3-D grid and of all
32 warps of a 1024-thread block, ldmatrix not counted, warps that issue none absent, one launch's
counts only, nothing outside a traffic block.
"""
import numpy as np

from cupykv.backends import emulator as E
from cupykv.backends.emulator import accounting, build
from cupykv.kernels import KERNEL_DIR

WARPS = 3
SOURCE = r"""#include "common.cuh"
#include "mma.cuh"
// Warp w of block (x, y, z) issues x + 2 y + 4 z + w mma (none in warp 0 of block 0) after one ldmatrix.
extern "C" __global__ void counted_mma(float* out) {
    __shared__ __align__(16) __half tile[8 * 8];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int i = threadIdx.x; i < 64; i += blockDim.x) tile[i] = __float2half(1.0f);
    __syncthreads();
    unsigned one[1];
    cupykv::ldmatrix_x1(one, tile + (lane % 8) * 8);
    const unsigned a[4] = {one[0], one[0], one[0], one[0]}, b[2] = {one[0], one[0]};
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int n = blockIdx.x + 2 * blockIdx.y + 4 * blockIdx.z + warp;
    for (int i = 0; i < n; ++i) cupykv::mma_m16n8k16<__half>(acc, a, b, acc);
    const long long block = blockIdx.x + gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    out[block * blockDim.x + threadIdx.x] = acc[0];
}
"""


def function():
    return E.Module(SOURCE, ["counted_mma"], include_dirs=[KERNEL_DIR]).get_function("counted_mma")


def run(fn, grid, warps=WARPS):
    blocks = int(np.prod(grid))
    out = E.zeros(blocks * 32 * warps, np.float32)
    fn(grid, 32 * warps, (out,))
    return np.asarray(out).reshape(blocks, warps, 32)


def expected(grid, warps=WARPS):
    """``{(linear block, warp): mma}`` of the warps that issue any, and each lane's acc[0]."""
    counts, out = {}, np.zeros((int(np.prod(grid)), warps, 32), np.float32)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                block = x + grid[0] * (y + grid[1] * z)
                for w in range(warps):
                    n = x + 2 * y + 4 * z + w
                    if n:
                        counts[(block, w)] = n
                    out[block, w] = 16 * n   # each mma adds the dot of 16 ones
    return counts, out


def test_each_warps_mma_are_counted_by_linear_block_and_warp():
    fn = function()
    grids = ((2, 2, 2), (3, 1, 1))
    with E.traffic() as t:
        outs = [run(fn, grid) for grid in grids]
    for launch, out, grid in zip(t.launches, outs, grids):
        counts, want = expected(grid)
        np.testing.assert_array_equal(out, want)   # the kernel ran the mma it was counted for
        # exact per warp, ldmatrix left out, warp 0 of block 0 (no mma) absent; the second launch's
        # counts are its own, not added to the first's
        assert launch.mma_per_warp() == counts
    assert (0, 0) not in t.launches[0].mma_per_warp() and (7, 2) in t.launches[0].mma_per_warp()


def test_a_1024_thread_blocks_warps_are_numbered_0_to_31():
    # every warp of the largest block under its own number: warp w issues w mma
    fn = function()
    with E.traffic() as t:
        out = run(fn, (1, 1, 1), warps=32)
    counts, want = expected((1, 1, 1), warps=32)
    np.testing.assert_array_equal(out, want)
    assert t.launches[0].mma_per_warp() == counts and (0, 31) in counts


def test_launches_outside_a_traffic_block_count_no_mma():
    fn = function()
    with E.traffic() as t:
        run(fn, (3, 1, 1))
    np.testing.assert_array_equal(run(fn, (2, 2, 2)), expected((2, 2, 2))[1])   # runs, uncounted
    # the runtime still holds the traffic launch's counts: the launch after it added none
    assert accounting._warp_mma(build.runtime()) == t.launches[0].warp_mma
