"""attention(): masked GQA attention of new queries over one layer of a KVCache.

The convenience form of :class:`~cupykv.AttentionPlan`: it checks the call,
then runs a plan made for the call's static shape and options, kept per
cache (a few at most, least recently used first out) and made on first use,
outside capture (a captured step's warm-up run makes it). Plans own their
split-KV workspaces, so calls of different shapes never share one; calls of
the same shape on one cache share their plan, so two streams that attend
over one cache at once should each hold their own :class:`AttentionPlan`.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Hashable

from cupykv import _args
from cupykv._typing import ArrayLike, DeviceArray, FloatLike, IntLike
from cupykv.attention_plan import AttentionPlan, check_operands, check_split_keys, max_splits
from cupykv.cache import KVCache
from cupykv.rope import Rope

PLANS_PER_CACHE = 8
_plans: weakref.WeakKeyDictionary[KVCache, OrderedDict[Hashable, AttentionPlan]] = weakref.WeakKeyDictionary()


def plan_for(cache: KVCache, q_len: int, n_heads: int, *, scale: float | None = None, window: int | None = None,
             softcap: float | None = None, rope: Rope | None = None, num_splits: int | None = None,
             split_keys: int | None = None) -> AttentionPlan:
    """The cached plan of ``cache`` for these static arguments, made (outside capture) on first use."""
    key = (q_len, n_heads, scale, window, softcap, rope, num_splits, split_keys)
    plans = _plans.setdefault(cache, OrderedDict())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = AttentionPlan(cache, q_len, n_heads, scale=scale, window=window, softcap=softcap,
                                          rope=rope, num_splits=num_splits, split_keys=split_keys)
        while len(plans) > PLANS_PER_CACHE:
            plans.popitem(last=False)
    plans.move_to_end(key)
    return plan


def attention(q: ArrayLike, cache: KVCache, layer: IntLike, *, scale: FloatLike | None = None,
              window: IntLike | None = None, softcap: FloatLike | None = None, rope: Rope | None = None,
              out: ArrayLike | None = None, num_splits: IntLike | None = None,
              split_keys: IntLike | None = None, run_if: ArrayLike | None = None) -> DeviceArray:
    """Causal GQA attention of ``q`` over the live rows of one cache layer.

    Query ``i`` of sequence ``b`` sits at position ``lengths[b] + i`` (rows
    appended but not yet advanced count as present) and attends to every
    position ``j <= lengths[b] + i`` below ``max_seq`` (and ``j > pos - window``
    with a window). Work follows the live lengths, read on the device.

    Graph-safe: yes, with ``out=`` — launches only: the plan for the call's static shape and options is
    made (and its workspace allocated) on first use, which in a captured step is its warm-up run; without
    ``out`` the output is allocated, which a captured step refuses (CaptureError).

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
        the plan picks it (:func:`cupykv.attention_plan.plan_splits`).
    split_keys : int, optional
        Instead of ``num_splits``: splits at the fixed positions
        ``[s * split_keys, (s + 1) * split_keys)`` (a multiple of 128), so a
        query row's result does not depend on ``q_len`` (see
        :class:`~cupykv.AttentionPlan`).
    run_if : device int32 array ``[1]``, optional
        The launch's gate, read on the device at run time (a captured step sees
        its value at every replay): 0 makes the launch return at once, reading
        nothing else and writing nothing (``out`` keeps its bytes, the plan's
        split counters stay at 0); any other value, or ``None``, attends. The
        caller's word (or ``Backend.always_run()``), C-contiguous; it may not
        overlap ``out`` or a buffer of any cache or plan.

    Returns
    -------
    device array ``[batch, q_len, n_heads, head_dim]`` in the storage dtype.
    A query with nothing to attend to gets zeros. With ``run_if`` holding 0,
    ``out`` as it was (zeros when the call allocated it).

    Raises
    ------
    TypeError, ValueError
        Bad arguments, before anything is allocated or launched.
    CaptureError
        No ``out`` inside a captured step.
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a cupykv.KVCache, got {type(cache).__name__}")
    spec = cache.spec
    layer = _args.check_layer(layer, spec)
    q_len, n_heads = _args.check_q(q, spec)
    scale, window, softcap = _args.check_scale(scale, spec), _args.check_window(window), _args.check_softcap(softcap)
    rope = _args.check_rope(rope, spec)
    if num_splits is not None:
        num_splits = _args.check_int("num_splits", num_splits, 1, max_splits(spec.max_seq))
    if split_keys is not None:
        split_keys = check_split_keys(split_keys, spec)
    operands = check_operands(cache, q_len, n_heads, q, layer, out, run_if)   # before a new plan allocates
    plan = plan_for(cache, q_len, n_heads, scale=scale, window=window, softcap=softcap, rope=rope,
                    num_splits=num_splits, split_keys=split_keys)
    return plan._launch(*operands)
