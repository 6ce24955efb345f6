// "Why is this job slow" card of the job view: the causes of lost step time, largest first,
// as GET /api/v1/jobs/{job}/causes gives them (backend/policy/causes.py replays the recent
// steps with one cause removed at a time). Every figure is the server's; a GC hint shows
// when the server gives one (GC pauses above 2% of the step). A hung job's rank, phase,
// Python stack and NCCL flight recorder dump (GET /api/v1/jobs/{job}: hung_*, from the
// page's one poller, poller.js) show in their own card above.
import { byId, el, fmt, jobResource, pct } from "./common.js";

const POLL_MS = 3000;

export class CausesCard {
  constructor(job, poller) {
    Object.assign(this, { job, poller, goodput: null, last: null },
      byId({ summary: "causes-summary", hint: "gc-hint", hang: "hang-card" }));
    this.body = document.querySelector("#causes-table tbody");
  }

  start() {
    this.poller.subscribe((job) => {
      this.goodput = job.goodput;
      this.renderHang(job);
    });
    const tick = () => this.refresh().finally(() => setTimeout(tick, POLL_MS));
    tick();
  }

  async refresh() {
    const res = await jobResource(this.job, "causes");
    if (res) this.render(res);
  }

  // A hung job (status "hung"): the rank it waits on, where, since when, and its stack.
  renderHang(job) {
    const hung = job.status === "hung" && job.hung_rank !== null && job.hung_rank !== undefined;
    this.hang.hidden = !hung;
    if (!hung) return;
    const since = job.hung_since ? Math.max(0, Date.now() / 1000 - job.hung_since) : null;
    document.getElementById("hang-text").textContent =
      `Rank ${job.hung_rank} stopped stepping` +
      (job.hung_batch_index !== null ? ` at batch ${job.hung_batch_index}` : "") +
      ` (${job.hung_phase})` + (since !== null ? `, ${since.toFixed(0)} s ago` : "") + ".";
    document.getElementById("hang-stack").textContent = job.hung_stack || "(no stack: its hook sent no report)";
    const nccl = document.getElementById("hang-nccl");
    nccl.hidden = !job.hung_nccl_dump;
    nccl.textContent = job.hung_nccl_dump
      ? `NCCL flight recorder dump (written when the collective times out): ${job.hung_nccl_dump}` : "";
  }

  render(res) {
    this.last = res;
    this.summary.textContent = res.window_steps
      ? `${res.window_steps} recent steps replayed: measured ${fmt(res.step_ms, 1, " ms")}, replay ${fmt(res.replayed_step_ms, 1, " ms")} a step.`
        + (this.goodput !== null && this.goodput !== undefined ? ` Goodput ${pct(this.goodput)}.` : "")
      : "Waiting for steps from every rank.";
    this.hint.hidden = !res.hint;
    this.hint.textContent = res.hint || "";
    if (!res.data.length) {
      this.body.replaceChildren(el("tr", {}, el("td", { colspan: 6, class: "empty" },
        res.window_steps ? "No cause costs more than 0.2% of the step." : "–")));
      return;
    }
    this.body.replaceChildren(...res.data.map((c) => el("tr", { "data-cause": c.cause },
      el("td", {}, c.cause.replace(/_/g, " ")),
      el("td", {}, c.ranks.length ? c.ranks.map((r) => `r${r}`).join(" ") : "–"),
      el("td", { class: "num" }, fmt(c.ms_per_step, 1, " ms")),
      el("td", { class: "num" }, pct(c.share_of_step)),
      el("td", { class: "num" }, fmt(c.gpu_hours_lost, 3)),
      el("td", { class: "remedy" }, c.remedy),
    )));
  }
}
