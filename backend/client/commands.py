"""``rebalancer jobs|job|proposals|approve|reject|mode|override|place|rollback|watch|report|causes``: the
REST client from a shell. Standard library only (``watch`` adds ``websockets``), so it runs
where the server's packages are not installed.

Exit codes scripts can rely on: 0 done; 1 the server refused (4xx; its reason on stderr);
2 bad usage; 3 the server cannot be reached; 4 the server failed (5xx).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from backend.client import watch
from backend.client._format import duration, num, table
from backend.client.rest import APIError, Client, ServerUnreachable
from backend.modes import MODES

__all__ = ["COMMANDS", "add_commands", "run", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE",
           "EXIT_UNREACHABLE", "EXIT_SERVER_ERROR"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_SERVER_ERROR = 0, 1, 2, 3, 4
COMMANDS = ("jobs", "job", "proposals", "approve", "reject", "mode", "override", "place", "rollback", "watch",
            "report", "causes")


class UsageError(ValueError):
    """A value the command line cannot mean (exit 2)."""


# --- parser -----------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server")
    g.add_argument("--server", help="backend URL (env REBALANCER_SERVER; default http://127.0.0.1:8000)")
    g.add_argument("--token", help="bearer token (env REBALANCER_TOKEN; prefer the env, argv is visible to ps)")
    g.add_argument("--json", action="store_true", help="print the server's JSON instead of text")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")
    return p


def add_commands(sub: Any) -> None:
    """Register the client commands on ``rebalancer``'s subparsers."""
    common = [_common()]

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".",
                              parents=common)  # type: ignore[no-any-return]

    add("jobs", "list jobs with their status, step time, imbalance and ETA")
    add("job", "one job: status, placement, pending proposal, ETA and cost").add_argument("name")
    p = add("proposals", "a job's proposals, newest first")
    p.add_argument("name")
    p.add_argument("--status", help="only this status (proposed, approved, applied, rejected, ...)")
    p.add_argument("--limit", type=int, default=20)
    for verb in ("approve", "reject"):
        p = add(verb, f"{verb} a proposal by id")
        p.add_argument("name")
        p.add_argument("id", type=int)
        p.add_argument("--reason")
    p = add("mode", "set a job's mode")
    p.add_argument("name")
    p.add_argument("mode", choices=MODES)
    p.add_argument("--reason")
    p = add("override", "pin, cap, floor or drain ranks (added to the overrides in force)")
    p.add_argument("name")
    p.add_argument("--pin", action="append", default=[], metavar="RANK=N", help="rank trains exactly N samples")
    p.add_argument("--cap", action="append", default=[], metavar="RANK=N", help="rank trains at most N samples")
    p.add_argument("--floor", action="append", default=[], metavar="RANK=N", help="rank trains at least N samples")
    p.add_argument("--drain", action="append", default=[], metavar="RANK[,RANK]", help="rank gets no samples")
    p.add_argument("--granularity", type=int, help="shares are multiples of this")
    p.add_argument("--clear", action="store_true", help="drop the overrides in force first")
    p.add_argument("--reason")
    p = add("place", "submit a placement by hand and apply it")
    p.add_argument("name")
    p.add_argument("shares", help="one share per rank, e.g. 12,12,8 (must sum to the global batch)")
    p.add_argument("--propose", action="store_true", help="only create the proposal; approve it later")
    p.add_argument("--force", action="store_true", help="submit it even though it breaks a memory cap (audited)")
    p.add_argument("--length-sq-weight", type=float, metavar="K",
                   help="send the cost model k with it: a sample of length L weighs L + K*L^2 (0 to 1e6)")
    p.add_argument("--reason")
    p = add("rollback", "return to exactly the shares in force before the current placement")
    p.add_argument("name")
    p.add_argument("--reason")
    p = add("watch", "live view of a job's ranks and shares (dashboard feed; Ctrl-C ends)")
    p.add_argument("name")
    p.add_argument("--count", type=int, default=0, help="stop after N updates (default: until Ctrl-C)")
    p.add_argument("--wait", action="store_true", help="wait for a job that has not started yet (by default "
                                                       "an unknown job is an error)")
    add("causes", "why a job is slow: each cause's time per step, GPU-hours lost and remedy").add_argument("name")
    p = add("report", "a job's end-of-run report: key figures, or one offline HTML file with --out")
    p.add_argument("name")
    p.add_argument("--out", metavar="FILE.html", help="write the self-contained HTML report (plotly charts) here")
    p.add_argument("--compare", metavar="OTHER", help="compare with another job's run")


