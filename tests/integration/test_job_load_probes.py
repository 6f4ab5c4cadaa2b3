"""Loading a job reads a few index entries, however full the rings and whenever its plans were made (0029).

``job_load_v3`` answers App.get_job, App.wait, the dashboard and ``awa-fast job show`` on long-lived
pooled connections, whose generic plans are made once. These tests count the rows and index entries
one load reads in the claim ring (``_claim_ring_reads``, as the completion tests do). A cancel
(``job_cancel``) and the first job loader (``job_load``, which ``unique_holds_v2`` calls) find a
claimed job's receipt the same way since 0031.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.fixtures.database import connect, sqlx
from tests.integration.storage_helpers import claim, counted, enqueue
from tests.integration.test_completion_probes import (
    Q,
    _claim_ring_reads,
    _slot0_reltuples,
    _slot0_with_empty_statistics,
    completed_receipts,
)

pytestmark = pytest.mark.integration


def _reads(a: psycopg.Connection, schema: str, call):  # noqa: ANN001, ANN202
    return counted(a, lambda c: _claim_ring_reads(c, schema), call)


def _load_reads(storage, a: psycopg.Connection, schema: str, job_id: int) -> tuple[str, dict[str, int]]:  # noqa: ANN001
    return _reads(a, schema, lambda: storage.job_load(a, job_id)["state"])


def test_a_load_planned_on_an_empty_claim_slot_still_probes_by_key(pg_dsn, schema, storage, conn):
    """A pooled connection plans job_load while claim slot 0 has an empty table's statistics; once the
    slot holds FILL receipts, loading a running job must still read a few index entries."""
    _slot0_with_empty_statistics(conn, schema)
    with connect(pg_dsn, schema, tag="app") as a:
        for _ in range(7):  # past PostgreSQL's five custom plans: the generic plan is made now
            enqueue(schema, conn, Q)
            running = claim(storage, conn, Q, 1)[0]
            assert _load_reads(storage, a, schema, running.job_id)[0] == "running"
            assert storage.receipt_complete_rows(conn, [running]) == []
        completed_receipts(storage, schema, conn)
        assert _slot0_reltuples(conn, schema) == 0.0  # still the empty slot's statistics
        enqueue(schema, conn, Q)
        running = claim(storage, conn, Q, 1)[0]
        state, reads = _load_reads(storage, a, schema, running.job_id)
    assert state == "running"
    assert sum(reads.values()) <= 4, reads


def test_a_running_job_is_found_without_reading_the_receipts_after_it(pg_dsn, schema, storage, conn):
    """The running check reads the lane's first receipt ending at or after the job's row, not every
    receipt of the lane that follows it; the other states still come out right."""
    enqueue(schema, conn, Q)
    running = claim(storage, conn, Q, 1)[0]
    later = completed_receipts(storage, schema, conn)
    assert {s.lane_id for s in later} == {running.lane_id}  # one lane: FILL receipts after the running job's
    available = enqueue(schema, conn, Q)
    sqlx(conn, schema, "ANALYZE")
    with connect(pg_dsn, schema, tag="app") as a:
        loads = {name: _load_reads(storage, a, schema, job_id)
                 for name, job_id in (("running", running.job_id), ("completed", later[0].job_id),
                                      ("available", available))}
    assert {name: state for name, (state, _) in loads.items()} == {
        "running": "running", "completed": "completed", "available": "available"}
    assert {name: sum(reads.values()) <= 4 for name, (_, reads) in loads.items()} == {
        "running": True, "completed": True, "available": True}, loads


def _completed_compactly(storage, schema: str, conn: psycopg.Connection):  # noqa: ANN001, ANN202
    """A job completed by the COPY path as a whole receipt (a compact done row, no per-job done row),
    then FILL more receipts of its lane, completed; the job's snapshot."""
    enqueue(schema, conn, Q)
    snap = claim(storage, conn, Q, 1)[0]
    assert storage.receipt_complete(conn, [snap], {(snap.claim_slot, snap.claim_id)}, ()) == []
    later = completed_receipts(storage, schema, conn)
    assert {s.lane_id for s in later} == {snap.lane_id}
    sqlx(conn, schema, "ANALYZE")
    return snap


def test_a_cancel_of_a_compactly_completed_job_reads_one_receipt(pg_dsn, schema, storage, conn):
    """job_cancel (App.cancel) of a claimed job reads the lane's first receipt ending at or after its
    row, not every later receipt of the lane (0031), while it holds the lane's claim head."""
    done = _completed_compactly(storage, schema, conn)
    with connect(pg_dsn, schema, tag="app") as a:
        outcome, reads = _reads(a, schema, lambda: storage.job_cancel(a, done.job_id))
        assert storage.job_load(a, done.job_id)["state"] == "completed"
    assert outcome == "terminal"
    assert sum(reads.values()) <= 8, reads


def test_the_first_job_loader_reads_one_receipt_for_a_claimed_job(pg_dsn, schema, storage, conn):
    """job_load (version 1, which unique_holds_v2 calls for a held key once job_done_compact said no)
    finds a claimed job's receipt as job_load_v3 does (0031). It knows no compact done rows, so a job
    completed that way is unknown to it (None)."""
    done = _completed_compactly(storage, schema, conn)
    with connect(pg_dsn, schema, tag="app") as a:
        state, reads = _reads(a, schema, lambda: sqlx(a, schema, "SELECT __SCHEMA__.job_load(%s) ->> 'state'",
                                                      (done.job_id,)).fetchone()[0])
    assert state is None
    assert sum(reads.values()) <= 8, reads
