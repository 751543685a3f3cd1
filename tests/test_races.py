"""The emulator's race checker and synchronisation checks on planted bugs.

Every planted bug must be caught with a report that names the kernel, both threads, both
source lines and the memory offset; the same code without the bug must pass. The planted
kernels are tests/emulator_kernels/races.cu (each with a switch between the bug and the
correct code) and patched copies of the real attention and rmsnorm kernels, built at test
time with one ``__syncthreads()`` removed. The unmodified kernels are checked by the whole
suite, which runs with the race checker on.
"""

import os
import re
from pathlib import Path

import numpy as np
import pytest

import cupykv
from cupykv import ops
from cupykv.backends import emulator as E
from cupykv.backends.emulator import build, sites
from cupykv.backends.emulator_backend import EmulatorBackend
from cupykv.kernels import ATTENTION_HEAD_DIMS, KERNEL_DIR, KERNELS
from process_memory import mapped_bytes
from source_lines import source_site

RACES = Path(__file__).parent / "emulator_kernels" / "races.cu"
RACE_NAMES = ["warp_exchange", "blocks_share_output", "set_flag", "atomic_count", "publish_total",
              "shuffle_mask_misses_callers", "shuffle_masks_differ", "syncwarp_mask_misses_caller",
              "half_warp_exchange", "sync_chain", "last_block_sums", "overwrite_after_reads",
              "clear_while_counting", "hand_off_to_some_blocks", "relayed_hand_off", "warp_hand_off",
              "two_races_one_array", "byte_races", "read_then_flag_set_twice", "store_one_word",
              "reread_then_write", "copy_64_bytes", "halves_then_word", "late_warps_read_then_write",
              "wide_read_then_overwrite", "first_byte_and_last_word", "word_then_wider_store",
              "byte_then_halfword"]


def load_races():
    """races.cu's kernels, built (or taken from the cache) as one module."""
    return E.Module(RACES.read_text(), RACE_NAMES, filename=str(RACES))


@pytest.fixture(scope="module")
def races():
    return load_races()


def only_hazard(error):
    """The single hazard group of a RaceError (asserting there is exactly one)."""
    assert len(error.hazards) == 1, str(error)
    return error.hazards[0]


def hazards_between(error, line_a, line_b):
    """The hazard groups of a RaceError, asserting each is between the two source lines.

    Which of the two lines runs first in the emulator depends on the schedule, so a planted
    race shows as read-after-write, write-after-read, or both.
    """
    assert error.hazards, str(error)
    for hazard in error.hazards:
        assert {hazard.first.site, hazard.second.site} == {line_a, line_b}, str(error)
        assert_names_threads(str(error), hazard)
    return error.hazards


def assert_names_threads(message, hazard):
    """The message shows both accesses: kind, source line, block and thread."""
    for access in (hazard.first, hazard.second):
        b, t = access.block, access.thread
        assert (f"{access.kind:<6} at {access.site} by block ({b[0]},{b[1]},{b[2]}) "
                f"thread ({t[0]},{t[1]},{t[2]})") in message


# ---- the checker's own memory -----------------------------------------------------------
def test_each_launch_unmaps_the_shadows_of_its_written_arguments(races, monkeypatch):
    """A written argument's shadow (48 bytes of records per byte, 240 MiB of address space for a
    4 MiB array, mostly never touched) is mapped for its launch only: ten more launches leave the
    address space less than one shadow larger."""
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "1")
    out = E.zeros(2**20, np.float32)
    launch = lambda: races.get_function("blocks_share_output")(4, 32, (out, np.int32(1)))  # noqa: E731
    launch()   # the shadows of shared memory, reused by every launch, are mapped by now
    before = mapped_bytes()
    for _ in range(10):
        launch()
    assert mapped_bytes() - before < 48 * out.nbytes
    np.testing.assert_array_equal(out[:5], [1, 2, 3, 4, 0])


# ---- shared memory ----------------------------------------------------------------------
def test_missing_syncwarp_in_a_warp_exchange_is_reported(races):
    fn = races.get_function("warp_exchange")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 64, (E.zeros(64, np.int32), np.int32(0)))
    message = str(caught.value)
    assert message.startswith("kernel 'warp_exchange': data race in shared memory")
    found = hazards_between(caught.value, source_site(RACES, "slots[tid] = 10 * tid;"),
                            source_site(RACES, "out[tid] = slots[tid ^ 1];"))
    for hazard in found:
        assert hazard.memory == "shared" and hazard.kind in ("read-after-write", "write-after-read")
        assert hazard.where == "static __shared__ slots (in warp_exchange)"
        # lane l reads what lane l ^ 1 writes: two lanes of one warp, same block
        lanes = (hazard.first.thread[0], hazard.second.thread[0])
        assert lanes[0] ^ lanes[1] == 1 and hazard.first.block == hazard.second.block
        writer = hazard.first if hazard.first.kind == "write" else hazard.second
        assert hazard.offset == 4 * writer.thread[0]
    assert sum(h.count for h in found) == 64  # every thread's read races with one write

    out = E.zeros(64, np.int32)
    fn(1, 64, (out, np.int32(1)))  # with __syncwarp(): no report, the exchanged values
    np.testing.assert_array_equal(out, 10 * (np.arange(64) ^ 1))


@pytest.mark.parametrize("sync, threads, writer, reader", [(0, 2, 0, 1), (1, 64, 63, 0)])
def test_a_write_after_reads_races_with_whichever_read_record_holds_an_unordered_reader(
        races, monkeypatch, sync, threads, writer, reader):
    # The checker keeps two read records a word. In index order the thread that ends the barrier
    # runs on first, then the others in turn. Two threads, no barrier (sync 0): thread 1 reads,
    # then thread 0 reads and writes; its own read is the newer record and thread 1's the older,
    # the race. 64 threads and only a __syncwarp (sync 1): thread 63 reads first, then warp 0, then
    # the rest of warp 1; the records keep a reader of each warp, and thread 0's read races with
    # thread 63's write, although the last readers before it are its own warp's.
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    fn = races.get_function("overwrite_after_reads")
    with pytest.raises(E.RaceError) as caught:
        fn(1, threads, (E.zeros(threads, np.int32), np.int32(sync), np.int32(writer)))
    (hazard,) = hazards_between(caught.value, source_site(RACES, "out[threadIdx.x] = word;"),
                                source_site(RACES, "if ((int)threadIdx.x == writer) word = 8;"))
    assert hazard.kind == "write-after-read" and hazard.memory == "shared" and hazard.count == 1
    assert (hazard.first.thread[0], hazard.second.thread[0]) == (reader, writer)
    out = E.zeros(64, np.int32)
    fn(1, 64, (out, np.int32(2), np.int32(63)))   # with __syncthreads(): no report
    np.testing.assert_array_equal(out, 7)


