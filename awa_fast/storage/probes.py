"""Measurement probes: the catalog and statistics reads the benchmarks take.

None of these is on a hot path or used by the runtime; ``awa-fast bench``
and the ``perf/`` scripts call them to describe the server they measured
(version, settings, the postmaster) and what the engine left behind (dead
tuples per table, claim and completion timestamps). They live here because
only the storage layer runs SQL. Each takes the connection to run on.

The queries read PostgreSQL's own catalogs (``pg_settings``,
``pg_stat_activity``, ``pg_stat_user_tables``) or one schema's tables; none
relies on an index of ours except where it says so.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
from collections.abc import Sequence

import psycopg

from awa_fast.storage.schema import render, validate_schema

# Intent: the settings that decide a benchmark's numbers, by name (pg_settings is a view; no index).
_SETTINGS = "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s) ORDER BY name"
# Intent: backends a bench run started that are still connected (their statistics are not flushed yet).
_BACKENDS_SINCE = ("SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_start >= %s "
                   "AND application_name LIKE 'awa_fast%%' AND application_name <> %s")
# Intent: dead tuples of every table of one schema (pg_stat_user_tables, filtered by schemaname).
_DEAD_TOTAL = "SELECT COALESCE(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables WHERE schemaname = %s"
_DEAD_TOP = ("SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s AND n_dead_tup > 0 "
             "ORDER BY n_dead_tup DESC LIMIT %s")
# Intent: the first claim statement's start, while its receipt still exists (lease_claims is small: the live claims).
_FIRST_CLAIM = "SELECT extract(epoch FROM min(claimed_at))::float8 FROM __SCHEMA__.lease_claims"
# Intent: the start of the last completion transaction (scans done_entries and the compact done_receipts;
# bench schemas only).
_LAST_FINISH = ("SELECT extract(epoch FROM greatest((SELECT max(finished_at) FROM __SCHEMA__.done_entries),"
                " (SELECT max(finished_at) FROM __SCHEMA__.done_receipts)))::float8")
# Intent: per job, when its completion row was written (done_entries by job_id = ANY, and the compact rows'
# job_ids: scans, bench schemas only).
# {d} and {r}: the time expression over alias d (done_entries) and r (done_receipts); system columns
# such as xmin must be qualified once the FROM list has a second item (the unnest).
_FINISHED_BY_JOB = ("SELECT d.job_id, extract(epoch FROM {d})::float8 FROM __SCHEMA__.done_entries d "
                    "WHERE d.job_id = ANY(%(jobs)s) UNION ALL "
                    "SELECT u.j, extract(epoch FROM {r})::float8 FROM __SCHEMA__.done_receipts r "
                    "CROSS JOIN LATERAL unnest(r.job_ids) AS u(j) WHERE u.j = ANY(%(jobs)s)")
# Intent: the pinned reader's one read of the ready ring, so its snapshot holds back vacuum.
_PIN_READ = "SELECT count(*) FROM __SCHEMA__.ready_entries"
_PIN_XMIN = "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()"


def server_version(conn: psycopg.Connection) -> str:
    """The server's ``server_version`` setting, e.g. ``'18.1'``."""
    return setting(conn, "server_version")


def setting(conn: psycopg.Connection, name: str) -> str:
    """One run-time setting's current value (``current_setting(name)``)."""
    row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
    assert row is not None
    return str(row[0])


def settings(conn: psycopg.Connection, names: Sequence[str]) -> dict[str, str]:
    """The current value of each named setting that exists, by name."""
    return {n: v for n, v in conn.execute(_SETTINGS, (list(names),))}


def backend_pid(conn: psycopg.Connection) -> int:
    """The pid of the server process serving ``conn``."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def schema_drop(conn: psycopg.Connection, schema: str) -> None:
    """``DROP SCHEMA ... CASCADE`` of one (validated) schema, if it exists. For bench schemas."""
    conn.execute(render("DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE", validate_schema(schema)))


def backends_started_since(conn: psycopg.Connection, since: _dt.datetime, except_application: str) -> int:
    """awa_fast backends (by application name) started at or after ``since``, other than this one."""
    row = conn.execute(_BACKENDS_SINCE, (since, except_application)).fetchone()
    return int(row[0]) if row else 0


def stats_snapshot_clear(conn: psycopg.Connection) -> None:
    """Drop this session's statistics snapshot, so the next read sees fresh counters."""
    conn.execute("SELECT pg_stat_clear_snapshot()")


def stats_flush(conn: psycopg.Connection) -> None:
    """Flush this backend's pending statistics (PostgreSQL 15+; ignored before) and clear the snapshot."""
    with contextlib.suppress(psycopg.Error):
        conn.execute("SELECT pg_stat_force_next_flush()")
    stats_snapshot_clear(conn)


def dead_tuples_total(conn: psycopg.Connection, schema: str) -> int:
    """``n_dead_tup`` summed over every table of ``schema``."""
    row = conn.execute(_DEAD_TOTAL, (validate_schema(schema),)).fetchone()
    return int(row[0]) if row else 0


def dead_tuples_top(conn: psycopg.Connection, schema: str, limit: int = 8) -> dict[str, int]:
    """The ``limit`` tables of ``schema`` with the most dead tuples: name -> ``n_dead_tup``."""
    return {r[0]: int(r[1]) for r in conn.execute(_DEAD_TOP, (validate_schema(schema), limit))}


def _epoch(conn: psycopg.Connection, schema: str, text: str) -> float | None:
    row = conn.execute(render(text, validate_schema(schema))).fetchone()
    return float(row[0]) if row and row[0] is not None else None


def claim_first_at(conn: psycopg.Connection, schema: str) -> float | None:
    """Epoch seconds of the earliest live claim (``min(lease_claims.claimed_at)``); None when none."""
    return _epoch(conn, schema, _FIRST_CLAIM)


def completion_last_at(conn: psycopg.Connection, schema: str) -> float | None:
    """Epoch seconds of the latest ``done_entries.finished_at``; None when nothing finished."""
    return _epoch(conn, schema, _LAST_FINISH)


def completion_at_by_job(conn: psycopg.Connection, schema: str, job_ids: Sequence[int],
                         commit_timestamp: bool) -> dict[int, float]:
    """job_id -> epoch seconds its completion row was written.

    With ``commit_timestamp`` (the server runs with ``track_commit_timestamp``)
    the row's exact commit time, else ``finished_at`` (the start of the
    completing transaction).
    """
    ts = "pg_xact_commit_timestamp({t}.xmin)" if commit_timestamp else "{t}.finished_at"
    text = _FINISHED_BY_JOB.format(d=ts.format(t="d"), r=ts.format(t="r"))
    return dict(conn.execute(render(text, validate_schema(schema)), {"jobs": list(job_ids)}).fetchall())


def pinned_reader_begin(conn: psycopg.Connection, schema: str) -> str | None:
    """Open a ``REPEATABLE READ`` transaction on ``conn`` that has read the ready ring; returns its xmin.

    The snapshot stays pinned (and holds back vacuum) until the caller ends
    the transaction with ``conn.rollback()``. ``conn`` must not be autocommit.
    """
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.execute(render(_PIN_READ, validate_schema(schema))).fetchone()
    row = conn.execute(_PIN_XMIN).fetchone()
    return row[0] if row else None
