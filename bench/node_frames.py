"""Node frames: bytes per rank-step on the wire, and what one core ingests.

Bytes: a node of 8 ranks, one flush: the ``node_metrics`` frame the node agent sends
(rebalancer_wire/node.py) against the 8 ``metrics`` frames it replaced, per rank-step; for a
plain step record, for one with every mesh, communication, token and phase field a hook
sends (values as a hook measures them: full-precision floats), and for the ~1 Hz device
sample. The frames are built with the hook's own encoder (``Metrics`` -> ``NodeMetrics.pack``).

Ingest per core: one process (this one) runs the backend's hot road on the frames of
``--ranks`` ranks for ``--seconds`` of CPU time: decode and check the frame
(``decode_frame``, ``check_against``), fold it into live state
(``LiveState.add_node_metrics``), and every second of simulated time take the persistence
windows and aggregate them (``take_pending``, ``aggregate_windows``). Reported: rank-steps
per CPU second (process time, so a busy machine slows the run but not the figure much), at
1 and 10 steps a second per rank, with a device sample per rank each simulated second.
The websocket, the dashboard and the controller are not in it: ``bench.capacity`` measures
the whole server.

    python -m bench.node_frames [--ranks 4096] [--seconds 5]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from backend.live.state import LiveState
from backend.live.windows import aggregate_windows
from bench._report import RESULTS_DIR, print_table, write_json
from rebalancer_wire.node import NodeMetrics, decode_frame, encode_node
from rebalancer_wire.protocol import DeviceSample, Hello, Metrics, StepRecord, encode

__all__ = ["frame_bytes", "ingest_rate", "main"]

NODE = 8


def _step(rng: random.Random, k: int, t: float, full: bool) -> StepRecord:
    ms = [rng.uniform(0.05, 400.0) for _ in range(5)]
    rec = StepRecord(batch_index=k, local_batch_size=rng.randint(8, 64), placement_version=3,
                     data_wait_ms=ms[0], compute_ms=ms[1], sync_wait_ms=ms[2], optimizer_ms=ms[3],
                     step_ms=sum(ms[:4]) + ms[4], t=t)
    if full:
        rec.comm_bytes, rec.comm_ms = rng.randint(10**8, 10**10), rng.uniform(1.0, 300.0)
        rec.work, rec.batch_work = float(rng.randint(10**4, 10**6)), float(rng.randint(10**7, 10**8))
        rec.work_sq, rec.batch_work_sq = rng.uniform(1e9, 1e12), rng.uniform(1e12, 1e15)
        rec.slowest_rank = rng.randint(0, 4095)
        rec.host_ms, rec.ckpt_ms = ms[0] * 0.3, ms[0] * 0.1
        rec.gc_ms = (rng.uniform(0, 1), 0.0, 0.0)
        rec.mem_peak_bytes, rec.mem_reserved_bytes, rec.mem_total_bytes = 61_234_567_890, 70_123_456_789, 85_899_345_920
    return rec


def _device(rng: random.Random, t: float) -> DeviceSample:
    return DeviceSample(t=t, source="nvml", util_pct=rng.uniform(80, 100), mem_used_bytes=rng.randint(10**10, 8 * 10**10),
                        mem_total_bytes=85_899_345_920, power_w=rng.uniform(300, 700), temp_c=float(rng.randint(40, 85)),
                        sm_clock_mhz=1755.0, sm_clock_max_mhz=1980.0, throttle_reasons=["sw_power_cap"],
                        nvlink_tx_bytes_per_s=rng.uniform(1e9, 1e11), nvlink_rx_bytes_per_s=rng.uniform(1e9, 1e11))


def _frames(job: str, ranks: range, k: int, steps: int, t: float, *, full: bool, device: bool,
            rng: random.Random) -> list[Metrics]:
    return [Metrics(job=job, rank=r, steps=[_step(rng, k + j, t - (steps - 1 - j) * 0.1, full) for j in range(steps)],
                    device=[_device(rng, t)] if device else []) for r in ranks]


@dataclass
class FrameBytes:
    record: str
    node_bytes_per_rank_step: float
    rank_frame_bytes_per_rank_step: float


def frame_bytes(seed: int = 0) -> list[FrameBytes]:
    """Bytes per rank-step of an 8-rank node's flush, packed and as per-rank frames."""
    rng = random.Random(seed)
    t = time.time()
    out = []
    for name, full, device in (("plain step record", False, False),
                               ("with mesh, comm, token, phase and memory fields", True, False),
                               ("device sample (~1 Hz, per rank-sample)", False, True)):
        frames = _frames("bytes", range(NODE), 100, 1, t, full=full, device=device, rng=rng)
        if device:  # the sample alone: the frames' step records are taken out of both sides
            frames = [Metrics(job=m.job, rank=m.rank, device=m.device) for m in frames]
        node = len(encode_node(NodeMetrics.pack("bytes", frames)))
        per_rank = sum(len(encode(m)) for m in frames)
        out.append(FrameBytes(name, round(node / NODE, 1), round(per_rank / NODE, 1)))
    return out


