"""Rotary position embedding (LLaMA / GPT-NeoX half-split form).

For an even ``head_dim``, ``half = head_dim // 2`` and feature pair
``(x[i], x[i + half])`` is rotated by the angle
``a = p * theta ** (-2 i / head_dim)`` at position ``p``::

    out[i]        = x[i] * cos(a) - x[i + half] * sin(a)
    out[i + half] = x[i + half] * cos(a) + x[i] * sin(a)

The fast path only passes ``theta`` to its kernels; ``rope_angles`` is the
float64 form the reference uses.
"""

from dataclasses import dataclass

import numpy as np

from ._args.cache_args import check_rope_theta


@dataclass(frozen=True)
class Rope:
    """Rotary embedding settings.

    Parameters
    ----------
    theta : float, default 10000.0
        Base of the inverse frequencies; finite and >= 1, so that every
        inverse frequency is at most 1 and an angle at most its position
        (finite, as the kernels' double arithmetic needs). Stored as a float.

    Raises
    ------
    TypeError
        ``theta`` is not a real number (``bool`` is rejected).
    ValueError
        ``theta`` is not finite or below 1.
    """

    theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "theta", check_rope_theta("Rope.theta", self.theta))


def rope_angles(positions, head_dim, theta):
    """Rotation angles in float64.

    Parameters
    ----------
    positions : int or array_like of int, shape ``[...]``
        Token positions.
    head_dim : int
        Features per head (even).
    theta : float
        Rope base.

    Returns
    -------
    numpy.ndarray, float64, shape ``[..., head_dim // 2]``
        ``angles[..., i] = positions[...] * theta ** (-2 i / head_dim)``.
    """
    positions = np.asarray(positions, dtype=np.float64)
    inv_freq = float(theta) ** (-2.0 * np.arange(head_dim // 2) / head_dim)  # [half]
    return positions[..., None] * inv_freq
