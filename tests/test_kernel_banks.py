"""Shared-memory bank conflicts of cupykv's kernels, counted on the emulator (CPU-measured).

The bank counter (cupykv/backends/emulator/banks.cpp, checked on known patterns in
tests/test_banks.py) names every call site whose warp requests take more wavefronts than they
need. The design of each kernel says which accesses are conflict-free; these tests hold the
kernels to it exactly: the set of conflicting sites must be the documented one, no more (a padding
lost, a stride changed) and no less (a documented trade-off that no longer holds is a stale doc).

The documented conflicts (docs/performance.md, "Shared-memory banks"):
- ``row marks``: attention_mma's one-time zeroing of the rows' NaN marks, 16 to 64 words a block.
- ``stage copies``: cp.async writes of the K/V stages where the stage row stride serves the
  fragment reads instead: 16-bit caches at head_dim 96 (208-byte rows) and fp8 caches at 64 and 96
  (80- and 112-byte rows). A stride that made both conflict-free does not exist for these sizes
  (the reads need rows an odd number of 16-byte units apart, the writes an even one).
- ``q pieces``: at head_dim 96 the q pieces' stores, once per block, for the same reason.
- ``partial sums``: linear_mma's split-k reduction reads at 8 or more live rows (2-way), once per
  row tile of 16 outputs, beside a weight loop that reads global memory only.
"""

import re
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv import attention_plan, ops, testing
from cupykv.backends import get_backend
from cupykv.kernels import KERNEL_DIR
from source_lines import line_number

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def source_line(filename, text):
    """The line number in ``filename`` (in cupykv/kernels) of the only line that holds ``text``."""
    return line_number(Path(KERNEL_DIR) / filename, text)


def site_class(site, filename, named_lines):
    """A shared-memory site as a documented class ("stage copies", or the name of a line in
    ``named_lines``), else as ``filename:line``."""
    if site.startswith("async_copy.cuh"):
        return "stage copies"
    lines = [int(n) for n in re.findall(re.escape(filename) + r":(\d+)", site)]
    line = lines[-1] if lines else None
    return named_lines.get(line, f"{filename}:{line}" if line else site)


def conflicted(launch, filename, named_lines):
    return {site_class(s.site, filename, named_lines) for s in launch.bank_conflicts()}


def attention_launch(dtype, head_dim, group, q_len, length=93, num_splits=None, batch=1):
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=head_dim, max_seq=512, batch=batch, dtype=dtype)
    cache = cupykv.KVCache(spec, backend="emulator")
    cache.advance(length)
    backend = cache._backend
    io = "bfloat16" if dtype == "float8_e4m3" else dtype
    q = backend.asarray(np.random.default_rng(0).standard_normal((batch, q_len, 2 * group, head_dim))
                        .astype(np.float32)).astype(backend.storage_dtype(io))
    options = {} if num_splits is None else {"num_splits": num_splits}
    with testing.traffic(cache, banks=True) as t:
        cupykv.attention(q, cache, 0, **options)
    launches = [launch for launch in t.launches if launch.kernel.startswith("cupykv_attention")]
    assert len(launches) == 1, t.report()
    return launches[0]


def mma_named_lines():
    return {source_line("attention_mma.cu", "row_mark(r) = 0;"): "row marks",
            source_line("attention_mma.cu", "* kRow + lo_column] = lo_piece;"): "q pieces",
            source_line("attention_mma.cu", "* kRow + hi_column] = hi_piece;"): "q pieces",
            source_line("attention_mma.cu", "make_float2(acc[t][n8][2 * half] * unscale"): "accumulator stores"}


# (dtype, head_dim, group, q_len): 1, 2 and 4 row tiles, every head_dim, 16-bit and fp8 caches
MMA_CASES = [("bfloat16", 64, 4, 1), ("float16", 96, 4, 1), ("bfloat16", 128, 4, 1), ("float16", 256, 4, 1),
             ("bfloat16", 128, 8, 4), ("bfloat16", 64, 8, 8), ("float16", 256, 8, 4),
             ("float8_e4m3", 64, 4, 1), ("float8_e4m3", 96, 4, 1), ("float8_e4m3", 128, 4, 1),
             ("float8_e4m3", 256, 4, 1), ("float8_e4m3", 128, 8, 8)]


