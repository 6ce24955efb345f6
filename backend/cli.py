"""The ``rebalancer`` command: ``serve``, ``demo``, ``run``, ``token create|list|revoke``, and the
REST client's commands (``jobs``, ``approve``, ``watch``, ... in ``backend.client.commands``).

Server packages (pydantic, FastAPI) are imported only by the server commands, so the
client commands work where only the client is installed."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from backend.client import commands as client_commands

if TYPE_CHECKING:
    from backend.settings import Settings

__all__ = ["main", "build_parser", "load_settings"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rebalancer", description="Live rebalancing of data-parallel training.")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the backend (REST, websockets, dashboard)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; env REBALANCER_HOST)")
    serve.add_argument("--port", type=int, help="port (default 8000; env REBALANCER_PORT)")
    serve.add_argument("--db", help="sqlite:///path or postgresql://user@host/db (env REBALANCER_DB)")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])

    demo = sub.add_parser("demo", help="backend plus a real 4-rank CPU job with uneven speeds")
    demo.add_argument("--port", type=int, default=8000, help="backend port (a free one if busy)")
    demo.add_argument("--steps", type=int, default=None,
                      help="the job stops after N steps; the backend stays up until Ctrl-C (default: "
                           "train until Ctrl-C)")
    demo.add_argument("--exit-when-done", action="store_true",
                      help="with --steps: stop the backend too when the job ends (scripts, CI)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--speeds", default="1,1,0.5,0.25", help="relative speed of each rank")
    demo.add_argument("--mode", choices=["auto", "approve", "observe"], default="approve")
    demo.add_argument("--global-batch-size", type=int, default=64)
    demo.add_argument("--per-sample-ms", type=float, default=2.0)
    demo.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    demo.add_argument("--job", default="demo")

    dbp = sub.add_parser("db", help="the database schema (Alembic migrations)")
    dsub = dbp.add_subparsers(dest="db_command", required=True)
    up = dsub.add_parser("upgrade", help="apply every migration (serve does this at start)")
    cur = dsub.add_parser("current", help="print the schema revision the database is at")
    for sp in (up, cur):
        sp.add_argument("--db", help="database URL (env REBALANCER_DB)")

    tok = sub.add_parser("token", help="manage access tokens in the database")
    tsub = tok.add_subparsers(dest="token_command", required=True)
    create = tsub.add_parser("create", help="create a token and print its secret once")
    create.add_argument("--role", required=True, choices=["viewer", "operator", "admin", "hook"])
    create.add_argument("--job", help="the job a hook token may speak for")
    create.add_argument("--name", default="")
    lst = tsub.add_parser("list", help="list tokens (never their secrets)")
    lst.add_argument("--all", action="store_true", help="include revoked tokens")
    rev = tsub.add_parser("revoke", help="revoke a token by id")
    rev.add_argument("id", type=int)
    for sp in (create, lst, rev):
        sp.add_argument("--db", help="database URL (env REBALANCER_DB)")
    client_commands.add_commands(sub)
    from backend import run_cmd

    run_cmd.add_command(sub)
    return p


def load_settings(**overrides: object) -> Settings:
    """Settings from env with the given (non-None) overrides; exits 2 with the reasons."""
    from pydantic import ValidationError

    from backend.settings import Settings

    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                 for e in exc.errors()]
        print("rebalancer: refusing to start, invalid settings:\n" + "\n".join(lines), file=sys.stderr)
        raise SystemExit(2) from None


def database_error(db: str, exc: BaseException) -> str:
    """One line for a database that cannot be opened: the URL (password hidden) and the
    driver's own reason, whitespace folded."""
    from sqlalchemy.engine import make_url

    try:
        shown = make_url(db).render_as_string(hide_password=True)
    except Exception:
        shown = db.split("@")[-1]
    reason = str(getattr(exc, "orig", None) or exc)
    return f"rebalancer: refusing to start, cannot open the database {shown}: {' '.join(reason.split())}"


