// Plotly charts of the job view. Full frames redraw with Plotly.react (layout.uirevision keeps
// the user's zoom); deltas append with Plotly.extendTraces inside a sliding window.
/* global Plotly */

export const WINDOW_POINTS = 1500; // per-batch points kept on the time series
const HEAT_COLUMNS = 120; // heatmap columns kept (one per push with new data)
const HEAT_EVERY_MS = 500; // the heatmap is the heaviest redraw: at most twice a second
// The Plotly options every chart of the dashboard shares.
export const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
export const FONT = { family: "system-ui, sans-serif", size: 11, color: "#1d2330" };
const COLORS = { compute: "#2f6fde", straggler: "#c2372b", sync: "#b8c0cc", data: "#e3c27a",
  step: "#1d2330", uniform: "#c2372b", throughput: "#1f8a4c", proposal: "#7a4fd6",
  gc: "#d6457a", host: "#8a6d3b", ckpt: "#5a8f8c", optimizer: "#6b7a99" };
// The heatmap's phases (backend/dashboard/fold.py HEAT_ROW_PHASES, HEAT_VIEW_PHASES) and util.
export const HEAT_METRICS = ["compute", "data_wait", "sync_wait", "optimizer", "step", "host", "ckpt", "gc", "util"];

function hardwareWebGL() {
  try {
    const gl = document.createElement("canvas").getContext("webgl");
    if (!gl) return false;
    const info = gl.getExtension("WEBGL_debug_renderer_info");
    const renderer = info ? String(gl.getParameter(info.UNMASKED_RENDERER_WEBGL)) : "";
    return !/swiftshader|llvmpipe|software/i.test(renderer);
  } catch { return false; }
}
// scattergl draws thousands of points cheaply on a GPU; emulated in software (headless, VMs)
// it is far slower than SVG, so fall back to plain scatter there.
export const LINE = hardwareWebGL() ? "scattergl" : "scatter";

function base(extra) {
  return { margin: { l: 48, r: 16, t: 8, b: 36 }, font: FONT, paper_bgcolor: "#fff",
    plot_bgcolor: "#fff", uirevision: "keep", showlegend: true,
    legend: { orientation: "h", y: 1.12, x: 0 }, ...extra };
}

// About 1.2 px per rank beyond 200 ranks, so that one slow rank in 512 still shows as a line.
function heatHeight(nRanks) {
  return Math.max(300, Math.min(900, Math.round(nRanks * 1.2 + 90)));
}

export class Charts {
  constructor() {
    this.rankBars = document.getElementById("rank-bars");
    this.heatmap = document.getElementById("heatmap");
    this.series = document.getElementById("series");
    this.placement = document.getElementById("placement-bars");
    this.heat = []; // [{b, compute: [...], data_wait: [...], ..., util: [...]}]: HEAT_METRICS
    this.heatMetric = "compute";
    this.heatDirty = false;
    this.lastHeat = 0;
    this.seriesReady = false;
    this.markers = [];
    this.points = 0;
  }

  rankLabels(ranks) {
    return ranks.rank.map((r) => `r${r}`);
  }

  // Each rank's step stacked by phase (docs/causes.md): compute (its GC pauses drawn apart:
  // most fall in it), sync wait, the loader's data wait, the loop's host work, checkpoint
  // writes, optimizer. Compute stays the first trace (the straggler in red).
  updateRanks(ranks) {
    if (!ranks || !ranks.rank || !ranks.rank.length) return;
    const x = this.rankLabels(ranks);
    const col = (name) => (ranks[name] || []).map((v) => v ?? 0);
    const [gc, host, ckpt] = [col("gc_ms"), col("host_ms"), col("ckpt_ms")];
    const computeAll = col("compute_ms");
    const compute = computeAll.map((v, i) => Math.max(0, v - gc[i]));
    const loader = col("data_wait_ms").map((v, i) => Math.max(0, v - host[i] - ckpt[i]));
    const worst = Math.max(...computeAll);
    const colors = computeAll.map((v) => (v === worst && worst > 0 && computeAll.length > 1 ? COLORS.straggler : COLORS.compute));
    const many = x.length > 64;
    const bar = (name, y, color) => ({ type: "bar", name, x, y, marker: { color },
      hovertemplate: `%{x}: ${name} %{y:.1f} ms<extra></extra>` });
    const traces = [
      { ...bar("compute", compute, COLORS.compute), marker: { color: colors } },
      bar("GC pauses", gc, COLORS.gc),
      bar("sync wait", col("sync_wait_ms"), COLORS.sync),
      bar("data wait", loader, COLORS.data),
      bar("host work", host, COLORS.host),
      bar("checkpoint", ckpt, COLORS.ckpt),
      bar("optimizer", col("optimizer_ms"), COLORS.optimizer),
    ].filter((t, i) => i === 0 || t.y.some((v) => v > 0)); // phases no rank has stay out of the legend
    Plotly.react(this.rankBars, traces, base({ barmode: "stack", bargap: many ? 0 : 0.25,
      yaxis: { title: { text: "ms per step" } }, xaxis: { showticklabels: !many, type: "category" } }), CONFIG);
  }

  addHeat(columns, full) {
    if (full) this.heat = [];
    for (const c of columns) this.heat.push(c);
    if (this.heat.length > HEAT_COLUMNS) this.heat.splice(0, this.heat.length - HEAT_COLUMNS);
    this.heatDirty = true;
    this.drawHeat();
  }

