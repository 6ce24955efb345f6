"""The docs refer to nothing outside the repository (issue 10): every relative link in
README.md and docs/ resolves, and nothing points at a DESIGN.md the repository lacks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve_inside_the_repository() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_design_lives_in_docs_and_nothing_cites_an_outside_design_file() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    for part in ("## Words", "## Invariants", "## The policy's math"):
        assert part in design
    for page in PAGES:
        assert "DESIGN" not in page.read_text(), f"{page.relative_to(ROOT)} cites DESIGN; point at docs/design.md"


# docs/architecture.md's module map: one entry a line, two spaces of indent a folder level, the
# role after the name; a continuation line starts at the role's column.
_ENTRY = re.compile(r"^( *)([\w.]+/|[\w.]+\.py)(?:\s{2,}(\S.*))?$")
_PRODUCT = ("rebalancer_wire", "trainer_hook", "backend")


def _module_map(text: str) -> tuple[dict[str, str], list[str]]:
    """The entries of the map (path -> role) and the lines it could not read."""
    block = text.split("## Packages", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    unread: list[str] = []
    folders: list[str] = []
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 24:
            continue  # a role's continuation
        m = _ENTRY.match(line)
        if m is None or indent % 2 or indent // 2 > len(folders) or not m.group(3):
            unread.append(line)
            continue
        del folders[indent // 2:]
        path = "".join(folders) + m.group(2)
        entries[path] = m.group(3)
        if path.endswith("/"):
            folders.append(m.group(2))
    return entries, unread


def _product_modules() -> set[str]:
    """Every module of the product packages; a package's __init__.py is its folder's entry, and
    Alembic's versions/ are the migrations/ entry's."""
    found = set()
    for package in _PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if "migrations/versions/" in rel:
                continue
            found.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    return found


def test_the_architecture_page_lists_every_module_with_its_role() -> None:
    entries, unread = _module_map((ROOT / "docs" / "architecture.md").read_text())
    assert unread == [], f"lines of the module map that are not 'name  role' at a folder's indent: {unread}"
    listed = {p for p in entries if p.split("/", 1)[0] in _PRODUCT
              and (p.endswith(".py") or (ROOT / p / "__init__.py").exists())}  # _site/ is no package
    modules = _product_modules()
    assert sorted(modules - listed) == [], "modules missing from docs/architecture.md's map"
    assert sorted(listed - modules) == [], "docs/architecture.md lists modules that are gone"
    gone = [p for p in entries if not (ROOT / p).exists()]
    assert gone == [], f"docs/architecture.md lists paths that are gone: {gone}"


def test_the_module_map_reader_sees_missing_and_gone_modules() -> None:
    text = ("## Packages\n\n```\nbackend/                 the server\n  cli.py                 the command\n"
            "  api/                   the edge\n    deps.py              dependencies\n"
            "                         (a continuation)\n  gone.py\n```\n")
    entries, unread = _module_map(text)
    assert entries == {"backend/": "the server", "backend/cli.py": "the command",
                       "backend/api/": "the edge", "backend/api/deps.py": "dependencies"}
    assert unread == ["  gone.py"]  # an entry without its role
