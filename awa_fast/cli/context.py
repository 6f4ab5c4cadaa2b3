"""What every command needs: the database, schema and home it targets, and how it prints.

``migrate``, ``supervise``, ``db start`` and ``bench`` resolve the DSN with
:func:`resolve_dsn` (starting the embedded server when none is configured);
``status``, ``health``, ``serve`` and the admin commands use the embedded
server only if it already runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from awa_fast.errors import ConfigError

if TYPE_CHECKING:
    import psycopg

    from awa_fast.app import App
    from awa_fast.storage import Storage

log = logging.getLogger("awa_fast.cli")


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


def _admin(args: argparse.Namespace) -> tuple[App, Storage, psycopg.Connection]:
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
