"""Soak: run every launch path many times and count hangs and abnormal exits.

    python -m bench.soak --runs 20                        # every path, 20 runs each
    python -m bench.soak --runs 3 --paths ddp-w0,accelerate --burn 2
    python -m bench.soak --list                           # the paths and what they run
    make soak                                             # SOAK_RUNS=... SOAK_PATHS=...

Each run is a real 2-rank torchrun/gloo CPU job (``bench._soak_worker``) with a
timeout. A run is a **hang** when it outlives its timeout (every process then prints its
stacks, see ``bench._launch``) and **abnormal** when it ended otherwise than the path
expects: a non-zero exit (or, for the paths that end with the user's error, an exit
other than that error), a worker killed by a signal, ``terminate called`` or ``Fatal
Python error`` in the output, a Python thread still running at exit, a process of the
job left running after torchrun ended, or a job that never reached its end. Runs go
round-robin over the paths, so load changes hit every path alike. ``--burn N`` keeps N
busy-looping processes running alongside. The report (per path: runs, hangs, abnormal,
the reasons, the first failures' stacks) is written to ``bench/results/soak.json`` (or
``--out``); the whole log of each failed run is kept under ``--log-dir``.
Exit code: 0 when every run was clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._backend import free_port, running_backend, stop_on_sigterm
from bench._launch import LaunchResult, first_stacks, launch, torchrun_cmd
from bench._load import busy_loops
from bench._report import RESULTS_DIR, machine

__all__ = ["PATHS", "MAIN_PATHS", "CI_PATHS", "Path_", "classify", "run_soak", "main"]

WORKER = ["-m", "bench._soak_worker"]


@dataclass(frozen=True)
class Path_:
    """One launch path: the worker's arguments, its backend and the end it must reach."""

    name: str
    args: tuple[str, ...]
    what: str
    backend: str = "live"  # live | absent | killed | none (offline)
    max_restarts: int = 0
    # c10d rendezvous with an unshared store: how docs/integrations.md says to launch
    # restartable gloo jobs (the static rendezvous cannot restart them in torch 2.13).
    rdzv_c10d: bool = False
    # Exit codes a worker may end with: (0,) unless the user's own error ends the run
    # (then also -15: torchrun SIGTERMs the ranks still running when one has failed).
    worker_codes: tuple[int, ...] = (0,)
    expect_text: str = "[soak] done"  # must appear in the output
    timeout_s: float = 120.0