# --- formatting ---------------------------------------------------------------------------


def _job_row(j: dict[str, Any]) -> list[Any]:
    imb = j.get("imbalance")
    return [j["job"], j.get("status", "-"), j.get("mode") or "-",
            f"{j.get('connected_ranks', 0)}/{j.get('world_size', '?')}", num(j.get("batch_index"), "{}"),
            num(j.get("step_ms")), num(imb, "{:.0%}"), duration(j.get("eta_s")),
            num(j.get("cost_per_hour"), "${:.2f}")]


def _job_text(j: dict[str, Any]) -> str:
    placement = j.get("placement") or {}
    lines = [
        ("job", f"{j['job']}: {j.get('status', '-')}" + (f" ({j['status_detail']})" if j.get("status_detail") else "")),
        ("mode", f"{j.get('mode') or '-'}, strategy {j.get('strategy') or '-'}"),
        ("ranks", f"{j.get('connected_ranks', 0)}/{j.get('world_size')} connected, "
                  f"global batch {j.get('global_batch_size')}"),
        ("progress", f"batch {num(j.get('batch_index'), '{}')}"
                     + (f" of {j['total_steps']}" if j.get("total_steps") else "")
                     + f", step {num(j.get('step_ms'))} ms, {num(j.get('step_rate_hz'), '{:.2f}')} steps/s"),
        ("imbalance", f"{num(j.get('imbalance'), '{:.1%}')}, idle {num(j.get('idle_fraction'), '{:.1%}')}"),
        ("placement", f"v{placement.get('version', '-')} {placement.get('shares', '-')}"),
        ("pending", f"proposal {j['pending_proposal_id']}" if j.get("pending_proposal_id") is not None else "none"),
        ("eta", duration(j.get("eta_s"))),
        ("cost", f"{num(j.get('cost_per_hour'), '${:.2f}')}/h, idle {num(j.get('idle_cost_per_hour'), '${:.2f}')}/h"),
    ]
    if p := j.get("pipeline"):  # a pipelined job (docs/pipelines.md); `GET .../pipeline` has the grid
        neck = "differs" if p.get("bottleneck_stage") is None else f"stage {p['bottleneck_stage']}"
        lines.append(("pipeline", f"{p['label']}, {p['pipelines']} pipelines; bottleneck {neck}, slowest pipeline "
                                  f"{num(p.get('slowest_pipeline'), '{}')}, bubble {num(p.get('bubble_share'), '{:.1%}')}"))
        lines.append(("advice", p.get("advice_note") or "-"))
    return "\n".join(f"{k + ':':<11}{v}" for k, v in lines)


def _proposal_row(p: dict[str, Any]) -> list[Any]:
    gain = p.get("predicted_gain")
    return [p["id"], p["status"], p["source"], num(gain, "{:+.1%}"), p["base_version"],
            ",".join(map(str, p["shares"])), time.strftime("%H:%M:%S", time.localtime(p["created_at"]))]


def _proposal_line(verb: str, p: dict[str, Any]) -> str:
    extra = f", placement version {p['placement_version']}" if p.get("placement_version") is not None else ""
    return f"Proposal {p['id']} of {p['job']} {verb}: shares {p['shares']}{extra}."


def _pairs(items: list[str], flag: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        rank, sep, n = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[str(int(rank))] = int(n)
        except ValueError:
            raise UsageError(f"{flag} expects RANK=N with whole numbers, like {flag} 2=16; got {item!r}.") from None
    return out


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"{what} expects whole numbers separated by commas, like 12,12,8; got {text!r}.") from None


# --- commands -------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, out: TextIO, data: Any, text: Callable[[], str]) -> int:
    out.write((json.dumps(data, indent=2) if args.json else text()) + "\n")
    return EXIT_OK


