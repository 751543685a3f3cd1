"""Rotary position embedding (LLaMA / GPT-NeoX half-split form).

For an even ``head_dim``, ``half = head_dim // 2`` and feature pair
``(x[i], x[i + half])`` is rotated by the angle
``a = p * theta ** (-2 i / head_dim)`` at position ``p``::

    out[i]        = x[i] * cos(a) - x[i + half] * sin(a)
    out[i + half] = x[i + half] * cos(a) + x[i] * sin(a)

The fast path only passes ``theta`` to its kernels; ``rope_angles`` is the
float64 form the reference uses.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cupykv.errors import shown

# The argument layer (cupykv._args) imports this module to check that a rope is a Rope, so the
# theta check lives here and this module imports nothing from cupykv but the leaf cupykv.errors:
# the dependency runs one way.
_THETA_MAX = float(np.finfo(np.float64).max)
_THETA_EXPECTED = (f"a float in 1..{_THETA_MAX:.8g} (finite and >= 1, so that every rotation angle "
                   "p * theta**(-2i/head_dim) is at most p)")


def check_rope_theta(name: str, theta: object) -> float:
    """Return a rotary base as a float in ``1..FLOAT64_MAX`` (the kernels compute angles in double).

    ``theta >= 1`` keeps every inverse frequency ``theta ** (-2i / head_dim)``
    at most 1, so an angle is at most its position: finite, never NaN. Raises
    ``TypeError`` for anything but a real number (``bool`` included) and
    ``ValueError`` outside the range, with the argument layer's messages
    (``<name>: expected <what>, got <value>``).
    """
    if isinstance(theta, (bool, np.bool_)) or not isinstance(theta, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name}: expected {_THETA_EXPECTED}, got {shown(theta)} ({type(theta).__name__})")
    try:
        number = float(theta)
    except OverflowError:   # an int beyond float64
        number = -math.inf if theta < 0 else math.inf
    if not 1.0 <= number <= _THETA_MAX:
        raise ValueError(f"{name}: expected {_THETA_EXPECTED}, got {shown(theta)}")
    return number


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_rope_theta("Rope.theta", self.theta))


def rope_angles(positions: npt.ArrayLike, head_dim: int, theta: float) -> npt.NDArray[np.float64]:
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
