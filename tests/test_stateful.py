"""Stateful property test: random interleavings of every cache operation never diverge from the reference."""
import pytest

from hypothesis import settings

from cupykv.testing import CacheMachine

# CI runs at least 300 generated sequences of up to 12 operations each.
SEQUENCES = 300 if settings.default.max_examples >= 200 else 60

TestEmulatorCache = CacheMachine.TestCase
TestEmulatorCache.settings = settings(max_examples=SEQUENCES, stateful_step_count=12, deadline=None)


class CupyCacheMachine(CacheMachine):
    backend = "cupy"


TestCupyCache = CupyCacheMachine.TestCase
TestCupyCache.settings = TestEmulatorCache.settings
TestCupyCache.pytestmark = [pytest.mark.gpu]
