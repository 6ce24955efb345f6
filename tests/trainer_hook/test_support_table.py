"""Every row of the support table in docs/integrations.md says what ``hook.attach`` really
does (issue 39: the table listed FSDP2 + TP and HSDP as refused while docs/meshes.md showed
them working). Each row is built here, in process on a one-rank gloo group or a 1 x 1 mesh,
and attached; a row that needs several ranks or a framework names the test that shows it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset

from trainer_hook import RebalanceHook
from trainer_hook.gradients import GradientState, register_gradient_weighting

ROOT = Path(__file__).resolve().parents[2]
MODES = ("ddp_comm_hook", "loss_scale", "fsdp2_reduce_scatter", "fsdp1_comm_hook", "local")


def table_rows() -> list[list[str]]:
    """The rows of the first table of docs/integrations.md (framework / wrapper ...)."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    head = text.index("| framework / wrapper | supported |")
    rows = []
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows


def _attach(model: torch.nn.Module, *, gradients: str = "auto", **hook_kwargs: object) -> str:
    hook = RebalanceHook(global_batch_size=4, **hook_kwargs)  # type: ignore[arg-type]
    try:
        hook.attach(model, gradients=gradients)
        return str(hook.gradients)
    finally:
        hook.close()


def _linear() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def _ddp_hook_taken() -> str:
    model = DDP(_linear())
    model.register_comm_hook(None, _allreduce)  # someone else's hook holds DDP's one slot
    return _attach(model, gradients="loss_scale")


def _allreduce(_state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotated hooks here
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _fsdp2() -> str:
    from torch.distributed.fsdp import fully_shard

    return _attach(fully_shard(_linear()))


def _fsdp1() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return _attach(FSDP(_linear(), device_id=torch.device("cpu")))


def _two_ranks_plain_module() -> str:
    # attach() weights with the hook's world size; a second rank is what changes the answer.
    return register_gradient_weighting(_linear(), GradientState(), 2)


def _hsdp(*, dp_mesh: bool) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = fully_shard(_linear(), mesh=mesh)
    return _attach(model, **({"dp_mesh": mesh} if dp_mesh else {}))


def _fsdp2_tp() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_linear(), mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return _attach(fully_shard(model, mesh=mesh["dp"]), dp_mesh=mesh["dp"])


def _tensor_parallel() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return _attach(parallelize_module(_linear(), init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()}))


def _pipeline() -> str:
    from torch.distributed.pipelining import PipelineStage, pipeline

    pipe = pipeline(_linear(), mb_args=(torch.randn(2, 4),))
    for attempt in (lambda: _attach(pipe), lambda: _attach(pipe, gradients="loss_scale")):
        with pytest.raises(ValueError, match="pipeline parallelism") as refused:
            attempt()
        assert "hook.attach(model, gradients='loss_scale') with" not in str(refused.value)  # not suggested
    stage_module = _linear()
    stage = PipelineStage(stage_module, 0, 1, torch.device("cpu"))  # noqa: F841 - holds stage_module
    return _attach(stage_module, gradients="loss_scale")  # the option refused for a stage's module


def _deepspeed() -> str:
    engine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    return _attach(engine())


def _iterable() -> str:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(8)

    hook = RebalanceHook(global_batch_size=4)
    try:
        hook.data_loader(Stream())
        return "accepted"
    finally:
        hook.close()


