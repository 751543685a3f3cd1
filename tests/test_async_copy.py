"""cp.async on the emulator (cupykv/kernels/async_copy.cuh): copies land at their wait, and
every way of depending on an unfinished copy fails loudly.

The kernels are tests/emulator_kernels/async_copy.cu, each with a switch between correct code and
a planted misuse. The semantics checked are the PTX ISA's ("cp.async", "cp.async.commit_group",
"cp.async.wait_group / cp.async.wait_all"): groups are per thread, wait_group N completes all
but the N most recent groups (empty groups count), wait_all commits first, src-size bytes are
read and the rest zero-filled. The same source compiles with NVRTC for sm_80 and sm_90 without
spills, so what runs here is what a GPU will run.
"""
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E
from cupykv.backends.emulator import build
from cupykv.backends.emulator.accounting import CopyWaits
from cupykv.kernels import KERNEL_DIR
from compile_refusals import assert_refused_by_both_compilers
from source_lines import source_site

KERNELS = Path(__file__).parent / "emulator_kernels"
SOURCE = KERNELS / "async_copy.cu"
HEADER = Path(KERNEL_DIR) / "async_copy.cuh"
NAMES = ["async_roundtrip<4>", "async_roundtrip<8>", "async_roundtrip<16>", "async_pipeline", "async_groups",
         "async_early_read", "async_early_byte", "async_past_the_end"]


line = functools.partial(source_site, SOURCE)   # 'async_copy.cu:LINE' of a needle


ISSUE = line("cp_async<BYTES>(dst, from_src, src_bytes);")   # the kernel line of the copy


@pytest.fixture(scope="module")
def module():
    return E.Module(SOURCE.read_text(), NAMES, include_dirs=[KERNELS, KERNEL_DIR], filename=str(SOURCE))


