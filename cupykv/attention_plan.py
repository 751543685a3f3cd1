"""AttentionPlan: decode attention over one cache, planned once, run many times.

Planning does the host work of an attention call that depends only on static
shapes: argument checks, the launch geometry, the split-KV factor (from the
device's multiprocessor count and the kernel's occupancy) and the split-KV
workspace, which the plan allocates and owns. Running does the rest: it
checks ``q`` and ``out`` against the plan and launches. A plan is made
outside capture; a captured step runs plans, so nothing in the step
allocates, and two plans never share scratch memory (run them on two
streams at once).

The tiling constants are read from ``kernels/attention.cu``
(``namespace attention_tiling``), so the launch code and the kernel cannot
disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cupykv import _args
from cupykv._typing import ArrayLike, DeviceArray, FloatLike, IntLike
from cupykv.backends.base import Backend
from cupykv.backends.capture import active_capture, refuse_in_capture
from cupykv.cache import KVCache
from cupykv.cache import KernelView
from cupykv.kernels import (CUDA_TYPES, KERNELS, attention_f32_head_dim, attention_instance, attention_mma_head_dim,
                            attention_mma_row_tiles)
from cupykv.rope import Rope
from cupykv.spec import CacheSpec

TILING = KERNELS["attention"].constants("attention_tiling")
MMA_TILING = KERNELS["attention_mma"].constants("attention_mma_tiling")
F32_TILING = KERNELS["attention_f32"].constants("attention_f32_tiling")
THREADS = TILING["kThreads"]       # threads per block of the CUDA-core kernel
TILE_ROWS = TILING["kTileRows"]    # query rows (query x head of one GQA group) per block, or per m16 tile
CHUNK = TILING["kChunk"]           # keys a block scores at once; splits fall on multiples of it
MIN_KEYS_PER_SPLIT = 256           # below this, a split's fixed cost outweighs its parallelism
MAX_SPLITS = 65535                 # splits are grid y: CUDA's limit there
for _file, _tiling in (("attention_mma.cu", MMA_TILING), ("attention_f32.cu", F32_TILING)):   # one split plan
    if (_tiling["kTileRows"], _tiling["kSplitAlign"]) != (TILE_ROWS, CHUNK):
        raise ImportError(f"kernels: {_file} tiles {_tiling['kTileRows']} rows and aligns splits to "
                          f"{_tiling['kSplitAlign']} keys, attention.cu {TILE_ROWS} and {CHUNK}: they must agree")


def shared_memory_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CUDA-core attention block: q tile, scores and row stats (float32)."""
    return (TILE_ROWS * head_dim + TILE_ROWS * CHUNK + 3 * TILE_ROWS) * 4


@dataclass(frozen=True)
class AttentionKernel:
    """The attention kernel a cache runs: its ``.cu`` op, template instance and block shape."""

    op: str
    instance: str
    threads: int
    shared_mem_bytes: int
    rows_per_block: int = TILE_ROWS   # query rows (query x head of one GQA group) a block owns

    @property
    def tensor_cores(self) -> bool:
        """Whether S = QK^T and PV run on mma.sync (16-bit and fp8 caches whose rows are whole 16-byte
        copies, up to head_dim 256: :func:`cupykv.kernels.attention_mma_head_dim`)."""
        return self.op == "attention_mma"

    @property
    def opts_in_to_shared_memory(self) -> bool:
        """Whether a launch needs the kernel's opt-in to more than 48 KiB of dynamic shared memory."""
        return self.shared_mem_bytes > _args.MAX_DYNAMIC_SHARED_MEMORY


def mma_row_tiles(query_rows: int, head_dim: int) -> int:
    """m16 row tiles per block of the tensor-core kernel for ``query_rows`` (``q_len * group``) rows
    per sequence and kv head: the fewest of :func:`cupykv.kernels.attention_mma_row_tiles` that hold
    them, or the most there are, so that a block reads each K/V row once for up to 64 rows (32 at
    head_dim 256)."""
    choices = attention_mma_row_tiles(head_dim)
    return next((tiles for tiles in choices if query_rows <= TILE_ROWS * tiles), choices[-1])


