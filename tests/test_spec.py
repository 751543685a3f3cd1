"""CacheSpec: validation, derived shapes and sizes checked against NumPy's own."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupykv import CacheSpec
from cupykv.spec import DTYPES, LAYOUTS

specs = st.builds(
    CacheSpec,
    n_layers=st.integers(1, 4),
    n_kv_heads=st.integers(1, 8),
    head_dim=st.integers(1, 256),
    max_seq=st.integers(1, 64),
    batch=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
)


def test_defaults():
    spec = CacheSpec(n_layers=2, n_kv_heads=4, head_dim=64, max_seq=128)
    assert (spec.batch, spec.dtype, spec.layout) == (1, "float32", "NHD")
    assert spec.shape == (2, 1, 128, 4, 64)


def test_layouts_order_axes():
    nhd = CacheSpec(3, 4, 8, 16, batch=2, layout="NHD")
    hnd = CacheSpec(3, 4, 8, 16, batch=2, layout="HND")
    assert nhd.shape == (3, 2, 16, 4, 8) and nhd.seq_axis == 2
    assert hnd.shape == (3, 2, 4, 16, 8) and hnd.seq_axis == 3
    assert nhd.layer_shape == (2, 16, 4, 8) and hnd.layer_shape == (2, 4, 16, 8)


def test_numpy_integers_are_normalised():
    spec = CacheSpec(np.int64(2), np.int32(4), np.uint8(64), np.int16(16), batch=np.int64(3))
    for name in ("n_layers", "n_kv_heads", "head_dim", "max_seq", "batch"):
        assert type(getattr(spec, name)) is int
    assert spec == CacheSpec(2, 4, 64, 16, batch=3)


def test_frozen_and_hashable():
    spec = CacheSpec(1, 1, 8, 8)
    with pytest.raises(AttributeError):
        spec.max_seq = 9
    assert hash(spec) == hash(CacheSpec(1, 1, 8, 8))


@given(specs)
def test_derived_match_numpy(spec):
    expected_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                      "float8_e4m3": ml_dtypes.float8_e4m3fn}[spec.dtype]
    assert spec.np_dtype == np.dtype(expected_dtype)
    array = np.empty(spec.shape, dtype=spec.np_dtype)
    assert spec.itemsize == array.itemsize
    assert spec.strides == tuple(s // array.itemsize for s in array.strides)
    assert spec.nbytes == 2 * array.nbytes
    assert spec.shape == (spec.n_layers,) + spec.layer_shape
    assert spec.shape[spec.seq_axis] == spec.max_seq


GOOD = dict(n_layers=2, n_kv_heads=4, head_dim=64, max_seq=16, batch=2, dtype="float32", layout="NHD")

BAD_FIELDS = [
    # (field, bad value, exception, expected description, shown value)
    ("n_layers", 0, ValueError, "an int in 1..2147483647", "0"),
    ("n_layers", -3, ValueError, "an int in 1..2147483647", "-3"),
    ("n_layers", 2.0, TypeError, "an int in 1..2147483647", "2.0"),
    ("n_layers", True, TypeError, "an int in 1..2147483647", "True"),
    ("n_layers", "2", TypeError, "an int in 1..2147483647", "'2'"),
    ("n_kv_heads", 0, ValueError, "an int in 1..2147483647", "0"),
    ("n_kv_heads", None, TypeError, "an int in 1..2147483647", "None"),
    ("n_kv_heads", np.float32(4), TypeError, "an int in 1..2147483647", "4"),
    ("n_layers", 2**31, ValueError, "an int in 1..2147483647", "2147483648"),
    ("n_kv_heads", np.uint64(2**64 - 1), ValueError, "an int in 1..2147483647", "18446744073709551615"),
    ("head_dim", 300, ValueError, "an int in 1..256", "300"),
    ("head_dim", 257, ValueError, "an int in 1..256", "257"),
    ("head_dim", 0, ValueError, "an int in 1..256", "0"),
    ("head_dim", np.bool_(True), TypeError, "an int in 1..256", "True"),
    ("max_seq", 0, ValueError, "an int in 1..1073741824", "0"),
    ("max_seq", 1.5, TypeError, "an int in 1..1073741824", "1.5"),
    ("max_seq", 2**30 + 1, ValueError, "an int in 1..1073741824", "1073741825"),
    ("max_seq", np.int64(2**31), ValueError, "an int in 1..1073741824", "2147483648"),
    ("batch", 0, ValueError, "an int in 1..2147483647", "0"),
    ("batch", [2], TypeError, "an int in 1..2147483647", "[2]"),
    ("dtype", "float64", ValueError, "one of 'float32', 'float16', 'bfloat16', 'float8_e4m3'", "'float64'"),
    ("dtype", "fp16", ValueError, "one of 'float32', 'float16', 'bfloat16', 'float8_e4m3'", "'fp16'"),
    ("dtype", np.float16, TypeError, "one of 'float32', 'float16', 'bfloat16', 'float8_e4m3'", "float16"),
    ("layout", "NDH", ValueError, "one of 'NHD', 'HND'", "'NDH'"),
    ("layout", "nhd", ValueError, "one of 'NHD', 'HND'", "'nhd'"),
    ("layout", 0, TypeError, "one of 'NHD', 'HND'", "0"),
]


@pytest.mark.parametrize("field, value, exc, expected, shown", BAD_FIELDS)
def test_bad_field(field, value, exc, expected, shown):
    with pytest.raises(exc) as info:
        CacheSpec(**{**GOOD, field: value})
    message = str(info.value)
    assert message.startswith(f"CacheSpec.{field}: expected {expected}, got ")
    assert shown in message.split(", got ", 1)[1]


def test_head_dim_message_example():
    with pytest.raises(ValueError, match=r"^CacheSpec\.head_dim: expected an int in 1\.\.256, got 300$"):
        CacheSpec(**{**GOOD, "head_dim": 300})


def test_max_seq_leaves_room_for_every_query_position_in_int32():
    # max_seq <= MAX_SEQ and q_len <= MAX_NEW: a position lengths[b] + i < max_seq + q_len <= 2**31 - 1
    from cupykv.spec import MAX_NEW, MAX_SEQ
    assert MAX_SEQ + MAX_NEW == 2**31 - 1
    assert CacheSpec(**{**GOOD, "max_seq": MAX_SEQ}).max_seq == 2**30


@pytest.mark.parametrize("fields, message", [
    (dict(batch=70000, n_kv_heads=40000, head_dim=1),
     r"^CacheSpec\.batch: expected batch \* n_kv_heads <= 2147483647 \(attention launches one block per sequence and "
     r"kv head on grid x\), got 70000 \* 40000 = 2800000000$"),
    (dict(batch=1, n_kv_heads=2**23, head_dim=256),
     r"^CacheSpec\.n_kv_heads: expected n_kv_heads \* head_dim <= 2147483647 \(append indexes a row of "
     r"n_kv_heads \* head_dim elements with an int\), got 8388608 \* 256 = 2147483648$"),
])
def test_a_spec_that_every_attention_or_append_would_overflow_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec(**{**GOOD, **fields})


@pytest.mark.parametrize("fields", [dict(batch=1, n_kv_heads=2**31 - 1, head_dim=1),
                                    dict(batch=2**31 - 1, n_kv_heads=1, head_dim=1)])
def test_products_of_exactly_int32_max_are_accepted(fields):
    """The products' bound is inclusive: 2**31 - 1 blocks (grid x's limit) and elements still fit an int
    (2**31 - 1 is prime, so only 1 x 2**31 - 1 reaches it)."""
    spec = CacheSpec(**{**GOOD, **fields})
    assert max(spec.batch * spec.n_kv_heads, spec.n_kv_heads * spec.head_dim) == 2**31 - 1
