"""The offline NVRTC check: every kernel instance compiles for sm_80 and sm_90 without spills, and
every attention and linear instance keeps the occupancy its ``__launch_bounds__`` declares.

The verdict is reproducible: the test extra pins the NVRTC wheel, and CI also
runs the check under a second, older pinned NVRTC (``.ci/run`` installs it and
sets ``CUPYKV_SECOND_NVRTC``), so no instance sits at the edge of one
allocator's choices.
"""
import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cupykv import nvrtc_check, occupancy
from cupykv.kernels import KERNEL_DIR, KERNELS, KernelFile
from compiler_drift import assert_registers_near


@pytest.fixture(scope="module")
def reports():
    return nvrtc_check.check_all()


def test_every_instance_compiles_for_both_archs_without_spills(reports):
    expected = {(arch, inst) for arch in nvrtc_check.ARCHS for k in KERNELS.values() for inst in k.instances}
    assert {(r.arch, r.instance) for r in reports} == expected
    spilled = [(r.arch, r.instance) for r in reports if r.spills]
    assert spilled == []
    assert all(0 < r.registers <= 255 for r in reports)


def test_command_line_prints_the_table_and_succeeds(reports, monkeypatch, capsys):
    """``python -m cupykv check`` in this process, its compiles those of the ``reports`` fixture (the
    same pinned NVRTC: a second full compile would cost a minute of CI); the command runs as a
    process of its own, compiling everything, under the second pinned NVRTC below."""
    from cupykv.__main__ import main as cli_main
    used = []

    def compiled(nvrtc=None):
        used.append(nvrtc)
        return reports

    monkeypatch.setattr(nvrtc_check, "check_all", compiled)
    assert cli_main(["check"]) == 0
    assert len(used) == 1 and used[0].wheel_version == nvrtc_check.PINNED_NVRTC
    result = capsys.readouterr()
    assert "cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 2>" in result.out
    assert nvrtc_check.format_table(reports) in result.out   # every instance's registers, stack and spills
    assert f"OK, {len(reports)} instances compiled for sm_80, sm_90, no spills" in result.out
    assert "occupancy at or above every declared minimum" in result.out
    # the tensor-core decode block: 2 warps, 47872 bytes of q pieces and stages + 16 static, 4 blocks an SM
    # (shared memory); with two row tiles 60928 + 16 bytes after the opt-in past 48 KiB, 3 blocks
    assert re.search(r"^sm_90  cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 1> +\d+ +64 +47888 +4 +8 +3  shared",
                     result.out, re.M), result.out
    assert re.search(r"^sm_90  cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 2> +\d+ +64 +60944 +3 +6 +2  shared",
                     result.out, re.M), result.out
    # four row tiles: two row groups of 2 warps (128 threads), 87040 + 16 bytes: 2 blocks, 1 declared
    assert re.search(r"^sm_90  cupykv_attention_mma<__nv_bfloat16, __nv_bfloat16, 128, 4> +\d+ +128 +87056 +2 +8 +1  ",
                     result.out, re.M), result.out
    major, minor = nvrtc_check.PINNED_NVRTC.split(".")[:2]
    assert f"NVRTC {major}.{minor} (nvidia-cuda-nvrtc {nvrtc_check.PINNED_NVRTC}) from " in result.out
    assert "-ftz=true" in result.out.splitlines()[0]


def test_the_test_extra_pins_the_nvrtc_the_check_loads():
    requirements = importlib.metadata.requires("cupykv")
    assert f'nvidia-cuda-nvrtc=={nvrtc_check.PINNED_NVRTC}; extra == "test"' in requirements
    assert importlib.metadata.version("nvidia-cuda-nvrtc") == nvrtc_check.PINNED_NVRTC
    assert nvrtc_check.load_nvrtc().wheel_version == nvrtc_check.PINNED_NVRTC


def test_options_are_the_ones_cupy_compiles_with():
    # cupy/cuda/compiler.py: the caller's -std=c++17, then -ftz=true and
    # --device-as-default-execution-space; -arch=sm_XX is added per target.
    assert {"-std=c++17", "-ftz=true", "--device-as-default-execution-space"} <= set(nvrtc_check.OPTIONS)


