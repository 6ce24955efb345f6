"""End to end: memory caps and out-of-memory reactions with a real backend (uvicorn) and
real torchrun/gloo ranks whose device memory comes from the fake allocator behind the
hook's memory-source seam (tests.helpers.fake_memory, the only fake).

- A fast rank with little memory is capped below its speed-optimal share, and the
  proposal says so; its fit and cap are on REST.
- A manual placement over a memory cap is refused with the predicted peak and the cap;
  forced, it runs the rank out of memory: the rank reports it before dying, the backend
  marks the placement unsafe, caps the rank below the failing share and rolls back, and
  the job restarted by torchrun trains under the rolled-back placement.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.backend.test_e2e_control import ADMIN, ENV, call, wait_for
from tests.helpers.server import running_server
from tests.helpers.torchrun import REPO_ROOT, running_torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

WORKER = os.path.join(REPO_ROOT, "tests", "backend", "_memory_worker.py")
GB = 10**9


def memory_job(url: str, name: str, *, b: int, speeds: str, memory: str,
               max_restarts: int = 0) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[str], list[str]]]:
    return running_torchrun(len(speeds.split(",")), [
        WORKER, "--server", url, "--job", name, "--token", ADMIN, "--global-batch-size", str(b),
        "--speeds", speeds, "--memory", memory, "--per-sample-ms", "1.0"], max_restarts=max_restarts)


def memory_of(server: Any, name: str) -> list[dict[str, Any]] | None:
    status, body = call(server, "GET", f"/api/v1/jobs/{name}/memory", ADMIN)
    return body["data"] if status == 200 else None


def test_fast_rank_with_little_memory_is_capped_below_its_speed_share(tmp_path: Path) -> None:
    # Rank 0 computes 4x faster: speed alone gives it about 28-32 of 48. Its card holds 4.7 GB; a
    # step takes 1 GB + 0.1 GB per sample. At the uniform 16 the fit is proportional
    # (0.1625 GB per sample), so the cap is floor(0.9 * 4.7 / 0.1625) = 26.
    name = "e2e-memory-cap"
    memory = f"{47 * GB // 10}:{GB}:{GB // 10},{80 * GB}:{GB}:{GB // 10},{80 * GB}:{GB}:{GB // 10}"
    with running_server(tmp_path, env=ENV) as server, \
            memory_job(server.url, name, b=48, speeds="4,1,1", memory=memory) as (proc, out):
        base = f"/api/v1/jobs/{name}"
        prop = wait_for("a proposal", lambda: (
            (r := call(server, "GET", f"{base}/proposals?status=proposed", ADMIN))[0] == 200
            and r[1]["count"] and r[1]["data"][0]), proc=proc, log=out)
        # Ranks 1 and 2 are alike and split the rest by their measured speed: 11 each on a quiet
        # machine; a proposal made from the first few steps on a loaded one (CI) gave 13 and 9.
        assert prop["shares"][0] == 26 and sum(prop["shares"]) == 48 and min(prop["shares"][1:]) >= 8, prop
        assert "rank 0 is capped at 26 samples by memory" in prop["reason"], prop["reason"]
        assert "; speed alone would give it " in prop["reason"], prop["reason"]
        r0 = prop["explanation"]["ranks"][0]
        assert r0["mem_cap"] == 26 and r0["mem_peak_after_bytes"] <= r0["mem_limit_bytes"]
        assert r0["mem_peak_before_bytes"] == pytest.approx(2.6 * GB)
        capped = prop["explanation"]["evidence"]["memory_capped"]
        assert capped[0]["rank"] == 0 and capped[0]["speed_share"] > 26
        mem = memory_of(server, name)
        assert mem is not None
        assert (mem[0]["status"], mem[0]["method"], mem[0]["cap"]) == ("fitted", "proportional", 26)
        assert mem[0]["source"] == "cuda" and mem[0]["total_bytes"] == 47 * GB // 10
        assert mem[1]["cap"] > 48 - 26 and mem[0]["last_peak_bytes"] == int(2.6 * GB)


def test_oom_is_reported_and_the_restarted_job_runs_the_previous_placement(tmp_path: Path) -> None:
    # Rank 0's card holds 2.2 GB: 13 samples (2.3 GB) run it out of memory.
    name = "e2e-memory-oom"
    memory = f"{22 * GB // 10}:{GB}:{GB // 10},{80 * GB}:{GB}:{GB // 10}"
    env = {**ENV, "REBALANCER_DEFAULT_MODE": "approve"}
    with running_server(tmp_path, env=env) as server, \
            memory_job(server.url, name, b=16, speeds="1,1", memory=memory, max_restarts=1) as (proc, out):
        base = f"/api/v1/jobs/{name}"
        wait_for("rank 0's memory fit", lambda: (m := memory_of(server, name)) and m[0]["status"] == "fitted",
                 proc=proc, log=out)
        # Over the cap (proportional fit at 8: 0.225 GB a sample, cap floor(1.98 / 0.225) = 8).
        status, body = call(server, "POST", f"{base}/proposals", ADMIN, {"shares": [13, 3], "apply": True})
        assert status == 400, body
        assert body["detail"] == (
            "Placement breaks memory caps: rank 0 would peak at 2.7 GiB with 13 samples, above its "
            "limit of 1.8 GiB (90% of 2.0 GiB); its memory cap is 8 samples. Send force=true to "
            "submit it anyway.")
        status, body = call(server, "POST", f"{base}/proposals", ADMIN,
                            {"shares": [13, 3], "apply": True, "force": True, "reason": "try it"})
        assert status == 201, body
        forced = body["placement_version"]
        # Rank 0 runs out of memory at 13 samples, reports it, dies; torchrun restarts the job.
        audit = wait_for("the out-of-memory report", lambda: [
            a for a in call(server, "GET", f"{base}/audit", ADMIN)[1]["data"] if a["action"] == "placement.oom"],
            log=out)
        assert audit[0]["params"]["rank"] == 0 and audit[0]["params"]["local_batch_size"] == 13
        assert "CUDA out of memory" in audit[0]["reason"]
        actions = [a["action"] for a in call(server, "GET", f"{base}/audit", ADMIN)[1]["data"]]
        assert "placement.memory_force" in actions and "placement.oom_rollback" in actions
        placements = call(server, "GET", f"{base}/placements", ADMIN)[1]["data"]
        unsafe = next(p for p in placements if p["version"] == forced)
        assert unsafe["failed"] and unsafe["error"].startswith("unsafe: rank 0 ran out of memory at 13 samples")
        back = max(placements, key=lambda p: p["version"])
        assert back["version"] > forced and back["shares"] == [8, 8] and back["source"] == "rollback"
        assert call(server, "GET", f"{base}/overrides", ADMIN)[1]["caps"] == {"0": 12}
        # The restarted ranks say hello, get the rolled-back placement and train under it.
        wait_for("steps of the restarted job under the rolled-back placement", lambda: [
            p for p in call(server, "GET", f"{base}/metrics?source=live&rank=0", ADMIN)[1]["data"]
            if p["placement_version"] == back["version"]], proc=proc, log=out)
        assert any("attempt 1 starts" in line for line in out), "".join(out)
        # The policy never offers rank 0 the failing share again.
        status, body = call(server, "POST", f"{base}/proposals", ADMIN, {"shares": [13, 3], "force": True})
        assert status == 400 and "capped at 12 samples" in body["detail"], body
