// Shared helpers of the dashboard pages: token, REST calls, the live socket, formatting.

const TOKEN_KEY = "rebalancer.token";

// A `?token=` in the page's URL is taken once: kept in localStorage and removed from the
// address bar and the history, so no later request, link or log line carries it.
(function takeUrlToken() {
  const url = new URL(location.href);
  const q = url.searchParams.get("token");
  if (!q) return;
  localStorage.setItem(TOKEN_KEY, q);
  url.searchParams.delete("token");
  history.replaceState(history.state, "", url.pathname + url.search + url.hash);
})();

/** The bearer token (from an earlier `?token=` or the token box), or "". */
export function getToken() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
}

/** A REST call under /api/v1; throws Error(detail) on a non-2xx answer. */
export async function api(path, { method = "GET", body } = {}) {
  const headers = { Accept: "application/json" };
  const token = getToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(`/api/v1${path}`, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = { detail: text }; }
  if (!res.ok) {
    let detail = data && data.detail !== undefined ? data.detail : `HTTP ${res.status}`;
    if (Array.isArray(detail)) detail = detail.map((d) => d.msg || JSON.stringify(d)).join("; ");
    const err = new Error(String(detail));
    err.status = res.status;
    throw err;
  }
  return data;
}

/** A resource of one job (`/jobs/{job}/{path}`), or null when the server refuses it:
 * a card that polls draws nothing new this turn and asks again on the next. */
export async function jobResource(job, path) {
  try { return await api(`/jobs/${encodeURIComponent(job)}/${path}`); } catch { return null; }
}

/** `{name: id}` to `{name: element}`: the elements a card fills. */
export function byId(ids) {
  return Object.fromEntries(Object.entries(ids).map(([name, id]) => [name, document.getElementById(id)]));
}

/** Who the token belongs to: {name, role, operator, open_mode}, or null when refused. */
export async function whoami() {
  try { return await api("/whoami"); } catch (e) { return { error: e.message, status: e.status }; }
}

/**
 * Keep a /ws/dashboard socket open: reconnect with capped exponential backoff.
 * onFrame(frame) gets every parsed frame; onState(state, detail) gets
 * "connecting" | "open" | "closed".
 */
export function liveSocket(job, onFrame, onState) {
  let delay = 500;
  let ws = null;
  let stopped = false;
  const connect = () => {
    const params = new URLSearchParams();
    if (job) params.set("job", job);
    const proto = location.protocol === "https:" ? "wss" : "ws";
    onState("connecting", "");
    ws = new WebSocket(`${proto}://${location.host}/ws/dashboard?${params}`);
    ws.onopen = () => {
      // The token goes as the first message, never in the URL (URLs end up in logs).
      const token = getToken();
      if (token) ws.send(JSON.stringify({ type: "auth", token }));
      delay = 500;
      onState("open", "");
    };
    ws.onmessage = (ev) => {
      let frame;
      try { frame = JSON.parse(ev.data); } catch { return; }
      onFrame(frame);
    };
    ws.onclose = (ev) => {
      if (stopped) return;
      const why = ev.code === 4401 ? "token missing or invalid" : ev.code === 4403 ? "token lacks the viewer role" : "";
      onState("closed", why);
      // Jitter keeps a room full of dashboards from reconnecting in lockstep.
      setTimeout(connect, delay * (0.75 + Math.random() / 2));
      delay = Math.min(delay * 2, 8000);
    };
  };
  connect();
  return { close() { stopped = true; if (ws) ws.close(); } };
}

// --- formatting -------------------------------------------------------------------------

export const STATUS_LABEL = {
  warming_up: "warming up", balanced: "balanced", imbalanced: "imbalanced",
  proposal_pending: "proposal pending", idle: "idle", degraded: "degraded", hung: "hung", ended: "ended",
};

export function fmt(v, digits = 1, unit = "") {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return `${Number(v).toFixed(digits)}${unit}`;
}

export function pct(v, digits = 1) {
  return v === null || v === undefined ? "–" : `${(100 * v).toFixed(digits)}%`;
}

export function bytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  if (Math.abs(s) < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  const h = Math.floor(s / 3600);
  return `${h} h ${Math.round((s % 3600) / 60)} min`;
}