def test_every_instance_is_spill_free_under_the_second_pinned_nvrtc():
    root = os.environ.get("CUPYKV_SECOND_NVRTC")
    if not root:
        if os.environ.get("CI"):
            pytest.fail("CUPYKV_SECOND_NVRTC is not set: .ci/run installs nvidia-cuda-nvrtc=="
                        f"{nvrtc_check.SECOND_NVRTC} and sets it")
        pytest.skip(f"CUPYKV_SECOND_NVRTC not set (pip install --target DIR --no-deps "
                    f"nvidia-cuda-nvrtc=={nvrtc_check.SECOND_NVRTC}, then set it to DIR)")
    # A separate process: two libnvrtc builds in one process would share symbols.
    result = subprocess.run([sys.executable, "-m", "cupykv", "check", "--nvrtc", root],
                            capture_output=True, text=True, timeout=600)
    assert f"(nvidia-cuda-nvrtc {nvrtc_check.SECOND_NVRTC})" in result.stdout, result.stdout[:500]
    assert result.returncode == 0, result.stderr
    every = sum(len(kernel.instances) for kernel in KERNELS.values()) * len(nvrtc_check.ARCHS)
    assert f"OK, {every} instances compiled for sm_80, sm_90, no spills" in result.stdout


def test_an_explicit_library_that_does_not_exist_fails_clearly(tmp_path):
    with pytest.raises(nvrtc_check.NvrtcError, match="no libnvrtc.so under"):
        nvrtc_check.load_nvrtc(str(tmp_path))


def test_no_loadable_library_names_every_candidate_it_tried(monkeypatch):
    monkeypatch.setattr(nvrtc_check, "_candidate_libraries", lambda: ["/nowhere/libnvrtc.so.13"])
    with pytest.raises(nvrtc_check.NvrtcError, match=r"^libnvrtc not found: install the test extra .* or point "
                                                     r"CUDA_PATH at a CUDA toolkit; tried /nowhere/libnvrtc.so.13: "):
        nvrtc_check.load_nvrtc()
    monkeypatch.setattr(nvrtc_check, "_candidate_libraries", lambda: [])
    with pytest.raises(nvrtc_check.NvrtcError, match=r"^libnvrtc not found: .* CUDA toolkit$"):
        nvrtc_check.load_nvrtc()


# What ptxas -v writes (NVRTC 13.5, sm_80): a kernel with static shared memory, and one without.
PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1bPf' for 'sm_80'
ptxas info    : Function properties for _Z1bPf
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]
ptxas info    : Compile time = 3.870 ms
ptxas info    : Compiling entry function '_Z1aPf' for 'sm_80'
ptxas info    : Function properties for _Z1aPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compile time = 0.940 ms
"""


def test_the_ptxas_log_gives_each_instance_its_own_figures():
    reports = nvrtc_check.parse_ptxas_log(PTXAS_LOG, {"_Z1aPf": "a", "_Z1bPf": "b"}, "sm_80")
    assert reports == [nvrtc_check.InstanceReport("sm_80", "a", 8, 0, 0, 0, 0),        # no smem line: 0 bytes
                       nvrtc_check.InstanceReport("sm_80", "b", 10, 16, 4, 8, 1024)]


@pytest.mark.parametrize("dropped", ["Used 8 registers", "0 bytes stack frame"])
def test_an_instance_missing_either_ptxas_line_fails(dropped):
    log = "\n".join(line for line in PTXAS_LOG.splitlines() if dropped not in line)
    with pytest.raises(nvrtc_check.NvrtcError, match=r"^no ptxas report for a \(_Z1aPf\) on sm_80"):
        nvrtc_check.parse_ptxas_log(log, {"_Z1aPf": "a", "_Z1bPf": "b"}, "sm_80")


def test_launch_bounds_multiply_every_axis_of_maxntid():
    # __launch_bounds__ only ever writes (n, 1, 1); a hand-written PTX may give all three axes
    ptx = ".visible .entry _Z1aPf(\n\t.param .u64 p\n)\n.maxntid 8, 4, 2\n.minnctapersm 3\n{\n\tret;\n}\n"
    assert nvrtc_check.parse_launch_bounds(ptx, {"_Z1aPf": "a"}) == {"a": (64, 3)}


def _process_of(nvrtc, item):
    """A worker's answer for map_in_processes: the item and the process that computed it."""
    return item, os.getpid()


@pytest.mark.parametrize("cores", [2, 3, None])
def test_several_items_run_in_worker_processes_and_a_lone_item_runs_here(monkeypatch, cores):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    nvrtc = nvrtc_check.load_nvrtc()
    done = nvrtc_check.map_in_processes(_process_of, range(5), nvrtc)
    assert [item for item, _ in done] == list(range(5))
    workers = {pid for _, pid in done}
    if cores is None:   # the core count unknown: one process, this one
        assert workers == {os.getpid()}
    else:               # a worker per core, none of them this process
        assert len(workers) == cores and os.getpid() not in workers
    assert nvrtc_check.map_in_processes(_process_of, [7], nvrtc) == [(7, os.getpid())]


def _die(nvrtc, status):
    """A worker that exits with ``status`` before it answers (as one NVRTC crashed in would)."""
    os._exit(status)


