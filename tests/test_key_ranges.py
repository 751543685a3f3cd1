"""The keys each attention split reads (cupykv/kernels/attention_keys.cuh), against the mask.

Every attention kernel takes its block's key range from ``attention_split_keys``. The kernels'
own tests compare outputs, and an output stays right when the splits are merely uneven (a
later split empty, an earlier one longer), so those tests cannot see how the keys are split.
Here the header runs on the emulator, one case per thread (tests/emulator_kernels/key_ranges.cu),
and each range is checked against keys worked out from the mask alone:

- a tile's keys are those its queries attend: query i at position ``length + i`` attends
  ``j <= position``, ``j < max_seq``, and ``j > position - window`` when ``window > 0``;
- with ``split_keys == 0``, split s holds the s-th piece of P keys, where P is the smallest
  multiple of ``align`` for which ``num_splits`` pieces cover the tile's keys;
- with ``split_keys > 0``, split s holds the tile's keys in ``[s * split_keys, (s + 1) * split_keys)``.

A range is read as ``range(begin, end)``: a split with ``end <= begin`` reads nothing.
"""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cupykv import nvrtc_check
from cupykv.attention_plan import CHUNK, TILE_ROWS
from cupykv.backends import emulator as E
from cupykv.kernels import KERNEL_DIR

SOURCE = Path(__file__).parent / "emulator_kernels" / "key_ranges.cu"
FIELDS = ("length", "first_row", "tile_rows", "group", "max_seq", "window", "split", "num_splits",
          "split_keys", "align")


@pytest.fixture(scope="module")
def module():
    return E.Module(SOURCE.read_text(), ["split_ranges", "live_lengths"], include_dirs=[KERNEL_DIR],
                    filename=str(SOURCE))


def split_ranges(module, cases):
    """cases: dicts of FIELDS -> the (begin, end) the header gives each."""
    table = np.array([[case[name] for name in FIELDS] for case in cases], np.int32)
    ranges = E.zeros((len(cases), 2), np.int32)
    module.get_function("split_ranges")((len(cases) + 63) // 64, 64,
                                        (E.asarray(table), np.int32(len(cases)), ranges))
    return [tuple(int(v) for v in row) for row in np.asarray(ranges)]


