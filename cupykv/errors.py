"""Exceptions raised by cupykv."""
from __future__ import annotations

from typing import Iterable

_SHOWN = 60   # characters of a rejected value's repr kept in a message


def shown(value: object) -> str:
    """``repr(value)`` for an error message, shortened when long (a 400-digit int).

    It lives here, in a module that imports nothing from cupykv, so that the argument layer
    (``cupykv._args``) and ``cupykv.rope``, which that layer imports, show values alike.
    """
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN - 15]}...{text[-12:]}"


class CacheOverflowError(RuntimeError):
    """A sequence was appended or advanced past the cache capacity.

    Raised by ``KVCache.check()`` when any per-sequence overflow flag is set.
    Rows that would have landed at positions ``>= max_seq`` were dropped, so
    the affected sequences no longer hold their full history. The message
    names the overflowed sequences; ``reset(slots)`` clears their flags.
    """

    @classmethod
    def for_sequences(cls, sequences: Iterable[int], max_seq: int) -> CacheOverflowError:
        """The error for overflow flags set on ``sequences`` (a list of ints)."""
        return cls(
            f"cache overflow in sequences {list(sequences)} (max_seq={max_seq}): rows past "
            f"capacity were dropped; call reset({list(sequences)}) before reusing these slots"
        )


class UserError(Exception):
    """Base of the errors a user fixes without touching cupykv's code.

    A setting, an argument, an input file, or a device or tool this machine
    lacks. The command line (``python -m cupykv``) prints these as one line,
    ``cupykv <command>: error: <message>``, with no traceback, and exits with
    status 2. Every other exception is a bug and keeps its traceback.
    """


class BackendUnavailableError(UserError, RuntimeError):
    """The chosen backend cannot run here: no usable CUDA device for ``"cupy"``, or a
    machine the CPU emulator does not support (see
    :class:`cupykv.backends.emulator.PlatformError`)."""


class InputError(UserError, ValueError):
    """An input cannot be used: a missing or unreadable model file, an unknown model name,
    a prompt that encodes to no token."""
