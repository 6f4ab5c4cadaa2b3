"""``App.enqueue`` without ``conn=`` runs on one cursor per pool connection, never shared between threads.

A new cursor per call (``conn.execute``) builds a psycopg Transformer: ~14 µs
of client CPU, a fifth of a single enqueue, and 15% of a producer's CPU in
the 10-producer scenario (docs/performance-log.md, 2026-12-02 producers). The
App keeps one cursor on each connection of its own pool. A pool connection
belongs to one thread from ``getconn`` to ``putconn``, so its cursor does
too; a caller's connection (``conn=``) may be shared and still gets a new
cursor per call. A job to run now skips the cursor too
(tests/integration/test_app_enqueue_direct.py); a scheduled one uses it.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from awa_fast import App
from tests.fixtures.database import sqlx

Q = "cursorq"


@pytest.fixture
def cursors_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every psycopg cursor built from a connection (``Connection.cursor``, which ``execute`` calls)."""
    made: list[int] = []
    real = psycopg.Connection.cursor

    def counting(self: psycopg.Connection, *args: object, **kwargs: object) -> object:
        made.append(1)
        return real(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(psycopg.Connection, "cursor", counting)
    return made


def test_single_enqueues_reuse_the_pool_connections_cursor(pg_dsn, schema, conn, cursors_made):
    with App(pg_dsn, schema) as app:
        first = app.enqueue("cursor.kind", {"i": -1}, queue=Q)  # opens the pool
        later = [app.enqueue("cursor.kind", {"i": 100}, queue=Q, delay=3600)]  # builds the cursor
        before = len(cursors_made)
        ids = [app.enqueue("cursor.kind", {"i": i}, queue=Q) for i in range(50)]  # no cursor: the direct path
        later.append(app.enqueue("cursor.kind", {"i": 50}, queue=Q, delay=3600))  # the delayed statement reuses it
        assert len(cursors_made) == before  # a new cursor per call would make 51 here
    rows = dict(sqlx(conn, schema, "SELECT job_id, (args->>'i')::int FROM __SCHEMA__.ready_entries "
                                   "WHERE job_id = ANY(%s)", (ids + [first],)).fetchall())
    assert rows == {first: -1, **{job_id: i for i, job_id in enumerate(ids)}}
    deferred = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.deferred_jobs WHERE job_id = ANY(%s) "
                                  "ORDER BY job_id", (later,)).fetchall()
    assert deferred == [(100,), (50,)]


def test_a_callers_connection_gets_a_new_cursor_per_call(pg_dsn, schema, cursors_made):
    with App(pg_dsn, schema) as app, psycopg.connect(pg_dsn) as own:
        app.enqueue("cursor.kind", {"i": 0}, queue=Q, conn=own)
        before = len(cursors_made)
        for i in range(5):
            app.enqueue("cursor.kind", {"i": i}, queue=Q, conn=own)
        own.rollback()
        assert len(cursors_made) - before == 5


def test_threads_sharing_an_app_each_get_their_own_jobs_id(pg_dsn, schema, conn):
    per_thread, threads = 150, 6
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with App(pg_dsn, schema, pool_size=2) as app:  # more threads than connections: they take turns
        app.enqueue("cursor.kind", {"t": -1, "n": -1}, queue=Q)
        start = threading.Barrier(threads)

        def produce(t: int) -> None:
            try:
                start.wait()
                got[t] = [app.enqueue("cursor.kind", {"t": t, "n": n}, queue=Q) for n in range(per_thread)]
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors
    ids = [job_id for t in range(threads) for job_id in got[t]]
    assert len(set(ids)) == threads * per_thread
    rows = sqlx(conn, schema, "SELECT job_id, (args->>'t')::int, (args->>'n')::int FROM __SCHEMA__.ready_entries "
                              "WHERE job_id = ANY(%s)", (ids,)).fetchall()
    assert {job_id: (t, n) for job_id, t, n in rows} == {
        job_id: (t, n) for t in range(threads) for n, job_id in enumerate(got[t])}
