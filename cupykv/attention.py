"""attention(): masked GQA attention of new queries over one layer of a KVCache.

Host side only: argument checks, the split-KV plan (static per cache and
query shape, so it is the same on every replay of a captured step), the
workspace, then one launch (plus a combine launch when split).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupykv import _args, graph
from cupykv.cache import KVCache
from cupykv.kernels import CUDA_TYPES, attention_instance

THREADS = 128          # attention_tiling::kThreads in kernels/attention.cu
TILE_ROWS = 16         # attention_tiling::kTileRows
CHUNK = 128            # attention_tiling::kChunk
TARGET_BLOCKS = 264    # two waves of a 132-SM H100/H200; more splits only add combine work
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 65535     # splits are grid y: CUDA's limit there


def shared_memory_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one attention block: q tile, scores and row stats (float32)."""
    return (TILE_ROWS * head_dim + TILE_ROWS * CHUNK + 3 * TILE_ROWS) * 4


def plan_splits(cache: KVCache, q_len: int, n_heads: int) -> int:
    """Number of KV splits: enough blocks to fill the GPU, never less than 256 keys a split.

    Depends only on static shapes, so a captured graph keeps a valid plan.
    The emulator runs blocks one after another, where splitting only adds work.
    """
    spec = cache.spec
    if cache.backend == "emulator":
        return 1
    blocks = spec.batch * spec.n_kv_heads * _tiles(q_len, n_heads // spec.n_kv_heads)
    return max(1, min(math.ceil(TARGET_BLOCKS / blocks), spec.max_seq // MIN_KEYS_PER_SPLIT))


def _tiles(q_len: int, group: int) -> int:
    """Blocks of up to TILE_ROWS query rows (query x head of one GQA group) per sequence and kv head."""
    return math.ceil(q_len * group / TILE_ROWS)


def max_splits(max_seq: int) -> int:
    """The largest split-KV factor: one chunk of keys a split at least, and CUDA's grid y limit."""
    return max(1, min(math.ceil(max_seq / CHUNK), MAX_SPLITS))


@dataclass(frozen=True)
class _Workspace:
    """One cache's split-KV scratch: three flat float32 buffers and their views for the last shape used."""

    buffers: tuple      # float32 [size] each, for partial_out, partial_max, partial_sum; grow, never shrink
    shape: tuple        # (splits, rows, head_dim) that ``views`` were carved for
    views: tuple        # partial_out [splits, rows, head_dim], partial_max, partial_sum [splits, rows]
    ranges: tuple       # ("attention workspace", first, last) byte addresses of each buffer (see KVCache._ranges)


def _workspace(cache: KVCache, num_splits: int, rows: int, head_dim: int) -> tuple:
    """fp32 partial results ``[splits, rows, head_dim]``, max and sum ``[splits, rows]``.

    Leading views of three buffers per cache, each grown (outside capture
    only) when a call needs more than any call before it, so memory stays
    bounded by the largest call and a smaller one allocates nothing. They are
    three allocations, not one, so that on the emulator an overrun of one
    view hits a guard page instead of the next view. A captured graph keeps
    the buffers it was captured with alive through its launch arguments. An
    unsplit launch never touches them: one element each stands in.
    """
    if num_splits == 1:
        rows = head_dim = 1
    shape = (num_splits, rows, head_dim)
    current = cache._workspace
    if current is not None and current.shape == shape:
        return current.views
    shapes = ((num_splits, rows, head_dim), (num_splits, rows), (num_splits, rows))
    buffers = list(current.buffers) if current is not None else [None, None, None]
    for i, view_shape in enumerate(shapes):
        size = math.prod(view_shape)
        if buffers[i] is None or buffers[i].size < size:
            graph.refuse_in_capture(f"growing attention's split-KV workspace to {size} float32 values",
                                    "call attention once with the step's largest shapes before capture")
            buffers[i] = cache._backend.zeros((size,), np.float32)
    views = tuple(buffer[:math.prod(view_shape)].reshape(view_shape) for buffer, view_shape in zip(buffers, shapes))
    ranges = tuple(("attention workspace", *_args.byte_range(buffer)) for buffer in buffers)
    cache._workspace = _Workspace(tuple(buffers), shape, views, ranges)
    return views


def attention(q, cache: KVCache, layer, *, scale=None, window=None, softcap=None, rope=None, out=None,
              num_splits=None):
    """Causal GQA attention of ``q`` over the live rows of one cache layer.

    Query ``i`` of sequence ``b`` sits at position ``lengths[b] + i`` (rows
    appended but not yet advanced count as present) and attends to every
    position ``j <= lengths[b] + i`` below ``max_seq`` (and ``j > pos - window``
    with a window). Work follows the live lengths, read on the device.

    Parameters
    ----------
    q : device array ``[batch, q_len, n_heads, head_dim]``
        Queries in the cache's dtype (bfloat16 as ``ml_dtypes.bfloat16`` or
        uint16 bit patterns, on either backend), C-contiguous; ``q_len`` in
        ``1..2**30-1``, ``n_heads`` a multiple of ``n_kv_heads`` (head ``h``
        reads kv head ``h // (n_heads // n_kv_heads)``), ``batch * q_len *
        n_heads`` at most ``2**31-1``.
    cache : KVCache
    layer : int
    scale : float, optional
        Logit scale, a normal float32 > 0; ``1/sqrt(head_dim)`` by default.
    window : int, optional
        Sliding window in ``1..2**31-1``: keep positions ``j > pos - window``.
    softcap : float, optional
        A normal float32 > 0: logits become ``softcap * tanh(s / softcap)``.
    rope : Rope, optional
        Rotate each query at its position first.
    out : device array ``[batch, q_len, n_heads, head_dim]``, optional
        Written in place and returned (the graph-safe form), viewed as the
        storage dtype; the dtype forms of ``q`` are accepted. C-contiguous,
        writeable, and overlapping neither ``q`` nor any buffer of a cache.
    num_splits : int, optional
        Split-KV factor in ``1..min(ceil(max_seq / 128), 65535)``; by default
        :func:`plan_splits` picks it.

    Returns
    -------
    device array ``[batch, q_len, n_heads, head_dim]`` in the storage dtype.
    A query with nothing to attend to gets zeros.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, before anything is allocated or launched.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a cupykv.KVCache, got {type(cache).__name__}")
    spec = cache.spec
    backend = cache._backend
    cache._check_device()
    layer = _args.check_layer(layer, spec)
    q_len, n_heads = _args.check_q(q, spec)
    scale = _args.check_scale(scale, spec)
    window = _args.check_window(window)
    if window is not None:  # any window above max_seq + q_len keeps every position: same result, fits int32
        window = min(window, spec.max_seq + q_len)
    softcap = _args.check_softcap(softcap)
    rope = _args.check_rope(rope, spec)
    q = _args.device_operand("q", q, backend, spec.dtype)
    shape = (spec.batch, q_len, n_heads, spec.head_dim)
    if out is not None:
        out = _args.device_operand("out", out, backend, spec.dtype, shape, written=True)
        _args.check_no_overlap("out", out, [("q", q)])
        _args.check_apart_from_caches("out", out, cache)   # and every other cache
    if num_splits is None:
        num_splits = plan_splits(cache, q_len, n_heads)
    num_splits = _args.check_int("num_splits", num_splits, 1, max_splits(spec.max_seq))

    rows = spec.batch * q_len * n_heads
    group = n_heads // spec.n_kv_heads
    grid = (spec.batch * spec.n_kv_heads * _tiles(q_len, group), num_splits)
    _args.check_launch("q", f"batch * n_kv_heads * ceil(q_len * group / {TILE_ROWS}) = {spec.batch} * "
                       f"{spec.n_kv_heads} * {_tiles(q_len, group)} query tiles", grid, (THREADS,),
                       shared_memory_bytes(spec.head_dim))
    if out is None:
        out = backend.zeros(shape, backend.storage_dtype(spec.dtype))
    partial_out, partial_max, partial_sum = _workspace(cache, num_splits, rows, spec.head_dim)
    cache._launch(
        "attention", attention_instance(spec.dtype, spec.head_dim), grid, (THREADS,),
        (out, partial_out, partial_max, partial_sum, q, cache.k, cache.v, cache.lengths,
         *cache._layout_args(layer),
         np.int32(q_len), np.int32(n_heads), np.int32(spec.n_kv_heads), np.int32(spec.head_dim),
         np.int32(spec.max_seq), np.int32(num_splits), np.float32(scale), np.float32(softcap or 0.0),
         np.int32(window or 0), np.int32(rope is not None), np.float64(rope.theta if rope else 0.0)),
        shared_memory_bytes(spec.head_dim))
    if num_splits > 1:
        cache._launch(
            "attention", f"cupykv_attention_combine<{CUDA_TYPES[spec.dtype]}>", (rows,), (THREADS,),
            (out, partial_out, partial_max, partial_sum, np.int32(rows), np.int32(spec.head_dim),
             np.int32(num_splits)))
    return out