PATHS: dict[str, Path_] = {p.name: p for p in [
    Path_("ddp-w0", ("--mode", "ddp", "--steps", "60"),
          "DDP, num_workers=0, live backend, 60 steps (the run that once ended in SIGABRT)"),
    Path_("ddp-w2-fork", ("--mode", "ddp", "--num-workers", "2", "--mp-context", "fork"),
          "DDP, 2 DataLoader workers started by fork"),
    Path_("ddp-w4-fork", ("--mode", "ddp", "--num-workers", "4", "--mp-context", "fork"),
          "DDP, 4 DataLoader workers started by fork"),
    # One epoch (16 batches) at most: these start methods re-import torch in every worker
    # of every epoch, about 50 s a worker on 2 loaded cores.
    Path_("ddp-w2-forkserver", ("--mode", "ddp", "--num-workers", "2", "--mp-context", "forkserver", "--steps", "14"),
          "DDP, 2 DataLoader workers from a forkserver, 14 steps", timeout_s=180.0),
    Path_("ddp-w2-spawn", ("--mode", "ddp", "--num-workers", "2", "--mp-context", "spawn", "--steps", "14"),
          "DDP, 2 DataLoader workers started by spawn, 14 steps", timeout_s=180.0),
    Path_("accum2-w2", ("--mode", "accum", "--accum", "2", "--num-workers", "2"),
          "DDP with gradient accumulation (no_sync) over 2 micro-batches, 2 workers"),
    Path_("accelerate", ("--mode", "accelerate", "--accum", "2", "--num-workers", "2"),
          "Accelerate, accumulation 2, 2 workers (the run that once hung in CI)"),
    Path_("hf-trainer", ("--mode", "hf", "--accum", "2", "--steps", "20"),
          "HF Trainer (RebalancingTrainer), accumulation 2"),
    Path_("fsdp2", ("--mode", "fsdp2",), "FSDP2 (fully_shard), gradients='loss_scale'"),
    Path_("elastic-restart", ("--mode", "elastic", "--steps", "30", "--fail-at", "12"),
          "rank 1 dies at step 12 of the first attempt; torchrun restarts both ranks",
          max_restarts=1, rdzv_c10d=True),
    Path_("backend-absent", ("--mode", "ddp", "--num-workers", "2"),
          "the backend URL points at a closed port", backend="absent"),
    Path_("backend-killed", ("--mode", "ddp", "--num-workers", "2", "--steps", "60", "--kill-backend-at", "20"),
          "rank 0 SIGKILLs the backend at step 20; training goes on", backend="killed"),
    Path_("end-after-destroy", ("--mode", "ddp", "--end", "close-after-destroy"),
          "hook.close() after dist.destroy_process_group()"),
    Path_("end-no-close", ("--mode", "ddp", "--num-workers", "2", "--end", "no-close"),
          "no hook.close() and no destroy_process_group(): the interpreter's exit"),
    Path_("end-exception", ("--mode", "ddp", "--num-workers", "2", "--end", "exception"),
          "every rank raises the user's error from the loop at step 10",
          worker_codes=(1, -15), expect_text="SoakUserError"),
    Path_("end-interrupt", ("--mode", "ddp", "--end", "interrupt"),
          "KeyboardInterrupt from the loop at step 10 on every rank",
          worker_codes=(1, -2, 130, -15), expect_text="KeyboardInterrupt"),
]}
# The main paths: the DataLoader start methods, the integrations, a restart, the backend
# failing, and the exits that once aborted.
MAIN_PATHS = ("ddp-w0", "ddp-w2-fork", "ddp-w2-spawn", "accelerate", "hf-trainer", "elastic-restart",
              "backend-killed", "end-no-close", "end-exception")
# CI runs each of these once (tests/bench/test_soak.py); the ends of a script each run once
# in tests/trainer_hook/test_clean_exit.py. Kept to two for CI's time budget (issue 26):
# fork-started workers, Accelerate and the TorchElastic restart have their own end-to-end
# tests (test_fork_safety, test_accelerate, test_elastic); `make soak` runs all the main paths.
CI_PATHS = ("ddp-w2-spawn", "backend-killed")

_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def classify(path: Path_, res: LaunchResult) -> list[str]:
    """Why a run is not clean (empty: clean). A hang is reported as the single reason 'hang'."""
    if res.hung:
        return ["hang"]
    reasons = [f"output: {f}" for f in res.findings]
    if res.leaked:
        reasons.append(f"leaked {len(res.leaked)} process(es)")
    codes = [int(c) for c in _EXITCODE.findall(res.output)]
    if path.worker_codes == (0,):
        if res.returncode != 0:
            reasons.append(f"torchrun exit {res.returncode}")
        if path.max_restarts == 0 and any(c != 0 for c in codes):
            reasons.append(f"worker exit codes {sorted(set(codes))}")
    else:
        if res.returncode == 0:
            reasons.append("torchrun exit 0 although the user's error should end the run")
        bad = sorted({c for c in codes if c not in path.worker_codes})
        if bad:
            reasons.append(f"worker exit codes {bad} (expected {list(path.worker_codes)})")
    if any(c < 0 and c not in path.worker_codes for c in codes) and path.max_restarts == 0:
        reasons.append("a worker was killed by a signal")
    if path.expect_text not in res.output:
        reasons.append(f"no {path.expect_text!r} in the output")
    return sorted(set(reasons))


