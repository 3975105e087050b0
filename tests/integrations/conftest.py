"""Fixtures shared by the integration tests."""

import pytest


@pytest.fixture
def fresh_state():
    """accelerate's process-wide state reset around the test, as accelerate's own tests do
    (AccelerateTestCase); yields the reset, for a test that builds a second Accelerator."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield AcceleratorState._reset_state
    AcceleratorState._reset_state(True)
