"""The claim sends a receipt's own columns once (migration 0021, claim_batch_v4).

Of a claim row's 18 columns, six have one value per receipt: queue,
priority, ready_slot, lane_id, claim_slot and claim_id. claim_batch_v4 puts
them on each receipt's first row and NULL on the rest; the decoder carries
them forward. These tests read the raw rows of the runtime's claim query,
check that the decoded snapshots are the ones claim_batch_v3 gives for the
same claim, and that a receipt broken by a tombstone still starts full.
"""

from __future__ import annotations

from typing import Any

import pytest

from awa_fast import _impl
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage.schema import render
from tests.fixtures.database import sqlx
from tests.integration.storage_helpers import enqueue

pytestmark = pytest.mark.integration

Q = "q"
RECEIPT_FIELDS = ("queue", "priority", "ready_slot", "lane_id", "claim_slot", "claim_id")
AT = tuple(ClaimSnapshot.__struct_fields__.index(f) for f in RECEIPT_FIELDS)
V3 = """SELECT job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot,
       lane_id, lane_seq, claim_slot, claim_id, created_at, errors, callback_result, progress
FROM __SCHEMA__.claim_batch_v3(%s::text, %s::int, 0, 1)"""


def raw_claim(storage: Any, conn: Any, limit: int) -> list[tuple[Any, ...]]:
    """The runtime's claim query, its rows as sent (the backlog marker dropped)."""
    rows = conn.cursor(binary=True).execute(storage.q["lane_claim"], (Q, limit, 0, 1)).fetchall()
    return [r for r in rows if r[0] is not None]


def receipts(conn: Any, schema: str) -> dict[int, tuple[int, int, int, list[int]]]:
    return {int(cid): (int(cs), int(lid), int(rs), list(j)) for cs, cid, lid, rs, j in sqlx(
        conn, schema, "SELECT claim_slot, claim_id, lane_id, ready_slot, job_ids FROM __SCHEMA__.lease_claims")}


def test_only_each_receipts_first_row_carries_its_columns(schema, storage, conn):
    low = [enqueue(schema, conn, Q, {"i": i}, priority=1) for i in range(5)]
    high = [enqueue(schema, conn, Q, {"i": i}, priority=2) for i in range(4)]  # another lane
    rows = raw_claim(storage, conn, 100)
    assert sorted(r[0] for r in rows) == sorted(low + high)
    by_receipt = receipts(conn, schema)
    assert len(by_receipt) == 2
    firsts = [r for r in rows if r[AT[0]] is not None]
    assert len(firsts) == 2
    for first in firsts:
        claim_slot, lane_id, ready_slot, job_ids = by_receipt[first[AT[5]]]
        assert rows[rows.index(first)][0] == job_ids[0]  # the receipt's first job
        assert (first[AT[0]], first[AT[2]], first[AT[3]], first[AT[4]]) == (Q, ready_slot, lane_id, claim_slot)
        rest = rows[rows.index(first) + 1: rows.index(first) + len(job_ids)]
        assert [r[0] for r in rest] == job_ids[1:]
        assert all(r[i] is None for r in rest for i in AT)


def test_decoded_snapshots_equal_the_previous_claims(schema, storage, conn):
    """The same claim through claim_batch_v3 (rolled back) and through the runtime's claim."""
    for i in range(6):
        enqueue(schema, conn, Q, {"i": i}, priority=1)
    for i in range(3):
        enqueue(schema, conn, Q, {"i": i}, priority=3)
    conn.autocommit = False
    try:
        cur = conn.cursor(binary=True)
        old = [r for r in cur.execute(render(V3, schema), (Q, 100)).fetchall() if r[0] is not None]
        conn.rollback()
    finally:
        conn.autocommit = True
    want = _impl.decode_snapshots(old)
    got = storage.lane_claim(conn, Q, 100)
    assert len(got) == 9
    # claim ids come from a sequence (not rolled back): compare them as a partition of the rows
    strip = [(s.job_id, s.run_lease, s.queue, s.priority, s.ready_slot, s.lane_id, s.lane_seq, s.claim_slot,
              bytes(s.args), s.created_at) for s in got]
    assert strip == [(s.job_id, s.run_lease, s.queue, s.priority, s.ready_slot, s.lane_id, s.lane_seq,
                      s.claim_slot, bytes(s.args), s.created_at) for s in want]
    groups = [[s.job_id for s in got if s.claim_id == c] for c in dict.fromkeys(s.claim_id for s in got)]
    assert groups == [[s.job_id for s in want if s.claim_id == c] for c in dict.fromkeys(s.claim_id for s in want)]


def test_a_receipt_broken_by_a_tombstone_starts_with_a_full_row(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(5)]
    assert storage.job_cancel(conn, jobs[0]) == "cancelled"
    assert storage.job_cancel(conn, jobs[2]) == "cancelled"
    rows = raw_claim(storage, conn, 100)
    assert [r[0] for r in rows] == [jobs[1], jobs[3], jobs[4]]
    assert rows[0][AT[0]] == Q and all(rows[0][i] is not None for i in AT)
    assert all(r[i] is None for r in rows[1:] for i in AT)


