"""The ``awa-fast`` command line.

Environment variables are read here only, under the ``AWA_FAST_`` prefix
(plus ``DATABASE_URL``). The DSN comes from ``--dsn``, then
``AWA_FAST_DSN``, then ``DATABASE_URL``; with none, the embedded server is
started. Errors print one line to stderr and exit non-zero: 2 for bad
input or configuration, 3 when the database cannot be reached.
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
from typing import Any

import psycopg

from awa_fast.errors import AwaFastError, ConfigError, DatabaseUnavailable

log = logging.getLogger("awa_fast.cli")


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _home(args: argparse.Namespace) -> pathlib.Path:
    from awa_fast.embedded import default_home

    return pathlib.Path(args.home) if getattr(args, "home", None) else default_home()


def resolve_dsn(args: argparse.Namespace) -> str:
    """``--dsn``, ``AWA_FAST_DSN``, ``DATABASE_URL``, else the embedded server (started if needed)."""
    dsn = getattr(args, "dsn", None) or _env("AWA_FAST_DSN") or _env("DATABASE_URL")
    if dsn:
        _check_dsn(dsn)
        return dsn
    from awa_fast.embedded import ensure_embedded

    return ensure_embedded(_home(args))


def _check_dsn(dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ConfigError("invalid DSN: it could not be parsed; use 'postgresql://user@host:port/dbname' "
                          "or 'host=... dbname=...'") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return json.loads(value)
    return str(value)


def _out(args: argparse.Namespace, data: Any, text: str | None = None) -> None:
    if getattr(args, "json", False) or text is None:
        print(json.dumps(data, default=_json_default, sort_keys=True))
    else:
        print(text)


def _storage_conn(args: argparse.Namespace):  # noqa: ANN202
    from awa_fast.storage import Storage, connect

    storage = Storage(args.schema)
    conn = connect(resolve_dsn(args), application_name="awa_fast:cli")
    storage.schema_check(conn)
    return storage, conn


# -- commands --------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from awa_fast.storage.migrate import RingSizes, migrate
    from awa_fast.storage.schema import validate_schema

    validate_schema(args.schema)
    rings = RingSizes(args.ready_slots, args.claim_slots, args.lease_slots)
    dsn = resolve_dsn(args)
    result = migrate(dsn, args.schema, rings)
    data = {"schema": result.schema, "from_version": result.from_version, "to_version": result.to_version,
            "changed": result.changed, "granted": list(args.grant_runtime)}
    if args.grant_runtime:
        from awa_fast.storage import Storage, connect

        conn = connect(dsn, application_name="awa_fast:migrate")
        try:
            for role in args.grant_runtime:
                Storage(args.schema).runtime_grant(conn, role)
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
        _out(args, {"running": True, "dsn": dsn}, f"embedded PostgreSQL running: {dsn}")
    elif args.action == "stop":
        stopped = stop_embedded(home)
        _out(args, {"stopped": stopped}, "stopped" if stopped else "not running")
    elif args.action == "status":
        st = embedded_status(home)
        _out(args, st, ("running" if st["running"] else "not running") + f" ({st['datadir']})")
        return 0 if st["running"] else 1
    else:
        st = embedded_status(home)
        print(st["dsn"])
    return 0


def cmd_supervise(args: argparse.Namespace) -> int:
    from awa_fast.runtime.loader import load_app
    from awa_fast.runtime.supervisor import Supervisor, SupervisorConfig, parse_queue_spec

    app = load_app(args.app)
    specs = [parse_queue_spec(q) for q in args.queue] if args.queue else [parse_queue_spec(q) for q in app.queues()]
    if not specs:
        raise ConfigError("no queues: pass --queue NAME or register handlers on the app")
    dsn = args.dsn or _env("AWA_FAST_DSN") or _env("DATABASE_URL") or app.dsn
    if dsn:
        _check_dsn(dsn)
    else:
        from awa_fast.embedded import ensure_embedded

        dsn = ensure_embedded(_home(args))
    schema = args.schema if args.schema_given else app.storage.schema
    config = SupervisorConfig(args.app, dsn, schema, tuple(specs), drain_timeout=args.drain_timeout,
                              maintenance=not args.no_maintenance, poll_interval=args.poll_interval,
                              heartbeat_interval=args.heartbeat_interval, listen=not args.no_listen,
                              io_timeout=args.io_timeout,
                              home=str(_home(args)),
                              maintenance_config={"election_interval": args.election_interval,
                                                  "rescue_interval": args.rescue_interval})
    return Supervisor(config).run()


def cmd_status(args: argparse.Namespace) -> int:
    from awa_fast.runtime.status import collect_status, format_status

    storage, conn = _storage_conn(args)
    try:
        data = collect_status(storage, conn, _home(args), exact=args.exact)
    finally:
        conn.close()
    _out(args, data, format_status(data))
    return 0


def cmd_job(args: argparse.Namespace) -> int:
    storage, conn = _storage_conn(args)
    try:
        if args.action == "show":
            job = storage.job_load(conn, args.id)
            if job is None:
                raise AwaFastError(f"no job {args.id} (never existed, or its history was pruned)")
            _out(args, job, json.dumps(job, default=_json_default, indent=2, sort_keys=True))
        elif args.action == "cancel":
            result = storage.job_cancel(conn, args.id)
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
            return 0 if result in ("cancelled", "cancel_requested") else 1
        else:
            job = storage.job_load(conn, args.id)
            state = job["state"] if job else "unknown"
            if state == "dlq":
                storage.dlq_retry(conn, [args.id])
                result = "retried"
            elif state in ("scheduled", "retryable", "snoozed"):
                storage.deferred_run_now(conn, args.id)
                result = "due now"
            else:
                raise AwaFastError(f"job {args.id} is {state}; only DLQ and deferred jobs can be retried")
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
    finally:
        conn.close()
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    from awa_fast.client import validate_name

    storage, conn = _storage_conn(args)
    try:
        if args.action == "list":
            rows = storage.queue_list(conn)
            _out(args, rows, "\n".join(f"{r['queue']}: {'paused' if r['paused'] else 'active'}" for r in rows)
                 or "no queues")
            return 0
        validate_name("queue", args.name)
        ok = storage.queue_pause(conn, args.name, args.action == "pause")
        if not ok:
            raise AwaFastError(f"no queue {args.name!r}; `awa-fast queue list` shows the known queues")
        _out(args, {"queue": args.name, "paused": args.action == "pause"},
             f"queue {args.name}: {'paused' if args.action == 'pause' else 'resumed'}")
    finally:
        conn.close()
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    storage, conn = _storage_conn(args)
    try:
        if args.action == "list":
            rows = storage.dlq_list(conn, args.queue, args.limit)
            _out(args, rows, "\n".join(f"{r['job_id']} {r['queue']} {r['kind']} attempt {r['attempt']}: "
                                      f"{r['reason'][:120]}" for r in rows) or "DLQ is empty")
            return 0
        if not args.id and not args.queue:
            raise ConfigError(f"dlq {args.action}: give --id ID (repeatable) or --queue NAME")
        if args.action == "retry":
            ids = storage.dlq_retry(conn, args.id or None, args.queue)
            _out(args, {"retried": ids}, f"retried {len(ids)} jobs")
        else:
            n = storage.dlq_purge(conn, args.id or None, args.queue)
            _out(args, {"purged": n}, f"purged {n} jobs")
    finally:
        conn.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from awa_fast.bench import run_bench

    return run_bench(args, resolve_dsn(args))


# -- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="awa-fast", description="A fast PostgreSQL job queue.")
    p.add_argument("--log-level", default=_env("AWA_FAST_LOG_LEVEL") or "INFO")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
        sp.add_argument("--dsn", help="PostgreSQL DSN (default: AWA_FAST_DSN, DATABASE_URL, else embedded)")
        sp.add_argument("--schema", default=_env("AWA_FAST_SCHEMA") or "awa_fast")
        sp.add_argument("--home", default=_env("AWA_FAST_HOME"), help="embedded server home")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON")

    sp = sub.add_parser("migrate", help="install or upgrade the schema")
    common(sp)
    sp.add_argument("--ready-slots", type=int, default=16)
    sp.add_argument("--claim-slots", type=int, default=8)
    sp.add_argument("--lease-slots", type=int, default=8)
    sp.add_argument("--grant-runtime", action="append", default=[], metavar="ROLE",
                    help="grant ROLE what enqueue and supervise need (no DDL, no TRUNCATE); repeatable")
    sp.set_defaults(func=cmd_migrate)

    sp = sub.add_parser("db", help="manage the embedded PostgreSQL server")
    sp.add_argument("action", choices=["start", "stop", "status", "url"])
    sp.add_argument("--home", default=_env("AWA_FAST_HOME"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_db)

    sp = sub.add_parser("supervise", help="run claimers and maintenance for an app")
    sp.add_argument("app", help="module:attribute of the awa_fast.App")
    common(sp, json_flag=False)
    sp.add_argument("--queue", action="append", default=[],
                    help="NAME[:stripes=N,concurrency=M,batch=B] (repeatable; default: the app's queues)")
    sp.add_argument("--drain-timeout", type=float, default=float(_env("AWA_FAST_DRAIN_TIMEOUT") or 30))
    sp.add_argument("--poll-interval", type=float, default=1.0, help="claim poll fallback (s)")
    sp.add_argument("--heartbeat-interval", type=float, default=5.0, help="heartbeat period of held attempts (s)")
    sp.add_argument("--election-interval", type=float, default=1.0, help="standby leader election period (s)")
    sp.add_argument("--rescue-interval", type=float, default=1.0, help="leader rescue scan period (s)")
    sp.add_argument("--no-maintenance", action="store_true", help="run no maintenance process here")
    sp.add_argument("--io-timeout", type=float, default=10.0,
                    help="a claim, completion flush or LISTEN ping unanswered this long (s) is a dead connection")
    sp.add_argument("--no-listen", action="store_true",
                    help="poll only, no LISTEN/NOTIFY (e.g. behind a transaction-pooling proxy)")
    sp.set_defaults(func=cmd_supervise)

    sp = sub.add_parser("status", help="queues, claimers, rings and the leader")
    common(sp)
    sp.add_argument("--exact", action="store_true", help="also scan for exact per-state counts")
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("job", help="show, cancel or retry one job")
    sp.add_argument("action", choices=["show", "cancel", "retry"])
    sp.add_argument("id", type=int)
    common(sp)
    sp.set_defaults(func=cmd_job)

    sp = sub.add_parser("queue", help="pause, resume or list queues")
    sp.add_argument("action", choices=["pause", "resume", "list"])
    sp.add_argument("name", nargs="?", default="")
    common(sp)
    sp.set_defaults(func=cmd_queue)

    sp = sub.add_parser("dlq", help="list, retry or purge dead-lettered jobs")
    sp.add_argument("action", choices=["list", "retry", "purge"])
    sp.add_argument("--queue")
    sp.add_argument("--id", type=int, action="append", default=[])
    sp.add_argument("--limit", type=int, default=100)
    common(sp)
    sp.set_defaults(func=cmd_dlq)

    sp = sub.add_parser("bench", help="benchmarks (see docs/performance.md)")
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
    common(sp)
    sp.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.schema_given = "--schema" in (argv if argv is not None else sys.argv[1:]) or bool(_env("AWA_FAST_SCHEMA"))
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except DatabaseUnavailable as exc:
        print(f"awa-fast: error: {exc}", file=sys.stderr)
        return 3
    except AwaFastError as exc:
        print(f"awa-fast: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        from awa_fast.storage import redact_dsn  # noqa: F401 - messages never carry the password

        print(f"awa-fast: error: database error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
