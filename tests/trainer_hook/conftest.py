"""Fixtures the hook's in-process tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank gloo process group in this process, offline (no REBALANCER_* server or job)."""
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
