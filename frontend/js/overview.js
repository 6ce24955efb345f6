// Fleet view: every job with its figures and the fleet's totals, from /ws/dashboard overview
// frames (the server's fleet summary, backend/live/fleet.py; the page computes no figure).
// Sorting and filtering happen here, on the rows of the newest frame.
import {
  STATUS_LABEL, duration, el, fmt, forecastFor, liveSocket, money, morphChildren, mountTokenBox, pct,
} from "./common.js";

const body = document.getElementById("jobs-body");
const conn = document.getElementById("conn");
const table = document.getElementById("jobs-table");
const statusFilter = document.getElementById("filter-status");
const textFilter = document.getElementById("filter-text");
const shown = document.getElementById("fleet-shown");
let lastFrame = 0;
let frame = null;
const sort = { key: "job", dir: 1 };  // dir 1: ascending

function devicesText(j) {
  return j.devices.map((d) => `${d.count}× ${d.kind}`).join(", ");
}

function gpuHours(v) {
  if (v === null || v === undefined) return "–";
  return v === 0 ? "0" : v >= 100 ? v.toFixed(0) : Number(v.toPrecision(3)).toString();
}

function signedDuration(s) {
  if (s === null || s === undefined) return "–";
  return (s < 0 ? "−" : "") + duration(Math.abs(s));
}

// With several backend replicas: the one that controls the job (its summary says; docs/scale-out.md).
function ownerTag(summary) {
  const o = summary && summary.owner;
  if (!o) return null;
  return el("span", { class: "owner", "data-owner": o.replica_id, title: `controlled by replica ${o.replica_id}${o.url ? ` at ${o.url}` : ""}` },
    ` @ ${o.replica_id}`);
}

function row(j, summary) {
  const f = forecastFor(j.job, summary || j, () => render());  // the server's ETA (a local total: its /forecast)
  const eta = f ? f.eta_s : null;
  const age = summary ? summary.age_s : null;
  const stale = age !== null && age !== undefined && age > 5 && j.status !== "idle" && j.status !== "ended";
  const jobUrl = `/job/${encodeURIComponent(j.job)}`;
  const saved = j.saved_cost !== null && j.saved_cost !== undefined
    ? `${signedDuration(j.saved_s)} · ${money(j.saved_cost)}` : signedDuration(j.saved_s);
  return el("tr", { "data-job": j.job, "data-status": j.status },
    el("td", {}, el("a", { href: jobUrl, class: "job-link" }, j.job), ownerTag(summary)),
    el("td", {}, el("span", { class: `pill ${j.status}`, title: j.status_detail || "" },
      STATUS_LABEL[j.status] || j.status), stale ? el("span", { class: "pill stale" }, "stale") : null),
    el("td", { class: "devices" }, devicesText(j) || "–"),
    el("td", { class: "num" }, `${j.connected_ranks}/${j.world_size}`),
    el("td", { class: "num" }, fmt(j.step_ms, 1, " ms")),
    el("td", { class: "num", title: j.balanced_step_ms === null ? "the policy has not fitted the job yet"
      : `balanced step ${fmt(j.balanced_step_ms, 1, " ms")}` }, j.efficiency === null ? "n/a" : pct(j.efficiency)),
    el("td", { class: "num" }, gpuHours(j.wasted_gpu_hours)),
    el("td", { class: "num", title: j.saved_s < 0
      ? "negative: the rebalanced steps took longer than the uniform split is predicted to take"
      : j.saved_s === 0 ? "no change in split" : "" }, saved),
    el("td", {}, j.bound || "n/a"),
    el("td", { class: "num" }, j.pending_proposals
      ? el("a", { href: `${jobUrl}#placement-card`, class: "pending-link", title: "approve or reject on the job page" },
        `${j.pending_proposals} · approve`)
      : "0"),
    el("td", { class: "num" }, pct(j.imbalance)),
    el("td", {}, j.mode || "–"),
    el("td", { class: "num" }, eta === null || eta === undefined ? "–" : duration(eta)),
    el("td", { class: "num" }, money(j.cost_per_hour)),
    el("td", { class: "num", title: "useful compute over paid device time (docs/causes.md)" },
      j.goodput === null || j.goodput === undefined ? "n/a" : pct(j.goodput)),
  );
}

