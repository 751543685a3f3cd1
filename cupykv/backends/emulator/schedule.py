"""Seeded schedule perturbation: the order in which the emulator runs blocks and threads.

``CUPYKV_EMULATOR_SEED`` (an integer, read at every launch) picks the order. ``0`` or unset:
blocks in index order (x fastest) and threads first-in, first-out, as the emulator always
ran them. Any other value: blocks in a seeded random order; whenever a thread must be picked
to run (at the start of a block, after a barrier or warp collective, after a thread exits), a
seeded random ready thread. Threads still switch only at barriers, warp intrinsics and exit.

Each launch derives its own seed from the session seed and the launch's identity (kernel,
grid, block, dynamic shared memory), not from a launch counter: a test that fails under a
seed replays the same order when it runs alone with that seed.
"""

import hashlib
import os

from .errors import LaunchError

ENV = "CUPYKV_EMULATOR_SEED"


def session_seed():
    """The seed of ``CUPYKV_EMULATOR_SEED``, 0 when unset or empty."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return 0
    try:
        seed = int(text, 0)
    except ValueError:
        raise LaunchError(f"{ENV}={text!r} is not an integer") from None
    if not 0 <= seed < 2**64:
        raise LaunchError(f"{ENV}={text!r} is outside 0 .. 2**64 - 1")
    return seed


def launch_seed(seed, name, grid, block, shared_mem):
    """The runtime's seed for one launch: 0 (index order) when ``seed`` is 0, else a
    nonzero 64-bit value derived from ``seed`` and the launch's identity."""
    if not seed:
        return 0
    text = f"{seed}|{name}|{tuple(grid)}|{tuple(block)}|{int(shared_mem)}".encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return value or 1


def replay_hint(seed):
    """The sentence error messages end with under a perturbed schedule ('' for seed 0)."""
    if not seed:
        return ""
    return f" [emulator schedule seed {seed}: set {ENV}={seed} to replay this order]"
