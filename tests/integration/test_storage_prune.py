"""Ring rotation and prune: gates, short lock timeout, and no truncation of live work.

Prune takes a short lock_timeout, checks its gates before and after taking
ACCESS EXCLUSIVE on the slot's children, and only then TRUNCATEs. A busy or
gated slot is skipped (the outcome word says why), never waited on for long.
"""

from __future__ import annotations

import time

from tests.fixtures.database import connect, scalar, sqlx
from tests.integration.storage_helpers import (
    claim,
    complete,
    counts,
    enqueue,
    load,
    rotate_and_prune,
)

Q = "q"

READY_TABLES = ("ready_entries", "ready_segments", "ready_tombstones", "done_entries", "done_receipts")
CLAIM_TABLES = ("lease_claims", "lease_claim_closures", "lease_claim_closure_batches")


def slot_rows(conn, schema, tables, slot) -> int:
    return sum(int(scalar(conn, schema, f"SELECT count(*) FROM __SCHEMA__.{t}_{slot}")) for t in tables)


def timed_prune(storage, conn, ring, slot, lock_timeout_ms=50):
    # a prune that waited for the lock instead of skipping fails here instead of hanging the test
    conn.execute("SET statement_timeout = '5s'")
    t0 = time.monotonic()
    out = storage.ring_prune(conn, ring, slot, lock_timeout_ms)
    return out, time.monotonic() - t0


def test_ready_prune_gates_pending_open_claims_and_leases(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"x": 1})
    assert storage.ring_prune(conn, "ready", 0) == "current"
    assert storage.ring_prune(conn, "ready", 2) == "empty"
    assert storage.ring_rotate(conn, "ready") == 1

    assert storage.ring_prune(conn, "ready", 0) == "pending_ready"
    [snap] = claim(storage, conn, Q, 10)
    assert snap.ready_slot == 0
    assert storage.ring_prune(conn, "ready", 0) == "open_claims"
    token = storage.attempt_register_callback(conn, snap, 600)
    assert token is not None
    assert storage.ring_prune(conn, "ready", 0) == "active_leases"
    assert slot_rows(conn, schema, READY_TABLES, 0) == 2  # ready row + segment, untouched

    assert storage.callback_resolve(conn, token, "complete") == "ok"
    assert storage.ring_prune(conn, "ready", 0) == "pruned"
    assert slot_rows(conn, schema, READY_TABLES, 0) == 0
    assert counts(storage, conn, Q) == {"completed": 1}  # folded into the rollups
    assert load(storage, conn, job) is None  # history pruned
    assert storage.ring_prune(conn, "ready", 0) == "empty"


def test_claim_prune_gates_open_claims_and_cursor_behind(pg_dsn, schema, storage, conn):
    enqueue(schema, conn, Q, {"i": 0})
    enqueue(schema, conn, Q, {"i": 1})
    [s1] = claim(storage, conn, Q, 1)
    assert s1.claim_slot == 0
    assert storage.ring_prune(conn, "claim", 0) == "current"
    assert storage.ring_rotate(conn, "claim") == 1
    assert storage.ring_prune(conn, "claim", 0) == "open_claims"
    assert complete(storage, conn, [s1]) == []

    with connect(pg_dsn, schema, autocommit=False, tag="holder") as holder:
        [s2] = storage.lane_claim(holder, Q, 1)  # holds the lane's claim head until it commits
        assert s2.claim_slot == 1
        # a lost advance: the cursor falls behind the receipt in the sealed slot, and prune
        # cannot move it while the claimer holds the lane
        sqlx(conn, schema, "SELECT setval(claim_seq, 0, true) FROM __SCHEMA__.queue_claim_heads")
        assert storage.ring_prune(conn, "claim", 0) == "cursor_behind"
        holder.commit()
    assert storage.ring_prune(conn, "claim", 0) == "pruned"
    assert slot_rows(conn, schema, CLAIM_TABLES, 0) == 0
    assert claim(storage, conn, Q, 10) == []  # no double claim after the prune
    assert complete(storage, conn, [s2]) == []
    assert counts(storage, conn, Q) == {"completed": 2}


def test_lease_prune_gate_active_leases(schema, storage, conn):
    enqueue(schema, conn, Q)
    [snap] = claim(storage, conn, Q, 1)
    token = storage.attempt_register_callback(conn, snap, 600)
    assert token is not None
    assert storage.ring_rotate(conn, "lease") == 1
    assert storage.ring_prune(conn, "lease", 0) == "active_leases"
    assert storage.callback_resolve(conn, token, "complete") == "ok"
    assert storage.ring_prune(conn, "lease", 0) == "pruned"
    assert int(scalar(conn, schema, "SELECT pg_relation_size('__SCHEMA__.leases_0')".replace(
        "__SCHEMA__", f'"{schema}"'))) == 0


def test_prune_with_a_concurrent_reader_returns_busy_quickly_then_succeeds(pg_dsn, schema, storage, conn):
    enqueue(schema, conn, Q)
    complete(storage, conn, claim(storage, conn, Q, 10))
    assert storage.ring_rotate(conn, "ready") == 1
    for table in ("ready_entries_0", "done_entries"):  # the partition itself, or the parent (all partitions)
        with connect(pg_dsn, schema, autocommit=False, tag="reader") as reader:
            reader.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()
            out, took = timed_prune(storage, conn, "ready", 0)
            assert out == "busy"
            assert took < 0.75, f"prune waited {took:.3f}s for the reader"
            assert slot_rows(conn, schema, READY_TABLES, 0) > 0
            # the lock timeout is local to the prune's transaction
            assert conn.execute("SHOW lock_timeout").fetchone()[0] == "0"
    out, _ = timed_prune(storage, conn, "ready", 0)
    assert out == "pruned"
    assert counts(storage, conn, Q) == {"completed": 1}