@dataclass
class PathStats:
    path: Path_
    runs: int = 0
    hangs: int = 0
    abnormal: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    wall_s: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    infra_errors: list[str] = field(default_factory=list)  # runs not made (the backend did not start)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path.name, "what": self.path.what, "runs": self.runs, "hangs": self.hangs,
            "abnormal": self.abnormal, "clean": self.runs - self.hangs - self.abnormal,
            "reasons": dict(self.reasons),
            "wall_s_median": round(statistics.median(self.wall_s), 2) if self.wall_s else None,
            "wall_s_max": round(max(self.wall_s), 2) if self.wall_s else None,
            "failures": self.failures,
            "not_run": len(self.infra_errors),
            "not_run_errors": self.infra_errors[:3],
        }


def run_soak(
    paths: list[str], runs: int, *, burn: int = 0, log_dir: Path, max_minutes: float | None = None,
    timeout_s: float | None = None, progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``runs`` rounds over ``paths``; returns the report (see the module docstring)."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"unknown soak path(s) {unknown}; known: {', '.join(PATHS)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    stats = {name: PathStats(PATHS[name]) for name in paths}
    started = time.monotonic()
    load0 = os.getloadavg()[0]
    stopped_early = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(busy_loops(burn))
        live = None
        if any(PATHS[p].backend == "live" for p in paths):
            live = stack.enter_context(running_backend(Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="rb-soak-")))))
        for i in range(runs):
            for name in paths:
                if max_minutes is not None and time.monotonic() - started > max_minutes * 60:
                    stopped_early = True
                    break
                path = stats[name].path
                st = stats[name]
                try:
                    res = _run_once(path, i, live_url=live.url if live else None, log_dir=log_dir,
                                    timeout_s=timeout_s or path.timeout_s)
                except RuntimeError as exc:  # the soak's own backend did not start: not a run
                    st.infra_errors.append(str(exc)[:2000])
                    progress(f"soak: round {i + 1}/{runs} {name:18s} not run: {str(exc)[:200]}")
                    continue
                st.runs += 1
                st.wall_s.append(res.wall_s)
                reasons = classify(path, res)
                verdict = "ok"
                if reasons == ["hang"]:
                    st.hangs += 1
                    verdict = "HANG"
                elif reasons:
                    st.abnormal += 1
                    verdict = "ABNORMAL: " + "; ".join(reasons)
                st.reasons.update(reasons)
                if reasons:
                    log_path = log_dir / f"{name}-{i}.log"
                    if len(st.failures) < 3:
                        st.failures.append({"run": i, "reasons": reasons, "returncode": res.returncode,
                                            "leaked": res.leaked, "log": str(log_path),
                                            "stacks": first_stacks(res.output)})
                else:
                    (log_dir / f"{name}-{i}.log").unlink(missing_ok=True)
                progress(f"soak: round {i + 1}/{runs} {name:18s} {res.wall_s:6.1f}s {verdict}")
            if stopped_early:
                progress(f"soak: the {max_minutes:g} min budget is spent; stopped in round {i + 1}")
                break
    report = {
        "command": "python -m bench.soak " + " ".join(sys.argv[1:]),
        "started_load_avg_1m": round(load0, 2),
        "burners": burn,
        "rounds_requested": runs,
        "stopped_early": stopped_early,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "totals": {
            "runs": sum(s.runs for s in stats.values()),
            "hangs": sum(s.hangs for s in stats.values()),
            "abnormal": sum(s.abnormal for s in stats.values()),
        },
        "paths": [s.to_json() for s in stats.values()],
    }
    return report


