"""The offline NVRTC check: every kernel instance compiles for sm_80 and sm_90 without spills.

The verdict is reproducible: the test extra pins the NVRTC wheel, and CI also
runs the check under a second, older pinned NVRTC (``.ci/run`` installs it and
sets ``CUPYKV_SECOND_NVRTC``), so no instance sits at the edge of one
allocator's choices.
"""
import importlib.metadata
import os
import subprocess
import sys

import pytest

from cupykv import nvrtc_check
from cupykv.kernels import KERNELS


@pytest.fixture(scope="module")
def reports():
    return nvrtc_check.check_all()


def test_every_instance_compiles_for_both_archs_without_spills(reports):
    expected = {(arch, inst) for arch in nvrtc_check.ARCHS for k in KERNELS.values() for inst in k.instances}
    assert {(r.arch, r.instance) for r in reports} == expected
    spilled = [(r.arch, r.instance) for r in reports if r.spills]
    assert spilled == []
    assert all(0 < r.registers <= 255 for r in reports)


def test_command_line_prints_the_table_and_succeeds():
    result = subprocess.run([sys.executable, "-m", "cupykv", "check"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "cupykv_attention<__nv_bfloat16, 128>" in result.stdout
    assert "no spills" in result.stdout
    major, minor = nvrtc_check.PINNED_NVRTC.split(".")[:2]
    assert f"NVRTC {major}.{minor} (nvidia-cuda-nvrtc {nvrtc_check.PINNED_NVRTC}) from " in result.stdout
    assert "-ftz=true" in result.stdout.splitlines()[0]


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
    assert "no spills" in result.stdout


def test_an_explicit_library_that_does_not_exist_fails_clearly(tmp_path):
    with pytest.raises(nvrtc_check.NvrtcError, match="no libnvrtc.so under"):
        nvrtc_check.load_nvrtc(str(tmp_path))


def test_a_compile_error_fails_with_the_compiler_log():
    nvrtc = nvrtc_check.load_nvrtc()
    source = "__global__ void broken(float* x) { x[0] = undeclared_name; }\n"
    with pytest.raises(nvrtc_check.NvrtcError, match="undeclared_name"):
        nvrtc_check.compile_file(nvrtc, "broken.cu", source, ["broken"], "sm_80")


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
    assert "spiller (sm_80)" in _failure_line([report])


def _failure_line(reports):
    import contextlib
    import io
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        nvrtc_check.report(reports)
    return stderr.getvalue()
