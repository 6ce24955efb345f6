"""Pipelines (issue 40): each data-parallel pipeline of a PP2 x DP2 job trains its own
number of micro-batches; parameters equal a one-process float64 replay of the global batch
under GPipe, 1F1B and interleaved 1F1B (2 model stages per rank), DDP or FSDP2 over the dp
dim, with placements changed mid-run and a pipeline drained."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from tests.helpers.configs import run_configs
from tests.trainer_hook import _pipeline_worker as pw
from trainer_hook.pipeline import check_count, fewest_micro_batches, schedule_name

M = 6
STEPS = 14
# Asked at an exchange's step + 1 (every 3 steps, lag 1): uneven from step 4-ish, one
# pipeline drained from the next switch, uneven again after.
# Interleaved with 2 ranks per pipeline takes 0-4 and 6 of 6 (a multiple of count // 2).
PLANS = {"gpipe": "1=2,4;5=6,0;9=1,5", "1f1b": "1=2,4;5=0,6;9=4,2", "interleaved": "1=2,4;5=6,0;9=4,2"}
CONFIGS = [["--schedule", "gpipe", "--plan", PLANS["gpipe"]], ["--schedule", "1f1b", "--plan", PLANS["1f1b"]],
           ["--bad"], ["--schedule", "1f1b", "--plan", PLANS["1f1b"], "--wrap", "fsdp2"],
           ["--schedule", "gpipe", "--plan", PLANS["gpipe"], "--wrap", "fsdp2"],
           ["--schedule", "interleaved", "--plan", PLANS["interleaved"]],
           ["--schedule", "interleaved", "--plan", PLANS["interleaved"], "--wrap", "fsdp2"]]
TRAINED = {0: "gpipe", 1: "1f1b", 3: "1f1b-fsdp2", 4: "gpipe-fsdp2", 5: "interleaved", 6: "interleaved-fsdp2"}
NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def schedule_of(cfg: int) -> str:
    return CONFIGS[cfg][1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Every configuration one after the other in one torchrun job of 4 ranks."""
    out = tmp_path_factory.mktemp("pipelines")
    return run_configs(4, ["tests/trainer_hook/_pipeline_worker.py", "--steps", str(STEPS),
                           "--micro-batches", str(M)], out, CONFIGS, timeout=280)


def replay(steps: int) -> list[torch.Tensor]:
    """One process, the whole model: step k trains micro-batches k*M .. k*M+M-1, the mean of
    their per-micro-batch mean losses."""
    model = pw.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=pw.LR, momentum=0.9)
    for k in range(steps):
        loss = sum(pw.mean_loss(model(x), y) for x, y in (pw.make(k * M + j) for j in range(M)))
        (loss / M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


@pytest.mark.multiproc
@pytest.mark.parametrize("cfg", list(TRAINED), ids=list(TRAINED.values()))
def test_parameters_equal_a_one_process_replay_under_changing_counts_and_a_drain(
        runs: list[list[dict[str, Any]]], cfg: int) -> None:
    ranks = runs[cfg]  # rank r: stage r // 2 of pipeline r % 2
    shares = [tuple(s) for s in ranks[0]["shares"]]
    assert all(d["shares"] == ranks[0]["shares"] for d in ranks), "stages or pipelines switched at different steps"
    plan = [tuple(v) for v in pw.w.parse_plan(CONFIGS[cfg][3]).values()]
    assert all(p in shares for p in plan), (shares, plan)
    drained = [k for k, s in enumerate(shares) if 0 in s]
    assert drained, "no step drained a pipeline"
    for k in range(STEPS):
        # Both stages of a pipeline trained the same micro-batches; the pipelines, the global batch.
        for j in (0, 1):
            assert ranks[j]["ids"][k] == ranks[j + 2]["ids"][k]
        trained = sorted(i for j in (0, 1) for i in ranks[j]["ids"][k] if i >= 0)
        assert trained == list(range(k * M, k * M + M)), (k, trained)
    for k in drained:
        idle = shares[k].index(0)
        want = fewest_micro_batches(NAMES[schedule_of(cfg)], 2)
        assert ranks[idle]["ids"][k] == [-1] * want
    want = replay(STEPS)
    # Model stage s lives on pipeline rank s % 2 (interleaved: stages 0 and 2 on ranks 0-1, 1 and 3 on 2-3).
    by_stage = {int(s): ps for r in (0, 2) for s, ps in ranks[r]["stage_params"].items()}
    assert sorted(by_stage) == list(range(4 if schedule_of(cfg) == "interleaved" else 2))
    got = [torch.tensor(p, dtype=torch.float64) for s in sorted(by_stage) for p in by_stage[s]]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)
    for r in (1, 3):  # the other pipeline's replicas of each stage agree
        assert ranks[r]["params"] == ranks[r - 1]["params"]