export function money(v) {
  return v === null || v === undefined ? "–" : `$${v < 10 ? v.toFixed(2) : v.toFixed(0)}`;
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// Redrawing a live table with replaceChildren swaps every element under the pointer: a
// click whose press lands on one link and whose release lands on its replacement is no
// click at all (measured on the fleet table at its frame rate: 22 of 50 presses held
// 120 ms were lost). morphChildren updates the elements in place instead, so a link or
// button stays the same element from one frame to the next while its text changes.
// The nodes given are fresh ones built by el() without listeners: listeners are not copied.

function morph(have, want) {
  if (have.nodeType !== want.nodeType || have.nodeName !== want.nodeName) return false;
  if (have.nodeType !== Node.ELEMENT_NODE) {
    if (have.nodeValue !== want.nodeValue) have.nodeValue = want.nodeValue;
    return true;
  }
  for (const { name } of Array.from(have.attributes)) {
    if (!want.hasAttribute(name)) have.removeAttribute(name);
  }
  for (const { name, value } of Array.from(want.attributes)) {
    if (have.getAttribute(name) !== value) have.setAttribute(name, value);
  }
  morphChildren(have, Array.from(want.childNodes));
  return true;
}

/**
 * Make `parent`'s children match `wants` (detached nodes, in order) while keeping the
 * existing nodes that match: by `keyOf(node)` where it gives a key (a table's rows by
 * their job, so a re-sort moves a row rather than rebuilding it), else by position.
 * A frame that changes nothing touches no node.
 */
export function morphChildren(parent, wants, keyOf = () => null) {
  const byKey = new Map();
  for (const n of parent.childNodes) {
    const k = keyOf(n);
    if (k !== null && k !== undefined) byKey.set(k, n);
  }
  wants.forEach((want, i) => {
    const at = parent.childNodes[i] || null;
    const k = keyOf(want);
    const keyed = k !== null && k !== undefined;
    const have = keyed ? byKey.get(k) : at && !byKey.has(keyOf(at)) ? at : null;
    if (have && morph(have, want)) {
      if (keyed) byKey.delete(k);
      if (have !== at) parent.insertBefore(have, at);
    } else if (have && have === at) {
      parent.replaceChild(want, at);
    } else {
      parent.insertBefore(want, at);
    }
  });
  while (parent.childNodes.length > wants.length) parent.lastChild.remove();
}

/** The token box in the header: shows who you are, lets you paste another token. */
export async function mountTokenBox(root, onChange) {
  const me = await whoami();
  const input = el("input", { type: "password", placeholder: "token", id: "token-input", size: 14 });
  const label = me && me.role
    ? el("span", { class: "who", id: "whoami" }, `${me.name} · ${me.role}${me.open_mode ? " (open mode)" : ""}`)
    : el("span", { class: "who warn", id: "whoami" }, me && me.status === 401 ? "token needed" : "signed out");
  const save = el("button", {
    type: "button", class: "small", id: "token-save",
    onclick: () => { setToken(input.value.trim()); onChange ? onChange() : location.reload(); },
  }, input.value ? "Use" : "Use token");
  const clear = el("button", {
    type: "button", class: "small ghost",
    onclick: () => { setToken(""); location.href = location.pathname; },
  }, "Forget");
  root.replaceChildren(label, input, save, clear);
  return me;
}

/** Steps the user says the run will take in all (remembered per job in this browser). */
export function totalSteps(job) {
  const v = Number(localStorage.getItem(`rebalancer.total.${job}`));
  return Number.isFinite(v) && v > 0 ? v : null;
}

export function setTotalSteps(job, n) {
  if (n) localStorage.setItem(`rebalancer.total.${job}`, String(n));
  else localStorage.removeItem(`rebalancer.total.${job}`);
}

/**
 * ETA and cost to finish, as the server computes them (the page never recomputes them):
 * the summary's own eta_s / cost_to_finish, or, when the user set a total in this browser
 * that differs from what the hooks reported, the server's /forecast for that total
 * (fetched at most every 5 s per job and total; `onReady` is called when it arrives).
 */
const forecasts = new Map();
export function forecastFor(job, summary, onReady = () => {}) {
  const mine = totalSteps(job);
  if (!summary || !mine || mine === summary.total_steps) return summary;
  const key = `${job}:${mine}`;
  const hit = forecasts.get(key);
  if (!hit || Date.now() - hit.at > 5000) {
    forecasts.set(key, { at: Date.now(), data: hit ? hit.data : null });
    api(`/jobs/${encodeURIComponent(job)}/forecast?total_steps=${mine}`)
      .then((d) => { forecasts.set(key, { at: Date.now(), data: d }); onReady(); })
      .catch(() => {});
  }
  return hit ? hit.data : null;
}
