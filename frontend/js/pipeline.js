// Pipeline card of the job view (a PP x DP job, docs/pipelines.md): the grid of stages x
// pipelines with each cell's time per micro-batch, the bottleneck stage, the bubble share,
// the slowest pipeline, the placement in force's predicted step beside the measured one (a
// miss beyond the tolerance flagged) and the stage-split advice, as GET /api/v1/jobs/{job}/pipeline gives
// them (backend/policy/pipeline_advice.py). Every figure is the server's. The card stays
// hidden for a job without pipelines: the job view's `pipeline` is null, and the grid is
// not asked for (its 404 would be a console error on every poll). The job resource comes
// from the page's one poller (poller.js).
/* global Plotly */
import { CONFIG, FONT } from "./charts.js";
import { byId, el, fmt, jobResource, pct } from "./common.js";
import { stat } from "./controls.js";

export class PipelineCard {
  constructor(job, poller) {
    Object.assign(this, { job, poller, last: null }, byId({
      card: "pipeline-card", label: "pipeline-label", stats: "pipeline-stats", grid: "pipeline-grid",
      advice: "pipeline-advice", prediction: "pipeline-prediction",
    }));
  }

  start() {
    this.poller.subscribe((job) => this.refresh(job));
  }

  async refresh(job) {
    if (!job.pipeline) { this.card.hidden = true; return; }
    const p = await jobResource(this.job, "pipeline");
    if (p) this.render(p);
  }

  render(p) {
    this.last = p;
    this.card.hidden = false;
    this.label.textContent = `${p.label}, ${p.pipelines} pipelines`;
    // Interleaved: a column is a pipeline rank, holding model stages s, s + pp, ... (loop order).
    const v = p.stages_per_rank || 1;
    const col = (s) => (v > 1 ? `rank ${s} (stages ${Array.from({ length: v }, (_, i) => s + i * p.pp_size).join(", ")})`
      : `stage ${s}`);
    const neck = p.bottleneck_stage === null ? "differs" : col(p.bottleneck_stage);
    this.stats.replaceChildren(
      stat("bottleneck", neck, p.bottleneck_stage === null ? "" : "bad"),
      stat("slowest pipeline", p.slowest_pipeline === null ? "–" : `pipeline ${p.slowest_pipeline}`),
      stat("bubble", pct(p.bubble_share), p.bubble_share > 0.3 ? "bad" : ""),
      stat("micro-batches ≥", String(p.min_microbatches)),
    );
    const stages = Math.max(0, ...p.rows.map((r) => r.stages.length));
    const x = Array.from({ length: stages }, (_, s) => col(s));
    const y = p.rows.map((r) => `pipeline ${r.pipeline} (${r.n_microbatches ?? "–"} mb)`);
    const z = p.rows.map((r) => x.map((_, s) => (r.stages[s] ? r.stages[s].stage_ms : null)));
    const text = z.map((row) => row.map((v) => (v === null ? "" : `${fmt(v, 2)} ms`)));
    Plotly.react(this.grid, [{
      type: "heatmap", x, y, z, text, texttemplate: "%{text}", hovertemplate: "%{y}, %{x}: %{text}<extra></extra>",
      colorscale: "YlOrRd", colorbar: { title: { text: "ms / micro-batch" } },
    }], {
      margin: { l: 140, r: 20, t: 8, b: 36 }, font: FONT, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      uirevision: "keep", yaxis: { autorange: "reversed" },
    }, CONFIG);
    this.renderPrediction(p.prediction);
    const a = p.advice;
    if (!a) {
      this.advice.replaceChildren(el("p", { class: "hint" }, p.advice_note || ""));
      return;
    }
    const names = a.module_names_per_stage.map((g, i) => el("li", {}, `stage ${i}: ${g.join(", ")}`));
    this.advice.replaceChildren(
      el("p", { class: "notice" },
        `Stage-split advice: layers [${a.current_layers_per_stage.join(", ")}] → ` +
        `[${a.layers_per_stage.join(", ")}] per stage; predicted step ${fmt(a.step_ms_after, 1)} ms ` +
        `instead of ${fmt(a.step_ms_before, 1)} ms (${pct(a.gain)} faster). Apply it by restarting ` +
        "from a checkpoint with the new split."),
      names.length ? el("ul", { class: "stage-modules" }, names) : null,
    );
  }

  // The stage model's prediction for the placement in force and, once it settled, the
  // measured step: per pipeline its run, for the job its step; a miss is a warning.
  renderPrediction(c) {
    if (!c) { this.prediction.replaceChildren(); return; }
    const runs = c.pipelines.map((r) => `pipeline ${r.pipeline} (${r.n_microbatches} mb): predicted ` +
      `${fmt(r.predicted_ms, 1)} ms` + (r.measured_ms === null ? "" : `, measured ${fmt(r.measured_ms, 1)} ms ` +
      `(${r.error === null ? "–" : `${r.error >= 0 ? "+" : ""}${pct(r.error)}`})`));
    const head = c.measured_step_ms === null
      ? `Placement in force: predicted step ${fmt(c.predicted_step_ms, 1)} ms; ${c.note}.`
      : `Placement in force: predicted step ${fmt(c.predicted_step_ms, 1)} ms, measured ` +
        `${fmt(c.measured_step_ms, 1)} ms (${c.error >= 0 ? "+" : ""}${pct(c.error)}): ${c.note}`;
    this.prediction.replaceChildren(
      el("p", { class: c.missed ? "notice bad" : "hint", id: "pipeline-prediction-head" }, head),
      el("ul", { class: "stage-modules" }, runs.map((t) => el("li", {}, t))),
    );
  }
}
