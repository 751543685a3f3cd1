"""Stateful property test: random interleavings of every cache operation never diverge from the reference."""
import dataclasses

import pytest

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from cupykv.testing import CacheMachine, specs

# CI runs at least 300 generated sequences of up to 12 operations each.
SEQUENCES = 300 if settings.default.max_examples >= 200 else 60

TestEmulatorCache = CacheMachine.TestCase
TestEmulatorCache.settings = settings(max_examples=SEQUENCES, stateful_step_count=12, deadline=None)


class CupyCacheMachine(CacheMachine):
    backend = "cupy"


TestCupyCache = CupyCacheMachine.TestCase
TestCupyCache.settings = TestEmulatorCache.settings
TestCupyCache.pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("batch", [1, 6])
def test_subclass_with_any_batch(batch):
    """A subclass may pick any batch: per-sequence rule arguments are sized from the spec."""
    class Machine(CacheMachine):
        spec_strategy = specs(max_seqs=(4, 9), head_dims=(2, 8)).map(lambda s: dataclasses.replace(s, batch=batch))

    run_state_machine_as_test(Machine, settings=settings(max_examples=8, stateful_step_count=10, deadline=None))
