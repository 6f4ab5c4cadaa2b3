"""``App.enqueue_async`` of a job to run now: one prepared statement on libpq's asynchronous calls.

The async twin of ``test_app_enqueue_direct.py``. On the App's own async pool
connections (``AsyncPoolConnection``: autocommit, one task from ``getconn`` to
``putconn``) the single enqueue skips psycopg's cursor layer
(``Storage.job_enqueue_direct_async``). These tests hold it to the cursor path's
contract: the same rows, the same psycopg errors, a pool connection that stays
usable after an error or a cancelled task, and a session that lost its
statements prepares it again. The pool connection is lent with ``getconn`` and
``putconn`` alone, so every call must give it back idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import generators

from awa_fast import App, Client, PayloadError, Unique, UniqueConflict
from awa_fast.storage.connection import AsyncPoolConnection
from tests.fixtures.database import sqlx

Q = "adirectq"


async def _on_pool_conn(app: App, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """``fn(connection)`` on the App's async pool connection (pool_size=1: its only one)."""
    pool = await app._apool()
    async with pool.connection() as pc:
        return await fn(pc)


async def _statements(app: App) -> list[str]:
    async def names(pc: Any) -> list[str]:
        cur = await pc.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'awa_fast_%'")
        return [r[0] for r in await cur.fetchall()]
    return await _on_pool_conn(app, names)


async def _backend(app: App) -> tuple[int, psycopg.pq.TransactionStatus]:
    async def info(pc: Any) -> tuple[int, psycopg.pq.TransactionStatus]:
        return pc.info.backend_pid, pc.info.transaction_status
    return await _on_pool_conn(app, info)


def test_a_job_to_run_now_is_stored_as_the_cursor_path_stores_it(pg_dsn, schema, conn):
    async def scenario() -> tuple[dict[int, Any], list[str]]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            direct = await app.enqueue_async("direct.kind", {"n": 1, "s": "é\u2603"}, queue=Q, priority=3,
                                             max_attempts=7, metadata={"m": [1, 2]})
            async with await psycopg.AsyncConnection.connect(pg_dsn) as own:
                via_cursor = await app.enqueue_async("direct.kind", {"n": 1, "s": "é\u2603"}, queue=Q,
                                                     priority=3, max_attempts=7, metadata={"m": [1, 2]}, conn=own)
                await own.commit()
            no_metadata = await app.enqueue_async("direct.kind", None, queue=Q)
            names = await _statements(app)
            jobs = {job_id: await app.get_job_async(job_id) for job_id in (direct, via_cursor, no_metadata)}
            return jobs, names

    jobs, names = asyncio.run(scenario())
    assert names  # the direct path ran: its statement lives on the session
    fields = ("state", "queue", "kind", "args", "metadata", "attempt", "max_attempts", "priority")
    got = [{f: getattr(info, f) for f in fields} for info in jobs.values()]
    assert got[0] == got[1] == {
        "state": "available", "queue": Q, "kind": "direct.kind", "args": {"n": 1, "s": "é\u2603"},
        "metadata": {"m": [1, 2]}, "attempt": 0, "max_attempts": 7, "priority": 3}
    assert got[2]["args"] == {} and got[2]["metadata"] is None
    assert len(jobs) == 3


def test_the_async_pool_hands_out_the_direct_connection_class(pg_dsn, schema, conn):
    async def scenario() -> type:
        async with App(pg_dsn, schema, pool_size=1) as app:
            return await _on_pool_conn(app, lambda pc: asyncio.sleep(0, type(pc)))

    assert issubclass(asyncio.run(scenario()), AsyncPoolConnection)


