"""A streamed bulk enqueue: rows go to PostgreSQL while later payloads are still being checked.

A bad payload found after earlier rows (or whole earlier COPY chunks) were
sent still raises its typed error before anything commits: everything the
call wrote is undone (a savepoint inside the caller's transaction, which
stays usable with its own work), and the lane numbers it reserved are a gap
the claim passes exactly as it passes the gap of a rolled-back single
enqueue.
"""

from __future__ import annotations

import asyncio
import json
import math

import psycopg
import pytest

from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.errors import PayloadError
from awa_fast.storage.copy_rows import COPY_BLOCK
from tests.fixtures.database import connect
from tests.integration.storage_helpers import claim, counts, enqueue, row_counts, warm_lanes

INTRANS = psycopg.pq.TransactionStatus.INTRANS


def _rows(n: int, bad_at: int | None = None) -> list[object]:
    rows: list[object] = [{"i": i} for i in range(n)]
    if bad_at is not None:
        rows[bad_at] = {"i": math.nan}
    return rows


def _enqueue_seq(conn: psycopg.Connection, schema: str, queue: str) -> int:
    """The last lane number handed out on ``queue``'s only lane."""
    row = conn.execute(f'SELECT pg_sequence_last_value(h.enqueue_seq) FROM "{schema}".queue_enqueue_heads h '
                       f'JOIN "{schema}".queue_lanes l USING (lane_id) WHERE l.queue = %s', (queue,)).fetchone()
    assert row is not None
    return int(row[0] or 0)


def test_bad_payload_in_a_later_chunk_undoes_the_earlier_chunks_and_keeps_the_callers_work(
        pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, "sq", enqueue_shards=1)
    warm_lanes(conn, schema, "sq", 2, 1)  # the lane exists (committed) before the caller's transaction
    conn.execute(f'CREATE TABLE "{schema}".caller_rows (id int PRIMARY KEY)')
    cli = Client(None, schema)
    before = row_counts(conn, schema, skip=("schema_migrations", "caller_rows"))
    with connect(pg_dsn, schema, autocommit=False, tag="caller") as p:
        p.execute(f'INSERT INTO "{schema}".caller_rows VALUES (1)')
        with pytest.raises(PayloadError) as info:
            # chunks of 500: three whole COPYs are sent before the bad row of the fourth is checked
            cli.enqueue_many("k", _rows(2000, bad_at=1700), queue="sq", conn=p, chunk=500)
        assert "nothing was enqueued" in str(info.value)
        assert p.info.transaction_status == INTRANS  # still usable
        assert row_counts(p, schema, skip=("schema_migrations", "caller_rows")) == before
        assert p.execute(f'SELECT count(*) FROM "{schema}".caller_rows').fetchone() == (1,)
        assert _enqueue_seq(p, schema, "sq") >= 1500  # the earlier chunks did reserve (and write) their rows
        good = cli.enqueue("k", {"good": 1}, queue="sq", conn=p)
        p.commit()
    assert [s.job_id for s in claim(storage, conn, "sq", 100)] == [good]
    assert conn.execute(f'SELECT count(*) FROM "{schema}".caller_rows').fetchone() == (1,)


def test_bad_payload_after_streamed_blocks_commits_nothing_on_the_clients_own_connection(
        pg_dsn, schema, storage, conn):
    cli = Client(pg_dsn, schema)
    before = row_counts(conn, schema)
    try:
        with pytest.raises(PayloadError):
            cli.enqueue_many("k", _rows(3 * COPY_BLOCK, bad_at=2 * COPY_BLOCK + 5), queue="oq")
        assert row_counts(conn, schema) == before
        assert claim(storage, conn, "oq", 100) == []
        # the client's connection is clean again: the next call commits
        assert cli.enqueue_many("k", _rows(3), queue="oq") == 3
    finally:
        cli.close()
    assert len(claim(storage, conn, "oq", 100)) == 3


