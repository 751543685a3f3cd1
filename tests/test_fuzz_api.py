"""A fuzz of the public API: every call is refused with a named error and changes nothing, or matches the reference.

Each example builds a small emulator cache with random committed rows and its
reference twin, then makes one public call (a cache method, ``attention``, an
op of ``cupykv.ops``, ``Rope``, ``CacheSpec``, ``KVCache``, or the LLaMA
model's config, constructor and ``generate``) with arguments drawn by
``fuzz_args``: good, borderline and bad ones (wrong dtypes and shapes,
zero-size axes, strided, reversed and offset views, read-only arrays, arrays
overlapping each other or the cache, ints and floats of every NumPy type at
the edges of their ranges, lists, tuples, strings, None). The builders
(``fuzz_calls``, ``fuzz_ops``, ``fuzz_model``) label every call valid or not
by the contract as the tests read it. Then:

- a valid call must be accepted (a ``MemoryError`` for a cache the machine
  cannot hold excepted), and its results must equal the reference's: the
  whole cache bit for bit, attention within the stated tolerance, ops within
  the tolerances of ``test_ops``, the model's logits within theirs;
- an invalid call must raise ``TypeError`` or ``ValueError`` whose message
  starts with the name of one of the call's arguments, and leave the cache
  and every array the example made unchanged, bit for bit.

Examples: ten times the profile's count (500 on a workstation, 2000 with CI=true).
"""
import re

import numpy as np
from hypothesis import HealthCheck, event, given, settings, strategies as st

from cupykv import testing
import fuzz_calls
import fuzz_model
import fuzz_ops
from fuzz_args import Env, set_bad_arguments

EXAMPLES = 10 * settings.default.max_examples

# call -> (builder, weight): the model's calls cost the most, so they are drawn less often
CALLS = {
    "append": (fuzz_calls.build_append, 4), "advance": (fuzz_calls.build_advance, 3),
    "truncate": (fuzz_calls.build_truncate, 3), "reset": (fuzz_calls.build_reset, 2),
    "write": (fuzz_calls.build_write, 3), "set_lengths": (fuzz_calls.build_set_lengths, 2),
    "additive_mask": (fuzz_calls.build_additive_mask, 2), "attention": (fuzz_calls.build_attention, 5),
    "Rope": (fuzz_calls.build_rope, 1), "CacheSpec": (fuzz_calls.build_cache_spec, 1),
    "KVCache": (fuzz_calls.build_kv_cache, 1),
    **{name: (builder, 2) for name, builder in fuzz_ops.BUILDERS.items()},
    "LlamaConfig": (fuzz_model.build_llama_config, 1), "Llama": (fuzz_model.build_llama, 1),
    "generate": (fuzz_model.build_generate, 1),
}
CALL_NAMES = st.sampled_from([name for name, (_, weight) in CALLS.items() for _ in range(weight)])
# all good (must be accepted), one named argument perhaps bad (the others good), or each perhaps bad
MODES = ("all good", "one bad", "one bad", "any bad")
SPECS = testing.specs(kv_heads=(1, 2), head_dims=(2, 3, 8, 64), max_seqs=(1, 4, 16), max_batch=3)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
@given(spec=SPECS, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_every_public_call_is_refused_by_name_or_matches_the_reference(spec, seed, data):
    name = data.draw(CALL_NAMES, label="call")
    builder = CALLS[name][0]
    mode = data.draw(st.sampled_from(MODES), label="mode")
    if mode == "one bad":
        set_bad_arguments(target=data.draw(st.sampled_from(builder.arguments), label="the argument that may be bad"))
    else:
        set_bad_arguments(tenths=0 if mode == "all good" else data.draw(st.sampled_from((1, 3, 10)), label="tenths"))
    lengths = np.random.default_rng(seed).integers(0, spec.max_seq + 1, spec.batch)
    env = Env(spec, lengths, seed)
    call = builder(data.draw, env)
    before = env.snapshot()
    try:
        result = call.run()
    except (TypeError, ValueError, MemoryError) as error:
        message = str(error)
        named = re.match(r"([\w.]+)(\[\d+\])?: expected ", message)   # an argument, or one element of it
        assert named and named.group(1) in call.names, f"{name}: the message names none of {call.names}: {message!r}"
        if isinstance(error, MemoryError):
            assert "expected a cache of at most" in message, message
        else:
            assert not call.valid, f"{name} refused a valid call {call.args}: {message}"
        for i, (was, now) in enumerate(zip(before, env.snapshot())):
            assert np.array_equal(was, now), f"{name} was refused ({message}) but changed buffer {i}"
        event(f"{name}: refused")
        return
    assert call.valid, f"{name} accepted an invalid call {call.args}"
    call.check(result)
    event(f"{name}: accepted")
