"""Memory caps and an out-of-memory error on the device, end to end: a real backend and two
torchrun ranks sharing one GPU (tests/gpu/_memory_worker.py). Rank 0's allocator is
limited to 2.2 GB: a manual placement above its cap is refused; forced, it runs the rank
out of memory for real, which the rank reports before dying; the backend rolls back, caps
the rank below the failing share and never offers that share again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.backend.test_e2e_control import ADMIN, ENV, call, wait_for
from tests.gpu._rig import Rig, write_fact
from tests.helpers.server import running_server
from tests.helpers.torchrun import REPO_ROOT, running_torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]
WORKER = os.path.join(REPO_ROOT, "tests", "gpu", "_memory_worker.py")
GB = 10**9


def test_placement_over_the_cap_is_refused_and_a_real_oom_is_reported_once(rig: Rig, tmp_path: Path) -> None:
    name = "gpu-memory-oom"
    memory = f"{22 * GB // 10}:{GB}:{GB // 10},{8 * GB}:{GB}:{GB // 10}"
    env = {**ENV, "REBALANCER_DEFAULT_MODE": "approve"}
    with running_server(tmp_path, env=env) as server, running_torchrun(2, [
            WORKER, "--server", server.url, "--job", name, "--token", ADMIN, "--global-batch-size", "16",
            "--memory", memory], max_restarts=1) as (proc, out):
        base = f"/api/v1/jobs/{name}"
        wait_for("rank 0's memory fit", lambda: (
            (r := call(server, "GET", f"{base}/memory", ADMIN))[0] == 200 and r[1]["data"]
            and r[1]["data"][0]["status"] == "fitted"), proc=proc, log=out)
        status, body = call(server, "POST", f"{base}/proposals", ADMIN, {"shares": [13, 3], "apply": True})
        assert status == 422, body
        refused = body["detail"]
        assert refused.startswith("Placement breaks memory caps: rank 0 would peak at "), refused
        assert refused.endswith("Send force=true to submit it anyway."), refused
        status, body = call(server, "POST", f"{base}/proposals", ADMIN,
                            {"shares": [13, 3], "apply": True, "force": True, "reason": "gpu check"})
        assert status == 201, body
        forced = body["placement_version"]
        audit = wait_for("the out-of-memory report", lambda: [
            a for a in call(server, "GET", f"{base}/audit", ADMIN)[1]["data"] if a["action"] == "placement.oom"],
            log=out)
        assert len(audit) == 1 and audit[0]["params"]["rank"] == 0, audit
        assert audit[0]["params"]["local_batch_size"] == 13 and "out of memory" in audit[0]["reason"], audit
        placements = call(server, "GET", f"{base}/placements", ADMIN)[1]["data"]
        unsafe = next(p for p in placements if p["version"] == forced)
        assert unsafe["failed"] and unsafe["error"].startswith("unsafe: rank 0 ran out of memory at 13 samples")
        back = max(placements, key=lambda p: p["version"])
        assert back["version"] > forced and back["source"] == "rollback" and back["shares"][0] < 13, back
        caps = call(server, "GET", f"{base}/overrides", ADMIN)[1]["caps"]
        assert 0 < caps["0"] < 13, caps
        wait_for("steps of the restarted job under the rolled-back placement", lambda: [
            p for p in call(server, "GET", f"{base}/metrics?source=live&rank=0", ADMIN)[1]["data"]
            if p["placement_version"] == back["version"]], proc=proc, log=out)
        # Never repeated: the failing share is refused again, and no second report came.
        status, body = call(server, "POST", f"{base}/proposals", ADMIN, {"shares": [13, 3], "force": True})
        assert status == 422 and f"capped at {caps['0']} samples" in body["detail"], body
        ooms = [a for a in call(server, "GET", f"{base}/audit", ADMIN)[1]["data"] if a["action"] == "placement.oom"]
        assert len(ooms) == 1, ooms
        write_fact("memory_caps", {"device": rig.kind, "refused": refused, "oom_reason": audit[0]["reason"][:300],
                                   "rollback_shares": back["shares"], "caps": caps})