def tile_keys(case):
    """The keys the tile's queries attend, from the mask (a tile has at least one row)."""
    keys = set()
    rows = range(case["first_row"], case["first_row"] + max(case["tile_rows"], 1))
    for query in {row // case["group"] for row in rows}:
        position = case["length"] + query
        lowest = position - case["window"] + 1 if case["window"] > 0 else 0
        keys.update(range(max(lowest, 0), min(position + 1, case["max_seq"])))
    return sorted(keys)


def expected_split_keys(case):
    """The keys split `split` must read, as a list in increasing order."""
    keys = tile_keys(case)
    split, split_keys = case["split"], case["split_keys"]
    if split_keys > 0:
        return [j for j in keys if split * split_keys <= j < (split + 1) * split_keys]
    piece = 0
    while piece * case["num_splits"] < len(keys):
        piece += case["align"]
    return keys[split * piece:(split + 1) * piece]


def check(module, cases):
    """Each case's range from the header is the keys expected_split_keys gives it; returns the ranges."""
    ranges = split_ranges(module, cases)
    for case, (begin, end) in zip(cases, ranges):
        assert list(range(begin, end)) == expected_split_keys(case), (case, (begin, end))
    return ranges


def case_of(**fields):
    defaults = dict(length=0, first_row=0, tile_rows=TILE_ROWS, group=1, max_seq=1024, window=0, split=0,
                    num_splits=1, split_keys=0, align=CHUNK)
    return {**defaults, **fields}


def every_split(**fields):
    return [case_of(**fields, split=s) for s in range(fields["num_splits"])]


@pytest.mark.parametrize("keys, num_splits", [(512, 4), (513, 4), (511, 4), (129, 2), (1, 3), (384, 2), (1000, 7)])
def test_splits_are_equal_pieces_of_the_tile_aligned_to_the_chunk(module, keys, num_splits):
    # One query row at position keys - 1 attends keys 0..keys-1: 512 in 4 splits is 128 each, 513
    # needs pieces of 256 (the last two splits read 1 key and nothing).
    check(module, every_split(length=keys - 1, tile_rows=1, num_splits=num_splits))


@pytest.mark.parametrize("window", [1, 100, 128, 129, 300])
def test_a_windowed_tile_is_split_from_its_first_key(module, window):
    # Keys from length - window + 1: the pieces start there, not at 0, and not at a multiple of align.
    check(module, every_split(length=900, tile_rows=1, window=window, num_splits=3))
    check(module, every_split(length=900, first_row=32, tile_rows=TILE_ROWS, group=4, window=window,
                              num_splits=2, max_seq=2048))


@pytest.mark.parametrize("split_keys", [128, 256])
def test_fixed_splits_cut_at_multiples_of_split_keys(module, split_keys):
    check(module, every_split(length=700, tile_rows=TILE_ROWS, group=2, num_splits=8, split_keys=split_keys))
    check(module, every_split(length=700, tile_rows=1, window=200, num_splits=8, split_keys=split_keys))


def test_the_smallest_fixed_split_is_one_key(module):
    # split_keys 1 (align 1): split s reads key s alone, here keys 3..5 of a window of 3 at position 5;
    # equal pieces would have given keys 3, 4 and 5 to splits 0, 1 and 2 instead
    ranges = check(module, every_split(length=5, tile_rows=1, window=3, num_splits=6, split_keys=1, align=1))
    assert [end - begin for begin, end in ranges][3:] == [1, 1, 1]


def test_a_tile_ends_at_max_seq_and_a_window_past_it_reads_nothing(module):
    check(module, every_split(length=1020, tile_rows=TILE_ROWS, max_seq=1024, num_splits=2))
    check(module, every_split(length=1030, tile_rows=4, max_seq=1024, window=3, num_splits=2))
    check(module, every_split(length=1030, tile_rows=4, max_seq=1024, window=3, num_splits=4, split_keys=256))


@pytest.mark.parametrize("first_row", [4, 5])
def test_a_tile_of_no_rows_reads_the_keys_of_its_first_row(module, first_row):
    # Row 4 is the first of query 2 (group 2): a tile counted as rows 4..3 would end at query 1.
    check(module, every_split(length=300, first_row=first_row, tile_rows=0, group=2, num_splits=2))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_split_reads_its_share_of_the_keys_the_mask_allows(module, data):
    group = data.draw(st.sampled_from([1, 2, 4, 8]), label="group")
    q_len = data.draw(st.integers(1, 40), label="q_len")
    max_seq = data.draw(st.integers(1, 1200), label="max_seq")
    first_row = data.draw(st.integers(0, q_len * group - 1).map(lambda r: r - r % TILE_ROWS), label="first_row")
    fields = dict(length=data.draw(st.integers(0, max_seq), label="length"), first_row=first_row,
                  tile_rows=min(TILE_ROWS, q_len * group - first_row), group=group, max_seq=max_seq,
                  window=data.draw(st.sampled_from([0, 0, 1, 2, 127, 128, 129, 500]), label="window"),
                  align=data.draw(st.sampled_from([CHUNK, 16, 1]), label="align"))
    if data.draw(st.booleans(), label="fixed"):
        split_keys = data.draw(st.sampled_from([128, 256, 384]), label="split_keys")
        fields.update(split_keys=split_keys, num_splits=-(-max_seq // split_keys))
    else:
        fields.update(num_splits=data.draw(st.integers(1, 9), label="num_splits"))
    cases = every_split(**fields)
    ranges = check(module, cases)
    # Together the splits read every attended key once.
    assert [j for begin, end in ranges for j in range(begin, end)] == tile_keys(cases[0])


def test_live_length_clamps_the_stored_length_to_the_cache(module):
    stored = np.array([-5, -1, 0, 1, 511, 512, 513, 2**31 - 1, -2**31], np.int32)
    lengths = E.zeros(stored.size, np.int32)
    module.get_function("live_lengths")(1, 32, (E.asarray(stored), np.int32(stored.size), np.int32(512), lengths))
    np.testing.assert_array_equal(np.asarray(lengths), np.clip(stored, 0, 512))


@pytest.mark.parametrize("arch", nvrtc_check.ARCHS)
def test_same_source_compiles_with_nvrtc(arch):
    nvrtc = nvrtc_check.load_nvrtc()
    nvrtc_check.compile_file(nvrtc, SOURCE.name, SOURCE.read_text(), [], arch, include_dirs=(KERNEL_DIR,))
