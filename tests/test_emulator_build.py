"""The emulator's platform check and build cache: clear errors before compiling, one build per
module across processes, temporaries of killed builds swept, a compile time limit."""

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from cupykv.backends import emulator as E
from cupykv.backends.emulator import build, diskcache, host


def _kernel(tag):
    """A tiny kernel source that no other test compiles (``tag`` makes its cache key unique)."""
    return f"// {tag}\n__global__ void k(int* x) {{ x[threadIdx.x] = 3 * threadIdx.x; }}\n"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder holding only the runtime already built (so that only modules compile)."""
    runtime = build.runtime()._name
    folder = tmp_path / "emulator"
    folder.mkdir()
    shutil.copy(runtime, folder)
    monkeypatch.setenv("CUPYKV_CACHE_DIR", str(tmp_path))
    return folder


# ---- platform ----------------------------------------------------------------------------
def test_other_architecture_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(host.platform, "machine", lambda: "aarch64")
    compiles = build.stats["compiles"]
    with pytest.raises(E.PlatformError, match=r"needs x86-64 Linux .*this machine is Linux aarch64"):
        E.Module(_kernel("aarch64"), ["k"])
    assert build.stats["compiles"] == compiles


def test_other_os_is_refused(monkeypatch):
    monkeypatch.setattr(host.platform, "system", lambda: "Darwin")
    with pytest.raises(E.PlatformError, match="this machine is Darwin"):
        build.check_platform()


def test_no_gxx_on_path(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "CXX", "g++")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(E.PlatformError, match=r"'g\+\+' is not on PATH"):
        E.Module(_kernel("no g++"), ["k"])


def _fake_compiler(folder, macros):
    script = folder / "g++"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '#define {m}'\n" for m in macros))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("macros, match", [
    (["__GNUC__ 7", "__GNUC_MINOR__ 5"], "is GCC 7.5, older than 9"),
    (["__GNUC__ 4", "__clang__ 1"], "is not GCC"),
])
def test_old_or_foreign_compiler(monkeypatch, tmp_path, macros, match):
    _fake_compiler(tmp_path, macros)
    monkeypatch.setattr(build, "CXX", "g++")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(E.PlatformError, match=match):
        build.check_platform()


def test_platform_error_is_a_user_error():
    from cupykv.errors import BackendUnavailableError, UserError
    assert issubclass(E.PlatformError, BackendUnavailableError) and issubclass(E.PlatformError, UserError)
    assert issubclass(E.PlatformError, E.EmulatorError)


# ---- build cache -------------------------------------------------------------------------
def test_stale_temporaries_are_swept(fresh_cache):
    old = time.time() - 2 * diskcache.stale_after()
    stale_file = fresh_cache / "mod-0123.abcd.tmp.so"
    stale_dir = fresh_cache / "mod-4567.efgh.tmp"
    legacy_dir = fresh_cache / "cuemu-x1y2z3"
    fresh_file = fresh_cache / "mod-89ab.ijkl.tmp.so"   # another build may own it: kept
    for path in (stale_dir, legacy_dir):
        path.mkdir()
        (path / "kernel.cpp").write_text("int x;")
    stale_file.write_bytes(b"half a library")
    fresh_file.write_bytes(b"half a library")
    for path in (stale_file, stale_dir, legacy_dir):
        os.utime(path, (old, old))
    E.Module(_kernel("sweep"), ["k"])
    assert not stale_file.exists() and not stale_dir.exists() and not legacy_dir.exists()
    assert fresh_file.exists()
    assert len(list(fresh_cache.glob("cuemu-runtime-*.so"))) == 1   # the artifacts stay


def test_temporaries_of_the_same_module_are_swept_at_once(fresh_cache):
    """Under a module's lock no live process owns its temporaries: a killed build's are deleted."""
    source = _kernel("same module")
    E.Module(source, ["k"])
    (path,) = fresh_cache.glob("mod-*.so")
    leftover = fresh_cache / f"{diskcache.temporary_prefix(path)}killed.tmp.so"
    leftover.write_bytes(b"half a library")
    path.unlink()
    build.clear_memory_cache()
    E.Module(source, ["k"])
    assert path.exists() and not leftover.exists()


CONCURRENT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from cupykv.backends import emulator as E
    from cupykv.backends.emulator import build
    start = float(sys.argv[1])
    time.sleep(max(0.0, start - time.time()))    # both processes start compiling together
    mod = E.Module(sys.argv[2], ["k"])
    x = E.zeros(8, np.int32)
    mod.get_function("k")(1, 8, (x,))
    assert x.tolist() == [3 * i for i in range(8)], x
    print(build.stats["compiles"])
""")


