"""The claim finds a lane's next segment in the current ready slot first (migration 0032).

claim_batch_v4 looks up the ready slot holding a lane's next rows in ready_segments, which is
partitioned by ready slot. It reads the current slot's child alone first and falls back to the
lookup over every child only when that child does not hold the segment with the next number.
These tests count the buffers a claim fetches from each ready_segments child, and check that a
backlog left in an older slot is still claimed first, in lane order.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.fixtures.database import sqlx
from tests.integration.storage_helpers import claim, counted, enqueue, ring_current

pytestmark = pytest.mark.integration

Q = "q"


def _segment_blocks(conn: psycopg.Connection, schema: str) -> dict[int, int]:
    """Buffers this transaction fetched per ready_segments child (its table and indexes), by slot."""
    rows = sqlx(conn, schema, """
        SELECT substring(t.relname FROM '[0-9]+$')::int, sum(pg_stat_get_xact_blocks_fetched(r.oid))
        FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
        LEFT JOIN pg_index x ON x.indexrelid = r.oid
        JOIN pg_class t ON t.oid = COALESCE(x.indrelid, r.oid)
        WHERE n.nspname = %s AND t.relkind = 'r' AND t.relname ~ '^ready_segments_[0-9]+$'
        GROUP BY 1""", (schema,)).fetchall()
    return {int(slot): int(n) for slot, n in rows}


def test_a_quiet_queue_claims_from_the_current_slot_reading_that_child_alone(schema, storage, conn):
    for _ in range(2):  # rows claimed in an older slot, then the ring moved on: slot 2 is current
        enqueue(schema, conn, Q)
        assert len(claim(storage, conn, Q, 10)) == 1
        storage.ring_rotate(conn, "ready")
    current = ring_current(storage, conn, "ready")
    assert current == 2
    for _ in range(7):  # past the custom plans: the generic plan the claimer keeps
        job_id = enqueue(schema, conn, Q)
        snaps, read = counted(conn, lambda c: _segment_blocks(c, schema), lambda: claim(storage, conn, Q, 10))
        assert [(s.job_id, s.ready_slot) for s in snaps] == [(job_id, current)]
        assert set(read) == {current}, read


def test_a_backlog_in_an_older_slot_is_claimed_first_and_once(schema, storage, conn):
    older = [enqueue(schema, conn, Q) for _ in range(3)]
    storage.ring_rotate(conn, "ready")
    newer = [enqueue(schema, conn, Q) for _ in range(2)]
    first = claim(storage, conn, Q, 1)  # the current slot holds a later segment: the lookup over the ring
    assert [(s.job_id, s.ready_slot) for s in first] == [(older[0], 0)]
    rest = claim(storage, conn, Q, 10)
    assert [s.job_id for s in rest] == older[1:] + newer
    assert claim(storage, conn, Q, 10) == []
    newest = enqueue(schema, conn, Q)  # the next number is in the current slot now
    assert [(s.job_id, s.ready_slot) for s in claim(storage, conn, Q, 10)] == [(newest, 1)]
