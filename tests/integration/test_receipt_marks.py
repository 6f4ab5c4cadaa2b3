"""A lane's receipt mark (migration 0025): claims set it, the single enqueue reads it before the receipts.

The mark is a sequence per lane (``queue_claim_heads.receipt_seq``). Every claim that writes
receipts sets it to the last number they cover before it commits, and a rolled-back claim leaves
it there, so it is never below the last number of a committed receipt. ``job_enqueue_v3`` makes
``job_enqueue_v2``'s NOTIFY decision, and reads the lane's receipts in the claim ring only where
the cursor and the mark cannot settle it (tests/integration/test_storage_notify.py holds the
decision itself).
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from awa_fast.client import Client
from awa_fast.storage import Storage
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render
from tests.fixtures.database import connect, migrate_before, scalar, sqlx
from tests.integration.storage_helpers import claim, enqueue

Q = "marks"
KIND = "marks.job"


def _lane(conn: psycopg.Connection, schema: str) -> int:
    return int(scalar(conn, schema, "SELECT lane_id FROM __SCHEMA__.queue_claim_heads WHERE queue = %s", (Q,)))


def _mark_and_cursor(conn: psycopg.Connection, schema: str, lane: int) -> tuple[int, int]:
    row = sqlx(conn, schema, "SELECT pg_sequence_last_value(receipt_seq), pg_sequence_last_value(claim_seq) "
                             "FROM __SCHEMA__.queue_claim_heads WHERE lane_id = %s", (lane,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _notifies(listener: psycopg.Connection) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=0.2, stop_after=None)]


@pytest.mark.parametrize("function", ["claim_batch_v3", "claim_batch_v4"])
def test_a_claim_sets_its_lanes_mark_before_it_commits_and_a_rollback_leaves_it(pg_dsn, schema, storage, conn,
                                                                                   function):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    ids = [enqueue(schema, conn, Q, {"n": i}) for i in range(5)]
    lane = _lane(conn, schema)
    assert _mark_and_cursor(conn, schema, lane) == (0, 0)  # lane_ensure starts it at 0
    with connect(pg_dsn, schema, "claimer", autocommit=False) as c:
        rows = sqlx(c, schema, f"SELECT job_id FROM __SCHEMA__.{function}(%s, 3) WHERE job_id IS NOT NULL",
                    (Q,)).fetchall()
        assert [r[0] for r in rows] == ids[:3]
        # not committed yet: the cursor has not moved, the mark already covers the receipt
        assert _mark_and_cursor(conn, schema, lane) == (3, 0)
        c.rollback()
    assert _mark_and_cursor(conn, schema, lane) == (3, 0)  # a sequence: the rollback keeps it
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == ids  # the rolled-back rows are claimed again
    assert _mark_and_cursor(conn, schema, lane) == (5, 0)  # the cursor lags one claim behind; the mark does not


def test_an_enqueue_behind_a_backlog_reads_no_claim_ring_partition(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    client = Client(pg_dsn, schema)
    try:
        client.enqueue_many(KIND, [{"n": i} for i in range(100)], queue=Q)  # 64+ past the cursor
        with connect(pg_dsn, schema, "producer", autocommit=False) as p:
            enqueue(schema, p, Q, {"n": 100})
            locked = [r[0] for r in p.execute(
                "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE l.pid = pg_backend_pid() AND c.relname LIKE 'lease_claim%%'").fetchall()]
            p.rollback()
    finally:
        client.close()
    assert locked == []  # job_enqueue_v2 locked 26 here: each claim partition and its two indexes


def _wakes(listener: psycopg.Connection) -> list[str]:
    """The notifications of an enqueue that must wake claimers: wait for the first one."""
    return [n.payload for n in listener.notifies(timeout=5, stop_after=1)]


def _claim_ring_locked(c: psycopg.Connection) -> bool:
    """Whether this transaction of ``c`` holds a lock on a claim-ring relation (it read the receipts)."""
    return bool(c.execute("SELECT count(*) FROM pg_locks l JOIN pg_class r ON r.oid = l.relation "
                          "WHERE l.pid = pg_backend_pid() AND r.relname LIKE 'lease_claim%%'").fetchone()[0])


@pytest.mark.parametrize("function", ["job_enqueue_v2", "job_enqueue_v3"])
def test_v3_decides_as_v2_and_reads_the_receipts_only_where_the_mark_cannot_settle_it(pg_dsn, schema, storage,
                                                                                       conn, function):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    client = Client(pg_dsn, schema)

    def enqueue_reading(p: psycopg.Connection) -> bool:
        """One enqueue through ``function`` on ``p``, committed; whether it read the claim ring."""
        sqlx(p, schema, f"SELECT __SCHEMA__.{function}(%s, 2, %s, '{{}}', NULL, 5, NULL)", (Q, KIND))
        read = _claim_ring_locked(p)
        p.commit()
        return read

    try:
        with psycopg.connect(pg_dsn, autocommit=True) as listener, \
                connect(pg_dsn, schema, "producer", autocommit=False) as p:
            listener.execute(f'LISTEN "{storage.channel}"')
            enqueue_reading(p)
            assert _wakes(listener) == [Q]  # an empty lane: wake
            client.enqueue_many(KIND, [{"n": i} for i in range(100)], queue=Q)
            _notifies(listener)
            # 101 rows waiting, no claim: no wake-up; the mark (0) settles it for v3
            assert enqueue_reading(p) == (function == "job_enqueue_v2")
            assert _notifies(listener) == []
            with connect(pg_dsn, schema, "claimer", autocommit=False) as c:
                got = sqlx(c, schema, "SELECT count(job_id) FROM __SCHEMA__.claim_batch_v4(%s, 1000)",
                           (Q,)).fetchone()
                assert got == (102,)
                # in flight: its rows still count as waiting, as job_enqueue_v2 counts them (claimers are
                # busy); the mark covers them, so v3 reads the committed receipts to decide as v2 does
                assert enqueue_reading(p) is True
                assert _notifies(listener) == []
                c.rollback()
            assert enqueue_reading(p) is True  # rolled back: the mark stays, the receipts decide
            assert _notifies(listener) == []
            assert len(claim(storage, conn, Q, 1000)) == 104  # committed; the cursor lags its receipt
            assert enqueue_reading(p) is True  # after a drain: the receipt is read and claimers are woken
            assert _wakes(listener) == [Q]
    finally:
        client.close()


def test_the_migration_marks_existing_lanes_at_their_enqueue_head(pg_dsn):
    """A schema just before migration receipt_marks: one lane fully claimed (its cursor lags its
    receipt), one with a backlog; after the upgrade the first enqueues decide as job_enqueue_v2 does,
    and a claim sets the migrated lane's mark."""
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        try:
            ours = migrate_before(c, name, "receipt_marks")
            for queue, jobs in (("claimed", 80), ("waiting", 80)):
                c.execute(render("SELECT __SCHEMA__.queue_ensure(%s)", name), (queue,))
                c.execute(render("UPDATE __SCHEMA__.queue_meta SET enqueue_shards = 1 WHERE queue = %s", name),
                          (queue,))
                c.execute(render("SELECT __SCHEMA__.job_enqueue_many(%s, 2, 'k', "
                                 "array_fill('{}'::jsonb, ARRAY[%s]), NULL, 5)", name), (queue, jobs))
            claimed = c.execute(render("SELECT count(job_id) FROM __SCHEMA__.claim_batch_v4('claimed', 1000)",
                                       name)).fetchone()
            assert claimed == (80,)
            result = migrate(pg_dsn, name)
            assert result.from_version == ours - 1
            marks = dict(c.execute(render(
                "SELECT queue, pg_sequence_last_value(receipt_seq) FROM __SCHEMA__.queue_claim_heads", name)
                ).fetchall())
            cursors = dict(c.execute(render(
                "SELECT queue, pg_sequence_last_value(claim_seq) FROM __SCHEMA__.queue_claim_heads", name)
                ).fetchall())
            assert cursors == {"claimed": 0, "waiting": 0}  # the claim's cursor move is still to come
            assert marks == {"claimed": 80, "waiting": 80}  # at the enqueue head: past every receipt
            st = Storage(name)
            with psycopg.connect(pg_dsn, autocommit=True) as listener:
                listener.execute(f'LISTEN "awa_fast_{name}"')
                client = Client(pg_dsn, name)
                try:
                    client.enqueue("k", {}, queue="claimed")  # everything before it is claimed: wake
                    assert _wakes(listener) == ["claimed"]
                    client.enqueue("k", {}, queue="waiting")  # 80 waiting: the claimers are coming anyway
                    assert _notifies(listener) == []
                    with psycopg.connect(pg_dsn, autocommit=True) as w:
                        assert len(st.lane_claim(w, "waiting", 1000)) == 81
                        mark = w.execute(render("SELECT pg_sequence_last_value(receipt_seq) FROM "
                                                "__SCHEMA__.queue_claim_heads WHERE queue = 'waiting'", name)
                                         ).fetchone()
                    assert mark == (81,)  # the claim set the migrated lane's mark
                    client.enqueue("k", {}, queue="waiting")
                    assert _wakes(listener) == ["waiting"]
                finally:
                    client.close()
        finally:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
