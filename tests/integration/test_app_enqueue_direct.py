"""``App.enqueue`` of a job to run now goes through one prepared statement on libpq itself.

On the App's own pool connections (autocommit, one thread from ``getconn`` to
``putconn``) the single enqueue skips psycopg's cursor layer: the same
``job_enqueue_v3`` call, prepared once per session, parameters encoded in
binary by the caller (``Storage.job_enqueue_direct``). These tests hold it to
the cursor path's contract: the same rows, the same psycopg errors, a pool
connection that stays usable after an error, and a session that lost its
statements (``DEALLOCATE ALL``, ``DISCARD ALL``) prepares it again.
"""

from __future__ import annotations

import logging

import psycopg
import pytest

from awa_fast import App, PayloadError, Unique, UniqueConflict
from awa_fast.storage.connection import PoolConnection
from tests.fixtures.database import sqlx

Q = "directq"


def _statements(app: App) -> list[str]:
    """Names of the prepared statements of the App's one pool connection (pool_size=1)."""
    with app._pool().connection() as pc:
        return [r[0] for r in pc.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'awa_fast_%'")]


def test_a_job_to_run_now_is_stored_as_the_cursor_path_stores_it(pg_dsn, schema, conn):
    with App(pg_dsn, schema, pool_size=1) as app, psycopg.connect(pg_dsn) as own:
        direct = app.enqueue("direct.kind", {"n": 1, "s": "é\u2603"}, queue=Q, priority=3, max_attempts=7,
                             metadata={"m": [1, 2]})
        via_cursor = app.enqueue("direct.kind", {"n": 1, "s": "é\u2603"}, queue=Q, priority=3, max_attempts=7,
                                 metadata={"m": [1, 2]}, conn=own)
        own.commit()
        no_metadata = app.enqueue("direct.kind", None, queue=Q)
        assert _statements(app)  # the direct path ran: its statement lives on the session
        jobs = {job_id: app.get_job(job_id) for job_id in (direct, via_cursor, no_metadata)}
    fields = ("state", "queue", "kind", "args", "metadata", "attempt", "max_attempts", "priority")
    got = {job_id: {f: getattr(info, f) for f in fields} for job_id, info in jobs.items() if info is not None}
    assert got[direct] == got[via_cursor] == {
        "state": "available", "queue": Q, "kind": "direct.kind", "args": {"n": 1, "s": "é\u2603"},
        "metadata": {"m": [1, 2]}, "attempt": 0, "max_attempts": 7, "priority": 3}
    assert got[no_metadata]["args"] == {} and got[no_metadata]["metadata"] is None
    assert len({direct, via_cursor, no_metadata}) == 3


def test_a_server_error_raises_the_psycopg_class_and_the_connection_stays_usable(pg_dsn, schema, conn):
    fn = sqlx(conn, schema, "SELECT 'job_enqueue_v3(text, int, text, jsonb, jsonb, int, timestamptz)'"
                            "::text").fetchone()[0]
    original = sqlx(conn, schema, f"SELECT pg_get_functiondef('__SCHEMA__.{fn}'::regprocedure)").fetchone()[0]
    with App(pg_dsn, schema, pool_size=1) as app:
        before = app.enqueue("direct.kind", {"i": 0}, queue=Q)
        sqlx(conn, schema, "CREATE OR REPLACE FUNCTION __SCHEMA__.job_enqueue_v3(p_queue text, p_priority int, "
                           "p_kind text, p_args jsonb, p_metadata jsonb, p_max_attempts int, p_run_at timestamptz) "
                           "RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused for the test' "
                           "USING ERRCODE = '40001'; END $$")
        with pytest.raises(psycopg.errors.SerializationFailure, match="refused for the test"):
            app.enqueue("direct.kind", {"i": 1}, queue=Q)
        conn.execute(original)
        after = app.enqueue("direct.kind", {"i": 2}, queue=Q)  # the same pool connection, still usable
        with app._pool().connection() as pc:
            assert pc.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    found = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.ready_entries "
                               "ORDER BY job_id").fetchall()
    assert found == [(0,), (2,)] and after > before