def test_a_server_error_raises_the_psycopg_class_and_the_connection_stays_usable(pg_dsn, schema, conn):
    fn = sqlx(conn, schema, "SELECT 'job_enqueue_v3(text, int, text, jsonb, jsonb, int, timestamptz)'"
                            "::text").fetchone()[0]
    original = sqlx(conn, schema, f"SELECT pg_get_functiondef('__SCHEMA__.{fn}'::regprocedure)").fetchone()[0]

    async def scenario() -> tuple[int, int, psycopg.pq.TransactionStatus]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            before = await app.enqueue_async("direct.kind", {"i": 0}, queue=Q)
            sqlx(conn, schema, "CREATE OR REPLACE FUNCTION __SCHEMA__.job_enqueue_v3(p_queue text, p_priority int, "
                               "p_kind text, p_args jsonb, p_metadata jsonb, p_max_attempts int, "
                               "p_run_at timestamptz) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN "
                               "RAISE EXCEPTION 'refused for the test' USING ERRCODE = '40001'; END $$")
            with pytest.raises(psycopg.errors.SerializationFailure, match="refused for the test"):
                await app.enqueue_async("direct.kind", {"i": 1}, queue=Q)
            conn.execute(original)
            after = await app.enqueue_async("direct.kind", {"i": 2}, queue=Q)  # the same connection, usable
            return before, after, (await _backend(app))[1]

    before, after, status = asyncio.run(scenario())
    assert status == psycopg.pq.TransactionStatus.IDLE
    found = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.ready_entries ORDER BY job_id").fetchall()
    assert found == [(0,), (2,)] and after > before