@pytest.mark.parametrize("seed", ["0", "1", "2", "3", "4", "5"])
def test_a_read_before_a_benign_pair_of_stores_races_with_the_unordered_one(races, monkeypatch, seed):
    """Lane 1's store is ordered after lane 0's read; thread 32's store of the same value is not.
    The stores are a benign pair, and the read must still be found racing with thread 32's
    store in every schedule, also where lane 1 stores between the two."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", seed)
    with pytest.raises(E.RaceError) as caught:
        races.get_function("read_then_flag_set_twice")(1, 64, (E.zeros(1, np.int32), E.zeros(1, np.int32)))
    (hazard,) = hazards_between(caught.value, source_site(RACES, "if (threadIdx.x == 0) out[0] = flag[0];"),
                                source_site(RACES, "// not ordered after it"))
    readers = {"write-after-read": hazard.first, "read-after-write": hazard.second}
    assert readers[hazard.kind].thread[0] == 0, str(caught.value)


@pytest.mark.parametrize("seed", ["0", "1", "2", "3"])
def test_a_write_races_with_another_warps_read_after_two_readers_of_one_warp_other_than_warp_0(
        races, monkeypatch, seed):
    """Warps 1 and 2 read a word and a thread of warp 1 overwrites it after only a __syncwarp. The
    checker skips recording a reader once its two read records hold readers of two different warps;
    here the first two readers are both of warp 1, so the next, of warp 2, must still be recorded, or
    the write (ordered after warp 1's reads) would look ordered after every read on record. In index
    order (seed 0) warp 2 reads before warp 1's writer passes its __syncwarp; in every order the race
    is reported, as a write-after-read or a read-after-write, between the two lines."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", seed)
    fn = races.get_function("late_warps_read_then_write")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 96, (E.zeros(1, np.int32), E.zeros(96, np.int32), np.int32(0), np.int32(34)))
    found = hazards_between(caught.value, source_site(RACES, "if (threadIdx.x >= 32) out[threadIdx.x] = *word;"),
                            source_site(RACES, "if ((int)threadIdx.x == writer) *word = 8;"))
    assert all(h.memory == "global" for h in found), str(caught.value)
    for h in found:   # the read is warp 2's, the write thread 34's
        read, write = (h.first, h.second) if h.kind == "write-after-read" else (h.second, h.first)
        assert read.thread[0] >= 64 and write.thread[0] == 34, str(caught.value)
    word, out = E.zeros(1, np.int32), E.zeros(96, np.int32)
    fn(1, 96, (word, out, np.int32(1), np.int32(34)))   # with __syncthreads(): no report
    assert E.asnumpy(word).tolist() == [8] and not E.asnumpy(out).any()


@pytest.mark.parametrize("increment", [1, 0])
@pytest.mark.parametrize("seed", ["0", "1", "2"])
def test_a_plain_store_racing_with_atomics_is_reported_in_either_order(races, monkeypatch, seed, increment):
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", seed)
    fn = races.get_function("clear_while_counting")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 64, (E.zeros(1, np.int32), np.int32(0), np.int32(increment)))
    found = hazards_between(caught.value, source_site(RACES, "if (threadIdx.x == 0) tally = 0;"),
                            source_site(RACES, "if (threadIdx.x != 0) atomicAdd(&tally, increment);"))
    assert all(h.kind == "write-after-write" and h.memory == "shared" for h in found)
    assert all({h.first.kind, h.second.kind} == {"write", "atomic"} for h in found)   # a plain store, an atomic
    out = E.zeros(1, np.int32)
    fn(1, 64, (out, np.int32(1), np.int32(increment)))
    np.testing.assert_array_equal(out, 63 * increment)



def test_a_race_on_a_written_argument_overlapping_a_read_one_names_the_written_one_and_both_threads():
    """Two blocks of a 2 x 2 grid of 4 x 3 x 2 threads write one element of ``y`` (no order between
    blocks), which overlaps the read-only ``x`` that starts 4 elements below it. The two arguments
    merge into one region, writable since one of them is: the race is reported, on the written argument
    (element 0, not element 4 of ``x``), with each block and thread unravelled from its linear index."""
    src = ("__global__ void racy(const float* x, float* y) {\n"
           "  if (threadIdx.x == 1 && threadIdx.y == 2 && threadIdx.z == 1 && blockIdx.y == 1)\n"
           "    y[0] = x[0] + blockIdx.x + 1.f;\n"
           "}\n")
    racy = E.Module(src, ["racy"], filename="racy.cu").get_function("racy")
    buffer = E.zeros(12, np.float32)
    with pytest.raises(E.RaceError) as caught:
        racy((2, 2, 1), (4, 3, 2), (buffer[:8], buffer[4:]))
    message = str(caught.value)
    assert "write-after-write on argument 1 (float32 array of shape (8,)) element 0, byte offset 0 " in message, \
        message
    sides = re.findall(r"write  at racy\.cu:3 by block (\(\d,\d,\d\)) thread (\(\d,\d,\d\))", message)
    assert sorted(sides) == [("(0,1,0)", "(1,2,1)"), ("(1,1,0)", "(1,2,1)")], message


LONG_KERNEL = "__global__ void many(float* y, int c) {\n" + "".join(
    f"  if (c > {k}) y[{k}] = 1.f + threadIdx.x;\n" for k in range(10)) + "}\n"


