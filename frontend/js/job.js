/* global Plotly */
// Job view: wires the live socket to the charts, the tables and the operator controls.
import { Charts } from "./charts.js";
import { CausesCard } from "./causes.js";
import { CommCard } from "./comm.js";
import { PipelineCard } from "./pipeline.js";
import { jobPoller } from "./poller.js";
import {
  STATUS_LABEL, api, bytes, duration, el, forecastFor, fmt, liveSocket, money,
  mountTokenBox, pct, setTotalSteps, totalSteps,
} from "./common.js";
import { Controls, stat } from "./controls.js";

const $ = (id) => document.getElementById(id);
const job = decodeURIComponent(location.pathname.replace(/^\/job\//, "").replace(/\/$/, ""));
const STALE_MS = 5000;

document.title = `Rebalancer · ${job}`;
$("job-name").textContent = job;

const charts = new Charts();
// State the tests (and curious operators in the console) can read.
const state = { frames: 0, lastFrameAt: 0, summary: null, control: {}, ranks: null, savings: null, me: null };
window.rebalancer = { state, charts };
let controls = null;

function renderSummary(s, savings) {
  if (!s) return;
  $("status").className = `pill ${s.status}`;
  $("status").textContent = STATUS_LABEL[s.status] || s.status;
  $("status-detail").textContent = s.status_detail || "";
  const thr = s.step_ms ? (s.global_batch_size * 1000) / s.step_ms : null;
  // Micro-batch placements: shares count fixed-shape micro-batches (docs/streaming.md).
  const micro = s.share_unit === "micro_batch";
  $("stats").replaceChildren(
    // A mesh job's rows are its data-parallel replicas; the mesh says what each holds.
    ...(s.mesh ? [stat("mesh", s.mesh.label)] : []),
    stat(s.mesh ? "replicas" : "ranks", `${s.connected_ranks}/${s.world_size}`),
    stat("global batch", micro ? `${s.global_batch_size} micro-batches` : s.global_batch_size),
    stat("batch", s.batch_index ?? "–"),
    stat("step", fmt(s.step_ms, 1, " ms")),
    stat("steps/s", fmt(s.step_rate_hz, 2)),
    stat(micro ? "micro-batches/s" : "samples/s", fmt(thr, 0)),
    stat("imbalance", pct(s.imbalance), s.imbalance > 0.1 ? "bad" : "good"),
    stat("idle", pct(s.idle_fraction)),
    stat("placement", s.placement_version === null || s.placement_version === undefined ? "–" : `v${s.placement_version}`),
    stat("cost/h", money(s.cost_per_hour)),
    // With several backend replicas: the one that controls this job (docs/scale-out.md).
    ...(s.owner ? [stat("controlled by", s.owner.url ? `${s.owner.replica_id} (${s.owner.url})` : s.owner.replica_id)] : []),
  );
  renderReplicas(s.replicas);
  renderForecast(s, savings);
}

// A mesh job: its replicas, their members (and devices) and which one sets the replica's pace.
function renderReplicas(replicas) {
  const table = $("replica-table");
  table.hidden = !replicas;
  if (!replicas) return;
  table.querySelector("tbody").replaceChildren(...replicas.map((p) => el("tr", { "data-replica": p.replica },
    el("td", {}, `replica ${p.replica}`, p.connected ? "" : " (disconnected)"),
    el("td", {}, p.members.map((m) => `r${m}`).join(", ")),
    el("td", { class: "num" }, fmt(p.compute_ms, 1, " ms")),
    el("td", { class: "num" }, fmt(p.step_ms, 1, " ms")),
    el("td", {}, p.slowest_rank === null || p.slowest_rank === undefined ? "–" : `r${p.slowest_rank}`),
    el("td", {}, (p.member_devices || []).length
      ? p.members.map((m, i) => `r${m}: ${p.member_devices[i] ?? "?"}`).join("; ") : "–"),
  )));
}

// What a sample costs in the split (the controller's cost_model), in one line.
function costModelText(m) {
  if (!m) return "";
  const fit = m.r2 === null || m.r2 === undefined ? "" : `, R² ${fmt(m.r2, 3)}`;
  const lin = m.model === "fitted a*L+b*L^2" && m.r2_linear !== null && m.r2_linear !== undefined
    ? ` (length alone: ${fmt(m.r2_linear, 3)})` : "";
  return `Cost model: ${m.model}${fit}${lin}. ${m.detail || ""}`;
}

function renderForecast(s, savings) {
  const total = totalSteps(job) || s.total_steps;
  $("total-steps").placeholder = s.total_steps ? String(s.total_steps) : "";
  // The server's figures (backend/live/forecast.py); nothing is recomputed here.
  const f = forecastFor(job, s, () => { if (state.summary) renderForecast(state.summary, state.savings); });
  $("forecast").replaceChildren(
    stat("ETA", total ? duration(f ? f.eta_s : null) : "set total steps"),
    stat("cost/h", money(s.cost_per_hour)),
    stat("cost to finish", money(f ? f.cost_to_finish : null)),
  );
  if (!savings) return;
  $("savings").replaceChildren(
    stat("time saved", duration(savings.saved_s), savings.saved_s > 0 ? "good" : ""),
    stat("faster than uniform", pct(savings.faster), savings.faster > 0 ? "good" : ""),
    stat("cost saved", money(savings.saved_cost)),
  );
  $("savings-note").textContent = savingsNote(s, savings);
}

// A saving is never shown negative, nor as 0, without saying what it means.
function savingsNote(s, savings) {
  if (s.placement_version === 0 || (savings.uniform_s > 0 && savings.saved_s === 0)) {
    return "No change in split: the job still trains under the uniform split, so nothing is saved or lost.";
  }
  if (savings.saved_s < 0) {
    return "Negative: the steps under the rebalanced split took longer than the uniform split is predicted "
      + "to take (predicted from each rank's measured per-sample cost); see the measured gain of each "
      + "placement below, and roll back if it made things worse.";
  }
  return "";
}

// Peak memory: newest peak, the fit m0 + m*b and the memory cap in samples (what the
// policy will not go above); "–" for a rank that measures no memory (CPU).
function memoryCell(r, i) {
  const peak = (r.mem_peak_bytes || [])[i];
  const m0 = (r.mem_fixed_bytes || [])[i];
  const per = (r.mem_per_sample_bytes || [])[i];
  const cap = (r.mem_cap || [])[i];
  const source = (r.memory_source || [])[i];
  if (peak === null || peak === undefined) {
    return el("td", { class: "num mem-fit", title: source ? "waiting for the first readings: may only lose work" : "no memory source" }, source ? "measuring" : "–");
  }
  const fit = m0 === null || m0 === undefined ? "no fit yet" : `${bytes(m0)} + ${bytes(per)}/sample (${r.mem_fit[i]})`;
  return el("td", { class: "num mem-fit", title: fit },
    `${bytes(peak)}${cap === null || cap === undefined ? "" : ` · cap ${cap}`}`);
}

function renderDevices(r, shares) {
  if (!r || !r.rank) return;
  const worst = Math.max(...r.compute_ms.map((v) => v ?? 0));
  const body = $("device-table").querySelector("tbody");
  body.replaceChildren(...r.rank.map((rank, i) => {
    const mem = r.mem_used_bytes[i] !== null && r.mem_used_bytes[i] !== undefined
      ? `${bytes(r.mem_used_bytes[i])} / ${bytes(r.mem_total_bytes[i])}`
      : r.rss_bytes[i] ? `rss ${bytes(r.rss_bytes[i])}` : "–";
    const util = r.util_pct[i] ?? r.cpu_pct[i];
    const clock = r.sm_clock_mhz[i] === null ? "–" : `${fmt(r.sm_clock_mhz[i], 0)}${r.sm_clock_max_mhz[i] ? ` / ${fmt(r.sm_clock_max_mhz[i], 0)}` : ""} MHz`;
    const slow = r.compute_ms[i] === worst && worst > 0 && r.rank.length > 1;
    return el("tr", { class: slow ? "straggler" : "", "data-rank": rank },
      el("td", {}, `r${rank}`, r.connected[i] ? "" : " (disconnected)"),
      el("td", {}, r.host[i] || ""),
      el("td", { title: r.device_name[i] || "" }, r.device_type[i] || ""),
      el("td", { class: "num", title: state.summary && state.summary.share_unit === "micro_batch" ? "micro-batches per step" : "samples per step" },
        shares[i] ?? r.share[i] ?? "–"),
      el("td", { class: "num" }, r.work_per_s ? fmt(r.work_per_s[i], 0) : "–"),
      el("td", { class: "num" }, r.work_share ? pct(r.work_share[i]) : "–"),
      el("td", { class: "num" }, fmt(r.compute_ms[i], 1, " ms")),
      el("td", { class: "num" }, fmt(r.sync_wait_ms[i], 1, " ms")),
      el("td", { class: "num" }, fmt(r.data_wait_ms[i], 1, " ms")),
      el("td", { class: "num" }, fmt(util, 0, r.util_pct[i] === null ? " % cpu" : " %")),
      el("td", { class: "num" }, mem),
      memoryCell(r, i),
      el("td", { class: "num" }, fmt(r.power_w[i], 0, " W")),
      el("td", { class: "num" }, fmt(r.temp_c[i], 0, " °C")),
      el("td", { class: "num" }, clock),
      el("td", {}, (r.throttle_reasons[i] || []).join(", ")),
      el("td", { class: "num" }, money(r.price_per_hour[i])),
    );
  }));
}

// Frames arrive at up to 10 Hz; drawing is slower than parsing (software rendering, 512
// ranks), so frames are merged and drawn at most every DRAW_MS on an animation frame.
const DRAW_MS = 250;
let pending = null;
let lastDraw = 0;
let drawQueued = false;
let lastHeavy = 0;
let ranksDirty = false;

function merge(into, f) {
  if (!into || f.full) return { ...f, series: { ...f.series }, heat: [...(f.heat || [])], markers: [...(f.markers || [])] };
  for (const k of Object.keys(f.series)) into.series[k] = (into.series[k] || []).concat(f.series[k]);
  into.heat.push(...(f.heat || []));
  into.markers.push(...(f.markers || []));
  for (const k of ["summary", "savings", "t"]) into[k] = f[k];
  // Big jobs get the per-rank columns about once a second, and the control state comes
  // only when it changed: a frame without them keeps the last ones.
  if (f.ranks) into.ranks = f.ranks;
  if ("control" in f) into.control = f.control;
  return into;
}

function onFrame(f) {
  if (f.type !== "job") return;
  state.frames += 1;
  state.lastFrameAt = Date.now();
  setConn("open", "");
  if (!f.summary) {
    $("status-detail").textContent = `No data for job ${job} yet: waiting for its ranks to connect.`;
    return;
  }
  pending = merge(pending, f);
  if (!drawQueued) {
    drawQueued = true;
    setTimeout(() => requestAnimationFrame(draw), Math.max(0, DRAW_MS - (Date.now() - lastDraw)));
  }
}

function draw() {
  drawQueued = false;
  lastDraw = Date.now();
  const f = pending;
  pending = null;
  if (!f) return;
  state.summary = f.summary;
  if ("control" in f) {
    state.control = f.control || {};
    $("cost-model").textContent = costModelText(state.control.cost_model);
  }
  if (f.ranks) {
    state.ranks = f.ranks;
    ranksDirty = true;
  }
  state.savings = f.savings;
  state.draws = (state.draws || 0) + 1;
  renderSummary(f.summary, f.savings);
  charts.addHeat(f.heat || [], f.full);
  charts.updateSeries(f.series, f.markers || [], f.full);
  // Per-rank panels cost ~0.25 ms per rank to redraw: refresh them less often on big jobs.
  const ranks = state.ranks;
  const nRanks = ranks && ranks.rank ? ranks.rank.length : 0;
  const heavyEvery = nRanks > 128 ? 1000 : 0;
  if (ranks && (f.full || (ranksDirty && Date.now() - lastHeavy >= heavyEvery))) {
    lastHeavy = Date.now();
    ranksDirty = false;
    charts.updateRanks(ranks);
    renderDevices(ranks, (state.control.placement && state.control.placement.shares) || []);
  }
  if (ranks) {
    charts.updatePlacement(state.control, ranks);
    if (controls) controls.update(state.control, ranks);
  }
  // A run that ended (every rank said goodbye) is not stale: it says so, once.
  const ended = f.summary.status === "ended";
  $("ended-banner").hidden = !ended;
  if (ended) {
    $("ended-banner").textContent = `The run ended at batch ${f.summary.batch_index ?? "–"}: every rank said `
      + `goodbye ${new Date(f.summary.last_seen * 1000).toLocaleTimeString()}. Its figures are final.`;
  }
  const stale = !ended && f.summary.age_s !== null && f.summary.age_s * 1000 > STALE_MS;
  showStale(stale, stale ? `Data is stale: the job sent nothing for ${duration(f.summary.age_s)}.` : "");
}

function ended() {
  return Boolean(state.summary && state.summary.status === "ended");
}

function showStale(on, text) {
  $("stale-banner").hidden = !on;
  if (on) $("stale-banner").textContent = text;
}

function setConn(s, detail) {
  const c = $("conn");
  c.className = `conn ${s}`;
  c.textContent = s === "open" ? "live" : s === "closed" ? `reconnecting${detail ? `: ${detail}` : ""}` : "connecting";
}

// Zero-code monitoring (`rebalancer run`, trainer_hook/zero_code.py): the ranks say so in
// their hook_version ("... observe-only (rebalancer run): <framework>"); the notice under
// the header gives the one line that enables rebalancing in that framework and the gain
// the policy predicts for it (its pending proposal: shown, never sent, in observe mode).
const ZERO_CODE = "observe-only (rebalancer run)";
const ENABLE_LINE = {
  ddp: (b) => `hook = RebalanceHook(global_batch_size=${b}); hook.attach(ddp_model); loader = hook.data_loader(dataset)`
    + " (and `with hook.step():` around each step)",
  accelerate: (b) => `model, optimizer, loader = prepare_with_rebalancer(accelerator, RebalanceHook(global_batch_size=${b}), model, optimizer, dataset)`,
  hf_trainer: (b) => `trainer = RebalancingTrainer(rebalance_hook=RebalanceHook(global_batch_size=${b}), model=model, args=args, train_dataset=ds)`,
  lightning: (b) => `rebalance = RebalanceLightningCallback(RebalanceHook(global_batch_size=${b}))`
    + " (pass callbacks=[rebalance] and return rebalance.train_dataloader(dataset) from train_dataloader)",
};
// A loader over an IterableDataset: every line above would refuse it (no global order to split).
const STREAMING_NEEDS = "a map-style dataset (__len__ and __getitem__) in place of the stream: every "
  + "adapter splits one global order of the samples, which an IterableDataset does not have; then "
  + "hook.data_loader(dataset) as for DDP (docs/integrations.md)";
state.zeroCode = null; // the framework, once a rank reported it

async function checkZeroCode() {
  try {
    const ranks = await api(`/jobs/${encodeURIComponent(job)}/ranks`);
    const tagged = ranks.data.map((r) => r.hook_version || "").find((v) => v.includes(ZERO_CODE));
    if (tagged) state.zeroCode = tagged.split(`${ZERO_CODE}:`)[1]?.trim() || "ddp";
  } catch { /* not there yet, or the server restarts: next round */ }
  renderZeroCode();
}

function renderZeroCode() {
  const box = $("zero-code-notice");
  // Shown once the job's summary gave its global batch size: the line is meant to be pasted.
  if (!state.zeroCode || !state.summary) { box.hidden = true; return; }
  const b = state.summary.global_batch_size;
  const streaming = state.zeroCode === "streaming";
  const line = streaming ? STREAMING_NEEDS : (ENABLE_LINE[state.zeroCode] || ENABLE_LINE.ddp)(b);
  const p = state.control && state.control.pending_proposal;
  const gain = p && p.predicted_gain !== null && p.predicted_gain !== undefined
    ? `the policy predicts ${pct(p.predicted_gain)} shorter steps with it (proposal ${p.id}, observe mode).`
    : "the policy predicts no gain above its threshold yet (observe mode).";
  box.replaceChildren(
    `Monitored by rebalancer run without code change: observe only. `
      + (streaming ? "This job streams its data; rebalancing needs " : "One line enables rebalancing: "),
    el("code", { id: "zero-code-line" }, line), "; ", el("span", { id: "zero-code-gain" }, gain));
  box.hidden = false;
}
checkZeroCode();
setInterval(() => { if (state.zeroCode) renderZeroCode(); else checkZeroCode(); }, 3000);

setInterval(() => {
  // An ended run sends no more frames: silence is expected, not stale.
  if (state.lastFrameAt && Date.now() - state.lastFrameAt > STALE_MS && !ended()) {
    showStale(true, `Data is stale: no update from the server for ${duration((Date.now() - state.lastFrameAt) / 1000)}; reconnecting.`);
  }
}, 1000);

$("heat-metric").addEventListener("change", (e) => charts.setHeatMetric(e.target.value));
$("total-steps").value = totalSteps(job) || "";
$("total-steps").addEventListener("change", (e) => {
  const n = Math.floor(Number(e.target.value));
  setTotalSteps(job, n > 0 ? n : null);
  if (state.summary) renderForecast(state.summary, state.savings);
});

mountTokenBox($("token-box")).then((me) => {
  state.me = me;
  controls = new Controls(job, me);
  window.rebalancer.controls = controls;
  if (state.ranks) controls.update(state.control, state.ranks);
  document.body.dataset.role = me && me.role ? me.role : "none";
  document.body.classList.toggle("no-controls", !controls.operator);
  // The placement card may have changed width; plotly only follows window resizes by itself.
  if (charts.placement.data) Plotly.Plots.resize(charts.placement);
});
liveSocket(job, onFrame, setConn);
const poller = jobPoller(job); // one GET /jobs/{job} stream for the cards below and report.js
window.rebalancer.poller = poller;
const comm = new CommCard(job, poller);
window.rebalancer.comm = comm;
comm.start();
const causes = new CausesCard(job, poller);
window.rebalancer.causes = causes;
causes.start();
const pipeline = new PipelineCard(job, poller);
window.rebalancer.pipeline = pipeline;
pipeline.start();
