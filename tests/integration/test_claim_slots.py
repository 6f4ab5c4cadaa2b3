"""The claim and the ready ring: lane order across slots, and what a claim locks.

A lane's rows are numbered by its enqueue sequence in commit order, but the
ready slot a row lands in is the one its producer read, and a producer in a
REPEATABLE READ transaction (or one that read the slot just before a
rotation) can land a later number in an older slot than an earlier number.
The claim must then never take the later rows of one slot past a number that
lives in another slot: its receipt covers every number up to the last row it
took, and the cursor moves past them.
"""

from __future__ import annotations

from tests.fixtures.database import connect
from tests.integration.storage_helpers import claim, complete, counts, enqueue, ring_current

Q = "q"


def test_a_later_number_in_an_older_ready_slot_never_hides_an_earlier_one(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=1)  # one lane: the numbers interleave in it
    first = enqueue(schema, conn, Q, {"i": 0})  # number 1, slot 0
    with connect(pg_dsn, schema, autocommit=False, tag="rr") as rr:
        rr.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        rr.execute("SELECT 1")  # the snapshot: the ready ring is at slot 0 for this transaction
        assert storage.ring_rotate(conn, "ready") == 1
        newer = enqueue(schema, conn, Q, {"i": 1})  # number 2, slot 1
        older = enqueue(schema, rr, Q, {"i": 2})  # number 3, but in slot 0 (its snapshot's slot)
        rr.commit()
    last = enqueue(schema, conn, Q, {"i": 3})  # number 4, slot 1
    assert ring_current(storage, conn, "ready") == 1
    got = claim(storage, conn, Q, 10) + claim(storage, conn, Q, 10) + claim(storage, conn, Q, 10)
    assert sorted(s.job_id for s in got) == sorted([first, newer, older, last])
    assert [s.lane_seq for s in sorted(got, key=lambda s: s.lane_seq)] == [1, 2, 3, 4]
    assert complete(storage, conn, got) == []
    assert counts(storage, conn, Q) == {"completed": 4}


def test_interleaved_slots_are_claimed_one_by_one_in_lane_order_with_tombstones(pg_dsn, schema, storage, conn):
    """Small claims across an interleaving, a tombstone in a run and a rolled-back gap keep lane order.

    Slot 0 holds numbers 1, 2 (cancelled), 3 and 6; slot 1 holds 4 and 5, then 7 after a gap a
    rolled-back reservation left. Claims of 3 walk them in number order, never past one they did
    not take (the second claim reads 5 and 8 in slot 1 and must stop before 6), and the cancelled
    row is spent, not returned.
    """
    storage.queue_configure(conn, Q, enqueue_shards=1)
    j1 = enqueue(schema, conn, Q, {"i": 1})
    j2 = enqueue(schema, conn, Q, {"i": 2})
    j3 = enqueue(schema, conn, Q, {"i": 3})
    assert storage.job_cancel(conn, j2) == "cancelled"
    with connect(pg_dsn, schema, autocommit=False, tag="rr") as rr:
        rr.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        rr.execute("SELECT 1")
        assert storage.ring_rotate(conn, "ready") == 1
        j4 = enqueue(schema, conn, Q, {"i": 4})
        j5 = enqueue(schema, conn, Q, {"i": 5})
        j6 = enqueue(schema, rr, Q, {"i": 6})  # slot 0
        rr.commit()
    with connect(pg_dsn, schema, autocommit=False, tag="rollback") as c:
        enqueue(schema, c, Q, {"i": "gone"})  # number 7 never commits
        c.rollback()
    j8 = enqueue(schema, conn, Q, {"i": 8})
    got = []
    for _ in range(10):
        snaps = claim(storage, conn, Q, 3)
        if not snaps:
            break
        got.append([s.job_id for s in snaps])
    flat = [j for batch in got for j in batch]
    assert flat == [j1, j3, j4, j5, j6, j8]  # lane order; the cancelled job is spent, the gap crossed
    assert all(len(b) <= 3 for b in got)
    assert counts(storage, conn, Q) == {"running": 6, "cancelled": 1}