@pytest.mark.parametrize("racy_lines", [1, 8, 9])
def test_each_racy_line_of_a_long_kernel_is_named_by_the_users_file_and_at_most_8_are_written_out(racy_lines):
    """Two threads write the element of each of the first ``racy_lines`` statements: one pair of call
    sites a statement, each named ``many.cu:LINE``. Lines were named after the build's own kernel.cpp
    when the user's file came first in a DWARF 5 line table (this kernel, at 10 statements). The
    message writes out 8 pairs and counts the rest."""
    many = E.Module(LONG_KERNEL, ["many"], filename="many.cu").get_function("many")
    with pytest.raises(E.RaceError) as caught:
        many(1, 2, (E.zeros(10, np.float32), np.int32(racy_lines)))
    lines = str(caught.value).splitlines()
    pairs = "1 pair" if racy_lines == 1 else f"{racy_lines} pairs"
    hazards = "1 hazard" if racy_lines == 1 else f"{racy_lines} hazards"
    assert lines[0].startswith(f"kernel 'many': data race in global memory ({hazards} between {pairs} of call sites)")
    shown = min(racy_lines, 8)
    for k in range(shown):
        assert lines[1 + 3 * k] == (f"  write-after-write on argument 0 (float32 array of shape (10,)) element {k}, "
                                    f"byte offset {4 * k} (1 hazard like it):"), lines
        assert [line.split(" by block")[0] for line in lines[2 + 3 * k:4 + 3 * k]] == [
            f"    write  at many.cu:{k + 2}"] * 2, lines
    assert lines[1 + 3 * shown].startswith("  ... and 1 more pairs" if racy_lines == 9 else "  Nothing orders"), lines


def test_a_site_no_line_of_the_users_code_holds_is_named_by_its_offset_in_the_module():
    """A return address the line tables give no user line for (offset 1, before any function: addr2line
    answers ``??:0``) is written ``module.so+0xOFFSET``."""
    many = E.Module(LONG_KERNEL, ["many"], filename="many.cu")
    assert sites.describe_sites(many.path, {1}) == {1: f"{os.path.basename(many.path)}+0x1"}


def test_an_addr2line_frame_is_the_users_file_and_line_unless_it_is_the_emulators_own():
    """Frames in the emulator's headers (cuemu.h) and in generated wrappers (``<...>``) are not the kernel
    author's code and give no site; a folder whose name only starts like the headers' folder is the user's."""
    headers = str(build.INCLUDE_DIR)
    assert sites._frame(f"{headers}/cuemu.h:120") is None
    assert sites._frame(f"{headers}/../include/cuemu.h:120 (discriminator 3)") is None
    assert sites._frame("/tmp/kernels/<launch wrapper>:7") is None
    assert sites._frame("??:0") is None and sites._frame("many.cu:?") is None
    assert sites._frame(f"{headers}_mine/attention.cu:52 (discriminator 1)") == "attention.cu:52"


def test_a_half_warp_syncwarp_orders_its_lanes_only(races):
    fn = races.get_function("half_warp_exchange")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 32, (E.zeros(32, np.int32), np.int32(0)))
    found = hazards_between(caught.value, source_site(RACES, "halves[lane] = 3 * lane;"),
                            source_site(RACES, "v = halves[lane ^ 8];"))
    assert all(h.first.thread[0] < 16 and h.second.thread[0] < 16 for h in found)
    out = E.zeros(32, np.int32)
    fn(1, 32, (out, np.int32(1)))
    lane = np.arange(32)
    np.testing.assert_array_equal(out, np.where(lane < 16, 3 * (lane ^ 8), -1))


def test_warp_synchronisation_is_transitive(races):
    fn = races.get_function("sync_chain")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 32, (E.zeros(1, np.int32), np.int32(0)))
    hazard = only_hazard(caught.value)
    assert hazard.count == 1 and {hazard.first.thread, hazard.second.thread} == {(0, 0, 0), (2, 0, 0)}
    assert {hazard.first.site, hazard.second.site} == {source_site(RACES, "if (lane == 0) shared_value = 42;"),
                                                       source_site(RACES, "if (lane == 2) out[0] = shared_value;")}
    out = E.zeros(1, np.int32)
    fn(1, 32, (out, np.int32(1)))  # lane 0 -> lane 1 -> lane 2: ordered
    assert out[0] == 42


def test_result_read_before_the_barrier_that_publishes_it(races):
    fn = races.get_function("publish_total")
    x = E.asarray(np.arange(128, dtype=np.float32))
    with pytest.raises(E.RaceError) as caught:
        fn(1, 128, (x, E.zeros(128), np.int32(0)))
    hazards_between(caught.value, source_site(RACES, "total = t;"), source_site(RACES, "out[tid] = total;"))
    assert "on static __shared__ total (in publish_total), byte offset 0 (" in str(caught.value)
    out = E.zeros(128)
    fn(1, 128, (x, out, np.int32(1)))
    assert (out == np.arange(128).sum()).all()


def test_plain_read_of_a_count_other_threads_update_atomically(races):
    fn = races.get_function("atomic_count")
    with pytest.raises(E.RaceError) as caught:
        fn(1, 96, (E.zeros(1, np.int32), np.int32(0)))
    found = hazards_between(caught.value, source_site(RACES, "atomicAdd(&count, 1);"),
                            source_site(RACES, "out[0] = count;"))
    for hazard in found:
        assert {hazard.first.kind, hazard.second.kind} == {"atomic", "read"}
    out = E.zeros(1, np.int32)
    fn(1, 96, (out, np.int32(1)))  # atomics among themselves never race
    assert out[0] == 96


def attention_without_barrier_before_pv(source):
    """attention.cu without the __syncthreads() between the softmax and the P.V phases."""
    lines = source.split("\n")
    phase3 = [i for i, line in enumerate(lines) if "// 3. acc = acc * rescale" in line]
    assert len(phase3) == 1
    barrier = max(i for i in range(phase3[0]) if lines[i].strip() == "__syncthreads();")
    assert phase3[0] - barrier <= 3, "the barrier before phase 3 moved; update this patch"
    lines[barrier] = ""  # keeps every line number
    return "\n".join(lines)


