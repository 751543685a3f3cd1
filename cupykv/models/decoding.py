"""Decoding loops on the device: N greedy steps per graph replay, and speculative cycles in one graph.

:meth:`Llama.generate <cupykv.models.Llama.generate>` prefills, then runs one
of two loops, eagerly or as a captured graph (made on first use, kept per
loop shape):

- :class:`GreedyLoop`: ``tokens_per_replay`` consecutive decode steps. Ids,
  positions and the argmax -> embedding hand-off stay on the device; the host
  reads the new tokens once per replay.
- :class:`SpeculativeLoop`: one greedy speculative cycle per replay. A draft
  model proposes k tokens, the target verifies them in one pass of q_len
  k + 1, ``speculative_accept`` keeps the longest accepted prefix plus the
  target's own next token, and both caches are truncated to it from device
  arrays. The tokens are the target's greedy tokens, exactly.

Stopping happens on the device. Per sequence, ``active`` (1 while it decodes)
and ``budget`` (tokens it may still emit) live in device memory; a sequence
stops after a stop id, when its budget runs out, or at capacity. Shapes are
static, so a stopped sequence stays in the batch, but its steps change
nothing that is live: it emits nothing, its length is frozen, and it keeps
embedding its last token at that length, so the rows its steps append are
pending rows past its live length (the last token's own K/V), never past
``max_length``, the longest committed length at which those rows still fit.
No overflow flag is ever set, so ``cache.check()`` stays clean. The host
starts no replay once every sequence has stopped, and within a greedy replay
the decode steps after the last sequence stopped do no work: ``decode_commit``
counts the sequences still decoding in a device word (``StopState.n_active``),
which every kernel of the step (embedding, rmsnorm, linear, append, attention,
silu_mul, add, argmax) reads as its ``run_if`` and exits at entry when it is 0.
``decode_commit`` and the cache's advance (of 0) still run: they are what
writes the -1 tokens of those steps.

Exactness. A row of a pass with q_len q is computed exactly as the same row
of a q_len-1 step: linear, the norms and argmax work row by row, and
attention's key loop for a row does not depend on the other rows of its tile.
So the verify pass's logits equal the decode steps' bit for bit, and the
speculative tokens equal the greedy ones. Where attention splits the keys (a
long cache on a GPU), the model's passes of up to ``EXACT_Q_LEN`` queries split
them at fixed positions (``split_keys``, see ``Llama._decode_split_keys``), so
a verify row still sums its keys in the order of the decode step; equal
splits of each tile's range would cut at points that follow the tile's last
query, and a near-tie of the two best logits could then resolve the other way.

Launches, for a model of L layers (14 launches per layer, 15 with split-KV):
a greedy step is ``decode_step`` plus ``decode_commit``, 14 L + 6, so a
replay of N steps makes N (14 L + 6). A speculative cycle makes k draft
forwards (14 L_draft + 5 each), two ``speculative_gather``, one verify
forward (14 L + 5), ``speculative_accept`` and two truncates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cupykv import _args

__all__ = ["DecodeStats", "GreedyLoop", "SpeculativeLoop", "decode_commit", "speculative_accept",
           "speculative_gather", "MAX_STOP_IDS", "check_draft", "decode", "run_pass"]

#: stop ids a loop checks on the device (the buffer's size is a launch constant of the captured graph).
MAX_STOP_IDS = 64
_THREADS = 256


@dataclass(frozen=True)
class DecodeStats:
    """What the last :meth:`Llama.generate <cupykv.models.Llama.generate>` did.

    Attributes
    ----------
    replays : int
        Passes of the loop body after the prefill (graph replays, or eager passes).
    steps : int
        Greedy decode steps (or speculative cycles) those passes ran, no-op ones included.
    tokens : int
        New tokens returned, over all prompts (each prompt's first, from the prefill, included).
    cycles : int
        Speculative cycles, counted per sequence that was still decoding (0 without a draft).
    proposed, accepted : int
        Draft tokens proposed in those cycles (k each), and how many the target accepted.
    cycle_tokens : int
        Tokens those cycles emitted (accepted ones plus the target's own, cut at a stop).
    """

    replays: int = 0
    steps: int = 0
    tokens: int = 0
    cycles: int = 0
    proposed: int = 0
    accepted: int = 0
    cycle_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``accepted / proposed`` (NaN without speculative cycles)."""
        return self.accepted / self.proposed if self.proposed else math.nan

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens a sequence gained per speculative cycle, ``cycle_tokens / cycles`` (NaN without cycles)."""
        return self.cycle_tokens / self.cycles if self.cycles else math.nan


# -- launches -------------------------------------------------------------------------
def _int32(name, array, backend, shape, *, written=False):
    array = _args.int32_operand(name, array, backend, written=written)
    _args.check_shape(name, array, shape)
    return array


def _apart(written, read) -> None:
    """Every written ``(name, array)`` apart from every other argument of the launch."""
    for i, (name, array) in enumerate(written):
        _args.check_no_overlap(name, array, [*written[i + 1:], *read])


def decode_commit(ids, tokens, advance_by, active, budget, next_ids, lengths, stop_ids, n_active, *, max_length,
                  backend=None) -> None:
    """End one greedy step of a device-side loop (``kernels/decode_commit.cu``; its header gives the rule).

    Parameters
    ----------
    ids, tokens, advance_by, active, budget : device int32 ``[batch]``
        Written (``ids``, ``active`` and ``budget`` also read).
    next_ids, lengths : device int32 ``[batch]``
        This step's argmax, and the cache's committed lengths before its advance.
    stop_ids : device int32 ``[n_stop]``
        Stop ids, padded with -1.
    n_active : device int32 ``[1]``
        The number of sequences still decoding, decremented for each that stops (the step kernels'
        ``run_if`` word).
    max_length : int
        The longest committed length at which a stopped sequence's pending row still fits (``<= max_seq - 1``).
    backend : {"cupy", "emulator"}, optional
        Inferred from ``ids`` by default.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, named, before the launch.
    """
    backend = _args.backend_for("ids", ids, backend)
    (batch,) = _int32("ids", ids, backend, (None,), written=True).shape
    written = [(name, _int32(name, array, backend, (batch,), written=True))
               for name, array in (("ids", ids), ("tokens", tokens), ("advance_by", advance_by),
                                   ("active", active), ("budget", budget))]
    read = [("next_ids", _int32("next_ids", next_ids, backend, (batch,))),
            ("lengths", _int32("lengths", lengths, backend, (batch,)))]
    stop_ids = _int32("stop_ids", stop_ids, backend, (None,))
    n_active = _int32("n_active", n_active, backend, (1,), written=True)
    _apart(written + [("n_active", n_active)], read + [("stop_ids", stop_ids)])
    max_length = _args.check_int32("max_length", max_length)
    arrays = dict(written + read)
    grid = (math.ceil(batch / _THREADS),)
    backend.launch("decode_commit", "cupykv_decode_commit", grid, (_THREADS,),
                   (arrays["ids"], arrays["tokens"], arrays["advance_by"], arrays["active"], arrays["budget"],
                    arrays["next_ids"], arrays["lengths"], stop_ids, n_active, np.int32(stop_ids.shape[0]),
                    np.int32(batch), np.int32(max_length)))


def speculative_gather(out, src, *, offset=0, row_stride, col_stride=0, backend=None) -> None:
    """``out[r, c] = src.flat[offset + r * row_stride + c * col_stride]`` for int32 ids (``kernels/speculative.cu``).

    Parameters
    ----------
    out : device int32 ``[rows, cols]`` (or ``[rows]``, one column)
    src : device int32, any contiguous shape; every index read must lie inside it
    offset, row_stride, col_stride : int
        In elements, >= 0.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, named (an index past ``src`` included), before the launch.
    """
    backend = _args.backend_for("out", out, backend)
    out = _args.int32_operand("out", out, backend, written=True)
    src = _args.int32_operand("src", src, backend)
    shape = tuple(out.shape) if out.ndim == 2 else (out.shape[0], 1) if out.ndim == 1 else None
    if shape is None or min(shape) < 1:
        raise ValueError(f"out: expected shape (rows,) or (rows, cols) with sizes >= 1, got {tuple(out.shape)}")
    rows, cols = shape
    offset = _args.check_int32("offset", offset)
    row_stride = _args.check_int32("row_stride", row_stride)
    col_stride = _args.check_int32("col_stride", col_stride)
    last = offset + (rows - 1) * row_stride + (cols - 1) * col_stride
    if last >= src.size:
        raise ValueError(f"src: expected at least {last + 1} elements (offset + (rows - 1) * row_stride + "
                         f"(cols - 1) * col_stride + 1), got {src.size}")
    _args.check_no_overlap("out", out, [("src", src)])
    grid = (math.ceil(rows * cols / _THREADS),)
    _args.check_launch("out", f"rows * cols = {rows} * {cols} ids", grid, (_THREADS,))
    backend.launch("speculative", "cupykv_speculative_gather", grid, (_THREADS,),
                   (out, src, np.int32(rows), np.int32(cols), np.int32(offset), np.int32(row_stride),
                    np.int32(col_stride)))


def speculative_accept(tokens, accepted, target_lengths, draft_lengths, chain, draft_pair, active, budget,
                       verify_ids, target_ids, lengths, stop_ids, *, max_length, backend=None) -> None:
    """Accept the longest verified prefix of one speculative cycle (``kernels/speculative.cu``, whose header
    gives the rule).

    Parameters
    ----------
    tokens : device int32 ``[batch, k + 1]``
        Written: the tokens each sequence emits this cycle, -1 padded.
    accepted, target_lengths, draft_lengths, chain, active, budget : device int32 ``[batch]``
        Written (``active`` and ``budget`` also read).
    draft_pair : device int32 ``[batch, 2]``
        Written: the draft's next q_len-2 input.
    verify_ids, target_ids : device int32 ``[batch, k + 1]``
        The verify pass's input ids and its argmax.
    lengths : device int32 ``[batch]``
        The target's lengths after the verify pass's ``advance(k + 1)``.
    stop_ids : device int32 ``[n_stop]``
        Stop ids, padded with -1.
    max_length : int
        ``min(target max_seq - k - 1, draft max_seq - k)``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, named, before the launch.
    """
    backend = _args.backend_for("tokens", tokens, backend)
    batch, width = _int32("tokens", tokens, backend, (None, None), written=True).shape
    if width < 2:
        raise ValueError(f"tokens: expected shape (batch, k + 1) with k >= 1, got {tuple(tokens.shape)}")
    written = [("tokens", tokens)] + [
        (name, _int32(name, array, backend, (batch,), written=True))
        for name, array in (("accepted", accepted), ("target_lengths", target_lengths),
                            ("draft_lengths", draft_lengths), ("chain", chain), ("active", active),
                            ("budget", budget))]
    written.append(("draft_pair", _int32("draft_pair", draft_pair, backend, (batch, 2), written=True)))
    read = [("verify_ids", _int32("verify_ids", verify_ids, backend, (batch, width))),
            ("target_ids", _int32("target_ids", target_ids, backend, (batch, width))),
            ("lengths", _int32("lengths", lengths, backend, (batch,)))]
    stop_ids = _int32("stop_ids", stop_ids, backend, (None,))
    _apart(written, read + [("stop_ids", stop_ids)])
    max_length = _args.check_int32("max_length", max_length)
    arrays = dict(written + read)
    grid = (math.ceil(batch / _THREADS),)
    backend.launch("speculative", "cupykv_speculative_accept", grid, (_THREADS,),
                   (*(arrays[name] for name in ("tokens", "accepted", "target_lengths", "draft_lengths", "chain",
                                                "draft_pair", "active", "budget", "verify_ids", "target_ids",
                                                "lengths")),
                    stop_ids, np.int32(width - 1), np.int32(stop_ids.shape[0]), np.int32(batch),
                    np.int32(max_length)))


def check_draft(target, draft, num_speculative) -> int:
    """``num_speculative`` as an int (0 without a draft), after checking that ``draft`` can serve ``target``."""
    if draft is None:
        if num_speculative is not None:
            raise ValueError(f"num_speculative: expected None without a draft, got {num_speculative!r}")
        return 0
    if not isinstance(draft, type(target)):
        raise TypeError(f"draft: expected None or a {type(target).__name__}, got {type(draft).__name__}")
    if draft is target:
        raise ValueError("draft: expected another Llama with its own cache, got this model itself")
    mine, theirs = target.cache.spec, draft.cache.spec
    for what, want, got in (("vocab_size", target.config.vocab_size, draft.config.vocab_size),
                            ("batch", mine.batch, theirs.batch), ("backend", target.backend.name, draft.backend.name)):
        if want != got:
            raise ValueError(f"draft: expected a Llama with {what}={want!r} (this model's), got {what}={got!r}")
    return _args.check_int("num_speculative", 4 if num_speculative is None else num_speculative, 1, 64)


# -- the loops --------------------------------------------------------------------------
class StopState:
    """A model's device-side stopping state: ``active``, ``budget``, ``advance_by`` ``[batch]``, stop ids,
    and ``n_active`` ``[1]``, the number of sequences still decoding (the greedy loop's ``run_if`` word).

    One per model, shared by its loops (their graphs hold these pointers).
    """

    def __init__(self, backend, batch: int):
        self.backend = backend
        self.active = backend.zeros((batch,), np.int32)
        self.budget = backend.zeros((batch,), np.int32)
        self.advance_by = backend.zeros((batch,), np.int32)
        self.stop_ids = backend.zeros((MAX_STOP_IDS,), np.int32)
        self.n_active = backend.zeros((1,), np.int32)

    def start(self, budgets, stops, active) -> None:
        """Upload the budgets (tokens each sequence may still emit), the stop ids and who decodes (outside capture)."""
        padded = np.full(MAX_STOP_IDS, -1, np.int32)
        padded[: len(stops)] = stops
        self.backend.upload(self.stop_ids, padded)
        self.backend.upload(self.budget, np.asarray(budgets, np.int32))
        self.backend.upload(self.active, np.asarray(active, np.int32))
        self.backend.upload(self.n_active, np.array([np.count_nonzero(active)], np.int32))

    def active_host(self) -> np.ndarray:
        return self.backend.to_host(self.active).astype(bool)


class GreedyLoop:
    """``n_steps`` greedy decode steps of ``model`` as one body (replayed as one graph).

    Reads the model's decode ids (each sequence's last token) and cache lengths, both on the device.
    After a pass, ``tokens`` ``[n_steps, batch]`` holds each step's new token (-1 where a sequence
    had stopped) and ``logits`` ``[n_steps, batch, vocab]`` each step's logits.
    """

    def __init__(self, model, n_steps: int):
        backend, batch = model.backend, model.cache.spec.batch
        self.model, self.n_steps = model, n_steps
        self.state = model._stop_state()
        self.next_ids = backend.zeros((batch,), np.int32)
        self.tokens = backend.zeros((n_steps, batch), np.int32)
        self.logits = backend.zeros((n_steps, batch, model.config.vocab_size), model._storage)
        self.max_length = model.cache.spec.max_seq - 1

    def run(self) -> None:
        """Launch the body (launches only: capturable)."""
        model, state, act = self.model, self.state, self.model._decode
        for step in range(self.n_steps):   # once no sequence decodes, the step's kernels exit at entry
            model._forward(act, run_if=state.n_active)
            model._head(act.hidden, act.normed, self.logits[step], self.next_ids, run_if=state.n_active)
            decode_commit(act.ids, self.tokens[step], state.advance_by, state.active, state.budget,
                          self.next_ids, model.cache.lengths, state.stop_ids, state.n_active,
                          max_length=self.max_length)
            model.cache.advance(state.advance_by)


class SpeculativeLoop:
    """One greedy speculative cycle of ``target`` with ``draft`` proposing ``k`` tokens, as one body.

    Per cycle: a q_len-2 draft step (the last committed token again, then the last token), k - 1 draft
    steps of q_len 1, the target's verify pass of q_len k + 1, the accept kernel, and both caches
    truncated to what was accepted. Between cycles the draft holds one row less than the target (see
    ``kernels/speculative.cu``). After a pass, ``tokens`` ``[batch, k + 1]`` holds the tokens each
    sequence emitted (-1 padded), ``accepted`` ``[batch]`` its accepted prefix (-1 where stopped) and
    ``logits`` ``[batch, k + 1, vocab]`` the verify pass's logits.
    """

    def __init__(self, target, draft, k: int):
        backend, batch, vocab = target.backend, target.cache.spec.batch, target.config.vocab_size
        self.target, self.draft, self.k = target, draft, k
        self.state = target._stop_state()
        self.pair_act = draft._activations(2)                     # ids [batch * 2]: the draft's q_len-2 input
        self.pair_logits = backend.zeros((batch * 2, vocab), draft._storage)
        self.pair_ids = backend.zeros((batch * 2,), np.int32)
        self.chain = backend.zeros((k + 1, batch), np.int32)      # last token, then proposals d_0..d_{k-1}
        self.verify_act = target._activations(k + 1)              # ids [batch * (k + 1)]
        self.logits = backend.zeros((batch, k + 1, vocab), target._storage)
        self.target_ids = backend.zeros((batch * (k + 1),), np.int32)
        self.tokens = backend.zeros((batch, k + 1), np.int32)
        self.accepted = backend.zeros((batch,), np.int32)
        self.target_lengths = backend.zeros((batch,), np.int32)
        self.draft_lengths = backend.zeros((batch,), np.int32)
        self.max_length = min(target.cache.spec.max_seq - k - 1, draft.cache.spec.max_seq - k)

    def start(self, last_tokens, last_prompt_tokens) -> None:
        """Load the chain's last token and the draft's first pair (host values; outside capture)."""
        self.target.backend.upload(self.chain[0], np.asarray(last_tokens, np.int32))
        pair = np.stack([np.asarray(last_prompt_tokens, np.int32), np.asarray(last_tokens, np.int32)], axis=1)
        self.target.backend.upload(self.pair_act.ids, pair.reshape(-1))

    def run(self) -> None:
        """Launch one cycle (launches only: capturable)."""
        target, draft, k, state = self.target, self.draft, self.k, self.state
        batch = target.cache.spec.batch
        pair, one = self.pair_act, draft._decode
        draft._forward(pair)
        draft._head(pair.hidden, pair.normed, self.pair_logits, self.pair_ids)
        draft.cache.advance(2)
        speculative_gather(self.chain[1], self.pair_ids, offset=1, row_stride=2)   # d_0: the pair's second row
        for i in range(1, k):
            draft._forward(one, ids=self.chain[i])
            draft._head(one.hidden, one.normed, draft._logits, self.chain[i + 1])
            draft.cache.advance(1)
        verify = self.verify_act
        speculative_gather(verify.ids.reshape(batch, k + 1), self.chain, row_stride=1, col_stride=batch)
        target._forward(verify)
        target._head(verify.hidden, verify.normed, self.logits.reshape(batch * (k + 1), -1), self.target_ids)
        target.cache.advance(k + 1)
        speculative_accept(self.tokens, self.accepted, self.target_lengths, self.draft_lengths, self.chain[0],
                           pair.ids.reshape(batch, 2), state.active, state.budget,
                           verify.ids.reshape(batch, k + 1), self.target_ids.reshape(batch, k + 1),
                           target.cache.lengths, state.stop_ids, max_length=self.max_length)
        target.cache.truncate(self.target_lengths)
        draft.cache.truncate(self.draft_lengths)


# -- the host side ----------------------------------------------------------------------
def run_pass(model, loop, use_graph: bool) -> None:
    """One pass of ``loop``: eager launches, or a replay of its graph (captured on first use; the capture's
    warm-up run is this pass)."""
    from cupykv.graph import capture

    if not use_graph:
        loop.run()
    elif getattr(loop, "graph", None) is None:
        loop.graph = capture(loop.run)
    else:
        loop.graph.replay()
    model._last_loop = loop


def decode(model, loop, padded, n_prompts: int, max_new_tokens: int, stops, *, use_graph: bool,
           return_logits: bool, progress=None, on_token=None
           ) -> tuple[list[list[int]], np.ndarray | None, DecodeStats]:
    """Run ``loop`` after both prefills until every prompt has stopped; returns ``(tokens, logits, stats)``.

    ``padded`` are the prompts (one per slot, dummies included); the model's decode ids hold each
    sequence's first new token. The host reads the new tokens (and, with ``return_logits``, the
    logits) once per pass. ``logits`` is None without ``return_logits``, else float32
    ``[steps, n_prompts, vocab]``, zeros past a prompt's last token.
    """
    backend, spec = model.backend, model.cache.spec
    speculative = isinstance(loop, SpeculativeLoop)
    first = backend.to_host(model._decode.ids)
    lengths = [len(p) for p in padded]
    budgets = [max_new_tokens - 1] * n_prompts + [0] * (spec.batch - n_prompts)
    active = [budgets[b] > 0 and int(first[b]) not in stops and lengths[b] + 1 <= loop.max_length
              for b in range(spec.batch)]
    loop.state.start(budgets, stops, active)
    if speculative:
        loop.start(first, [p[-1] for p in padded])
        loop.draft.cache.truncate([n - 1 for n in lengths])   # the draft holds one row less (see SpeculativeLoop)
    tokens: list[list[int]] = [[] for _ in range(n_prompts)]
    logits: list[list[np.ndarray]] = [[] for _ in range(n_prompts)]
    stats = dict(replays=0, steps=0, cycles=0, proposed=0, accepted=0, cycle_tokens=0)

    def emit(new, new_logits):
        """Append each prompt's new tokens (and logits rows); stream them one token per prompt per call."""
        for i in range(max(map(len, new), default=0)):
            step = [row[i] if i < len(row) else None for row in new]
            for b, token in enumerate(step):
                if token is not None:
                    tokens[b].append(token)
                    if return_logits:
                        logits[b].append(new_logits[b][i])
            if on_token is not None:
                on_token(step)
            if progress is not None:
                progress(max(map(len, tokens)), max_new_tokens)

    first_logits = _host_float(model, model._logits)[:n_prompts, None] if return_logits else None
    emit([[int(first[b])] for b in range(n_prompts)], first_logits)
    while np.any(active):
        # each pass emits at least one token of every sequence still decoding, whose budgets are
        # max_new_tokens - 1 past the first: a pass more means the device's stop state is broken
        if stats["replays"] >= max_new_tokens - 1:
            raise RuntimeError(f"decode: sequences {[b for b in range(spec.batch) if active[b]]} still decode after "
                               f"{stats['replays']} passes, the most max_new_tokens={max_new_tokens} allows (each "
                               "pass emits a token of every decoding sequence): the device's stop state is broken")
        run_pass(model, loop, use_graph)
        stats["replays"] += 1
        host = backend.to_host(loop.tokens)
        host_logits = _host_float(model, loop.logits) if return_logits else None
        if speculative:                                   # tokens [batch, k + 1]
            accepted = backend.to_host(loop.accepted)
            stats["steps"] += 1
            live = accepted[:n_prompts] >= 0
            stats["cycles"] += int(live.sum())
            stats["proposed"] += loop.k * int(live.sum())
            stats["accepted"] += int(accepted[:n_prompts][live].sum())
            new = [[int(t) for t in host[b] if t >= 0] for b in range(n_prompts)]
            stats["cycle_tokens"] += sum(map(len, new))
            new_logits = None if host_logits is None else [
                list(host_logits[b, : len(new[b])]) for b in range(n_prompts)]
        else:                                             # tokens [n_steps, batch]
            stats["steps"] += loop.n_steps
            new = [[int(t) for t in host[:, b] if t >= 0] for b in range(n_prompts)]
            new_logits = None if host_logits is None else [
                [host_logits[j, b] for j in range(loop.n_steps) if host[j, b] >= 0] for b in range(n_prompts)]
        emit(new, new_logits)
        over = [b for b in range(n_prompts) if len(tokens[b]) > max_new_tokens]
        if over:
            raise RuntimeError(f"decode: prompts {over} emitted {[len(tokens[b]) for b in over]} tokens, past "
                               f"max_new_tokens={max_new_tokens}: the device's budget was not kept")
        active = loop.state.active_host()
    if speculative:
        backend.copy(model._decode.ids, loop.chain[0])    # next_tokens() and decode_step() continue from here
    stats["tokens"] = sum(map(len, tokens))
    if not return_logits:
        return tokens, None, DecodeStats(**stats)
    steps = max(map(len, tokens))
    stacked = np.zeros((steps, n_prompts, model.config.vocab_size), np.float32)
    for b, rows in enumerate(logits):
        stacked[: len(rows), b] = rows
    return tokens, stacked, DecodeStats(**stats)


def _host_float(model, array) -> np.ndarray:
    """A device array of the model's activation (io) dtype as float32 on the host."""
    return model.backend.to_host(array).view(model.cache.spec.io_np_dtype).astype(np.float32)