def _run_once(path: Path_, i: int, *, live_url: str | None, log_dir: Path, timeout_s: float) -> LaunchResult:
    env = {"REBALANCER_JOB": f"soak-{path.name}-{i}-{os.getpid()}"}
    log_path = log_dir / f"{path.name}-{i}.log"
    cmd = torchrun_cmd(2, [*WORKER, *path.args], max_restarts=path.max_restarts, rdzv_c10d=path.rdzv_c10d)
    if path.rdzv_c10d:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if path.backend == "live":
        assert live_url is not None
        env["REBALANCER_SERVER"] = live_url
    elif path.backend == "absent":
        env["REBALANCER_SERVER"] = f"http://127.0.0.1:{free_port()}"
    elif path.backend == "killed":
        with tempfile.TemporaryDirectory(prefix="rb-soak-") as tmp, running_backend(Path(tmp)) as backend:
            env["REBALANCER_SERVER"] = backend.url
            env["REBALANCER_SOAK_BACKEND_PID"] = str(backend.pid)
            return launch(cmd, env=env, timeout=timeout_s, log_path=log_path)
    return launch(cmd, env=env, timeout=timeout_s, log_path=log_path)


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"{'path':20s} {'runs':>5s} {'hangs':>6s} {'abnormal':>9s} {'median s':>9s}"]
    for p in report["paths"]:
        med = p["wall_s_median"]
        lines.append(f"{p['path']:20s} {p['runs']:5d} {p['hangs']:6d} {p['abnormal']:9d} "
                     f"{med if med is not None else '-':>9}")
        for reason, n in p["reasons"].items():
            lines.append(f"{'':22s}{n} x {reason}")
    t = report["totals"]
    lines.append(f"total: {t['runs']} runs, {t['hangs']} hangs, {t['abnormal']} abnormal "
                 f"({report['minutes']} min, {report['burners']} burners, load {report['started_load_avg_1m']} at start)")
    return lines


def markdown_table(report: dict[str, Any]) -> str:
    """The report as the Markdown table docs/reliability.md shows."""
    rows = ["| path | runs | hangs | abnormal | median / max s |", "|---|---|---|---|---|"]
    for p in report["paths"]:
        why = "; ".join(f"{n} x {r}" for r, n in p["reasons"].items())
        abnormal = f"{p['abnormal']} ({why})" if p["abnormal"] and why else str(p["abnormal"])
        rows.append(f"| `{p['path']}` | {p['runs']} | {p['hangs']} | {abnormal} | "
                    f"{p['wall_s_median']} / {p['wall_s_max']} |")
    t = report["totals"]
    rows.append(f"| **all** | **{t['runs']}** | **{t['hangs']}** | **{t['abnormal']}** | |")
    return "\n".join(rows)


def report_path(out: Path) -> Path:
    """Where the report goes: ``out``, or ``out/soak.json`` for a folder (a long soak once
    ran for 40 minutes and lost its report writing onto a folder)."""
    return out / "soak.json" if out.is_dir() else out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="rounds over the paths (runs per path)")
    p.add_argument("--paths", default="all", help="comma-separated path names, 'all' or 'main'")
    p.add_argument("--burn", type=int, nargs="?", const=os.cpu_count() or 1, default=0,
                   help="busy-looping processes alongside (bare --burn: one per CPU)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a run counts as hung")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json",
                   help="report file, or a folder to write soak.json in")
    p.add_argument("--log-dir", type=Path, default=None, help="failed runs' logs (default: a temp dir)")
    p.add_argument("--list", action="store_true", help="print the paths and exit")
    p.add_argument("--markdown", type=Path, default=None, metavar="JSON",
                   help="print a soak report (bench/results/soak.json) as a Markdown table and exit")
    args = p.parse_args(argv)
    if args.markdown is not None:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return 0
    if args.list:
        for path in PATHS.values():
            print(f"{path.name:20s} {path.what}")
        return 0
    if args.runs < 1 or args.burn < 0 or (args.timeout is not None and args.timeout <= 0):
        p.error("--runs must be >= 1, --burn >= 0, --timeout > 0")
    args.out = report_path(args.out)  # before an hour of runs, not after
    names = list(PATHS) if args.paths == "all" else list(MAIN_PATHS) if args.paths == "main" else \
        [s.strip() for s in args.paths.split(",") if s.strip()]
    stop_on_sigterm()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="rb-soak-logs-"))
    try:
        report = run_soak(names, args.runs, burn=args.burn, log_dir=log_dir, max_minutes=args.max_minutes,
                          timeout_s=args.timeout)
    except ValueError as exc:
        p.error(str(exc))
    report["machine"] = machine()
    report["log_dir"] = str(log_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(summary_lines(report)))
    print(f"report: {args.out}; failed runs' logs: {log_dir}")
    t = report["totals"]
    return 0 if t["hangs"] == 0 and t["abnormal"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