def staged_attention_without(barrier_comment):
    """A patch of attention_f32.cu that removes the __syncthreads() whose comment starts so."""
    def patch(source):
        lines = source.split("\n")
        found = [i for i, line in enumerate(lines) if line.strip().startswith("__syncthreads();")
                 and line.split("//", 1)[-1].strip().startswith(barrier_comment)]
        assert len(found) == 1, f"the barrier '{barrier_comment}' moved; update this patch"
        lines[found[0]] = ""  # keeps every line number
        return "\n".join(lines)
    return patch


def rmsnorm_without_barrier(source):
    """rmsnorm.cu without its only __syncthreads() (before the warp totals are read)."""
    lines = source.split("\n")
    barriers = [i for i, line in enumerate(lines) if line.strip() == "__syncthreads();"]
    assert len(barriers) == 1
    lines[barriers[0]] = ""
    return "\n".join(lines)


class PatchedBackend(EmulatorBackend):
    """The emulator backend with one kernel file's source rewritten before it is compiled."""

    def __init__(self, op, patch):
        super().__init__()
        self.filename, self.patch = KERNELS[op].filename, patch

    def _compile(self, filename, source, instances):
        if filename == self.filename:
            source = self.patch(source)
        return super()._compile(filename, source, instances)


def one_query_attention(backend, head_dim=30, rows=5):
    """Attention of one query (q_len 1, one head) over ``rows`` cached float32 rows: the generic
    CUDA-core kernel (attention.cu) at head_dim 30, the staged one (attention_f32.cu) at its sizes."""
    rng = np.random.default_rng(0)
    spec = cupykv.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=head_dim, max_seq=128, batch=1, dtype="float32")
    cache = cupykv.KVCache(spec, backend=backend)
    k, v = (backend.asarray(rng.standard_normal((1, rows, 1, head_dim)).astype(np.float32)) for _ in "kv")
    cache.append(0, k, v)
    cache.advance(rows)
    q = backend.asarray(rng.standard_normal((1, 1, 1, head_dim)).astype(np.float32))
    return cupykv.attention(q, cache, 0, num_splits=1)


def test_attention_without_the_barrier_before_pv_is_reported_at_q_len_1():
    path = Path(KERNEL_DIR) / "attention.cu"
    with pytest.raises(E.RaceError) as caught:
        one_query_attention(PatchedBackend("attention", attention_without_barrier_before_pv))
    message = str(caught.value)
    assert message.startswith("kernel 'cupykv_attention<float, float, 0>': data race in shared memory")
    softmax_writes = {source_site(path, "row[c] = p;"), source_site(path, "row_rescale[r] = rescale;")}
    pv_reads = {source_site(path, "const float rescale = row_rescale[r];"),
                source_site(path, "const float4 p = *reinterpret_cast<const float4*>(scores + r * kChunk + c);"),
                source_site(path, "const float p = scores[r * kChunk + c];")}
    pairs = [h for h in caught.value.hazards if {h.first.site, h.second.site} & softmax_writes
             and {h.first.site, h.second.site} & pv_reads]
    assert pairs, message
    rescale_sites = {source_site(path, "row_rescale[r] = rescale;"),
                     source_site(path, "const float rescale = row_rescale[r];")}
    for h in pairs:
        # the report names the shared array (kernels/shared_layout.cuh) the two accesses met in
        array = "row_rescale" if {h.first.site, h.second.site} & rescale_sites else "scores"
        assert h.memory == "shared" and re.fullmatch(
            rf"dynamic shared memory \(shared array '{array}' byte offset \d+\)", h.where), h.where
        assert h.first.thread != h.second.thread and h.first.block == h.second.block
        assert_names_threads(message, h)
    # the real kernel, same call: no report
    one_query_attention(EmulatorBackend())


K_READ = "const float4 k4 = *reinterpret_cast<const float4*>(k_row + d);"
V_READ = "v4[piece] = *reinterpret_cast<const float4*>(v_stage + key * kRow + piece * 4 * kLanesPerRow + lane_dim);"


def assert_reports_an_early_stage_access(caught, head_dim, access_lines):
    """A RaceError or AsyncCopyError (which one depends on the emulator's schedule: whether the copy's
    own thread has reached its wait) naming the staged kernel, the line of the access and, for an
    AsyncCopyError, the copy issued in load_step."""
    path = Path(KERNEL_DIR) / "attention_f32.cu"
    message = str(caught.value)
    assert message.startswith(f"kernel 'cupykv_attention_f32<{head_dim}>'"), message
    assert any(f"at {source_site(path, line)} " in message for line in access_lines), message
    if isinstance(caught.value, E.AsyncCopyError):   # the copy: issued by load_step at one of its two calls
        calls = {source_site(path, "if (steps > 0) load_step(0, 0);"),
                 source_site(path, "if (n + 1 < steps) load_step(n + 1, (n + 1) % kStages);")}
        issued = re.search(r"cp.async issued by thread \(\d+,0,0\) at async_copy.cuh:\d+ \(inlined into (\S+)\)",
                           message)
        assert issued and issued.group(1) in calls, message
    else:
        for hazard in caught.value.hazards:
            assert hazard.memory == "shared" and hazard.first.thread != hazard.second.thread
            assert_names_threads(message, hazard)


@pytest.mark.parametrize("head_dim", ATTENTION_HEAD_DIMS)
def test_staged_attention_reading_a_stage_before_every_copy_landed_is_reported(head_dim):
    """Without the barrier after cp_async_wait, a warp reads K rows of a step that other threads copy:
    their copies may still be pending (AsyncCopyError), or landed at a wait that nothing orders
    before the read (RaceError)."""
    patched = PatchedBackend("attention_f32", staged_attention_without("... and every thread's"))
    with pytest.raises((E.RaceError, E.AsyncCopyError)) as caught:
        one_query_attention(patched, head_dim, rows=40)
    assert_reports_an_early_stage_access(caught, head_dim, [K_READ, V_READ])
    one_query_attention(EmulatorBackend(), head_dim, rows=40)   # the real kernel: no report