@dataclass
class IngestRate:
    ranks: int
    steps_per_s: float
    frames: int
    rank_steps: int
    cpu_s: float
    rank_steps_per_cpu_s: float
    records_per_cpu_s: float  # steps + device samples


def ingest_rate(ranks: int, steps_per_s: float, seconds: float, seed: int = 0) -> IngestRate:
    """Node frames of ``ranks`` ranks (8 a node), one flush per simulated second holding
    ``steps_per_s`` steps and one device sample per rank, through decode, checks, the fold
    and the windows, until ``seconds`` of this process's CPU time are spent."""
    rng = random.Random(seed)
    job = f"core-{ranks}"
    live = LiveState()
    hellos = {r: Hello(job=job, rank=r, world_size=ranks, global_batch_size=ranks * 64) for r in range(ranks)}
    for h in hellos.values():
        live.register(h)
    per = max(1, round(steps_per_s))
    # A minute of distinct frames, prebuilt (the hook's work, not the backend's), replayed with
    # fresh batch indices and times by re-encoding only their headers' columns.
    t0 = time.time() - 60
    texts = []
    for s in range(4):
        for n0 in range(0, ranks, NODE):
            frames = _frames(job, range(n0, min(n0 + NODE, ranks)), 1 + s * per, per, t0 + s, full=False, device=True, rng=rng)
            texts.append(encode_node(NodeMetrics.pack(job, frames)))
    last = {r: 0 for r in range(ranks)}
    done = frames_n = 0
    c0 = time.process_time()
    i = 0
    while time.process_time() - c0 < seconds:
        raw = texts[i % len(texts)]
        i += 1
        msg, _ = decode_frame(raw)
        assert isinstance(msg, NodeMetrics)
        bad = msg.check_against(hellos, time.time(), last)
        if bad:
            raise RuntimeError(f"the bench's own frames were refused: {next(iter(bad.values()))}")
        live.add_node_metrics(msg)
        done += sum(msg.n_steps)
        frames_n += 1
        if frames_n % max(1, ranks // NODE) == 0:  # a simulated second: the persistence flush
            aggregate_windows(live.take_pending())
    cpu = time.process_time() - c0
    records = done + done // per
    return IngestRate(ranks, steps_per_s, frames_n, done, round(cpu, 2), round(done / cpu), round(records / cpu))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=5.0, help="CPU seconds per rate")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    sizes = frame_bytes()
    print_table("Bytes per rank-step on the wire (an 8-rank node's flush)",
                ["record", "node_metrics B", "per-rank metrics B"],
                [[b.record, b.node_bytes_per_rank_step, b.rank_frame_bytes_per_rank_step] for b in sizes])
    rates = [ingest_rate(args.ranks, sps, args.seconds) for sps in (1.0, 10.0)]
    print_table(f"Ingest per core (one process, {args.ranks} ranks, node frames of {NODE}, a device sample per "
                "rank each second)", ["steps/s per rank", "frames", "rank-steps", "CPU s", "rank-steps / CPU s",
                                      "records / CPU s"],
                [[r.steps_per_s, r.frames, r.rank_steps, r.cpu_s, r.rank_steps_per_cpu_s, r.records_per_cpu_s]
                 for r in rates])
    write_json(args.out / "node_frames.json", {"bytes": [asdict(b) for b in sizes], "ingest": [asdict(r) for r in rates]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