@pytest.mark.multiproc
@pytest.mark.parametrize("cfg", list(TRAINED), ids=list(TRAINED.values()))
def test_each_pipeline_leader_reports_its_stages(runs: list[list[dict[str, Any]]], cfg: int) -> None:
    ranks = runs[cfg]
    name = schedule_of(cfg)
    for r, d in enumerate(ranks):
        assert d["hello"]["pp_stage"] == r // 2 and d["hello"]["dp_index"] == r % 2
        assert d["hello"]["schedule"] == {"interleaved": "interleaved1f1b"}.get(name, name)
        assert d["hello"]["min_microbatches"] == (2 if name == "1f1b" else 0)
        assert d["hello"]["n_stages"] == (4 if name == "interleaved" else 2)  # model stages
    for leader in (0, 1):  # stage 0 of each pipeline speaks for it
        recs = ranks[leader]["records"]
        assert len(recs) == STEPS
        for rec in recs:
            shares = ranks[0]["shares"][rec["batch"]]
            assert rec["n_microbatches"] == rec["local"] == shares[leader]
            for key in ("stage_fwd_ms", "stage_bwd_ms", "stage_send_wait_ms", "stage_recv_wait_ms", "stage_bubble_ms"):
                assert len(rec[key]) == 2 and all(v >= 0 for v in rec[key]), (key, rec)
            assert all(v > 0 for v in rec["stage_fwd_ms"] + rec["stage_bwd_ms"])
            assert 0 <= rec["bubble_ms"] <= rec["step_ms"]
            # Each stage's entry is what that stage measured itself.
            for stage in (0, 1):
                own = ranks[leader + 2 * stage]["times"][rec["batch"]]
                assert rec["stage_fwd_ms"][stage] == pytest.approx(own[0])
                assert rec["stage_bubble_ms"][stage] == pytest.approx(own[4])
    for d in ranks:  # a stage's idle time is part of its schedule call, its waits part of that
        for t in d["times"]:
            fwd, bwd, send, recv, bubble, wall, n = t
            assert send + recv <= bubble + 1e-6 <= wall + 1e-6


@pytest.mark.multiproc
def test_a_placement_1f1b_cannot_run_is_rejected_naming_what_it_takes(runs: list[list[dict[str, Any]]]) -> None:
    refused = runs[1][0]["refused"]
    assert refused == ["placement version 2 is invalid: pipeline 0: Schedule1F1B needs at least as many "
                       "micro-batches as stages (2) per pipeline, got 1: give every pipeline 0 (drained) or at "
                       "least 2, or use ScheduleGPipe."]
    assert (1, M - 1) not in [tuple(s) for s in runs[1][0]["shares"]]


@pytest.mark.multiproc
def test_a_count_interleaved_cannot_run_is_rejected_naming_the_counts_it_takes(
        runs: list[list[dict[str, Any]]]) -> None:
    refused = runs[5][0]["refused"]
    assert refused == ["placement version 2 is invalid: pipeline 1: ScheduleInterleaved1F1B with 2 ranks per "
                       "pipeline needs a count that is a multiple of its rounds (count // 2), got 5; nearby "
                       "counts it takes: [3, 4, 6]."]
    assert (1, M - 1) not in [tuple(s) for s in runs[5][0]["shares"]]


