// Communication card of the job view: what bounds the step (a badge with its figures) and,
// per rank, the bus bandwidth and the share of the step spent waiting inside collectives.
// Reads the job resource from the page's one poller (poller.js) and, with each answer,
// GET /api/v1/jobs/{job}/ranks; every figure is the server's (backend/policy/comm.py),
// nothing is recomputed here. Absent counters show "–".
/* global Plotly */
import { CONFIG, FONT } from "./charts.js";
import { byId, fmt, jobResource, pct } from "./common.js";
import { stat } from "./controls.js";

export class CommCard {
  constructor(job, poller) {
    Object.assign(this, { job, poller, last: null },
      byId({ badge: "bound-badge", stats: "comm-stats", detail: "bound-detail", chart: "comm-bars" }));
  }

  start() {
    this.poller.subscribe((jobRes) => this.refresh(jobRes));
  }

  async refresh(jobRes) {
    const ranks = await jobResource(this.job, "ranks");
    if (ranks) this.render(jobRes.bound, ranks.data, jobRes.step_ms);
  }

  render(bound, ranks, stepMs) {
    this.last = { bound, ranks };
    const verdict = bound ? bound.verdict : "unknown";
    this.badge.className = `pill bound ${verdict}`;
    this.badge.textContent = verdict;
    this.detail.textContent = bound ? bound.detail : "";
    this.stats.replaceChildren(
      stat("exposed comm", bound && bound.exposed_comm_ms !== null ? fmt(bound.exposed_comm_ms, 1, " ms") : "–"),
      stat("comm share", bound ? pct(bound.comm_share) : "–", bound && bound.comm_share > 0.5 ? "bad" : ""),
      stat("busbw", bound && bound.busbw_gbps !== null ? fmt(bound.busbw_gbps, 2, " GB/s") : "–"),
      stat("bytes/step", bound && bound.comm_bytes_per_step !== null ? fmt(bound.comm_bytes_per_step / 1e6, 1, " MB") : "–"),
    );
    if (!ranks || !ranks.length) return;
    const x = ranks.map((r) => `r${r.rank}`);
    const step = stepMs || null;
    const waitShare = ranks.map((r) => (r.wait_ms !== null && step ? r.wait_ms / step : null));
    const exposedShare = bound && bound.comm_share !== null ? ranks.map(() => bound.comm_share) : ranks.map(() => null);
    Plotly.react(this.chart, [
      { type: "bar", name: "busbw GB/s", x, y: ranks.map((r) => r.busbw_gbps), marker: { color: "#2f6fde" } },
      { type: "scatter", mode: "markers", name: "wait for peers (share of step)", x, y: waitShare, yaxis: "y2",
        marker: { color: "#c2372b", size: 9 } },
      { type: "scatter", mode: "lines", name: "exposed comm (share of step)", x, y: exposedShare, yaxis: "y2",
        line: { color: "#1d2330", dash: "dot" } },
    ], {
      margin: { l: 48, r: 48, t: 8, b: 36 }, font: FONT, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      uirevision: "keep", legend: { orientation: "h", y: 1.15, x: 0 },
      yaxis: { title: { text: "GB/s" }, rangemode: "tozero" },
      yaxis2: { overlaying: "y", side: "right", range: [0, 1], tickformat: ".0%" },
    }, CONFIG);
  }
}
