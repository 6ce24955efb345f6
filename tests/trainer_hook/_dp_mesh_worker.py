"""torchrun target (4 gloo ranks) for issue 24: RebalanceHook(..., dp_mesh=M) trains exactly.

Runs each case in turn in one launch (CI time), after the attach refusals of meshes
without dp_mesh (``_mesh_worker.attach_all``): DP2 x TP2 (FSDP2 over mesh['dp'] plus
Colwise/Rowwise over 'tp'), HSDP 2 x 2 (fully_shard on the 2-D mesh), DP2 x TP2 with the
token-mean loss, and DDP over the 'dp' sub-group of a 2 x 2 mesh. Global rank 0 pushes three placements per case; each rank records the
dataset indices it trained per batch index; rank 0 writes the full parameters."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.trainer_hook import _exact_worker as w  # noqa: E402
from tests.trainer_hook._mesh_worker import attach_all  # noqa: E402
from trainer_hook import RebalanceHook  # noqa: E402

STEPS = 20  # two epochs and a bit (the 9th batch of each holds 4 samples)
PLANS = {  # batch index -> shares per replica (each takes effect a lookahead later)
    "dp2_tp2": {1: [8, 4], 5: [3, 9], 9: [11, 1]},
    "hsdp": {1: [6, 2, 3, 1], 5: [1, 1, 5, 5], 9: [2, 4, 4, 2]},
    "dp2_tp2_tokens": {1: [8, 4], 5: [3, 9], 9: [11, 1]},
    "dp2_ddp": {1: [8, 4], 5: [3, 9], 9: [11, 1]},
}


SLOW_MS = 30.0  # rank 1 (a member of replica 0, whose leader is rank 0) sleeps this long in
SLOW_CASE = "dp2_ddp"  # every forward of this case: only the replica's pace can show it


def tokens(idx: torch.Tensor) -> torch.Tensor:
    """Each sample's valid-token count (1 to 3): the token-mean loss weights samples by it."""
    return (idx % 3 + 1).to(torch.float64)


