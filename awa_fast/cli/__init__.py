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

The package, by command group: ``parser`` (every command and option),
``db`` (``migrate``, ``db``), ``runtime`` (``supervise``, ``status``,
``health``, ``serve``, ``bench``), ``jobs`` (``job``, ``queue``, ``dlq``),
``context`` (the DSN, schema and home rules and the output every command
shares); :func:`main` is here.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import psycopg

from awa_fast.cli.context import _env, resolve_dsn
from awa_fast.cli.parser import build_parser
from awa_fast.cli.runtime import supervise_target
from awa_fast.errors import AwaFastError, DatabaseUnavailable

EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE

__all__ = ["build_parser", "main", "resolve_dsn", "supervise_target"]


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
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", stream=sys.stderr)
    try:
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
