"""The peers section's torch side: DLPack views of cupykv's buffers, masks, and one call per SDPA backend.

Everything here takes the ``torch`` module as an argument (cupykv never
imports torch on its own). Each call is a zero-argument function that builds
its ``[batch, heads, seq, head_dim]`` views of the shared buffers inside
itself and runs ``scaled_dot_product_attention(..., enable_gqa=True)`` under
``sdpa_kernel`` of one backend, so the bench times exactly what torch does,
layout handling included.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional

import numpy as np

import cupykv

#: torch's SDPA backends, by the names the JSON uses (torch.nn.attention.SDPBackend members)
TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "math": "MATH"}


def as_torch(torch: Any, array: Any, dtype: Optional[str] = None) -> Any:
    """A torch tensor over ``array``'s memory (DLPack, no copy); bfloat16 goes as its uint16 bits.

    Both backends hand bfloat16 over as 16-bit words (CuPy stores uint16
    bits, the emulator ``ml_dtypes.bfloat16``, which DLPack cannot name),
    viewed back as ``torch.bfloat16`` on torch's side.
    """
    if dtype == "bfloat16":
        return torch.from_dlpack(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


def causal_mask(torch: Any, lengths: Any, q_len: int, kv_len: int) -> Any:
    """Boolean ``[batch, 1, q_len, kv_len]``: query ``i`` of sequence ``b`` sees key ``j <= lengths[b] + i``.

    cupykv's contract: query ``i`` sits at position ``lengths[b] + i``. Built on
    torch's device from the cache's device lengths (a torch view of them).
    """
    keys = torch.arange(kv_len, device=lengths.device)
    last = lengths.to(torch.int64)[:, None, None, None] + torch.arange(q_len, device=lengths.device)[:, None]
    return keys <= last


@contextlib.contextmanager
def on_current_stream(torch: Any, backend: Any, gpu: bool) -> Iterator[str]:
    """Make torch launch on CuPy's current stream, where the bench's CUDA events are recorded."""
    if not gpu:
        yield "CPU: torch runs synchronously on the host"
        return
    pointer = backend.xp.cuda.get_current_stream().ptr
    stream = torch.cuda.default_stream() if pointer == 0 else torch.cuda.ExternalStream(pointer)
    with torch.cuda.stream(stream):
        yield f"torch on CuPy's current stream (handle {pointer:#x}), so the CUDA events bracket its work"


def math_bytes(batch: int, n_heads: int, q_len: int, kv_len: int, hd: int) -> int:
    """Rough temporaries of the math backend: K/V expanded over the group and upcast to float32, and scores."""
    return batch * n_heads * (2 * kv_len * hd * (2 + 4) + q_len * kv_len * 4 * 3)


def torch_calls(torch: Any, cache: cupykv.KVCache, q: Any, lengths: list[int], gpu: bool
                ) -> dict[str, tuple[Callable[[], Any], str]]:
    """One zero-argument call per SDPA backend, each under its own ``sdpa_kernel``, and how it masks.

    Every call builds its ``[batch, heads, seq, head_dim]`` views of the shared
    buffers inside itself, so any copy torch makes is part of its time.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    spec, q_len = cache.spec, q.shape[1]
    kv_len = max(lengths) + q_len
    tq = as_torch(torch, q, spec.dtype)                                      # [batch, q_len, n_heads, hd]
    tk, tv = as_torch(torch, cache.k[0], spec.dtype), as_torch(torch, cache.v[0], spec.dtype)
    if spec.layout == "NHD":                                                 # [batch, max_seq, n_kv, hd]
        def heads_first(t: Any) -> Any:
            return t[:, :kv_len].transpose(1, 2)
    else:                                                                    # [batch, n_kv, max_seq, hd]
        def heads_first(t: Any) -> Any:
            return t[:, :, :kv_len]
    uniform = len(set(lengths)) == 1
    mask = None if uniform and q_len == 1 else causal_mask(torch, as_torch(torch, cache.lengths), q_len, kv_len)
    calls: dict[str, tuple[Callable[[], Any], str]] = {}
    for name, member in TORCH_BACKENDS.items():
        kernel = getattr(SDPBackend, member)
        how, attn_mask = ("no mask (every live key is visible)" if mask is None else "boolean mask from the "
                          "cache's lengths, built outside the timed call"), mask
        if name == "flash" and gpu and mask is not None and uniform:
            calls[name] = _flash_lower_right(torch, kernel, tq, tk, tv, heads_first, q_len, kv_len)
            continue

        def call(kernel: Any = kernel, attn_mask: Any = attn_mask) -> Any:
            with sdpa_kernel(kernel):
                return sdpa(tq.transpose(1, 2), heads_first(tk), heads_first(tv), attn_mask=attn_mask,
                            enable_gqa=True)
        calls[name] = (call, how)
    return calls


def _flash_lower_right(torch: Any, kernel: Any, tq: Any, tk: Any, tv: Any, heads_first: Callable[[Any], Any],
                       q_len: int, kv_len: int) -> tuple[Callable[[], Any], str]:
    """Flash with cupykv's causal rule for q_len > 1 (equal lengths): torch's lower-right causal bias.

    F.scaled_dot_product_attention's flash refuses masks, and its ``is_causal``
    is upper-left. ``causal_lower_right`` is the contract and reaches flash's own
    causal kernel, but only when flash takes the case: otherwise torch would
    quietly run another kernel, so the call refuses, with torch's reasons.
    """
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    bias = causal_lower_right(q_len, kv_len)

    def call() -> Any:
        query, key, value = tq.transpose(1, 2), heads_first(tk), heads_first(tv)
        cuda = torch.backends.cuda   # SDPAParams(q, k, v, mask, dropout, is_causal, enable_gqa); debug=True
        if not cuda.can_use_flash_attention(cuda.SDPAParams(query, key, value, None, 0.0, False, True), True):
            raise RuntimeError("torch.backends.cuda.can_use_flash_attention: flash does not take this case")
        with sdpa_kernel(kernel):
            return sdpa(query, key, value, attn_mask=bias, enable_gqa=True)
    return call, "torch.nn.attention.bias.causal_lower_right (flash's own causal kernel, no mask tensor)"


def first_call(torch: Any, call: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """Run ``call`` once: its output, or ``None`` and torch's reason for refusing the case."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call(), None
        except RuntimeError as exc:   # no kernel for this case, or out of memory (torch.OutOfMemoryError)
            if "out of memory" in str(exc).lower() and torch.cuda.is_available():
                torch.cuda.empty_cache()
            said = [str(w.message).strip() for w in caught if str(w.message).strip()]
            return None, "; ".join(said + [str(exc).strip().splitlines()[0]])
