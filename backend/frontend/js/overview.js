// Jobs overview: one row per job, refreshed from /ws/dashboard overview frames.
import {
  STATUS_LABEL, duration, el, fmt, forecastFor, getToken, liveSocket, money, mountTokenBox, pct,
} from "./common.js";

const body = document.getElementById("jobs-body");
const conn = document.getElementById("conn");
let lastFrame = 0;

function row(j) {
  const q = getToken() && new URLSearchParams(location.search).get("token")
    ? `?token=${encodeURIComponent(getToken())}` : "";
  const f = forecastFor(j.job, j);  // the server's ETA (a local total: its /forecast)
  const eta = f ? f.eta_s : null;
  const stale = j.age_s !== null && j.age_s > 5 && j.status !== "idle";
  return el("tr", { "data-job": j.job },
    el("td", {}, el("a", { href: `/job/${encodeURIComponent(j.job)}${q}`, class: "job-link" }, j.job)),
    el("td", {}, el("span", { class: `pill ${j.status}`, title: j.status_detail || "" },
      STATUS_LABEL[j.status] || j.status), stale ? el("span", { class: "pill stale" }, "stale") : null),
    el("td", { class: "num" }, `${j.connected_ranks}/${j.world_size}`),
    el("td", { class: "num" }, j.batch_index ?? "–"),
    el("td", { class: "num" }, fmt(j.step_rate_hz, 1)),
    el("td", { class: "num" }, fmt(j.step_ms, 1, " ms")),
    el("td", { class: "num" }, pct(j.imbalance)),
    el("td", {}, j.mode || "–"),
    el("td", { class: "num" }, eta === null ? "–" : duration(eta)),
    el("td", { class: "num" }, money(j.cost_per_hour)),
  );
}

function render(frame) {
  lastFrame = Date.now();
  if (!frame.jobs.length) return;
  body.replaceChildren(...frame.jobs.map(row));
}

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
liveSocket(null, (f) => { if (f.type === "overview") { render(f); setConn("open", ""); } }, setConn);
