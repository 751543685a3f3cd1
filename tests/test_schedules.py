"""Every cupykv kernel under other emulator schedules gives the same bits as in index order.

The session runs under one schedule seed (conftest.py). This module runs the sweep of
:func:`cupykv.validate_launches.launch_every_kernel`, which launches every instance of every
kernel in :data:`cupykv.kernels.KERNELS` through the public API, under seed 0 (blocks in
index order, threads first-in first-out), under the session's seed and under a second seed,
and keeps a copy of every array argument after every launch. cupykv's kernels are
deterministic (no atomics, fixed reduction orders), so each seeded run must match the
index-order run bit for bit: a difference is a result that depends on the order of blocks or
threads, i.e. a race that the race checker does not see (for example through a read-only
argument). The race checker is on throughout, so every instance also runs race-free under
all three orders. A failure names the seed; ``CUPYKV_EMULATOR_SEED=<seed>`` replays it, and
this module then runs that seed again. The last tests show that the seeds do reorder blocks
and threads.
"""

import os

import numpy as np
import pytest

from cupykv import validate_launches
from cupykv.backends import emulator as E
from cupykv.backends.base import Backend

from test_emulator import load_good
from test_races import load_races

SESSION_SEED = int(os.environ["CUPYKV_EMULATOR_SEED"], 0)   # conftest.py sets it
SEEDS = sorted({SESSION_SEED, SESSION_SEED + 1} - {0})
TIMING_OPS = {"delay"}   # the bench timer's guard kernel writes elapsed clock cycles


def run_sweep(seed, monkeypatch):
    """[((op, instance), [array arguments after the launch])] of the sweep under ``seed``."""
    launches = []
    original = Backend.launch

    def launch(self, op, instance, grid, block, args, shared_mem=0):
        original(self, op, instance, grid, block, args, shared_mem)
        if op not in TIMING_OPS:
            arrays = [np.ascontiguousarray(a).view(np.ndarray).copy() for a in args
                      if isinstance(a, np.ndarray)]
            launches.append(((op, instance), arrays))

    with monkeypatch.context() as patch:
        patch.setenv("CUPYKV_EMULATOR_SEED", str(seed))
        patch.setattr(Backend, "launch", launch)
        validate_launches.launch_every_kernel("emulator")
    return launches


@pytest.fixture(scope="module")
def index_order():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_sweep(0, monkeypatch)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_kernel_gives_the_index_order_bits_under_seed(seed, index_order, monkeypatch):
    seeded = run_sweep(seed, monkeypatch)
    assert [name for name, _ in seeded] == [name for name, _ in index_order]
    for n, ((op, instance), got), (_, want) in zip(range(len(seeded)), seeded, index_order):
        for k, (g, w) in enumerate(zip(got, want)):
            differ = g.view(np.uint8) != w.view(np.uint8)
            assert not differ.any(), (
                f"launch {n} ({op}: {instance}), array argument {k}: {int(differ.sum())} bytes differ "
                f"under CUPYKV_EMULATOR_SEED={seed} from index order (seed 0); set "
                f"CUPYKV_EMULATOR_SEED={seed} to replay")


def test_the_sweep_covers_every_kernel_instance(index_order):
    launched = {name for name, _ in index_order}
    expected = validate_launches.expected_instances()
    assert expected - launched == {(op, i) for op, i in expected if op in TIMING_OPS}


# ---- the seeds do perturb the order -------------------------------------------------------
@pytest.fixture(scope="module")
def races():
    return load_races()


