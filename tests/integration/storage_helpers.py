"""Shared helpers for the storage-engine integration tests (tests/integration/test_storage_*.py).

Everything here talks to the real PostgreSQL of the test session through the
public storage layer, plus a few direct reads of the schema's tables to check
what the engine wrote (``connect``, ``sqlx``, ``scalar`` and ``wait_for`` are
the shared fixture plugins under tests/fixtures/). Waiting is always on an observable event (pg_locks,
pg_stat_activity, a row) with a deadline, never a bare sleep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson
import psycopg

from awa_fast.client import Client
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage import RawJson, Storage
from tests.fixtures.database import scalar, sqlx
from tests.fixtures.waiting import wait_for

KIND = "test.job"

# Every done row, one per job, in done_entries' columns: per-job rows, and the attempts a compact
# done_receipts row (migration 0015) completes, with their attempt and kind from the ready row they completed.
DONE_ALL = """(SELECT ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state, queue, kind, error
    FROM __SCHEMA__.done_entries
    UNION ALL
    SELECT d.ready_slot, u.j, d.lane_id, e.lane_seq, u.l, (e.attempt + 1)::smallint, 1::smallint, d.queue, e.kind,
           NULL::text
    FROM __SCHEMA__.done_receipts d CROSS JOIN LATERAL unnest(d.job_ids, d.run_leases) AS u(j, l)
    LEFT JOIN __SCHEMA__.ready_entries e
           ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.job_id = u.j AND e.lease_base + 1 = u.l
          AND e.lane_seq BETWEEN d.first_seq AND d.last_seq) AS done_all"""


def counted(conn: psycopg.Connection, count: Callable[[psycopg.Connection], dict[Any, int]],
            call: Callable[[], Any]) -> tuple[Any, dict[Any, int]]:
    """Run ``call()`` in one transaction on the autocommit ``conn``: its result, and how much each of
    ``count(conn)``'s counters rose meanwhile (the ones that did not move left out). ``count`` reads
    this transaction's own statistics, e.g. ``pg_stat_get_xact_*``."""
    conn.execute("BEGIN")
    before = count(conn)
    result = call()
    after = count(conn)
    conn.execute("COMMIT")
    return result, {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def function_calls(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Calls per PL/pgSQL function of ``schema`` in ``conn``'s current transaction (``track_functions``
    on), the ones its backend has not yet flushed to the shared statistics; a ``count`` for :func:`counted`."""
    rows = conn.execute("SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE schemaname = %s",
                        (schema,)).fetchall()
    return {name: int(n) for name, n in rows}


def ring_child_blocks(conn: psycopg.Connection, schema: str, children: str) -> dict[str, int]:
    """Buffers this transaction fetched from each table of ``schema`` whose name matches the regular
    expression ``children`` (a ring's children, e.g. ``'^leases_[0-9]+$'``) and from each of their indexes."""
    rows = sqlx(conn, schema, """
        SELECT r.relname, pg_stat_get_xact_blocks_fetched(r.oid)
        FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
        LEFT JOIN pg_index x ON x.indexrelid = r.oid
        JOIN pg_class t ON t.oid = COALESCE(x.indrelid, r.oid)
        WHERE n.nspname = %s AND t.relkind = 'r' AND t.relname ~ %s""", (schema, children)).fetchall()
    return {name: int(n) for name, n in rows}


def explained(conn: psycopg.Connection, call: Callable[[], Any], *, analyze: bool = False,
              json_format: bool = False) -> tuple[Any, list[str]]:
    """Run ``call()`` with auto_explain sending the plan of every statement it runs on ``conn``
    (nested ones too) to the client as a notice: its result, and the notices' texts. ``analyze``
    adds actual rows and loops (no timing); ``json_format`` writes each plan as JSON."""
    plans: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        plans.append(diag.message_primary or "")

    conn.add_notice_handler(keep)
    conn.execute("LOAD 'auto_explain'")
    settings = {"log_min_duration": "0", "log_nested_statements": "on", "log_level": "notice",
                "log_analyze": "on" if analyze else "off", "log_timing": "off",
                "log_format": "json" if json_format else "text"}
    for k, v in settings.items():
        conn.execute(f"SET auto_explain.{k} = {v}")
    try:
        result = call()
    finally:
        conn.execute("SET auto_explain.log_min_duration = -1")
        conn.remove_notice_handler(keep)
    return result, plans


def lock_waiters(observer: psycopg.Connection, pid: int) -> list[tuple[str, str]]:
    """(locktype, mode) of every lock ``pid`` is waiting for (not granted)."""
    return [(r[0], r[1]) for r in observer.execute(
        "SELECT locktype, mode FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)).fetchall()]


def wait_blocked(observer: psycopg.Connection, pid: int, locktype: str | None = None,
                 timeout: float = 10.0) -> None:
    """Wait until backend ``pid`` waits on a lock (of ``locktype``), as pg_locks shows it."""
    wait_for(lambda: any(locktype is None or lt == locktype for lt, _ in lock_waiters(observer, pid)),
             timeout, f"backend {pid} to wait on a {locktype or 'any'} lock")


def is_waiting(observer: psycopg.Connection, pid: int) -> bool:
    """True if ``pid`` waits on a heavyweight lock right now (pg_locks or pg_stat_activity)."""
    if lock_waiters(observer, pid):
        return True
    row = observer.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return bool(row and row[0] == "Lock")


def leaf_tables(conn: psycopg.Connection, schema: str) -> list[str]:
    """Every plain table and partition of the schema (relkind r), by name."""
    return [r[0] for r in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 1", (schema,)).fetchall()]


def parent_tables(conn: psycopg.Connection, schema: str) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'p' ORDER BY 1", (schema,)).fetchall()]


def row_counts(conn: psycopg.Connection, schema: str, *,
               skip: Iterable[str] = ("schema_migrations",)) -> dict[str, int]:
    """Row count of every table (and partition) of the schema."""
    skip = set(skip)
    out: dict[str, int] = {}
    for t in leaf_tables(conn, schema):
        if t in skip:
            continue
        row = conn.execute(f'SELECT count(*) FROM "{schema}"."{t}"').fetchone()
        assert row is not None
        out[t] = int(row[0])
    return out


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def claim(storage: Storage, conn: psycopg.Connection, queue: str, limit: int = 100) -> list[ClaimSnapshot]:
    """One claim in autocommit (the claim commits at once)."""
    assert conn.autocommit
    return storage.lane_claim(conn, queue, limit)


def complete(storage: Storage, conn: psycopg.Connection, snaps: Sequence[ClaimSnapshot], *,
             whole: bool = False, with_state: Sequence[ClaimSnapshot] = ()) -> list[tuple[int, int]]:
    """Complete attempts in one transaction; ``whole``: the batch holds every job of its receipts."""
    receipts = {(s.claim_slot, s.claim_id) for s in snaps} if whole else ()
    with conn.transaction():
        return storage.receipt_complete(conn, snaps, receipts, with_state)


def close(storage: Storage, conn: psycopg.Connection, snap: ClaimSnapshot, outcome: int,
          delay: float | None = None, error: str | None = None) -> str:
    """attempt_close of one attempt in autocommit; the status word."""
    [res] = storage.attempt_close(conn, [(snap, outcome, delay, error)])
    assert (res.job_id, res.run_lease) == (snap.job_id, snap.run_lease)
    return res.status


def counts(storage: Storage, conn: psycopg.Connection, queue: str) -> dict[str, int]:
    """queue_counts_exact of one queue, zero entries dropped."""
    return {k: v for k, v in storage.queue_counts_exact(conn).get(queue, {}).items() if v}


def load(storage: Storage, conn: psycopg.Connection, job_id: int) -> dict[str, Any] | None:
    return storage.job_load(conn, job_id)


def done_rows(conn: psycopg.Connection, schema: str, job_id: int) -> list[dict[str, Any]]:
    cur = sqlx(conn, schema, "SELECT ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state, queue, "
                             f"kind, error FROM {DONE_ALL} WHERE job_id = %s ORDER BY run_lease",
               (job_id,))
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def deferred_row(conn: psycopg.Connection, schema: str, job_id: int) -> dict[str, Any] | None:
    cur = sqlx(conn, schema, "SELECT *, extract(epoch FROM run_at - now())::float8 AS due_in "
                             "FROM __SCHEMA__.deferred_jobs WHERE job_id = %s", (job_id,))
    names = [d.name for d in cur.description or ()]
    row = cur.fetchone()
    return None if row is None else dict(zip(names, row))


def make_due(conn: psycopg.Connection, schema: str) -> int:
    """Make every deferred job due (run_at one second in the past, database clock)."""
    return sqlx(conn, schema, "UPDATE __SCHEMA__.deferred_jobs SET run_at = now() - interval '1 s'").rowcount


def jloads(raw: bytes | None) -> Any:
    return None if raw is None else orjson.loads(raw)


def raw(obj: Any) -> RawJson:
    return RawJson(orjson.dumps(obj))


def client(schema: str) -> Client:
    return Client(None, schema)


def enqueue(schema: str, conn: psycopg.Connection, queue: str, args: Any = None, **kw: Any) -> int:
    """Client.enqueue on ``conn`` (autocommit: committed at once)."""
    return client(schema).enqueue(kw.pop("kind", KIND), args if args is not None else {}, queue=queue,
                                  conn=conn, **kw)


def warm_lanes(conn: psycopg.Connection, schema: str, queue: str, priority: int, shards: int) -> list[int]:
    """Create the lanes of (queue, priority) shard 0..shards-1 up front (committed)."""
    return [int(r[0]) for r in sqlx(conn, schema, "SELECT __SCHEMA__.lane_ensure(%s, %s, s) "
                                                  "FROM generate_series(0, %s - 1) s ORDER BY s",
                                    (queue, priority, shards)).fetchall()]


def claim_seq_value(conn: psycopg.Connection, schema: str, lane_id: int) -> int:
    return int(scalar(conn, schema, "SELECT pg_sequence_last_value(claim_seq) FROM __SCHEMA__.queue_claim_heads "
                                    "WHERE lane_id = %s", (lane_id,)))


def ring_current(storage: Storage, conn: psycopg.Connection, ring: str) -> int:
    return int(storage.ring_state(conn)[ring]["slot"])


def rotate_and_prune(storage: Storage, conn: psycopg.Connection, ring: str) -> tuple[int | None, dict[int, str]]:
    """Rotate ``ring`` once, then try to prune every sealed slot; (new slot, {slot: outcome})."""
    new = storage.ring_rotate(conn, ring)
    state = storage.ring_state(conn)[ring]
    out = {}
    for s in range(int(state["slots"])):
        if s != state["slot"]:
            out[s] = storage.ring_prune(conn, ring, s)
    return new, out


def ensure_pgstattuple(conn: psycopg.Connection) -> None:
    conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")


def dead_tuples_exact(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Exact dead tuples (pgstattuple) of every table and partition of the schema, non-zero ones."""
    out: dict[str, int] = {}
    for t in leaf_tables(conn, schema):
        row = conn.execute("SELECT dead_tuple_count FROM pgstattuple(%s::regclass)",
                           (f'"{schema}"."{t}"',)).fetchone()
        assert row is not None
        if row[0]:
            out[t] = int(row[0])
    return out


def disable_autovacuum(conn: psycopg.Connection, schema: str) -> None:
    """autovacuum_enabled = false on every table, partitioned parent and partition of the schema."""
    for t in leaf_tables(conn, schema):
        conn.execute(f'ALTER TABLE "{schema}"."{t}" SET (autovacuum_enabled = false)')
    for t in parent_tables(conn, schema):
        try:
            with conn.transaction():
                conn.execute(f'ALTER TABLE "{schema}"."{t}" SET (autovacuum_enabled = false)')
        except psycopg.errors.DatabaseError:
            pass  # partitioned parents hold no tuples; some versions refuse storage options on them
