"""Exceptions raised by cupykv."""


class CacheOverflowError(RuntimeError):
    """A sequence was appended or advanced past the cache capacity.

    Raised by ``KVCache.check()`` when any per-sequence overflow flag is set.
    Rows that would have landed at positions ``>= max_seq`` were dropped, so
    the affected sequences no longer hold their full history. The message
    names the overflowed sequences; ``reset(slots)`` clears their flags.
    """

    @classmethod
    def for_sequences(cls, sequences, max_seq):
        """The error for overflow flags set on ``sequences`` (a list of ints)."""
        return cls(
            f"cache overflow in sequences {list(sequences)} (max_seq={max_seq}): rows past "
            f"capacity were dropped; call reset({list(sequences)}) before reusing these slots"
        )