@pytest.mark.multiproc
def test_bad_input_gets_clear_errors(runs: list[list[dict[str, Any]]]) -> None:
    got = runs[2][0]["refused"]
    assert "needs micro-batch placements: pass micro_batches=M" in got["no_micro_batches"]
    assert "needs dp_mesh too" in got["no_dp_mesh"]
    assert got["looped_bfs"].startswith("hook.pipeline_schedule() cannot balance the pipeline schedule "
                                        "ScheduleLoopedBFS (its count rules and its bubble are not modelled")
    assert "Supported: ScheduleGPipe and Schedule1F1B" in got["looped_bfs"]
    assert "builds the schedule with scale_grads=False" in got["scale_grads"]
    assert got["wrong_group"] == ("stage 0 sends over ranks [0, 1], but pp_mesh holds ranks [0, 2]: build "
                                  "PipelineStage(..., group=mesh['pp'].get_group()) (the stage's group and "
                                  "pp_mesh must agree).")
    for d in runs[2]:  # every rank refused every one (none trains on, none hangs)
        assert set(d["refused"]) == set(got) and "accepted" not in d["refused"].values()


@pytest.mark.multiproc
def test_zero_bubble_misplaced_stages_and_tp_are_refused_naming_what_is_supported(
        runs: list[list[dict[str, Any]]]) -> None:
    got = runs[2][0]["refused"]
    assert got["zero_bubble"].startswith(
        "hook.pipeline_schedule() cannot balance the pipeline schedule ScheduleInterleavedZeroBubble (it splits "
        "backward into input and weight parts")
    assert got["zero_bubble"].endswith("Supported: ScheduleGPipe and Schedule1F1B (one PipelineStage per rank) and "
                                       "ScheduleInterleaved1F1B (a list of stages per rank) from "
                                       "torch.distributed.pipelining.")
    pp_rank = 0  # rank 0's message
    assert got["interleaved_order"] == (
        f"ScheduleInterleaved1F1B places model stage i on pipeline rank i % 2 (loop order): pipeline rank {pp_rank} "
        "holds stages [0, 2], in that order, but was given stages [2, 0].")
    assert got["tp"] == ("the data-parallel replica of this rank (ranks [0, 1, 2, 3], from dp_mesh) is not its "
                         "pipeline (ranks [0, 2], from pp_mesh): the hook balances PP x DP meshes whose dims are "
                         "exactly 'pp' and 'dp' (tensor parallelism inside a stage is not supported here).")


