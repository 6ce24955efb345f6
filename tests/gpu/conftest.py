"""GPU checks (``make test-gpu``, ``scripts/gpu-check``): every test here is marked ``gpu``
and skipped, at collection and at no cost, without a CUDA device unless the CPU rehearsal
is on (``REBALANCER_GPU_REHEARSAL=1``, tests/gpu/_rig.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu._rig import Rig, skip_reason

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = skip_reason()
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def rig() -> Iterator[Rig]:
    yield Rig.detect()
