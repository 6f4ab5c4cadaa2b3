"""The ``awa-fast`` command line (also ``python -m awa_fast``).

Environment variables are read here (under the ``AWA_FAST_`` prefix, plus
``DATABASE_URL``) and, for ``App(dsn=None)``, by the one rule in
:func:`awa_fast.app.dsn_from_environment`: ``--dsn``, then ``AWA_FAST_DSN``,
then ``DATABASE_URL``; with none, the embedded server. ``migrate``,
``supervise``, ``db start`` and ``bench`` start the embedded server when
needed; ``status`` and the ``job``/``queue``/``dlq`` commands never do (they
say how to start it). The schema is ``--schema``, then ``AWA_FAST_SCHEMA``,
then ``awa_fast``. Errors print one line to stderr: exit 2 for bad input,
configuration or a database error, 3 when the database cannot be reached.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import psycopg

from awa_fast import cron_cli, logs
from awa_fast.errors import AwaFastError, ConfigError, DatabaseUnavailable, UnknownJob

log = logging.getLogger("awa_fast.cli")

JOB_ID_MAX = 2**63 - 1
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _home(args: argparse.Namespace) -> pathlib.Path:
    from awa_fast.embedded import default_home

    return pathlib.Path(args.home) if getattr(args, "home", None) else default_home()


def _schema(args: argparse.Namespace) -> str:
    from awa_fast.app import resolve_schema
    from awa_fast.storage.schema import validate_schema

    return validate_schema(resolve_schema(getattr(args, "schema", None)))


def resolve_dsn(args: argparse.Namespace | str | None) -> str:
    """``--dsn``, ``AWA_FAST_DSN``, ``DATABASE_URL``, else the embedded server (started if needed)."""
    from awa_fast.app import resolve_dsn as _resolve

    explicit = args if isinstance(args, str) or args is None else getattr(args, "dsn", None)
    home = _home(args) if isinstance(args, argparse.Namespace) else None
    dsn, source = _resolve(explicit, home)
    log.debug("using PostgreSQL from %s", source)
    return dsn


def _admin_dsn(args: argparse.Namespace) -> str:
    """The DSN for admin commands: configured, or an embedded server that already runs (never started here)."""
    from awa_fast.app import dsn_from_environment

    dsn, source = dsn_from_environment(getattr(args, "dsn", None))
    if dsn is not None:
        from awa_fast.storage import redact_dsn

        log.debug("using PostgreSQL at %s (from %s)", redact_dsn(dsn), "--dsn" if source == "argument" else source)
        return dsn
    from awa_fast.embedded import embedded_status

    home = _home(args)
    st = embedded_status(home)
    if not st["running"]:
        raise ConfigError(f"no database given (--dsn, AWA_FAST_DSN or DATABASE_URL) and the embedded server "
                          f"under {home} is not running: start it with `awa-fast db start`, or pass --dsn")
    return str(st["dsn"])


def _json_default(value: Any) -> Any:
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return json.loads(value)
    return str(value)


def _out(args: argparse.Namespace, data: Any, text: str | None = None) -> None:
    if getattr(args, "json", False) or text is None:
        sys.stdout.write(json.dumps(data, default=_json_default, sort_keys=True) + "\n")
    else:
        sys.stdout.write(text + ("\n" if text else ""))


def _admin(args: argparse.Namespace):  # noqa: ANN202 - (App, Storage, Connection)
    """An App bound to the command's schema plus one checked autocommit connection."""
    from awa_fast.app import App
    from awa_fast.storage import connect

    dsn = _admin_dsn(args)
    app = App(dsn, _schema(args))
    conn = connect(dsn, application_name="awa_fast:cli")
    try:
        app.storage.schema_check(conn)
    except BaseException:
        conn.close()
        raise
    return app, app.storage, conn


