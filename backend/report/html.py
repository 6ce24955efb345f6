"""The end-of-run report as one self-contained HTML file: plotly.js inlined from the
installed ``plotly`` package (the same file the dashboard serves), no outside request, so
it opens offline and can be mailed or attached to a ticket.

``render(report)`` for one run, ``render_compare(a, b)`` for two side by side.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from typing import Any

from backend.assets import plotly_js_path

__all__ = ["render", "render_compare", "inline_code"]

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#1d232a;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde}
.sub{color:#667;margin-bottom:16px}table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #dde;padding:4px 8px;text-align:right}th{background:#f4f6f9}
td.l,th.l{text-align:left}.kpi{display:flex;flex-wrap:wrap;gap:10px}
.kpi div{border:1px solid #dde;border-radius:6px;padding:8px 12px;min-width:140px}
.kpi b{display:block;font-size:18px}.chart{height:340px}.advice li{margin:3px 0}
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _num(x: Any, nd: int = 2, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}{unit}"
    return f"{x}{unit}"


def _money(x: Any) -> str:
    return "-" if x is None else f"${x:,.4f}" if abs(x) < 1 else f"${x:,.2f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _share(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def _when(t: Any) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _script_json(obj: Any) -> str:
    # Inside <script>: no "</" may end the element early.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


def _kpis(r: dict[str, Any]) -> str:
    sv = r.get("savings") or {}
    items = [("duration", _num(r.get("duration_s"), 1, " s")), ("steps", _num(r.get("steps"))),
             ("samples/s", _num(r.get("samples_per_s"), 1)), ("mean step", _num(r.get("mean_step_ms"), 1, " ms")),
             ("cost per hour", _money((r.get("cost") or {}).get("per_hour"))),
             ("cost in total", _money((r.get("cost") or {}).get("total"))),
             ("time saved vs uniform", _num(sv.get("saved_s"), 2, " s")),
             ("money saved vs uniform", _money(sv.get("saved_cost")))]
    return '<div class="kpi">' + "".join(f"<div>{_e(k)}<b>{_e(v)}</b></div>" for k, v in items) + "</div>"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(c)}</td>' for i, c in enumerate(row))
                   + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _charts_one(r: dict[str, Any], prefix: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(div id, title, {data, layout}) for one run."""
    s = r.get("series") or []
    marks = [p["effective_batch_index"] for p in r.get("placements", []) if p.get("effective_batch_index")]
    step = {"data": [
        {"type": "scatter", "mode": "lines", "name": "step", "x": [p["batch_index"] for p in s],
         "y": [p["step_ms"] for p in s]},
        {"type": "scatter", "mode": "lines", "name": "rank 0 compute", "x": [p["batch_index"] for p in s],
         "y": [p["compute_ms"] for p in s]}],
        "layout": {"xaxis": {"title": {"text": "batch index"}}, "yaxis": {"title": {"text": "ms"}},
                   "shapes": [{"type": "line", "xref": "x", "yref": "paper", "x0": b, "x1": b, "y0": 0, "y1": 1,
                               "line": {"dash": "dot", "color": "#888"}} for b in marks]}}
    ranks = r.get("ranks") or []
    names = [f"rank {x['rank']}" for x in ranks]
    split = {"data": [{"type": "bar", "name": label, "x": names, "y": [x[key] for x in ranks]}
                      for label, key in (("compute", "compute_s"), ("sync wait", "sync_wait_s"),
                                         ("data wait", "data_wait_s"), ("optimizer", "optimizer_s"))],
             "layout": {"barmode": "stack", "yaxis": {"title": {"text": "seconds"}}}}
    pl = r.get("placements") or []
    world = r.get("world_size") or 0
    shares = {"data": [{"type": "bar", "name": f"rank {i}", "x": [f"v{p['version']} {p['source']}" for p in pl],
                        "y": [p["shares"][i] if i < len(p["shares"]) else None for p in pl]} for i in range(world)],
              "layout": {"barmode": "stack", "yaxis": {"title": {"text": "samples of the global batch"}}}}
    out = [(f"{prefix}step", "Step time over the run (dotted: a placement took effect)", step),
           (f"{prefix}split", "Where each rank's time went", split),
           (f"{prefix}shares", "Shares per placement version", shares)]
    adv = r.get("advice")
    if adv:
        drops = adv["drop"]
        out.append((f"{prefix}drop", "Dropping one rank (the policy's model)", {"data": [
            {"type": "bar", "name": "throughput it adds", "x": [f"rank {d['rank']}" for d in drops],
             "y": [d["throughput_gain"] for d in drops]},
            {"type": "bar", "name": "share of the cost", "x": [f"rank {d['rank']}" for d in drops],
             "y": [d["cost_share"] for d in drops]}],
            "layout": {"barmode": "group", "yaxis": {"tickformat": ".0%"}}}))
    return out