def _serve(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    settings = load_settings(host=args.host, port=args.port, db=args.db, log_level=args.log_level)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _serve_with(settings)
    except (SQLAlchemyError, OSError) as exc:
        print(database_error(settings.db, exc), file=sys.stderr)
        return 2


def _exit_with_parent(parent: int) -> None:
    """Stop serving (SIGTERM to this process: uvicorn's graceful shutdown) once ``parent``,
    the process that started the backend for its own lifetime, is gone."""
    import os
    import signal

    from backend.process import on_parent_gone

    def shut_down() -> None:
        logging.getLogger("rebalancer").warning(
            "its parent process is gone (REBALANCER_EXIT_WITH_PARENT=%d): shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    on_parent_gone(parent, shut_down)


def _serve_with(settings: Settings) -> int:
    from backend.storage import make_engine as _engine

    probe = _engine(settings.db)  # reach the database before migrations log anything
    try:
        with probe.connect():
            pass
    finally:
        probe.dispose()
    from backend import redact

    redact.install()
    if not settings.loopback and settings.admin_token is None:
        from backend.auth.tokens import active_token_count
        from backend.parts import init_db
        from backend.storage import make_engine, make_sessionmaker

        engine = make_engine(settings.db)
        init_db(engine)
        with make_sessionmaker(engine)() as s:
            n = active_token_count(s)
        engine.dispose()
        if n == 0:
            print(
                f"rebalancer: refusing to serve on {settings.host} with no access tokens: anyone who can "
                f"reach it could change placements.\nCreate an admin token first:\n"
                f"  rebalancer token create --role admin --db {settings.db}\n"
                f"or set REBALANCER_ADMIN_TOKEN, or bind to 127.0.0.1.",
                file=sys.stderr,
            )
            return 2
    # The policy and persistence run on worker threads; with the default 5 ms GIL switch
    # interval the event loop waits up to 5 ms for the GIL after each poll while they run
    # (1,024 ranks: dashboard p50 ~280 -> ~200 ms with 1 ms).
    sys.setswitchinterval(0.001)
    import uvicorn

    from backend.main import create_app

    app = create_app(settings)  # opens the database: the caller turns its failure into one line
    if settings.exit_with_parent is not None:
        _exit_with_parent(settings.exit_with_parent)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=redact.log_config(),
                ws_max_size=settings.ws_max_bytes, ws="websockets-sansio",
                # X-Forwarded-For counts only from the configured proxies (none by default;
                # uvicorn's own default trusts any local client)
                proxy_headers=bool(settings.forwarded_allow_ips),
                forwarded_allow_ips=settings.forwarded_allow_ips or None,
                ws_ping_interval=settings.ws_ping_interval_s, ws_ping_timeout=settings.ws_ping_timeout_s)
    return 0


def _token(args: argparse.Namespace) -> int:
    from backend.auth.tokens import create_token, list_tokens, revoke_token
    from backend.parts import init_db
    from backend.storage import make_engine, make_sessionmaker

    settings = load_settings(db=args.db)
    engine = make_engine(settings.db)
    try:
        init_db(engine)
        with make_sessionmaker(engine)() as s:
            if args.token_command == "create":
                try:
                    row, secret = create_token(s, role=args.role, job=args.job, name=args.name, created_by="cli")
                except ValueError as exc:
                    print(f"rebalancer: {exc}", file=sys.stderr)
                    return 2
                s.commit()
                scope = f" for job '{row.job}'" if row.job else ""
                print(f"Created {row.role} token {row.id} '{row.name}'{scope}. Secret (shown once):",
                      file=sys.stderr)
                print(secret)
            elif args.token_command == "list":
                for r in list_tokens(s, include_revoked=args.all):
                    revoked = " revoked" if r.revoked_at else ""
                    print(f"{r.id}\t{r.role}\t{r.job or '-'}\t{r.name}\t{r.hint}...\t"
                          f"{r.created_at:.0f}{revoked}")
            else:
                gone = revoke_token(s, args.id)
                if gone is None:
                    print(f"rebalancer: token {args.id} not found; see `rebalancer token list`.", file=sys.stderr)
                    return 1
                s.commit()
                print(f"Revoked token {gone.id} '{gone.name}'.")
    finally:
        engine.dispose()
    return 0


def _db(args: argparse.Namespace) -> int:
    from backend.storage import make_engine
    from backend.storage.migrations import HEAD, current, upgrade

    settings = load_settings(db=args.db)
    engine = make_engine(settings.db)
    try:
        if args.db_command == "upgrade":
            before = current(engine)
            upgrade(engine)
            print(f"Database at revision {current(engine)} (was {before or 'empty'}).")
        else:
            rev = current(engine)
            print(f"{rev or 'empty'}{' (head)' if rev == HEAD else ''}")
    finally:
        engine.dispose()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in client_commands.COMMANDS:
        return client_commands.run(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "token":
        return _token(args)
    if args.command == "db":
        return _db(args)
    if args.command == "run":
        from backend import run_cmd

        return run_cmd.run(args)
    from backend.demo import run_demo

    return run_demo(port=args.port, steps=args.steps, ranks=args.ranks, speeds=args.speeds, mode=args.mode,
                    global_batch_size=args.global_batch_size, per_sample_ms=args.per_sample_ms,
                    db=args.db, job=args.job, exit_when_done=args.exit_when_done)


if __name__ == "__main__":
    raise SystemExit(main())