@pytest.mark.parametrize("status", [0, 3])
def test_a_worker_that_dies_without_answering_fails_the_map(monkeypatch, status):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(nvrtc_check.NvrtcError, match=rf"^an NVRTC worker process failed \(exit status {status}\)$"):
        nvrtc_check.map_in_processes(_die, [status, status], nvrtc_check.load_nvrtc())


def test_the_command_fails_with_status_1_when_nvrtc_cannot_load(tmp_path, capsys):
    assert nvrtc_check.main(str(tmp_path)) == 1
    assert capsys.readouterr().err == f"cupykv check: FAILED\nno libnvrtc.so under {tmp_path}\n"


def test_the_resource_table_lines_its_columns_up_under_the_header():
    reports = [nvrtc_check.InstanceReport("sm_80", "short", 32, 0, 0, 0, 0),
               nvrtc_check.InstanceReport("sm_90", "a_much_longer_instance<float, 128>", 255, 16, 4, 8, 1024)]
    header, *rows = nvrtc_check.format_table(reports).splitlines()
    assert len({len(header), *map(len, rows)}) == 1
    assert [row.split() for row in rows] == [["sm_80", "short", "32", "0", "0", "0", "0"],
                                             ["sm_90", "a_much_longer_instance<float,", "128>", "255", "16", "4", "8",
                                              "1024"]]
    assert header.index("regs") + len("regs") == rows[1].index("255") + len("255")


def test_a_compile_error_fails_with_the_compiler_log():
    nvrtc = nvrtc_check.load_nvrtc()
    source = "__global__ void broken(float* x) { x[0] = undeclared_name; }\n"
    with pytest.raises(nvrtc_check.NvrtcError, match="undeclared_name"):
        nvrtc_check.compile_file(nvrtc, "broken.cu", source, ["broken"], "sm_80")