def test_two_processes_compile_a_module_once(fresh_cache):
    env = dict(os.environ, CUPYKV_CACHE_DIR=str(fresh_cache.parent))
    start = time.time() + 3.0
    source = _kernel(f"concurrent {start}")
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(start), source], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    assert sorted(int(out.split()[-1]) for out, _ in results) == [0, 1]   # one compiled, the other waited
    assert len(list(fresh_cache.glob("mod-*.so"))) == 1
    assert not [p.name for p in fresh_cache.iterdir() if p.name.endswith((".tmp", ".tmp.so"))]


def test_compile_timeout(fresh_cache, monkeypatch):
    monkeypatch.setenv(host.COMPILE_TIMEOUT_ENV, "0.01")
    with pytest.raises(E.CompileError, match=r"did not finish compiling slow\.cu within 0\.01 s \(set "
                                             r"CUPYKV_EMULATOR_COMPILE_TIMEOUT"):
        E.Module(_kernel("timeout"), ["k"], filename="slow.cu")
    assert not [p.name for p in fresh_cache.iterdir() if p.name.endswith((".tmp", ".tmp.so"))]
    assert not list(fresh_cache.glob("mod-*.so"))


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_compile_timeout_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv(host.COMPILE_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"CUPYKV_EMULATOR_COMPILE_TIMEOUT: expected a number of seconds > 0, "
                                         f"got '{value}'"):
        host.compile_timeout()


def test_module_still_runs_after_the_checks(fresh_cache):
    mod = E.Module(_kernel("runs"), ["k"])
    x = E.zeros(4, np.int32)
    mod.get_function("k")(1, 4, (x,))
    assert x.tolist() == [0, 3, 6, 9]


# ---- copies past an object, found by g++ -----------------------------------------------------
# Bit-casts a 16-byte vector into a local array, as the kernels' vector loads do, with the copy size
# as a macro. A size of 17 writes one byte past `raw` and reads one past `packed`: on a GPU both
# pass silently, and neither the bounds sanitizer (indices) nor the guards (global and shared
# memory) see a local object's end.
VECTOR_COPY = """
struct Vec16 { unsigned a, b, c, d; };
__global__ void unpack(float* out, const Vec16* in) {
  const Vec16 packed = in[threadIdx.x];
  float raw[4];
  memcpy(raw, &packed, COPY_BYTES);
  for (int e = 0; e < 4; ++e) out[threadIdx.x * 4 + e] = raw[e];
}
"""


def test_a_copy_past_a_local_object_does_not_build(fresh_cache):
    with pytest.raises(E.CompileError, match=r"(?s)failed to compile copy\.cu.*copy\.cu:6:\d+: error: .*writing 17 bytes "
                                             r"into a region of size 16 overflows the destination"):
        E.Module(VECTOR_COPY, ["unpack"], options=("-DCOPY_BYTES=17",), filename="copy.cu")
    module = E.Module(VECTOR_COPY, ["unpack"], options=("-DCOPY_BYTES=16",), filename="copy.cu")
    out = E.zeros(8, np.float32)
    module.get_function("unpack")(1, 2, (out, E.asarray(np.arange(8, dtype=np.float32).view(np.uint32))))
    assert out.tolist() == list(range(8))


@pytest.mark.skipif(host.gcc_major(build.CXX) < 11, reason="g++ finds overreads from version 11")
def test_a_copy_reading_past_its_source_does_not_build(fresh_cache):
    source = VECTOR_COPY.replace("float raw[4];", "float raw[5];")   # room for 17 bytes: only the read overruns
    with pytest.raises(E.CompileError, match=r"(?s)copy\.cu:6:\d+: error: .*reading 17 bytes from a region of size 16"):
        E.Module(source, ["unpack"], options=("-DCOPY_BYTES=17",), filename="copy.cu")


# ---- what the cache keys cover ------------------------------------------------------------
HEADER_USER = '#include "value.cuh"\n#ifndef OFFSET\n#define OFFSET 0\n#endif\n' \
              '__global__ void k(int* x) { x[threadIdx.x] = VALUE + OFFSET; }\n'


def _value(module):
    x = E.zeros(1, np.int32)
    module.get_function("k")(1, 1, (x,))
    return int(x[0])


