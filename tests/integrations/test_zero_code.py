"""`rebalancer run -- torchrun ...`: plain DDP, FSDP2, HF Trainer and Accelerate scripts with no
rebalancer import are monitored by a real backend; a broken injection changes neither its output nor
its exit code (trainer_hook.zero_code, trainer_hook/_site/sitecustomize.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.run_cmd import job_name_for, site_dir
from tests.helpers.ports import free_port
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, job_env, torchrun_cmd

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiproc]

SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_ddp_job.py")
STEPS = 120  # per rank: 8 samples each, 16 a global batch


def _torchrun(steps: int = STEPS, code: int = 0, slow_ms: int = 0) -> list[str]:
    return torchrun_cmd(2, [SCRIPT, str(steps), str(code), str(slow_ms)])


def _stdout_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("final loss")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with running_server(tmp_path_factory.mktemp("zero_code")) as s:
        yield s


@pytest.fixture(scope="module")
def baseline() -> subprocess.CompletedProcess[str]:
    """What the script alone, no injection, prints and returns: what every run below must too.
    The two ranks' math in this process (no torchrun start of its own): DDP averages the
    ranks' gradients as g0 / 2 + g1 / 2, exact in float64, so the loss is the script's to
    the last bit; each worker exits with 3, which torchrun reports as its own failure, 1."""
    import torch

    g = torch.Generator().manual_seed(0)
    xs = torch.randn(STEPS * 16, 8, generator=g, dtype=torch.float64)
    ys = torch.randn(STEPS * 16, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for k in range(STEPS):  # DistributedSampler, no shuffle: rank r takes every second sample from r
        grads = []
        for r in (0, 1):
            idx = torch.arange(16 * k + r, 16 * (k + 1), 2)
            loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
            if r == 0:
                loss0 = loss
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = g0 / 2 + g1 / 2
        opt.step()
        opt.zero_grad()
    return subprocess.CompletedProcess([SCRIPT], 1, f"final loss {loss0.item():.12f}\n", "")


def test_rebalancer_run_monitors_a_plain_ddp_script_live(server: Server, baseline):
    # Rank 1 computes 30 ms longer each step (a sleep before backward; the math is the
    # baseline's): rank 0 waits for it inside the gradient all-reduce.
    cmd = [sys.executable, "-m", "backend", "run", "--server", server.url, "--job", "plain",
           "--", *_torchrun(code=3, slow_ms=30)]
    proc = subprocess.Popen(cmd, env=job_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    live = 0
    try:
        while proc.poll() is None:  # the ranks show up while the script trains
            status, body = server.call("GET", "/api/v1/jobs/plain/ranks")
            if status == 200:
                live = max(live, sum(r["connected"] for r in body["data"]))
            time.sleep(0.1)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == baseline.returncode, err  # the command's own exit status
    assert _stdout_lines(out) == _stdout_lines(baseline.stdout)
    assert live == 2, err
    ranks = server.get("/api/v1/jobs/plain/ranks")["data"]  # type: ignore[index]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["n_steps"] == STEPS and r["batch_index"] == STEPS - 1
        assert r["local_batch_size"] == 8 and r["placement_version"] == 0
        assert r["step_ms"] > 0 and r["data_wait_ms"] >= 0 and r["device"] is not None
    # Compute vs sync wait without code change: the straggler computes, its peer waits.
    assert ranks[1]["compute_ms"] > ranks[0]["compute_ms"] and ranks[0]["sync_wait_ms"] > ranks[1]["sync_wait_ms"]
    job = server.get("/api/v1/jobs/plain")
    assert job["world_size"] == 2 and job["global_batch_size"] == 16  # type: ignore[index]
    assert job["mode"] == "observe"  # type: ignore[index]
    # What rebalancing would gain (the job page's notice): the policy's proposal, moving
    # work off rank 1, shown and never sent in observe mode.
    proposal = server.get("/api/v1/jobs/plain/proposals")["data"][0]  # type: ignore[index]
    assert job["pending_proposal_id"] == proposal["id"] and proposal["status"] == "proposed"  # type: ignore[index]
    assert proposal["shares"][0] > 8 > proposal["shares"][1] and proposal["predicted_gain"] > 0
    assert job["placement"] == {"version": 0, "shares": [8, 8]}  # type: ignore[index]
    assert "rebalancer: monitoring job 'plain' (2 rank(s), global batch 16)" in err
    assert f"rebalancer run: dashboard: {server.url}/job/plain" in err


FSDP2_SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_fsdp2_job.py")
HF_SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_hf_job.py")
ACCELERATE_SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_accelerate_job.py")


@pytest.mark.parametrize(("job", "script", "framework", "local"), [
    ("fsdp2", [FSDP2_SCRIPT, "12", "30"], "ddp", 8),  # rank 1 computes 30 ms longer a step
    ("hf", [HF_SCRIPT, "{tmp}", "12"], "hf_trainer", 4),
    ("accelerate", [ACCELERATE_SCRIPT, "12", "30"], "accelerate", 8),  # rank 1 30 ms longer a step
], ids=["fsdp2", "hf-trainer", "accelerate"])
def test_rebalancer_run_monitors_fsdp2_hf_trainer_and_accelerate_scripts(server: Server, tmp_path: Path, job, script,
                                                              framework, local):
    # Unchanged scripts: every rank's 12 steps arrive with their data wait, compute and sync
    # wait; the script's own output is all there is on stdout, its exit status is kept.
    cmd = [sys.executable, "-m", "backend", "run", "--server", server.url, "--job", job, "--",
           *torchrun_cmd(2, [a.format(tmp=tmp_path) for a in script])]
    proc = subprocess.run(cmd, env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert [line.split(" ")[:2] for line in proc.stdout.splitlines() if line.startswith("final")] == [
        ["final", "loss"]], proc.stdout
    assert "rebalancer:" not in proc.stdout and "monitoring is off" not in proc.stderr, proc.stderr
    ranks = server.get(f"/api/v1/jobs/{job}/ranks")["data"]  # type: ignore[index]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["hook_version"].endswith(f"observe-only (rebalancer run): {framework}")
        assert r["n_steps"] == 12 and r["batch_index"] == 11 and r["local_batch_size"] == local
        assert r["step_ms"] > 0 and r["compute_ms"] > 0 and r["data_wait_ms"] >= 0
        assert r["step_ms"] >= r["compute_ms"] and r["sync_wait_ms"] >= 0
    if job in ("fsdp2", "accelerate"):  # the straggler's peer waits in the collectives
        assert ranks[1]["compute_ms"] > ranks[0]["compute_ms"] and ranks[0]["sync_wait_ms"] > ranks[1]["sync_wait_ms"]
    assert server.get(f"/api/v1/jobs/{job}")["mode"] == "observe"  # type: ignore[index]


def test_a_broken_injection_leaves_output_and_exit_code_unchanged(baseline):
    # One job, a broken injection on each rank (tests/integrations/_rank_env.py): rank 0's
    # backend is a closed port (the transport retries quietly, training is unchanged); rank 1
    # fails inside the injection (one line, then the script as usual).
    server_url = f"http://127.0.0.1:{free_port()}"
    env = job_env({"PYTHONPATH": site_dir() + os.pathsep + REPO_ROOT, "REBALANCER_MONITOR": "1",
                   "REBALANCER_JOB": "broken", "REBALANCER_SERVER": server_url,
                   "RANK1__REBALANCER_GLOBAL_BATCH_SIZE": "many"})
    cmd = torchrun_cmd(2, [os.path.join(REPO_ROOT, "tests", "integrations", "_rank_env.py"), SCRIPT, str(STEPS), "3"])
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == baseline.returncode, proc.stderr
    assert proc.stdout == baseline.stdout
    # Rank 1 says so once; rank 0 only its usual start line (its transport retries quietly);
    # nothing from torchrun's agent.
    said = sorted(line for line in proc.stderr.splitlines() if "rebalancer:" in line)
    assert said == [
        "rebalancer: monitoring is off for rank 1 (invalid settings: ValueError: "
        "REBALANCER_GLOBAL_BATCH_SIZE='many' is not an integer); training goes on unmonitored",
        f"rebalancer: monitoring job 'broken' (2 rank(s), global batch 16) on {server_url}; observe only",
    ], proc.stderr
    assert "trainer_hook" not in proc.stderr  # no traceback through the injection


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path):
    # Python imports only the first sitecustomize on the path; ours runs the next one.
    user = tmp_path / "site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys\nprint('user sitecustomize ran', file=sys.stderr)\n")
    env = job_env({"PYTHONPATH": site_dir() + os.pathsep + str(user) + os.pathsep + REPO_ROOT,
                   "REBALANCER_MONITOR": "1", "REBALANCER_SERVER": "http://127.0.0.1:1"})
    proc = subprocess.run([sys.executable, "-c", "import sys; print('script'); sys.exit(5)"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (5, "script\n", "user sitecustomize ran\n")


def test_rebalancer_run_refuses_a_missing_command():
    proc = subprocess.run([sys.executable, "-m", "backend", "run", "--job", "x"], env=job_env(), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == ("rebalancer run: give the command to run after --, e.g. rebalancer run -- torchrun "
                           "--nproc-per-node 2 train.py\n")


def test_job_names_come_from_the_script():
    t = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    assert job_name_for(["torchrun", "--nproc-per-node", "2", "path/train.py", "--lr", "1"], t) == "train-030405"
    assert job_name_for(["python", "-m", "pkg.finetune"], t) == "finetune-030405"
    assert job_name_for(["./launch.sh"], t) == "job-030405"


def test_a_failure_inside_a_step_logs_one_line_and_turns_monitoring_off(capsys):
    # In-process: the optimizer hook's own failure never reaches the training loop.
    import torch

    from trainer_hook.zero_code import Monitor

    m = Monitor({"RANK": "1", "WORLD_SIZE": "2", "REBALANCER_SERVER": "http://127.0.0.1:1", "REBALANCER_JOB": "j"})

    m._transport = object()  # sending the step record fails
    m._prev_end = 0.0
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    m._after_optimizer_step(opt, (), {})
    m._after_optimizer_step(opt, (), {})  # off: silent
    assert m.off
    assert capsys.readouterr().err == (
        "rebalancer: monitoring is off for rank 1 (timing a step failed: AttributeError: 'object' object "
        "has no attribute 'put_step'); "
        "training goes on unmonitored\n")


def test_the_monitor_stands_down_when_the_script_has_its_own_hook(capsys):
    # Both would report the same rank of the same job: the script's hook wins.
    import torch

    from trainer_hook import RebalanceHook
    from trainer_hook.zero_code import Monitor

    m = Monitor({"RANK": "0", "WORLD_SIZE": "1", "REBALANCER_SERVER": "http://127.0.0.1:1", "REBALANCER_JOB": "j"})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with RebalanceHook(global_batch_size=4):  # offline, one process
        m._after_optimizer_step(opt, (), {})
    assert m.off and m._transport is None
    err = capsys.readouterr().err  # after the hook's own start line (offline here)
    assert err.startswith("rebalancer: offline, nothing is reported") and err.endswith(
        "\nrebalancer: the script has its own RebalanceHook: the injected monitoring stands down\n"), err


def test_a_step_splits_into_data_optimizer_sync_and_compute():
    # Pure arithmetic on fixed clock readings (seconds): the step 10 -> 11.
    from trainer_hook.zero_code import split_step

    # DDP: last gradient at 10.5, optimizer from 10.8: 0.3 s waited for the all-reduce.
    assert split_step(10.0, 11.0, 0.1, 10.8, 10.5, 0.0) == pytest.approx((1.0, 0.1, 0.2, 0.3))
    # FSDP2: no gradient hook fired this step (a reading from the last one), 0.25 s in collectives.
    assert split_step(10.0, 11.0, 0.1, 10.8, 9.5, 0.25) == pytest.approx((1.0, 0.1, 0.2, 0.25))
    # No optimizer reading this step: no optimizer time and no DDP wait.
    assert split_step(10.0, 11.0, 0.0, 9.9, 9.8, 0.0) == (1.0, 0.0, 0.0, 0.0)
    # Never more than the step: the parts are clipped in order, compute is never negative.
    step, data, opt, sync = split_step(10.0, 11.0, 0.7, 10.9, 10.1, 5.0)
    assert (step, data, opt) == pytest.approx((1.0, 0.7, 0.1)) and sync == pytest.approx(0.2)
    assert step - data - opt - sync == pytest.approx(0.0, abs=1e-12)


class _Jobs:
    """A backend's job list as ``rebalancer run`` polls it: one list per call, the last repeated."""

    server = "http://127.0.0.1:9"

    def __init__(self, *lists: list[str]) -> None:
        self.lists = list(lists)
        self.modes: list[str] = []

    def jobs(self) -> list[dict[str, str]]:
        names = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
        return [{"job": n} for n in names]

    def job(self, name: str) -> dict[str, str]:
        return {"job": name, "mode": "approve"}

    def set_mode(self, name: str, mode: str, *, reason: str) -> None:
        self.modes.append(mode)


