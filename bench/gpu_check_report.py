"""scripts/gpu-check's results file and summary line, from what its steps left in one folder.

Reads ``junit.xml`` (pytest), ``facts/*.json`` (what each GPU test measured),
``bench.json`` (bench.gpu_step) and ``nvidia-smi.txt``; writes ``gpu-check.json`` there;
prints the summary and each failed test; exits 0 when every selected test passed (at least
one) and the bench ran or was skipped, else 1.

    python -m bench.gpu_check_report DIR --mode cuda|rehearsal --pytest-rc N --pytest-s S \
        --bench-rc N (-1: skipped) --bench-s S --total-s S --torch VERSION --cuda VERSION|None
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

__all__ = ["main", "report"]

_OUTCOME = {"failure": "failed", "error": "error", "skipped": "skipped"}


def _tests(junit: Path) -> list[dict[str, Any]]:
    if not junit.exists():
        return []
    tests = []
    for case in ET.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in _OUTCOME.items():
            el = case.find(tag)
            if el is not None:
                outcome, message = name, (el.get("message") or "")[:500]
                break
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return tests


def _device(mode: str) -> str:
    if mode != "cuda":
        return "none (CPU rehearsal)"
    try:
        import torch

        return str(torch.cuda.get_device_name(0))
    except Exception as exc:  # noqa: BLE001 - the report goes out whatever this says
        return f"unknown ({exc})"


def report(root: Path, *, mode: str, pytest_rc: int, pytest_s: int, bench_rc: int, bench_s: int,
           total_s: int, torch_version: str, torch_cuda: str) -> tuple[bool, dict[str, Any], list[str]]:
    """(ok, the results document, the summary lines); writes ``root/gpu-check.json``."""
    tests = _tests(root / "junit.xml")
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    facts = {p.stem: json.loads(p.read_text()) for p in sorted((root / "facts").glob("*.json"))}
    bench_file = root / "bench.json"
    bench = json.loads(bench_file.read_text()) if bench_rc == 0 and bench_file.exists() else None
    smi_file = root / "nvidia-smi.txt"
    smi = smi_file.read_text().strip() if smi_file.exists() else None
    device = _device(mode)
    ok = (pytest_rc == 0 and counts["failed"] == counts["error"] == 0 and counts["passed"] > 0
          and bench_rc in (0, -1))
    doc = {"check": "gpu-check", "ok": ok, "mode": mode, "device": device, "nvidia_smi": smi,
           "torch": torch_version, "cuda": None if torch_cuda == "None" else torch_cuda,
           "finished_unix": time.time(), "total_s": total_s,
           "pytest": {"rc": pytest_rc, "seconds": pytest_s, **counts, "tests": tests},
           "bench": {"rc": bench_rc, "seconds": bench_s, "result": bench},
           "facts": facts}
    (root / "gpu-check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if bench_rc == -1:
        bench_note = "skipped"
    elif bench is None:
        bench_note = f"rc {bench_rc}"
    else:
        bench_note = (f"ok ({bench['overhead_pct']:+.2f}% step time, "
                      f"step() {bench['step_enter_exit_us_median']:.1f} us)")
    lines = [f"gpu-check {'OK' if ok else 'FAILED'} ({mode}, {device}): {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped in "
             f"{pytest_s} s (pytest rc {pytest_rc}); bench {bench_note}; {total_s} s in all"]
    lines += [f"  {t['outcome'].upper()} {t['name']}: {t['message'][:200]}"
              for t in tests if t["outcome"] in ("failed", "error")]
    lines.append(f"results: {root / 'gpu-check.json'}")
    return ok, doc, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check_report", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--mode", choices=("cuda", "rehearsal"), required=True)
    for name in ("pytest-rc", "pytest-s", "bench-rc", "bench-s", "total-s"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--torch", default="")
    p.add_argument("--cuda", default="None")
    a = p.parse_args(argv)
    if not a.folder.is_dir():
        p.error(f"{a.folder} is not a folder; pass the one gpu-check wrote its results to.")
    ok, _, lines = report(a.folder, mode=a.mode, pytest_rc=a.pytest_rc, pytest_s=a.pytest_s,
                          bench_rc=a.bench_rc, bench_s=a.bench_s, total_s=a.total_s,
                          torch_version=a.torch, torch_cuda=a.cuda)
    print("\n" + "\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