def test_a_changed_header_or_define_builds_another_module(fresh_cache, tmp_path):
    """A stale module would return the old value: the header's bytes and the -D options are in the key."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "value.cuh").write_text("#define VALUE 1\n")
    assert _value(E.Module(HEADER_USER, ["k"], include_dirs=[include])) == 1
    (include / "value.cuh").write_text("#define VALUE 2\n")
    assert _value(E.Module(HEADER_USER, ["k"], include_dirs=[include])) == 2
    assert _value(E.Module(HEADER_USER, ["k"], include_dirs=[include], options=("-DOFFSET=10",))) == 12
    assert _value(E.Module(HEADER_USER, ["k"], include_dirs=[include], options=("-D", "OFFSET=20"))) == 22
    assert len(list(fresh_cache.glob("mod-*.so"))) == 4


@pytest.mark.parametrize("options, value", [
    (("--define-macro=OFFSET=30",), 31), (("--define-macro", "OFFSET=40"), 41), (("-DOFFSET=50", "-UOFFSET"), 1),
    (("--include-path=other",), 7), (("--include-path", "other"), 7), (("-Iother",), 7),
])
def test_nvrtcs_spellings_of_defines_and_include_paths_reach_the_host_compiler(fresh_cache, tmp_path, monkeypatch,
                                                                                options, value):
    """Every NVRTC spelling of -D, -U and -I that CuPy may pass works on the emulator as under NVRTC. An
    include path relative to the process's directory is found (the build itself runs in a temporary one),
    and the headers of an -I option's folder are in the module's key, as those of ``include_dirs`` are."""
    monkeypatch.chdir(tmp_path)
    for folder, header in (("include", "#define VALUE 1\n"), ("other", "#define VALUE 7\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "value.cuh").write_text(header)
    searches_other = any("other" in o for o in options)
    include_dirs = [] if searches_other else ["include"]
    assert _value(E.Module(HEADER_USER, ["k"], include_dirs=include_dirs, options=options)) == value
    if searches_other:
        (tmp_path / "other" / "value.cuh").write_text("#define VALUE 8\n")
        assert _value(E.Module(HEADER_USER, ["k"], include_dirs=include_dirs, options=options)) == 8


# ---- the other NVRTC options ------------------------------------------------------------------
CONSTANT_USER = HEADER_USER.replace('#include "value.cuh"', "#define VALUE 1")   # no header to find


@pytest.mark.parametrize("options, named, complaint", [
    (("-use_fast_math",), 0, "it replaces expf, sinf, division and square root by approximations the emulator "
                             "does not reproduce"),
    (("--use_fast_math",), 0, "it replaces expf, sinf, division and square root by approximations"),
    (("-ftz=false",), 0, "fibers always flush fp32 subnormals to zero, as the -ftz=true code CuPy compiles does"),
    (("--ftz=false",), 0, "fibers always flush fp32 subnormals to zero"),
    (("-prec-div=false",), 0, "the emulator divides in IEEE round-to-nearest, as -prec-div=true does"),
    (("--prec-sqrt=false",), 0, "the emulator takes square roots in IEEE round-to-nearest"),
    (("-include", "extra.h"), 0, "the emulator compiles only the source and the headers it includes"),
    (("--pre-include=extra.h",), 0, "the emulator compiles only the source and the headers it includes"),
    (("-ftz=yes",), 0, "expected -ftz=true or -ftz=false, got 'yes'"),
    (("-fmad",), 0, "expected -fmad=true or -fmad=false, got no value"),
    (("-std=c++23",), 0, "expected one of c++03, c++11, c++14, c++17, c++20, got 'c++23'"),
    (("--std=gnu++17",), 0, "expected one of c++03, c++11, c++14, c++17, c++20, got 'gnu++17'"),
    (("-DOFFSET=1", "-D"), 1, "expected a value after it"),
    (("--include-path",), 0, "expected a value after it"),
])
def test_an_nvrtc_option_the_emulator_cannot_honour_is_refused_before_anything_builds(fresh_cache, options, named,
                                                                                     complaint):
    """An option that would make the GPU compute what the emulator does not (fast math, subnormals kept,
    approximate division or square root, a pre-included header), or one NVRTC would refuse for its value,
    fails by name before the host compiler runs: a pass on the emulator would say nothing of the GPU."""
    with pytest.raises(E.CompileError) as refused:
        E.Module(CONSTANT_USER, ["k"], options=options)
    assert str(refused.value).startswith(f"emulator: NVRTC option {options[named]!r}: {complaint}"), refused.value
    assert not list(fresh_cache.glob("mod-*.so"))


def test_nvrtc_options_without_effect_on_what_a_kernel_computes_change_nothing(fresh_cache):
    """The target, ptxas's and the optimizer's settings, debug and line information, the diagnostics, the
    values of -ftz, -prec-div and -prec-sqrt the emulator models, -fmad either way, and a dialect up to
    C++17 are taken without a warning, and build the very module no option does."""
    without = [
        "-arch=sm_90", "--gpu-architecture=compute_80", "-lineinfo", "--generate-line-info", "-G",
        "-Xptxas=-v", "--ptxas-options=-O3", "-maxrregcount=64", "--dopt=on", "-rdc=false",
        "-ftz=true", "--prec-div=true", "-prec-sqrt=true", "-fmad=false", "--fmad=true",
        "--device-as-default-execution-space", "-default-device", "-w", "--diag-suppress=177",
        "-std=c++17", "--std=c++14", "-std", "c++11", "--extra-device-vectorization", "-dlto",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        taken = E.Module(CONSTANT_USER, ["k"], options=without)
    assert _value(taken) == 1
    assert taken.path == E.Module(CONSTANT_USER, ["k"]).path   # the same key


def test_an_nvrtc_option_the_emulator_does_not_know_is_ignored_with_a_warning_at_the_callers_line(fresh_cache):
    with pytest.warns(E.EmulatorOptionWarning) as caught:
        module = E.Module(CONSTANT_USER, ["k"], options=("-lineinfo", "--some-future-option=3"))
    assert [str(w.message) for w in caught] == [
        "emulator: NVRTC option '--some-future-option=3' is not one the emulator knows; it was ignored"]
    assert caught[0].filename == __file__   # stacklevel: the Module(...) call, not the emulator's code
    assert _value(module) == 1


CXX20_USER = "consteval int twice(int v) { return 2 * v; }\n" \
             "__global__ void k(int* x) { x[threadIdx.x] = twice(21); }\n"


def test_std_cxx20_reaches_the_host_compiler(fresh_cache):
    """A dialect above C++17 is the host compiler's too: code that needs it builds with it, and fails to
    build without it (the emulator's headers need C++17, which also compiles code written for 11 and 14)."""
    assert _value(E.Module(CXX20_USER, ["k"], options=("-std=c++20",))) == 42
    assert _value(E.Module(CXX20_USER, ["k"], options=("--std", "c++20"))) == 42
    with pytest.raises(E.CompileError, match="consteval"):
        E.Module(CXX20_USER, ["k"], options=("-std=c++14",))


UNRESTRICTED = "__global__ void scale(float* out, const float* in) { out[threadIdx.x] = 3.0f * in[threadIdx.x]; }\n"


def test_the_restrict_option_makes_every_pointer_parameter_restrict(fresh_cache):
    """``-restrict`` promises NVRTC that no two pointer parameters alias, as ``__restrict__`` on each would:
    overlapping arguments, one written, are refused before anything runs, as for a declared one."""
    buffer = E.asarray(np.arange(1, 10, dtype=np.float32))
    plain = E.Module(UNRESTRICTED, ["scale"]).get_function("scale")
    restricted = E.Module(UNRESTRICTED, ["scale"], options=("-restrict",)).get_function("scale")
    assert (plain.param_restrict, restricted.param_restrict) == ((False, False), (True, True))
    with pytest.raises(E.LaunchError, match=r"kernel 'scale': arguments 0 \(.*\) and 1 \(.*\) overlap in 28 bytes, "
                                            r"but argument 0 is __restrict__ \(the module's -restrict option\) and "
                                            r"argument 0 is written"):
        restricted(1, 8, (buffer[1:], buffer[:8]))
    assert E.asnumpy(buffer).tolist() == list(range(1, 10))   # nothing ran
    plain(1, 1, (buffer[1:], buffer[:8]))                      # no promise made: one thread runs
    assert E.asnumpy(buffer).tolist() == [1, 3, *range(3, 10)]


def test_an_assert_in_a_copied_header_names_the_users_header_and_line(fresh_cache, tmp_path):
    """An include dir holding a header that declares ``__shared__`` variables is compiled from rewritten
    copies of its headers. An assert in one of them, rewritten or not, names the header the user has and
    its line, not the build's temporary copy (``__FILE__`` follows a ``#line`` at the top of each copy)."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "scratch.cuh").write_text("#pragma once\n__shared__ int scratch[4];\n")   # the dir is copied
    (include / "checks.cuh").write_text("#pragma once\n#include <assert.h>\n\n"
                                        "__device__ void must_be_positive(int v) { assert(v > 0); }\n")
    source = '#include "checks.cuh"\n#include "scratch.cuh"\n' \
             '__global__ void k(int v) { scratch[0] = v; must_be_positive(scratch[0]); }\n'
    with pytest.raises(E.DeviceAssertError) as e:
        E.Module(source, ["k"], include_dirs=[include]).get_function("k")(1, 1, (np.int32(0),))
    assert f"device assertion `v > 0` failed at {include / 'checks.cuh'}:4 in " in str(e.value), str(e.value)


def test_a_kernel_template_in_an_included_header_is_held_to_its_launch_bounds(fresh_cache, tmp_path):
    """A kernel defined in a header (a template the source instantiates) is held to its
    ``__launch_bounds__`` per instance, as one in the source is: the header is compiled from a copy
    that states the bound in the kernel's body, and an error in the bound names the header's line."""
    include = tmp_path / "include"
    include.mkdir()
    header = include / "fill.cuh"
    header.write_text("#pragma once\ntemplate <int WARPS>\n"
                      "__global__ void __launch_bounds__(WARPS * 32) fill(int* out) {\n"
                      "    out[threadIdx.x] = WARPS;\n}\n")
    source = '#include "fill.cuh"\ntemplate __global__ void fill<2>(int*);\n'
    fill = E.Module(source, ["fill<2>"], include_dirs=[include]).get_function("fill<2>")
    out = E.zeros(65, np.int32)
    fill(1, 64, (out,))
    assert E.asnumpy(out).tolist() == [2] * 64 + [0]
    with pytest.raises(E.LaunchError, match=r"kernel 'fill<2>': block \(65, 1, 1\) has 65 threads, above the "
                                            r"kernel's __launch_bounds__\(WARPS \* 32\), whose first argument is 64"):
        fill(1, 65, (E.zeros(65, np.int32),))
    header.write_text(header.read_text().replace("WARPS * 32", "WARPS * kLanes"))
    with pytest.raises(E.CompileError, match=rf"{re.escape(str(header))}:3:.*kLanes"):
        E.Module(source, ["fill<2>"], include_dirs=[include])


def test_an_instrumented_and_a_plain_build_of_one_source_are_two_modules(fresh_cache, monkeypatch):
    """Where shadow memory cannot be mapped, modules are built without the access hooks: such a build
    must never be handed to a process that checks races, nor the other way round."""
    source = _kernel("instrumented or plain")
    assert E.Module(source, ["k"]).instrumented
    monkeypatch.setattr(build, "instrumented", lambda: False)
    assert not E.Module(source, ["k"]).instrumented
    assert len(list(fresh_cache.glob("mod-*.so"))) == 2


def test_the_keys_follow_the_runtime_sources_and_flags(tmp_path, monkeypatch):
    """A runtime or module built before an edit of the runtime's sources or flags is not reused after it."""
    def keys():
        return build.runtime_key(), build.module_key(text, [], [], build.runtime_key())

    text = _kernel("keys")
    before = keys()
    edited = tmp_path / build.RUNTIME_SOURCES[-1].name
    edited.write_bytes(build.RUNTIME_SOURCES[-1].read_bytes() + b"\n// an edit\n")
    with monkeypatch.context() as patch:
        patch.setattr(build, "RUNTIME_SOURCES", (*build.RUNTIME_SOURCES[:-1], edited))
        assert keys()[0] != before[0] and keys()[1] != before[1]
    with monkeypatch.context() as patch:
        patch.setattr(build, "COMMON_FLAGS", (*build.COMMON_FLAGS, "-ffast-math"))
        assert keys()[0] != before[0] and keys()[1] != before[1]
    assert keys() == before
    # each part is framed by its length: moving bytes from one part to the next changes the key
    key = before[0]
    assert build.module_key(text + "-DA", ["=1"], [], key) != build.module_key(text, ["-DA=1"], [], key)


def test_a_runtime_edited_after_loading_refuses_new_modules(tmp_path, monkeypatch):
    """Once a process has loaded the runtime, a module built from edited runtime sources or emulator
    headers (cuemu_abi.h's structure layouts) would disagree with it: the build is refused with a
    message that says to restart, instead of failing later in ways that point elsewhere."""
    E.Module(_kernel("before the edit"), ["k"])   # the runtime is loaded
    edited_include = tmp_path / "include"
    shutil.copytree(build.INCLUDE_DIR, edited_include)
    abi = edited_include / "cuemu_abi.h"
    abi.write_text(abi.read_text() + "\n// an edit\n")
    with monkeypatch.context() as patch:
        patch.setattr(build, "INCLUDE_DIR", edited_include)
        with pytest.raises(E.CompileError, match=r"changed after this process loaded the runtime .*Restart"):
            E.Module(_kernel("after the edit"), ["k"])
    E.Module(_kernel("after the edit"), ["k"])   # with the loaded runtime's headers back, it builds