def _details(r: dict[str, Any]) -> str:
    parts = ["<h2>Ranks</h2>", _table(
        ["rank", "host", "device", "steps", "mean batch", "compute ms/step", "sync wait ms/step",
         "data wait ms/step", "USD/h"],
        [[x["rank"], x["host"], x["device_name"] or x["device_type"], x["steps"], x["mean_local_batch_size"],
          _num(x["compute_ms_per_step"]), _num(x["sync_wait_ms_per_step"]), _num(x["data_wait_ms_per_step"]),
          _num(x["price_per_hour"], 2)] for x in r.get("ranks", [])], left=3)]
    parts += ["<h2>Placements</h2>", _table(
        ["version", "source", "shares", "by", "from batch", "step ms before", "after", "measured gain", "note"],
        [[p["version"], p["source"], ",".join(map(str, p["shares"])), p["actor"],
          _num(p["effective_batch_index"]), _num(p["step_ms_before"]), _num(p["step_ms_after"]),
          _pct(p["measured_gain"]), "rolled back" if p["rolled_back"] else "failed" if p["failed"] else ""]
         for p in r.get("placements", [])], left=4)]
    decisions = ", ".join(f"{k}: {v}" for k, v in (r.get("decisions") or {}).items()) or "none"
    parts += [f"<h2>Proposals</h2><p>Decisions: {_e(decisions)}</p>", _table(
        ["id", "status", "source", "shares", "predicted gain", "decided by", "reason"],
        [[p["id"], p["status"], p["source"], ",".join(map(str, p["shares"] or [])), _pct(p["predicted_gain"]),
          p["decided_by"] or "", p["decision_reason"] or p["reason"] or ""] for p in r.get("proposals", [])],
        left=4)]
    adv = r.get("advice")
    parts.append("<h2>Cost-aware advice</h2>")
    if adv:
        parts.append('<ul class="advice">' + "".join(f"<li>{_e(a)}</li>" for a in adv["summary"]) + "</ul>")
        parts.append(_table(["rank", "step ms without it", "throughput it adds", "share of cost",
                             "cost per sample without it", "advice"],
                            [[d["rank"], _num(d["step_ms_without"]), _pct(d["throughput_gain"]),
                              _pct(d["cost_share"]), _pct(d["cost_per_sample_change"]), d["advice"]]
                             for d in adv["drop"]]))
        parts.append(f"<p class=sub>{_e(adv['model'])}; predicted step {_num(adv['predicted_step_ms'])} ms "
                     f"(of which {_num(adv['overhead_ms'])} ms no split changes).</p>")
    else:
        parts.append("<p>Not enough stored steps per rank to fit the policy's model.</p>")
    comm = r.get("communication")
    parts.append("<h2>Communication</h2>")
    if comm:
        parts.append(f"<p><b>{_e(comm['verdict'])}</b>: {_e(comm['detail'])}</p>")
        parts.append(_table(["rank", "bytes per step", "ms in collectives", "ms waiting for peers", "busbw GB/s"],
                            [[c["rank"], _num(c["comm_bytes_per_step"]), _num(c["comm_ms"]), _num(c["wait_ms"]),
                              _num(c["busbw_gbps"])] for c in comm["ranks"]]))
    else:
        parts.append("<p>Not measured (the backend no longer held the run's last steps).</p>")
    causes = r.get("causes")
    parts.append("<h2>Why the run was slow</h2>")
    if r.get("goodput") is not None:
        parts.append(f"<p>Goodput (useful compute over paid device time, last steps): <b>{_pct(r['goodput'])}</b></p>")
    if causes:
        parts.append(_table(["cause", "ranks", "ms lost per step", "share of step", "GPU-hours lost", "remedy"],
                            [[c["cause"], " ".join(map(str, c["ranks"])), _num(c["ms_per_step"]),
                              _pct(c["share_of_step"]), _num(c["gpu_hours_lost"], 4), c["remedy"]] for c in causes]))
    elif causes == []:
        parts.append("<p>No cause cost more than 0.2% of the step over the run's last steps.</p>")
    else:
        parts.append("<p>Not measured (the backend no longer held the run's last steps).</p>")
    if r.get("pipeline"):
        parts.append(_pipeline(r["pipeline"]))
    parts.append(_predictions(r.get("placements", [])))
    return "".join(parts)


