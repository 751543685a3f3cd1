"""The positions arguments of ``append`` and ``write``: where rows go, and where their positions are returned.

``positions`` (write) is a device int32 array read by the kernel at run
time, or host values checked here and uploaded by the caller once every
check has passed. ``positions_out`` is a device int32 array the kernel
writes; without one, ``return_positions=True`` makes the caller allocate,
which a captured step may not do, so that is refused inside a capture
before anything else happens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from cupykv._args.arrays import int32_operand
from cupykv._args.cache_args import check_positions, check_positions_shape
from cupykv._args.overlap import check_no_overlap
from cupykv._args.scalars import check_bool
from cupykv._typing import DeviceArray
from cupykv.backends.capture import refuse_in_capture

if TYPE_CHECKING:
    from cupykv._args.cache_args import Int64Array
    from cupykv.backends.base import Backend
    from cupykv.spec import CacheSpec


def positions_operand(positions: object, spec: CacheSpec, n_new: int, backend: Backend,
                      written: Iterable[tuple[str, DeviceArray | None]]
                      ) -> tuple[DeviceArray, None] | tuple[None, Int64Array]:
    """``(device positions, None)`` for a device array, ``(None, int64 [batch, n_new])`` for host values.

    A device array must be int32 of shape ``[batch, n_new]`` (or ``[batch]``
    when ``n_new`` is 1), C-contiguous, and share no byte with ``written``
    (``(description, array)`` pairs: what the launch writes).
    """
    if not backend.is_device_array(positions) and isinstance(positions, (list, tuple, np.ndarray)):
        return None, check_positions(positions, spec, n_new)
    device = int32_operand("positions", positions, backend)
    check_positions_shape("positions", device, spec, n_new)
    check_no_overlap("positions", device, written)
    return device, None


def positions_output(return_positions: object, positions_out: object, spec: CacheSpec, n_new: int, backend: Backend,
                     inputs: Iterable[tuple[str, DeviceArray | None]]) -> DeviceArray | None:
    """The checked ``positions_out``, or ``None`` (the caller allocates one when ``return_positions``).

    ``positions_out`` must be a writeable, C-contiguous device int32 array of
    shape ``[batch, n_new]`` (or ``[batch]`` when ``n_new`` is 1), apart from
    ``inputs`` (``(name, array)`` pairs the launch reads) and from every cache.
    """
    return_positions = check_bool("return_positions", return_positions)
    if positions_out is None:
        if return_positions:
            refuse_in_capture("return_positions=True without positions_out",
                              "pass a device int32 array [batch, n_new], allocated before capture, as positions_out")
        return None
    out = int32_operand("positions_out", positions_out, backend, written=True)
    check_positions_shape("positions_out", out, spec, n_new)
    check_no_overlap("positions_out", out, inputs)
    return out