@pytest.mark.parametrize("head_dim", ATTENTION_HEAD_DIMS)
def test_staged_attention_refilling_a_stage_other_warps_still_read_is_reported(head_dim):
    """Without the barrier at the end of a step, the copies of step n + 2 may be issued into the
    stage while another warp still reads step n from it (three steps of 32 keys, five of 16: 65 keys)."""
    patched = PatchedBackend("attention_f32", staged_attention_without("every warp is done with the stage"))
    with pytest.raises((E.RaceError, E.AsyncCopyError)) as caught:
        one_query_attention(patched, head_dim, rows=65)
    assert_reports_an_early_stage_access(caught, head_dim, [K_READ, V_READ])
    one_query_attention(EmulatorBackend(), head_dim, rows=65)


def test_rmsnorm_without_its_barrier_is_reported():
    path = Path(KERNEL_DIR) / "rmsnorm.cu"
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    weight = np.ones(256, np.float32)
    patched = PatchedBackend("rmsnorm", rmsnorm_without_barrier)
    with pytest.raises(E.RaceError) as caught:
        ops.rmsnorm(patched.asarray(x), patched.asarray(weight), 1e-5, backend=patched)
    message = str(caught.value)
    assert message.startswith("kernel 'cupykv_rmsnorm<float>': data race in shared memory")
    found = hazards_between(caught.value, source_site(path, "if (lane == 0) warp_totals[warp] = sum_sq;"),
                            source_site(path, "total += warp_totals[w];"))
    for hazard in found:
        assert hazard.kind in ("read-after-write", "write-after-read")
        assert hazard.where == "static __shared__ warp_totals (in cupykv_rmsnorm<float>)"
        writer = hazard.first if hazard.kind == "read-after-write" else hazard.second
        assert writer.kind == "write" and writer.thread[0] % 32 == 0  # lane 0 of its warp
        assert hazard.offset == 4 * (writer.thread[0] // 32)          # writes its warp's slot
    ops.rmsnorm(patched.asarray(x), patched.asarray(weight), 1e-5, backend="emulator")  # the real kernel: no report


# ---- global memory ----------------------------------------------------------------------
def run_last_block_sums(races, steps, blocks=6, threads=32):
    x = np.arange(blocks * threads, dtype=np.float32)
    partial, out, counter = E.zeros(blocks * (threads + 1)), E.zeros(threads + 1), E.zeros(1, np.int32)
    races.get_function("last_block_sums")(blocks, threads, (E.asarray(x), partial, out, counter, np.int32(steps)))
    return x, out, counter


def test_a_hand_off_through_a_fenced_counter_orders_the_blocks(races):
    """Barrier, release fence, count, acquire fence, barrier: the last block reads every block's
    partials, and the firsts that each releasing thread wrote after the barrier (its own accesses),
    with no race reported, and leaves the counter at 0 for the next launch (or graph replay)."""
    for _ in range(2):
        x, out, counter = run_last_block_sums(races, 15)
        columns = x.reshape(6, 32)
        assert np.array_equal(out[:32], 2 * columns.sum(axis=0)) and out[32] == columns[:, 0].sum()
        assert counter[0] == 0


@pytest.mark.parametrize("steps, missing", [(14, "the releasing fence"), (13, "the acquiring fence"),
                                            (11, "the barrier after the acquire"),
                                            (7, "the barrier before the release")])
def test_a_hand_off_missing_one_step_is_a_race(races, steps, missing):
    """Without the barrier after the acquire, a __syncwarp() orders thread 0's warp after it, but
    not the block's second warp (64 threads)."""
    threads = 64 if steps == 11 else 32
    with pytest.raises(E.RaceError) as caught:
        run_last_block_sums(races, steps, threads=threads)
    message = str(caught.value)
    assert message.startswith("kernel 'last_block_sums': data race"), missing
    publish, sum_up = (source_site(RACES, "partial[blockIdx.x * blockDim.x + column] ="),
                       source_site(RACES, "sum += partial[b * blockDim.x + column];"))
    across_blocks = [h for h in caught.value.hazards if {h.first.site, h.second.site} == {publish, sum_up}]
    if steps == 11:   # thread 0 acquired, and its warp synced with it: the second warp's reads race
        assert across_blocks and all(h.second.thread[0] >= 32 for h in across_blocks), message
        assert sum(h.count for h in across_blocks) == 5 * 32, message   # 5 earlier blocks' partials each
    elif steps == 7:  # thread 0 released its own writes: the race is the other threads' writes
        assert across_blocks and all(h.first.thread != (0, 0, 0) for h in across_blocks), message
    else:
        assert across_blocks, message
    for hazard in across_blocks:
        assert hazard.kind == "read-after-write" and hazard.first.block != hazard.second.block


@pytest.mark.parametrize("acquirers, racing_places", [(0b110, []), (0b010, [2]), (0b100, [1])])
def test_what_a_block_acquired_is_its_own(races, acquirers, racing_places):
    """Of the blocks that read what the first block released, those that did not acquire it race
    with it, also after a block that did acquire it (turns 1 and 2 of 3; 0b110: both acquire)."""
    data, out, counters, order = E.zeros(32), E.zeros(3 * 32), E.zeros(2, np.int32), E.zeros(3, np.int32)

    def run():
        races.get_function("hand_off_to_some_blocks")(3, 32, (data, out, counters, order, np.int32(acquirers)))
    if not racing_places:
        run()
        assert np.array_equal(E.asnumpy(out)[32:], np.tile(np.arange(1, 33, dtype=np.float32), 2))
        return
    with pytest.raises(E.RaceError) as caught:
        run()
    publisher, readers = (int(order[0]), 0, 0), {(int(order[place]), 0, 0) for place in racing_places}
    found = hazards_between(caught.value, source_site(RACES, "data[threadIdx.x] = (float)(threadIdx.x + 1);"),
                            source_site(RACES, "= data[threadIdx.x];"))
    for hazard in found:
        assert hazard.kind == "read-after-write", str(caught.value)
        assert hazard.first.block == publisher and hazard.second.block in readers, str(caught.value)
    assert {hazard.second.block for hazard in found} == readers


@pytest.mark.parametrize("publisher_lanes, steps, racing_lanes", [
    (0xFFFFFFFF, 3, set()),                     # both warps synced: ordered
    (0x0000FFFF, 3, set(range(16, 32))),        # lanes 16-31 did not sync with lane 0 before the release
    (0x00000003, 3, set(range(2, 32))),         # only lane 1 did
    (0xFFFFFFFF, 2, set(range(1, 32))),         # no sync before the release: lane 0's own write only
    (0xFFFFFFFF, 1, set(range(1, 32))),         # no sync after the acquire: lane 0's own read only
    (0xFFFFFFFF, 1 | 4, set(range(1, 32))),     # a sync before the acquire instead
    (0xFFFFFFFF, 2 | 8, set(range(1, 32))),     # a sync before the writes instead of after
])
def test_a_hand_off_between_warps_is_ordered_by_syncwarp(races, publisher_lanes, steps, racing_lanes):
    """One-warp blocks hand data off with __syncwarp() in place of __syncthreads(): the release
    carries the lanes that synced with the releasing lane before it, the acquire reaches the lanes
    that synced with the acquiring lane after it, and only those lanes are ordered."""
    data, out, counters = E.zeros(32), E.zeros(32), E.zeros(2, np.int32)

    def run():
        races.get_function("warp_hand_off")(2, 32, (data, out, counters, np.uint32(publisher_lanes), np.int32(steps)))
    if not racing_lanes:
        run()
        np.testing.assert_array_equal(out, np.arange(3, 35, dtype=np.float32))
        return
    with pytest.raises(E.RaceError) as caught:
        run()
    found = hazards_between(caught.value, source_site(RACES, "// warp-published"), source_site(RACES, "// warp-read"))
    assert {h.kind for h in found} == {"read-after-write"}, str(caught.value)
    assert {h.first.thread[0] for h in found} <= racing_lanes, str(caught.value)
    assert sum(h.count for h in found) == len(racing_lanes), str(caught.value)   # one per racing lane


def run_relayed_hand_off(races, blocks, releaser, steps):
    data, out, counters = E.zeros(32 * 2), E.zeros(32 * 2), E.zeros(blocks + 1, np.int32)
    races.get_function("relayed_hand_off")(blocks, 64, (data, out, counters, np.int32(releaser), np.int32(steps)))
    return E.asnumpy(out)


@pytest.mark.parametrize("blocks, releaser, steps", [(3, 0, 0), (3, 32, 1), (5, 0, 0), (5, 32, 1), (8, 32, 1),
                                                     (3, 1, 4), (5, 1, 4), (3, 0, 8), (5, 32, 9)])
def test_a_hand_off_relayed_through_other_addresses_orders_the_reader_after_the_publisher(
        races, blocks, releaser, steps):
    """Happens-before is transitive: the reader acquires from the last relay, which released what
    it had acquired from the one before, and so on back to the publisher (1 to 6 relays). A relay
    carries on what its thread 0 acquired when thread 0 itself releases, when a barrier lies
    between the acquire and thread 32's release, or a __syncwarp() between it and lane 1's. A
    publisher that releases each warp's elements in turn (steps 8) hands both releases on."""
    out = run_relayed_hand_off(races, blocks, releaser, steps)
    np.testing.assert_array_equal(out, np.arange(2, 66, dtype=np.float32))


@pytest.mark.parametrize("blocks, releaser, steps, broken", [
    (3, 32, 0, "thread 32 releases with no barrier after thread 0's acquire"),
    (3, 1, 0, "lane 1 releases with no __syncwarp() after lane 0's acquire"),
    (5, 32, 0, "every relay releases from another warp with no barrier"),
    (3, 0, 2, "the relay releases without having acquired"),
    (5, 0, 2, "the first of three relays releases without having acquired"),
])
def test_a_relay_that_did_not_acquire_what_it_releases_leaves_a_race(races, monkeypatch, blocks, releaser,
                                                                    steps, broken):
    """In index order (seed 0) a relay's thread 0 runs its acquire before thread 32 (or lane 1)
    releases: the release comes later in time, and still carries nothing without a barrier (or a
    __syncwarp()) between them."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    with pytest.raises(E.RaceError) as caught:
        run_relayed_hand_off(races, blocks, releaser, steps)
    found = hazards_between(caught.value, source_site(RACES, "// published"), source_site(RACES, "// relayed"))
    assert "ordered only by a hand-off" in str(caught.value), str(caught.value)
    for hazard in found:
        assert hazard.kind == "read-after-write", broken
        assert hazard.first.block != hazard.second.block, broken
    assert sum(hazard.count for hazard in found) == 64, broken   # every reader's element


def test_each_pair_of_lines_is_its_own_hazard(races):
    """Two races of one kind on one array, between two pairs of lines: the report has both."""
    with pytest.raises(E.RaceError) as caught:
        races.get_function("two_races_one_array")(1, 64, (E.zeros(2, np.int32), E.zeros(2, np.int32)))
    pairs = {frozenset((h.first.site, h.second.site)) for h in caught.value.hazards}
    assert pairs == {frozenset((source_site(RACES, f"pair[{i}] = {i + 1};"),
                                source_site(RACES, f"out[{i}] = pair[{i}];"))) for i in (0, 1)}, str(caught.value)
    assert len({h.kind for h in caught.value.hazards}) == 1, str(caught.value)


@pytest.mark.parametrize("scenario, target", [
    (0, 3),                       # the last byte of a word written whole, then split
    (1, 4),                       # a split word's byte record beside another word that splits
    (2, 1), (2, 2), (2, 3),       # a byte written alone, then the whole word read: not merged back
])
def test_a_race_on_one_byte_is_found_however_the_word_was_accessed(races, scenario, target):
    bytes_, counter, out = E.zeros(8, np.uint8), E.zeros(1, np.int32), E.zeros(2, np.int32)
    with pytest.raises(E.RaceError) as caught:
        races.get_function("byte_races")(2, 1, (bytes_, counter, out, np.int32(scenario), np.int32(target)))
    hazard = only_hazard(caught.value)
    assert hazard.kind == "read-after-write" and hazard.offset == target, str(caught.value)
    assert hazard.second.site == source_site(RACES, "out[0] = bytes[target];"), str(caught.value)
    assert hazard.first.block != hazard.second.block


@pytest.mark.parametrize("n_words", [2, 3, 16, 17])
def test_a_write_of_the_first_byte_and_one_of_the_last_word_are_no_race(races, monkeypatch, n_words):
    """Two unordered blocks write the two ends of one array: the first byte (its word's record split
    into bytes) and the last word. The records of the two ends are kept apart, so no race; in index
    order (seed 0) the byte comes first."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    bytes_ = E.zeros(4 * n_words, np.uint8)
    races.get_function("first_byte_and_last_word")(2, 1, (bytes_, np.int32(n_words)))
    expected = np.zeros(4 * n_words, np.uint8)
    expected[0] = 7
    expected[-4:] = [4, 3, 2, 1]   # 0x01020304, little-endian
    np.testing.assert_array_equal(bytes_, expected)


def test_a_threads_newer_read_replaces_its_own_record_not_another_threads(races):
    word, counter, out = E.zeros(1, np.int32), E.zeros(1, np.int32), E.zeros(1, np.int32)
    with pytest.raises(E.RaceError) as caught:
        races.get_function("reread_then_write")(2, 1, (word, counter, out))
    hazard = only_hazard(caught.value)
    assert hazard.kind == "write-after-read", str(caught.value)
    assert (hazard.first.site, hazard.second.site) == (source_site(RACES, "out[0] = word[0];"),
                                                       source_site(RACES, "word[0] = seen + 1;")), str(caught.value)


def test_a_wide_access_pair_counts_one_hazard_not_one_per_word(races):
    # the int4 spans four 4-byte granules, each checked; the report counts the pair of accesses once
    data, counter, out = E.zeros(4, np.int32), E.zeros(1, np.int32), E.zeros(4, np.int32)
    with pytest.raises(E.RaceError) as caught:
        races.get_function("wide_read_then_overwrite")(2, 1, (data, counter, out))
    hazard = only_hazard(caught.value)
    assert (hazard.kind, hazard.count, hazard.offset) == ("write-after-read", 1, 0), str(caught.value)
    assert (hazard.first.site, hazard.second.site) == (source_site(RACES, "out[0] = data[0];"),
                                                       source_site(RACES, "data[0] = make_int4(1, 2, 3, 4);"))


@pytest.mark.parametrize("kernel, store, words", [("store_one_word", "*word = blockIdx.x == 1", 2),
                                                   ("copy_64_bytes", "memcpy(words, value, sizeof value);", 16)])
@pytest.mark.parametrize("differ", [0, 1])
def test_two_stores_of_a_word_are_benign_only_if_every_byte_is_the_same(races, kernel, store, words, differ):
    target = E.zeros(words, np.uint32)
    run = lambda: races.get_function(kernel)(2, 1, (target, np.int32(differ)))
    if not differ:
        run()
        assert (E.asnumpy(target) == 1).all()   # 0x0000000100000001 is two words of 1
        return
    with pytest.raises(E.RaceError) as caught:
        run()
    hazard = only_hazard(caught.value)
    assert hazard.kind == "write-after-write", str(caught.value)
    assert hazard.first.site == hazard.second.site == source_site(RACES, store), str(caught.value)


def test_a_wider_store_is_benign_when_the_bytes_it_shares_hold_the_same_value(races, monkeypatch):
    """A store of 8 bytes after an unordered 4-byte store of its low word, with that word's value: only
    the shared bytes are compared, so the high word it newly writes is no race (seed 0 runs the
    4-byte store first)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    pair = E.zeros(1, np.uint64)
    races.get_function("word_then_wider_store")(2, 1, (pair,))
    assert int(E.asnumpy(pair)[0]) == 0x0000000500000001


@pytest.mark.parametrize("differ", [0, 1])
def test_a_halfword_store_over_an_unordered_byte_compares_that_byte_only(races, monkeypatch, differ):
    """Block 1's 2-byte store shares byte 0 with block 0's 1-byte store: the same value there is
    benign whatever byte 1, which nobody wrote before, holds; another value is a race at byte 0
    (seed 0 runs the byte store first)."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    bytes_ = E.zeros(4, np.uint8)

    def run():
        races.get_function("byte_then_halfword")(2, 1, (bytes_, np.int32(differ)))
    if not differ:
        run()
        np.testing.assert_array_equal(bytes_, [7, 5, 0, 0])
        return
    with pytest.raises(E.RaceError) as caught:
        run()
    hazard = only_hazard(caught.value)
    assert hazard.kind == "write-after-write" and hazard.offset == 0, str(caught.value)


def test_a_store_over_two_earlier_writes_names_its_first_bytes_writer(races, monkeypatch):
    """In index order (seed 0) block 2's 4-byte store comes after block 0's low half and block 1's
    high half: one write-after-write, whose earlier write is that of the store's first byte."""
    monkeypatch.setenv("CUPYKV_EMULATOR_SEED", "0")
    with pytest.raises(E.RaceError) as caught:
        races.get_function("halves_then_word")(3, 1, (E.zeros(1, np.uint32),))
    hazard = only_hazard(caught.value)
    assert hazard.kind == "write-after-write", str(caught.value)
    assert (hazard.first.block, hazard.first.site) == ((0, 0, 0), source_site(RACES, "halves[0] = 1")), \
        str(caught.value)
    assert (hazard.second.block, hazard.second.site) == ((2, 0, 0), source_site(RACES, "word[0] = 0x")), \
        str(caught.value)


@pytest.mark.parametrize("lines", [64, 66])
def test_the_first_64_pairs_of_call_sites_are_described_and_the_rest_counted(lines):
    """A kernel whose two threads race at `lines` store lines, one pair of call sites each: the
    first 64 pairs are described, and the hazards past them are counted in the total only."""
    stores = "".join(f"  out[{i}] = threadIdx.x;\n" for i in range(lines))   # volatile: one store a line
    source = f"__global__ void many_sites(volatile int* out) {{\n{stores}}}\n"
    kernel = E.Module(source, ["many_sites"]).get_function("many_sites")
    with pytest.raises(E.RaceError) as caught:
        kernel(1, 2, (E.zeros(lines, np.int32),))
    message, described = str(caught.value), min(lines, 64)
    assert len(caught.value.hazards) == described, message
    assert f"({lines} hazards between {described} pairs of call sites)" in message, message
    beyond = f"({lines - 64} hazards beyond the first 64 pairs of call sites are counted only)"
    assert (beyond in message) == (lines > 64), message


def test_two_blocks_writing_one_output_element(races):
    fn = races.get_function("blocks_share_output")
    with pytest.raises(E.RaceError) as caught:
        fn(4, 32, (E.zeros(4), np.int32(0)))
    message, hazard = str(caught.value), only_hazard(caught.value)
    assert message.startswith("kernel 'blocks_share_output': data race in global memory")
    assert hazard.kind == "write-after-write" and hazard.count == 3  # blocks 2, 3, 4 overwrite
    assert hazard.first.block != hazard.second.block
    assert hazard.first.thread == hazard.second.thread == (0, 0, 0)
    assert hazard.first.site == hazard.second.site == source_site(RACES, "out[separate ? blockIdx.x : 0]")
    assert "argument 0 (float32 array of shape (4,)) element 0, byte offset 0" in message
    assert_names_threads(message, hazard)
    out = E.zeros(4)
    fn(4, 32, (out, np.int32(1)))
    np.testing.assert_array_equal(out, [1, 2, 3, 4])


def test_a_race_in_an_array_of_64_mib_is_reported(races):
    """The access layer marks a watched array's shadow (a byte per 8 bytes) at each launch; spans of
    1 MiB and more are released to the kernel when cleared, never when marked, so a large array is
    checked like a small one (a 64 MiB argument: an 8 MiB span)."""
    out = E.zeros(2**24, np.float32)
    with pytest.raises(E.RaceError) as caught:
        races.get_function("blocks_share_output")(4, 32, (out, np.int32(0)))
    assert only_hazard(caught.value).count == 3, str(caught.value)
    assert "argument 0 (float32 array of shape (16777216,)) element 0, byte offset 0" in str(caught.value)


def test_a_flag_set_to_one_value_by_many_threads_is_benign(races):
    fn = races.get_function("set_flag")
    flag = np.zeros(1, np.int32)  # a host array: shadowed in guarded memory, checked the same
    fn(3, 64, (flag, np.int32(0)))
    assert flag[0] == 1
    with pytest.raises(E.RaceError, match=r"write-after-write on argument 0 \(int32 array of shape "
                                          r"\(1,\)\) element 0"):
        fn(3, 64, (flag, np.int32(1)))


def test_read_only_arguments_are_not_tracked_but_aliases_of_written_ones_are(races):
    fn = races.get_function("publish_total")
    x = E.asarray(np.arange(64, dtype=np.float32))
    fn(1, 64, (x, E.zeros(64), np.int32(1)))
    assert fn.param_writable == (False, True, False)
    # out aliasing x: x's reads are compared with out's writes, but each thread reads and
    # writes only its own element, so there is no race
    y = E.asarray(np.arange(64, dtype=np.float32))
    fn(1, 64, (y, y, np.int32(1)))
    assert (y == np.arange(64).sum()).all()


# ---- warp synchronisation (synccheck) -----------------------------------------------------
def test_shuffle_whose_mask_leaves_out_calling_lanes(races):
    fn = races.get_function("shuffle_mask_misses_callers")
    with pytest.raises(E.BarrierError, match=r"__shfl_xor_sync at .*races\.cu:\d+ \(mask 0x0000ffff\)"
                                             r".*the calling lane (1[6-9]|2\d|3[01]) \(thread \d+\) "
                                             r"is not in the mask"):
        fn(1, 32, (E.zeros(32, np.int32), np.int32(0)))
    out = E.zeros(32, np.int32)
    fn(1, 32, (out, np.int32(1)))
    np.testing.assert_array_equal(out, np.arange(32) ^ 1)


def test_shuffle_lanes_passing_different_masks(races):
    fn = races.get_function("shuffle_masks_differ")
    with pytest.raises(E.BarrierError, match=r"passes mask 0x(0000ffff|ffffffff), but lane \d+ "
                                             r"\(thread \d+\), which both masks name, waits at "
                                             r".*races\.cu:\d+ with mask 0x(ffffffff|0000ffff)"):
        fn(1, 32, (E.zeros(32, np.int32), np.int32(0)))
    fn(1, 32, (E.zeros(32, np.int32), np.int32(1)))


def test_syncwarp_whose_mask_leaves_out_the_caller(races):
    fn = races.get_function("syncwarp_mask_misses_caller")
    with pytest.raises(E.BarrierError, match=r"__syncwarp at .*races\.cu:\d+ \(mask 0xfffffffe\).*"
                                             r"the calling lane 0 \(thread 0\) is not in the mask"):
        fn(1, 32, (E.zeros(32, np.int32), np.int32(0)))
    fn(1, 32, (E.zeros(32, np.int32), np.int32(1)))


# ---- switches ---------------------------------------------------------------------------
def test_the_checker_can_be_turned_off(races, monkeypatch):
    monkeypatch.setenv("CUPYKV_EMULATOR_RACECHECK", "0")
    races.get_function("warp_exchange")(1, 64, (E.zeros(64, np.int32), np.int32(0)))


def test_same_source_compiles_with_nvrtc():
    from cupykv import nvrtc_check
    nvrtc = nvrtc_check.load_nvrtc()
    nvrtc_check.compile_file(nvrtc, RACES.name, RACES.read_text(), [], "sm_80")
