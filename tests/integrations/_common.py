"""Shared pieces of the integration jobs and their single-process reference.

The jobs record, per rank and per trained batch, the dataset indices they used; the test
rebuilds each global batch as the ranks' slices in rank order and trains the same model
on it in one process. Equal final parameters then show that the split did not change
the math (docs/design.md, invariant 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

N_SAMPLES = 60
GLOBAL_BATCH = 12
IN_DIM = 4
LR = 0.1
MOMENTUM = 0.9


class IndexedData(torch.utils.data.Dataset):
    """Deterministic regression data; each item carries its own index."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, IN_DIM, generator=g, dtype=torch.float64)
        w = torch.randn(IN_DIM, 1, generator=g, dtype=torch.float64)
        self.y = (self.x @ w).squeeze(-1) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": torch.tensor(i), "x": self.x[i], "labels": self.y[i]}


class TinyNet(nn.Module):
    """A small MLP in float64 whose loss is the mean over the samples it is given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN_DIM, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor | None = None) -> dict[str, Any]:
        out = self.net(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class TokenData(IndexedData):
    """Three targets per sample, of which only the first ``i % 3 + 1`` count (-100 elsewhere),
    so samples carry different numbers of "tokens", like padded sequences."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        super().__init__(n)
        g = torch.Generator().manual_seed(99)
        self.y = self.x @ torch.randn(IN_DIM, 3, generator=g, dtype=torch.float64)
        for i in range(n):
            self.y[i, i % 3 + 1 :] = -100.0


class TokenNet(nn.Module):
    """Loss = squared error summed over valid targets, divided by the number of valid
    targets in the whole global batch when the Trainer passes ``num_items_in_batch``
    (as HF language models do), else by the count in the batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN_DIM, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        out = self.net(x)
        valid = labels != -100
        total = ((out - labels) ** 2 * valid).sum()
        count = kwargs.get("num_items_in_batch")
        return {"loss": total / (count if count is not None else valid.sum()), "logits": out}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def dump(out_dir: str, rank: int, payload: dict[str, Any], model: nn.Module) -> None:
    """Write this rank's record (JSON) and final parameters (torch.save, exact)."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (path / f"rank{rank}.r{restart}.json").write_text(json.dumps(payload))
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path / f"rank{rank}.r{restart}.pt")


def accelerate_configs_main(run: Callable[[str, list[str]], None], argv: list[str]) -> None:
    """An Accelerate-based job's main: ``OUT ARGS...`` runs ``run(OUT, ARGS)`` once;
    ``--configs OUT '[[ARGS...], ...]'`` runs each configuration into ``OUT/cfgN``, one after
    the other on the process group in place, with a fresh Accelerate state for each."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    if argv[0] != "--configs":
        run(argv[0], argv[1:])
    else:
        out_root, configs = argv[1], json.loads(argv[2])
        for i, args in enumerate(configs):
            if i:  # the last configuration is complete (its checkpoint too) on every rank
                dist.barrier()
                AcceleratorState._reset_state(reset_partial_state=True)
                GradientState._reset_state()
            run(os.path.join(out_root, f"cfg{i}"), args)
    dist.barrier()
    dist.destroy_process_group()


def load(out_dir: Path, world: int, restart: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    recs = [json.loads((out_dir / f"rank{r}.r{restart}.json").read_text()) for r in range(world)]
    params = [torch.load(out_dir / f"rank{r}.r{restart}.pt") for r in range(world)]
    return recs, params


def global_batches(recs: list[dict[str, Any]]) -> list[list[int]]:
    """Rank slices of each trained batch joined in rank order; drained ranks' dummies dropped."""
    steps = [{int(k): v for k, v in r["batches"].items()} for r in recs]
    ks = sorted(steps[0])
    for s in steps[1:]:
        assert sorted(s) == ks, "ranks trained different batch indices"
    out = []
    for k in ks:
        whole: list[int] = []
        for s in steps:
            whole.extend(s[k]["idx"] if not s[k].get("dummy") else [])
        out.append(whole)
    return out


def reference(
    batches: list[list[int]], accum: int = 1, *, short_window_mean: bool = False, tokens: bool = False
) -> dict[str, torch.Tensor]:
    """One process, whole global batches, mean loss: what every split must reproduce.

    With ``accum`` > 1 the optimizer steps every ``accum`` micro-batches of an epoch and at
    its end (both Accelerate and the Trainer restart the count each epoch). Each loss is
    divided by ``accum`` (Accelerate) or, with ``short_window_mean``, by the size of its
    window, which is shorter at the end of an epoch (the Trainer). ``tokens`` trains
    TokenNet on TokenData: the loss is the mean over the global batch's valid targets.
    """
    data = TokenData() if tokens else IndexedData()
    model = TokenNet() if tokens else TinyNet()
    opt = make_optimizer(model)
    per_epoch = -(-N_SAMPLES // GLOBAL_BATCH)
    full = per_epoch // accum * accum  # micro-batches of an epoch in full windows
    for c, idx in enumerate(batches):
        j = c % per_epoch + 1  # position in the epoch, from 1
        divisor = accum if (j <= full or not short_window_mean) else per_epoch - full
        ix = torch.tensor(idx)
        loss = model(data.x[ix], data.y[ix])["loss"] / divisor
        loss.backward()
        if j % accum == 0 or j == per_epoch:
            opt.step()
            opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-9) -> float:
    """Largest relative difference; fails above ``rtol``."""
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        diff = float((g - w).abs().max() / w.abs().max().clamp_min(1e-12))
        worst = max(worst, diff)
    assert worst <= rtol, f"parameters differ from the single-process reference by {worst:.3e} (> {rtol})"
    return worst


def check_every_sample_once(batches: list[list[int]], n: int = N_SAMPLES, b: int = GLOBAL_BATCH) -> None:
    """Each epoch's global batches use every sample exactly once, B at a time."""
    per_epoch = -(-n // b)
    for e in range(len(batches) // per_epoch):
        epoch = batches[e * per_epoch : (e + 1) * per_epoch]
        flat = sorted(i for batch in epoch for i in batch)
        assert flat == list(range(n)), f"epoch {e} does not use every sample exactly once"