def test_which_counts_each_schedule_takes() -> None:
    assert schedule_name(ScheduleGPipe) == "ScheduleGPipe"
    assert schedule_name(type("MyOneFOneB", (Schedule1F1B,), {})) == "Schedule1F1B"
    assert schedule_name(ScheduleInterleaved1F1B) == "ScheduleInterleaved1F1B"
    with pytest.raises(ValueError, match="cannot balance the pipeline schedule ScheduleLoopedBFS"):
        schedule_name(ScheduleLoopedBFS)
    assert [fewest_micro_batches(n, 4) for n in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")] \
        == [1, 4, 1]
    assert check_count("ScheduleGPipe", 1, 4) is None and check_count("ScheduleGPipe", 0, 4) is None
    assert check_count("Schedule1F1B", 0, 4) is None and check_count("Schedule1F1B", 4, 4) is None
    assert "at least as many micro-batches as stages (4)" in str(check_count("Schedule1F1B", 3, 4))
    # Interleaved 1F1B: a multiple of its rounds (count // pp); torch refuses the others too.
    assert check_count("ScheduleInterleaved1F1B", 3, 2) is None and check_count("ScheduleInterleaved1F1B", 6, 2) is None
    why = check_count("ScheduleInterleaved1F1B", 5, 2)
    assert why is not None and "got 5; nearby counts it takes: [3, 4, 6]" in why
    # the hook's rule and the backend policy's are one rule (the hook never imports the backend)
    from backend.policy.pipeline import takes_count

    for name, wire in (("ScheduleGPipe", "gpipe"), ("Schedule1F1B", "1f1b"), ("ScheduleInterleaved1F1B",
                                                                               "interleaved1f1b")):
        for p in (1, 2, 3, 4, 8):
            assert [check_count(name, n, p) is None for n in range(70)] == [takes_count(wire, p, n) for n in range(70)]


def test_a_stage_s_layers_come_from_layers_or_its_torchtitan_layers_container() -> None:
    from types import SimpleNamespace

    from trainer_hook.pipeline import stage_layers

    class Part(torch.nn.Module):  # torchtitan keeps a stage's blocks keyed by their index in the model
        def __init__(self, container: torch.nn.Module) -> None:
            super().__init__()
            self.layers = container

    blocks = torch.nn.ModuleDict({"4": torch.nn.Linear(2, 2), "5": torch.nn.Linear(2, 2)})
    assert stage_layers(SimpleNamespace(submod=Part(blocks)), None) == (("layers.4", "layers.5"), False)
    listed = Part(torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 3))
    assert stage_layers(SimpleNamespace(submod=listed), None) == (("layers.0", "layers.1", "layers.2"), True)
    assert stage_layers(SimpleNamespace(submod=torch.nn.Linear(2, 2)), None) == ((), False)
    given = ["layers.7", "norm", "output"]
    assert stage_layers(SimpleNamespace(submod=Part(blocks)), given) == (tuple(given), False)
    with pytest.raises(ValueError, match="takes this stage's layer module names"):
        stage_layers(SimpleNamespace(submod=Part(blocks)), "layers.0")


def _torch_interleaved_run(p: int, v: int, m: int, fwd: float, bwd: float) -> float:
    """torch's own ScheduleInterleaved1F1B order for each rank (its order builder, no stages
    needed), replayed with each op starting when its rank is free and its input is there."""
    from torch.distributed.pipelining.schedules import _ComputationType

    sched: Any = object.__new__(ScheduleInterleaved1F1B)
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches = v, p, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    orders = [[a for a in sched._calculate_single_rank_operations(r) if a is not None] for r in range(p)]
    done: dict[tuple[bool, int, int], float] = {}
    free, at, last = [0.0] * p, [0] * p, p * v - 1
    while any(at[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                s, i, f = a.stage_index, a.microbatch_index, a.computation_type == _ComputationType.FORWARD
                dep = ((True, s - 1, i) if s else None) if f else ((False, s + 1, i) if s < last else (True, s, i))
                if dep is not None and dep not in done:
                    break
                free[r] = done[(f, s, i)] = max(free[r], done[dep] if dep else 0.0) + (fwd if f else bwd)
                at[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(free)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 12), (4, 16)])
def test_the_interleaved_model_is_torchs_own_order_replayed(p: int, m: int) -> None:
    """T(m) = sum(t)/v + (m - 1/v) max(t) (backend/policy/pipeline.py) is exactly the run of
    torch 2.13's ScheduleInterleaved1F1B order with equal stages and instant p2p, m >= p; with
    fewer micro-batches than ranks the schedule waits longer than the model says."""
    from backend.policy.pipeline import schedule_ms

    v, t = 2, 12.0  # per rank and micro-batch: v model stages of fwd 2 + bwd 4 ms
    assert _torch_interleaved_run(p, v, m, t / v / 3, 2 * t / v / 3) == pytest.approx(schedule_ms([t] * p, m, v))
    if p == 4 and m == 4:
        assert _torch_interleaved_run(4, 2, 2, 2.0, 4.0) == pytest.approx(1.286 * schedule_ms([t] * 4, 2, 2), rel=1e-3)


def test_a_list_of_modules_is_attached_only_by_a_pipelined_hook() -> None:
    from trainer_hook import RebalanceHook

    hook = RebalanceHook(global_batch_size=4)
    try:
        with pytest.raises(ValueError, match=r"attach\(\) takes one model, got a list of 2: a list of modules is for "
                                             r"an interleaved pipeline rank's stage modules"):
            hook.attach([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    finally:
        hook.close()
