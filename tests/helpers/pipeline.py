"""Frames of a pipelined job (PP2 x DP2, docs/pipelines.md) for the backend and browser
tests: two pipelines of two stages, 16 micro-batches a step, 1F1B, each stage's layers
[2, 2]. Pipeline 0's stages take 4 and 8 ms a micro-batch, pipeline 1's twice that (a slow
pipeline); stage 1 holds the heavy output layer (layers cost 2, 2, 2, 6 ms in pipeline 0).
The frames carry exactly the model's schedule time ``sum(t) + (m-1) max(t)``, so the tests
work every figure by hand."""

from __future__ import annotations

import time
from typing import Any

from websockets.sync.client import ClientConnection

from rebalancer_wire.protocol import Hello, MeshShape, Metrics, PipelineShape, StepRecord, encode

__all__ = ["JOB", "MESH", "NAMES", "STAGES", "LAYERS", "REST_MS", "shape", "hello_frame", "schedule", "steps", "feed"]

JOB = "pp2x2"
MESH = MeshShape(dp=2, replica_size=2, dims=("dp", "pp"), shape=(2, 2))
NAMES = ("tok_embeddings", "layers.0", "layers.1", "output")
STAGES = {0: [4.0, 8.0], 1: [8.0, 16.0]}  # ms per micro-batch, per stage
LAYERS = {0: [2.0, 2.0, 2.0, 6.0], 1: [4.0, 4.0, 4.0, 12.0]}
REST_MS = 1.5  # data wait 0.5 + optimizer 1.0


def shape(dp_index: int, **kw: Any) -> PipelineShape:
    base: dict[str, Any] = dict(pp_size=2, pp_stage=0, dp_index=dp_index, tp_size=1, schedule="1f1b", n_stages=2,
                                min_microbatches=2, layers_per_stage=(2, 2), layer_names=NAMES)
    return PipelineShape(**{**base, **kw})


def hello_frame(rank: int, job: str = JOB, **kw: Any) -> str:
    return encode(Hello(job=job, rank=rank, world_size=2, global_batch_size=16, host="h", mesh=MESH,
                        micro_batches=True, pipeline=shape(rank, **kw)))


def schedule(stage: list[float], m: int) -> float:
    return sum(stage) + (m - 1) * max(stage)


def steps(rank: int, first: int, n: int, shares: list[int], version: int, *,
          slower: dict[int, float] | None = None) -> list[StepRecord]:
    """Pipeline ``rank``'s steps under ``shares``: every pipeline's step is the slowest's.
    ``slower``: pipelines whose stages run that many times their usual time."""
    slower = slower or {}
    stages = {i: [t * slower.get(i, 1.0) for t in STAGES[i]] for i in STAGES}
    m = shares[rank]
    stage = stages[rank]
    compute = schedule(stage, m)
    step = max(schedule(stages[i], shares[i]) for i in stages) + REST_MS
    idle = [compute - m * t for t in stage]
    t0 = time.time()
    return [StepRecord(
        batch_index=b, local_batch_size=m, placement_version=version, data_wait_ms=0.5, compute_ms=compute,
        sync_wait_ms=step - compute - REST_MS, optimizer_ms=1.0, step_ms=step, t=t0 + (b - first) * 0.01,
        n_microbatches=m, bubble_ms=sum(idle) / 2, stage_fwd_ms=tuple(t / 4 for t in stage),
        stage_bwd_ms=tuple(3 * t / 4 for t in stage), stage_send_wait_ms=(0.25, 0.0), stage_recv_wait_ms=(0.0, 0.5),
        stage_bubble_ms=tuple(idle), layer_ms=tuple(LAYERS[rank])) for b in range(first, first + n)]


def feed(ws: ClientConnection, rank: int, first: int, n: int, shares: list[int], version: int, *,
         job: str = JOB, slower: dict[int, float] | None = None) -> None:
    for start in range(first, first + n, 8):
        ws.send(encode(Metrics(job=job, rank=rank, steps=steps(rank, start, min(8, first + n - start), shares,
                                                                  version, slower=slower))))