def _seconds(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


# -- commands --------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from awa_fast.storage.migrate import RingSizes, migrate

    schema = _schema(args)
    rings = RingSizes(args.ready_slots, args.claim_slots, args.lease_slots)
    dsn = resolve_dsn(args)
    result = migrate(dsn, schema, rings)
    data = {"schema": result.schema, "from_version": result.from_version, "to_version": result.to_version,
            "changed": result.changed, "granted": list(args.grant_runtime)}
    if args.grant_runtime:
        from awa_fast.storage import Storage, connect

        conn = connect(dsn, application_name="awa_fast:migrate")
        try:
            for role in args.grant_runtime:
                Storage(schema).runtime_grant(conn, role)
        finally:
            conn.close()
    _out(args, data, f"schema {result.schema}: version {result.from_version} -> {result.to_version}"
         + ("" if result.changed else " (already up to date)"))
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from awa_fast.embedded import embedded_status, ensure_embedded, stop_embedded

    home = _home(args)
    if args.action == "start":
        dsn = ensure_embedded(home)
        _out(args, {"running": True, "dsn": dsn},
             f"embedded PostgreSQL running: {dsn}\n(it keeps running; stop it with `awa-fast db stop`)")
    elif args.action == "stop":
        stopped = stop_embedded(home)
        _out(args, {"stopped": stopped}, "stopped" if stopped else "not running")
    elif args.action == "status":
        st = embedded_status(home)
        _out(args, st, ("running" if st["running"] else "not running") + f" ({st['datadir']})")
        return 0 if st["running"] else 1
    else:
        st = embedded_status(home)
        sys.stdout.write(f"{st['dsn']}\n")
    return 0


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


def _job_text(info: Any) -> str:
    lines = [f"job {info.job_id}: {info.state}",
             f"  kind {info.kind}, queue {info.queue}, priority {info.priority}",
             f"  attempt {info.attempt} of {info.max_attempts}, run_lease {info.run_lease}"]
    for label, value in (("created", info.created_at), ("run at", info.run_at), ("finished", info.finished_at),
                         ("callback timeout", info.callback_timeout_at)):
        if value is not None:
            lines.append(f"  {label} {value.isoformat()}")
    lines.append(f"  args {json.dumps(info.args, default=_json_default, sort_keys=True)}")
    if info.metadata is not None:
        lines.append(f"  metadata {json.dumps(info.metadata, default=_json_default, sort_keys=True)}")
    lines.append(f"  progress {json.dumps(info.progress, default=_json_default)}")
    lines.append(f"  result {json.dumps(info.result, default=_json_default)}")
    if info.error:
        lines.append(f"  error {info.error}")
    if info.errors:
        lines.append("  errors:")
        for err in info.errors:
            if isinstance(err, dict):
                when = f" at {err['at']}" if err.get("at") else ""
                lines.append(f"    attempt {err.get('attempt')}{when}: {err.get('error')}")
            else:
                lines.append(f"    {err}")
    return "\n".join(lines)


def cmd_job(args: argparse.Namespace) -> int:
    app, storage, conn = _admin(args)
    try:
        if args.action == "list":
            jobs = app.list_jobs(queue=args.queue, kind=args.kind, state=args.state, limit=args.limit,
                                 before_id=args.before, conn=conn)
            _out(args, [j.to_dict() for j in jobs],
                 "\n".join(f"{j.job_id} {j.state} {j.queue} {j.kind} attempt {j.attempt}/{j.max_attempts}"
                           for j in jobs) or "no jobs")
        elif args.action == "show":
            info = app.get_job(args.id, conn=conn)
            if info is None:
                raise UnknownJob(args.id)
            _out(args, info.to_dict(), _job_text(info))
        elif args.action == "cancel":
            result = storage.job_cancel(conn, args.id)
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
            return 0 if result in ("cancelled", "cancel_requested") else 1
        else:
            outcome = storage.job_retry(conn, args.id)
            if outcome is None:
                info = app.get_job(args.id, conn=conn)
                state = info.state if info else "unknown"
                raise AwaFastError(f"job {args.id} is {state}; only DLQ and scheduled, retryable or snoozed "
                                   "jobs can be retried")
            result = "retried" if outcome == "retried" else "due now"
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
    finally:
        conn.close()
    return 0


def _queue_text(s: Any) -> str:
    return (f"{s.queue}: {'paused' if s.paused else 'active'}, deadline {_seconds(s.deadline)}, "
            f"heartbeat timeout {_seconds(s.heartbeat_timeout)}, dlq {'on' if s.dlq else 'off'} "
            f"(retention {_seconds(s.dlq_retention)}), aging {_seconds(s.aging_interval)}, "
            f"{s.enqueue_shards} enqueue shards")


def cmd_queue(args: argparse.Namespace) -> int:
    app, _storage, conn = _admin(args)
    try:
        if args.action == "list":
            rows = app.list_queues(conn=conn)
            _out(args, [r.to_dict() for r in rows], "\n".join(_queue_text(r) for r in rows) or "no queues")
        elif args.action == "show":
            s = app.queue_settings(args.name, conn=conn)
            counts = app.counts(args.name, conn=conn)[args.name]
            text = _queue_text(s) + "\n  " + ", ".join(f"{k} {v}" for k, v in counts.items())
            _out(args, dict(s.to_dict(), counts=counts), text)
        elif args.action == "configure":
            from awa_fast.app import KEEP

            from awa_fast.limits import check_max_running, parse_rate

            deadline: Any = KEEP if args.deadline is None else (None if args.deadline == 0 else args.deadline)
            if args.burst is not None and args.max_rate is None:
                raise ConfigError("--burst needs --max-rate (e.g. --max-rate 100/1s --burst 20)")
            if args.max_running is None:
                max_running: Any = KEEP
            elif args.max_running == "none":
                max_running = None
            else:
                try:
                    max_running = check_max_running(int(args.max_running))
                except ValueError:
                    raise ConfigError(f"--max-running {args.max_running!r}: use an integer >= 0, "
                                      "or 'none' to remove the limit") from None
            rate: Any = KEEP if args.max_rate is None else (
                None if args.max_rate == "none" else parse_rate(args.max_rate, args.burst))
            s = app.configure_queue(args.name, deadline=deadline, heartbeat_timeout=args.heartbeat_timeout,
                                    dlq=args.dlq, dlq_retention=args.dlq_retention,
                                    aging_interval=args.aging_interval, enqueue_shards=args.enqueue_shards,
                                    history_retention=args.history_retention, max_running=max_running,
                                    max_rate=rate, conn=conn)
            _out(args, s.to_dict(), _queue_text(s))
        else:
            paused = args.action == "pause"
            ok = app.pause(args.name, conn=conn) if paused else app.resume(args.name, conn=conn)
            if not ok:
                raise AwaFastError(f"no queue {args.name!r}; `awa-fast queue list` shows the known queues")
            _out(args, {"queue": args.name, "paused": paused},
                 f"queue {args.name}: {'paused' if paused else 'resumed'}")
    finally:
        conn.close()
    return 0


def _confirm(prompt: str) -> bool:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def cmd_dlq(args: argparse.Namespace) -> int:
    app, storage, conn = _admin(args)
    try:
        if args.action == "list":
            rows = app.dlq_list(args.queue, args.limit, conn=conn)
            _out(args, [r.to_dict() for r in rows],
                 "\n".join(f"{r.job_id} {r.queue} {r.kind} attempt {r.attempt}: {r.reason[:120]}" for r in rows)
                 or "DLQ is empty")
            return 0
        if not args.id and not args.queue:
            raise ConfigError(f"dlq {args.action}: give --id ID (repeatable), --queue NAME, or both")
        ids = args.id or None
        if args.dry_run:
            rows = storage.dlq_select(conn, ids, args.queue, 1_000_000)
            verb = "retry" if args.action == "retry" else "purge"
            _out(args, {f"would_{verb}": [r["job_id"] for r in rows]},
                 "\n".join([f"would {verb} {len(rows)} jobs"] + [f"  {r['job_id']} {r['queue']} {r['kind']}: "
                                                                 f"{r['reason'][:100]}" for r in rows]))
            return 0
        if args.action == "retry":
            moved = app.dlq_retry(ids, args.queue, conn=conn)
            _out(args, {"retried": moved}, f"retried {len(moved)} jobs")
            return 0
        if ids is None and not args.yes:
            count = len(storage.dlq_select(conn, None, args.queue, 1_000_000))
            if not sys.stdin.isatty():
                raise ConfigError(f"dlq purge --queue {args.queue} deletes all {count} DLQ entries of the queue "
                                  "for good: add --yes to confirm (or --dry-run to list them)")
            if not _confirm(f"purge all {count} DLQ entries of queue {args.queue} for good? [y/N] "):
                sys.stderr.write("nothing purged\n")
                return 1
        purged = app.dlq_purge(ids, args.queue, conn=conn)
        _out(args, {"purged": len(purged)}, f"purged {len(purged)} jobs")
    finally:
        conn.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from awa_fast.bench import run_bench

    return run_bench(args, resolve_dsn(args))


# -- parser ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (what went wrong and where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (a whole number)") from None
    if not 1 <= value <= JOB_ID_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range; job ids are 1..{JOB_ID_MAX}")
    return value


def _int_range(low: int, high: int):  # noqa: ANN202
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range; use {low}..{high}")
        return value

    return parse


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 10 * 365 * 86400:
        raise argparse.ArgumentTypeError(f"{text} is out of range; use 0..315360000 seconds")
    return value


def _log_levels(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; use DEBUG, INFO, WARNING or ERROR")
    return text.upper()


def build_parser() -> argparse.ArgumentParser:
    from awa_fast import __version__

    p = _Parser(prog="awa-fast", description="A fast PostgreSQL job queue.",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n  awa-fast migrate\n  awa-fast supervise myapp.jobs:app\n"
                       "  awa-fast job list --state dlq\n\n"
                       "The DSN comes from --dsn, AWA_FAST_DSN, then DATABASE_URL (prefer the environment or\n"
                       "~/.pgpass over --dsn: a password on the command line shows in `ps`).")
    p.add_argument("--version", action="version", version=f"awa-fast {__version__}")
    p.add_argument("--log-level", type=_log_levels, default=_env("AWA_FAST_LOG_LEVEL") or "INFO",
                   help="DEBUG, INFO, WARNING or ERROR (also after the command)")
    p.add_argument("--log-format", type=logs.format_arg, default=_env("AWA_FAST_LOG_FORMAT") or "text",
                   help="text, or json: one object per line (also after the command)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def leaf(parent: Any, name: str, help_text: str, example: str, *, db: bool = True,
             json_flag: bool = True) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                               epilog="example:\n  " + example, formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--log-level", type=_log_levels, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.add_argument("--log-format", type=logs.format_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if db:
            sp.add_argument("--dsn", help="PostgreSQL DSN (default: AWA_FAST_DSN, DATABASE_URL, else embedded)")
            sp.add_argument("--schema", default=None,
                            help="schema name (default: AWA_FAST_SCHEMA, else awa_fast)")
        sp.add_argument("--home", default=_env("AWA_FAST_HOME"), help="embedded server home")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON")
        return sp

    def group(name: str, help_text: str) -> Any:
        gp = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        gp.add_argument("--log-level", type=_log_levels, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        gp.add_argument("--log-format", type=logs.format_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return gp.add_subparsers(dest="action", required=True, parser_class=_Parser, metavar="ACTION")

    sp = leaf(sub, "migrate", "install or upgrade the schema (idempotent)", "awa-fast migrate --schema awa_fast")
    sp.add_argument("--ready-slots", type=int, default=16)
    sp.add_argument("--claim-slots", type=int, default=8)
    sp.add_argument("--lease-slots", type=int, default=8)
    sp.add_argument("--grant-runtime", action="append", default=[], metavar="ROLE",
                    help="grant ROLE what enqueue and supervise need (no DDL, no TRUNCATE); repeatable")
    sp.set_defaults(func=cmd_migrate)

    db = group("db", "manage the embedded PostgreSQL server")
    for action, text in (("start", "start the embedded server (it keeps running until `db stop`)"),
                         ("stop", "stop the embedded server"),
                         ("status", "say whether the embedded server runs (exit 1 if not)"),
                         ("url", "print the embedded server's DSN")):
        sp = leaf(db, action, text, f"awa-fast db {action}", db=False)
        sp.set_defaults(func=cmd_db)

    sp = leaf(sub, "supervise", "run claimers and maintenance for an app until SIGTERM/SIGINT",
              "awa-fast supervise myapp.jobs:app --queue email:stripes=2,concurrency=64", json_flag=False)
    sp.add_argument("app", help="module:attribute of the awa_fast.App")
    sp.add_argument("--queue", action="append", default=[],
                    help="NAME[:stripes=N,concurrency=M,batch=B] (repeatable; default: the app's queues)")
    sp.add_argument("--drain-timeout", type=float, default=float(_env("AWA_FAST_DRAIN_TIMEOUT") or 30))
    sp.add_argument("--poll-interval", type=float, default=1.0, help="claim poll fallback (s)")
    sp.add_argument("--heartbeat-interval", type=float, default=5.0, help="heartbeat period of held attempts (s)")
    sp.add_argument("--election-interval", type=float, default=1.0, help="standby leader election period (s)")
    sp.add_argument("--rescue-interval", type=float, default=1.0, help="leader rescue scan period (s)")
    sp.add_argument("--no-maintenance", action="store_true", help="run no maintenance process here")
    sp.add_argument("--metrics", metavar="HOST:PORT", default=None,
                    help="serve Prometheus /metrics, /healthz and /readyz there (needs awa-fast[metrics])")
    sp.add_argument("--io-timeout", type=float, default=10.0,
                    help="a claim, completion flush or LISTEN ping unanswered this long (s) is a dead connection")
    sp.add_argument("--no-listen", action="store_true",
                    help="poll only, no LISTEN/NOTIFY (e.g. behind a transaction-pooling proxy)")
    sp.set_defaults(func=cmd_supervise)

    sp = leaf(sub, "status", "show queues, claimers, rings and the leader (never starts the embedded server)",
              "awa-fast status --exact")
    sp.add_argument("--exact", action="store_true", help="also scan for exact per-state counts")
    sp.set_defaults(func=cmd_status)

    sp = leaf(sub, "health", "exit 0 when the database, schema, leader and this host's claimers are healthy",
              "awa-fast health --json --stale-after 10")
    sp.add_argument("--stale-after", type=_duration, default=10.0,
                    help="a local claimer silent this long (seconds) is unhealthy (default 10)")
    sp.add_argument("--require-local", action="store_true",
                    help="unhealthy when no supervisor runs on this host")
    sp.set_defaults(func=cmd_health)

    sp = leaf(sub, "serve", "serve the web dashboard and its JSON API (needs awa-fast[web])",
              "awa-fast serve --bind 127.0.0.1:8787 --read-only", json_flag=False)
    sp.add_argument("app", nargs="?", default=None, help="module:attribute of the awa_fast.App (optional)")
    sp.add_argument("--bind", default="127.0.0.1:8787", help="address to listen on (default 127.0.0.1:8787)")
    sp.add_argument("--read-only", action="store_true", help="hide and refuse every action")
    sp.add_argument("--token-file", default=None,
                    help="admin token file, created 0600 when missing (default $AWA_FAST_HOME/dashboard.token)")
    sp.set_defaults(func=cmd_serve)

    from awa_fast.records import JOB_STATES

    job = group("job", "list, show, cancel or retry jobs")
    sp = leaf(job, "list", "list jobs, newest id first", "awa-fast job list --queue email --state dlq --limit 20")
    sp.add_argument("--queue")
    sp.add_argument("--kind")
    sp.add_argument("--state", choices=JOB_STATES)
    sp.add_argument("--limit", type=_int_range(1, 10_000), default=100)
    sp.add_argument("--before", type=_job_id, default=None, metavar="ID", help="page: jobs with ids below ID")
    sp.set_defaults(func=cmd_job)
    for action, text in (("show", "show one job: state, attempts, args, progress, result and errors"),
                         ("cancel", "cancel a job (a running one is asked to stop); exit 1 if already terminal"),
                         ("retry", "run a DLQ, scheduled, retryable or snoozed job again now")):
        sp = leaf(job, action, text, f"awa-fast job {action} 2199023255553")
        sp.add_argument("id", type=_job_id)
        sp.set_defaults(func=cmd_job)

    queue = group("queue", "list, show, configure, pause or resume queues")
    sp = leaf(queue, "list", "list every queue with its settings (deadline included)", "awa-fast queue list")
    sp.set_defaults(func=cmd_queue)
    sp = leaf(queue, "show", "show one queue's settings and exact job counts", "awa-fast queue show email")
    sp.add_argument("name")
    sp.set_defaults(func=cmd_queue)
    sp = leaf(queue, "configure", "create or change a queue's settings (durations in seconds)",
              "awa-fast queue configure email --deadline 300 --heartbeat-timeout 30 --no-dlq")
    sp.add_argument("name")
    sp.add_argument("--deadline", type=_duration, help="per-attempt deadline (0: none)")
    sp.add_argument("--heartbeat-timeout", type=_duration)
    sp.add_argument("--dlq", dest="dlq", action="store_true", default=None, help="dead-letter failed jobs")
    sp.add_argument("--no-dlq", dest="dlq", action="store_false", help="fail jobs terminally instead")
    sp.add_argument("--dlq-retention", type=_duration)
    sp.add_argument("--aging-interval", type=_duration)
    sp.add_argument("--enqueue-shards", type=_int_range(1, 64))
    sp.add_argument("--history-retention", type=_duration,
                    help="seconds terminal jobs stay visible at least (the ready ring keeps the longest of all queues)")
    sp.add_argument("--max-running", help="at most N of this queue's jobs running at once over every worker; "
                                          "'none' removes the limit")
    sp.add_argument("--max-rate", help="at most COUNT/PERIOD jobs started, e.g. 100/1s; 'none' removes the limit")
    sp.add_argument("--burst", type=float, help="with --max-rate: jobs that may start at once (default COUNT)")
    sp.set_defaults(func=cmd_queue)
    for action, text in (("pause", "stop claims on a queue (running jobs finish)"),
                         ("resume", "let claims on a paused queue start again")):
        sp = leaf(queue, action, text, f"awa-fast queue {action} email")
        sp.add_argument("name")
        sp.set_defaults(func=cmd_queue)

    dlq = group("dlq", "list, retry or purge dead-lettered jobs")
    sp = leaf(dlq, "list", "list dead-lettered jobs, newest first", "awa-fast dlq list --queue email --limit 20")
    sp.add_argument("--queue")
    sp.add_argument("--limit", type=_int_range(1, 10_000), default=100)
    sp.set_defaults(func=cmd_dlq, id=[])
    for action, text, example in (
            ("retry", "move dead-lettered jobs back to ready with fresh attempts (--id and --queue: both hold)",
             "awa-fast dlq retry --queue email --dry-run"),
            ("purge", "delete dead-lettered jobs for good (--id and --queue: both hold; a whole queue needs "
                      "--yes or a terminal's confirmation)", "awa-fast dlq purge --queue email --yes")):
        sp = leaf(dlq, action, text, example)
        sp.add_argument("--queue")
        sp.add_argument("--id", type=_job_id, action="append", default=[])
        sp.add_argument("--dry-run", action="store_true", help="print what would be touched; change nothing")
        if action == "purge":
            sp.add_argument("--yes", action="store_true", help="purge a whole queue without asking")
        sp.set_defaults(func=cmd_dlq)

    sp = leaf(sub, "bench", "run a benchmark scenario (see docs/performance.md)",
              "awa-fast bench drain --jobs 200000")
    sp.add_argument("scenario", choices=["drain", "bulk-enqueue", "concurrent-insert", "latency", "pinned-reader"])
    sp.add_argument("--jobs", type=int, default=20000)
    sp.add_argument("--rate", type=float, default=200.0)
    sp.add_argument("--seconds", type=float, default=20.0)
    sp.add_argument("--concurrency", type=int, default=64)
    sp.add_argument("--stripes", type=int, default=2)
    sp.add_argument("--batch", type=int, default=1024)
    sp.add_argument("--producers", type=int, default=10)
    sp.add_argument("--save", action="store_true", help="also write the JSON to perf/results/")
    sp.add_argument("--reclaim-seconds", type=float, default=None, help="pinned-reader: reclaim wait after unpin")
    sp.add_argument("--payload-bytes", type=int, default=None, metavar="N",
                    help="drain, bulk-enqueue: pad each job's args to about N bytes of JSON")
    sp.add_argument("--rss-every", type=float, default=0.0, metavar="SECONDS",
                    help="latency, pinned-reader: sample every claimer's RSS this often (0: off)")
    sp.set_defaults(func=cmd_bench)
    cron_cli.add_parser(sub)  # awa-fast cron list|pause|resume|trigger (awa_fast/cron_cli.py)
    return p


def _error(message: str) -> None:
    sys.stderr.write(f"awa-fast: error: {message}\n")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _quiet_broken_pipe() -> int:
    """The reader (e.g. ``| head``) went away: end quietly, and keep the interpreter's final
    flush of stdout from failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # --help or --version into `| head`
        return _quiet_broken_pipe()
    args.schema_given = bool(getattr(args, "schema", None)) or bool(_env("AWA_FAST_SCHEMA"))
    logs.configure(str(args.log_level), args.log_format)  # JSON lines with --log-format json
    try:
        if (_env("AWA_FAST_OTEL") or "0").lower() not in ("0", "false", "no", "off"):
            from awa_fast import otel

            otel.enable()  # with the global TracerProvider (the app module may install it)
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except DatabaseUnavailable as exc:
        _error(str(exc))
        return 3
    except AwaFastError as exc:
        _error(str(exc))
        return 2
    except psycopg.OperationalError as exc:
        _error(f"database error: {_first_line(exc)}")
        return 3
    except psycopg.Error as exc:
        _error(f"database error: {_first_line(exc)}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