@pytest.mark.parametrize("forget", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_a_session_that_lost_the_statement_prepares_it_again(pg_dsn, schema, conn, forget):
    with App(pg_dsn, schema, pool_size=1) as app:
        app.enqueue("direct.kind", {"i": 0}, queue=Q)
        names = _statements(app)
        assert len(names) == 1
        with app._pool().connection() as pc:
            pc.execute(forget)
        assert _statements(app) == []
        app.enqueue("direct.kind", {"i": 1}, queue=Q)
        assert _statements(app) == names
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (2,)


def test_a_statement_the_session_has_but_the_connection_did_not_note_is_used(pg_dsn, schema, conn):
    """A prepare interrupted after the server ran it (a KeyboardInterrupt) leaves the statement on
    the session and not in the connection's set: the next call's prepare meets "already exists"
    (42P05), which must count as prepared, not fail every enqueue on that connection."""
    with App(pg_dsn, schema, pool_size=1) as app:
        name, sql = app.storage._enqueue_direct
        with app._pool().connection() as pc:
            assert pc.pgconn.prepare(name, sql).status == psycopg.pq.ExecStatus.COMMAND_OK
            pc._prepared_direct = None  # the interrupted call never noted it
        app.enqueue("direct.kind", {"i": 0}, queue=Q)
        app.enqueue("direct.kind", {"i": 1}, queue=Q)
        assert _statements(app) == [name.decode()]
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (2,)


def test_a_lost_session_raises_operational_error_and_the_pool_replaces_it(pg_dsn, schema, conn):
    with App(pg_dsn, schema, pool_size=1) as app:
        app.enqueue("direct.kind", {"i": 0}, queue=Q)
        with app._pool().connection() as pc:
            pid = pc.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            app.enqueue("direct.kind", {"i": 1}, queue=Q)
        app.enqueue("direct.kind", {"i": 2}, queue=Q)  # a new session, which prepares the statement anew
        with app._pool().connection() as pc:
            assert pc.info.backend_pid != pid
    found = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.ready_entries "
                               "ORDER BY job_id").fetchall()
    assert found == [(0,), (2,)]


def test_run_prepared_refuses_a_connection_in_a_transaction(pg_dsn):
    with PoolConnection.connect(pg_dsn) as pc:  # not autocommit: the call could not be its own transaction
        with pytest.raises(psycopg.ProgrammingError, match="idle autocommit"):
            pc.run_prepared(b"awa_fast_probe", b"SELECT 1", ())
        pc.autocommit = True
        pc.execute("BEGIN")
        with pytest.raises(psycopg.ProgrammingError, match="idle autocommit"):
            pc.run_prepared(b"awa_fast_probe", b"SELECT 1", ())


def test_every_call_gives_the_pool_connection_back_idle(pg_dsn, schema, conn, caplog):
    """The App lends its pool connection for one call (``getconn`` .. ``putconn``), without the
    connection's own commit-on-exit: a call must end every transaction it opens, or ``putconn``
    rolls it back (and psycopg_pool logs a warning). With one connection: calls that succeed
    (single, scheduled, bulk and unique enqueues, loads, lists, counts, a cancel, queue settings,
    a pause and a resume) and calls that fail (a streamed bulk call whose bad payload past its
    first block fails it inside its transaction, a unique enqueue whose key is held) each give it
    back idle, and the next call gets the same backend."""
    caplog.set_level(logging.WARNING, logger="psycopg.pool")
    items: list[object] = [{"i": i} for i in range(1500)]
    items[1400] = {"bad": float("nan")}
    once = Unique(by_args=True)
    with App(pg_dsn, schema, pool_size=1) as app:
        with app._pool().connection() as pc:
            pid = pc.info.backend_pid
        first = app.enqueue("direct.kind", {"i": "first"}, queue=Q)
        app.enqueue("direct.kind", {"i": "later"}, queue=Q, delay=3600)
        assert app.enqueue_many("direct.kind", [{"i": i} for i in range(3)], queue=Q) == 3
        app.enqueue("direct.kind", {"u": 1}, queue=Q, unique=once)
        assert app.get_job(first) is not None and app.list_jobs(queue=Q)
        assert app.counts(Q) and app.queue_settings(Q).queue == Q
        assert app.pause(Q) and app.resume(Q)
        assert app.cancel(first)
        with pytest.raises(PayloadError):
            app.enqueue_many("direct.kind", items, queue=Q)
        with pytest.raises(UniqueConflict):
            app.enqueue("direct.kind", {"u": 1}, queue=Q, unique=once)
        last = app.enqueue("direct.kind", {"i": "last"}, queue=Q)
        with app._pool().connection() as pc:
            assert (pc.info.backend_pid, pc.info.transaction_status) == (pid, psycopg.pq.TransactionStatus.IDLE)
        assert app.get_job(last) is not None
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg.pool")] == []
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (6,)
