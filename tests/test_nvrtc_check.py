"""The offline NVRTC check: every kernel instance compiles for sm_80 and sm_90 without spills."""
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


def test_a_compile_error_fails_with_the_compiler_log():
    lib = nvrtc_check.load_nvrtc()
    source = "__global__ void broken(float* x) { x[0] = undeclared_name; }\n"
    with pytest.raises(nvrtc_check.NvrtcError, match="undeclared_name"):
        nvrtc_check.compile_file(lib, "broken.cu", source, ["broken"], "sm_80")


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
    lib = nvrtc_check.load_nvrtc()
    lowered, log = nvrtc_check.compile_file(lib, "spiller.cu", source, ["spiller"], "sm_80")
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
