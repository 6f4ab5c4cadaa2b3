"""The commands that run or watch the runtime: ``supervise``, ``status``, ``health``, ``serve``, ``bench``."""

from __future__ import annotations

import argparse
import logging
import pathlib
from typing import Any

from awa_fast.cli.context import _admin, _admin_dsn, _home, _out, _schema, resolve_dsn
from awa_fast.errors import ConfigError

log = logging.getLogger("awa_fast.cli")


def supervise_target(args: argparse.Namespace, app: Any) -> tuple[str, str, str]:
    """``(dsn, where it came from, schema)`` for ``supervise``: the one rule that ``App`` follows.

    DSN: ``--dsn``, the app's own explicit ``App(dsn=...)``, ``AWA_FAST_DSN``,
    ``DATABASE_URL``, else the embedded server (started). Schema: ``--schema``,
    else the app's (``App(schema=None)`` means ``AWA_FAST_SCHEMA``, else ``awa_fast``).
    """
    from awa_fast.app import resolve_dsn as _resolve
    from awa_fast.storage.schema import validate_schema

    dsn, source = _resolve(args.dsn or app.dsn, _home(args))
    if not args.dsn and app.dsn:
        source = f"{args.app}'s dsn"
    elif args.dsn:
        source = "--dsn"
    schema = validate_schema(args.schema) if args.schema else app.storage.schema
    return dsn, source, schema


def cmd_supervise(args: argparse.Namespace) -> int:
    from awa_fast.runtime.loader import load_app
    from awa_fast.runtime.supervisor import Supervisor, SupervisorConfig, parse_queue_spec
    from awa_fast.storage import redact_dsn

    app = load_app(args.app)
    specs = [parse_queue_spec(q) for q in args.queue] if args.queue else [parse_queue_spec(q) for q in app.queues()]
    if not specs:
        raise ConfigError("no queues: pass --queue NAME or register handlers on the app")
    dsn, source, schema = supervise_target(args, app)
    log.info("supervise %s: schema %s on PostgreSQL at %s (from %s)", args.app, schema, redact_dsn(dsn),
             "the embedded server" if source == "embedded" else source, extra={"action": "dsn"})
    metrics = None
    if args.metrics:
        try:
            from awa_fast.metrics import check_bind, parse_bind
        except ImportError as exc:
            raise ConfigError(str(exc)) from None
        metrics = parse_bind(args.metrics)
        check_bind(metrics)
    config = SupervisorConfig(args.app, dsn, schema, tuple(specs), drain_timeout=args.drain_timeout,
                              maintenance=not args.no_maintenance, poll_interval=args.poll_interval,
                              heartbeat_interval=args.heartbeat_interval, listen=not args.no_listen,
                              io_timeout=args.io_timeout,
                              home=str(_home(args)),
                              maintenance_config={"election_interval": args.election_interval,
                                                  "rescue_interval": args.rescue_interval},
                              metrics=metrics)
    return Supervisor(config).run()


def cmd_status(args: argparse.Namespace) -> int:
    from awa_fast.runtime.status import collect_status, format_status

    _app, storage, conn = _admin(args)
    try:
        data = collect_status(storage, conn, _home(args), exact=args.exact)
    finally:
        conn.close()
    _out(args, data, format_status(data))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from awa_fast.health import check, format_report

    report = check(_admin_dsn(args), _schema(args), _home(args), stale_after=args.stale_after,
                   require_local=args.require_local)
    _out(args, report.to_dict(), format_report(report))
    return 0 if report.healthy else 1


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from awa_fast.web import serve
        from awa_fast.web.backend import Backend
        from awa_fast.web.security import load_or_create_token
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    from awa_fast.metrics import parse_bind

    if args.app:
        from awa_fast.runtime.loader import load_app

        app = load_app(args.app)
        if args.schema:
            app = type(app)(dsn=app.dsn, schema=args.schema)
    else:
        from awa_fast.app import App

        app = App(dsn=None, schema=_schema(args))
    dsn = _admin_dsn(args)
    app.dsn = dsn
    host, port = parse_bind(args.bind, default_port=8787)
    token_file = pathlib.Path(args.token_file) if args.token_file else _home(args) / "dashboard.token"
    token = load_or_create_token(token_file)
    log.info("dashboard on http://%s:%d/ (%s; admin token in %s)", host, port,
             "read-only" if args.read_only else "actions need the token", token_file,
             extra={"action": "serve_start"})
    serve(Backend(app, dsn, _home(args)), host=host, port=port, token=token, read_only=args.read_only)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from awa_fast.bench import run_bench

    return run_bench(args, resolve_dsn(args))
