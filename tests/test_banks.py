"""The emulator's shared-memory bank counter, on kernels whose wavefronts are known.

The counter (cupykv/backends/emulator/banks.cpp) groups a warp's shared-memory accesses into
requests, as the traffic counter groups global ones, and counts the wavefronts each request takes
under 32 banks of 4-byte words: 4-byte accesses in one phase of 32 lanes, 8-byte ones in two of
16, 16-byte ones (vectors, ldmatrix rows, cp.async destinations) in four of 8. The kernels are in
tests/emulator_kernels/banks.cu; each test states the wavefronts a GPU takes for its pattern. The
decode kernels' own figures are held in tests/test_kernel_banks.py.
"""

from pathlib import Path

import numpy as np
import pytest

from cupykv.backends import emulator as E
from cupykv import nvrtc_check
from cupykv.kernels import KERNEL_DIR
from source_lines import source_site

KERNELS_DIR = Path(__file__).parent / "emulator_kernels"
SOURCE = KERNELS_DIR / "banks.cu"
NAMES = ["strided_words", "strided_pairs", "strided_vectors", "ldmatrix_rows", "async_stage", "vector_components",
         "adjacent_words", "quarter_warp_columns", "scalar_quads", "shared_atomics", "shared_copy",
         "stores_split_by_a_barrier", "static_strided_words"]


@pytest.fixture(scope="module")
def kernels():
    return E.Module(SOURCE.read_text(), NAMES, include_dirs=[KERNELS_DIR, KERNEL_DIR], filename=str(SOURCE))


def shared_sites(t, kind):
    """The launch's SharedSite records of ``kind`` (exactly one launch in the block)."""
    assert len(t.launches) == 1, t.report()
    return [s for s in t.launches[0].shared_sites if s.kind == kind]


def sites_by_line(t, kind):
    """:func:`shared_sites` of ``kind``, in the order of their source lines."""
    return sorted(shared_sites(t, kind), key=lambda s: int(s.site.split(":")[1]))


def figures(site):
    """A SharedSite's counts: (accesses, bytes, requests, wavefronts, ideal)."""
    return site.accesses, site.bytes, site.requests, site.wavefronts, site.ideal


def one_site(t, kind):
    found = shared_sites(t, kind)
    assert len(found) == 1, t.report()
    return found[0]


@pytest.mark.parametrize("stride, wavefronts", [(0, 1), (1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 32),
                                                (33, 1), (3, 1)])
def test_4_byte_words_take_the_most_words_of_one_bank(kernels, stride, wavefronts):
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("strided_words")(1, 32, (out, np.int32(stride)), shared_mem=4 * (32 * stride + 1))
    for kind in ("store", "load"):
        site = one_site(t, kind)
        assert (site.requests, site.wavefronts, site.ideal) == (1, wavefronts, 1), t.report()
        assert (site.accesses, site.bytes, site.memory) == (32, 128, "dynamic")
        assert site.site.startswith("banks.cu:"), site.site
        assert site.extent == 4 * (31 * stride + 1), t.report()   # lane 31's word, its last byte + 1
    assert t.launches[0].shared_total() == (2, 2 * wavefronts, 2)
    # what the accesses reached, not the 4 * (32 * stride + 1) bytes declared; no static memory used
    assert (t.launches[0].shared_extent(), t.launches[0].shared_extent("static")) == (4 * (31 * stride + 1), 0)
    assert sorted(s.kind for s in t.launches[0].bank_conflicts()) == ([] if wavefronts == 1 else ["load", "store"])
    np.testing.assert_array_equal(out, np.arange(32, dtype=np.float32) * (stride > 0))


@pytest.mark.parametrize("kernel, size, stride, wavefronts", [
    ("strided_pairs", 8, 1, 2), ("strided_pairs", 8, 2, 4), ("strided_pairs", 8, 8, 16),
    ("strided_vectors", 16, 1, 4), ("strided_vectors", 16, 2, 8), ("strided_vectors", 16, 8, 32)])
