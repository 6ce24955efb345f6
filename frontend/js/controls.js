// Operator controls of the job view (proposal decisions, mode, overrides, manual placement,
// rollback) and the history tables. Viewers get the same page with the controls hidden.
import { api, bytes, el, fmt, pct } from "./common.js";

const $ = (id) => document.getElementById(id);

function say(id, text, ok = false) {
  const node = $(id);
  node.textContent = text;
  node.className = `msg ${ok ? "ok" : "err"}`;
}

export class Controls {
  constructor(job, me) {
    this.job = job;
    this.enc = encodeURIComponent(job);
    this.operator = Boolean(me && me.operator);
    this.control = {};
    this.world = 0;
    this.overridesShown = null;
    for (const node of document.querySelectorAll(".operator-only")) node.hidden = !this.operator;
    $("mode").addEventListener("change", (e) => this.act("control-msg", `/jobs/${this.enc}/mode`,
      { method: "PUT", body: { mode: e.target.value, reason: "set from the dashboard" } }, `Mode set to ${e.target.value}.`));
    $("apply-overrides").addEventListener("click", () => this.applyOverrides());
    $("clear-overrides").addEventListener("click", () => this.act("override-msg", `/jobs/${this.enc}/overrides`,
      { method: "PUT", body: { pins: {}, caps: {}, floors: {}, drains: [], granularity: 1, reason: "cleared from the dashboard" } },
      "Overrides cleared.", true));
    $("submit-manual").addEventListener("click", () => this.submitManual());
    $("rollback").addEventListener("click", () => {
      if (!window.confirm("Roll back to the placement in force before the current one?")) return;
      this.act("override-msg", `/jobs/${this.enc}/rollback`, { method: "POST", body: { reason: "rollback from the dashboard" } },
        "Rollback sent.");
    });
    this.refreshHistory();
    setInterval(() => this.refreshHistory(), 3000);
  }

  async act(msgId, path, opts, okText, reloadOverrides = false) {
    $(msgId).className = "msg";
    $(msgId).textContent = "sending…";
    try {
      await api(path, opts);
      say(msgId, okText, true);
      if (reloadOverrides) this.overridesShown = null;
      this.refreshHistory();
    } catch (e) {
      say(msgId, e.message);
    }
  }

  update(control, ranks) {
    this.control = control || {};
    const c = this.control;
    this.world = ranks && ranks.rank ? ranks.rank.length : this.world;
    // No action on a run that ended; in observe mode only the mode itself (the way out).
    const ended = c.status === "ended";
    const observe = c.mode === "observe";
    $("mode").hidden = !this.operator || ended;
    $("override-card").hidden = !this.operator || ended || observe;
    $("mode-text").textContent = this.operator && !ended ? "" : (c.mode || "–");
    if (this.operator && c.mode && document.activeElement !== $("mode")) $("mode").value = c.mode;
    $("strategy-text").textContent = c.strategy ? `strategy: ${c.strategy}` : "";
    this.renderProposal(c.pending_proposal, ended ? "ended" : observe ? "observe" : "");
    this.renderOverrideTable(c, ranks);
  }

  // `why` ("ended", "observe" or ""): why the proposal may not be acted on here.
  renderProposal(p, why = "") {
    const box = $("proposal");
    const key = p ? `${p.id}:${p.status}:${why}` : "none";
    if (key === this.proposalKey) return;
    this.proposalKey = key;
    if (!p) {
      box.replaceChildren(el("p", { class: "muted", id: "no-proposal" }, "No pending proposal."));
      return;
    }
    const gain = p.predicted_gain;
    const nodes = [
      el("div", { class: "row" },
        el("b", { id: "proposal-title" }, `Proposal ${p.id}`),
        el("span", { class: "pill proposal_pending" }, p.status),
        el("span", { class: "muted" }, `${p.source}${p.strategy ? ` · ${p.strategy}` : ""}`)),
      el("div", { class: "stats" },
        stat("predicted gain", gain === null || gain === undefined ? "–" : pct(gain), "good"),
        stat("step before", fmt(p.predicted_step_ms_before, 1, " ms")),
        stat("step after", fmt(p.predicted_step_ms_after, 1, " ms"))),
      el("div", { class: "explain", id: "proposal-reason" }, p.reason || ""),
      explanationTable(p.explanation),
    ];
    if (p.status === "proposed" && why) {
      nodes.push(el("p", { class: "hint", id: "proposal-note" }, why === "ended"
        ? "The run ended: no placement can take effect now."
        : "Observe mode: this proposal is shown, never sent. Set the mode to approve to act on it."));
    } else if (this.operator && p.status === "proposed") {
      nodes.push(el("div", { class: "row" },
        el("button", { type: "button", class: "good", id: "approve", onclick: () => this.decide(p.id, "approve") }, "Approve"),
        el("button", { type: "button", class: "ghost", id: "reject", onclick: () => this.decide(p.id, "reject") }, "Reject")));
    }
    box.replaceChildren(...nodes.filter(Boolean));
  }

