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