def test_compiles_in_worker_processes_keep_the_jobs_order_and_raise_a_workers_error(monkeypatch):
    """map_in_processes: five programs on two workers come back in the order asked for, and a compile
    error in a worker is raised here with the compiler's log."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    nvrtc = nvrtc_check.load_nvrtc()
    jobs = [(f"k{i}.cu", f"__global__ void k{i}(float* x) {{ x[{i}] = {i}.0f; }}\n", (f"k{i}",),
             ("sm_80", "sm_90")[i % 2], KERNEL_DIR) for i in range(5)]
    done = nvrtc_check.map_in_processes(nvrtc_check._compile_job, jobs, nvrtc)
    assert [arch for arch, _ in done] == ["sm_80", "sm_90", "sm_80", "sm_90", "sm_80"]
    assert [list(program.lowered.values()) for _, program in done] == [[f"k{i}"] for i in range(5)]
    broken = ("broken.cu", "__global__ void broken(float* x) { x[0] = undeclared_name; }\n", ("broken",), "sm_80",
              KERNEL_DIR)
    with pytest.raises(nvrtc_check.NvrtcError, match="undeclared_name"):
        nvrtc_check.map_in_processes(nvrtc_check._compile_job, [jobs[0], broken, jobs[1]], nvrtc)


def test_a_spilling_kernel_is_reported_as_spilling():
    # 64 live floats per thread under a 32-register cap (1024 threads, 2 blocks per SM) must spill.
    source = (
        "__global__ void __launch_bounds__(1024, 2) spiller(float* out) {\n"
        "  float v[64];\n"
        "  #pragma unroll\n  for (int i = 0; i < 64; ++i) v[i] = out[i * 1024 + threadIdx.x];\n"
        "  float acc = 0.f;\n"
        "  #pragma unroll\n  for (int i = 0; i < 64; ++i)\n"
        "  #pragma unroll\n    for (int j = 0; j < 64; ++j) acc += v[i] * v[(i * 7 + j) % 64];\n"
        "  #pragma unroll\n  for (int i = 0; i < 64; ++i) out[i * 1024 + threadIdx.x] = v[i] * acc;\n"
        "}\n")
    nvrtc = nvrtc_check.load_nvrtc()
    lowered, log = nvrtc_check.compile_file(nvrtc, "spiller.cu", source, ["spiller"], "sm_80")
    (report,) = nvrtc_check.parse_ptxas_log(log, lowered, "sm_80")
    assert report.registers <= 32
    assert report.spills and report.spill_store_bytes > 0 and report.spill_load_bytes > 0
    code, _, stderr = _report_exit([report])
    assert code == 1 and "FAILED, register spills in 1 instance(s): spiller (sm_80)" in stderr


@pytest.mark.parametrize("stores, loads", [(4, 0), (0, 4), (1, 0), (0, 1)],
                         ids=["stores", "loads", "one byte stored", "one byte loaded"])
def test_spill_stores_or_loads_alone_fail_the_check(stores, loads):
    spilled = nvrtc_check.InstanceReport("sm_90", "cupykv_write<float, float>", registers=32, stack_bytes=8,
                                         spill_store_bytes=stores, spill_load_bytes=loads, shared_bytes=0)
    code, _, stderr = _report_exit([spilled])
    assert spilled.spills and code == 1 and "cupykv_write<float, float> (sm_90)" in stderr
    clean = nvrtc_check.InstanceReport("sm_90", "cupykv_write<float, float>", 32, 8, 0, 0, 0)
    assert not clean.spills and _report_exit([clean])[0] == 0


# ---- occupancy ---------------------------------------------------------------------------------
SM80, SM90 = occupancy.LIMITS["sm_80"], occupancy.LIMITS["sm_90"]


@pytest.mark.parametrize("limits, registers, threads, shared, blocks, limiter", [
    # registers: ceil(32 R / 256) * 256 per warp of 65536 per SM, whole blocks of warps
    (SM80, 128, 128, 16576, 4, "registers"),      # 4096 per warp: 16 warps, 4 blocks of 4
    (SM90, 94, 128, 16576, 5, "registers"),       # 3008 -> 3072 per warp: 21 warps, 5 blocks
    (SM80, 168, 128, 12480, 3, "registers"),      # 5376 per warp: 12 warps
    (SM90, 80, 128, 12480, 6, "registers"),       # 2560 per warp: 25 warps, 6 blocks
    (SM90, 114, 128, 24768, 4, "registers"),      # 3648 -> 3840 per warp: 17 warps
    (SM80, 48, 128, 0, 10, "registers"),          # 1536 per warp: 42 warps
    (SM80, 32, 1024, 0, 2, "registers+threads"),  # 1024 per warp: 64 warps; 2048 threads
    (SM80, 16, 32, 0, 32, "blocks"),              # 128 warps by registers, 64 blocks by threads
    (SM80, 32, 128, 48 * 1024, 3, "shared"),      # 167936 // (49152 + 1024)
    (SM90, 32, 128, 48 * 1024, 4, "shared"),      # 233472 // 50176
    (SM80, 32, 128, 60944, 2, "shared"),          # past 48 KiB (opt-in): 167936 // 62080
    (SM80, 32, 128, 163 * 1024 + 1, 0, "shared"),  # past sm_80's 163 KiB a block (with 1 KB reserved): none
    (SM90, 32, 128, 163 * 1024 + 1, 1, "shared"),  # sm_90 allows 227 KiB a block
    (SM80, 32, 128, 163 * 1024, 1, "shared"),     # exactly sm_80's largest block
    (SM90, 32, 128, 227 * 1024, 1, "shared"),     # exactly sm_90's largest block
    (SM90, 32, 128, 227 * 1024 + 1, 0, "shared"),  # one byte past it
    (SM80, 16, 96, 0, 21, "threads"),             # 2048 // 96: whole blocks of 3 warps, not 21.3
    (SM80, 16, 1, 0, 32, "blocks"),               # one thread is a block of one warp
    (SM80, 32, 100, 100, 16, "registers+threads"),  # 100 threads occupy 4 warps
    (SM80, 255, 1024, 0, 0, "registers"),         # 8192 per warp: 8 warps, a block needs 32
    (SM80, 100, 128, 0, 4, "registers"),          # 3200 -> 3328 per warp: 19 warps (20 unrounded: 5 blocks)
    (SM90, 132, 128, 0, 3, "registers"),          # 4224 -> 4352 per warp: 15 warps (15.5 unrounded: still 15)
    (SM90, 60, 64, 0, 16, "registers"),           # 1920 -> 2048 per warp: 32 warps (34 unrounded: 17 blocks)
])
def test_occupancy_arithmetic(limits, registers, threads, shared, blocks, limiter):
    result = occupancy.blocks_per_sm(limits, registers, threads, shared)
    assert (result.blocks, result.limiter) == (blocks, limiter)


def test_shared_memory_is_allocated_in_128_byte_units_plus_1_kb_per_block():
    # 100 bytes + 1024 reserved = 1124 -> 1152 bytes a block; 167936 // 1152 = 145 (not 149)
    assert occupancy.blocks_per_sm(SM80, 0, 32, 100).by_shared == 145
    assert occupancy.blocks_per_sm(SM80, 0, 32, 0).by_shared == 164
    assert occupancy.blocks_per_sm(SM90, 0, 32, 0).by_shared == 228


@pytest.mark.parametrize("threads", [0, 1025])
def test_occupancy_refuses_impossible_blocks(threads):
    with pytest.raises(ValueError, match="threads per block"):
        occupancy.blocks_per_sm(SM80, 32, threads, 0)


@pytest.mark.parametrize("registers, shared", [(-1, 0), (0, -1)])
def test_occupancy_refuses_a_negative_amount_of_either_resource(registers, shared):
    with pytest.raises(ValueError, match=rf"must be >= 0, got {registers} and {shared}$"):
        occupancy.blocks_per_sm(SM80, registers, 32, shared)


def test_launch_bounds_are_read_from_the_ptx():
    source = ("template <int N> __global__ void __launch_bounds__(64 * N, N + 1) k(float* x) { x[threadIdx.x] = N; }\n"
              "__global__ void __launch_bounds__(256) plain(float* x) { x[threadIdx.x] = 1.f; }\n"
              "__global__ void free_kernel(float* x) { x[threadIdx.x] = 2.f; }\n")
    nvrtc = nvrtc_check.load_nvrtc()
    program = nvrtc_check.compile_program(nvrtc, "bounds.cu", source, ["k<2>", "plain", "free_kernel"], "sm_80")
    assert nvrtc_check.parse_launch_bounds(program.ptx, program.lowered) == {
        "k<2>": (128, 3), "plain": (256, None), "free_kernel": (None, None)}


def test_every_attention_and_linear_instance_meets_its_declared_occupancy(reports):
    rows = occupancy.rows(reports)
    expected = {(r.arch, r.instance) for r in reports if r.instance.startswith(("cupykv_attention", "cupykv_linear"))}
    assert {(row.report.arch, row.report.instance) for row in rows} == expected
    for row in rows:
        r = row.report
        if r.instance.startswith("cupykv_attention<"):   # attention_min_blocks(): 4
            assert r.min_blocks == 4, r
        elif r.instance.startswith("cupykv_attention_f32<"):   # attention_f32_min_blocks: sm_80's shared memory
            assert r.min_blocks == (4 if r.instance.endswith(("<32>", "<64>")) else 2), r
        elif r.instance.startswith("cupykv_attention_mma<") and ", 256, " in r.instance:
            # attention_mma_min_blocks<T, 256, tiles>(): 2 with one tile, 1 with two (sm_80's shared memory
            # for 16-bit caches)
            assert r.min_blocks == (2 if r.instance.endswith(", 1>") else 1), r
        elif r.instance.startswith("cupykv_attention_mma<") and r.instance.endswith(", 2>"):
            assert r.min_blocks == 2, r   # attention_mma_min_blocks<T, 2>(): 2 (sm_80's shared memory)
        elif r.instance.startswith("cupykv_attention_mma<") and r.instance.endswith(", 4>"):
            assert r.min_blocks == 1, r   # attention_mma_min_blocks<T, 4>(): 1 (sm_80's shared memory)
        elif r.instance.startswith("cupykv_attention_mma<"):   # attention_mma_min_blocks<T, 1>(): 3 for 16-bit,
            fp8_blocks = 4   # fp8: what sm_80's shared memory fits (sm_90's fits 5; registers at head_dim 64 do not)
            assert r.min_blocks == (fp8_blocks if "__nv_fp8_e4m3" in r.instance else 3), r
        elif r.instance.startswith("cupykv_linear<"):
            assert r.min_blocks == 4, r
        elif r.instance.startswith("cupykv_linear_mma<"):   # 2 blocks of 8 warps: 64 KB of weight in flight per SM
            assert r.min_blocks == 2, r
        assert not row.below_minimum, (r, row.occupancy)


PERFORMANCE_DOC = Path(__file__).parents[1] / "docs" / "performance.md"


def _bytes_in_flight_per_block(head_dim: int, fp8: bool) -> int:
    """K/V bytes a block of attention_mma keeps in flight: its key warps x the steps a key warp has in
    flight while it computes one (kStagesFp8 - 1 or kStages - 1) x K and V of kStepKeys rows."""
    mma = KERNELS["attention_mma"].constants("attention_mma_tiling")
    itemsize, ahead = (1, mma["kStagesFp8"] - 1) if fp8 else (2, mma["kStages"] - 1)
    return mma[f"kWarps{head_dim}"] * ahead * 2 * mma["kStepKeys"] * head_dim * itemsize


def _docs_table():
    """Rows of docs/performance.md's occupancy table: (instance pattern, {arch: (registers, blocks)})."""
    text = PERFORMANCE_DOC.read_text()
    types = {"bf16": "__nv_bfloat16", "half": "__half", "float": "float", "T": None}
    rows = []
    for match in re.finditer(r"^\| (attention_mma|attention|linear_mma|linear)<(\w+), (\d+)(?:, (\d+))?>[^|]*\| (\d+) \| (\d+) "
                             r"\| (\d+) \| (\d+) \|$", text, re.M):
        kernel, t, size, row_tiles, r80, b80, r90, b90 = match.groups()
        size = f"{size}, {row_tiles}" if row_tiles else size   # attention_mma: head_dim, row tiles
        rows.append((kernel, types[t], size, {"sm_80": (int(r80), int(b80)), "sm_90": (int(r90), int(b90))}))
    for match in re.finditer(r"^\| attention_f32<(\d+)>[^|]*\| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M):
        size, r80, b80, r90, b90 = match.groups()   # float32 only: no type argument
        rows.append(("attention_f32", "", size, {"sm_80": (int(r80), int(b80)), "sm_90": (int(r90), int(b90))}))
    return rows


def _assert_documented_occupancy(what: str, found, documented_registers: tuple[int, int], documented_blocks: int):
    """A documented occupancy row against the check's rows ``found`` (one instance, or the io types of one):

    - the fewest and the most registers are the documented range's ends within the drift ptxas shows
      between hosts (tests/compiler_drift.py);
    - the documented blocks per SM are what either end of the documented range gives at the
      instances' threads and shared memory, exactly;
    - and, when this host's registers are the documented ones, what the check computed.
    """
    counts = sorted({row.report.registers for row in found})
    fewest, most = documented_registers
    assert_registers_near(what if len(counts) == 1 else f"{what}: the fewest", counts[0], fewest)
    if len(counts) > 1 or most != fewest:
        assert_registers_near(f"{what}: the most", counts[-1], most)
    for registers in documented_registers:
        expected = occupancy.blocks_per_sm(occupancy.LIMITS[found[0].report.arch], registers, found[0].shape.threads,
                                           max(row.shared_bytes for row in found))
        assert expected.blocks == documented_blocks, (what, registers)
    if (counts[0], counts[-1]) == documented_registers:
        assert {row.occupancy.blocks for row in found} == {documented_blocks}, what


def test_the_occupancy_table_in_the_docs_is_what_the_check_computes(reports):
    rows = _docs_table()
    assert len(rows) >= 17
    assert {size for kernel, _, size, _ in rows if kernel == "attention_mma"} == {
        f"{head_dim}, {tiles}" for head_dim in (64, 96, 128, 256) for tiles in (1, 2, 4) if tiles < 4 or head_dim < 256}
    assert {size for kernel, _, size, _ in rows if kernel == "attention_f32"} == {"32", "64", "128", "256"}
    computed = {(row.report.arch, row.report.instance): row for row in occupancy.rows(reports)}
    for kernel, cuda_type, size, by_arch in rows:
        for cuda in ([cuda_type] if cuda_type is not None else ["float", "__half", "__nv_bfloat16"]):
            # attention kernels take the cache type and the io type (the same but for fp8 caches)
            instance = (f"cupykv_{kernel}<{size}>" if kernel == "attention_f32"
                        else f"cupykv_{kernel}<{cuda}, {size}>" if kernel.startswith("linear")
                        else f"cupykv_{kernel}<{cuda}, {cuda}, {size}>")
            for arch, (documented_registers, documented_blocks) in by_arch.items():
                _assert_documented_occupancy(f"{instance} on {arch}", [computed[(arch, instance)]],
                                             (documented_registers, documented_registers), documented_blocks)


def test_the_one_tile_fp8_occupancy_table_in_the_docs_is_what_the_check_computes(reports):
    """docs/performance.md's one-tile fp8 table: registers (fewest to most over the io types, one
    figure when they agree) and blocks per SM, the same for every io type, and bytes in flight =
    blocks x key warps x the kStagesFp8 - 1 steps (K and V of 16 keys, a byte each) a warp has in
    flight while it computes one."""
    text = PERFORMANCE_DOC.read_text()
    rows = re.findall(r"^\| attention_mma<fp8, any io, (\d+), 1> \| (\d+(?:-\d+)?) \| (\d+)[^|]*\| (\d+(?:-\d+)?) \| "
                      r"(\d+)[^|]*\| (\d+) KB / (\d+) KB \|$", text, re.M)
    assert sorted(int(row[0]) for row in rows) == [64, 96, 128, 256]
    computed = {(row.report.arch, row.report.instance): row for row in occupancy.rows(reports)}
    for head_dim, r80, b80, r90, b90, kb80, kb90 in rows:
        per_block = _bytes_in_flight_per_block(int(head_dim), fp8=True)
        for arch, registers, blocks, kb in (("sm_80", r80, b80, kb80), ("sm_90", r90, b90, kb90)):
            found = [computed[(arch, f"cupykv_attention_mma<__nv_fp8_e4m3, {io}, {head_dim}, 1>")]
                     for io in ("__nv_bfloat16", "__half", "float")]
            fewest, _, most = registers.partition("-")
            _assert_documented_occupancy(f"attention_mma<fp8, any io, {head_dim}, 1> on {arch}", found,
                                         (int(fewest), int(most or fewest)), int(blocks))
            assert int(blocks) * per_block == int(kb) * 1024, (head_dim, arch)


def kernel_dir_with(tmp_path, filename, source):
    """A kernel folder in ``tmp_path``: every header of cupykv's kernels, and ``source`` as ``filename``."""
    for header in Path(KERNEL_DIR).glob("*.cuh"):
        (tmp_path / header.name).write_text(header.read_text())
    (tmp_path / filename).write_text(source)
    return str(tmp_path)


def _report_exit(reports):
    import contextlib
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = nvrtc_check.report(reports)
    return code, stdout.getvalue(), stderr.getvalue()


def test_a_planted_low_register_occupancy_fails():
    planted = nvrtc_check.InstanceReport("sm_80", "cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128>", registers=168, stack_bytes=0,
                                         spill_store_bytes=0, spill_load_bytes=0, shared_bytes=0, max_threads=128,
                                         min_blocks=4)
    code, stdout, stderr = _report_exit([planted])
    assert code == 1
    assert "BELOW MINIMUM" in stdout
    assert ("FAILED, occupancy below the design minimum in 1 instance(s): cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128> "
            "(sm_80): 3 blocks/SM, limited by registers (168 registers, 16576 bytes of shared memory), but "
            "__launch_bounds__ declares 4") in stderr
    fine = nvrtc_check.InstanceReport("sm_80", "cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128>", 128, 0, 0, 0, 0, 128, 4)
    assert _report_exit([fine])[0] == 0


def test_the_occupancy_table_lines_its_columns_up_under_the_header():
    reports = [nvrtc_check.InstanceReport("sm_80", "cupykv_linear<float, 1>", 40, 0, 0, 0, 0, 128, 4),
               nvrtc_check.InstanceReport("sm_90", "cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128>", 64, 0, 0,
                                          0, 0, 128, 4)]
    header, *lines = occupancy.format_rows(occupancy.rows(reports)).splitlines()
    registers_end = header.index("regs") + len("regs")
    assert len(lines) == 2
    for line, report in zip(lines, reports):
        assert line.startswith(f"{report.arch}  {report.instance} ")
        assert line[:registers_end].endswith(f" {report.registers}"), (header, line)   # right-aligned under "regs"


def test_an_instance_that_does_not_fit_an_sm_fails_without_a_declared_minimum():
    # 150 KB of static shared memory plus attention's 16576 dynamic bytes: past sm_80's 163 KB a block,
    # so no block is ever resident there, whatever __launch_bounds__ says (here: nothing)
    planted = nvrtc_check.InstanceReport("sm_80", "cupykv_attention<__nv_bfloat16, __nv_bfloat16, 128>", registers=64,
                                         stack_bytes=0, spill_store_bytes=0, spill_load_bytes=0,
                                         shared_bytes=150 * 1024, max_threads=None, min_blocks=None)
    (row,) = occupancy.rows([planted])
    assert row.occupancy.blocks == 0 and row.below_minimum
    code, stdout, stderr = _report_exit([planted])
    assert code == 1 and "BELOW MINIMUM" in stdout and "0 blocks/SM, limited by shared" in stderr


@pytest.mark.parametrize("blocks, min_blocks, below", [(1, None, False), (1, 0, False), (0, None, True),
                                                      (3, 3, False), (2, 3, True), (4, 3, False)])
def test_below_minimum_is_fewer_blocks_than_declared_or_than_one(blocks, min_blocks, below):
    # without a declared minimum (or with 0) one resident block is enough; with one, exactly that many
    report = nvrtc_check.InstanceReport("sm_90", "cupykv_linear<float, 1>", 32, 0, 0, 0, 0, 128, min_blocks)
    limits = occupancy.Occupancy(blocks, by_registers=blocks, by_threads=16, by_blocks=32, by_shared=20)
    row = occupancy.OccupancyRow(report, occupancy.launch_shape(report.instance), limits)
    assert row.below_minimum is below


@pytest.mark.parametrize("instance, note", [
    ("cupykv_attention_f32<64>", "head_dim 64, staged K/V"),
    ("cupykv_attention<__half, __half, 128>", "head_dim 128"),
    ("cupykv_attention<__half, __half, 0>", f"head_dim {occupancy.GENERIC_HEAD_DIM} (generic: its largest)"),
    ("cupykv_attention_mma<__half, __half, 128, 1>", "head_dim 128, tensor cores, 16 rows"),
    ("cupykv_attention_mma<__nv_fp8_e4m3, __nv_bfloat16, 64, 2>", "head_dim 64, tensor cores, 32 rows"),
    ("cupykv_linear<float, 1>", ""), ("cupykv_linear_mma<__half, 16>", "tensor cores"),
])
def test_each_instance_family_is_noted_by_what_sets_its_launch(instance, note):
    # the occupancy table's last column: the numbers come from the instance's own template arguments
    assert occupancy.launch_shape(instance).note == note


def test_kernels_outside_attention_and_linear_have_no_launch_shape():
    assert occupancy.launch_shape("cupykv_add<float>") is None
    assert occupancy.launch_shape("cupykv_rmsnorm<__half>") is None


def test_a_planted_shared_memory_tile_that_drops_occupancy_fails(tmp_path):
    """The real generic attention source with 16 KB more static shared memory per block (a deeper
    cp.async pipeline, say): registers still allow 5 blocks on sm_80, shared memory (with the
    24784 dynamic bytes of head_dim 256) only 3, under the 4 its __launch_bounds__ declares."""
    source = KERNELS["attention"].source()
    anchor = "    extern __shared__ float smem[];\n"
    assert source.count(anchor) == 1
    planted = source.replace(anchor, anchor + "    __shared__ float planted_stage[4096];   // 16 KB\n"
                                              "    planted_stage[tid * 32] = 0.0f;\n    __syncthreads();\n"
                                              "    if (planted_stage[(tid * 32 + 32) % 4096] != 0.0f) __trap();\n")
    bf16 = KernelFile("attention.cu", ("cupykv_attention<__nv_bfloat16, __nv_bfloat16, 0>",))
    reports = nvrtc_check.check_all(archs=("sm_80",), kernels=[bf16],
                                    kernel_dir=kernel_dir_with(tmp_path, "attention.cu", planted))
    (row,) = occupancy.rows(reports)
    assert row.report.shared_bytes >= 16384 and row.occupancy.limiter == "shared" and row.occupancy.blocks == 3
    code, _, stderr = _report_exit(reports)
    assert code == 1
    assert "cupykv_attention<__nv_bfloat16, __nv_bfloat16, 0> (sm_80): 3 blocks/SM, limited by shared" in stderr


@pytest.mark.parametrize("threads", [1025, 2048])
def test_launch_bounds_past_the_threads_a_block_may_have_fail_though_nvrtc_accepts_them(tmp_path, threads):
    """argmax.cu with its ``__launch_bounds__(1024)`` raised: NVRTC compiles it and writes the number into
    the PTX, and only a launch on the GPU would fail, so the check refuses it by instance and arch."""
    source = KERNELS["argmax"].source()
    assert source.count("__launch_bounds__(1024)") == 1
    planted = source.replace("__launch_bounds__(1024)", f"__launch_bounds__({threads})")
    argmax = KernelFile("argmax.cu", ("cupykv_argmax<float>",))
    (report,) = nvrtc_check.check_all(archs=("sm_90",), kernels=[argmax],
                                      kernel_dir=kernel_dir_with(tmp_path, "argmax.cu", planted))
    assert report.max_threads == threads and not report.spills
    code, _, stderr = _report_exit([report])
    assert code == 1
    assert (f"FAILED, __launch_bounds__ above the threads a block may have in 1 instance(s): cupykv_argmax<float> "
            f"(sm_90): {threads} threads, at most 1024") in stderr
    assert _report_exit([replace(report, max_threads=1024)])[0] == 0


def test_the_two_and_four_row_tile_bytes_in_flight_in_the_docs_follow_the_check(reports):
    """docs/performance.md's tables of two- and four-row-tile blocks: blocks per SM as the check
    computes them, and bytes in flight = blocks x key warps x the steps a key warp has in flight (K
    and V of 16 keys; the two row groups of a four-tile block share them)."""
    text = PERFORMANCE_DOC.read_text()
    rows = re.findall(r"^  \| (16-bit|fp8), head_dim (\d+)(?:, (4) tiles)? \| (\d+) / (\d+)[^|]*\| (\d+) KB / (\d+) KB \|$",
                      text, re.M)
    assert sorted((kind, head_dim, tiles or "2") for kind, head_dim, tiles, *_ in rows) == sorted(
        (kind, head_dim, tiles) for kind in ("16-bit", "fp8") for head_dim in ("64", "128") for tiles in ("2", "4"))
    computed = {(row.report.arch, row.report.instance): row.occupancy.blocks for row in occupancy.rows(reports)}
    for kind, head_dim, tiles, b80, b90, kb80, kb90 in rows:
        head_dim = int(head_dim)
        types = "__nv_fp8_e4m3, __nv_bfloat16" if kind == "fp8" else "__nv_bfloat16, __nv_bfloat16"
        instance = f"cupykv_attention_mma<{types}, {head_dim}, {tiles or 2}>"
        per_block = _bytes_in_flight_per_block(head_dim, fp8=kind == "fp8")
        for arch, blocks, kb in (("sm_80", b80, kb80), ("sm_90", b90, kb90)):
            assert computed[(arch, instance)] == int(blocks), (instance, arch)
            assert int(blocks) * per_block == int(kb) * 1024, (instance, arch)
