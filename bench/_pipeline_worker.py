"""torchrun target of ``python -m bench.pipeline``: a PP2 x DP2 job on 4 CPU ranks (gloo).

Each stage is two real Linear layers plus an injected delay per micro-batch (forward
``--fwd-ms``, backward ``--bwd-ms``, divided by the rank's pipeline speed, as the other
benches slow ranks down): pipeline ``j`` runs at ``--speeds[j]``. ``--plan STEP=a,b;...``
has rank 0 request those placements (offline sweeps); with ``--server`` the hook reports to
the backend in ``auto`` mode and the backend decides. Every step each stage records its
peak saved-activation bytes (``torch.autograd.graph.saved_tensors_hooks``: what autograd
keeps for the backward) and rank 0 writes ``--result``: per step its time, the shares in
force and every stage's peak.

Layered (``--layer-ms``, the heavy-last-stage case): the model is a stack of layers, layer
``i`` a Linear plus ``--layer-ms[i]`` forward (twice that backward) per micro-batch, split
``--split`` over the two stages; each stage module keeps its layers in a ``layers``
ModuleDict keyed by the layer's index in the whole model, as torchtitan does, so the hook
reports ``layers.0``, ... and the backend can advise a split. ``--head-ms`` adds a layer-less
head to the last stage. ``--save DIR`` writes each layer's parameters at the end and
``--load DIR`` starts from them whatever the split (a restart from a checkpoint with a new
split); with ``--server``, rank 0 reads the job's stage-split advice over REST
(``GET /api/v1/jobs/{job}/pipeline``) before closing and writes it into ``--result``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.workers import parse_plan
from trainer_hook import RebalanceHook

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
WIDTH = 128
ROWS = 16  # samples per micro-batch


class _Delay(torch.autograd.Function):
    """Sleeps ``fwd_s`` in forward and ``bwd_s`` in backward: a slower device's compute."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class Stage(torch.nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Delay.apply(self.b(torch.tanh(self.a(x))), self.fwd_s, self.bwd_s)


class SavedBytes:
    """Bytes autograd holds for the backward right now, and the step's peak above what was
    held when it started (``reset``; ``base``: a schedule's metadata inference can leave a
    graph alive across steps, which is not the step's own)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.base = 0

    def reset(self) -> None:
        self.base = self.peak = self.live

    def pack(self, t: torch.Tensor) -> Any:
        n = t.numel() * t.element_size()
        holder = _Held(t)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, n)
        return holder

    def _free(self, n: int) -> None:
        self.live -= n

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.t


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Layer(torch.nn.Module):
    def __init__(self, fwd_s: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.fwd_s = fwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Delay.apply(torch.tanh(self.lin(x)), self.fwd_s, 2 * self.fwd_s)


class LayeredStage(torch.nn.Module):
    """Layers ``first .. first + len(costs) - 1`` of the model (torchtitan's layout), and on
    the last stage a head of ``head_s`` forward (twice that backward)."""

    def __init__(self, first: int, costs_s: list[float], head_s: float) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(first + i): Layer(c) for i, c in enumerate(costs_s)})
        self.head_s = head_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return _Delay.apply(x, self.head_s, 2 * self.head_s) if self.head_s else x


def read_advice(server: str, job: str, timeout: float = 20.0) -> dict[str, Any]:
    """The job's pipeline view over REST, once it carries advice (or the last one read)."""
    import urllib.request

    view: dict[str, Any] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{server}/api/v1/jobs/{job}/pipeline", timeout=5) as r:
                view = json.loads(r.read())
        except OSError:
            pass
        if view.get("advice"):
            break
        time.sleep(0.3)
    return view


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--result", required=True)
    p.add_argument("--schedule", default="1f1b", choices=tuple(SCHEDULES))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batches", type=int, default=12)
    p.add_argument("--speeds", default="1,0.5")
    p.add_argument("--fwd-ms", type=float, default=2.0)
    p.add_argument("--bwd-ms", type=float, default=4.0)
    p.add_argument("--plan", default="")
    p.add_argument("--server", default=None)
    p.add_argument("--job", default="pipeline-bench")
    p.add_argument("--layer-ms", default="", help="per layer forward ms: a layered model (torchtitan layout)")
    p.add_argument("--split", default="", help="layers per stage, e.g. 2,2")
    p.add_argument("--head-ms", type=float, default=0.0)
    p.add_argument("--save", default="")
    p.add_argument("--load", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    speed = [float(s) for s in args.speeds.split(",")][dp_rank]
    torch.manual_seed(3)
    part: torch.nn.Module
    if args.layer_ms:
        costs = [float(c) / 1e3 / speed for c in args.layer_ms.split(",")]
        split = [int(n) for n in args.split.split(",")]
        if len(split) != 2 or sum(split) != len(costs) or min(split) < 1:
            raise SystemExit(f"--split {args.split} must give both stages at least one of {len(costs)} layers")
        first = sum(split[:pp_rank])
        part = LayeredStage(first, costs[first:first + split[pp_rank]], args.head_ms / 1e3 / speed * pp_rank)
        if args.load:
            state = torch.load(os.path.join(args.load, "layers.pt"))
            part.layers.load_state_dict({k: v for k, v in state.items() if k.split(".")[0] in part.layers})
    else:
        part = Stage(args.fwd_ms / 1e3 / speed, args.bwd_ms / 1e3 / speed)
    model = DDP(part, process_group=mesh["dp"].get_group())
    stage = PipelineStage(model, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    online = args.server is not None
    hook = RebalanceHook(server=args.server, job=args.job, micro_batches=args.micro_batches, dp_mesh=mesh["dp"],
                         pp_mesh=mesh["pp"], mode="auto" if online else None, exchange_every=2, exchange_lag=1)
    hook.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plan = parse_plan(args.plan)
    saved = SavedBytes()
    gen = torch.Generator().manual_seed(0)
    pool = [(torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)) for _ in range(8)]
    steps: list[dict[str, Any]] = []
    prev = time.perf_counter()
    for _ in range(args.steps):
        k = hook.batch_index
        if rank == 0 and k in plan:
            hook.request_placement(plan[k], reason=f"sweep@{k}")
        with hook.step():
            run = hook.pipeline_schedule(stage, SCHEDULES[args.schedule], loss_fn=lambda o, y: (o - y).pow(2).mean())
            batch = [pool[j % len(pool)] for j in run.micro_batches]
            saved.reset()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                if stage.is_first:
                    run.step(torch.cat([b[0] for b in batch]))
                else:
                    run.step(target=torch.cat([b[1] for b in batch]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        peaks = [0] * 8
        peaks[rank] = saved.peak - saved.base
        peaks[4 + rank] = saved.base
        buf = torch.tensor(peaks, dtype=torch.int64)
        dist.all_reduce(buf)  # outside hook.step(): the bench's own bookkeeping
        steps.append({"batch": k, "step_ms": (now - prev) * 1e3, "shares": hook.shares,
                      "peak_saved_bytes": buf.tolist()[:4], "held_before_bytes": buf.tolist()[4:],
                      "count": run.n_microbatches})
        prev = time.perf_counter()
    view = read_advice(args.server, args.job) if online and rank == 0 and args.layer_ms else None
    if args.save and isinstance(part, LayeredStage):  # one file of every layer's parameters
        mine = {k: v.detach().clone() for k, v in part.layers.state_dict().items()}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rank == 0:
            os.makedirs(args.save, exist_ok=True)
            torch.save({k: v for d in every for k, v in d.items()}, os.path.join(args.save, "layers.pt"))
    hook.close()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"steps": steps, "placements": [list(a) for a in hook.acks], "pipeline_view": view}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