def documented_mma_conflicts(dtype, head_dim):
    documented = {"row marks"}
    if head_dim == 96 and dtype != "float8_e4m3":
        documented |= {"stage copies", "q pieces"}
    if dtype == "float8_e4m3" and head_dim in (64, 96):
        documented |= {"stage copies"}
    return documented


@pytest.mark.parametrize("dtype, head_dim, group, q_len", MMA_CASES)
def test_tensor_core_attention_conflicts_only_where_documented(dtype, head_dim, group, q_len):
    launch = attention_launch(dtype, head_dim, group, q_len)
    named = mma_named_lines()
    assert conflicted(launch, "attention_mma.cu", named) == documented_mma_conflicts(dtype, head_dim), launch.report()
    by_class = {}
    for s in launch.shared_sites:
        c = site_class(s.site, "attention_mma.cu", named)
        requests, wavefronts, ideal = by_class.get(c, (0, 0, 0))
        by_class[c] = (requests + s.requests, wavefronts + s.wavefronts, ideal + s.ideal)
    # the accumulators go out once per warp row pair, 8 bytes a lane, conflict-free (they took 4 wavefronts a
    # request where the row stride was head_dim floats)
    requests, wavefronts, ideal = by_class["accumulator stores"]
    assert requests > 0 and wavefronts == ideal == 2 * requests, launch.report()
    # the documented trade-offs stay what the docs say: 2-way at most in the copies, 4-way in the marks
    for c, (requests, wavefronts, ideal) in by_class.items():
        limit = {"row marks": 4, "stage copies": 2, "q pieces": 4 / 3}.get(c, 1)
        assert wavefronts <= limit * ideal, (c, launch.report())


@pytest.mark.parametrize("head_dim, group, q_len", [(32, 4, 1), (64, 4, 1), (128, 8, 2), (256, 4, 1)])
def test_float32_attention_is_free_of_bank_conflicts(head_dim, group, q_len):
    """The stage rows are head_dim + 4 floats, so a quarter-warp's 16-byte key reads hit 32 banks; the
    P.V reads take consecutive words of one row; q is a broadcast."""
    launch = attention_launch("float32", head_dim, group, q_len)
    assert launch.bank_conflicts() == [], launch.report()
    requests, wavefronts, ideal = launch.shared_total("load")
    assert requests > 0 and wavefronts == ideal


# (dtype, head_dim, group, q_len): the CUDA-core kernel (attention.cu), the staged float32 kernel at its own
# sizes and padded, the tensor-core kernel at one, two and four tiles, padded, and for fp8 caches
EXTENT_CASES = [("float32", 18, 2, 1), ("bfloat16", 12, 4, 1), ("float8_e4m3", 24, 4, 1),
                ("float32", 32, 4, 1), ("float32", 100, 4, 1), ("float32", 256, 4, 1),
                ("float16", 96, 4, 1), ("bfloat16", 40, 4, 1), ("bfloat16", 128, 8, 4), ("bfloat16", 64, 8, 8),
                ("float16", 256, 8, 4), ("float8_e4m3", 96, 4, 1), ("float8_e4m3", 128, 8, 8)]


@pytest.mark.parametrize("dtype, head_dim, group, q_len", EXTENT_CASES)
def test_declared_shared_memory_is_what_the_kernel_reaches(dtype, head_dim, group, q_len):
    """The dynamic shared memory a plan declares (attention_plan's sizes, mirrored from each kernel's
    layout) is the memory the kernel's accesses reach, to the byte: more would cost blocks per SM on a
    GPU and go unseen on the emulator, less is an out-of-bounds access the emulator reports. The one
    allowance is the tensor-core kernel's last stage row padding (16 bytes: 8 elements of 16-bit, 16
    codes of fp8), which no access touches, where the stages end the layout. 300 keys give every key
    warp steps enough to fill all its stages."""
    launch = attention_launch(dtype, head_dim, group, q_len, length=300)
    tiling = attention_plan.MMA_TILING
    unread_tail = (0, tiling["kRowPadFp8"] if dtype == "float8_e4m3" else 2 * tiling["kRowPad"])
    unused = launch.shared_mem - launch.shared_extent()
    assert launch.shared_extent() > 0 and unused in (unread_tail if "_mma<" in launch.kernel else (0,)), \
        (launch.kernel, launch.shared_mem, launch.shared_extent())


