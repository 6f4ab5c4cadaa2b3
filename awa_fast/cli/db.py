"""``awa-fast migrate`` and ``awa-fast db start|stop|status|url``: the schema and the embedded server."""

from __future__ import annotations

import argparse
import sys

from awa_fast.cli.context import _home, _out, _schema, resolve_dsn


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