def test_rebalancer_run_prints_the_job_name_the_script_reports_under(capsys):
    # Issue 39: the script's own hook named its own job; the dashboard URL printed at start
    # (for --job's name) led nowhere. The name the ranks used is printed once they say hello.
    import threading

    from backend.run_cmd import follow_job

    jobs = _Jobs(["old"], ["old"], ["old", "sft-7b"])
    assert follow_job(jobs, "train-1612", {"old"}, threading.Event(), set_observe=True, poll_s=0) == "sft-7b"
    assert capsys.readouterr().err == (
        "rebalancer run: the script reports as job 'sft-7b' (it names its own job, not 'train-1612'): "
        "dashboard: http://127.0.0.1:9/job/sft-7b\n")
    assert jobs.modes == []  # the script's own hook: its mode is its own
    # The name given: silent, and put in observe mode on a backend this command did not start.
    same = _Jobs(["old"], ["old", "train-1612", "sft-7b"])
    assert follow_job(same, "train-1612", {"old"}, threading.Event(), set_observe=True, poll_s=0) == "train-1612"
    assert capsys.readouterr().err == "" and same.modes == ["observe"]
    stopped = threading.Event()
    stopped.set()
    assert follow_job(_Jobs(["old"]), "train-1612", {"old"}, stopped, set_observe=True, poll_s=0) is None


def test_a_streaming_loader_is_reported_so_the_page_suggests_no_call_that_refuses_it():
    # Issue 39: the notice for a job over an IterableDataset named hook.data_loader(dataset),
    # which refuses one. The monitor tags such a job "streaming"; the page then says what
    # rebalancing needs instead (frontend/js/job.js, STREAMING_NEEDS).
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from trainer_hook.zero_code import _framework, _streams

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):
            return iter(torch.zeros(4, 2))

    assert _streams(iter(DataLoader(Stream(), batch_size=2)))
    assert not _streams(iter(DataLoader(torch.zeros(4, 2), batch_size=2)))
    assert _framework(streaming=True) == "streaming"
    js = Path(REPO_ROOT, "frontend", "js", "job.js").read_text()
    needs = js.split("const STREAMING_NEEDS = ", 1)[1].split(";\n", 1)[0]
    assert "a map-style dataset" in needs and "hook.data_loader(dataset)" in needs
    assert 'state.zeroCode === "streaming"' in js
