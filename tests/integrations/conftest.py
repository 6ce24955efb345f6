"""Fixtures of the framework integrations' tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """For a test that builds an Accelerator (or an HF Trainer, which builds one) in the test
    process: Accelerate's state is a process-wide singleton, and it and the Trainer set
    environment variables; both are put back after the test."""
    from accelerate.state import AcceleratorState, GradientState

    env = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(env)
