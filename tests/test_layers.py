"""Imports run downward: nothing below the routes and the wiring imports them, and the hook
never imports the backend. Read from the source (AST), type-only and function-level imports
included. KNOWN_UPWARD lists the arrows that still point up (issue 22's redesign removes
them); the test fails on any new one, and on a listed one that is gone (drop it from the list)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The top layers: they may import anything in the backend.
TOP = ("backend/main.py", "backend/parts.py", "backend/cli.py", "backend/cli_client.py",
       "backend/demo.py", "backend/run_cmd.py", "backend/__main__.py", "backend/api/")
UPPER = ("backend.api", "backend.parts", "backend.main", "backend.cli", "backend.demo", "backend.run_cmd")
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "migrations/versions" not in p.as_posix())


def test_nothing_below_the_routes_and_the_wiring_imports_them():
    upward = set()
    for path in _modules("backend"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(TOP):
            continue
        for name in _imports(path):
            if any(name == u or name.startswith(u + ".") for u in UPPER):
                upward.add((rel, name))
    assert upward - KNOWN_UPWARD == set(), "new imports that point up a layer"
    assert KNOWN_UPWARD - upward == set(), "gone: remove them from KNOWN_UPWARD"


def test_the_wiring_imports_no_route():
    names = _imports(ROOT / "backend/parts.py")
    assert not [n for n in names if n.startswith("backend.api")]


def test_the_hook_never_imports_the_backend():
    for path in _modules("trainer_hook"):
        bad = [n for n in _imports(path) if n == "backend" or n.startswith("backend.")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# No backend product module grows past this many lines; the ones listed are bigger with a reason.
LINE_CAP = 700
OVER_CAP: dict[str, str] = {}


def test_no_backend_module_is_over_the_line_cap():
    over = {}
    for path in _modules("backend"):
        n = len(path.read_text().splitlines())
        if n > LINE_CAP:
            over[path.relative_to(ROOT).as_posix()] = n
    assert set(over) - set(OVER_CAP) == set(), f"over {LINE_CAP} lines: {over}; split the module by owner"
    assert set(OVER_CAP) - set(over) == set(), "under the cap now: remove them from OVER_CAP"
