"""Shared test setup: hypothesis profiles and the ``gpu`` marker.

Profiles: ``dev`` (default, 50 examples) and ``ci`` (200 examples); pick one
with ``HYPOTHESIS_PROFILE=ci``. Tests marked ``gpu`` are skipped, with the
reason, unless CuPy imports and can use a CUDA device.
"""

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """``None`` when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy
    except Exception as exc:  # not installed, or a broken install
        return f"no usable CUDA GPU (cupy is not importable: {type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA GPU (cupy.cuda.runtime.getDeviceCount() failed: {exc})"
    if count < 1:
        return "no usable CUDA GPU (cupy.cuda.runtime.getDeviceCount() returned 0)"
    try:
        cupy.arange(4).sum().item()
    except Exception as exc:
        return f"no usable CUDA GPU (a tiny CuPy computation failed: {type(exc).__name__}: {exc})"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = gpu_skip_reason()
        if reason is not None:
            pytest.skip(reason)