  async decide(id, verb) {
    for (const b of document.querySelectorAll("#approve, #reject")) b.disabled = true;
    await this.act("control-msg", `/jobs/${this.enc}/proposals/${id}/${verb}`,
      { method: "POST", body: { reason: `${verb === "approve" ? "approved" : "rejected"} from the dashboard` } },
      verb === "approve" ? `Proposal ${id} approved: the job switches at a step boundary.` : `Proposal ${id} rejected.`);
    this.proposalKey = null;
  }

  renderOverrideTable(c, ranks) {
    if (!this.operator || !ranks || !ranks.rank) return;
    const ov = c.overrides || { pins: {}, caps: {}, drains: [], granularity: 1 };
    const key = JSON.stringify([ov, ranks.rank.length]);
    const body = $("override-table").querySelector("tbody");
    const shares = (c.placement && c.placement.shares) || [];
    if (key !== this.overridesShown) {
      // Rebuild only when the stored overrides change, so typing is never overwritten.
      this.overridesShown = key;
      body.replaceChildren(...ranks.rank.map((r) => el("tr", { "data-rank": r },
        el("td", {}, `r${r}`),
        el("td", { class: "num share" }, shares[r] ?? "–"),
        el("td", {}, el("input", { type: "number", min: 0, class: "n pin", value: ov.pins[r] ?? ov.pins[String(r)] ?? "" })),
        el("td", {}, el("input", { type: "number", min: 0, class: "n cap", value: ov.caps[r] ?? ov.caps[String(r)] ?? "" })),
        el("td", {}, el("input", { type: "checkbox", class: "drain", checked: (ov.drains || []).includes(r) }))),
      ));
      $("granularity").value = ov.granularity || 1;
    } else {
      for (const tr of body.querySelectorAll("tr")) {
        tr.querySelector(".share").textContent = shares[Number(tr.dataset.rank)] ?? "–";
      }
    }
  }

  applyOverrides() {
    const pins = {}; const caps = {}; const drains = [];
    for (const tr of $("override-table").querySelectorAll("tbody tr")) {
      const r = Number(tr.dataset.rank);
      const pin = tr.querySelector(".pin").value.trim();
      const cap = tr.querySelector(".cap").value.trim();
      if (pin !== "") pins[r] = Number(pin);
      if (cap !== "") caps[r] = Number(cap);
      if (tr.querySelector(".drain").checked) drains.push(r);
    }
    const granularity = Number($("granularity").value || 1);
    const bad = [...Object.values(pins), ...Object.values(caps), granularity].find((v) => !Number.isInteger(v) || v < 0);
    if (bad !== undefined) { say("override-msg", `Shares must be whole numbers >= 0, got ${bad}.`); return; }
    this.act("override-msg", `/jobs/${this.enc}/overrides`,
      { method: "PUT", body: { pins, caps, drains, granularity, reason: "set from the dashboard" } }, "Overrides applied.", true);
  }

