"""The workloads that ``python -m cupykv validate`` runs under checkers and profilers.

- ``every-kernel``: launches every kernel instance listed in
  :data:`cupykv.kernels.KERNELS` at least once, at small shapes, through the
  public API (the cache ops (append, write, advance, set_lengths, ...), :func:`cupykv.attention` with and without
  split-KV, :func:`cupykv.linear` and :mod:`cupykv.ops`), records each launch
  and fails if an instance was never launched. A kernel added to ``KERNELS``
  without a call here makes this workload fail, naming it. On a GPU it runs
  under compute-sanitizer (memcheck, racecheck, synccheck, initcheck); on the
  CPU the emulator is the checker (out-of-bounds accesses, divergent barriers,
  launch geometry and argument sizes).
- ``profile``: one decode attention step and one ``linear`` call at the bench's
  shapes (:data:`cupykv.bench.PLANS` ``"full"``), for Nsight Compute.

Run one as ``python -m cupykv.validate_launches --backend cupy --workload every-kernel``;
the exit status is 0 when the workload ran (and, for ``every-kernel``,
covered every instance).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from typing import Callable, Iterator, NamedTuple

import numpy as np

import cupykv
from cupykv import ops
from cupykv.backends import get_backend
from cupykv.backends.base import Backend
from cupykv.bench import PLANS
from cupykv.bench.arrays import fill_random, random_array
from cupykv.kernels import ATTENTION_HEAD_DIMS, ATTENTION_MMA_HEAD_DIMS, CACHE_DTYPE_PAIRS, KERNELS, LINEAR_ROW_TILES
from cupykv.spec import IO_DTYPES

#: head sizes launched: the specialised ones (of the staged and the tensor-core kernels) and one that
#: takes the generic (HEAD_DIM = 0) instance of every cache dtype: 30, whose 16-bit rows are not whole
#: 16-byte copies (a multiple of 8 would run padded on a tensor-core instance) and whose float32 rows
#: are not whole 16-byte copies either (a multiple of 4 would run padded on a staged instance).
HEAD_DIMS = (*sorted({*ATTENTION_HEAD_DIMS, *ATTENTION_MMA_HEAD_DIMS}), 30)
#: split-KV factors launched: 1 and 2 (the last block of each query block merges the splits).
NUM_SPLITS = (1, 2)
#: max_seq of the small caches: split-KV needs max_seq > 128 * (num_splits - 1).
SMALL_MAX_SEQ = 256
WORKLOADS = ("every-kernel", "profile")


class CoverageError(AssertionError):
    """Some kernel instances listed in ``KERNELS`` were never launched."""


def expected_instances() -> set[tuple[str, str]]:
    """Every ``(op, instance)`` pair listed in :data:`cupykv.kernels.KERNELS` (read at call time)."""
    return {(op, instance) for op, kernel_file in KERNELS.items() for instance in kernel_file.instances}


def check_coverage(launched, expected=None) -> None:
    """Raise :class:`CoverageError` unless every expected ``(op, instance)`` was launched.

    Parameters
    ----------
    launched : iterable of ``(op, instance)``
        Launches as recorded by :func:`recording_launches`.
    expected : set of ``(op, instance)``, optional
        Defaults to :func:`expected_instances`.
    """
    expected = expected_instances() if expected is None else set(expected)
    missing = sorted(expected - set(launched))
    if missing:
        names = "\n  ".join(f"{op}: {instance}" for op, instance in missing)
        raise CoverageError(f"{len(missing)} of {len(expected)} kernel instances in cupykv.kernels.KERNELS were "
                            f"never launched:\n  {names}\nadd a call that launches each of them to "
                            f"cupykv.validate_launches.launch_every_kernel")


class LaunchRecord(NamedTuple):
    """One :meth:`Backend.launch` as :func:`recording_launch_records` saw it."""

    op: str
    instance: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    shared_mem: int   # dynamic shared memory per block, in bytes


@contextlib.contextmanager
def _wrapping_launches(record: Callable[[LaunchRecord], None]) -> Iterator[None]:
    """Call ``record`` before every :meth:`Backend.launch` (any backend) inside the block; restore it on exit."""
    original = Backend.launch

    @functools.wraps(original)
    def launch(self, op, instance, grid, block, args, shared_mem=0):
        record(LaunchRecord(op, instance, tuple(grid), tuple(block), shared_mem))
        return original(self, op, instance, grid, block, args, shared_mem)

    Backend.launch = launch  # type: ignore[method-assign]   # wrapped for the block, restored below
    try:
        yield
    finally:
        Backend.launch = original  # type: ignore[method-assign]


@contextlib.contextmanager
def recording_launches() -> Iterator[list[tuple[str, str]]]:
    """Record ``(op, instance)`` of every :meth:`Backend.launch` (any backend) inside the block.

    Yields the list the launches are appended to, as they are made;
    ``Backend.launch`` is restored on exit.
    """
    launched: list[tuple[str, str]] = []
    with _wrapping_launches(lambda launch: launched.append((launch.op, launch.instance))):
        yield launched


@contextlib.contextmanager
def recording_launch_records() -> Iterator[list[LaunchRecord]]:
    """:func:`recording_launches` with each launch's geometry and dynamic shared memory: a
    :class:`LaunchRecord` per launch."""
    records: list[LaunchRecord] = []
    with _wrapping_launches(records.append):
        yield records


def _attention_round(backend: Backend, dtype: str, io_dtype: str, head_dim: int, seed: int) -> None:
    """Cache ops and attention for one storage and io dtype and head size, unsplit and split."""
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=SMALL_MAX_SEQ, batch=2, dtype=dtype,
                            io_dtype=io_dtype)
    cache = cupykv.KVCache(spec, backend=backend.name)
    rope = cupykv.Rope()
    k = random_array(backend, (2, 3, 1, head_dim), io_dtype, seed)        # [batch, n_new, n_kv, head_dim]
    v = random_array(backend, (2, 3, 1, head_dim), io_dtype, seed + 1)
    q = random_array(backend, (2, 1, 2, head_dim), io_dtype, seed + 2)    # [batch, q_len, n_heads, head_dim]
    # 9 queries x 2 heads = 18 rows of one kv head: past 16, the tensor-core kernel's two row tiles;
    # 9 x 4 = 36 rows: past 32, its four (two row groups of warps sharing the K/V stages; at head_dim
    # 256, two blocks of two)
    verify_q = random_array(backend, (2, 9, 2, head_dim), io_dtype, seed + 3)
    wide_q = random_array(backend, (2, 9, 4, head_dim), io_dtype, seed + 4)
    cache.append(0, k, v, rope=rope, return_positions=True)
    positions = backend.asarray(np.array([[0, 1, 2], [0, 1, 2]], np.int32))          # where append wrote
    cache.write(0, positions, k, v, rope=rope, return_positions=True)                 # the same rows again
    for num_splits in NUM_SPLITS:
        cupykv.attention(q, cache, 0, rope=rope, num_splits=num_splits)
        cupykv.attention(verify_q, cache, 0, num_splits=num_splits)
        cupykv.attention(wide_q, cache, 0, num_splits=num_splits)
    cache.advance(3)
    cache.set_lengths([3, 3])
    cache.additive_mask(q_len=1)
    cache.truncate([2, 1])
    cache.reset([1])
    cache.reset()


def _decoder_ops_round(backend: Backend, dtype: str, seed: int) -> None:
    """``linear`` for every row tile of both kernels, then embedding, rmsnorm, silu_mul, add and argmax, in one
    dtype. 16-bit dtypes run ``linear`` on tensor cores; an ``in_features`` of 9 takes the CUDA cores."""
    hidden, vocab, out_features = 64, 32, 16
    for in_features in (hidden, 9):
        weight = random_array(backend, (out_features, in_features), dtype, seed, scale=0.1)   # [out, in_features]
        for rows in LINEAR_ROW_TILES:
            ops.linear(random_array(backend, (rows, in_features), dtype, seed + rows), weight)
    table = random_array(backend, (vocab, hidden), dtype, seed + 100)                 # [vocab, hidden]
    ids = backend.asarray(np.array([0, 5, vocab - 1], np.int32))
    x = ops.embedding(ids, table)                                                      # [3, hidden]
    x = ops.rmsnorm(x, random_array(backend, (hidden,), dtype, seed + 101), 1e-5)
    x = ops.add(x, ops.silu_mul(x, random_array(backend, (3, hidden), dtype, seed + 102)))
    ops.argmax(ops.linear(x, table))                                                   # [3, vocab] -> [3]


def _bench_delay_round(backend: Backend) -> None:
    """The bench timer's guard kernel (no public op): packed as ``bench.timing.CudaEventTimer`` packs it."""
    spun = backend.zeros((1,), np.int64)                                               # [1] cycles counted
    backend.launch("delay", "cupykv_delay", (1,), (1,), (spun, np.int64(1000)))


