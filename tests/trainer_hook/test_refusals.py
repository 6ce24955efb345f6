"""Issue 10: hook.attach() refuses set-ups whose ranks are not all data-parallel replicas
(tensor parallelism, HSDP, pipeline parallelism), naming what is supported. Real torch
wrappers on a one-rank gloo group."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.helpers.torchrun import run_torchrun
from trainer_hook import RebalanceHook

SUPPORTED = "Supported: DistributedDataParallel, FSDP2 (fully_shard) and FSDP1"


def _tensor_parallel() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})


def _hsdp_fsdp2() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    return fully_shard(torch.nn.Linear(4, 4), mesh=mesh)  # type: ignore[no-any-return]


def _pipeline() -> torch.nn.Module:
    from torch.distributed.pipelining import pipeline

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    return pipeline(model, mb_args=(torch.randn(2, 4),))  # type: ignore[return-value]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (_tensor_parallel, "tensor parallelism (DTensor parameters outside FSDP) is not supported"),
        (_hsdp_fsdp2, "FSDP2 over a device mesh with more than one dimension (HSDP"),
        (_pipeline, "pipeline parallelism (Pipe) is not supported"),
    ],
    ids=["tensor-parallel", "hsdp-fsdp2", "pipeline"],
)
def test_non_data_parallel_setups_are_refused_naming_what_is_supported(
    one_rank_group: None, build: Callable[[], torch.nn.Module], message: str
) -> None:
    model = build()
    hook = RebalanceHook(global_batch_size=4)
    try:
        with pytest.raises(ValueError) as exc:
            hook.attach(model)
        assert message in str(exc.value) and SUPPORTED in str(exc.value)
        assert hook.gradients is None
    finally:
        hook.close()


@pytest.mark.multiproc
def test_fsdp1_hybrid_shard_is_refused_on_two_ranks() -> None:
    # Real gloo ranks: with a world of one FSDP1 turns HYBRID_SHARD into NO_SHARD (accepted).
    proc = run_torchrun(2, ["tests/trainer_hook/_hsdp_worker.py"], timeout=90)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} REFUSED FSDP1 with HYBRID_SHARD (HSDP) is not supported"), line
        assert "Use ShardingStrategy.FULL_SHARD" in line and SUPPORTED in line
