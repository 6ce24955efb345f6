"""Schema migrations: a database made by the first schema of this release (0001) upgrades
to the newest and keeps its rows, on SQLite and on PostgreSQL; ``rebalancer db upgrade``."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import inspect, text

from backend.cli import main
from backend.storage import make_engine, make_sessionmaker
from backend.storage import metrics as store
from backend.storage.control import get_settings, latest_placement, list_audit
from backend.storage.migrations import FIRST, HEAD, current, upgrade
from backend.storage.owners import epoch_of

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def _rows_of_release_one(conn) -> None:
    """Rows as the first schema held them (datetimes, a separate job settings table)."""
    conn.execute(text("INSERT INTO jobs (name, world_size, global_batch_size, created_at, last_seen) "
                      "VALUES ('old', 2, 32, :t, :t), ('seen-only', 1, 8, :t, :t)"), {"t": T0})
    conn.execute(text("INSERT INTO ranks (job, rank, host, pid, device_type, device_name, hook_version, "
                      "restart_count, first_seen, last_seen) VALUES "
                      "('old', 0, 'n0', 1, 'cpu', '', '0.1', 0, :t, :t)"), {"t": T0})
    conn.execute(text("INSERT INTO control_job_settings (job, world_size, global_batch_size, mode, policy, "
                      "created_at, updated_at) VALUES ('old', 2, 32, 'auto', '{\"min_gain\": 0.2}', 1.0, 2.0), "
                      "('settings-only', 4, 64, 'observe', '{}', 3.0, 4.0)"))
    conn.execute(text("INSERT INTO control_placements (job, version, shares, source, actor, reason, created_at, "
                      "acks, failed, auto, rolled_back) VALUES ('old', 0, '[16, 16]', 'initial', 'controller', "
                      "'', 1.0, '{}', false, false, false)"))
    conn.execute(text("INSERT INTO control_audit (time, actor, role, address, action, job, params, reason) "
                      "VALUES (1.0, 'controller', '', '', 'job.create', 'old', '{}', '')"))
    conn.execute(text("INSERT INTO auth_tokens (name, role, secret_sha256, hint, created_at, created_by) "
                      "VALUES ('ops', 'admin', 'ab', 'rb_', :t, 'cli')"), {"t": T0})


def test_a_database_of_the_first_schema_upgrades_and_keeps_its_rows(db_url):
    engine = make_engine(db_url)
    upgrade(engine, FIRST)
    assert current(engine) == FIRST
    with engine.begin() as conn:
        _rows_of_release_one(conn)
    upgrade(engine)
    assert current(engine) == HEAD
    tables = set(inspect(engine).get_table_names())
    assert "control_job_settings" not in tables and {"run_summaries", "job_metrics"} <= tables
    with make_sessionmaker(engine)() as s:
        old = get_settings(s, "old")
        assert (old.mode, old.policy, old.world_size) == ("auto", {"min_gain": 0.2}, 2)
        assert old.created_at == pytest.approx(T0.timestamp())  # one time representation: seconds
        assert get_settings(s, "seen-only") is None  # stored by ingest, never controlled
        assert store.get_job(s, "seen-only").last_seen == pytest.approx(T0.timestamp())
        assert get_settings(s, "settings-only").mode == "observe"  # folded in from the old table
        assert store.list_ranks(s, "old")[0].first_seen == pytest.approx(T0.timestamp())
        assert store.get_job(s, "old").mesh is None and store.list_ranks(s, "old")[0].replica_ranks is None  # 0005
        assert latest_placement(s, "old").shares == [16, 16]
        assert epoch_of(s, "old") is None  # 0006: no replica has fenced the job yet
        assert latest_placement(s, "old").prediction is None  # 0007: no stage-model prediction
        assert [a.action for a in list_audit(s, "old")] == ["job.create"]
        token_time = s.execute(text("SELECT created_at FROM auth_tokens")).scalar_one()
        assert token_time == pytest.approx(T0.timestamp())
    upgrade(engine)  # idempotent
    engine.dispose()


def test_a_database_made_before_migrations_is_stamped_then_upgraded(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'pre.db'}")
    upgrade(engine, FIRST)
    with engine.begin() as conn:
        _rows_of_release_one(conn)
        conn.execute(text("DROP TABLE alembic_version"))  # as create_all left it
    upgrade(engine)
    assert current(engine) == HEAD
    with make_sessionmaker(engine)() as s:
        assert get_settings(s, "old").mode == "auto"
    engine.dispose()


def test_db_upgrade_and_current_commands(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == "empty"
    assert main(["db", "upgrade", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == f"Database at revision {HEAD} (was empty)."
    assert main(["db", "current", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == f"{HEAD} (head)"


def _schema(engine) -> dict:
    insp = inspect(engine)
    out = {}
    for table in sorted(insp.get_table_names()):
        cols = {c["name"]: (type(c["type"]).__name__.upper()[:4], c["nullable"]) for c in insp.get_columns(table)}
        idx = sorted((i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in insp.get_indexes(table))
        out[table] = (cols, idx)
    return out


def test_a_new_database_gets_the_schema_the_migrations_build(tmp_path):
    """create_head (models + stamp) and the migrations step by step give the same tables."""
    fresh = make_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    upgrade(fresh)  # empty: create_head
    stepped = make_engine(f"sqlite:///{tmp_path / 'stepped.db'}")
    upgrade(stepped, FIRST)
    upgrade(stepped)  # 0001 -> 0002 by the migrations
    assert current(fresh) == current(stepped) == HEAD
    assert _schema(fresh) == _schema(stepped)
    fresh.dispose()
    stepped.dispose()
