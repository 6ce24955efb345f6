"""Backend capacity: many simulated hooks against one real backend process.

Real websocket clients, no training: one asyncio process opens N hook connections to
``/ws/hook`` (``hello``, then ``metrics`` frames at 10 steps a second per rank, batched the
way the hook's transport batches them) and one dashboard client on ``/ws/dashboard``.
Frames are pre-encoded templates, so the generator spends its CPU on sockets, not JSON.

Reported per world size: sustained messages/s and rank-steps/s (sent, and counted by the
backend), backend CPU (psutil on the server process), CPU of the load generator and of the
dashboard client, records lost (sent minus counted by the backend's
``rebalancer_ingest_records_total``: must be 0), and dashboard latency p50/p99: from the
moment a hook frame is handed to its socket to the moment a dashboard frame first shows
that rank at that frame's newest batch index or later. The dashboard client runs in its
own process so that the generator's busy event loop does not delay what it sees.

Prometheus's side: a scraper process fetches ``/metrics`` every ``SCRAPE_EVERY_S`` during
the measured window (under the full load) and a few times once the hooks stopped (quiet):
wall time per scrape, body size and series count. Every simulated rank reports an
NVML-like device sample (GPU index, UUID, utilisation, memory, power, temperature, clocks,
throttle reasons), so a scrape carries every per-rank and per-device series a GPU job has.

With ``--node-size 8`` the ranks of each simulated node share one websocket, as node
aggregation does (trainer_hook/node_agg.py, docs/protocol.md node connections): one hello
per rank on it, then every rank's frames on it; ``--steps-per-s 1`` models large jobs,
whose steps are slow (a frame per rank every max(flush interval, step) seconds).

With ``--replicas 2`` the load goes to two backend processes sharing PostgreSQL (a fresh
schema of 127.0.0.1:5432/test) and Redis (127.0.0.1:6379, a key prefix of its own), as
docs/scale-out.md runs them: the ranks are split into ``--jobs`` jobs (default one per
replica), job j's hooks connect to replica j % replicas (its owner), and the CPU of each
backend, of Redis and of PostgreSQL over the window is reported beside the records counted.

    python -m bench.capacity [--quick | --tiny] [--ranks 8,64,256,1024] [--seconds 15]
                             [--node-size 8] [--steps-per-s 1] [--replicas 2 [--jobs 4]]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import websockets

from bench._backend import Backend, running_backend, running_cluster, stop_on_sigterm
from bench._report import RESULTS_DIR, print_table, write_json
from trainer_hook.config import HookConfig

__all__ = ["CapacityResult", "run_capacity", "main"]

STEPS_PER_S = 10.0
# Mirror the hook's transport: it sends one frame per flush interval holding every step
# record queued since, plus the ~1 Hz device sample (trainer_hook/transport.py).
FLUSH_S: float = HookConfig.__dataclass_fields__["flush_interval_s"].default
DEVICE_EVERY_S = 1.0

_RECORD = (
    '{{"batch_index":{k},"local_batch_size":{b},"placement_version":0,"data_wait_ms":0.2,'
    '"compute_ms":{c:.3f},"sync_wait_ms":1.5,"optimizer_ms":0.8,"step_ms":100.0,"t":{t:.6f}}}'
)

_DEVICE = ('{{"t":{t:.6f},"source":"nvml","util_pct":97.0,"mem_used_bytes":32212254720,'
           '"mem_total_bytes":85899345920,"power_w":612.5,"temp_c":71.0,"sm_clock_mhz":1755.0,'
           '"sm_clock_max_mhz":1980.0,"throttle_reasons":["sw_power_cap"]}}')
SCRAPE_EVERY_S = 2.0
CONNECT_TIMEOUT_S = 900.0  # the connect phase's limit; past it the window measures the ranks connected
QUIET_SCRAPES = 3


@dataclass
class CapacityResult:
    ranks: int
    seconds: float
    target_rank_steps_per_s: float
    sent_messages_per_s: float
    sent_rank_steps_per_s: float
    counted_records_per_s: float | None  # steps + device samples, from the backend's counter
    records_sent: int
    records_counted: int | None
    records_lost: int | None
    loss_source: str
    backend_cpu_pct: float  # 100 = one core busy
    generator_cpu_pct: float  # the hook load generator process
    dashboard_client_cpu_pct: float  # the dashboard client, its own process
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_samples: int
    dashboard_frames: int
    dashboard_bytes_per_s: float
    send_lag_p99_ms: float  # how late the generator sent frames (its own overload)
    scrapes: int = 0  # /metrics fetched under load
    scrape_p50_ms: float | None = None  # wall time of one scrape under load
    scrape_max_ms: float | None = None
    scrape_quiet_ms: float | None = None  # median of QUIET_SCRAPES after the hooks stopped
    scrape_bytes: int | None = None  # body size of the last scrape
    scrape_series: int | None = None  # samples (lines) in it
    errors: list[str] = field(default_factory=list)
    node_size: int = 1  # ranks per hook websocket (1: a websocket per rank)
    frames: str = "rank"  # "node": one node_metrics frame per node per flush; "rank": a frame per rank
    steps_per_s: float = STEPS_PER_S  # per rank
    hook_sockets: int | None = None  # open hook websockets at the backends under load (/healthz)
    replicas: int = 1  # backend processes (more than one: PostgreSQL and Redis shared)
    jobs: int = 1  # the ranks split into this many jobs, job j owned by replica j % replicas
    replica_cpu_pct: list[float] = field(default_factory=list)  # each backend's (sums to backend_cpu_pct)
    replica_sockets: list[int | None] = field(default_factory=list)  # hook websockets each backend holds
    redis_cpu_pct: float | None = None  # this machine's Redis and PostgreSQL servers in the window
    postgres_cpu_pct: float | None = None
    # The connect phase: every rank's hello sent, its placement read back (before the window).
    ranks_connected: int = 0  # hellos answered with the placement in force
    connect_s: float | None = None  # from the first connection opened to the last hello answered
    hellos_per_s: float | None = None  # ranks_connected / connect_s
    # Each backend's CPU seconds over the connect phase (its first nodes already stream), and
    # their sum per hello answered: what a hello costs, whatever the machine's load.
    connect_replica_cpu_s: list[float] = field(default_factory=list)
    backend_cpu_ms_per_hello: float | None = None
    # This machine's load average (uptime: 1, 5, 15 min) when the connect phase began and at the
    # window's end: other work on a shared machine shows here.
    load_avg_start: list[float] = field(default_factory=list)
    load_avg_window: list[float] = field(default_factory=list)
    rank_steps_per_backend_core_s: float | None = None  # rank-steps sent in the window / backend CPU s


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))
    return s[i]


class _Load:
    """Shared state of one load run: what was sent when, and what the dashboard showed."""

    def __init__(self, job: str, ranks: int, steps_per_s: float = STEPS_PER_S) -> None:
        self.job = job
        self.ranks = ranks
        # A rank's transport sends a frame per flush interval, or per step when steps are slower.
        self.interval = max(FLUSH_S, 1.0 / steps_per_s)
        self.per_msg = max(1, round(steps_per_s * self.interval))
        self.batch = [0] * ranks  # next batch index per rank
        # Per rank: (newest batch index in the frame, wall time it was handed to the socket).
        self.sent_at: list[list[tuple[int, float]]] = [[] for _ in range(ranks)]
        self.measuring = False
        self.stop = False
        self.messages = 0
        self.records = 0
        self.devices_total = 0  # device samples sent over the whole run (for the loss count)
        self.lags: list[float] = []
        self.errors: list[str] = []
        self.no_reply = 0  # ranks whose hello got no placement back within 30 s
        self.replied = 0  # hellos answered with the placement in force (ranks connected)

    def reset_counters(self) -> None:
        self.messages = self.records = 0
        self.lags.clear()


def _rep(value: str, n: int) -> str:
    return ",".join([value] * n)


def _node_text(job: str, ranks: list[int], ks: list[int], per_msg: int, steps_per_s: float, now: float,
               computes: list[str], local: int, dev: bool) -> str:
    """One ``node_metrics`` frame (rebalancer_wire/node.py) of ``ranks``, as a node agent packs
    it: ``per_msg`` steps each, ending at ``now``, and an NVML-like sample each when ``dev``."""
    n = len(ranks)
    m = n * per_msg
    ts = ",".join(f"{now - (per_msg - 1 - j) / steps_per_s:.6f}" for j in range(per_msg))
    steps = (f'"batch_index":[{",".join(str(k + j) for k in ks for j in range(per_msg))}],'
             f'"local_batch_size":[{_rep(str(local), m)}],"placement_version":[{_rep("0", m)}],'
             f'"data_wait_ms":[{_rep("0.2", m)}],"compute_ms":[{",".join(c for c in computes for _ in range(per_msg))}],'
             f'"sync_wait_ms":[{_rep("1.5", m)}],"optimizer_ms":[{_rep("0.8", m)}],"step_ms":[{_rep("100.0", m)}],'
             f'"t":[{_rep(ts, n)}]')
    body = (f'{{"type":"node_metrics","v":3,"job":"{job}","ranks":[{",".join(map(str, ranks))}],'
            f'"n_steps":[{_rep(str(per_msg), n)}],"steps":{{{steps}}}')
    if dev:
        body += (f',"n_device":[{_rep("1", n)}],"device":{{"t":[{_rep(f"{now:.6f}", n)}],'
                 f'"source":[{_rep(chr(34) + "nvml" + chr(34), n)}],"util_pct":[{_rep("97.0", n)}],'
                 f'"mem_used_bytes":[{_rep("32212254720", n)}],"mem_total_bytes":[{_rep("85899345920", n)}],'
                 f'"power_w":[{_rep("612.5", n)}],"temp_c":[{_rep("71.0", n)}],"sm_clock_mhz":[{_rep("1755.0", n)}],'
                 f'"sm_clock_max_mhz":[{_rep("1980.0", n)}],"throttle_reasons":[{_rep(chr(91) + chr(34) + "sw_power_cap" + chr(34) + chr(93), n)}]}}')
    return body + "}"


async def _hook_client(load: _Load, base: str, ranks: list[int], t0: float, ready: asyncio.Event,
                       packed: bool = False) -> None:
    """One hook websocket: one rank's, or a node connection carrying ``ranks`` (``packed``:
    one node frame per flush for all of them, as the node agent sends; else a frame each)."""
    world = load.ranks
    gbs = max(world, 1) * 8
    hellos = [json.dumps({
        "type": "hello", "v": 1, "job": load.job, "rank": rank, "world_size": world,
        "global_batch_size": gbs, "host": f"node{rank // 8}", "pid": os.getpid(), "device_type": "H100",
        "device_name": "NVIDIA H100 80GB HBM3", "gpu_index": rank % 8,
        "gpu_uuid": f"GPU-{rank:08d}-0000-0000-0000-000000000000",
    }) for rank in ranks]
    heads = [f'{{"type":"metrics","v":1,"job":"{load.job}","rank":{rank},"dropped":0,"steps":[' for rank in ranks]
    interval = load.interval
    device_every = max(1, round(DEVICE_EVERY_S / interval))
    sent_msgs = 0
    per_msg = load.per_msg
    steps_per_s = per_msg / interval
    local = gbs // world
    computes = [20.0 + 30.0 * (rank % 4) for rank in ranks]
    texts = [f"{c:.3f}" for c in computes]
    async with websockets.connect(base + "/ws/hook", max_size=None, open_timeout=60,
                                  ping_interval=None) as ws:
        for hello in hellos:
            await ws.send(hello)
        for _ in hellos:
            try:  # the placement in force (the real hook does not wait for it either)
                await asyncio.wait_for(ws.recv(), timeout=30)
                load.replied += 1
            except asyncio.TimeoutError:
                load.no_reply += 1
                break
        ready.set()

        async def drain() -> None:
            async for _ in ws:
                pass

        reader = asyncio.create_task(drain())
        # Spread connections over one interval, as independent processes would be.
        next_at = t0 + interval * (ranks[0] / world)
        try:
            while not load.stop:
                delay = next_at - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = time.time()
                dev_due = sent_msgs % device_every == 0
                sent_msgs += 1
                if packed:
                    ks = [load.batch[rank] for rank in ranks]
                    await ws.send(_node_text(load.job, ranks, ks, per_msg, steps_per_s, now, texts, local, dev_due))
                    if dev_due:
                        load.devices_total += len(ranks)
                    for rank, k0 in zip(ranks, ks, strict=True):
                        load.batch[rank] = k0 + per_msg
                        load.sent_at[rank].append((k0 + per_msg - 1, now))
                    if load.measuring:
                        load.messages += 1
                        load.records += per_msg * len(ranks)
                        load.lags.append(max(0.0, now - next_at))
                    next_at += interval
                    if now - next_at > 5 * interval:
                        next_at = now
                    continue
                for rank, head, compute in zip(ranks, heads, computes, strict=True):
                    k0 = load.batch[rank]
                    # Steps end 1/rate apart; the newest ends now (its `t` is the send time).
                    recs = ",".join(
                        _RECORD.format(k=k0 + j, b=local, c=compute, t=now - (per_msg - 1 - j) / steps_per_s)
                        for j in range(per_msg)
                    )
                    dev = _DEVICE.format(t=now) if dev_due else ""
                    if dev:
                        load.devices_total += 1
                    await ws.send(f"{head}{recs}],\"device\":[{dev}]}}")
                    load.batch[rank] = k0 + per_msg
                    load.sent_at[rank].append((k0 + per_msg - 1, now))
                    if load.measuring:
                        load.messages += 1
                        load.records += per_msg
                if load.measuring:
                    load.lags.append(max(0.0, now - next_at))
                next_at += interval
                if now - next_at > 5 * interval:  # far behind: skip ahead, count it as lag
                    next_at = now
        finally:
            reader.cancel()


def _rank_positions(frame: Any) -> list[tuple[int, int]]:
    """(rank, batch_index) pairs a dashboard frame shows: the hub's columnar ``ranks``
    (``{"rank": [...], "batch_index": [...]}``) or, in frames between two of those on big
    jobs, its ``positions`` (the same two columns), or any object holding both keys."""
    cols = (frame.get("ranks") or frame.get("positions")) if isinstance(frame, dict) else None
    if isinstance(cols, dict) and isinstance(cols.get("rank"), list):
        return [(r, k) for r, k in zip(cols["rank"], cols.get("batch_index") or [], strict=False)
                if isinstance(r, int) and isinstance(k, int)]
    out: list[tuple[int, int]] = []
    stack = [frame]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            r, k = obj.get("rank"), obj.get("batch_index")
            if isinstance(r, int) and isinstance(k, int):
                out.append((r, k))
            stack.extend(v for v in obj.values() if isinstance(v, (dict, list)))
        elif isinstance(obj, list):
            stack.extend(v for v in obj if isinstance(v, (dict, list)))
    return out


async def _watch_dashboard(url: str, ranks: int, stop: Any, seen: list[tuple[int, int, float]],
                           frames: list[tuple[float, int]]) -> None:
    async with websockets.connect(url, max_size=None, open_timeout=60, ping_interval=None) as ws:
        shown = [-1] * ranks
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            now = time.time()
            frames.append((now, len(raw)))
            try:
                frame = json.loads(raw)
            except ValueError:
                continue
            for rank, k in _rank_positions(frame):
                if 0 <= rank < ranks and k > shown[rank]:
                    shown[rank] = k
                    seen.append((rank, k, now))


def _dashboard_process(url: str, ranks: int, stop: Any, conn: Any) -> None:
    """One dashboard client in its own process, so that the load generator's busy event
    loop does not delay the moment a frame is seen: it records (rank, batch index, time)
    each time a frame first shows a rank further on, and sends the log back at the end."""
    seen: list[tuple[int, int, float]] = []
    frames: list[tuple[float, int]] = []
    error = ""
    try:
        asyncio.run(_watch_dashboard(url, ranks, stop, seen, frames))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        error = repr(exc)
    conn.send((seen, frames, error))
    conn.close()


def _scrape(url: str) -> tuple[float, int, int]:
    """One ``/metrics`` fetch: (wall ms, bytes, samples)."""
    t = time.perf_counter()
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        body = r.read()
    ms = (time.perf_counter() - t) * 1000.0
    return ms, len(body), sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))


def _scrape_process(url: str, every_s: float, stop: Any, conn: Any) -> None:
    """Scrape ``/metrics`` every ``every_s`` until ``stop``, in its own process (as
    Prometheus would, apart from the load generator); sends back (start time, ms, bytes,
    samples) per scrape."""
    got: list[tuple[float, float, int, int]] = []
    error = ""
    while not stop.wait(every_s):
        try:
            got.append((time.time(), *_scrape(url)))
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            error = repr(exc)
            break
    conn.send((got, error))
    conn.close()


def _latencies(sent_at: list[list[tuple[int, float]]], seen: list[tuple[int, int, float]],
               t_lo: float, t_hi: float) -> list[float]:
    """For every hook frame sent in [t_lo, t_hi): ms until a dashboard frame first showed
    its rank at its newest batch index or later (frames never shown are left out)."""
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for rank, k, t in seen:
        by_rank.setdefault(rank, []).append((k, t))
    out: list[float] = []
    for rank, sends in enumerate(sent_at):
        shows = by_rank.get(rank, [])  # increasing k and t
        j = 0
        for k, t_sent in sends:
            while j < len(shows) and shows[j][0] < k:
                j += 1
            if j == len(shows):
                break
            if t_lo <= t_sent < t_hi:
                out.append((shows[j][1] - t_sent) * 1000.0)
    return out


def _ingest_counters(backend: Backend) -> dict[str, float]:
    """The backend's ``rebalancer_ingest_*`` Prometheus counters (summed over labels)."""
    try:
        text = backend.get("/metrics")
    except Exception:  # noqa: BLE001 - no /metrics: loss is then checked through REST
        return {}
    out: dict[str, float] = {}
    if not isinstance(text, str):
        return out
    for line in text.splitlines():
        m = re.match(r"^(rebalancer_ingest_[a-z_]+?)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _rest_steps(backend: Backend, job: str) -> int | None:
    """Step records the backend holds, judged by each rank's newest batch index."""
    try:
        body = backend.get(f"/api/v1/jobs/{job}/ranks")
    except Exception:  # noqa: BLE001
        return None
    rows = body.get("data", []) if isinstance(body, dict) else body
    return sum(int(r.get("batch_index") if r.get("batch_index") is not None else -1) + 1 for r in rows)


def _service_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this machine's Redis and PostgreSQL server processes (what a
    backend cluster costs them; other users of the same servers count too)."""
    out = {"redis": 0.0, "postgres": 0.0}
    for p in psutil.process_iter(["name"]):
        name = p.info.get("name") or ""
        key = "redis" if name.startswith("redis-server") else "postgres" if name.startswith("postgres") else None
        if key is None:
            continue
        try:
            out[key] += sum(p.cpu_times()[:2])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _sum_counters(backends: list[Backend]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in backends:
        for k, v in _ingest_counters(b).items():
            out[k] = out.get(k, 0.0) + v
    return out


async def _run_one(backends: list[Backend], ranks: int, seconds: float, warmup: float, node_size: int = 1,
                   steps_per_s: float = STEPS_PER_S, jobs: int = 1, frames: str = "node",
                   connect_timeout_s: float = CONNECT_TIMEOUT_S) -> CapacityResult:
    """``ranks`` simulated ranks in ``jobs`` jobs of (nearly) equal size; job j's hooks
    connect to ``backends[j % len(backends)]``, which therefore owns it. The dashboard
    client watches job 0 on its owner; the scraper scrapes the first backend."""
    sizes = [ranks // jobs + (j < ranks % jobs) for j in range(jobs)]
    if min(sizes) < 1:
        raise ValueError(f"{ranks} ranks cannot make {jobs} jobs.")
    name = f"cap-{ranks}" if node_size == 1 else f"cap-{ranks}-n{node_size}"
    loads = [_Load(name if jobs == 1 else f"{name}-j{j}", n, steps_per_s) for j, n in enumerate(sizes)]
    load = loads[0]  # the job the dashboard client watches
    backend = backends[0]
    servers = [psutil.Process(b.pid) for b in backends]
    me = psutil.Process()
    c_start = _sum_counters(backends)  # the backends may have served others before
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    dash = ctx.Process(target=_dashboard_process, daemon=True,
                       args=(f"{backend.ws_url}/ws/dashboard?job={load.job}", load.ranks, stop, child_conn))
    dash.start()
    # The scraper starts with the dashboard client, before the measured window (starting a
    # process inside it would take the window's CPU); only scrapes inside it are counted.
    scrape_stop = ctx.Event()
    scrape_conn, scrape_child = ctx.Pipe(duplex=False)
    scraper = ctx.Process(target=_scrape_process, daemon=True,
                          args=(backend.url, min(SCRAPE_EVERY_S, seconds / 2), scrape_stop, scrape_child))
    scraper.start()
    packed = frames == "node" and node_size > 1
    by_job = [[(job, backends[j % len(backends)].ws_url, list(range(r, min(r + node_size, job.ranks))))
               for r in range(0, job.ranks, node_size)] for j, job in enumerate(loads)]
    # The jobs' node connections interleaved: every replica answers its jobs' hellos at once,
    # not one replica after the other.
    groups = [g for wave in itertools.zip_longest(*by_job) for g in wave if g is not None]
    readies = [asyncio.Event() for _ in groups]
    tasks: list[asyncio.Task[None]] = []
    t0 = time.time() + 1.0
    sem = asyncio.Semaphore(64)  # connect in waves, as a real job's ranks trickle in

    async def start(i: int) -> None:
        async with sem:
            job, base, members = groups[i]
            task = asyncio.create_task(_hook_client(job, base, members, t0, readies[i], packed))
            tasks.append(task)
            waiter = asyncio.create_task(readies[i].wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    load_avg_start = os.getloadavg()
    c_hello0 = time.monotonic()
    cpu_c0 = [sum(p.cpu_times()[:2]) for p in servers]
    try:  # a backend that cannot take them all: measure what did connect, and say so
        await asyncio.wait_for(asyncio.gather(*(start(i) for i in range(len(groups)))), connect_timeout_s)
    except asyncio.TimeoutError:
        load.errors.append(f"the connect phase did not end within {connect_timeout_s:g} s "
                           f"(--connect-timeout-s): {sum(job.replied for job in loads)} of {ranks} ranks connected; "
                           f"the window measured those")
    connect_s = time.monotonic() - c_hello0
    connect_cpu_s = [sum(p.cpu_times()[:2]) - c for p, c in zip(servers, cpu_c0, strict=True)]
    connected = sum(job.replied for job in loads)
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed:
        load.errors.append(f"{len(failed)} hook connections failed: {failed[0].exception()!r}")
    await asyncio.sleep(max(0.0, t0 - time.time()) + warmup)
    for job in loads:
        job.reset_counters()
    c0 = _sum_counters(backends)
    cpu_s0 = [sum(p.cpu_times()[:2]) for p in servers]
    cluster = len(backends) > 1
    svc0 = _service_cpu_s() if cluster else {}
    cpu_g0 = sum(me.cpu_times()[:2])
    viewer = psutil.Process(dash.pid)
    cpu_d0 = sum(viewer.cpu_times()[:2])
    w0, wall0 = time.monotonic(), time.time()
    for job in loads:
        job.measuring = True
    await asyncio.sleep(seconds / 2)
    counts = await asyncio.gather(*(asyncio.to_thread(_hook_sockets, b) for b in backends))
    sockets = None if None in counts else sum(n for n in counts if n is not None)
    replica_sockets = list(counts)
    await asyncio.sleep(seconds / 2)
    for job in loads:
        job.measuring = False
    scrape_stop.set()
    elapsed, wall1 = time.monotonic() - w0, time.time()
    load_avg_window = os.getloadavg()
    c1 = _sum_counters(backends)
    cpu_s = [sum(p.cpu_times()[:2]) - c for p, c in zip(servers, cpu_s0, strict=True)]
    svc1 = _service_cpu_s() if cluster else {}
    cpu_g = sum(me.cpu_times()[:2]) - cpu_g0
    cpu_d = sum(viewer.cpu_times()[:2]) - cpu_d0
    for job in loads:
        job.stop = True
    await asyncio.sleep(3 * FLUSH_S)  # senders stop; let the last frames land
    for t in tasks:
        t.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    crashed = [o for o in outcomes if isinstance(o, Exception)]
    if crashed:
        load.errors.append(f"{len(crashed)} hook connections ended with an error, e.g. {crashed[0]!r}")
    await asyncio.sleep(1.0)
    c2 = _sum_counters(backends)
    got, scrape_error = await asyncio.to_thread(scrape_conn.recv)
    scraped = [x[1:] for x in got if wall0 <= x[0] < wall1]
    scraper.join(timeout=10)
    if scrape_error:
        load.errors.append(f"scraper: {scrape_error}")
    quiet = [await asyncio.to_thread(_scrape, backend.url) for _ in range(QUIET_SCRAPES)]
    stop.set()
    seen, frames, dash_error = await asyncio.to_thread(parent_conn.recv)
    dash.join(timeout=10)
    if dash_error:
        load.errors.append(f"dashboard client: {dash_error}")
    no_reply = sum(job.no_reply for job in loads)
    if no_reply:
        load.errors.append(f"{no_reply} ranks got no reply to hello within 30 s")
    errors = [e for job in loads for e in job.errors]
    latencies = _latencies(load.sent_at, seen, wall0, wall1)
    in_window = [n for t, n in frames if wall0 <= t < wall1]

    sent_steps = sum(sum(job.batch) for job in loads)
    sent_records = sent_steps + sum(job.devices_total for job in loads)
    messages, records = sum(job.messages for job in loads), sum(job.records for job in loads)
    counted_rate: float | None = None
    if "rebalancer_ingest_records_total" in c2:
        counted = int(c2["rebalancer_ingest_records_total"] - c_start.get("rebalancer_ingest_records_total", 0.0))
        lost: int | None = sent_records - counted
        source = "rebalancer_ingest_records_total (steps + device samples)"
        if "rebalancer_ingest_records_total" in c0:
            counted_rate = (c1["rebalancer_ingest_records_total"] - c0["rebalancer_ingest_records_total"]) / elapsed
    else:
        rest = sum(_rest_steps(backends[j % len(backends)], job.job) or 0 for j, job in enumerate(loads))
        counted = rest
        lost = sent_steps - rest
        sent_records = sent_steps
        source = "REST /ranks newest batch index (step records only)"
    return CapacityResult(
        ranks=ranks,
        seconds=round(elapsed, 2),
        target_rank_steps_per_s=ranks * load.per_msg / load.interval,
        sent_messages_per_s=round(messages / elapsed, 1),
        sent_rank_steps_per_s=round(records / elapsed, 1),
        counted_records_per_s=None if counted_rate is None else round(counted_rate, 1),
        records_sent=sent_records,
        records_counted=counted,
        records_lost=lost,
        loss_source=source,
        backend_cpu_pct=round(100.0 * sum(cpu_s) / elapsed, 1),
        generator_cpu_pct=round(100.0 * cpu_g / elapsed, 1),
        dashboard_client_cpu_pct=round(100.0 * cpu_d / elapsed, 1),
        latency_p50_ms=_round(_pct(latencies, 50)),
        latency_p99_ms=_round(_pct(latencies, 99)),
        latency_samples=len(latencies),
        dashboard_frames=len(in_window),
        dashboard_bytes_per_s=round(sum(in_window) / elapsed, 1),
        send_lag_p99_ms=_round(_pct([x * 1000 for x in (lag for job in loads for lag in job.lags)], 99)) or 0.0,
        scrapes=len(scraped),
        scrape_p50_ms=_round(_pct([x[0] for x in scraped], 50)),
        scrape_max_ms=_round(max((x[0] for x in scraped), default=None)),
        scrape_quiet_ms=_round(statistics.median(x[0] for x in quiet)),
        scrape_bytes=quiet[-1][1],
        scrape_series=quiet[-1][2],
        errors=errors,
        node_size=node_size,
        frames="node" if packed else "rank",
        steps_per_s=load.per_msg / load.interval,
        hook_sockets=sockets,
        replicas=len(backends),
        jobs=jobs,
        replica_cpu_pct=[round(100.0 * c / elapsed, 1) for c in cpu_s],
        replica_sockets=replica_sockets,
        redis_cpu_pct=round(100.0 * (svc1["redis"] - svc0["redis"]) / elapsed, 1) if cluster else None,
        postgres_cpu_pct=round(100.0 * (svc1["postgres"] - svc0["postgres"]) / elapsed, 1) if cluster else None,
        ranks_connected=connected,
        connect_s=round(connect_s, 2),
        hellos_per_s=round(connected / connect_s, 1) if connect_s > 0 else None,
        connect_replica_cpu_s=[round(c, 2) for c in connect_cpu_s],
        backend_cpu_ms_per_hello=round(1000 * sum(connect_cpu_s) / connected, 3) if connected else None,
        load_avg_start=[round(x, 2) for x in load_avg_start],
        load_avg_window=[round(x, 2) for x in load_avg_window],
        rank_steps_per_backend_core_s=(round(records / (sum(cpu_s) or 1e-9)) if sum(cpu_s) else None),
    )


def _hook_sockets(backend: Backend) -> int | None:
    try:
        with urllib.request.urlopen(backend.url + "/healthz", timeout=10) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):
        return None
    n = body.get("hook_sockets")
    return n if isinstance(n, int) else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def run_capacity(
    ranks_list: list[int], *, seconds: float = 15.0, warmup: float = 3.0,
    out_dir: Path = RESULTS_DIR, name: str = "capacity", backend: Backend | None = None,
    plot: bool = True, node_size: int = 1, steps_per_s: float = STEPS_PER_S, replicas: int = 1,
    jobs: int | None = None, frames: str = "node", connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> list[CapacityResult]:
    """Run the load for each world size against fresh backends per size (or against
    ``backend`` for all); write ``<name>.json``. ``node_size`` ranks share a websocket.
    ``replicas`` > 1 starts that many backends on a fresh PostgreSQL schema and Redis
    prefix (docs/scale-out.md) and splits the ranks into ``jobs`` jobs (default: one per
    replica), job j connecting to replica j % replicas."""
    if not 1 <= node_size <= 256:
        raise ValueError(f"node_size must be between 1 and 256 (MAX_RANKS_PER_CONNECTION), got {node_size}.")
    if not 0.01 <= steps_per_s <= 1000:
        raise ValueError(f"steps_per_s must be between 0.01 and 1000, got {steps_per_s}.")
    if not 1 <= replicas <= 16:
        raise ValueError(f"replicas must be between 1 and 16, got {replicas}.")
    jobs = replicas if jobs is None else jobs
    if not 1 <= jobs <= min(ranks_list):
        raise ValueError(f"jobs must be between 1 and the smallest world size ({min(ranks_list)}), got {jobs}.")
    if backend is not None and replicas > 1:
        raise ValueError("a given backend is one replica: leave replicas at 1.")
    results: list[CapacityResult] = []
    for n in ranks_list:
        if backend is not None:
            results.append(asyncio.run(_run_one([backend], n, seconds, warmup, node_size, steps_per_s, jobs, frames, connect_timeout_s)))
            continue
        if replicas > 1:
            with running_cluster(replicas) as fresh:
                results.append(asyncio.run(_run_one(fresh, n, seconds, warmup, node_size, steps_per_s, jobs, frames, connect_timeout_s)))
            continue
        with running_backend() as one:
            results.append(asyncio.run(_run_one([one], n, seconds, warmup, node_size, steps_per_s, jobs, frames, connect_timeout_s)))
    rows = [[
        r.ranks, r.node_size, r.hook_sockets if r.hook_sockets is not None else "-", r.sent_messages_per_s, r.sent_rank_steps_per_s,
        "-" if r.counted_records_per_s is None else r.counted_records_per_s,
        "-" if r.records_lost is None else r.records_lost,
        r.backend_cpu_pct, r.generator_cpu_pct, round(r.dashboard_frames / max(r.seconds, 1e-9), 1),
        "-" if r.latency_p50_ms is None else r.latency_p50_ms,
        "-" if r.latency_p99_ms is None else r.latency_p99_ms,
    ] for r in results]
    print_table(
        f"Backend capacity (simulated hooks, {results[0].steps_per_s:g} steps/s per rank)" if results else
        "Backend capacity",
        ["ranks", "ranks/socket", "sockets", "msg/s", "rank-steps/s", "counted rec/s", "lost", "backend CPU %",
         "generator CPU %", "dash frames/s", "dash p50 ms", "dash p99 ms"],
        rows,
    )
    print_table(
        "Prometheus scrape of /metrics (under the load above, and once the hooks stopped)",
        ["ranks", "scrapes", "p50 ms", "max ms", "quiet ms", "kB", "series"],
        [[r.ranks, r.scrapes, "-" if r.scrape_p50_ms is None else r.scrape_p50_ms,
          "-" if r.scrape_max_ms is None else r.scrape_max_ms,
          "-" if r.scrape_quiet_ms is None else r.scrape_quiet_ms,
          "-" if r.scrape_bytes is None else round(r.scrape_bytes / 1024, 1),
          "-" if r.scrape_series is None else r.scrape_series] for r in results],
    )
    if replicas > 1:
        print_table(
            f"Per replica ({replicas} backends, PostgreSQL and Redis shared; {jobs} jobs, job j on replica j % {replicas})",
            ["ranks", "sockets per replica", "replica CPU %", "Redis CPU %", "PostgreSQL CPU %", "counted rec/s per backend core"],
            [[r.ranks, " / ".join(str(n) for n in r.replica_sockets), " / ".join(f"{c:g}" for c in r.replica_cpu_pct), r.redis_cpu_pct, r.postgres_cpu_pct,
              "-" if not r.counted_records_per_s or not r.backend_cpu_pct
              else round(r.counted_records_per_s / (r.backend_cpu_pct / 100.0))] for r in results],
        )
    print_table(
        "Connect phase (every rank's hello answered) and the machine's load average (uptime)",
        ["ranks", "connected", "connect s", "hellos/s", "backend CPU ms/hello", "rank-steps per backend core-s",
         "load at start", "load at window end"],
        [[r.ranks, r.ranks_connected, "-" if r.connect_s is None else r.connect_s,
          "-" if r.hellos_per_s is None else r.hellos_per_s,
          "-" if r.backend_cpu_ms_per_hello is None else r.backend_cpu_ms_per_hello,
          "-" if r.rank_steps_per_backend_core_s is None else r.rank_steps_per_backend_core_s,
          " ".join(f"{x:g}" for x in r.load_avg_start), " ".join(f"{x:g}" for x in r.load_avg_window)]
         for r in results],
    )
    write_json(out_dir / f"{name}.json", {
        "command": "python -m bench.capacity " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("capacity.py") else None,
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu_count": os.cpu_count(),
        "steps_per_s_per_rank": results[0].steps_per_s if results else STEPS_PER_S, "flush_s": FLUSH_S,
        "node_size": node_size, "replicas": replicas, "jobs": jobs,
        "results": [asdict(r) for r in results],
    })
    if plot:
        from bench._plots import plot_capacity

        plot_capacity(results, out_dir / f"{name}.png")
    return results


@dataclass
class ScrapeCost:
    """The exporter alone, in process: ``generate_latest`` over a backend's parts holding
    one job of ``ranks`` GPU ranks (20 steps and an NVML sample each, controller state)."""

    ranks: int
    series: int
    bytes: int
    wall_ms_median: float
    cpu_ms_median: float  # this process's CPU time: what one scrape costs the backend
    repeats: int


# --scrape-only --comm: what a step record and a device sample add when the hook measures
# communication and the node's links.
_COMM_FIELDS = ',"comm_bytes":2000000000,"comm_ms":{c:.3f}'
_LINKS = (',"nic_tx_bytes_per_s":1.2e10,"nic_rx_bytes_per_s":1.1e10,"ib_tx_bytes_per_s":4.5e10,'
          '"ib_rx_bytes_per_s":4.4e10,"pcie_tx_bytes_per_s":2e10,"pcie_rx_bytes_per_s":1.9e10,'
          '"nvlink_tx_bytes_per_s":3e11,"nvlink_rx_bytes_per_s":2.9e11}}')


def scrape_cost(ranks: int, repeats: int = 7, rank_series: str = "slowest", gone: float = 0.0,
                comm: bool = False) -> ScrapeCost:
    """``gone``: the share of nodes whose ranks are lost (their connections dropped) while the
    others run on; ``comm``: step records with communication and device samples with link
    throughput."""
    import tempfile

    from backend.parts import build_parts
    from backend.settings import Settings
    from rebalancer_wire.protocol import decode

    async def fill(parts: Any) -> None:
        job, gbs = f"scrape-{ranks}", ranks * 8
        for r in range(ranks):
            hello = decode(json.dumps({
                "type": "hello", "v": 1, "job": job, "rank": r, "world_size": ranks,
                "global_batch_size": gbs, "host": f"node{r // 8}", "device_type": "H100",
                "device_name": "NVIDIA H100 80GB HBM3", "gpu_index": r % 8,
                "gpu_uuid": f"GPU-{r:08d}-0000-0000-0000-000000000000"}))
            parts.live.register(hello)
            await parts.controller.on_hello(hello)
            now = time.time()
            recs = ",".join(
                _RECORD.format(k=k, b=8, c=20.0 + r % 7, t=now - (19 - k) / STEPS_PER_S)[:-1]
                + (_COMM_FIELDS.format(c=5.0 + r % 3) if comm else "") + "}" for k in range(20))
            dev = _DEVICE.format(t=now)
            if comm:
                dev = dev[:-1] + _LINKS.format()
            parts.live.add_metrics(decode(
                f'{{"type":"metrics","v":{2 if comm else 1},"job":"{job}","rank":{r},"dropped":0,"steps":[{recs}],'
                f'"device":[{dev}]}}'))
        nodes = ranks // 8
        for r in range(ranks):
            if (r // 8) < nodes * gone:
                parts.live.set_connected(job, r, False, lost=True)

    with tempfile.TemporaryDirectory(prefix="rb-scrape-") as tmp:
        parts = build_parts(Settings(db=f"sqlite:///{tmp}/scrape.db", policy_process=False,
                                     metrics_rank_series=rank_series))  # type: ignore[arg-type]
        try:
            asyncio.run(fill(parts))
            walls, cpus, body = [], [], b""
            for _ in range(repeats):
                w, c = time.perf_counter(), time.process_time()
                body = parts.exporter.exposition().encode()
                cpus.append((time.process_time() - c) * 1000)
                walls.append((time.perf_counter() - w) * 1000)
        finally:
            parts.sql.close()
            parts.engine.dispose()
    series = sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))
    return ScrapeCost(ranks=ranks, series=series, bytes=len(body), wall_ms_median=round(statistics.median(walls), 1),
                      cpu_ms_median=round(statistics.median(cpus), 1), repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default=None, help="comma-separated world sizes")
    ap.add_argument("--seconds", type=float, default=None, help="measured window per size")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="smoke-test size")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--node-size", type=int, default=1,
                    help="ranks per hook websocket (8: node connections of 8-GPU nodes); 1: one per rank")
    ap.add_argument("--frames", choices=("node", "rank"), default="node",
                    help="with --node-size > 1: one node_metrics frame per node per flush (node, as the node "
                         "agent sends), or one metrics frame per rank on the node's socket (rank, older agents)")
    ap.add_argument("--steps-per-s", type=float, default=STEPS_PER_S, help="steps a second per rank")
    ap.add_argument("--name", default=None, help="result file name (default capacity, or capacity-nodeN)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="backend processes on PostgreSQL (127.0.0.1:5432/test) and Redis (127.0.0.1:6379)")
    ap.add_argument("--jobs", type=int, default=None, help="jobs the ranks are split into (default: one per replica)")
    ap.add_argument("--connect-timeout-s", type=float, default=CONNECT_TIMEOUT_S,
                    help="stop waiting for hellos after this long and measure the ranks connected (an error says so)")
    ap.add_argument("--scrape-only", action="store_true",
                    help="only the exporter's cost in process (scrape.json): no sockets, no load")
    ap.add_argument("--rank-series", choices=("slowest", "all"), default="slowest",
                    help="--scrape-only: REBALANCER_METRICS_RANK_SERIES of the measured backend")
    ap.add_argument("--gone", type=float, default=0.0,
                    help="--scrape-only: share of the nodes whose ranks are lost while the others run")
    ap.add_argument("--comm", action="store_true",
                    help="--scrape-only: step records with communication, device samples with link throughput")
    args = ap.parse_args(argv)
    if args.scrape_only:
        costs = [scrape_cost(n, rank_series=args.rank_series, gone=args.gone, comm=args.comm) for n in ([int(x) for x in args.ranks.split(",")] if args.ranks else [1024])]
        print_table("/metrics exposition in process (median of the repeats)",
                    ["ranks", "series", "kB", "wall ms", "CPU ms"],
                    [[c.ranks, c.series, round(c.bytes / 1024, 1), c.wall_ms_median, c.cpu_ms_median] for c in costs])
        write_json(args.out / "scrape.json", {"results": [asdict(c) for c in costs]})
        return 0
    if args.tiny:
        ranks, secs, warm = [4], 1.0, 1.0
    elif args.quick:
        ranks, secs, warm = [8, 256], 4.0, 1.0
    else:
        ranks, secs, warm = [8, 64, 256, 1024], 15.0, 3.0
    if args.ranks:
        ranks = [int(x) for x in args.ranks.split(",")]
    if args.seconds:
        secs = args.seconds
    name = args.name or ("capacity" if args.node_size == 1 else f"capacity-node{args.node_size}")
    if args.replicas > 1 and not args.name:
        name += f"-r{args.replicas}"
    if args.frames == "rank" and args.node_size > 1 and not args.name:
        name += "-rankframes"
    try:
        run_capacity(ranks, seconds=secs, warmup=warm, out_dir=args.out, name=name, node_size=args.node_size,
                     steps_per_s=args.steps_per_s, replicas=args.replicas, jobs=args.jobs, frames=args.frames,
                     connect_timeout_s=args.connect_timeout_s)
    except ValueError as exc:
        ap.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