def test_split_kv_attention_conflicts_as_one_split_does():
    launch = attention_launch("bfloat16", 128, 4, 1, length=300, num_splits=3)
    assert launch.grid[1] == 3
    assert conflicted(launch, "attention_mma.cu", mma_named_lines()) == {"row marks"}, launch.report()


@pytest.mark.parametrize("dtype, rows", [("bfloat16", 1), ("bfloat16", 8), ("float16", 16), ("float32", 1),
                                         ("float32", 8)])
def test_linear_conflicts_only_in_the_split_k_sums_of_many_rows(dtype, rows):
    backend = get_backend("emulator")
    x = backend.asarray(np.ones((rows, 512), np.float32)).astype(backend.storage_dtype(dtype))
    weight = backend.asarray(np.ones((64, 512), np.float32)).astype(backend.storage_dtype(dtype))
    with testing.traffic("emulator", banks=True) as t:
        ops.linear(x, weight)
    (launch,) = t.launches
    if dtype == "float32":
        assert launch.kernel.startswith("cupykv_linear<") and launch.bank_conflicts() == [], launch.report()
        return
    assert launch.kernel.startswith("cupykv_linear_mma<")
    sums = {source_line("linear_mma.cu", "float sum = partial[warp][r][2 * t + c];"): "partial sums",
            source_line("linear_mma.cu", "sum += partial[warp + h][r][2 * t + c];"): "partial sums"}
    assert conflicted(launch, "linear_mma.cu", sums) == ({"partial sums"} if rows >= 8 else set()), launch.report()
    assert all(s.wavefronts <= 2 * s.ideal for s in launch.shared_sites), launch.report()


_DOC_ROW = re.compile(r"^\| (bf16|half|fp8 \(bf16 io\)|float32), (\d+), (\d+), (\d+)[^|]* \| (\d+) \| (\d+) \| "
                      r"(\d+) \| (\d+) \| ([\d.]+) \|$", re.M)
_DOC_DTYPES = {"bf16": "bfloat16", "half": "float16", "fp8 (bf16 io)": "float8_e4m3", "float32": "float32"}


def test_the_documented_bank_table_is_the_count():
    """docs/performance.md's "Shared-memory banks" table: requests, wavefronts and ideal of one decode
    launch (301 live rows, batch 2) as the counter gives them now, exactly (the unpadded column is the
    count before the accumulator padding, kept for the record)."""
    doc = (Path(__file__).parents[1] / "docs" / "performance.md").read_text()
    section = doc.split("## Shared-memory banks", 1)[1].split("\n## ", 1)[0]
    rows = _DOC_ROW.findall(section)
    assert len(rows) == 9, "the bank table of docs/performance.md lost rows, or its format changed"
    for name, head_dim, group, q_len, requests, unpadded, wavefronts, ideal, ratio in rows:
        launch = attention_launch(_DOC_DTYPES[name], int(head_dim), int(group), int(q_len), length=300, batch=2)
        assert launch.shared_total() == (int(requests), int(wavefronts), int(ideal)), (name, head_dim, launch.report())
        assert f"{int(wavefronts) / int(ideal):.3f}" == ratio and int(unpadded) >= int(wavefronts)


@pytest.mark.parametrize("op", ["rmsnorm", "argmax"])
def test_reductions_are_free_of_bank_conflicts(op):
    backend = get_backend("emulator")
    with testing.traffic("emulator", banks=True) as t:
        if op == "rmsnorm":
            ops.rmsnorm(backend.zeros((3, 512), np.float32), backend.zeros((512,), np.float32), 1e-6)
        else:
            ops.argmax(backend.zeros((3, 1000), np.float32))
    (launch,) = t.launches
    assert launch.shared_total()[0] > 0 and launch.bank_conflicts() == [], launch.report()
