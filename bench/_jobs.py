"""Run the demo worker (a real torchrun/gloo CPU DDP job) against a backend, one setting.

A run: start the job, wait until the backend knows it, set its mode and policy (or apply
a manual placement), wait for the job to finish, and read the per-step times rank 0
wrote to its ``--result`` file.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._analysis import oracle_shares, static_shares
from bench._backend import REPO_ROOT, ApiError, Backend, free_port

STRATEGIES = ("uniform", "static", "profiled", "predictive", "oracle")


@dataclass
class JobSpec:
    """One demo job: true speeds, workload size and what happens during it."""

    job: str
    speeds: Sequence[float]
    steps: int
    global_batch_size: int = 64
    per_sample_ms: float = 2.0
    fixed_ms: float = 2.0
    slowdown: str | None = None  # RANK:STEP:FACTOR
    drift: str | None = None  # RANK:START_STEP:PCT_PER_STEP
    lookahead: int | None = None  # HookConfig.lookahead (None: the hook's default)
    # demo_worker --wrap: "ddp", "fsdp2" or "dp_tp" (a DP x TP mesh of TP groups of 2 ranks,
    # whose shares are per replica: a replica computes at its slowest member's speed).
    wrap: str = "ddp"

    @property
    def replica_speeds(self) -> list[float]:
        """The speed of each worker the split is over: a rank, or with dp_tp a replica (its
        slowest member)."""
        if self.wrap != "dp_tp":
            return list(self.speeds)
        return [min(self.speeds[i:i + 2]) for i in range(0, len(self.speeds), 2)]

    @property
    def a_ms(self) -> list[float]:
        return [self.fixed_ms for _ in self.replica_speeds]

    @property
    def c_ms(self) -> list[float]:
        return [self.per_sample_ms / s for s in self.replica_speeds]


@dataclass
class JobRun:
    spec: JobSpec
    strategy: str
    step_ms: list[float]
    placements: list[dict[str, Any]]  # from the worker's result file: version, batch, shares
    wall_s: float
    backend_placements: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_t: list[float] = field(default_factory=list)  # rank 0's Unix time at each step's end
    proposals: list[dict[str, Any]] = field(default_factory=list)  # the backend's, oldest first

    def batch_at(self, t: float) -> int:
        """Rank 0's batch index in progress at Unix time ``t`` (steps it had finished)."""
        return bisect.bisect_right(self.step_t, t)


def _torchrun_cmd(nproc: int, args: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "--max-restarts", "0",
        "-m", "trainer_hook.demo_worker", *args,
    ]


def _worker_args(spec: JobSpec, backend: Backend, result: Path) -> list[str]:
    args = [
        "--server", backend.url, "--job", spec.job, "--steps", str(spec.steps),
        "--global-batch-size", str(spec.global_batch_size),
        "--speeds", ",".join(f"{s:g}" for s in spec.speeds),
        "--per-sample-ms", f"{spec.per_sample_ms:g}", "--fixed-ms", f"{spec.fixed_ms:g}",
        "--result", str(result),
    ]
    if spec.slowdown:
        args += ["--slowdown", spec.slowdown]
    if spec.drift:
        args += ["--drift", spec.drift]
    if spec.lookahead is not None:
        args += ["--lookahead", str(spec.lookahead)]
    if spec.wrap != "ddp":
        args += ["--wrap", spec.wrap]
    return args


