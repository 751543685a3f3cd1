"""What the backends hand to their compilers, and where the CUDA files come from.

CuPy's disk cache keys a module on its source text, options and name
expressions, not on the headers that text includes: the text must therefore
change whenever a header does. A GPU extra must bring everything NVRTC needs on
a machine that has only the NVIDIA driver.
"""
import importlib.metadata
import os
import shutil

import pytest

from cupykv.backends.base import Backend
from cupykv.kernels import KERNEL_DIR, KERNELS, cuda_include_dirs, header_digest


@pytest.fixture
def kernel_copy(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return copy


@pytest.mark.parametrize("header", ["common.cuh", "elementwise.cuh"])
def test_a_header_change_changes_every_module_source(kernel_copy, header):
    before = {op: kernel.module_source(str(kernel_copy)) for op, kernel in KERNELS.items()}
    with open(kernel_copy / header, "a", encoding="utf-8") as f:
        f.write("// an edit\n")
    for op, kernel in KERNELS.items():
        assert kernel.source(str(kernel_copy)) == kernel.source()          # the .cu text is unchanged
        assert kernel.module_source(str(kernel_copy)) != before[op], op    # what the compiler sees is not


def test_module_source_is_the_file_plus_one_comment_line():
    kernel = KERNELS["attention"]
    text = kernel.module_source()
    assert text.startswith(kernel.source())
    assert text[len(kernel.source()):] == f"\n// cupykv headers sha256 {header_digest()}\n"


def test_the_digest_covers_only_headers(kernel_copy):
    before = header_digest(str(kernel_copy))
    with open(kernel_copy / "advance.cu", "a", encoding="utf-8") as f:
        f.write("// a .cu edit changes the source itself\n")
    assert header_digest(str(kernel_copy)) == before
    (kernel_copy / "new_helpers.cuh").write_text("#pragma once\n")
    assert header_digest(str(kernel_copy)) != before


class _RecordingBackend(Backend):
    name = "recording"

    def __init__(self):
        super().__init__()
        self.compiled = []

    def _compile(self, filename, source, instances):
        self.compiled.append((filename, source, tuple(instances)))
        return _Module()


class _Module:
    def get_function(self, instance):
        return lambda *args, **kwargs: None


def test_backends_compile_the_module_source():
    backend = _RecordingBackend()
    backend.kernel("advance", "cupykv_advance")
    assert backend.compiled == [("advance.cu", KERNELS["advance"].module_source(), KERNELS["advance"].instances)]


def test_the_cupy_backend_passes_the_module_source_to_rawmodule():
    # RawModule compiles lazily, so building one needs no GPU; its .code is CuPy's cache key text.
    from cupykv.backends import cupy_backend   # cupy-cuda13x is part of the test extra
    kernel = KERNELS["append"]
    module = cupy_backend.CupyBackend()._compile(kernel.filename, kernel.module_source(), kernel.instances)
    assert module.code == kernel.module_source()
    include = [opt[2:] for opt in module.options if opt.startswith("-I")]
    assert KERNEL_DIR in include
    assert any(os.path.exists(os.path.join(d, "cuda_fp16.h")) for d in include)


def _extra_requirements(extra):
    marker = f'extra == "{extra}"'
    return [r.split(";")[0].strip() for r in importlib.metadata.requires("cupykv") if marker in r]


def _distribution_name(requirement):
    for separator in "=<>!~[ ":
        requirement = requirement.split(separator)[0]
    return requirement


def test_the_cuda13_extra_brings_nvrtc_and_the_headers_it_needs():
    # The test extra installs the same distributions, so their file lists can be read here.
    shipped = {}
    for requirement in _extra_requirements("cuda13"):
        name = _distribution_name(requirement)
        if name.startswith("nvidia-"):
            shipped[name] = {os.path.basename(str(f)) for f in importlib.metadata.files(name)}
    files = set().union(*shipped.values())
    assert {"cuda_fp16.h", "cuda_bf16.h", "cuda_fp16.hpp", "cuda_bf16.hpp"} <= files, sorted(shipped)
    assert any(f.startswith("libnvrtc.so") for f in files)
    assert any(f.startswith("libnvrtc-builtins.so") for f in files)
    assert any(_distribution_name(r) == "cupy-cuda13x" for r in _extra_requirements("cuda13"))


def test_the_cuda12_extra_names_the_cuda12_nvrtc_and_runtime_wheels():
    names = {_distribution_name(r) for r in _extra_requirements("cuda12")}
    assert {"cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"} <= names


def test_the_headers_are_found_in_the_runtime_wheel():
    wheel_dirs = [d for d in cuda_include_dirs() if os.sep + "nvidia" + os.sep in d]
    assert wheel_dirs, cuda_include_dirs()
    assert os.path.exists(os.path.join(wheel_dirs[0], "cuda_bf16.h"))
