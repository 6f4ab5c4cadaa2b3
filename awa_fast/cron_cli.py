"""``awa-fast cron list [--json] | pause NAME | resume NAME | trigger NAME``.

Wired into ``awa_fast/cli/parser.py`` with two lines::

    from awa_fast import cron_cli              # with the other imports
    cron_cli.add_parser(sub)                   # in build_parser(), beside the other subcommands

(``add_parser`` sets ``func=run``, which ``cli.main`` dispatches to.) It also
runs on its own: ``python -m awa_fast.cron_cli --dsn ... list``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from awa_fast.errors import AwaFastError, ConfigError, DatabaseUnavailable


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``cron`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    sp: argparse.ArgumentParser = subparsers.add_parser("cron", help="list, pause, resume or trigger periodic jobs")
    sp.add_argument("action", choices=["list", "pause", "resume", "trigger"])
    sp.add_argument("name", nargs="?", help="schedule name (pause, resume, trigger)")
    sp.add_argument("--dsn", help="PostgreSQL DSN (default: AWA_FAST_DSN, DATABASE_URL, else embedded)")
    sp.add_argument("--schema", default=os.environ.get("AWA_FAST_SCHEMA") or "awa_fast")
    sp.add_argument("--home", default=os.environ.get("AWA_FAST_HOME") or None, help="embedded server home")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(func=run)
    return sp


def _dsn(args: argparse.Namespace) -> str:
    dsn = args.dsn or os.environ.get("AWA_FAST_DSN") or os.environ.get("DATABASE_URL")
    if dsn:
        return str(dsn)
    import pathlib

    from awa_fast.embedded import default_home, ensure_embedded

    return ensure_embedded(pathlib.Path(args.home) if args.home else default_home())


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, _dt.datetime) else value


def next_fire(row: dict[str, Any], now: _dt.datetime | None) -> _dt.datetime | None:
    """The next tick a schedule will fire (due now when it is not after ``now``); None when inactive."""
    if not row["enabled"] or row["paused"]:
        return None
    from awa_fast.periodic import ticks_after

    start = row["anchor_at"] if row["last_tick"] is None or row["anchor_at"] > row["last_tick"] else row["last_tick"]
    try:
        return next(ticks_after(row["cron"], row["timezone"], start), None)
    except (ConfigError, ValueError):
        return None


def run(args: argparse.Namespace) -> int:
    """Execute ``awa-fast cron ...``; returns the exit code."""
    from awa_fast.client import validate_name
    from awa_fast.storage import Storage, connect

    storage = Storage(args.schema)
    conn = connect(_dsn(args), application_name="awa_fast:cli")
    try:
        storage.schema_check(conn)
        if args.action == "list":
            now, rows = storage.schedule_list(conn)
            out = []
            for r in rows:
                out.append({"name": r["name"], "cron": r["cron"], "timezone": r["timezone"], "kind": r["kind"],
                            "queue": r["queue"], "missed": r["missed"], "next_fire": _iso(next_fire(r, now)),
                            "last_fire": _iso(r["last_tick"]), "last_fired_at": _iso(r["last_fired_at"]),
                            "paused": r["paused"], "enabled": r["enabled"], "source": r["source"]})
            if args.json:
                print(json.dumps(out, sort_keys=True))
            elif not out:
                print("no schedules")
            else:
                for r in out:
                    flag = "paused" if r["paused"] else ("disabled" if not r["enabled"] else "active")
                    print(f"{r['name']}  {r['cron']} ({r['timezone']})  {flag}  next {r['next_fire'] or '-'}  "
                          f"last {r['last_fire'] or '-'}  {r['kind']}@{r['queue']}  source {r['source']}")
            return 0
        if not args.name:
            raise ConfigError(f"cron {args.action}: give the schedule NAME")
        validate_name("schedule", args.name)
        if args.action in ("pause", "resume"):
            if not storage.schedule_pause(conn, args.name, args.action == "pause"):
                raise AwaFastError(f"no schedule {args.name!r}; `awa-fast cron list` shows them")
            result: dict[str, Any] = {"name": args.name, "paused": args.action == "pause"}
            text = f"schedule {args.name}: {'paused' if args.action == 'pause' else 'resumed'}"
        else:
            from awa_fast.periodic import trigger

            outcome, job = trigger(storage, conn, args.name)
            if outcome == "inactive":
                raise AwaFastError(f"no schedule {args.name!r}; `awa-fast cron list` shows them")
            result = {"name": args.name, "outcome": outcome, "job_id": job}
            text = (f"schedule {args.name}: enqueued job {job}" if outcome == "fired"
                    else f"schedule {args.name}: {outcome} (job {job} holds its unique key)")
        print(json.dumps(result, sort_keys=True) if args.json else text)
        return 0
    finally:
        conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m awa_fast.cron_cli ...``)."""
    parser = argparse.ArgumentParser(prog="awa-fast")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["cron", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except DatabaseUnavailable as exc:
        print(f"awa-fast: error: {exc}", file=sys.stderr)
        return 3
    except AwaFastError as exc:
        print(f"awa-fast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