def last_block_to_write(races, seed, monkeypatch):
    """Which block's write of out[0] survives when 8 blocks race on it (checker off)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", str(seed))
    out = E.zeros(8)
    races.get_function("blocks_share_output")(8, 32, (out, np.int32(0)))
    return int(out[0]) - 1


def test_seeds_reorder_blocks_and_replay(races, monkeypatch):
    assert last_block_to_write(races, 0, monkeypatch) == 7          # index order: block 7 runs last
    winners = {last_block_to_write(races, seed, monkeypatch) for seed in range(1, 17)}
    assert len(winners) > 1                                          # the seed decides
    for seed in (SESSION_SEED, 5):
        assert last_block_to_write(races, seed, monkeypatch) == last_block_to_write(races, seed, monkeypatch)


def test_seeds_reorder_threads(races, monkeypatch):
    """64 threads of one block store their index in one flag: the last one to run wins.

    Each seeded order runs the two warps in a seeded order, each in a seeded lane order, so the
    winner's warp and its lane both change with the seed."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    winners = []
    for seed in range(8):
        monkeypatch.setenv("CUPYKV_EMULATOR_SEED", str(seed))
        flag = E.zeros(1, np.int32)
        races.get_function("set_flag")(1, 64, (flag, np.int32(1)))
        winners.append(int(flag[0]))
    assert winners[0] == 63                                       # index order: thread 63 runs last
    assert len({w // 32 for w in winners[1:]}) > 1                 # the seed decides which warp runs last
    assert len({w % 32 for w in winners[1:]}) > 1                  # and which lane of it


def block_order(good, seed, blocks, monkeypatch):
    """[blocks] uint32: the block indices in the order the emulator ran them under ``seed``."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")   # one array of 4M blocks: no shadow needed
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", str(seed))
    order, taken = E.zeros(blocks, np.uint32), E.zeros(1, np.uint32)
    good.get_function("record_block_order")(blocks, 1, (order, taken))
    assert int(taken[0]) == blocks
    return np.asarray(order).copy()


@pytest.fixture(scope="module")
def good():
    return load_good()


# schedule.cpp permutes grids of up to 2**22 blocks (Fisher-Yates) and orders larger ones by a
# seeded affine bijection k -> (a * k + c) mod n.
@pytest.mark.parametrize("blocks", [2, 37, (1 << 22) + 1], ids=["two blocks", "permuted", "affine"])
def test_a_seed_runs_every_block_once_in_an_order_it_replays(good, blocks, monkeypatch):
    every_block = np.arange(blocks, dtype=np.uint32)
    assert (block_order(good, 0, blocks, monkeypatch) == every_block).all()      # seed 0: index order
    orders = {}
    for seed in (5, 6):
        block_order(good, 3, 37, monkeypatch)   # a small seeded grid just before must leave no order behind
        orders[seed] = block_order(good, seed, blocks, monkeypatch)
        assert (np.sort(orders[seed]) == every_block).all(), f"seed {seed}: a block ran twice or never"
        assert (block_order(good, seed, blocks, monkeypatch) == orders[seed]).all(), f"seed {seed} does not replay"
    if blocks == 2:   # a coin per seed: some seed of 1..16 runs block 1 first
        assert any(block_order(good, seed, 2, monkeypatch)[0] == 1 for seed in range(1, 17))
    else:   # one of 37! permutations or of trillions of affine maps: index order or a repeat is no chance
        assert all((order != every_block).any() for order in orders.values())
        assert (orders[5] != orders[6]).any()
        # the path each size takes: an affine order steps by one stride a (mod n); a permutation of 37
        # blocks with a single stride is a 1 in 37!/(36 * 37) chance
        strides = [len(np.unique(np.diff(order.astype(np.int64)) % blocks)) for order in orders.values()]
        assert all(n == 1 for n in strides) if blocks > 1 << 22 else all(n > 1 for n in strides), strides
    assert (block_order(good, 0, blocks, monkeypatch) == every_block).all()      # and seed 0 after them


def test_a_bad_seed_is_refused(monkeypatch, races):
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "twelve")
    with pytest.raises(E.LaunchError, match="CUPYKV_EMULATOR_SEED='twelve' is not an integer"):
        races.get_function("set_flag")(1, 32, (E.zeros(1, np.int32), np.int32(0)))


def test_errors_name_the_seed(monkeypatch, races):
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "7")
    with pytest.raises(E.RaceError, match=r"\[emulator schedule seed 7: set CUPYKV_EMULATOR_SEED=7 to "
                                          r"replay this order\]"):
        races.get_function("set_flag")(2, 32, (E.zeros(1, np.int32), np.int32(1)))