def test_8_byte_accesses_are_two_phases_of_16_lanes_and_16_byte_ones_four_of_8(kernels, kernel, size, stride,
                                                                               wavefronts):
    phases = size // 4
    out = E.zeros((32, size // 4), np.uint32)
    with E.traffic(banks=True) as t:
        kernels.get_function(kernel)(1, 32, (out, np.int32(stride)), shared_mem=size * 32 * stride)
    site = one_site(t, "load")
    assert (site.requests, site.wavefronts, site.ideal, site.bytes) == (1, wavefronts, phases, 32 * size), t.report()
    assert site.conflict_ratio == wavefronts / phases


def test_the_phases_of_16_byte_accesses_are_quarter_warps(kernels):
    out = E.zeros((32, 4), np.uint32)
    with E.traffic(banks=True) as t:
        kernels.get_function("quarter_warp_columns")(1, 32, (out,), shared_mem=16 * 64)
    for kind in ("store", "load"):
        site = one_site(t, kind)
        assert (site.requests, site.wavefronts, site.ideal) == (1, 32, 4), t.report()
    np.testing.assert_array_equal(out[:, 0], np.arange(32))


@pytest.mark.parametrize("row_stride, wavefronts", [(64, 32), (72, 4), (24, 4), (16, 8)])
def test_ldmatrix_takes_a_phase_per_matrix(kernels, row_stride, wavefronts):
    """Rows 128 bytes apart all sit in four banks (8-way in each matrix); 144 or 48 apart, no two
    rows of a matrix share a bank; 32 apart (a dense 16-column tile), rows r and r + 4 do (2-way)."""
    out = E.zeros(128, np.uint32)
    with E.traffic(banks=True) as t:
        kernels.get_function("ldmatrix_rows")(1, 32, (out, np.int32(row_stride)), shared_mem=2 * 16 * row_stride)
    site = one_site(t, "load")
    assert "mma.cuh" in site.site and "banks.cu" in site.site, site.site   # the kernel's line is named
    assert (site.requests, site.accesses, site.wavefronts, site.ideal) == (1, 32, wavefronts, 4), t.report()


@pytest.mark.parametrize("stride, wavefronts", [(1, 4), (8, 32)])
def test_a_cp_async_destination_counts_at_its_issue_only(kernels, stride, wavefronts):
    src, out = E.asarray(np.arange(128, dtype=np.uint32).reshape(32, 4)), E.zeros((32, 4), np.uint32)
    with E.traffic(banks=True) as t:
        kernels.get_function("async_stage")(1, 32, (src, out, np.int32(stride)), shared_mem=16 * 32 * stride)
    stores = shared_sites(t, "store")
    assert len(stores) == 1 and "async_copy.cuh" in stores[0].site, t.report()
    assert (stores[0].requests, stores[0].wavefronts, stores[0].ideal) == (1, wavefronts, 4)
    assert one_site(t, "load").wavefronts == wavefronts
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize("stride, wavefronts", [(1, 4), (8, 32)])
def test_a_float4_read_by_components_counts_as_one_16_byte_access(kernels, stride, wavefronts):
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("vector_components")(1, 32, (out, np.int32(stride)), shared_mem=16 * 32 * stride)
    for kind in ("store", "load"):
        site = one_site(t, kind)
        assert figures(site) == (32, 512, 1, wavefronts, 4), t.report()
    np.testing.assert_array_equal(out, np.arange(32) + 6.0)


@pytest.mark.parametrize("first, accesses, requests, wavefronts, ideal", [(0, 32, 1, 2, 2), (1, 64, 2, 4, 2)])
def test_adjacent_words_join_only_into_an_aligned_piece(kernels, first, accesses, requests, wavefronts, ideal):
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("adjacent_words")(1, 32, (out, np.int32(first)), shared_mem=4 * 66)
    loads = shared_sites(t, "load")
    assert len(loads) == 1, t.report()   # both loads are one source line
    assert figures(loads[0]) == (accesses, 256, requests, wavefronts, ideal), t.report()
    np.testing.assert_array_equal(out, 4 * np.arange(32) + 2 * first + 1.0)


@pytest.mark.parametrize("stride, first, wavefronts, ideal", [(1, 0, 4, 4), (8, 0, 32, 4), (1, 2, 8, 4)])
def test_four_scalar_stores_over_an_aligned_piece_count_as_one_vector_store(kernels, stride, first, wavefronts,
                                                                             ideal):
    """A quad of 4-byte stores on one aligned 16-byte piece is one 16-byte store at the first
    store's line (four phases of 8 lanes); shifted by two words it is two 8-byte stores, each two
    phases of 16 lanes where lanes l and l + 8 meet in a bank (2 wavefronts a phase)."""
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("scalar_quads")(1, 32, (out, np.int32(stride), np.int32(first)),
                                             shared_mem=4 * (4 * (31 * stride + 1) + first))
    stores = sites_by_line(t, "store")
    lines = ["the quad's first store"] if first == 0 else ["the quad's first store", "the third store"]
    assert [s.site for s in stores] == [source_site(SOURCE, line) for line in lines], t.report()
    pieces = len(lines)
    for site in stores:
        assert figures(site) == (32, 512 // pieces, 1, wavefronts // pieces, ideal // pieces), t.report()
    load = one_site(t, "load")   # the loads are one line
    assert figures(load) == (32 * pieces, 512, pieces, wavefronts, ideal), t.report()
    np.testing.assert_array_equal(out, 10.0 * np.arange(32))


def test_adjacent_atomics_are_their_own_kind_and_never_join(kernels):
    """Two atomics of adjacent words by each lane: two atomic requests of 4-byte words, not a store
    and not one 8-byte access, while the adjacent stores and loads around them join into 8 bytes."""
    out = E.zeros(32, np.int32)
    with E.traffic(banks=True) as t:
        kernels.get_function("shared_atomics")(1, 32, (out,), shared_mem=4 * 64)
    atomics = sites_by_line(t, "atomic")
    assert [s.site for s in atomics] == [source_site(SOURCE, "the even word's atomic"),
                                         source_site(SOURCE, "the odd word's atomic")], t.report()
    for site in atomics:
        assert figures(site) == (32, 128, 1, 2, 1), t.report()
    for kind in ("store", "load"):
        site = one_site(t, kind)
        assert figures(site) == (32, 256, 1, 2, 2), t.report()
    np.testing.assert_array_equal(out, np.full(32, 3))


@pytest.mark.parametrize("block_barrier", [0, 1], ids=["__syncwarp", "__syncthreads"])
def test_adjacent_stores_on_either_side_of_a_barrier_never_join(kernels, block_barrier):
    """A store before a barrier is counted in its own request: the word after the barrier that
    continues it is another 4-byte store request (2 wavefronts each, lanes l and l + 16 meeting in a
    bank), not half of one 8-byte store."""
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("stores_split_by_a_barrier")(1, 32, (out, np.int32(block_barrier)),
                                                          shared_mem=4 * 64)
    stores = sites_by_line(t, "store")
    assert [s.site for s in stores] == [source_site(SOURCE, "the store before the barrier"),
                                        source_site(SOURCE, "the store after the barrier")], t.report()
    for site in stores:
        assert figures(site) == (32, 128, 1, 2, 1), t.report()
    load = one_site(t, "load")
    assert figures(load) == (32, 256, 1, 2, 2), t.report()
    np.testing.assert_array_equal(out, 3.0 * np.arange(32))


def test_a_copy_within_shared_memory_counts_its_load_and_its_store_apart(kernels):
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("shared_copy")(1, 32, (out, np.int32(4)), shared_mem=4 * 64)
    copy = source_site(SOURCE, "the shared-to-shared copy")
    for kind in ("load", "store"):
        site = [s for s in shared_sites(t, kind) if s.site == copy]
        assert len(site) == 1, t.report()
        assert figures(site[0]) == (32, 128, 1, 1, 1), t.report()
    np.testing.assert_array_equal(out, np.arange(32, dtype=np.float32))


@pytest.mark.parametrize("kernel, shared_mem", [("strided_words", 4 * 65), ("static_strided_words", 0)],
                         ids=["dynamic", "static"])
def test_banks_are_counted_with_the_race_checker_off(kernels, monkeypatch, kernel, shared_mem):
    """The bank counter watches shared memory itself, dynamic and static: it does not lean on the
    race checker."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    out = E.zeros(32, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function(kernel)(1, 32, (out, np.int32(2)), shared_mem=shared_mem)
    assert t.launches[0].shared_total() == (2, 4, 2), t.report()
    np.testing.assert_array_equal(out, np.arange(32, dtype=np.float32))


def test_requests_split_at_warps_and_repeat_per_block(kernels):
    """Two warps and three blocks: six requests of each kind, each conflict-free at stride 1."""
    out = E.zeros(64, np.float32)
    with E.traffic(banks=True) as t:
        kernels.get_function("strided_words")(3, 64, (out, np.int32(1)), shared_mem=4 * 65)
    assert one_site(t, "load").requests == 6 and t.launches[0].shared_total("load") == (6, 6, 6)


def test_banks_are_counted_only_when_asked(kernels):
    out = E.zeros(32, np.float32)
    with E.traffic() as plain:
        with E.traffic(banks=True) as counted:
            kernels.get_function("strided_words")(1, 32, (out, np.int32(2)), shared_mem=4 * 65)
    assert plain.launches[0].shared_sites == () and plain.launches[0].shared_total() == (0, 0, 0)
    assert counted.launches[0].shared_total() == (2, 4, 2)
    with E.traffic() as plain:
        kernels.get_function("strided_words")(1, 32, (out, np.int32(2)), shared_mem=4 * 65)
    assert plain.launches[0].shared_sites == ()
    assert "shared memory" in counted.report() and "shared memory" not in plain.report()


@pytest.mark.parametrize("arch", nvrtc_check.ARCHS)
def test_the_same_source_compiles_with_nvrtc(arch):
    nvrtc = nvrtc_check.load_nvrtc()
    program = nvrtc_check.compile_program(nvrtc, SOURCE.name, SOURCE.read_text(), NAMES, arch,
                                          include_dirs=(str(KERNELS_DIR), KERNEL_DIR))
    reports = nvrtc_check.parse_ptxas_log(program.log, program.lowered, arch)
    assert {r.instance for r in reports} == set(NAMES)
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in program.ptx and "cp.async.cg.shared.global" in program.ptx