def _predictions(placements: list[dict[str, Any]]) -> str:
    """A pipelined job's placements: the stage model's predicted step beside the measured
    one, per pipeline and for the job (``backend.policy.pipeline_check``); "" without any."""
    rows = [(p, p["prediction"]) for p in placements if p.get("prediction")]
    if not rows:
        return ""

    def runs(c: dict[str, Any], key: str) -> str:
        return " | ".join(_num(x[key]) for x in c["pipelines"])

    return "<h3>Pipeline predictions checked</h3>" + _table(
        ["version", "micro-batches", "predicted run ms", "measured run ms", "predicted step ms",
         "measured step ms", "error", "check"],
        [[p["version"], ",".join(map(str, p["shares"])), runs(c, "predicted_ms"), runs(c, "measured_ms"),
          _num(c["predicted_step_ms"]), _num(c["measured_step_ms"]), _pct(c["error"]),
          ("MISSED: " if c["missed"] else "") + c["note"]] for p, c in rows], left=2)


def _pipeline(p: dict[str, Any]) -> str:
    """A pipelined job's last steps: ms per micro-batch of each stage in each pipeline, what
    bounds them, and the stage-split advice (docs/pipelines.md)."""
    stages = max((len(row["stages"]) for row in p["rows"]), default=0)
    neck = "none (the pipelines disagree)" if p["bottleneck_stage"] is None else f"stage {p['bottleneck_stage']}"
    out = [f"<h2>Pipeline</h2><p>{_e(p['label'])}, {p['pipelines']} pipelines; bottleneck {_e(neck)}; slowest "
           f"pipeline {_e(p['slowest_pipeline'])}; bubble {_share(p['bubble_share'])} of the schedule's run.</p>",
           _table(["pipeline", "micro-batches", *(f"stage {s} ms/micro-batch" for s in range(stages)), "run ms",
                   "bubble"],
                  [[row["pipeline"], _num(row.get("n_microbatches"), 0),
                    *(_num(c["stage_ms"]) for c in row["stages"]), *([""] * (stages - len(row["stages"]))),
                    _num(row.get("compute_ms")), _share(row.get("bubble_share"))] for row in p["rows"]])]
    a = p.get("advice")
    if a:
        names = "".join(f"<li>stage {i}: {_e(', '.join(g))}</li>" for i, g in enumerate(a["module_names_per_stage"]))
        out.append(f"<p class=advice><b>Stage-split advice</b>: layers {_e(a['current_layers_per_stage'])} -> "
                   f"{_e(a['layers_per_stage'])} per stage; predicted step {_num(a['step_ms_after'])} ms instead of "
                   f"{_num(a['step_ms_before'])} ms ({_share(a['gain'])} faster). Apply it by restarting from a "
                   f"checkpoint with the new split.</p>" + (f"<ul>{names}</ul>" if names else ""))
    else:
        out.append(f"<p>{_e(p.get('advice_note') or '')}</p>")
    return "".join(out)


# The report's only inline code besides plotly.js: static, so a Content-Security-Policy can
# allow it by hash (the charts' data travels in a JSON block, which runs nothing).
_RUNNER = (
    "const CHARTS=JSON.parse(document.getElementById('charts').textContent);"
    "for(const [id,spec] of Object.entries(CHARTS)){const el=document.getElementById(id);"
    "if(el){Plotly.newPlot(el,spec.data,Object.assign({margin:{t:10,r:10,b:40,l:60},"
    "legend:{orientation:'h'}},spec.layout),{displaylogo:false,responsive:true});}}")


def _plotly_inline() -> str:
    return plotly_js_path().read_text(encoding="utf-8").replace("</script", "<\\/script")