def test_claim_open_across_a_claim_ring_rotation_is_never_truncated(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    complete(storage, conn, claim(storage, conn, Q, 1))  # closed history in claim slot 0
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as claimer:
        [open_snap] = storage.lane_claim(claimer, Q, 1)  # receipt in slot 0, not committed yet
        assert open_snap.claim_slot == 0 and open_snap.job_id == jobs[1]
        assert storage.ring_rotate(conn, "claim") == 1
        out, took = timed_prune(storage, conn, "claim", 0)
        assert out != "pruned"
        assert out == "busy" and took < 0.75
        claimer.commit()
    assert int(scalar(conn, schema, "SELECT count(*) FROM __SCHEMA__.lease_claims_0")) == 2
    assert storage.ring_prune(conn, "claim", 0) == "open_claims"
    assert counts(storage, conn, Q) == {"available": 1, "running": 1, "completed": 1}
    # its receipt still guards the attempt
    assert complete(storage, conn, [open_snap]) == []
    assert storage.ring_prune(conn, "claim", 0) == "pruned"
    rest = claim(storage, conn, Q, 10)
    assert [s.job_id for s in rest] == [jobs[2]]
    assert complete(storage, conn, rest) == []
    assert counts(storage, conn, Q) == {"completed": 3}


def test_claim_open_across_a_ready_ring_rotation_is_never_truncated(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(2)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as claimer:
        snaps = storage.lane_claim(claimer, Q, 10)
        assert [s.ready_slot for s in snaps] == [0, 0]
        assert storage.ring_rotate(conn, "ready") == 1
        out, took = timed_prune(storage, conn, "ready", 0)
        assert out != "pruned" and took < 0.75
        claimer.commit()
    assert storage.ring_prune(conn, "ready", 0) == "open_claims"
    assert complete(storage, conn, snaps[:1]) == []
    assert storage.ring_prune(conn, "ready", 0) == "open_claims"
    assert complete(storage, conn, snaps[1:]) == []
    assert storage.ring_prune(conn, "ready", 0) == "pruned"
    assert counts(storage, conn, Q) == {"completed": 2}
    assert all(load(storage, conn, j) is None for j in jobs)


def test_prune_keeps_exact_counts_of_every_terminal_state(schema, storage, conn):
    storage.queue_configure(conn, "nodlq", dlq_enabled=False)
    for i in range(5):
        enqueue(schema, conn, Q, {"i": i})
    cancelled = enqueue(schema, conn, Q, {"c": 1})
    assert storage.job_cancel(conn, cancelled) == "cancelled"
    enqueue(schema, conn, "nodlq")
    complete(storage, conn, claim(storage, conn, Q, 100), whole=True)
    [f] = claim(storage, conn, "nodlq", 10)
    assert storage.attempt_close(conn, [(f, 2, None, "bad")])[0].status == "ok"
    expected = {Q: {"completed": 5, "cancelled": 1}, "nodlq": {"failed": 1}}
    assert storage.queue_counts_exact(conn) == expected
    new, pruned = rotate_and_prune(storage, conn, "ready")
    assert new == 1 and pruned[0] == "pruned"
    new, pruned = rotate_and_prune(storage, conn, "claim")
    assert new == 1 and pruned[0] == "pruned"
    assert storage.queue_counts_exact(conn) == expected
    # more history on top of the rollups stays exact too
    enqueue(schema, conn, Q)
    complete(storage, conn, claim(storage, conn, Q, 10))
    assert storage.ring_rotate(conn, "ready") == 2
    assert storage.ring_prune(conn, "ready", 1) == "pruned"
    assert storage.queue_counts_exact(conn) == {Q: {"completed": 6, "cancelled": 1}, "nodlq": {"failed": 1}}


def test_rotation_refuses_a_slot_that_is_not_pruned(schema, storage, conn):
    enqueue(schema, conn, Q)
    assert [storage.ring_rotate(conn, "ready") for _ in range(3)] == [1, 2, 3]
    assert storage.ring_rotate(conn, "ready") is None  # slot 0 still holds the job
    assert storage.ring_state(conn)["ready"]["slot"] == 3
    complete(storage, conn, claim(storage, conn, Q, 10))
    assert storage.ring_prune(conn, "ready", 0) == "pruned"
    assert storage.ring_rotate(conn, "ready") == 0
    # enqueue and claim keep working on the reused slot
    job = enqueue(schema, conn, Q)
    [snap] = claim(storage, conn, Q, 10)
    assert (snap.job_id, snap.ready_slot) == (job, 0)


def test_cancelled_unclaimed_rows_do_not_gate_prune_even_without_claimers(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    assert storage.job_cancel(conn, job) == "cancelled"
    assert storage.ring_rotate(conn, "ready") == 1
    # prune moves the cursor across the committed tombstone itself: no claimer needed
    assert storage.ring_prune(conn, "ready", 0) == "pruned"
    assert counts(storage, conn, Q) == {"cancelled": 1}
    assert claim(storage, conn, Q, 10) == []


def test_prune_does_not_pass_a_live_row_behind_a_tombstone(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    live = enqueue(schema, conn, Q)
    assert storage.job_cancel(conn, job) == "cancelled"
    assert storage.ring_rotate(conn, "ready") == 1
    assert storage.ring_prune(conn, "ready", 0) == "pending_ready"  # the live row still waits
    [snap] = claim(storage, conn, Q, 10)
    assert snap.job_id == live