# First cell of a row -> how to build it here. Keys are the table's text: a new or reworded
# row fails test_every_row_is_checked until it is added here or to ELSEWHERE.
IN_PROCESS: dict[str, Callable[[], str]] = {
    "`DistributedDataParallel`": lambda: _attach(DDP(_linear())),
    "DDP whose comm hook is taken (PowerSGD, fp16 compression)": _ddp_hook_taken,
    "FSDP2 (`fully_shard`, 1-D mesh)": _fsdp2,
    "FSDP1 (`FullyShardedDataParallel`, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)": _fsdp1,
    "`torch.compile` (`DDP(compile(m))`, `compile(DDP(m))`)": lambda: _attach(DDP(torch.compile(_linear()))),
    "any other module, one process": lambda: _attach(_linear()),
    "any other module, several ranks": _two_ranks_plain_module,
    "HSDP: FSDP2 on a 2-D mesh, with `dp_mesh`": lambda: _hsdp(dp_mesh=True),
    "HSDP: FSDP2 on a 2-D mesh without `dp_mesh`": lambda: _hsdp(dp_mesh=False),
    'FSDP2 + TP (`fully_shard(mesh=mesh["dp"])` over `parallelize_module(mesh["tp"])`), with `dp_mesh`': _fsdp2_tp,
    "tensor / context parallelism (DTensor parameters) or FSDP2 + TP without `dp_mesh`": _tensor_parallel,
    "pipeline parallelism without `pp_mesh` (`torch.distributed.pipelining`: a `Pipe`, a stage, or a stage's "
    'module, `gradients="loss_scale"` included)': _pipeline,
    "DeepSpeed (engine, Accelerate or Trainer)": _deepspeed,
    "`IterableDataset` with sample shares (`hook.batch_sampler`)": _iterable,
}
# Rows that need several ranks, a framework or a launcher: the test that shows each.
ELSEWHERE = {
    "loss terms that bypass the model's output (an auxiliary loss kept on a module, L2 on the parameters)":
        "tests/trainer_hook/test_exactness.py::test_loss_terms_that_bypass_the_output_stay_exact",
    "gradient accumulation": "tests/trainer_hook/test_sharded.py::test_sharded_models_are_exact_under_changing_placements",
    "HF Accelerate (DDP)": "tests/integrations/test_accelerate.py::test_accelerate_matches_single_process_reference",
    "HF Trainer (DDP)": "tests/integrations/test_hf_trainer.py::test_trainer_matches_single_process_reference",
    'PyTorch Lightning (`strategy="ddp"`, or one process)':
        "tests/integrations/test_lightning.py::test_lightning_matches_single_process_reference",
    "Lightning FSDP2: `ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`, `fully_shard` in "
    "`configure_model`": "tests/integrations/test_lightning.py::test_lightning_matches_single_process_reference",
    'Lightning `strategy="fsdp"` (FSDP1), DeepSpeed, `ModelParallelStrategy` with tensor parallelism, '
    "`accumulate_grad_batches > 1`": "tests/integrations/test_lightning.py::test_lightning_refuses_strategies_it_cannot_keep_exact",
    "any script, no code change (`rebalancer run`)":
        "tests/integrations/test_zero_code.py::test_rebalancer_run_monitors_a_plain_ddp_script_live",
    "Accelerate FSDP plugin, Trainer `fsdp=...`":
        "tests/integrations/test_accelerate.py::test_accelerate_rejects_setups_it_cannot_keep_exact",
    "HSDP: FSDP1 HYBRID_SHARD": "tests/trainer_hook/test_refusals.py::test_fsdp1_hybrid_shard_is_refused_on_two_ranks",
    "DDP / FSDP1 over a process group smaller than the world, FSDP2 over a sub-mesh, without `dp_mesh`":
        "tests/trainer_hook/test_dp_mesh.py::test_ddp_over_a_sub_group_is_refused",
    "streams: `IterableDataset`, `split_dataset_by_node`, `StatefulDataLoader`, any iterator; compiled fixed shapes":
        "tests/trainer_hook/test_micro_batches.py::test_parameters_equal_a_one_process_replay_under_changing_counts_and_a_drain",
    'PP x DP (`torch.distributed.pipelining`: `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B` with a '
    'list of stages per rank; DDP or FSDP2 over `mesh["dp"]`), with `pp_mesh`':
        "tests/trainer_hook/test_pipelines.py::"
        "test_parameters_equal_a_one_process_replay_under_changing_counts_and_a_drain",
    "PP x DP with `ScheduleLoopedBFS` or a zero-bubble schedule, or TP inside a stage":
        "tests/trainer_hook/test_pipelines.py::"
        "test_zero_bubble_misplaced_stages_and_tp_are_refused_naming_what_is_supported",
    "HF Trainer, Accelerate's `prepare_with_rebalancer`, Lightning with a `micro_batches=M` hook":
        "tests/trainer_hook/test_micro_batches.py::test_the_framework_adapters_refuse_a_micro_batch_hook_naming_the_loop",
}


def test_every_row_is_checked() -> None:
    names = [row[0] for row in table_rows()]
    assert len(names) >= 20, names
    assert set(names) == set(IN_PROCESS) | set(ELSEWHERE), (
        f"rows without a check: {sorted(set(names) - set(IN_PROCESS) - set(ELSEWHERE))}; "
        f"checks without a row: {sorted(set(IN_PROCESS) | set(ELSEWHERE) - set(names))}")
    for where in ELSEWHERE.values():
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / path).read_text(), where
    # The FSDP2 + TP without dp_mesh refusal needs a TP dim of two ranks: shown there.
    assert "def test_fsdp2_with_tensor_parallelism_is_refused_naming_dp_mesh(" in (
        ROOT / "tests/trainer_hook/test_dp_mesh.py").read_text()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("row", [r for r in table_rows() if r[0] in IN_PROCESS], ids=lambda r: r[0][:40])
def test_the_row_says_what_attach_does(one_rank_group: None, row: list[str]) -> None:
    what, supported, mechanism = row[0], row[1], row[2]
    build = IN_PROCESS[what]
    if supported.startswith("yes"):
        got = build()
        named = [m for m in MODES if f"`{m}`" in mechanism]
        if named:
            assert got == named[0], (what, got)
    else:
        assert supported.startswith("refused"), supported
        with pytest.raises(ValueError) as refused:
            build()
        if "naming `dp_mesh`" in supported:
            assert "dp_mesh" in str(refused.value), str(refused.value)