function sortValue(j, key) {
  if (key === "devices") return devicesText(j);
  return j[key];
}

function compare(a, b) {
  const va = sortValue(a, sort.key);
  const vb = sortValue(b, sort.key);
  const na = va === null || va === undefined;
  const nb = vb === null || vb === undefined;
  if (na || nb) return na === nb ? a.job.localeCompare(b.job) : na ? 1 : -1;  // n/a last either way
  const c = typeof va === "number" && typeof vb === "number" ? va - vb : String(va).localeCompare(String(vb));
  return c !== 0 ? sort.dir * c : a.job.localeCompare(b.job);
}

function matches(j) {
  const s = statusFilter.value;
  if (s === "running" ? j.status === "idle" || j.status === "ended" : s && j.status !== s) return false;
  const q = textFilter.value.trim().toLowerCase();
  return !q || j.job.toLowerCase().includes(q) || devicesText(j).toLowerCase().includes(q);
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function renderTotals(t) {
  setText("total-jobs", t.jobs);
  setText("total-ranks", t.connected_ranks === t.ranks ? t.ranks : `${t.connected_ranks}/${t.ranks}`);
  setText("total-running", t.running);
  setText("total-wasted", gpuHours(t.wasted_gpu_hours));
  setText("total-saved", t.saved_cost === null ? signedDuration(t.saved_s)
    : `${signedDuration(t.saved_s)} · ${money(t.saved_cost)}`);
  setText("total-pending", t.pending_proposals);
  setText("total-efficiency", t.efficiency === null ? "n/a" : pct(t.efficiency));
}

function render() {
  if (!frame || !frame.fleet) return;
  const fleet = frame.fleet;
  renderTotals(fleet.totals);
  for (const th of table.querySelectorAll("th[data-sort]")) {
    if (th.dataset.sort === sort.key) th.setAttribute("aria-sort", sort.dir > 0 ? "ascending" : "descending");
    else th.removeAttribute("aria-sort");
  }
  if (!fleet.data.length) return;
  const summaries = new Map((frame.jobs || []).map((s) => [s.job, s]));
  const rows = fleet.data.filter(matches).sort(compare);
  shown.textContent = `${rows.length} of ${fleet.count} shown`;
  // In place, row by job: up to dashboard_max_hz frames a second must not swap the link
  // under a user's pointer between press and release (common.js, morphChildren).
  morphChildren(body, rows.length ? rows.map((j) => row(j, summaries.get(j.job)))
    : [el("tr", {}, el("td", { colspan: 15, class: "empty" }, "No job matches the filter."))],
  (n) => (n.dataset ? n.dataset.job : null));
}

for (const th of table.querySelectorAll("th[data-sort]")) {
  th.addEventListener("click", () => {
    sort.dir = sort.key === th.dataset.sort ? -sort.dir : 1;
    sort.key = th.dataset.sort;
    render();
  });
}
statusFilter.addEventListener("change", render);
textFilter.addEventListener("input", render);

function setConn(state, detail) {
  conn.className = `conn ${state}`;
  conn.textContent = state === "open" ? "live" : state === "closed" ? `reconnecting${detail ? `: ${detail}` : ""}` : "connecting";
}

setInterval(() => {
  if (conn.classList.contains("open") && Date.now() - lastFrame > 5000) {
    conn.className = "conn stale";
    conn.textContent = "data is stale";
  }
}, 1000);

mountTokenBox(document.getElementById("token-box"));
liveSocket(null, (f) => {
  if (f.type !== "overview") return;
  lastFrame = Date.now();
  frame = f;
  render();
  setConn("open", "");
}, setConn);