@pytest.mark.parametrize("forget", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_a_session_that_lost_the_statement_prepares_it_again(pg_dsn, schema, conn, forget):
    async def scenario() -> tuple[list[str], list[str], list[str]]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            await app.enqueue_async("direct.kind", {"i": 0}, queue=Q)
            names = await _statements(app)
            await _on_pool_conn(app, lambda pc: pc.execute(forget))
            gone = await _statements(app)
            await app.enqueue_async("direct.kind", {"i": 1}, queue=Q)
            return names, gone, await _statements(app)

    names, gone, again = asyncio.run(scenario())
    assert len(names) == 1 and gone == [] and again == names
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (2,)


def test_a_statement_the_session_has_but_the_connection_did_not_note_is_used(pg_dsn, schema, conn):
    """A task cancelled after the server prepared the statement, before the connection noted it,
    leaves it on the session alone: the next prepare meets "already exists" (42P05), which must
    count as prepared, not fail every enqueue on that pool connection until it is replaced."""
    async def scenario() -> tuple[bytes, list[str]]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            name, sql = app.storage._enqueue_direct

            async def prepare_unnoted(pc: Any) -> None:
                pc.pgconn.send_prepare(name, sql)
                (res,) = await pc.wait(generators.execute(pc.pgconn))
                assert res.status == psycopg.pq.ExecStatus.COMMAND_OK
                pc._prepared_direct = None

            await _on_pool_conn(app, prepare_unnoted)
            await app.enqueue_async("direct.kind", {"i": 0}, queue=Q)
            await app.enqueue_async("direct.kind", {"i": 1}, queue=Q)
            return name, await _statements(app)

    name, names = asyncio.run(scenario())
    assert names == [name.decode()]
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (2,)


def test_a_client_without_an_async_connection_says_to_pass_one(pg_dsn, schema, conn):
    client = Client(dsn=pg_dsn, schema=schema)
    with pytest.raises(PayloadError, match="pass conn="):
        asyncio.run(client.enqueue_async("direct.kind", {"i": 0}, conn=None, queue=Q))
    client.close()


def test_a_lost_session_raises_operational_error_and_the_pool_replaces_it(pg_dsn, schema, conn):
    async def scenario() -> tuple[int, int]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            await app.enqueue_async("direct.kind", {"i": 0}, queue=Q)
            pid = (await _backend(app))[0]
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
            with pytest.raises(psycopg.OperationalError):
                await app.enqueue_async("direct.kind", {"i": 1}, queue=Q)
            await app.enqueue_async("direct.kind", {"i": 2}, queue=Q)  # a new session prepares it anew
            return pid, (await _backend(app))[0]

    pid, new_pid = asyncio.run(scenario())
    assert new_pid != pid
    found = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.ready_entries ORDER BY job_id").fetchall()
    assert found == [(0,), (2,)]


def test_a_task_cancelled_while_its_enqueue_waits_stores_nothing_and_the_connection_goes_on(pg_dsn, schema, conn):
    """The enqueue waits on a lock another session holds; the task is cancelled: psycopg
    cancels the statement on the server, the job is not stored, and the App's one pool
    connection comes back idle for the next call."""
    blocker = psycopg.connect(pg_dsn)

    async def scenario() -> tuple[int, int, psycopg.pq.TransactionStatus]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            await app.enqueue_async("direct.kind", {"i": 0}, queue=Q)  # the queue's lanes exist
            pid = (await _backend(app))[0]
            sqlx(blocker, schema, "LOCK TABLE __SCHEMA__.ready_entries IN ACCESS EXCLUSIVE MODE")
            task = asyncio.create_task(app.enqueue_async("direct.kind", {"i": 1}, queue=Q))
            deadline = time.monotonic() + 30
            while not conn.execute("SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity "
                                   "WHERE pid = %s", (pid,)).fetchone()[0]:
                assert not task.done(), task  # the enqueue must be waiting on the lock, not over
                assert time.monotonic() < deadline, "the enqueue never waited on the lock"
                await asyncio.sleep(0.01)  # polls the server's view: the wait has no event to await
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            blocker.rollback()
            last = await app.enqueue_async("direct.kind", {"i": 2}, queue=Q)
            backend, status = await _backend(app)
            return last, backend, status

    try:
        last, backend, status = asyncio.run(scenario())
    finally:
        blocker.close()
    assert last > 0 and status == psycopg.pq.TransactionStatus.IDLE
    found = sqlx(conn, schema, "SELECT (args->>'i')::int FROM __SCHEMA__.ready_entries ORDER BY job_id").fetchall()
    assert found == [(0,), (2,)]


def test_run_prepared_refuses_a_connection_in_a_transaction(pg_dsn):
    async def scenario() -> None:
        async with await AsyncPoolConnection.connect(pg_dsn) as pc:  # not autocommit
            with pytest.raises(psycopg.ProgrammingError, match="idle autocommit"):
                await pc.run_prepared(b"awa_fast_probe", b"SELECT 1", ())
            await pc.set_autocommit(True)
            await pc.execute("BEGIN")
            with pytest.raises(psycopg.ProgrammingError, match="idle autocommit"):
                await pc.run_prepared(b"awa_fast_probe", b"SELECT 1", ())

    asyncio.run(scenario())


def test_every_async_call_gives_the_pool_connection_back_idle(pg_dsn, schema, conn, caplog):
    """As the sync test of the same name: with one async pool connection, calls that succeed
    and calls that fail (a streamed bulk call failing inside its transaction, a held unique
    key) each give it back idle, the next call gets the same backend, and psycopg_pool logs
    no warning."""
    caplog.set_level(logging.WARNING, logger="psycopg.pool")
    items: list[object] = [{"i": i} for i in range(1500)]
    items[1400] = {"bad": float("nan")}
    once = Unique(by_args=True)

    async def scenario() -> tuple[int, tuple[int, psycopg.pq.TransactionStatus]]:
        async with App(pg_dsn, schema, pool_size=1) as app:
            pid = (await _backend(app))[0]
            first = await app.enqueue_async("direct.kind", {"i": "first"}, queue=Q)
            await app.enqueue_async("direct.kind", {"i": "later"}, queue=Q, delay=3600)
            assert await app.enqueue_many_async("direct.kind", [{"i": i} for i in range(3)], queue=Q) == 3
            await app.enqueue_async("direct.kind", {"u": 1}, queue=Q, unique=once)
            assert await app.get_job_async(first) is not None and await app.list_jobs_async(queue=Q)
            assert await app.counts_async(Q) and (await app.queue_settings_async(Q)).queue == Q
            assert await app.pause_async(Q) and await app.resume_async(Q)
            assert await app.cancel_async(first)
            with pytest.raises(PayloadError):
                await app.enqueue_many_async("direct.kind", items, queue=Q)
            with pytest.raises(UniqueConflict):
                await app.enqueue_async("direct.kind", {"u": 1}, queue=Q, unique=once)
            with pytest.raises(PayloadError):  # refused before anything is written
                await app.enqueue_async("direct.kind", {"bad": float("inf")}, queue=Q)
            last = await app.enqueue_async("direct.kind", {"i": "last"}, queue=Q)
            assert await app.get_job_async(last) is not None
            return pid, await _backend(app)

    pid, (backend, status) = asyncio.run(scenario())
    assert (backend, status) == (pid, psycopg.pq.TransactionStatus.IDLE)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg.pool")] == []
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries").fetchone() == (6,)