def test_claim_passes_an_aborted_bulk_gap_as_it_passes_an_aborted_single_enqueue(pg_dsn, schema, storage, conn):
    cli = Client(None, schema)
    for q in ("single", "bulk"):
        storage.queue_configure(conn, q, enqueue_shards=1)
        enqueue(schema, conn, q, {"first": 1})  # a committed row before the gap
    with connect(pg_dsn, schema, autocommit=False, tag="single") as p:
        enqueue(schema, p, "single", {"lost": 1})
        p.rollback()
    with connect(pg_dsn, schema, tag="bulk") as p, pytest.raises(PayloadError):
        cli.enqueue_many("k", _rows(2 * COPY_BLOCK + 10, bad_at=2 * COPY_BLOCK), queue="bulk", conn=p,
                         chunk=COPY_BLOCK)
    gaps = {q: _enqueue_seq(conn, schema, q) - 1 for q in ("single", "bulk")}
    assert gaps == {"single": 1, "bulk": 2 * COPY_BLOCK + 10}  # numbers handed out and never committed
    for q in ("single", "bulk"):
        assert [s.args for s in claim(storage, conn, q, 100)] == [b'{"first": 1}']
        assert claim(storage, conn, q, 100) == []  # nothing behind the gap yet: nothing claimed, no stall
    after = {q: cli.enqueue_many("k", _rows(5), queue=q, conn=conn, return_ids=True) for q in ("single", "bulk")}
    for q in ("single", "bulk"):
        assert counts(storage, conn, q)["available"] == 5
        assert [s.job_id for s in claim(storage, conn, q, 100)] == after[q]
        assert claim(storage, conn, q, 100) == []


def test_async_bad_payload_in_a_later_block_keeps_the_callers_transaction(pg_dsn, schema, storage, conn):
    app = App(pg_dsn, schema)

    async def scenario() -> int:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            kept = await app.enqueue_many_async("k", _rows(10), conn=aconn, queue="aq")
            with pytest.raises(PayloadError):
                await app.enqueue_many_async("k", _rows(2 * COPY_BLOCK, bad_at=COPY_BLOCK + 1), conn=aconn,
                                             queue="aq")
            assert aconn.info.transaction_status == INTRANS
            kept += await app.enqueue_many_async("k", _rows(3), conn=aconn, queue="aq")
            await aconn.commit()
            return kept

    try:
        assert asyncio.run(scenario()) == 13
    finally:
        app.close()
    assert storage.queue_counts_exact(conn)["aq"] == {"available": 13}


@pytest.mark.parametrize("n", [1, COPY_BLOCK - 1, COPY_BLOCK, COPY_BLOCK + 1, 3 * COPY_BLOCK + 7])
def test_streamed_rows_are_the_rows_given_in_order(pg_dsn, schema, storage, conn, n):
    cli = Client(None, schema)
    rows = [{"i": i, "s": "x" * (i % 7)} for i in range(n)]
    ids = cli.enqueue_many("k", rows, queue="rq", conn=conn, chunk=2 * COPY_BLOCK, metadata={"m": 1},
                           max_attempts=3, return_ids=True)
    snaps = claim(storage, conn, "rq", n + 10)
    by_id = {s.job_id: s for s in snaps}
    assert sorted(by_id) == sorted(ids) and len(snaps) == n
    assert [by_id[i].args for i in ids] == [json.dumps(r).encode() for r in rows]  # jsonb's own text of each
    # each chunk is its own lane (spread over the queue's shards), claimed in the order given
    for lane in {i >> 40 for i in ids}:
        assert [s.job_id for s in snaps if s.lane_id == lane] == [i for i in ids if i >> 40 == lane]
    assert {(s.metadata, s.max_attempts, s.attempt, s.kind) for s in snaps} == {(b'{"m": 1}', 3, 1, "k")}



def test_a_call_of_one_block_is_checked_before_anything_is_written(pg_dsn, schema, storage, conn):
    # Up to one COPY block is checked and encoded up front: a bad payload reserves no lane number and
    # the caller's transaction needs no savepoint (it is not failed, and no subtransaction is left behind).
    storage.queue_configure(conn, "small", enqueue_shards=1)
    enqueue(schema, conn, "small", {"first": 1})
    before = _enqueue_seq(conn, schema, "small")
    cli = Client(None, schema)
    with connect(pg_dsn, schema, autocommit=False, tag="small") as p:
        with pytest.raises(PayloadError):
            cli.enqueue_many("k", _rows(COPY_BLOCK, bad_at=COPY_BLOCK - 1), queue="small", conn=p)
        assert p.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # nothing was sent at all
        p.rollback()
    assert _enqueue_seq(conn, schema, "small") == before
    cli.close()
