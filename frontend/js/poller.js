// One poller of GET /api/v1/jobs/{job} for the job view's cards (communication, causes, pipeline, the
// hang card and the run report): each subscribes to jobPoller(job) and gets every new
// answer, so the page asks once per interval, however many cards read the job resource.
import { api } from "./common.js";

export const JOB_POLL_MS = 2000;

export class JobPoller {
  constructor(job, everyMs = JOB_POLL_MS) {
    this.path = `/jobs/${encodeURIComponent(job)}`;
    this.everyMs = everyMs;
    this.listeners = [];
    this.last = null;
    this.polls = 0; // answers fetched (the browser test counts them against the page's requests)
    this.running = false;
  }

  // fn(job) after every answer; the newest answer at once when there is one.
  subscribe(fn) {
    this.listeners.push(fn);
    if (this.last) fn(this.last);
    if (!this.running) this.start();
  }

  start() {
    this.running = true;
    const tick = () => this.refresh().finally(() => setTimeout(tick, this.everyMs));
    tick();
  }

  async refresh() {
    let job;
    try { job = await api(this.path); } catch { return; }
    this.last = job;
    this.polls += 1;
    for (const fn of this.listeners) {
      try { await fn(job); } catch (e) { console.error(e); }
    }
  }
}

const pollers = new Map();

// The page's one poller of ``job`` (job.js and report.js are separate modules).
export function jobPoller(job) {
  if (!pollers.has(job)) pollers.set(job, new JobPoller(job));
  return pollers.get(job);
}
