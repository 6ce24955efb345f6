"""Who numbers placements (docs/design.md, invariant 9): one rule on both sides
(``next_placement_version``), one function in the backend (``records.next_version``), and
inside the controller one part that adds placements to a running job (``Rollout``)."""

from __future__ import annotations

import ast
from pathlib import Path

from backend.control import records
from backend.parts import init_db
from backend.storage import control as db
from backend.storage.base import make_engine, make_sessionmaker
from rebalancer_wire.protocol import Hello, next_placement_version

ROOT = Path(__file__).resolve().parents[2]


def test_the_rule_is_one_past_the_newest_seen():
    assert next_placement_version() == 0
    assert next_placement_version(None, None) == 0
    assert next_placement_version(0) == 1
    assert next_placement_version(4, None, 9, 2) == 10


def test_the_backend_numbers_past_what_it_stored_and_what_the_hooks_run(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'v.db'}")
    init_db(engine)
    sm = make_sessionmaker(engine)
    with sm() as s:
        # A new job whose hooks already run version 7 (this backend's database was replaced).
        records.create_job(s, Hello(job="j", rank=0, world_size=2, global_batch_size=8, placement_version=7),
                           mode="approve", actor="controller", at=1.0)
        s.commit()
        assert [p.version for p in db.list_placements(s, "j")] == [8]
        row = records.new_placement(s, "j", [6, 2], source="manual", actor="controller", reason="r", at=2.0)
        assert row.version == 9
        row.failed = True  # a refused version is never numbered again
        s.commit()
        assert records.next_version(s, "j") == 10
        assert records.next_version(s, "j", running=12) == 13
        records.create_job(s, Hello(job="k", rank=0, world_size=2, global_batch_size=8), mode="approve",
                           actor="controller", at=1.0)
        s.commit()
        assert [p.version for p in db.list_placements(s, "k")] == [0]
    engine.dispose()


def _calls(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", getattr(n.func, "id", None)) == name)


def test_one_function_numbers_and_one_part_adds_placements_in_the_backend():
    numbering = {p.relative_to(ROOT).as_posix() for p in (ROOT / "backend").rglob("*.py")
                 if _calls(p, "next_placement_version")}
    assert numbering == {"backend/control/records.py"}
    adding = {p.relative_to(ROOT).as_posix() for p in (ROOT / "backend").rglob("*.py")
              if _calls(p, "new_placement")}
    assert adding == {"backend/control/records.py", "backend/control/rollout.py"}


def test_the_hook_numbers_its_own_request_with_the_same_rule():
    """``request_placement`` (a program placing its own ranks) is the hook's one numbering:
    it calls the wire's rule, and no hook file adds one to a version by hand."""
    numbering = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer_hook").rglob("*.py")
                 if _calls(p, "next_placement_version")}
    assert numbering == {"trainer_hook/_placements.py"}
    by_hand = [p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer_hook").rglob("*.py")
               if "1 + max(" in p.read_text() and "version" in p.read_text()]
    assert by_hand == []