def _decoding_round(backend: Backend) -> None:
    """The device-side decoding loops' bookkeeping kernels (cupykv.models.decoding), on tiny int32 arrays."""
    from cupykv.models import decoding

    batch, k = 3, 2

    def ids(*values):
        return backend.asarray(np.array(values, np.int32).reshape(-1))

    stop_ids = ids(7, -1)
    decoding.decode_commit(ids(1, 2, 3), ids(0, 0, 0), ids(0, 0, 0), ids(1, 1, 0), ids(2, 1, 5), ids(7, 4, 5),
                           ids(4, 6, 2), stop_ids, ids(2), max_length=15)
    chain = ids(1, 2, 3, 4, 5, 6, 7, 8, 9).reshape(k + 1, batch)                     # [k + 1, batch]
    verify_ids = backend.zeros((batch, k + 1), np.int32)
    decoding.speculative_gather(verify_ids, chain, row_stride=1, col_stride=batch)
    target_ids = ids(4, 9, 9, 5, 8, 7, 6, 9, 9).reshape(batch, k + 1)             # [batch, k + 1]
    shapes = ((batch, k + 1), (batch,), (batch,), (batch,), (batch,), (batch, 2))
    tokens, accepted, target_lengths, draft_lengths, chain_out, draft_pair = (
        backend.zeros(shape, np.int32) for shape in shapes)
    decoding.speculative_accept(tokens, accepted, target_lengths, draft_lengths, chain_out, draft_pair, ids(1, 1, 0),
                                ids(5, 5, 5), verify_ids, target_ids, ids(7, 8, 9), stop_ids, max_length=12)