def build(case: str) -> tuple[torch.nn.Module, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = w.build_model()
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        fully_shard(model, mesh=mesh)
        return model, mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if case.endswith("_ddp"):  # DDP takes no DTensor parameters: plain ones, replicated over "tp"
        return DDP(model, process_group=mesh["dp"].get_group()), mesh["dp"]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"]


def refusals(out: dict[str, object]) -> None:
    """What a wrong dp_mesh gets: a model whose mesh disagrees, a mesh outside the world."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    model, _ = build("dp2_tp2")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hook = RebalanceHook(job="mesh-disagree", global_batch_size=w.GLOBAL_BATCH, dp_mesh=mesh["tp"])
    try:
        hook.attach(model)
        out["disagree"] = "ATTACHED"
    except ValueError as exc:
        out["disagree"] = f"REFUSED {exc}"
    hook.close()
    try:
        RebalanceHook(job="mesh-outside", global_batch_size=w.GLOBAL_BATCH,
                      dp_mesh=DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",)))
        out["outside"] = "CREATED"
    except ValueError as exc:
        out["outside"] = f"REFUSED {exc}"


def seed_mismatch(out: dict[str, object]) -> None:
    """The user's mistake the hook cannot prevent: the two members of each replica (its TP
    pair) build their samplers with different seeds. Every rank must stop with a clear
    error at the same batch (none left waiting in a collective)."""
    rank = dist.get_rank()
    model, dp_mesh = build("dp2_ddp")
    hook = RebalanceHook(job="mesh-seeds", global_batch_size=w.GLOBAL_BATCH, dp_mesh=dp_mesh)
    hook.attach(model)
    opt = w.make_optimizer(model)
    ds = w.IndexedData()
    sampler = hook.batch_sampler(ds, shuffle=True, seed=3 + rank % 2)
    said = "TRAINED ON"
    try:
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for batch in sampler:
                idx = torch.tensor(batch, dtype=torch.int64)
                with hook.step():
                    torch.nn.functional.mse_loss(model(ds.x[idx]), ds.y[idx]).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    except RuntimeError as exc:
        said = str(exc)
    out["seed_mismatch"] = {"said": said, "at": hook.batch_index}
    hook.close()


def run(case: str, out: dict[str, object]) -> None:
    rank = dist.get_rank()
    model, dp_mesh = build(case)
    hook = RebalanceHook(job=f"mesh-{case}", global_batch_size=w.GLOBAL_BATCH, exchange_every=3,
                         exchange_lag=1, lookahead=3, dp_mesh=dp_mesh)
    hook.attach(model)
    opt = w.make_optimizer(model)
    ds = w.IndexedData()
    sampler = hook.batch_sampler(ds, shuffle=True, seed=3)
    seen: list[list[int]] = []
    epoch = 0
    while hook.batch_index < STEPS:
        sampler.set_epoch(epoch)
        epoch += 1
        for batch in sampler:
            k = hook.batch_index
            if rank == 0 and k == 0 and case == "dp2_tp2":
                try:
                    hook.request_placement([3, 3, 3, 3])
                except ValueError as exc:
                    out["per_rank_shares"] = str(exc)
            if rank == 0 and k in PLANS[case]:
                hook.request_placement(PLANS[case][k], reason=f"plan@{k}")
            idx = torch.tensor(batch, dtype=torch.int64)
            x, y = ds.x[idx], ds.y[idx]
            with hook.step():
                if case == SLOW_CASE and rank == 1:
                    time.sleep(SLOW_MS / 1e3)  # a slow member: DDP over 'dp' never makes rank 0 wait for it
                if case.endswith("_tokens"):
                    n = tokens(idx)
                    loss_sum = (n * (model(x) - y).squeeze(1).pow(2)).sum()
                    (loss_sum * hook.token_loss_weight(int(n.sum().item()))).backward()
                else:
                    torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            lo, hi = sampler.local_bounds(k)
            seen.append(idx.tolist() if hi > lo else [])  # a drained replica's dummy sample: weight 0
            if hook.batch_index >= STEPS:
                break
    hello = hook._hello()
    hook.close()  # the leader's last records leave combined at close
    out[case] = {
        "seen": seen, "replica": hook.rank, "replicas": hook.world_size, "gradients": hook.gradients,
        "shares": [list(t.shares) for t in hook.schedule.timeline()],
        "params": [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
                   for p in getattr(model, "module", model).parameters()],
        # A leader's history is its replica's (combined) records; a member's its own.
        "steps": [[r.batch_index, r.compute_ms, r.sync_wait_ms, r.step_ms] for r in hook.history],
        "slowest": [r.slowest_rank for r in hook.history],  # the leader's: which member it was
        "replica_ranks": list(hello.replica_ranks),
        "replica_devices": list(hello.replica_devices),
        "mesh": hello.mesh.to_dict() if hello.mesh is not None else None,
        "mesh_label": hello.mesh.label if hello.mesh is not None else None,
    }


def rebuild(out: dict[str, object]) -> None:
    """A second hook in the same processes over the same mesh, after the first closed (a
    notebook re-running its cell, fit twice): each replica's gloo group is made again while
    the first one's rendezvous keys are still in the store. One member of each replica comes
    1 s late (ranks 1 and 3, then 0 and 2, then 1 and 3), so its peer would read the stale
    keys if the name came back; whether gloo then dials the dead address depends on which
    side of the pair connects (ports: chance), hence three rebuilds of two replicas each."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ds = w.IndexedData()
    done: list[object] = []
    for round_ in range(4):
        if round_ and rank % 2 == round_ % 2:
            time.sleep(1.0)
        try:
            model = DDP(w.build_model(), process_group=mesh["dp"].get_group())
            hook = RebalanceHook(job=f"mesh-rebuild-{round_}", global_batch_size=w.GLOBAL_BATCH, dp_mesh=mesh["dp"])
            hook.attach(model)
            opt = w.make_optimizer(model)
            for batch in hook.batch_sampler(ds, shuffle=False):
                idx = torch.tensor(batch, dtype=torch.int64)
                with hook.step():
                    torch.nn.functional.mse_loss(model(ds.x[idx]), ds.y[idx]).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if hook.batch_index >= 2:
                    break
            hook.close()
            done.append(hook.batch_index)
        except Exception as exc:  # noqa: BLE001 - the test shows what went wrong
            done.append(f"{type(exc).__name__}: {exc}")
            break
    out["rebuild"] = done


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out: dict[str, object] = {"attach": attach_all()}  # test_dp_mesh.py's attach refusals
    refusals(out)
    for case in PLANS:
        run(case, out)
    seed_mismatch(out)
    rebuild(out)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
