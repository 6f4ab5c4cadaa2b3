"""The claim reads a lane's job bodies once (migration 0020, claim_batch_v3's body; claim_batch_v4 since 0021).

The receipt is written from the narrow columns of the rows it takes; the
result then reads exactly the receipt's rows by the primary key: the range
when the receipt holds every position of it, else its ``lane_seqs``. These
tests hold the claim to the rows and receipts it gave before (lane order,
tombstones and gaps left out, arrays equal to the rows) and check that the
receipt's statement no longer carries the job bodies.
"""

from __future__ import annotations

import json

import pytest

from tests.fixtures.database import sqlx
from tests.integration.storage_helpers import claim, enqueue, explained

pytestmark = pytest.mark.integration

Q = "q"


def receipts(conn, schema) -> list[tuple[int, int, list[int], list[int], list[int]]]:  # noqa: ANN001
    return [(int(a), int(b), list(j), list(rl), list(s)) for a, b, j, rl, s in sqlx(
        conn, schema, "SELECT first_seq, last_seq, job_ids, run_leases, lane_seqs FROM __SCHEMA__.lease_claims "
                      "ORDER BY claim_id").fetchall()]


def test_a_whole_range_comes_back_in_lane_order_with_its_bodies(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(7)]
    snaps = claim(storage, conn, Q, 5)
    assert [s.job_id for s in snaps] == jobs[:5]
    assert [json.loads(bytes(s.args)) for s in snaps] == [{"i": i} for i in range(5)]
    assert [(s.run_lease, s.attempt) for s in snaps] == [(1, 1)] * 5
    seqs = [s.lane_seq for s in snaps]
    assert seqs == sorted(seqs) and len({s.claim_id for s in snaps}) == 1
    [(first, last, jids, leases, lane_seqs)] = receipts(conn, schema)
    assert (first, last, jids, leases, lane_seqs) == (seqs[0], seqs[-1], jobs[:5], [1] * 5, seqs)
    rest = claim(storage, conn, Q, 10)
    assert [s.job_id for s in rest] == jobs[5:]


def test_tombstoned_rows_inside_the_range_are_neither_returned_nor_in_the_receipt(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(6)]
    assert storage.job_cancel(conn, jobs[1]) == "cancelled"
    assert storage.job_cancel(conn, jobs[4]) == "cancelled"
    snaps = claim(storage, conn, Q, 10)
    want = [jobs[i] for i in (0, 2, 3, 5)]
    assert [s.job_id for s in snaps] == want
    assert [json.loads(bytes(s.args)) for s in snaps] == [{"i": i} for i in (0, 2, 3, 5)]
    [(first, last, jids, leases, lane_seqs)] = receipts(conn, schema)
    assert jids == want and leases == [1] * 4 and lane_seqs == [s.lane_seq for s in snaps]
    assert last - first + 1 == 6  # the receipt covers the tombstoned positions too
    assert claim(storage, conn, Q, 10) == []


def test_a_range_of_tombstones_only_moves_the_cursor_and_returns_nothing(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    for j in jobs:
        assert storage.job_cancel(conn, j) == "cancelled"
    assert claim(storage, conn, Q, 10) == []
    assert [(r[2], r[3], r[4]) for r in receipts(conn, schema)] in ([([], [], [])], [])
    later = enqueue(schema, conn, Q, {"later": 1})
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == [later]


def test_the_receipt_statement_no_longer_carries_the_job_bodies(schema, storage, conn):
    """The statement that writes the receipt materializes only narrow columns (plan width), and the
    rows the claim returns are read by a plain primary-key scan of the ready ring."""
    for i in range(4):
        enqueue(schema, conn, Q, {"i": i, "pad": "x" * 200})
    snaps, plans = explained(conn, lambda: claim(storage, conn, Q, 10))
    assert len(snaps) == 4
    receipt = [p for p in plans if "INSERT INTO" in p and "lease_claims" in p]
    assert len(receipt) == 1, plans
    picked = receipt[0][receipt[0].index("CTE picked"):]
    width = int(picked.split("width=", 1)[1].split(")", 1)[0])
    assert width < 64, receipt[0]  # lane_seq, job_id, lease_base, tomb: no job body
    reads = [p for p in plans if "FROM" in p and "ready_entries p" in p and "lease_claims" not in p]
    assert len(reads) == 2, plans  # the receipt's first row by its key, then the rest (0021, claim_batch_v4)