  setHeatMetric(m) {
    if (!HEAT_METRICS.includes(m)) return;
    this.heatMetric = m;
    this.heatDirty = true;
    this.drawHeat(true);
  }

  drawHeat(force = false) {
    const now = Date.now();
    if (!this.heatDirty || (!force && now - this.lastHeat < HEAT_EVERY_MS) || !this.heat.length) {
      if (this.heatDirty && !this.heatTimer) {
        this.heatTimer = setTimeout(() => { this.heatTimer = null; this.drawHeat(true); }, HEAT_EVERY_MS);
      }
      return;
    }
    this.lastHeat = now;
    this.heatDirty = false;
    const m = this.heatMetric;
    // Older columns (or a rank that sends no phases) lack a phase: blank cells, not an error.
    const nRanks = Math.max(...this.heat.map((c) => (c.compute || []).length));
    const z = Array.from({ length: nRanks }, (_, r) => this.heat.map((c) => (c[m] || [])[r] ?? null));
    Plotly.react(this.heatmap, [{
      type: "heatmap", z, x: this.heat.map((c) => c.b), y: Array.from({ length: nRanks }, (_, r) => r),
      // Dark means slow (long compute) or busy: the straggler's row stands out on light ground.
      colorscale: m === "util" ? "Viridis" : "YlOrRd", reversescale: m !== "util", zsmooth: false,
      colorbar: { title: { text: m === "util" ? "%" : "ms" }, thickness: 10 },
      hovertemplate: `rank %{y}, batch %{x}: %{z:.1f}${m === "util" ? " %" : " ms"}<extra></extra>`,
    }], base({ showlegend: false, height: heatHeight(nRanks), xaxis: { title: { text: "batch" } },
      yaxis: { title: { text: "rank" }, autorange: "reversed", dtick: nRanks > 32 ? undefined : 1 } }), CONFIG);
  }

  seriesLayout() {
    const shapes = this.markers.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: m.b, x1: m.b,
      y0: 0, y1: 1, line: { color: COLORS.proposal, width: 1.5, dash: "dot" } }));
    const annotations = this.markers.map((m) => ({ x: m.b, y: 1, xref: "x", yref: "paper", text: `v${m.version}`,
      showarrow: false, font: { color: COLORS.proposal, size: 10 }, yanchor: "bottom" }));
    return base({ shapes, annotations, xaxis: { title: { text: "batch" } },
      yaxis: { title: { text: "step ms" }, rangemode: "tozero" },
      yaxis2: { title: { text: "samples/s" }, overlaying: "y", side: "right", rangemode: "tozero", showgrid: false },
      margin: { l: 48, r: 56, t: 18, b: 36 } });
  }

  updateSeries(series, markers, full) {
    const s = series;
    if (full || !this.seriesReady) {
      this.markers = markers.slice();
      const tail = (a) => a.slice(-WINDOW_POINTS);
      Plotly.react(this.series, [
        { type: LINE, mode: "lines", name: "step time", x: tail(s.b), y: tail(s.step_ms), line: { color: COLORS.step, width: 1.5 } },
        { type: LINE, mode: "lines", name: "uniform split (predicted)", x: tail(s.b), y: tail(s.uniform_step_ms),
          line: { color: COLORS.uniform, width: 1.2, dash: "dash" } },
        { type: LINE, mode: "lines", name: "slowest compute", x: tail(s.b), y: tail(s.max_compute_ms),
          line: { color: COLORS.compute, width: 1 } },
        { type: LINE, mode: "lines", name: "throughput", x: tail(s.b), y: tail(s.throughput), yaxis: "y2",
          line: { color: COLORS.throughput, width: 1 } },
      ], this.seriesLayout(), CONFIG);
      this.seriesReady = true;
      this.points = Math.min(s.b.length, WINDOW_POINTS);
      return;
    }
    if (s.b.length) {
      Plotly.extendTraces(this.series, {
        x: [s.b, s.b, s.b, s.b], y: [s.step_ms, s.uniform_step_ms, s.max_compute_ms, s.throughput],
      }, [0, 1, 2, 3], WINDOW_POINTS);
      this.points = Math.min(this.points + s.b.length, WINDOW_POINTS);
    }
    if (markers.length) {
      this.markers.push(...markers);
      const l = this.seriesLayout();
      Plotly.relayout(this.series, { shapes: l.shapes, annotations: l.annotations });
    }
  }

  updatePlacement(control, ranks) {
    const inForce = (control.placement && control.placement.shares) || [];
    const prop = control.pending_proposal;
    const x = inForce.map((_, r) => `r${r}`);
    const traces = [{ type: "bar", name: `in force (v${control.placement ? control.placement.version : "?"})`, x, y: inForce,
      marker: { color: COLORS.compute } }];
    if (prop) {
      traces.push({ type: "bar", name: `proposal ${prop.id}`, x, y: prop.shares, marker: { color: COLORS.proposal } });
    }
    const key = JSON.stringify([inForce, prop && prop.id, prop && prop.shares, ranks && ranks.rank && ranks.rank.length]);
    if (key === this.placementKey) return;
    this.placementKey = key;
    Plotly.react(this.placement, traces, base({ barmode: "group", height: 240,
      yaxis: { title: { text: "samples per step" } }, xaxis: { type: "category", showticklabels: x.length <= 64 } }), CONFIG);
  }
}