def _override(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    pins, caps, floors = _pairs(args.pin, "--pin"), _pairs(args.cap, "--cap"), _pairs(args.floor, "--floor")
    drains = [d for text in args.drain for d in _ints(text, "--drain")]
    if not (args.clear or pins or caps or floors or drains or args.granularity is not None):
        raise UsageError("override needs at least one of --pin, --cap, --floor, --drain, --granularity "
                         "or --clear.")
    cur: dict[str, Any] = {} if args.clear else dict(client.overrides(args.name))
    merged_pins = {**{str(k): v for k, v in (cur.get("pins") or {}).items()}, **pins}
    merged_caps = {**{str(k): v for k, v in (cur.get("caps") or {}).items()}, **caps}
    merged_floors = {**{str(k): v for k, v in (cur.get("floors") or {}).items()}, **floors}
    merged_drains = sorted({int(d) for d in (cur.get("drains") or [])} | set(drains))
    granularity = args.granularity if args.granularity is not None else int(cur.get("granularity") or 1)
    res = client.set_overrides(
        args.name, pins={int(k): v for k, v in merged_pins.items()},
        caps={int(k): v for k, v in merged_caps.items()},
        floors={int(k): v for k, v in merged_floors.items()},
        drains=merged_drains, granularity=granularity, reason=args.reason)

    def text() -> str:
        line = (f"Overrides of {args.name}: pins {res.get('pins') or {}}, caps {res.get('caps') or {}}, "
                f"floors {res.get('floors') or {}}, drains {res.get('drains') or []}, "
                f"granularity {res.get('granularity', 1)}.")
        pid = res.get("proposal_id")
        if pid is not None:
            line += (f"\nThe placement in force breaks them: proposal {pid} respects them "
                     f"(rebalancer approve {args.name} {pid}; in auto mode it applies by itself).")
        return line

    return _emit(args, out, res, text)


def _causes_text(name: str, c: dict[str, Any]) -> str:
    if not c.get("window_steps"):
        return f"Job {name}: no step every rank sent yet."
    lines = [f"Job {name}: {c['window_steps']} recent steps, {num(c.get('step_ms'))} ms a step "
             f"(replay {num(c.get('replayed_step_ms'))} ms)"]
    if c.get("hint"):
        lines.append(f"  {c['hint']}")
    if not c["data"]:
        return "\n".join([*lines, "  No cause costs more than 0.2% of the step."])
    lines.append(table(["CAUSE", "RANKS", "ms/STEP", "SHARE", "GPU-h LOST", "STEP WITHOUT ms"],
                       [[x["cause"], ",".join(map(str, x["ranks"])) or "-", num(x["ms_per_step"]),
                         f"{100 * x['share_of_step']:.1f}%", num(x["gpu_hours_lost"], "{:.4f}"),
                         num(x["predicted_step_ms_without"])] for x in c["data"]]))
    lines += [f"{x['cause']}: {x['remedy']}" for x in c["data"]]
    return "\n".join(lines)


def _report_text(r: dict[str, Any]) -> str:
    cost, sv = r.get("cost") or {}, r.get("savings") or {}
    lines = [
        f"Job {r['job']}: {'finished' if r.get('finished') else 'running'} ({r.get('reason')}), "
        f"{r['world_size']} ranks, global batch {r['global_batch_size']}",
        f"  duration {duration(r.get('duration_s'))}, {r.get('steps', 0)} steps, "
        f"{num(r.get('samples_per_s'))} samples/s, mean step {num(r.get('mean_step_ms'))} ms",
        f"  cost {num(cost.get('per_hour'), '${:.2f}')}/h, {num(cost.get('total'), '${:.4f}')} in total; "
        f"saved vs uniform {num(sv.get('saved_s'), '{:.1f}')} s, {num(sv.get('saved_cost'), '${:.4f}')}",
        f"  placements {len(r.get('placements') or [])}, proposals {len(r.get('proposals') or [])} "
        f"({', '.join(f'{k} {v}' for k, v in (r.get('decisions') or {}).items()) or 'none'})",
        table(["RANK", "DEVICE", "STEPS", "COMPUTE ms", "SYNC WAIT ms", "DATA WAIT ms"],
               [[x["rank"], x.get("device_name") or x.get("device_type"), x["steps"],
                 num(x.get("compute_ms_per_step")), num(x.get("sync_wait_ms_per_step")),
                 num(x.get("data_wait_ms_per_step"))] for x in r.get("ranks") or []]),
    ]
    adv = r.get("advice")
    lines += ["Advice:", *(f"  {a}" for a in adv["summary"])] if adv else ["Advice: not enough steps stored."]
    return "\n".join(lines)


def _report(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    name = str(args.name)
    if args.out:
        page = client.report_html(name, compare=args.compare)
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as exc:
            raise UsageError(f"cannot write {args.out}: {exc.strerror or exc}.") from None
        what = f"{name} against {args.compare}" if args.compare else name
        out.write(f"Wrote the report of {what} to {args.out} ({len(page) // 1024} kB, opens offline).\n")
        return EXIT_OK
    if args.compare:
        both = client.report(name, compare=args.compare)
        return _emit(args, out, both, lambda: "\n\n".join(_report_text(r) for r in both["data"]))
    r = client.report(name)
    return _emit(args, out, r, lambda: _report_text(r))


def _dispatch(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    cmd, name = args.command, str(getattr(args, "name", ""))
    if cmd == "jobs":
        jobs = client.jobs()
        return _emit(args, out, jobs, lambda: table(
            ["JOB", "STATUS", "MODE", "RANKS", "BATCH", "STEP ms", "IMBALANCE", "ETA", "COST/h"],
            [_job_row(dict(j)) for j in jobs]) if jobs else "No jobs yet.")
    if cmd == "job":
        j = client.job(name)
        return _emit(args, out, j, lambda: _job_text(dict(j)))
    if cmd == "causes":
        c = client.causes(name)
        return _emit(args, out, c, lambda: _causes_text(name, dict(c)))
    if cmd == "proposals":
        if args.limit < 1:
            raise UsageError(f"--limit must be at least 1, got {args.limit}.")
        props = client.proposals(name, status=args.status, limit=args.limit)
        return _emit(args, out, props, lambda: table(
            ["ID", "STATUS", "SOURCE", "GAIN", "BASE", "SHARES", "CREATED"],
            [_proposal_row(dict(p)) for p in props]) if props else f"No proposals for {name}.")
    if cmd in ("approve", "reject"):
        fn = client.approve if cmd == "approve" else client.reject
        p = fn(name, args.id, reason=args.reason)
        return _emit(args, out, p, lambda: _proposal_line("approved" if cmd == "approve" else "rejected", dict(p)))
    if cmd == "mode":
        ctl = client.set_mode(name, args.mode, reason=args.reason)
        if ctl.get("preset"):  # a job not seen yet: stored, applied at its first hello
            return _emit(args, out, ctl, lambda: f"Job {name} has not started yet: mode {ctl.get('mode', args.mode)} "
                                                 "is preset and applies when its first rank connects.")
        return _emit(args, out, ctl, lambda: f"Job {name} is now in {ctl.get('mode', args.mode)} mode.")
    if cmd == "override":
        return _override(client, args, out)
    if cmd == "place":
        shares = _ints(args.shares, "place")
        if not shares:
            raise UsageError("place needs one share per rank, like 12,12,8.")
        p = client.submit_placement(name, shares, reason=args.reason, apply=not args.propose,
                                    force=args.force, length_sq_weight=args.length_sq_weight)
        verb = "proposed (approve it to apply)" if args.propose else "approved; the job switches at a step boundary"
        return _emit(args, out, p, lambda: _proposal_line(verb, dict(p)))
    if cmd == "rollback":
        pl = client.rollback(name, reason=args.reason)
        return _emit(args, out, pl, lambda: f"Rolled {name} back: placement version {pl['version']} "
                                            f"restores shares {pl['shares']}.")
    if cmd == "watch":
        if args.count < 0:
            raise UsageError(f"--count must be 0 (no end) or more, got {args.count}.")
        if not args.wait:
            _require_job(client, name)
        watch.watch(client, name, count=args.count, as_json=args.json, out=out)
        return EXIT_OK
    if cmd == "report":
        return _report(client, args, out)
    raise UsageError(f"unknown command {cmd!r}.")


def _require_job(client: Client, name: str) -> None:
    """A job the backend knows, or an error naming the jobs it does know (a misspelt name
    would otherwise wait for frames that never come)."""
    try:
        client.job(name)
        return
    except APIError as exc:
        if exc.status != 404:
            raise
    names = sorted(j["job"] for j in client.jobs())
    known = (f"known jobs: {', '.join(names[:10])}" + (f" and {len(names) - 10} more" if len(names) > 10 else "")
             if names else "the backend has no jobs yet")
    raise APIError(404, f"Job '{name}' not found ({known}; `rebalancer jobs` lists them). To wait for a job "
                        "that has not started yet, pass --wait.", method="GET", path=f"/api/v1/jobs/{name}")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run one parsed client command; returns the exit code (messages go to stderr)."""
    out = out or sys.stdout
    try:
        try:
            client = Client(args.server, args.token, timeout=args.timeout)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if getattr(args, "name", "x") == "":
            raise UsageError("the job name must not be empty.")
        return _dispatch(client, args, out)
    except UsageError as exc:
        print(f"rebalancer {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except APIError as exc:
        print(f"rebalancer {args.command}: {exc.detail} (HTTP {exc.status})", file=sys.stderr)
        return EXIT_SERVER_ERROR if exc.status >= 500 else EXIT_REFUSED
    except ServerUnreachable as exc:
        print(f"rebalancer {args.command}: {exc} Is `rebalancer serve` running there? "
              f"Set --server or REBALANCER_SERVER.", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ImportError as exc:
        print(f"rebalancer {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `rebalancer jobs | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