def roundtrip(module, nbytes, n, threads, mode):
    """Runs async_roundtrip<nbytes> on src = 1..n; returns (src, out)."""
    src = E.asarray(np.arange(1, n + 1, dtype=np.float32))
    out = E.zeros(threads * nbytes // 4, np.float32)
    module.get_function(f"async_roundtrip<{nbytes}>")(1, threads, (src, out, np.int32(n), np.int32(mode)))
    return src, out


def expected_roundtrip(src, nbytes, threads):
    """The model: the tile is src zero-filled past n; out is the tile shifted by one thread's piece."""
    width = threads * nbytes // 4
    tile = np.zeros(width, np.float32)
    tile[:src.size] = src
    return np.roll(tile, -(nbytes // 4))


def assert_still_works(module):
    src, out = roundtrip(module, 16, 30, 8, 0)
    np.testing.assert_array_equal(out, expected_roundtrip(src, 16, 8))


# ---- copies land at the wait, zero-filled past src_bytes ---------------------------------------
@pytest.mark.parametrize("nbytes", [4, 8, 16])
@pytest.mark.parametrize("n, threads", [(64, 16), (30, 8), (1, 32), (0, 4)])
def test_copies_land_at_the_wait_zero_filled_past_the_live_bytes(module, nbytes, n, threads):
    n = min(n, threads * nbytes // 4)
    src, out = roundtrip(module, nbytes, n, threads, 0)
    np.testing.assert_array_equal(out, expected_roundtrip(src, nbytes, threads))


def test_a_two_stage_pipeline_is_exact(module):
    threads, tiles = 64, 5
    width = threads * 4
    src = E.asarray(np.random.default_rng(0).standard_normal(tiles * width).astype(np.float32))
    out = E.zeros((tiles, threads), np.float32)
    module.get_function("async_pipeline")(1, threads, (src, out, np.int32(tiles), np.int32(0)),
                                          shared_mem=2 * width * 4)
    np.testing.assert_array_equal(out, 2 * src.reshape(tiles, width)[:, (4 * np.arange(threads) + 5) % width])


# ---- wait_group N: all but the N most recent groups, exactly ---------------------------------
def pending_after(n_groups, empty_mask, uncommitted, wait_n):
    """Slots whose copies are still pending after the wait: the PTX model, written out."""
    if wait_n < 0:                         # wait_all = commit_group; wait_group 0
        return set()
    pending = {g for g in range(n_groups) if g >= n_groups - wait_n and not empty_mask >> g & 1}
    if uncommitted:                        # never committed: no wait_group covers it
        pending.add(n_groups)
    return pending


@pytest.mark.parametrize("empty_mask", [0, 0b1000, 0b0010], ids=["no-empty", "newest-empty", "group1-empty"])
@pytest.mark.parametrize("uncommitted", [0, 1])
def test_wait_group_completes_all_but_the_n_most_recent_groups(module, empty_mask, uncommitted):
    n_groups, threads = 4, 32
    src = E.asarray(np.arange(1, 4 * (n_groups + 1) + 1, dtype=np.float32))
    fn = module.get_function("async_groups")
    for wait_n in (0, 1, 2, 3, -1):
        pending = pending_after(n_groups, empty_mask, uncommitted, wait_n)
        for probe in range(n_groups + 1):
            out = E.zeros(threads, np.float32)
            args = (src, out, np.int32(n_groups), np.int32(empty_mask), np.int32(uncommitted), np.int32(wait_n),
                    np.int32(probe))
            case = f"wait_n={wait_n} probe={probe}"
            if probe in pending:   # the message names the copy at the slot read, not its neighbour before it
                group = "not yet committed" if probe == n_groups else f"group {probe} of that thread"
                with pytest.raises(E.AsyncCopyError, match=r"touches bytes that an asynchronous copy still writes "
                                                           r"\(16-byte cp\.async issued by thread \(\d+,0,0\) at "
                                                           rf"[^)]*\)?, {group}\)"):
                    fn(1, threads, args, shared_mem=threads * (n_groups + 1) * 16)
                continue
            written = probe < n_groups and not empty_mask >> probe & 1 or probe == n_groups and uncommitted
            if not written:   # nothing was copied there: no thread of the block wrote those bytes
                with pytest.raises(E.UninitializedReadError, match=r"\(32 reads at 1 call site\)"):
                    fn(1, threads, args, shared_mem=threads * (n_groups + 1) * 16)
                continue
            fn(1, threads, args, shared_mem=threads * (n_groups + 1) * 16)
            assert (out == src[4 * probe]).all(), case


@pytest.mark.parametrize("empty_mask, uncommitted, wait_n, in_flight_per_thread", [
    (0, 0, 0, 0), (0, 0, 2, 32), (0b1000, 0, 2, 16), (0, 1, 0, 16), (0, 1, 3, 64), (0, 1, -1, None)])
def test_the_traffic_record_counts_each_wait_and_the_bytes_it_leaves_in_flight(module, empty_mask, uncommitted,
                                                                               wait_n, in_flight_per_thread):
    """Each thread's cp_async_wait<N> is one wait; it leaves in flight the copies of its N newest
    groups (empty ones hold none) and the uncommitted one. cp_async_wait_all() is not counted
    (None: the kernel waits only with it)."""
    n_groups, threads = 4, 32
    src = E.asarray(np.arange(1, 4 * (n_groups + 1) + 1, dtype=np.float32))
    with E.traffic() as t:
        module.get_function("async_groups")(1, threads, (src, E.zeros(threads, np.float32), np.int32(n_groups),
                                                         np.int32(empty_mask), np.int32(uncommitted),
                                                         np.int32(wait_n), np.int32(0)),
                                            shared_mem=threads * (n_groups + 1) * 16)
    (launch,) = t.launches
    if in_flight_per_thread is None:
        assert launch.copy_waits == CopyWaits(0, 0, 0)
    else:
        assert launch.copy_waits == CopyWaits(threads, threads if in_flight_per_thread else 0,
                                                threads * in_flight_per_thread)


# ---- every dependence on an unfinished copy fails, naming both call sites ---------------------
def test_reading_the_destination_before_the_wait_fails_naming_both_lines(module):
    with pytest.raises(E.AsyncCopyError) as caught:
        roundtrip(module, 16, 30, 8, 1)
    message = str(caught.value)
    assert message.startswith("kernel 'async_roundtrip<16>' block (0,0,0) thread (")
    assert "a read of 4 bytes of static __shared__ tile (in async_roundtrip<16>) byte offset " in message
    assert f" at {line('if (mode == 1) out[first] = tile[first];')} touches bytes that an asynchronous copy " \
           "still writes (16-byte cp.async issued by thread (" in message
    assert f"(inlined into {ISSUE}), group 0 of that thread)" in message
    assert f"{HEADER.name}:" in message
    assert_still_works(module)


@pytest.mark.parametrize("at", [0, 1, 15])
def test_each_byte_of_a_pending_copy_is_pending(module, at):
    src, out = E.asarray(np.arange(1, 5, dtype=np.float32)), E.zeros(1, np.int32)
    read_at = line("out[0] = bytes[at];")
    with pytest.raises(E.AsyncCopyError, match=rf"a read of 1 byte of static __shared__ bytes \(in async_early_byte\) "
                                               rf"byte offset {at} by thread \(0,0,0\) at {read_at} touches bytes"):
        module.get_function("async_early_byte")(1, 1, (src, out, np.int32(at)))
    assert_still_works(module)


def test_writing_the_destination_before_the_wait_fails(module):
    with pytest.raises(E.AsyncCopyError, match=f"a write to 4 bytes .* at {line('if (mode == 4) tile[first]')} "):
        roundtrip(module, 16, 30, 8, 4)
    assert_still_works(module)


def test_a_second_copy_into_pending_bytes_fails(module):
    with pytest.raises(E.AsyncCopyError) as caught:
        roundtrip(module, 16, 30, 8, 8)
    message = str(caught.value)
    assert "a cp.async into 16 bytes of static __shared__ tile" in message
    assert f"(inlined into {line('if (mode == 8) cp_async<BYTES>')})" in message
    assert f"(inlined into {ISSUE}), not yet committed)" in message
    # the launch ended inside the second copy's check; the next launch's early read is a read again
    with pytest.raises(E.AsyncCopyError, match="a read of 4 bytes of static __shared__ tile"):
        roundtrip(module, 16, 30, 8, 1)
    assert_still_works(module)


@pytest.mark.parametrize("block", [(4, 2, 1), (4, 1, 2)], ids=["2d", "3d"])
def test_a_copy_message_names_threads_of_any_block_shape(module, block):
    """Threads that differ only in y (or z) copy into the same bytes of async_roundtrip's tile, and
    each waits at the barrier before its wait (mode 11): the second one's copy meets the first
    one's, still pending, and the message names both threads by (x,y,z)."""
    src = E.asarray(np.arange(1, 17, dtype=np.float32))
    with pytest.raises(E.AsyncCopyError) as caught:
        module.get_function("async_roundtrip<16>")(1, block, (src, E.zeros(16, np.float32), np.int32(16),
                                                              np.int32(11)))
    message = str(caught.value)
    found = re.search(r"a cp\.async into 16 bytes .* by thread \((\d+),(\d+),(\d+)\) at .* issued by thread "
                      r"\((\d+),(\d+),(\d+)\) at ", message)
    assert found, message
    copier, issuer = tuple(map(int, found.groups()[:3])), tuple(map(int, found.groups()[3:]))
    assert copier[0] == issuer[0] and copier != issuer, message
    assert all(c < b and i < b for c, i, b in zip(copier, issuer, block)), message


def test_exiting_with_a_copy_in_flight_fails(module):
    with pytest.raises(E.AsyncCopyError, match=r"exits with 1 asynchronous copy not waited for \(the first issued "
                                               rf"at .*inlined into {ISSUE}\)"):
        roundtrip(module, 16, 30, 8, 9)


def test_another_threads_data_needs_a_barrier_after_the_wait(module):
    # Without the __syncthreads() thread t reads thread t + 1's piece: still in flight (AsyncCopyError)
    # or landed but unordered (RaceError), depending on the order the schedule runs the threads.
    with pytest.raises((E.AsyncCopyError, E.RaceError)) as caught:
        roundtrip(module, 16, 30, 8, 2)
    assert line("for (int k = 0; k < kFloats; ++k) out[first + k]") in str(caught.value)
    assert_still_works(module)


def test_a_barrier_before_the_wait_does_not_publish_the_copy(module, monkeypatch):
    # Index order: the thread that ends the barrier (the last) runs on first and waits, so its
    # copy lands before the others read it: not pending, but landed at its wait, after the
    # barrier, so each read is unordered with it. The barrier has to follow the wait.
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    with pytest.raises(E.RaceError) as caught:
        roundtrip(module, 16, 32, 8, 11)
    message = str(caught.value)
    # the landing is a store of the last thread at its wait; each other thread's read races with it
    assert line("cp_async_wait<0>();   // mode 11: the copy lands here, after the barrier") in message
    assert line("if (t != (int)blockDim.x - 1) out[first] = tile[(blockDim.x - 1) * kFloats];") in message
    assert "read-after-write" in message
    assert_still_works(module)


@pytest.mark.parametrize("mode, match", [
    (5, r"the destination \(static __shared__ tile \(in async_roundtrip<16>\) byte offset \d+\) is not aligned "
        r"to the copy size 16 bytes"),
    (6, r"src_bytes 20 is not in 0\.\.16"),
    (7, r"the destination \(argument 1 \(float32 array of shape \(32,\)\) element \d+ \(byte offset \d+\)\) is not "
        r"in shared memory"),
    (3, r"reads 16 bytes at argument 0 \(float32 array of shape \(30,\)\) element 28 \(byte offset 112\), 8 past "
        r"the end of the array"),
    (10, r"the source \(argument 0 \(float32 array of shape \(30,\)\) element \d+ \(byte offset \d+\)\) is not "
         r"aligned to the copy size 16 bytes"),
], ids=["misaligned", "src-bytes-too-large", "global-destination", "source-past-the-end", "misaligned-source"])
def test_operands_the_instruction_does_not_allow_fail(module, mode, match):
    with pytest.raises(E.AsyncCopyError, match=rf"cp\.async at {HEADER.name}:\d+ \(inlined into {ISSUE}\) by "
                                               rf"thread \(\d,0,0\): {match}"):
        roundtrip(module, 16, 30, 8, mode)
    assert_still_works(module)


@pytest.mark.parametrize("dynamic", [0, 1], ids=["static", "dynamic"])
def test_a_copy_running_past_the_end_of_shared_memory_fails(module, dynamic):
    src = E.asarray(np.arange(1, 5, dtype=np.float32))
    # dynamic shared memory ends at its 20 bytes: the copy's check at the issue stops it; a static
    # variable sits between guard bytes, where the access layer stops the write that runs past it
    error, match = (E.AsyncCopyError, r"cp\.async at .* the destination \([^)]*\)?\) runs past the end of shared "
                                      r"memory") if dynamic else \
        (E.EmulatorFault, r"out-of-bounds write of 16 bytes at static __shared__ five \(in async_past_the_end\) byte "
                          r"offset 16 \(running 12 bytes past the end of the variable's 20 bytes\)")
    with pytest.raises(error, match=match):
        module.get_function("async_past_the_end")(1, 1, (src, np.int32(dynamic)), shared_mem=20 if dynamic else 0)
    assert_still_works(module)


@pytest.mark.parametrize("call, message", [
    ("cupykv::cp_async<12>(tile, src, 12);", "cp.async copies 4, 8 or 16 bytes"),
    ("cupykv::cp_async<2>(tile, src, 2);", "cp.async copies 4, 8 or 16 bytes"),
    ("cupykv::cp_async_wait<-1>();", "cp.async.wait_group takes a count of groups left pending"),
], ids=["12-bytes", "2-bytes", "wait-minus-1"])
def test_a_size_or_count_the_instruction_has_no_form_for_fails_to_compile(call, message):
    # caught where the kernel is written, not when (or whether) a launch reaches the copy
    source = ("#include \"async_copy.cuh\"\n"
              "__global__ void misuse(const float* src) {\n"
              "    __shared__ __align__(16) float tile[4];\n"
              f"    {call}\n"
              "    cupykv::cp_async_wait_all();\n"
              "}\n")
    assert_refused_by_both_compilers(source, "misuse", message)


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_pipeline_bugs_fail(module, mode):
    """wait<2> leaves the tile being read in flight; no barrier after the wait, or before a stage
    is refilled, lets a thread read another's bytes unordered or still in flight."""
    threads, tiles = 64, 4
    src = E.asarray(np.zeros(tiles * threads * 4, np.float32))
    errors = E.AsyncCopyError if mode == 1 else (E.AsyncCopyError, E.RaceError)
    with pytest.raises(errors):
        module.get_function("async_pipeline")(1, threads, (src, E.zeros((tiles, threads), np.float32), np.int32(tiles),
                                                           np.int32(mode)), shared_mem=2 * threads * 16)


def test_checks_hold_with_the_race_checker_off(module, monkeypatch):
    """The pending-bytes check does not depend on the race checker: the first copy of a launch
    turns on the watching of shared memory itself."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    with pytest.raises(E.AsyncCopyError, match="a read of 4 bytes"):
        roundtrip(module, 16, 30, 8, 1)
    with pytest.raises(E.AsyncCopyError, match="8 past the end of the array"):
        roundtrip(module, 16, 30, 8, 3)
    assert_still_works(module)


@pytest.mark.parametrize("seed", ["0", "2", "3"])
def test_verdicts_do_not_depend_on_the_schedule(module, monkeypatch, seed):
    """Index order and two more seeded orders of blocks and threads: the same results, the same errors."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", seed)
    test_a_two_stage_pipeline_is_exact(module)
    test_wait_group_completes_all_but_the_n_most_recent_groups(module, 0b1000, 1)
    test_pipeline_bugs_fail(module, 1)
    test_reading_the_destination_before_the_wait_fails_naming_both_lines(module)


# ---- the source read is a load like any other ------------------------------------------------
def test_the_traffic_counter_sees_each_source_byte_once_in_full_sector_requests(module):
    threads, tiles = 64, 3
    src = E.asarray(np.zeros(tiles * threads * 4, np.float32))
    out = E.zeros((tiles, threads), np.float32)
    with E.traffic() as t:
        module.get_function("async_pipeline")(1, threads, (src, out, np.int32(tiles), np.int32(0)),
                                              shared_mem=2 * threads * 16)
    (launch,) = t.launches
    loads = launch.of(src).counts("load")
    assert loads.bytes == src.nbytes and loads.touched_bytes == src.nbytes
    assert loads.sectors == src.nbytes // 32
    assert loads.requests == tiles * threads // 32            # one request per warp and tile
    assert loads.sectors_per_request == 16.0                    # 32 lanes x 16 contiguous bytes
    assert launch.of(out).counts("store").bytes == out.nbytes


def test_a_source_read_out_of_bounds_faults_like_a_load(module):
    # 32 threads x 16 bytes from an 8-float array: thread 2 on reads the guard page (or past the end).
    src = E.asarray(np.ones(8, np.float32))
    with pytest.raises((E.EmulatorFault, E.AsyncCopyError), match="argument 0"):
        module.get_function("async_roundtrip<16>")(1, 32, (src, E.zeros(128, np.float32), np.int32(128), np.int32(0)))


def test_a_source_read_of_protected_bytes_is_reported_at_the_copy_line(module):
    # A copy whose source lies inside its array but on a protected page faults in the emulator's own
    # copy routine; the report names the kernel line of the cp.async, as for a plain load (it once
    # named an offset in the module instead).
    src = E.zeros(2048, np.float32)
    view = src[1024 - 64:]   # threads 16..31 read the second page of src
    with E.protected(src, 4096), pytest.raises(E.EmulatorFault) as caught:
        module.get_function("async_roundtrip<16>")(1, 32, (view, E.zeros(128, np.float32), np.int32(128), np.int32(0)))
    message = str(caught.value)
    found = re.search(r"thread \((\d+),0,0\): read of protected bytes of argument 0 at element (\d+) ", message)
    assert found and int(found.group(2)) == 4 * int(found.group(1)) >= 64, message   # whichever thread ran first
    assert re.search(rf" at async_copy.cuh:\d+ \(inlined into {ISSUE}\)", message), message
    assert_still_works(module)


# ---- the same source is real CUDA ----------------------------------------------------------------
@pytest.mark.parametrize("arch", nvrtc_check.ARCHS)
def test_the_kernels_compile_with_nvrtc_without_spills(arch):
    nvrtc = nvrtc_check.load_nvrtc()
    program = nvrtc_check.compile_program(nvrtc, SOURCE.name, SOURCE.read_text(), NAMES, arch,
                                          include_dirs=(str(KERNELS), KERNEL_DIR))
    reports = nvrtc_check.parse_ptxas_log(program.log, program.lowered, arch)
    assert {r.instance for r in reports} == set(NAMES)
    assert [r.instance for r in reports if r.spills] == []
    for instruction in ("cp.async.cg.shared.global", "cp.async.ca.shared.global", "cp.async.commit_group",
                        "cp.async.wait_group 1", "cp.async.wait_all"):
        assert instruction in program.ptx, instruction
    # Each copy as async_copy.cuh means it: the source converted from a 64-bit generic address, the
    # destination the 32-bit shared-window one (a 64-bit register there would be the generic pointer),
    # 16 bytes as .cg (past L1: K/V rows are read once), and 4 or 8 as .ca (.cg takes 16 bytes only).
    lines = [text.strip() for text in program.ptx.splitlines()]
    copies = [(before, text) for before, text in zip(lines, lines[1:]) if re.match(r"cp\.async\.c[ag]\.", text)]
    assert copies
    sizes = set()
    for before, text in copies:
        assert re.fullmatch(r"cvta\.to\.global\.u64 src_global, %rd\d+;", before), (before, text)
        found = re.fullmatch(r"cp\.async\.(ca|cg)\.shared\.global \[%r\d+\], \[src_global\], (\d+), %r\d+;", text)
        assert found, text
        assert (found.group(1) == "cg") == (found.group(2) == "16"), text
        sizes.add(int(found.group(2)))
    assert sizes == {4, 8, 16}


RAW_COPY = r"""
// The emulator's cp.async entry point called directly, past the header's static_assert on the size.
extern "C" __global__ void raw_cp_async(const float* src, unsigned bytes) {
  __shared__ __align__(16) float tile[4];
  cuemu_cp_async(tile, src, bytes, bytes);
  cuemu_cp_async_wait_all();
}
"""


@pytest.mark.parametrize("size", [2, 12, 32])
def test_the_runtime_refuses_a_copy_size_the_instruction_has_no_form_for(module, size):
    """The header refuses such sizes at compile time (above); a kernel that reaches the runtime's own
    entry point directly is refused at the issue too, by size."""
    raw = E.Module(RAW_COPY, ["raw_cp_async"])
    src = E.asarray(np.arange(8, dtype=np.float32))
    with pytest.raises(E.AsyncCopyError, match=rf"cp\.async at .* by thread \(0,0,0\): copy size {size} \(cp\.async "
                                               r"copies 4, 8 or 16 bytes\)"):
        raw.get_function("raw_cp_async")(1, 1, (src, np.uint32(size)))
    raw.get_function("raw_cp_async")(1, 1, (src, np.uint32(16)))   # the same call at a size it has
    assert_still_works(module)


@pytest.mark.parametrize("poison", [0x41, 0xFF])
def test_an_uninstrumented_module_reads_the_launchs_poison_before_the_wait(module, monkeypatch, poison):
    """Without instrumentation (no shadow memory) an early read cannot be seen: it reads the poison
    the copy's destination holds until the wait, the launch's byte (CUPYKV_EMULATOR_POISON), and the
    data lands at the wait. The instrumented build of the same kernel stops at the read."""
    monkeypatch.setenv(E.memory.POISON_ENV, str(poison))
    src, out = E.asarray(np.arange(1, 5, dtype=np.float32)), E.zeros(8)
    with pytest.raises(E.AsyncCopyError, match=line("for (int k = 0; k < 4; ++k) out[k] = tile[k];")):
        module.get_function("async_early_read")(1, 1, (src, out))
    monkeypatch.setattr(build, "instrumented", lambda: False)
    plain = E.Module(SOURCE.read_text(), ["async_early_read"], include_dirs=[KERNELS, KERNEL_DIR],
                     filename=str(SOURCE))
    assert not plain.instrumented
    plain.get_function("async_early_read")(1, 1, (src, out))
    got = E.asnumpy(out)
    assert (got[:4].view(np.uint32) == poison * 0x01010101).all(), got[:4].view(np.uint32)
    np.testing.assert_array_equal(got[4:], [1, 2, 3, 4])
