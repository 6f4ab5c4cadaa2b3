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
