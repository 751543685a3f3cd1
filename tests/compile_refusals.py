"""A kernel source that both compilers must refuse: the emulator's host build and NVRTC (sm_80)."""
import re

import pytest

from cupykv import nvrtc_check
from cupykv.backends import emulator as E
from cupykv.kernels import KERNEL_DIR


def assert_refused_by_both_compilers(source, kernel, message, filename="misuse.cu"):
    """``source`` (a kernel ``kernel`` over cupykv's headers) fails to build on the emulator and under
    NVRTC, each log holding ``message`` (a ``static_assert``'s text, say); the emulator's names the file."""
    with pytest.raises(E.CompileError, match=rf"(?s){re.escape(filename)}.*{re.escape(message)}"):
        E.Module(source, [kernel], include_dirs=[KERNEL_DIR], filename=filename)
    with pytest.raises(nvrtc_check.NvrtcError, match=re.escape(message)):
        nvrtc_check.compile_file(nvrtc_check.load_nvrtc(), filename, source, [kernel], "sm_80",
                                 include_dirs=(KERNEL_DIR,))
