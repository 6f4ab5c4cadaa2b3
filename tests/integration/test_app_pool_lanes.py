"""One thread enqueuing through an App uses one backend, so its jobs share one lane.

A lane is picked by the enqueuing backend (shard = backend pid modulo the
queue's enqueue shards). When the App's pool grew to two connections on its
first call (the caller found it still filling) and then handed them out in
turn, a single-threaded producer spread its jobs over two lanes, and every
claim of that queue took the several-lanes ordering path: ~2.5x the buffer
reads per claimed job, the pickup-latency regression of this round
(docs/performance-log.md, "p-regress").
"""

from __future__ import annotations

import asyncio

import psycopg

from awa_fast import App
from tests.fixtures.database import sqlx

Q = "poolq"


def app_backends(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                       (f"awa_fast:app:{schema}",)).fetchone()
    assert row is not None
    return int(row[0])


def lanes_of(conn: psycopg.Connection, schema: str, queue: str) -> int:
    row = sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.queue_claim_heads WHERE queue = %s",
               (queue,)).fetchone()
    assert row is not None
    return int(row[0])


def test_one_thread_enqueues_through_one_backend_into_one_lane(pg_dsn, schema, conn):
    with App(pg_dsn, schema) as app:
        ids = [app.enqueue("pool.kind", {"i": i}, queue=Q) for i in range(20)]
        assert app_backends(conn, schema) == 1
    assert len({job_id >> 40 for job_id in ids}) == 1
    assert lanes_of(conn, schema, Q) == 1


def test_one_task_enqueues_through_one_async_backend_into_one_lane(pg_dsn, schema, conn):
    async def produce() -> tuple[list[int], int]:
        app = App(pg_dsn, schema)
        try:
            ids = [await app.enqueue_async("pool.kind", {"i": i}, queue=Q) for i in range(20)]
            return ids, app_backends(conn, schema)
        finally:
            await app.aclose()

    ids, backends = asyncio.run(produce())
    assert backends == 1
    assert len({job_id >> 40 for job_id in ids}) == 1
    assert lanes_of(conn, schema, Q) == 1