  submitManual() {
    const raw = $("manual-shares").value.trim();
    const parts = raw.split(/[\s,]+/).filter(Boolean);
    const shares = parts.map(Number);
    if (!parts.length || shares.some((v) => !Number.isInteger(v) || v < 0)) {
      say("override-msg", `Enter one whole number >= 0 per rank, separated by commas; got "${raw}".`);
      return;
    }
    if (this.world && shares.length !== this.world) {
      say("override-msg", `Enter ${this.world} shares (one per rank); got ${shares.length}.`);
      return;
    }
    this.act("override-msg", `/jobs/${this.enc}/proposals`,
      { method: "POST", body: { shares, apply: true, reason: "manual placement from the dashboard" } }, "Placement sent.");
  }

  async refreshHistory() {
    try {
      const [pl, au] = await Promise.all([api(`/jobs/${this.enc}/placements?limit=50`), api(`/jobs/${this.enc}/audit?limit=100`)]);
      $("placements").querySelector("tbody").replaceChildren(...pl.data.map((p) => el("tr", {},
        el("td", { class: "num" }, p.version), el("td", {}, p.source), el("td", {}, p.actor || ""),
        el("td", { class: "num" }, p.effective_batch_index ?? (p.failed ? "failed" : p.version === 0 ? 0 : "pending")),
        el("td", { class: "num" }, fmt(p.effect && p.effect.step_ms_before, 1, " ms")),
        el("td", { class: "num" }, fmt(p.effect && p.effect.step_ms_after, 1, " ms")),
        el("td", { class: "num" }, p.effect && p.effect.measured_gain !== null ? pct(p.effect.measured_gain) : "–",
          p.effect && p.effect.rolled_back ? " (rolled back)" : ""),
        el("td", { title: p.reason || "" }, (p.reason || "").slice(0, 60)))));
      $("audit").querySelector("tbody").replaceChildren(...au.data.map((a) => el("tr", {},
        el("td", {}, new Date(a.time * 1000).toLocaleTimeString()), el("td", {}, `${a.actor}${a.role ? ` (${a.role})` : ""}`),
        el("td", {}, a.action), el("td", { title: JSON.stringify(a.params) }, (a.reason || JSON.stringify(a.params)).slice(0, 70)))));
    } catch {
      // The history is secondary: the live feed keeps working; try again next round.
    }
  }
}

function stat(k, v, cls = "") {
  return el("div", { class: "stat" }, el("div", { class: "k" }, k), el("div", { class: `v ${cls}` }, v));
}

// Predicted peak memory before → after, and the memory cap ("–" where the rank has no fit).
function peakText(r) {
  if (r.mem_peak_after_bytes === null || r.mem_peak_after_bytes === undefined) return "–";
  const cap = r.mem_cap === null || r.mem_cap === undefined ? "" : ` (cap ${r.mem_cap})`;
  return `${bytes(r.mem_peak_before_bytes)} → ${bytes(r.mem_peak_after_bytes)}${cap}`;
}

function explanationTable(ex) {
  // Policy proposals explain every rank; manual ones carry only the memory part.
  const ranks = ex && Array.isArray(ex.ranks) && ex.ranks.length ? ex.ranks
    : ex && Array.isArray(ex.memory) ? ex.memory : null;
  if (!ranks || !ranks.length) return null;
  const rows = ranks.slice(0, 64).map((r) => el("tr", {},
    el("td", {}, `r${r.rank}`),
    el("td", { class: "num" }, r.share_before === undefined ? "" : `${r.share_before} → ${r.share_after}`),
    el("td", { class: "num" }, r.compute_ms_before === undefined ? "" : `${fmt(r.compute_ms_before, 1)} → ${fmt(r.compute_ms_after, 1)} ms`),
    el("td", { class: "num" }, r.c_ms === undefined ? "" : fmt(r.c_ms, 3, " ms/sample")),
    el("td", { class: "num mem-peak" }, peakText(r))));
  return el("div", { class: "scroll h160" }, el("table", { class: "grid" },
    el("thead", {}, el("tr", {}, el("th", {}, "rank"), el("th", { class: "num" }, "share"),
      el("th", { class: "num" }, "predicted compute"), el("th", { class: "num" }, "cost"),
      el("th", { class: "num" }, "predicted peak memory"))),
    el("tbody", {}, rows)));
}

export { stat };
