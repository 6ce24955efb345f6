// The run report on the job page: once no rank of the job is connected, the backend's
// end-of-run report (GET /api/v1/jobs/{job}/report) shows in its own card: key figures,
// the cost-aware advice, and the full report (the same self-contained HTML page
// `rebalancer report NAME --out` writes) in a frame, with a download link.
import { api, getToken, duration, fmt, money } from "./common.js";
import { stat } from "./controls.js";
import { jobPoller } from "./poller.js";

const $ = (id) => document.getElementById(id);
const job = decodeURIComponent(location.pathname.replace(/^\/job\//, "").replace(/\/$/, ""));
const state = { report: null, shown: false };
window.rebalancerReport = state;

async function reportHtml() {
  const headers = { Accept: "text/html" };
  const token = getToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  const res = await fetch(`/api/v1/jobs/${encodeURIComponent(job)}/report?format=html`, { headers });
  if (!res.ok) throw new Error(`HTTP ${res.status}`);
  return res.text();
}

async function show(r) {
  const card = $("report-card");
  const sv = r.savings || {};
  $("report-stats").replaceChildren(
    stat("duration", duration(r.duration_s)), stat("steps", String(r.steps)),
    stat("samples/s", fmt(r.samples_per_s, 1)), stat("cost in total", money((r.cost || {}).total)),
    stat("saved vs uniform", sv.saved_s == null ? "–" : `${fmt(sv.saved_s, 1)} s`),
    stat("money saved", money(sv.saved_cost)));
  const advice = (r.advice && r.advice.summary) || ["Not enough steps stored to fit the policy's model."];
  $("report-advice").replaceChildren(...advice.map((a) => {
    const li = document.createElement("li");
    li.textContent = a;
    return li;
  }));
  card.hidden = false;
  const page = await reportHtml();
  $("report-frame").srcdoc = page;
  const link = $("report-download");
  link.href = URL.createObjectURL(new Blob([page], { type: "text/html" }));
  link.download = `rebalancer-report-${job}.html`;
  state.shown = true;
}

// The job resource comes from the page's one poller (poller.js); the report is asked for
// only once no rank is connected, and a finished run's report does not change.
let asking = false;
async function onJob(j) {
  if (state.shown || asking || j.connected_ranks !== 0) return;
  asking = true;
  try {
    const r = await api(`/jobs/${encodeURIComponent(job)}/report`);
    if (r.finished) {
      state.report = r;
      await show(r);
    }
  } catch (e) {
    // the backend may restart: the next answer tries again
  } finally {
    asking = false;
  }
}

jobPoller(job).subscribe(onJob);
