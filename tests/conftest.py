"""Shared test setup: hypothesis profiles and the ``gpu`` marker.

Profiles: ``dev`` (50 examples per property, the default on a workstation)
and ``ci`` (200 examples, the default when the ``CI`` environment variable is
set, as on the CI machine); ``HYPOTHESIS_PROFILE`` overrides both. Tests marked
``gpu`` are skipped, with the reason, unless CuPy can use a CUDA device.
"""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from cupykv.backends import cuda_available

sys.path.insert(0, os.path.dirname(__file__))   # tests/backends.py and friends

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_report_header(config):
    available, reason = cuda_available()
    return [f"hypothesis: {settings.default.max_examples} examples per property",
            f"gpu tests: {'run' if available else 'skipped: ' + reason}"]


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        available, reason = cuda_available()
        if not available:
            pytest.skip(f"no usable CUDA GPU: {reason}")
