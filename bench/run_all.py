"""Run every benchmark and write ``bench/results/summary.json`` and ``summary.md``.

    python -m bench.run_all            # full: about 15 minutes on 2 cores
    python -m bench.run_all --quick    # smaller: under 3 minutes
    python -m bench.run_all --only balance,capacity
    python -m bench.run_all --docs     # and rewrite the tables in docs/performance.md

One benchmark failing does not stop the others: its entry in the summary says what broke.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._backend import REPO_ROOT, stop_on_sigterm
from bench._report import RESULTS_DIR, machine, markdown_table

__all__ = ["BENCHMARKS", "run_all", "summary_markdown", "headline_rows", "update_docs", "main"]

BENCHMARKS = ("balance", "reaction", "hook_overhead", "capacity", "policy")


def _balance(quick: bool, out: Path) -> dict[str, Any]:
    from bench import balance

    if quick:
        return balance.run_balance(**balance.QUICK, out_dir=out)
    return balance.run_balance(steps=150, out_dir=out)


def _reaction(quick: bool, out: Path) -> dict[str, Any]:
    from bench import reaction

    if quick:
        return reaction.run_reaction(**reaction.QUICK, out_dir=out)
    return reaction.run_reaction(out_dir=out)


def _capacity(quick: bool, out: Path) -> dict[str, Any]:
    from dataclasses import asdict

    from bench import capacity

    if quick:
        res = capacity.run_capacity([8, 256], seconds=4, warmup=1, out_dir=out)
    else:
        res = capacity.run_capacity([8, 64, 256, 1024], seconds=15, warmup=3, out_dir=out)
    return {"results": [asdict(r) for r in res]}


def _policy(quick: bool, out: Path) -> dict[str, Any]:
    from bench import policy  # the policy engineer's benchmark

    return policy.run_policy(quick, out)


def _external(module: str, quick: bool, out: Path) -> dict[str, Any]:
    """A benchmark another module owns: run it as a subprocess, keep its table and JSON."""
    path = out / f"{module}.json"
    cmd = [sys.executable, "-m", f"bench.{module}", "--out", str(path)] + (["--quick"] if quick else [])
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except BaseException:
        proc.send_signal(signal.SIGINT)  # lets it stop the backend it started
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    print(stdout, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{stderr[-3000:]}")
    data = json.loads(path.read_text()) if path.exists() else {}
    return {"stdout": stdout, **data}


RUNNERS: dict[str, Callable[[bool, Path], dict[str, Any]]] = {
    "balance": _balance,
    "reaction": _reaction,
    "capacity": _capacity,
    "hook_overhead": lambda quick, out: _external("hook_overhead", quick, out),
    "policy": lambda quick, out: _policy(quick, out),
}


def run_all(names: tuple[str, ...] = BENCHMARKS, *, quick: bool = False, out: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run ``names`` in order; return and write the summary."""
    summary: dict[str, Any] = {"quick": quick, "machine": machine(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "benchmarks": {}}
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.monotonic()
        try:
            data = RUNNERS[name](quick, out)
            entry = {"ok": True, "seconds": round(time.monotonic() - t0, 1), "result": data}
        except Exception as exc:  # noqa: BLE001 - report it and run the next benchmark
            traceback.print_exc()
            entry = {"ok": False, "seconds": round(time.monotonic() - t0, 1),
                     "error": f"{type(exc).__name__}: {exc}"[:4000]}
        summary["benchmarks"][name] = entry
        print(f"--- {name}: {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(_compact(summary), indent=2) + "\n")
    md = summary_markdown(summary)
    (out / "summary.md").write_text(md)
    print("\n" + md, flush=True)
    return summary


def _compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without per-step series (those live in each benchmark's own JSON)."""
    out = json.loads(json.dumps(summary))
    for entry in out["benchmarks"].values():
        res = entry.get("result") or {}
        for key in ("step_ms", "series", "stdout"):
            res.pop(key, None)
    return out


def summary_markdown(summary: dict[str, Any]) -> str:
    """Headline tables in markdown, from a run_all summary."""
    parts = [f"# Benchmark summary ({'quick' if summary.get('quick') else 'full'} run, "
             f"{summary.get('started', '')})", ""]
    m = summary.get("machine", {})
    parts += [f"Machine: {m.get('cpus')} CPU cores, {m.get('memory_gib')} GiB, Python {m.get('python')}, "
              f"load average at start {m.get('load_avg_1m')}.", ""]
    b = summary["benchmarks"]
    rows = headline_rows(summary)
    if rows:
        parts += ["## Headline", "", markdown_table(["measure", "result", "target"], rows), ""]
    for name, entry in b.items():
        if not entry.get("ok"):
            parts += [f"## {name}: FAILED", "", "```", entry.get("error", "")[:1500], "```", ""]
            continue
        res = entry["result"]
        if name == "balance":
            parts += ["## Balance efficiency (oracle step time / achieved; target >= 0.95)", ""]
            scen = list(dict.fromkeys(r["scenario"] for r in res["rows"]))
            strat = list(dict.fromkeys(r["strategy"] for r in res["rows"]))
            cell = {(r["scenario"], r["strategy"]): r for r in res["rows"]}
            rows = [[f"speeds {s}"] + [_eff(cell.get((s, st))) for st in strat] for s in scen]
            parts += [markdown_table(["scenario", *strat], rows), "",
                      "Cells: efficiency (steady step ms; steps until the split in force is within 5% of the "
                      "oracle's, for good).", ""]
        elif name == "reaction":
            parts += ["## Reaction (steps until within 10% of the moving oracle; excess time paid)", ""]
            parts += [markdown_table(
                ["event", "strategy", "steps to 10% (split)", "steps to 10% (measured)", "excess ms",
                 "excess ms/step"],
                [[r["event"], r["strategy"], r["steps_to_within_10pct"], r.get("steps_to_within_10pct_measured"),
                  r["excess_ms"], r["excess_ms_per_step"]]
                 for r in res["rows"]]), ""]
        elif name == "capacity":
            parts += ["## Backend capacity (simulated hooks at 10 steps/s per rank)", ""]
            parts += [markdown_table(
                ["ranks", "msg/s", "rank-steps/s", "lost", "backend CPU %", "generator CPU %",
                 "dashboard frames/s", "dashboard p50 ms", "dashboard p99 ms"],
                [[r["ranks"], r["sent_messages_per_s"], r["sent_rank_steps_per_s"], r["records_lost"],
                  r["backend_cpu_pct"], r["generator_cpu_pct"],
                  round(r["dashboard_frames"] / max(r["seconds"], 1e-9), 1),
                  r["latency_p50_ms"], r["latency_p99_ms"]]
                 for r in res["results"]]), ""]
        elif name == "hook_overhead" and "overhead_ratio_median" in res:
            parts += ["## Hook overhead (one rank, gloo, 20 ms steps; targets <= 1 % and <= 50 us)", ""]
            parts += [markdown_table(
                ["baseline step ms", "hooked step ms", "overhead (median)", "overhead (mean)",
                 "training-thread time added per step"],
                [[res["baseline_step_ms"]["median"], res["hooked_step_ms"]["median"],
                  f"{res['overhead_ratio_median'] * 100:+.2f} %", f"{res['overhead_ratio_mean'] * 100:+.2f} %",
                  f"{res['training_thread_added_us_per_step']:.1f} us"]]), ""]
        elif name == "policy" and "solve" in res:
            parts += ["## Policy solve time (exact integer split; target < 20 ms at 10,000 ranks)", ""]
            parts += [markdown_table(
                ["ranks", "constraints", "wall median ms", "CPU median ms"],
                [[r["ranks"], "yes" if r["constrained"] else "no", r["median_ms"], r["cpu_median_ms"]]
                 for r in res["solve"]]), ""]
            sim = res.get("simulator", {}).get("rows", [])
            if sim:
                parts += ["Simulator, mean step time / oracle over the whole run:", ""]
                scen = list(dict.fromkeys(r["scenario"] for r in sim))
                strat = list(dict.fromkeys(r["strategy"] for r in sim))
                cell = {(r["scenario"], r["strategy"]): r["ratio"] for r in sim}
                parts += [markdown_table(["scenario", *strat],
                                         [[sc] + [cell.get((sc, st)) for st in strat] for sc in scen]), ""]
        else:
            text = entry["result"].get("stdout", "").strip() if isinstance(entry.get("result"), dict) else ""
            parts += [f"## {name}", "", "```", text[-3000:], "```", ""]
    return "\n".join(parts) + "\n"


DOCS = REPO_ROOT / "docs" / "performance.md"


def update_docs(summary: dict[str, Any], path: Path = DOCS) -> bool:
    """Replace the generated blocks of docs/performance.md with this run's tables.

    The page keeps its prose; only the text between ``<!-- bench:NAME -->`` and
    ``<!-- /bench:NAME -->`` (NAME = headline or tables) is rewritten. Returns False when
    the page has no such block.
    """
    if not path.exists():
        return False
    text = path.read_text()
    md = summary_markdown(summary)
    _, _, rest = md.partition("## Headline\n\n")
    headline, _, tables = rest.partition("\n\n## ")
    m = summary.get("machine", {})
    when = (f"*{'Quick' if summary.get('quick') else 'Full'} run of {summary.get('started', '?')} "
            f"(`python -m bench.run_all{' --quick' if summary.get('quick') else ''}`) on "
            f"{m.get('cpus')} CPU cores, load average {m.get('load_avg_1m')} at start.*")
    blocks = {
        "headline": when + "\n\n" + headline.strip(),
        "tables": "### " + tables.strip().replace("\n## ", "\n### "),
    }
    changed = False
    for name, body in blocks.items():
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        if start in text and end in text:
            before, _, after = text.partition(start)
            _, _, after = after.partition(end)
            text = f"{before}{start}\n{body}\n{end}{after}"
            changed = True
    if changed:
        path.write_text(text)
    return changed


def _ok(summary: dict[str, Any], name: str) -> dict[str, Any] | None:
    entry = summary["benchmarks"].get(name)
    return entry["result"] if entry and entry.get("ok") else None


def _span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)} to {fmt.format(hi)}"


def headline_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """The few numbers a reader wants first, each with its target."""
    rows: list[list[Any]] = []
    bal = _ok(summary, "balance")
    if bal:
        by = {(r["scenario"], r["strategy"]): r for r in bal["rows"]}
        hetero = [sc for sc in dict.fromkeys(r["scenario"] for r in bal["rows"]) if sc != "1,1,1,1"]
        for strat in ("profiled", "predictive", "static"):
            rs = [by[(sc, strat)] for sc in hetero if (sc, strat) in by]
            if not rs:
                continue
            rows.append([f"{strat} efficiency, oracle/achieved ({len(rs)} heterogeneous scenario{'s' if len(rs) > 1 else ''})",
                         _span([r["efficiency"] for r in rs], "{:.2f}"), ">= 0.95"])
            if strat != "static":
                steps = [r["steps_to_within_5pct"] for r in rs]
                rows.append([f"{strat}: steps until within 5% of the oracle",
                             _span([x for x in steps if x is not None], "{:.0f}")
                             + ("" if None not in steps else " (some never)"), "<= 30"])
        for sc in hetero:
            if (sc, "uniform") in by and (sc, "profiled") in by:
                speedup = by[(sc, "uniform")]["steady_ms"] / by[(sc, "profiled")]["steady_ms"]
                rows.append([f"speed-up of profiled over the uniform split, speeds {sc}",
                             f"{speedup:.2f}x", ""])
    rea = _ok(summary, "reaction")
    if rea:
        for r in rea["rows"]:
            if r["strategy"] in ("profiled", "predictive"):
                steps = r["steps_to_within_10pct"]
                rows.append([f"{r['event']} of one rank: {r['strategy']} steps until within 10% of the oracle",
                             "never" if steps is None else steps, ""])
    hook = _ok(summary, "hook_overhead")
    if hook and "overhead_ratio_median" in hook:
        rows.append(["hook overhead on a 20 ms step (median)",
                     f"{hook['overhead_ratio_median'] * 100:+.2f} %", "<= 1 %"])
        rows.append(["training-thread time the hook adds per step",
                     f"{hook['training_thread_added_us_per_step']:.0f} us", "<= 50 us"])
    cap = _ok(summary, "capacity")
    if cap and cap.get("results"):
        r = max(cap["results"], key=lambda x: x["ranks"])
        rows.append([f"backend at {r['ranks']} ranks x 10 steps/s: rank-steps/s sustained, lost",
                     f"{r['sent_rank_steps_per_s']:.0f}/s, {r['records_lost']} lost", f"{r['ranks'] * 10}/s, 0 lost"])
        rows.append([f"dashboard latency at {r['ranks']} ranks, p50 / p99",
                     f"{r['latency_p50_ms']} / {r['latency_p99_ms']} ms", "p99 < 500 ms"])
    pol = _ok(summary, "policy")
    if pol and pol.get("solve"):
        r = next((x for x in pol["solve"] if x["ranks"] == 10000 and not x["constrained"]), None)
        if r:
            rows.append(["policy solve time at 10,000 ranks (CPU, median)", f"{r['cpu_median_ms']:.1f} ms", "< 20 ms"])
    return rows


def _eff(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    steps = r.get("steps_to_within_5pct")
    return f"{r['efficiency']:.2f} ({r['steady_ms']:.0f} ms; {'-' if steps is None else steps})"


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description="Run all Rebalancer benchmarks.")
    ap.add_argument("--quick", action="store_true", help="smaller sizes: under 3 minutes")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--docs", action="store_true",
                    help="also rewrite the generated tables in docs/performance.md")
    args = ap.parse_args(argv)
    names = tuple(args.only.split(",")) if args.only else BENCHMARKS
    bad = [n for n in names if n not in RUNNERS]
    if bad:
        ap.error(f"unknown benchmark(s) {bad}; expected some of {list(BENCHMARKS)}")
    t0 = time.monotonic()
    summary = run_all(names, quick=args.quick, out=args.out)
    if args.docs and update_docs(summary):
        print(f"Updated the tables in {DOCS}.")
    print(f"All benchmarks done in {time.monotonic() - t0:.0f} s.")
    return 0 if all(e["ok"] for e in summary["benchmarks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