def inline_code() -> tuple[list[str], list[str]]:
    """The exact inline scripts and styles every report page holds (for a CSP's hashes)."""
    return [_plotly_inline(), _RUNNER], [_CSS]


def _page(title: str, body: str, charts: list[tuple[str, str, dict[str, Any]]]) -> str:
    divs = {cid: spec for cid, _, spec in charts}
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><link rel=icon href=\"data:,\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style>"
        f"<script>{_plotly_inline()}</script></head><body>{body}"
        f"<script type=application/json id=charts>{_script_json(divs)}</script>"
        f"<script>{_RUNNER}</script></body></html>")


def _chart_divs(charts: list[tuple[str, str, dict[str, Any]]]) -> str:
    return "".join(f'<h2>{_e(t)}</h2><div class="chart" id="{_e(cid)}"></div>' for cid, t, _ in charts)


def _head(r: dict[str, Any]) -> str:
    state = "finished" if r.get("finished") else "running"
    return (f"<h1>Run report: {_e(r['job'])}</h1><div class=sub>{_e(r['world_size'])} ranks, global batch "
            f"{_e(r['global_batch_size'])}; {_e(state)} ({_e(r.get('reason'))}); "
            f"{_e(_when(r.get('started_at')))} to {_e(_when(r.get('ended_at')))}</div>")


def render(report: dict[str, Any]) -> str:
    """One run's report as a self-contained HTML page."""
    charts = _charts_one(report, "a-")
    body = _head(report) + _kpis(report) + _chart_divs(charts[:1]) + _chart_divs(charts[1:]) + _details(report)
    return _page(f"Rebalancer report: {report['job']}", body, charts)


def render_compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two runs side by side: key figures, step time and per-rank time."""
    def row(label: str, fa: Any, fb: Any) -> list[Any]:
        return [label, fa, fb]

    sa, sb = a.get("savings") or {}, b.get("savings") or {}
    ca, cb = a.get("cost") or {}, b.get("cost") or {}
    table = _table(["", a["job"], b["job"]], [
        row("ranks", a["world_size"], b["world_size"]),
        row("global batch", a["global_batch_size"], b["global_batch_size"]),
        row("duration s", _num(a.get("duration_s"), 1), _num(b.get("duration_s"), 1)),
        row("steps", a.get("steps"), b.get("steps")),
        row("samples/s", _num(a.get("samples_per_s"), 1), _num(b.get("samples_per_s"), 1)),
        row("mean step ms", _num(a.get("mean_step_ms"), 1), _num(b.get("mean_step_ms"), 1)),
        row("cost per hour", _money(ca.get("per_hour")), _money(cb.get("per_hour"))),
        row("cost in total", _money(ca.get("total")), _money(cb.get("total"))),
        row("time saved vs uniform s", _num(sa.get("saved_s")), _num(sb.get("saved_s"))),
        row("money saved vs uniform", _money(sa.get("saved_cost")), _money(sb.get("saved_cost"))),
        row("placements", len(a.get("placements", [])), len(b.get("placements", []))),
        row("proposals", len(a.get("proposals", [])), len(b.get("proposals", []))),
    ])
    step = {"data": [{"type": "scatter", "mode": "lines", "name": r["job"],
                      "x": [p["batch_index"] for p in r.get("series") or []],
                      "y": [p["step_ms"] for p in r.get("series") or []]} for r in (a, b)],
            "layout": {"xaxis": {"title": {"text": "batch index"}}, "yaxis": {"title": {"text": "step ms"}}}}
    compute = {"data": [{"type": "bar", "name": r["job"], "x": [f"rank {x['rank']}" for x in r.get("ranks", [])],
                         "y": [x["compute_ms_per_step"] for x in r.get("ranks", [])]} for r in (a, b)],
               "layout": {"barmode": "group", "yaxis": {"title": {"text": "compute ms per step"}}}}
    charts = [("cmp-step", "Step time, both runs", step), ("cmp-compute", "Compute per step and rank", compute)]
    body = (f"<h1>Run reports compared: {_e(a['job'])} and {_e(b['job'])}</h1>" + table + _chart_divs(charts)
            + f"<h2>{_e(a['job'])}</h2>" + _kpis(a) + f"<h2>{_e(b['job'])}</h2>" + _kpis(b))
    return _page(f"Rebalancer: {a['job']} vs {b['job']}", body, charts)
