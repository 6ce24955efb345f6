"""The distribution is ``torch-rebalancer`` (issue 39: ``rebalancer`` on PyPI is someone
else's library): every install line names it, and ``make demo`` installs only what the
demo needs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = "torch-rebalancer"
# A requirement naming this project: "rebalancer", maybe with a prefix, extras or quotes.
REQUIREMENT = re.compile(r"""(?<![\w./-])([\w-]*rebalancer)(?=\[|["'`\s]|$)""")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "backend").rglob("*.py")),
            *sorted((ROOT / "trainer_hook").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
            ROOT / "Dockerfile", ROOT / "Makefile"]


def test_the_distribution_is_torch_rebalancer_and_its_extras_name_it() -> None:
    import tomllib  # Python 3.11+, as tests/test_compose.py

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["scripts"] == {"rebalancer": "backend.cli:main"}  # the command stays
    own = [req for reqs in project["optional-dependencies"].values() for req in reqs if "rebalancer" in req]
    assert own and all(req.startswith(f"{DIST}[") for req in own), own


def test_every_install_line_names_the_distribution() -> None:
    wrong = []
    for path in _pages():
        if path == Path(__file__):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "pip install" not in line:
                continue
            tail = re.split(r"`|&&|#|\|", line.split("pip install", 1)[1])[0]  # the command's arguments
            for name in REQUIREMENT.findall(tail):
                if name != DIST:
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not wrong, wrong


def _recipe(makefile: str, target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert match, target
    return match.group(0)


def test_make_demo_installs_the_hook_and_the_server_only() -> None:
    makefile = (ROOT / "Makefile").read_text()
    demo, serve = _recipe(makefile, "demo"), _recipe(makefile, "serve")
    assert demo.startswith("demo: $(DEMO_STAMP)") and serve.startswith("serve: $(DEMO_STAMP)")
    demo_setup = _recipe(makefile, "$(DEMO_STAMP)")
    # The extras go through a variable: a comma written in $(call)'s arguments splits them.
    assert "$(call PKG_INSTALL,$(DEMO_EXTRAS))" in demo_setup and "dev" not in demo_setup
    assert re.search(r"^DEMO_EXTRAS := -e '\.\[hook,server\]'", makefile, re.M)
    assert demo_setup.startswith("$(DEMO_STAMP): pyproject.toml | $(CONSTRAINTS)\n")  # torch first
    test_setup = _recipe(makefile, "$(STAMP)")
    assert "$(call PKG_INSTALL,-e '.[dev]')" in test_setup
    assert test_setup.startswith("$(STAMP): pyproject.toml | $(CONSTRAINTS)\n")
    # The constraints come after torch and pin the torch installed: neither uv nor pip may
    # swap it for another build while installing the extras.
    constraints = _recipe(makefile, "$(CONSTRAINTS)")
    assert constraints.startswith("$(CONSTRAINTS): | $(TORCH_STAMP)\n")
    assert "print('torch==' + torch.__version__)\" > $@" in constraints
    install = re.search(r"^PKG_INSTALL = (.*\n(?:\t.*\n)*)", makefile, re.M)
    assert install and install.group(1).count("-c $(CONSTRAINTS) $(1)") == 2  # uv, else pip
    assert "$(BIN)/pip install -q -c $(CONSTRAINTS) $(1)" in install.group(1)
    assert "touch $@ $(DEMO_STAMP)" in test_setup  # .[dev] holds the demo's extras
    assert 'python -c "import torch" 2>/dev/null ||' in _recipe(makefile, "$(TORCH_STAMP)")  # an importable torch is reused
    assert re.search(r"^setup: \$\(STAMP\)$", makefile, re.M)


def test_the_demo_set_up_command_is_whole(tmp_path: Path) -> None:
    # What make would run for the demo's set-up in a fresh venv: the extras whole, for uv and
    # for the pip fallback (a comma inside $(call) once cut the command in two).
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-n", f"VENV={venv}", f"{venv}/.demo-stamp"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    install = [line for line in out.stdout.splitlines() if "uv pip install" in line]
    assert len(install) == 1 and install[0].count("-e '.[hook,server]'") == 2, out.stdout

