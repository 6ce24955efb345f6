"""``rebalancer watch``: the dashboard feed of one job as a text view (or JSON lines),
folded frame by frame, reconnecting after a lost connection."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from backend.client._format import duration, num, table
from backend.client.rest import Client, ServerUnreachable

__all__ = ["merge_frame", "rank_rows", "render_watch", "watch"]


def merge_frame(state: dict[str, Any], frame: dict[str, Any]) -> None:
    """Fold a dashboard frame into ``state`` (a frame without ``ranks`` keeps the last ones)."""
    if frame.get("type") != "job":
        return
    for key in ("summary", "control", "ranks", "savings"):
        if key in frame and frame[key] is not None:
            state[key] = frame[key]
    pos = frame.get("positions")
    ranks = state.get("ranks")
    if pos and ranks and ranks.get("rank") == pos.get("rank"):
        ranks["batch_index"] = pos["batch_index"]


def rank_rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    n = len(cols.get("rank", []))
    return [{k: v[i] for k, v in cols.items() if i < len(v)} for i in range(n)]


def render_watch(state: dict[str, Any], width: int = 20) -> str:
    """The watch view of a merged dashboard state, as plain text."""
    s = state.get("summary")
    if not s:
        return "waiting for the job's first metrics..."
    head = (f"{s['job']}  {s.get('status', '-')}  mode {s.get('mode') or '-'}  "
            f"batch {num(s.get('batch_index'), '{}')}  step {num(s.get('step_ms'))} ms  "
            f"{num(s.get('step_rate_hz'), '{:.2f}')} steps/s  imbalance {num(s.get('imbalance'), '{:.0%}')}  "
            f"placement v{num(s.get('placement_version'), '{}')}  ETA {duration(s.get('eta_s'))}  "
            f"{num(s.get('cost_per_hour'), '${:.2f}')}/h")
    lines = [head]
    if s.get("status_detail"):
        lines.append(s["status_detail"])
    pending = (state.get("control") or {}).get("pending_proposal")
    if pending:
        lines.append(f"pending proposal {pending.get('id')}: {pending.get('shares')} "
                     f"(predicted gain {num(pending.get('predicted_gain'), '{:+.1%}')}) -> "
                     f"rebalancer approve {s['job']} {pending.get('id')}")
    rows = rank_rows(state.get("ranks") or {})
    biggest = max([r.get("share") or 0 for r in rows] + [1])
    body = []
    for r in rows:
        share = r.get("share")
        bar = "#" * round((share or 0) / biggest * width)
        mem = (f"{r['mem_used_bytes'] / 2**30:.1f}/{r['mem_total_bytes'] / 2**30:.0f}G"
               if r.get("mem_used_bytes") is not None and r.get("mem_total_bytes") else "-")
        util = r.get("util_pct") if r.get("util_pct") is not None else r.get("cpu_pct")
        body.append([r.get("rank"), ("" if r.get("connected", True) else "x ") + str(r.get("host") or "-"),
                     r.get("device_type") or "-", num(share, "{}"), bar.ljust(width),
                     num(r.get("compute_ms")), num(r.get("sync_wait_ms")), num(r.get("data_wait_ms")),
                     num(util, "{:.0f}%"), mem])
    lines.append("")
    lines.append(table(["RANK", "HOST", "DEVICE", "SHARE", "", "COMPUTE ms", "SYNC ms", "DATA ms", "UTIL", "MEM"],
                       body))
    return "\n".join(lines)


def watch(client: Client, job: str, *, count: int, as_json: bool, out: TextIO) -> None:
    """``rebalancer watch``: print each update of the job's feed (text, or one JSON line with
    ``as_json``) until ``count`` updates (0: no end), reconnecting with backoff after a loss."""
    state: dict[str, Any] = {}
    shown, delay, ever = 0, 0.5, False
    tty = out.isatty() and not as_json
    while True:
        try:
            for frame in client.watch(job):
                ever = True
                delay = 0.5
                merge_frame(state, frame)
                if as_json:
                    out.write(json.dumps({"summary": state.get("summary"), "savings": state.get("savings"),
                                          "ranks": rank_rows(state.get("ranks") or {})}) + "\n")
                else:
                    out.write(("\x1b[H\x1b[2J" if tty else "") + render_watch(state) + "\n" + ("" if tty else "\n"))
                out.flush()
                shown += 1
                if count and shown >= count:
                    return
        except ServerUnreachable:
            if not ever:
                raise
        print(f"rebalancer watch: connection to {client.server} lost; reconnecting in {delay:g}s.",
              file=sys.stderr)
        time.sleep(delay)
        delay = min(delay * 2, 8.0)
