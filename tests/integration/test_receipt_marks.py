"""A lane's receipt mark (migration 0025): claims set it, the single enqueue decides its NOTIFY from it.

The mark is a sequence per lane (``queue_claim_heads.receipt_seq``). Every claim that writes
receipts sets it to the last number they cover before it commits, and a rolled-back claim leaves
it there, so it is never below the last number of a committed receipt. ``job_enqueue_v3`` reads it
with the claim cursor instead of probing every claim-ring partition for the lane's receipts, and so
wakes claimers in every case the probe did (tests/integration/test_storage_notify.py holds the
decision itself).
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from awa_fast.client import Client
from awa_fast.storage.migrate import migrate, migrations
from awa_fast.storage.schema import render
from tests.fixtures.database import connect, scalar, sqlx
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


def test_an_enqueue_wakes_claimers_while_a_claim_that_covers_the_lane_is_in_flight(pg_dsn, schema, storage,
                                                                                     conn):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    client = Client(pg_dsn, schema)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as listener:
            listener.execute(f'LISTEN "{storage.channel}"')
            client.enqueue_many(KIND, [{"n": i} for i in range(100)], queue=Q)
            client.enqueue(KIND, {"n": 100}, queue=Q)
            _notifies(listener)
            client.enqueue(KIND, {"n": 101}, queue=Q)  # 101 rows waiting, no claim: no wake-up
            assert _notifies(listener) == []
            with connect(pg_dsn, schema, "claimer", autocommit=False) as c:
                got = sqlx(c, schema, "SELECT count(job_id) FROM __SCHEMA__.claim_batch_v4(%s, 1000)",
                           (Q,)).fetchone()
                assert got == (102,)
                # the claim has not committed: a probe of committed receipts still saw 102 waiting
                client.enqueue(KIND, {"n": 102}, queue=Q)
                assert _notifies(listener) == [Q]
                c.rollback()
            client.enqueue(KIND, {"n": 103}, queue=Q)  # after a rollback: more wake-ups, never fewer
            assert _notifies(listener) == [Q]
            assert len(claim(storage, conn, Q, 1000)) == 104  # nothing was lost to the rolled-back claim
    finally:
        client.close()


def test_the_migration_marks_existing_lanes_at_their_effective_cursor(pg_dsn):
    """A schema just before migration receipt_marks: one lane fully claimed (its cursor lags its
    receipt), one with a backlog; after the upgrade the first enqueue decides as the probe did."""
    ours = next(m.version for m in migrations() if m.name == "receipt_marks")
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        try:
            with c.transaction():
                c.execute(render("CREATE SCHEMA __SCHEMA__", name))
                c.execute(render("CREATE TABLE __SCHEMA__.schema_migrations (version int PRIMARY KEY, "
                                 "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())", name))
                for mig in migrations():
                    if mig.version >= ours:
                        break
                    c.execute(render(mig.text, name))
                    c.execute(render("INSERT INTO __SCHEMA__.schema_migrations (version, name) VALUES (%s, %s)",
                                     name), (mig.version, mig.name))
                    if mig.version == 2:
                        c.execute(render("SELECT __SCHEMA__.ring_install(4, 4, 4)", name))
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
            assert marks == {"claimed": 80, "waiting": 0}
            with psycopg.connect(pg_dsn, autocommit=True) as listener:
                listener.execute(f'LISTEN "awa_fast_{name}"')
                client = Client(pg_dsn, name)
                try:
                    client.enqueue("k", {}, queue="claimed")  # everything before it is claimed: wake
                    assert _notifies(listener) == ["claimed"]
                    client.enqueue("k", {}, queue="waiting")  # 80 waiting: the claimers are coming anyway
                    assert _notifies(listener) == []
                finally:
                    client.close()
        finally:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