def mma_row_groups(row_tiles: int, head_dim: int) -> int:
    """Warps of the tensor-core kernel per key warp (``attention_mma_row_groups``): a warp holds at
    most ``kMaxWarpTiles`` row tiles (``kMaxWarpTiles256`` at head_dim 256), so four tiles (two at
    head_dim 256) take two row groups that share the K/V stages."""
    most = MMA_TILING["kMaxWarpTiles256" if head_dim == 256 else "kMaxWarpTiles"]
    return max(1, row_tiles // most)


def mma_shared_memory_bytes(dtype: str, head_dim: int, row_tiles: int) -> int:
    """Dynamic shared memory of one tensor-core attention block: the q pieces of each row tile,
    then the key warps' K/V stages, or the key warps' accumulators and row statistics (which take
    that memory over after the key loop) where those are more (``namespace attention_mma_tiling``
    of attention_mma.cu)."""
    stages = MMA_TILING[f"kStages{head_dim}Fp8" if dtype == "float8_e4m3" else f"kStages{head_dim}"]
    return max(row_tiles * MMA_TILING[f"kQTile{head_dim}"] + stages, row_tiles * MMA_TILING[f"kAccTile{head_dim}"])


def attention_kernel(dtype: str, head_dim: int, io_dtype: str | None = None, query_rows: int = 1) -> AttentionKernel:
    """The kernel for a cache's storage dtype, head size and io dtype (``dtype`` by default): tensor
    cores for 16-bit and fp8 caches whose rows are whole 16-byte copies, up to head_dim 256
    (``attention_mma.cu``, compiled at 64, 96, 128 and 256; a smaller head runs padded on the next
    size up, :func:`cupykv.kernels.attention_mma_head_dim`); float32 caches at head_dim 32, 64, 128 and
    256 (and other multiples of 4 from 20, padded: :func:`cupykv.kernels.attention_f32_head_dim`) on CUDA cores
    with K/V staged by asynchronous copies (``attention_f32.cu``); CUDA cores otherwise
    (``attention.cu``). ``query_rows`` (``q_len * group``) picks the tensor-core kernel's rows per
    block (:func:`mma_row_tiles`)."""
    instance_head_dim = attention_mma_head_dim(dtype, head_dim)
    if instance_head_dim is None:
        op, instance = attention_instance(dtype, head_dim, io_dtype)
        staged_head_dim = attention_f32_head_dim(dtype, head_dim)
        if staged_head_dim is not None:
            return AttentionKernel(op, instance, F32_TILING["kThreads"], F32_TILING[f"kShared{staged_head_dim}"])
        return AttentionKernel(op, instance, THREADS, shared_memory_bytes(head_dim))
    row_tiles = mma_row_tiles(query_rows, instance_head_dim)
    op, instance = attention_instance(dtype, head_dim, io_dtype, row_tiles)
    threads = 32 * MMA_TILING[f"kWarps{instance_head_dim}"] * mma_row_groups(row_tiles, instance_head_dim)
    return AttentionKernel(op, instance, threads, mma_shared_memory_bytes(dtype, instance_head_dim, row_tiles),
                           TILE_ROWS * row_tiles)


def block_row_choices(dtype: str, head_dim: int, io_dtype: str | None = None) -> tuple[int, ...]:
    """The query rows a block of the cache's attention kernel may own: 16, 32 or 64 on tensor cores
    (one, two or four m16 tiles; 16 or 32 past head_dim 128, on the 256 instance), 16 on CUDA cores."""
    instance_head_dim = attention_mma_head_dim(dtype, head_dim)
    if instance_head_dim is not None:
        return tuple(TILE_ROWS * tiles for tiles in attention_mma_row_tiles(instance_head_dim))
    return (TILE_ROWS,)


def _check_rows_per_block(rows_per_block: object, spec: CacheSpec) -> int:
    """``rows_per_block`` as an int, one of :func:`block_row_choices` for the cache."""
    choices = block_row_choices(spec.dtype, spec.head_dim, spec.io_dtype)
    number = _args.check_int("rows_per_block", rows_per_block, 1)
    if number not in choices:
        which = ("one of " + ", ".join(map(str, choices)) + " (blocks of the tensor-core kernel)" if len(choices) > 1
                 else f"{choices[0]} (blocks of the CUDA-core kernel, which a {spec.dtype} cache at head_dim "
                      f"{spec.head_dim} runs)")
        raise ValueError(f"rows_per_block: expected {which} or None, got {number}")
    return number


def query_blocks(q_len: int, group: int, rows_per_block: int = TILE_ROWS) -> int:
    """Blocks of up to ``rows_per_block`` query rows (query x head of one GQA group) per sequence and kv head."""
    return math.ceil(q_len * group / rows_per_block)


def max_splits(max_seq: int) -> int:
    """The largest split-KV factor: one chunk of keys a split at least, and CUDA's grid y limit."""
    return max(1, min(math.ceil(max_seq / CHUNK), MAX_SPLITS))


def plan_splits(spec: CacheSpec, q_len: int, n_heads: int, resident_blocks: int,
                rows_per_block: int = TILE_ROWS) -> int:
    """Number of KV splits: enough blocks to fill the device once, never fewer than 256 keys a split.

    Parameters
    ----------
    spec : CacheSpec
    q_len, n_heads : int
        The queries' static shape.
    resident_blocks : int
        Blocks the whole device runs at once: multiprocessors x blocks
        resident per multiprocessor (1 on the emulator, which runs blocks one
        after another, so it never splits by default).
    rows_per_block : int, optional
        Query rows one block owns (``AttentionKernel.rows_per_block``).

    Depends only on static shapes, so a captured graph keeps a valid plan.
    """
    blocks = spec.batch * spec.n_kv_heads * query_blocks(q_len, n_heads // spec.n_kv_heads, rows_per_block)
    return max(1, min(math.ceil(resident_blocks / blocks), spec.max_seq // MIN_KEYS_PER_SPLIT))


def check_split_keys(split_keys: object, spec: CacheSpec) -> int:
    """``split_keys`` as an int: a multiple of CHUNK, at most ``max_seq`` rounded up, in at most MAX_SPLITS splits."""
    lo = max(CHUNK, math.ceil(spec.max_seq / MAX_SPLITS / CHUNK) * CHUNK)
    hi = max(lo, math.ceil(spec.max_seq / CHUNK) * CHUNK)
    split_keys = _args.check_int("split_keys", split_keys, lo, hi)
    if split_keys % CHUNK:
        raise ValueError(f"split_keys: expected a multiple of {CHUNK} (the kernel's key chunk), got {split_keys}")
    return split_keys


def _check_n_heads(n_heads: object, spec: CacheSpec) -> int:
    """``n_heads`` as an int: a positive multiple of ``n_kv_heads``."""
    n_heads = _args.check_int32("n_heads", n_heads, lo=1)
    if n_heads % spec.n_kv_heads:
        raise ValueError(f"n_heads: expected a multiple of n_kv_heads={spec.n_kv_heads}, got {n_heads}")
    return n_heads


def check_operands(cache: KVCache, q_len: int, n_heads: int, q: ArrayLike, layer: IntLike, out: ArrayLike | None,
                   run_if: ArrayLike | None = None) -> tuple[KernelView, DeviceArray, DeviceArray | None, DeviceArray]:
    """The cache's kernel view of ``layer``, and ``q``, ``out`` and the ``run_if`` word as kernel operands (see
    :meth:`AttentionPlan.run`; ``Backend.always_run()`` for ``run_if=None``)."""
    spec = cache.spec
    view = cache.kernel_view(layer)
    backend = view.backend
    shape = (spec.batch, q_len, n_heads, spec.head_dim)
    found = _args.check_q(q, spec)
    if found != (q_len, n_heads):
        got = (spec.batch, *found, spec.head_dim)
        raise ValueError(f"q: expected the plan's shape {shape}, got {got}; make a plan for this shape")
    queries = _args.device_operand("q", q, backend, spec.io_dtype)
    output = None
    if out is not None:
        output = _args.device_operand("out", out, backend, spec.io_dtype, shape, written=True)
        _args.check_no_overlap("out", output, [("q", queries)])
        _args.check_apart_from_caches("out", output, cache)   # and every other cache and plan
    word = _args.run_if_operand(run_if, backend, cache)   # apart from every cache and plan (their workspaces)
    return view, queries, output, _args.run_if_word(word, backend, [("out", output)])


@dataclass(frozen=True)
class _Workspace:
    """A plan's split-KV scratch: fp32 partial output, running max and sum of every split and query row,
    and one counter per query block (the splits of a block count themselves; the last one merges)."""

    partial_out: DeviceArray      # [splits, rows, head_dim]
    partial_max: DeviceArray      # [splits, rows]
    partial_sum: DeviceArray      # [splits, rows]
    split_counters: DeviceArray   # [batch * n_kv_heads * query blocks] uint32, 0 between launches

    @property
    def buffers(self) -> tuple[DeviceArray, ...]:
        return self.partial_out, self.partial_max, self.partial_sum, self.split_counters

    @property
    def nbytes(self) -> int:
        return sum(int(buffer.nbytes) for buffer in self.buffers)


class AttentionPlan:
    """Causal GQA attention over one cache for one query shape: planned once, then run per layer.

    Query ``i`` of sequence ``b`` sits at position ``lengths[b] + i`` (rows
    appended but not yet advanced count as present) and attends to every
    position ``j <= lengths[b] + i`` below ``max_seq`` (and ``j > pos - window``
    with a window). Work follows the live lengths, read on the device at run
    time, so one plan serves every step of a decode loop and every layer.

    Graph-safe: no — refused inside a captured step (CaptureError): a plan allocates its workspace. Make
    plans before capture and run them inside.

    Parameters
    ----------
    cache : KVCache
    q_len : int
        Queries per sequence, ``1..2**30-1``.
    n_heads : int
        Query heads, a multiple of ``n_kv_heads`` (head ``h`` reads kv head
        ``h // (n_heads // n_kv_heads)``); ``batch * q_len * n_heads`` at most
        ``2**31-1``.
    scale : float, optional
        Logit scale, a normal float32 > 0; ``1/sqrt(head_dim)`` by default.
    window : int, optional
        Sliding window in ``1..2**31-1``: keep positions ``j > pos - window``.
    softcap : float, optional
        A normal float32 > 0: logits become ``softcap * tanh(s / softcap)``.
    rope : Rope, optional
        Rotate each query at its position first.
    num_splits : int, optional
        Split-KV factor in ``1..min(ceil(max_seq / 128), 65535)``; by default
        enough splits to fill the device once (:func:`cupykv.attention_plan.plan_splits`).
        The splits cut each tile's own key range into equal pieces, so where
        they fall depends on the query shape.
    split_keys : int, optional
        Instead of ``num_splits``: split ``s`` holds the fixed positions
        ``[s * split_keys, (s + 1) * split_keys)``, a multiple of 128 with at
        most 65535 splits of ``max_seq``. A query row's keys are then summed in
        the same order whatever ``q_len`` (without a window), so a row of a
        ``q_len = k + 1`` verification pass equals the same row decoded alone,
        bit for bit: what speculative decoding needs to reproduce greedy
        tokens exactly. Splits past a sequence's live length exit at once.
    rows_per_block : int, optional
        Query rows (``q_len * group`` per sequence and kv head) one block
        owns, for tuning: 16, 32 or 64 on tensor cores (16 or 32 past head_dim
        128), 16 on CUDA cores (:func:`cupykv.attention_plan.block_row_choices`).
        By default the fewest that hold ``q_len * group``, 64 at most (32 past
        head_dim 128): each block reads its keys' K/V once. Without a
        window, a row's result does not depend on it, unsplit or with
        ``split_keys``.

    Attributes
    ----------
    num_splits : int
    split_keys : int or None
    kernel : AttentionKernel
        The kernel the plan launches (tensor cores for 16-bit and fp8 caches
        whose rows are whole 16-byte copies, up to head_dim 256).
    grid, block : tuple of int
        The attention launch: one, split or not (the last block of a query tile
        to finish merges its splits, through a device counter the plan owns).
    shared_mem_bytes : int
        Dynamic shared memory per block.
    workspace_bytes : int
        Device memory the plan owns (0 when unsplit, bar three placeholder values).

    Raises
    ------
    TypeError, ValueError
        Bad arguments, before anything is allocated.
    CaptureError
        Made inside a captured step (make plans before capture).
    """

    def __init__(self, cache: KVCache, q_len: IntLike, n_heads: IntLike, *, scale: FloatLike | None = None,
                 window: IntLike | None = None, softcap: FloatLike | None = None, rope: Rope | None = None,
                 num_splits: IntLike | None = None, split_keys: IntLike | None = None,
                 rows_per_block: IntLike | None = None) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a cupykv.KVCache, got {type(cache).__name__}")
        refuse_in_capture("making an AttentionPlan (it allocates its workspace)",
                          "make plans before capture; cupykv.attention() makes its plan on the warm-up run")
        spec = cache.spec
        self.cache = cache
        self.q_len = _args.check_q_len(q_len)
        self.n_heads = _check_n_heads(n_heads, spec)
        self.scale = _args.check_scale(scale, spec)
        window = _args.check_window(window)
        # any window above max_seq + q_len keeps every position: same result, fits int32
        self.window = None if window is None else min(window, spec.max_seq + self.q_len)
        self.softcap = _args.check_softcap(softcap)
        self.rope = _args.check_rope(rope, spec)
        self.rows = spec.batch * self.q_len * self.n_heads
        if self.rows > _args.INT32_MAX:
            raise ValueError(f"q_len: expected batch * q_len * n_heads <= {_args.INT32_MAX} query rows, got "
                             f"{spec.batch} * {self.q_len} * {self.n_heads} = {self.rows}")
        group = self.n_heads // spec.n_kv_heads
        # a block of rows_per_block rows runs the kernel those rows pick (16, 32, 64: 1, 2, 4 tiles)
        block_rows = self.q_len * group if rows_per_block is None else _check_rows_per_block(rows_per_block, spec)
        self.kernel = attention_kernel(spec.dtype, spec.head_dim, spec.io_dtype, block_rows)
        rows_per_block = self.kernel.rows_per_block
        blocks = query_blocks(self.q_len, group, rows_per_block)
        self.block = (self.kernel.threads,)
        self.shared_mem_bytes = self.kernel.shared_mem_bytes
        backend = cache.kernel_view(0).backend
        self.split_keys = None if split_keys is None else check_split_keys(split_keys, spec)
        if self.split_keys is not None:
            if num_splits is not None:
                raise ValueError(f"num_splits: expected None with split_keys (the splits follow from it), "
                                 f"got {num_splits!r}")
            num_splits = math.ceil(spec.max_seq / self.split_keys)
        elif num_splits is None:
            device = backend.device_info()
            kernel = self.kernel
            self._opt_in_shared_memory(backend)   # first: the occupancy query counts it
            per_sm = backend.occupancy(kernel.op, kernel.instance, kernel.threads, self.shared_mem_bytes)
            num_splits = plan_splits(spec, self.q_len, self.n_heads, device.multiprocessor_count * per_sm,
                                     rows_per_block)
        self.num_splits = _args.check_int("num_splits", num_splits, 1, max_splits(spec.max_seq))
        self.grid = (spec.batch * spec.n_kv_heads * blocks, self.num_splits)
        _args.check_launch("q", f"batch * n_kv_heads * ceil(q_len * group / {rows_per_block}) = {spec.batch} * "
                           f"{spec.n_kv_heads} * {blocks} query blocks", self.grid, self.block, self.shared_mem_bytes,
                           MMA_TILING["kMaxShared"] if self.kernel.opts_in_to_shared_memory else None)
        self._opt_in_shared_memory(backend)
        self._workspace = self._allocate_workspace(backend, spec.head_dim)
        self._ranges = tuple(("attention plan workspace", *_args.byte_range(buffer)) for buffer in
                             self._workspace.buffers)
        _args.register_buffers(self)

    def _opt_in_shared_memory(self, backend: Backend) -> None:
        """Let the kernel launch with the plan's dynamic shared memory, when that is past 48 KiB (the
        opt-in only grows and lasts, so a second call changes nothing)."""
        if self.kernel.opts_in_to_shared_memory:
            backend.opt_in_shared_memory(self.kernel.op, self.kernel.instance, self.shared_mem_bytes)

    def _allocate_workspace(self, backend: Backend, head_dim: int) -> _Workspace:
        """Four buffers, not one, so that on the emulator an overrun of one hits a guard page.

        An unsplit launch never touches them: one element each stands in.
        """
        splits, rows, tiles = (self.num_splits, self.rows, self.grid[0]) if self.num_splits > 1 else (1, 1, 1)
        head_dim = head_dim if self.num_splits > 1 else 1
        return _Workspace(backend.zeros((splits, rows, head_dim), np.float32),
                          backend.zeros((splits, rows), np.float32), backend.zeros((splits, rows), np.float32),
                          backend.zeros((tiles,), np.uint32))

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of the split-KV workspace this plan owns (0 for an unsplit plan)."""
        return self._workspace.nbytes if self.num_splits > 1 else 0

    def owned_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(what, first, last)`` byte addresses of the plan's workspace: no op's output may write into them.

        Graph-safe: yes — host values, taken when the plan was made.
        """
        return self._ranges

    def __repr__(self) -> str:
        spec = self.cache.spec
        return (f"AttentionPlan(batch={spec.batch}, q_len={self.q_len}, n_heads={self.n_heads}, "
                f"n_kv_heads={spec.n_kv_heads}, head_dim={spec.head_dim}, dtype={spec.dtype!r}, "
                f"num_splits={self.num_splits}, split_keys={self.split_keys}, grid={self.grid}, workspace_bytes={self.workspace_bytes})")

    def run(self, q: ArrayLike, layer: IntLike, out: ArrayLike | None = None, *,
            run_if: ArrayLike | None = None) -> DeviceArray:
        """Attend ``q`` over ``layer`` of the plan's cache.

        Graph-safe: yes, with ``out=`` — launches only, into the plan's workspace and ``out``; without
        ``out`` the output is allocated, which a captured step refuses (CaptureError).

        Parameters
        ----------
        q : device array ``[batch, q_len, n_heads, head_dim]``
            The plan's shape, in the cache's dtype (bfloat16 as
            ``ml_dtypes.bfloat16`` or uint16 bit patterns), C-contiguous.
        layer : int
        out : device array ``[batch, q_len, n_heads, head_dim]``, optional
            Written in place and returned (the graph-safe form), viewed as the
            storage dtype; the dtype forms of ``q`` are accepted. C-contiguous,
            writeable, and overlapping neither ``q`` nor any buffer of a cache
            or plan.
        run_if : device int32 array ``[1]``, optional
            The launch's gate, read on the device at run time (a captured step
            sees its value at every replay): 0 makes the launch return at once,
            reading nothing else and writing nothing (``out`` keeps its bytes,
            and the split counters of the workspace stay at 0, so the next
            launch merges its splits as usual); any other value, or ``None``,
            attends. The caller's word (or ``Backend.always_run()``),
            C-contiguous; it may not overlap ``out`` or a buffer of any cache
            or plan.

        Returns
        -------
        device array ``[batch, q_len, n_heads, head_dim]`` in the storage dtype.
        A query with nothing to attend to gets zeros. With ``run_if`` holding
        0, ``out`` as it was (zeros when the call allocated it).

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before anything is allocated or launched.
        CaptureError
            No ``out`` inside a captured step.
        """
        return self._launch(*check_operands(self.cache, self.q_len, self.n_heads, q, layer, out, run_if))

    def _launch(self, view: KernelView, q: DeviceArray, out: DeviceArray | None, run_if: DeviceArray) -> DeviceArray:
        """Launch on checked operands (``out=None``: a new output array; ``run_if``: the gate word)."""
        spec = self.cache.spec
        backend = view.backend
        if out is None:
            out = backend.zeros((spec.batch, self.q_len, self.n_heads, spec.head_dim),
                                backend.storage_dtype(spec.io_dtype))
        rope = self.rope
        workspace = self._workspace
        args = (out, workspace.partial_out, workspace.partial_max, workspace.partial_sum, workspace.split_counters,
                q, view.k, view.v, view.lengths, *view.scale_args(), *view.layout_args(),
                np.int32(self.q_len), np.int32(self.n_heads), np.int32(spec.n_kv_heads), np.int32(spec.head_dim),
                np.int32(spec.max_seq), np.int32(self.num_splits), np.int32(self.split_keys or 0),
                np.float32(self.scale), np.float32(self.softcap or 0.0), np.int32(self.window or 0),
                np.int32(rope is not None), np.float64(rope.theta if rope else 0.0), run_if)
        try:
            backend.launch(self.kernel.op, self.kernel.instance, self.grid, self.block, args, self.shared_mem_bytes)
        except BaseException:
            # A launch that stopped part-way (an emulator error, Ctrl-C) may leave tiles mid-count: zero
            # the counters in place (a captured graph holds this buffer), so the next run merges right.
            if self.num_splits > 1 and active_capture() is None:
                workspace.split_counters.fill(0)
            raise
        return out