def _wait_job(backend: Backend, job: str, proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """Poll GET /jobs/{job} until every rank has said hello."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"job {job} exited with {proc.returncode} before registering")
        try:
            last = backend.get(f"/api/v1/jobs/{job}")
            ws = last.get("world_size") or 0
            if ws and (last.get("connected_ranks") or 0) >= ws:
                # The live view knows the ranks a moment before the controller has the job's
                # row in SQL: until then PUT .../mode answers 404 (a run lost to it).
                backend.get(f"/api/v1/jobs/{job}/policy")
                return dict(last)
        except ApiError as exc:
            if exc.status != 404:
                raise
        time.sleep(0.05)
    raise RuntimeError(f"job {job} did not register within {timeout}s (last: {last})")


def configure(backend: Backend, job: str, strategy: str, spec: JobSpec, policy: dict[str, Any]) -> list[str]:
    """Put a registered job under ``strategy``; returns notes on what was done."""
    notes: list[str] = []
    if strategy == "uniform":
        backend.put(f"/api/v1/jobs/{job}/mode", {"mode": "observe", "reason": "bench: uniform"})
    elif strategy in ("oracle", "static"):
        # A hand-made placement, applied at once; approve mode so nothing else is applied.
        shares = oracle_shares(spec.a_ms, spec.c_ms, spec.global_batch_size) if strategy == "oracle" \
            else static_shares(spec.speeds, spec.global_batch_size)
        backend.put(f"/api/v1/jobs/{job}/mode", {"mode": "approve", "reason": f"bench: {strategy}"})
        prop = backend.post(f"/api/v1/jobs/{job}/proposals", {
            "shares": shares, "apply": True,
            "reason": f"bench: {strategy} split from the injected speeds"})
        if prop.get("status") == "proposed":
            backend.post(f"/api/v1/jobs/{job}/proposals/{prop['id']}/approve", {"reason": "bench"})
        notes.append(f"{strategy} shares {shares} applied by hand")
    else:
        backend.put(f"/api/v1/jobs/{job}/policy", {"strategy": strategy, **policy,
                                                   "reason": f"bench: {strategy}"})
        backend.put(f"/api/v1/jobs/{job}/mode", {"mode": "auto", "reason": f"bench: {strategy}"})
    return notes


def run_job(
    backend: Backend, spec: JobSpec, strategy: str, *, policy: dict[str, Any] | None = None,
    timeout: float = 600.0, retries: int = 1,
) -> JobRun:
    """Run one job to the end under ``strategy`` (one of STRATEGIES).

    A job that fails without a complete result is run again (as ``<job>-retry<n>``, a new
    job for the backend) up to ``retries`` times; the failure is kept in ``notes``, so a
    flaky job shows in the results instead of silently disappearing.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    failures: list[str] = []
    for attempt in range(retries + 1):
        job = spec.job if attempt == 0 else f"{spec.job}-retry{attempt}"
        try:
            run = _run_once(backend, dataclasses.replace(spec, job=job), strategy, policy, timeout)
        except JobFailed as exc:
            failures.append(str(exc)[-1500:])
            print(f"  job {job} failed ({exc.reason}); {'retrying' if attempt < retries else 'giving up'}",
                  flush=True)
            continue
        run.notes = [f"earlier attempt failed: {f}" for f in failures] + run.notes
        return run
    raise RuntimeError(f"job {spec.job} failed {retries + 1} times; last failure:\n{failures[-1]}")


class JobFailed(RuntimeError):
    def __init__(self, reason: str, output: str):
        super().__init__(f"{reason}\n{output}")
        self.reason = reason


def _run_once(backend: Backend, spec: JobSpec, strategy: str, policy: dict[str, Any] | None,
              timeout: float) -> JobRun:
    with tempfile.TemporaryDirectory(prefix="rb-job-") as tmp:
        result = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO_ROOT)}
        t0 = time.monotonic()
        proc = subprocess.Popen(
            _torchrun_cmd(len(spec.speeds), _worker_args(spec, backend, result)),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            try:
                _wait_job(backend, spec.job, proc, timeout=120)
            except RuntimeError as exc:
                raise JobFailed(str(exc), proc.communicate(timeout=30)[0] if proc.poll() is not None else "") from None
            notes = configure(backend, spec.job, strategy, spec, policy or {})
            out, _ = proc.communicate(timeout=timeout)
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        wall = time.monotonic() - t0
        data = json.loads(result.read_text()) if result.exists() else None
        complete = data is not None and len(data.get("step_ms", [])) >= spec.steps
        if proc.returncode != 0:
            if not complete:
                raise JobFailed(f"exit code {proc.returncode}, no complete result", out[-3000:])
            # Every step ran and rank 0 wrote its result; the crash came while tearing down.
            notes.append(f"job exited {proc.returncode} after writing a complete result: "
                         + " | ".join(line for line in out.splitlines()[-40:] if "terminate" in line
                                      or "exitcode" in line)[:500])
        if data is None:
            raise JobFailed("the job exited 0 but wrote no result file", out[-3000:])
    backend_placements = _listed(backend, f"/api/v1/jobs/{spec.job}/placements")
    proposals = sorted(_listed(backend, f"/api/v1/jobs/{spec.job}/proposals"),
                       key=lambda p: float(p.get("created_at") or 0.0))
    rank0 = (data.get("records") or [[]])[0]
    return JobRun(
        spec=spec, strategy=strategy, step_ms=[float(x) for x in data["step_ms"]],
        placements=list(data.get("placements", [])), wall_s=wall,
        backend_placements=backend_placements, notes=notes,
        step_t=[float(r["t"]) for r in rank0], proposals=proposals,
    )


def _listed(backend: Backend, path: str) -> list[dict[str, Any]]:
    try:
        got = backend.get(path)
    except ApiError:
        return []
    return list(got.get("data", [])) if isinstance(got, dict) else []
