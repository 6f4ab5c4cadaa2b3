"""Async enqueue twins on psycopg.AsyncConnection, inside the caller's transaction."""

from __future__ import annotations

import asyncio

import psycopg

from awa_fast.app import App


def test_async_enqueue_and_copy_commit_and_roll_back_with_the_caller(pg_dsn, schema, storage, conn) -> None:
    app = App(pg_dsn, schema)

    async def scenario() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            one = await app.enqueue_async("k", {"n": 1}, conn=aconn, queue="aq")
            many = await app.enqueue_many_async("k", [{"n": i} for i in range(500)], conn=aconn, queue="aq")
            await aconn.rollback()
            await app.enqueue_async("k", {"n": 2}, conn=aconn, queue="aq")
            kept = await app.enqueue_many_async("k", [{"n": i} for i in range(300)], conn=aconn, queue="aq")
            await aconn.commit()
            return one, many + kept

    one, total = asyncio.run(scenario())
    assert one > 0 and total == 800
    # only the committed half is there
    assert storage.queue_counts_exact(conn)["aq"] == {"available": 301}
    app.close()