def launch_every_kernel(backend=None) -> list[tuple[str, str]]:
    """Launch every instance in ``KERNELS`` through the public API; return the launches made.

    Raises :class:`CoverageError` when an instance was not launched.

    Parameters
    ----------
    backend : {"cupy", "emulator"}, Backend or None
        ``None`` picks the default backend.
    """
    backend = get_backend(backend)
    with recording_launches() as launched:
        for i, (dtype, io_dtype) in enumerate(CACHE_DTYPE_PAIRS):
            for j, head_dim in enumerate(HEAD_DIMS):
                _attention_round(backend, dtype, io_dtype, head_dim, seed=100 * i + 10 * j)
        for i, dtype in enumerate(IO_DTYPES):
            _decoder_ops_round(backend, dtype, seed=1000 + i)
        _bench_delay_round(backend)
        _decoding_round(backend)
        backend.synchronize()
    check_coverage(launched)
    return list(launched)


def profile_workload(backend=None) -> None:
    """One bf16 decode attention step (split as the plan picks) and one ``linear`` call at bench shapes."""
    backend = get_backend(backend)
    plan = PLANS["full"]
    batch, live = 8, 4096
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=plan.n_kv_heads, head_dim=plan.head_dim, max_seq=live,
                            batch=batch, dtype="bfloat16")
    cache = cupykv.KVCache(spec, backend=backend.name)
    fill_random(backend, cache.k, "bfloat16", seed=1)
    fill_random(backend, cache.v, "bfloat16", seed=2)
    cache.advance(live - 1)                                   # the query's own pending row makes it `live`
    q = random_array(backend, (batch, 1, plan.n_heads, plan.head_dim), "bfloat16", seed=3)
    cupykv.attention(q, cache, 0)
    out_features, in_features = plan.linear_shapes[0]
    weight = random_array(backend, (out_features, in_features), "bfloat16", seed=4, scale=0.05)
    ops.linear(random_array(backend, (1, in_features), "bfloat16", seed=5), weight)
    backend.synchronize()


def main(argv=None) -> int:
    """Run one workload; print what was launched. Exit status 1 on missing coverage."""
    parser = argparse.ArgumentParser(prog="python -m cupykv.validate_launches", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("cupy", "emulator"), default=None)
    parser.add_argument("--workload", choices=WORKLOADS, default="every-kernel")
    parser.add_argument("--warm-up", action="store_true",
                        help="compile every kernel module first, in parallel worker processes (Backend.warm_up)")
    args = parser.parse_args(argv)
    backend = get_backend(args.backend)
    if args.warm_up:
        try:
            warm = backend.warm_up()
        except Exception as error:   # e.g. a GPU in exclusive-process mode refuses the workers' contexts
            # nothing is lost: the sweep compiles each module on its first use, as without --warm-up (and
            # a module that does not compile fails there, with its own error)
            print(f"warm-up: failed ({type(error).__name__}: {error}); each module compiles on first use instead")
        else:
            slowest = max(warm.op_seconds, key=lambda op: warm.op_seconds[op], default=None)
            print(f"warm-up: {len(warm.ops)} kernel modules compiled in {warm.seconds:.1f} s by {warm.processes} "
                  f"processes" + (f" (slowest: {slowest}, {warm.op_seconds[slowest]:.1f} s)" if slowest else ""))
    # Without a memory pool each array is its own allocation, so compute-sanitizer sees its real bounds
    # (an overrun inside a pooled chunk is invisible) and initcheck never sees reused, stale memory.
    backend.use_exact_allocations()
    if args.workload == "profile":
        profile_workload(backend)
        print(f"profile workload ran on {backend.name}")
        return 0
    try:
        launched = launch_every_kernel(backend)
    except CoverageError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    print(f"launched all {len(set(launched))} kernel instances in cupykv.kernels.KERNELS "
          f"({len(launched)} launches) on {backend.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
