"""Every lifecycle transition of one attempt through the storage layer (ADR-019/023).

Each test drives the real SQL functions through awa_fast.storage.Storage and
checks where the job ends up: the tables it must be in, the tables it must
not touch, queue_counts_exact and job_load. No sleeps: heartbeat_timeout=0
makes attempts rescuable at once, deferred jobs are made due by moving
run_at into the past, and claim-time aging is shown by back-dating a lane
head segment.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from awa_fast.storage import CLOSE_CANCEL, CLOSE_COMPLETE, CLOSE_FAIL, CLOSE_RETRY, CLOSE_SNOOZE, Storage
from tests.fixtures.database import scalar, sqlx
from tests.integration.storage_helpers import (
    DONE_ALL,
    KIND,
    claim,
    close,
    complete,
    counts,
    deferred_row,
    done_rows,
    enqueue,
    jloads,
    load,
    make_due,
    raw,
)

Q = "q"


def n_rows(conn, schema, table, where="true", params=None) -> int:
    return int(scalar(conn, schema, f"SELECT count(*) FROM __SCHEMA__.{table} WHERE {where}", params))


def n_done(conn, schema) -> int:
    """Done rows of both shapes, one per job (per-job done_entries and compact done_receipts)."""
    return int(scalar(conn, schema, f"SELECT count(*) FROM {DONE_ALL}"))


def claim_one(storage: Storage, conn, queue: str = Q):
    snaps = claim(storage, conn, queue, 1)
    assert len(snaps) == 1, snaps
    return snaps[0]


# ---------------------------------------------------------------------------
# complete


def test_complete_short_job_touches_no_attempt_state_or_lease(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"n": 1}, metadata={"m": True})
    snap = claim_one(storage, conn)
    assert (snap.job_id, snap.run_lease, snap.attempt, snap.kind) == (job, 1, 1, KIND)
    assert jloads(snap.args) == {"n": 1} and jloads(snap.metadata) == {"m": True}
    assert counts(storage, conn, Q) == {"running": 1}
    assert load(storage, conn, job)["state"] == "running"

    assert complete(storage, conn, [snap], whole=True) == []

    assert n_rows(conn, schema, "attempt_state") == 0
    assert n_rows(conn, schema, "leases") == 0
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"], done["attempt"], done["queue"], done["kind"]) == (1, 1, 1, Q, KIND)
    assert counts(storage, conn, Q) == {"completed": 1}
    got = load(storage, conn, job)
    assert got["state"] == "completed" and got["args"] == {"n": 1} and got["metadata"] == {"m": True}
    assert claim(storage, conn, Q, 10) == []


def test_complete_per_attempt_closures_and_stale_repeat(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == jobs
    assert complete(storage, conn, snaps[:2]) == []
    assert counts(storage, conn, Q) == {"completed": 2, "running": 1}
    # completing again is stale and writes nothing
    assert complete(storage, conn, snaps[:2]) == sorted((s.job_id, s.run_lease) for s in snaps[:2])
    assert n_done(conn, schema) == 2
    assert close(storage, conn, snaps[2], CLOSE_COMPLETE) == "ok"
    assert counts(storage, conn, Q) == {"completed": 3}


def test_complete_rows_low_latency_path(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == jobs
    assert [r.status for r in storage.attempt_heartbeat(conn, snaps[:1], [raw({"p": 1})])] == ["ok"]
    # one statement in autocommit: done rows, closures, attempt_state dropped
    assert storage.receipt_complete_rows(conn, snaps[:2], {(snaps[0].job_id, snaps[0].run_lease)}) == []
    assert n_rows(conn, schema, "attempt_state") == 0
    assert [(d["state"], d["run_lease"], d["attempt"], d["lane_seq"]) for d in done_rows(conn, schema, jobs[0])] \
        == [(1, 1, 1, snaps[0].lane_seq)]
    assert n_rows(conn, schema, "lease_claim_closures", "outcome = 1") == 2
    assert counts(storage, conn, Q) == {"completed": 2, "running": 1}
    # repeats and already-closed attempts are stale and write nothing; the live one still completes
    assert storage.receipt_complete_rows(conn, snaps) == sorted((s.job_id, s.run_lease) for s in snaps[:2])
    assert n_done(conn, schema) == 3
    assert counts(storage, conn, Q) == {"completed": 3}
    assert storage.receipt_complete_rows(conn, []) == []


def test_complete_rows_across_a_claim_ring_rotation(schema, storage, conn):
    """One low-latency completion batch with attempts of two claim slots (one slot or several: same rows)."""
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    first = claim(storage, conn, Q, 2)
    assert storage.ring_rotate(conn, "claim") is not None
    second = claim(storage, conn, Q, 2)
    assert len({s.claim_slot for s in first + second}) == 2
    assert storage.receipt_complete_rows(conn, first[:1] + second) == []
    assert storage.receipt_complete_rows(conn, first + second[:1]) == \
        sorted([(first[0].job_id, 1), (second[0].job_id, 1)])
    assert sorted(d["job_id"] for j in jobs for d in done_rows(conn, schema, j)) == sorted(jobs)
    assert n_rows(conn, schema, "lease_claim_closures", "outcome = 1") == 4
    assert counts(storage, conn, Q) == {"completed": 4}


# ---------------------------------------------------------------------------
# retry, snooze


def test_retry_with_backoff_consumes_attempt_and_records_error(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"a": 1}, max_attempts=5)
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_RETRY, None, "boom") == "ok"

    d = deferred_row(conn, schema, job)
    assert d is not None
    assert (d["state"], d["attempt"], d["lease_base"], d["max_attempts"]) == (2, 1, 1, 5)
    assert jloads(d["errors"]) == [{"attempt": 1, "error": "boom"}]
    # backoff for attempt 1: 1**4 + 15 + random()*30 seconds, by the database clock
    assert 15.0 < d["due_in"] <= 46.5, d["due_in"]
    assert counts(storage, conn, Q) == {"retryable": 1}
    assert load(storage, conn, job)["state"] == "retryable"
    assert claim(storage, conn, Q, 10) == []

    assert storage.deferred_promote(conn) == 0  # not due yet
    make_due(conn, schema)
    assert storage.deferred_promote(conn) == 1
    assert counts(storage, conn, Q) == {"available": 1}
    again = claim_one(storage, conn)
    assert (again.job_id, again.run_lease, again.attempt) == (job, 2, 2)
    assert jloads(again.errors) == [{"attempt": 1, "error": "boom"}]
    assert complete(storage, conn, [again]) == []
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"], done["attempt"]) == (1, 2, 2)
    assert counts(storage, conn, Q) == {"completed": 1}


def test_retry_after_n_seconds(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_RETRY, 120.0, "later") == "ok"
    d = deferred_row(conn, schema, job)
    assert d is not None and d["state"] == 2 and d["attempt"] == 1
    assert 119.0 < d["due_in"] <= 120.0, d["due_in"]


def test_snooze_does_not_consume_an_attempt(schema, storage, conn):
    job = enqueue(schema, conn, Q, max_attempts=1)
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_SNOOZE, 30.0) == "ok"
    d = deferred_row(conn, schema, job)
    assert d is not None
    assert (d["state"], d["attempt"], d["lease_base"]) == (3, 0, 1)
    assert d["errors"] is None
    assert 29.0 < d["due_in"] <= 30.0
    assert counts(storage, conn, Q) == {"snoozed": 1}
    assert load(storage, conn, job)["state"] == "snoozed"
    make_due(conn, schema)
    assert storage.deferred_promote(conn) == 1
    again = claim_one(storage, conn)
    # max_attempts=1 and still runnable: the snooze gave the attempt back
    assert (again.run_lease, again.attempt) == (2, 1)
    assert close(storage, conn, again, CLOSE_COMPLETE) == "ok"
    assert counts(storage, conn, Q) == {"completed": 1}


# ---------------------------------------------------------------------------
# terminal failure, DLQ


def test_terminal_failure_goes_to_dlq_by_default(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"x": 1})
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_FAIL, None, "bad input") == "ok"
    assert done_rows(conn, schema, job) == []
    [entry] = storage.dlq_list(conn, Q)
    assert (entry["job_id"], entry["reason"], entry["attempt"]) == (job, "bad input", 1)
    assert counts(storage, conn, Q) == {"dlq": 1}
    got = load(storage, conn, job)
    assert got["state"] == "dlq" and got["args"] == {"x": 1}
    assert storage.job_cancel(conn, job) == "terminal"
    outcome = scalar(conn, schema, "SELECT outcome FROM __SCHEMA__.lease_claim_closures WHERE job_id = %s", (job,))
    assert outcome == 6


def test_terminal_failure_without_dlq_is_a_failed_done_entry(schema, storage, conn):
    storage.queue_configure(conn, Q, dlq_enabled=False)
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_FAIL, None, "bad input") == "ok"
    assert n_rows(conn, schema, "dlq_entries") == 0
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["error"], done["run_lease"], done["attempt"]) == (2, "bad input", 1, 1)
    assert counts(storage, conn, Q) == {"failed": 1}
    assert load(storage, conn, job)["state"] == "failed"


def test_exhausted_retries_go_to_dlq(schema, storage, conn):
    job = enqueue(schema, conn, Q, max_attempts=2)
    first = claim_one(storage, conn)
    assert close(storage, conn, first, CLOSE_RETRY, 0.0, "e1") == "ok"
    make_due(conn, schema)
    assert storage.deferred_promote(conn) == 1
    second = claim_one(storage, conn)
    assert (second.attempt, second.run_lease) == (2, 2)
    assert close(storage, conn, second, CLOSE_RETRY, 0.0, "e2") == "ok"
    assert n_rows(conn, schema, "deferred_jobs") == 0
    [entry] = storage.dlq_list(conn, Q)
    assert entry["job_id"] == job and entry["attempt"] == 2
    assert "attempts exhausted" in entry["reason"]
    got = load(storage, conn, job)
    assert got["state"] == "dlq"
    assert [e["attempt"] for e in got["errors"]] == [1, 2]
    assert counts(storage, conn, Q) == {"dlq": 1}


def test_dlq_list_retry_one_retry_queue_and_purge(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    other = enqueue(schema, conn, "other")
    for s in claim(storage, conn, Q, 10) + claim(storage, conn, "other", 10):
        assert close(storage, conn, s, CLOSE_FAIL, None, f"fail {s.job_id}") == "ok"
    listed = storage.dlq_list(conn, Q)
    assert sorted(e["job_id"] for e in listed) == jobs
    assert all(e["queue"] == Q and e["reason"] == f"fail {e['job_id']}" for e in listed)
    assert [e["job_id"] for e in storage.dlq_list(conn)] != [] and len(storage.dlq_list(conn)) == 5
    assert len(storage.dlq_list(conn, Q, limit=2)) == 2

    assert storage.dlq_retry(conn, [jobs[0]]) == [jobs[0]]
    assert counts(storage, conn, Q) == {"available": 1, "dlq": 3}
    snap = claim_one(storage, conn)
    # fresh attempts, a new run_lease
    assert (snap.job_id, snap.attempt, snap.run_lease) == (jobs[0], 1, 2)
    assert jloads(snap.args) == {"i": 0}
    assert close(storage, conn, snap, CLOSE_COMPLETE) == "ok"

    assert sorted(storage.dlq_retry(conn, queue=Q)) == jobs[1:]
    assert counts(storage, conn, Q) == {"available": 3, "completed": 1}
    assert counts(storage, conn, "other") == {"dlq": 1}
    assert storage.dlq_retry(conn, [jobs[0]]) == []  # not in the DLQ any more

    for s in claim(storage, conn, Q, 10):
        assert close(storage, conn, s, CLOSE_FAIL, None, "again") == "ok"
    assert storage.dlq_purge(conn, [jobs[1]]) == 1
    assert storage.dlq_purge(conn, queue=Q) == 2
    assert storage.dlq_list(conn, Q) == []
    assert [e["job_id"] for e in storage.dlq_list(conn)] == [other]
    assert counts(storage, conn, Q) == {"completed": 1}


# ---------------------------------------------------------------------------
# cancel


def test_cancel_unclaimed_job_tombstones_it(schema, storage, conn):
    a = enqueue(schema, conn, Q, {"a": 1})
    b = enqueue(schema, conn, Q, {"b": 1})
    assert storage.job_cancel(conn, a) == "cancelled"
    assert n_rows(conn, schema, "ready_tombstones", "job_id = %s", (a,)) == 1
    assert counts(storage, conn, Q) == {"available": 1, "cancelled": 1}
    assert load(storage, conn, a)["state"] == "cancelled"
    assert storage.job_cancel(conn, a) == "terminal"
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == [b]  # never claimed
    assert complete(storage, conn, snaps) == []
    assert counts(storage, conn, Q) == {"cancelled": 1, "completed": 1}
    [done] = done_rows(conn, schema, a)
    assert done["state"] == 3
    assert storage.job_cancel(conn, 12345) == "unknown"


def test_cancel_deferred_job(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"later": 1}, delay=3600)
    assert counts(storage, conn, Q) == {"scheduled": 1}
    assert storage.job_cancel(conn, job) == "cancelled"
    assert n_rows(conn, schema, "deferred_jobs") == 0
    [done] = done_rows(conn, schema, job)
    assert done["state"] == 3
    got = load(storage, conn, job)
    assert got["state"] == "cancelled" and got["args"] == {"later": 1}
    make_due(conn, schema)
    assert storage.deferred_promote(conn) == 0
    assert claim(storage, conn, Q, 10) == []
    assert counts(storage, conn, Q) == {"cancelled": 1}


def test_cancel_running_job_is_seen_by_heartbeat_and_wins_over_retry(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert [r.status for r in storage.attempt_heartbeat(conn, [snap])] == ["ok"]
    assert storage.job_cancel(conn, job) == "cancel_requested"
    assert [r.status for r in storage.attempt_heartbeat(conn, [snap])] == ["cancel"]
    assert counts(storage, conn, Q) == {"running": 1}
    # the handler asks for a retry; the cancel request turns it into a cancellation
    assert close(storage, conn, snap, CLOSE_RETRY, 1.0, "interrupted") == "ok"
    assert n_rows(conn, schema, "deferred_jobs") == 0
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"]) == (3, 1)
    assert n_rows(conn, schema, "attempt_state") == 0
    assert counts(storage, conn, Q) == {"cancelled": 1}
    assert load(storage, conn, job)["state"] == "cancelled"


def test_cancel_running_job_then_snooze_is_cancelled(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert storage.job_cancel(conn, job) == "cancel_requested"
    assert close(storage, conn, snap, CLOSE_SNOOZE, 5.0) == "ok"
    assert [d["state"] for d in done_rows(conn, schema, job)] == [3]
    assert counts(storage, conn, Q) == {"cancelled": 1}


def test_cancel_outcome_from_handler(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert close(storage, conn, snap, CLOSE_CANCEL, None, "not needed") == "ok"
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["error"]) == (3, "not needed")
    assert counts(storage, conn, Q) == {"cancelled": 1}


def test_cancel_waiting_callback_job(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    token = storage.attempt_register_callback(conn, snap, 3600)
    assert token is not None
    assert storage.job_cancel(conn, job) == "cancelled"
    assert n_rows(conn, schema, "leases") == 0
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"]) == (3, 1)
    assert storage.callback_resolve(conn, token, "complete") == "unknown"
    assert counts(storage, conn, Q) == {"cancelled": 1}


# ---------------------------------------------------------------------------
# heartbeat, progress, callbacks


def test_heartbeat_and_progress_create_attempt_state_lazily(schema, storage, conn):
    for i in range(3):
        enqueue(schema, conn, Q, {"i": i})
    a, b, c = claim(storage, conn, Q, 3)
    assert n_rows(conn, schema, "attempt_state") == 0
    assert [r.status for r in storage.attempt_heartbeat(conn, [a])] == ["ok"]
    assert n_rows(conn, schema, "attempt_state") == 1
    assert n_rows(conn, schema, "attempt_state", "job_id = %s AND run_lease = 1 AND heartbeat_at IS NOT NULL "
                                                 "AND progress IS NULL", (a.job_id,)) == 1
    res = storage.attempt_heartbeat(conn, [b], [raw({"pct": 50})])
    assert [(r.job_id, r.run_lease, r.status) for r in res] == [(b.job_id, 1, "ok")]
    assert jloads(scalar(conn, schema, "SELECT progress FROM __SCHEMA__.attempt_state WHERE job_id = %s",
                         (b.job_id,))) == {"pct": 50}
    # a later heartbeat without progress keeps the last progress
    assert [r.status for r in storage.attempt_heartbeat(conn, [b], [None])] == ["ok"]
    assert jloads(scalar(conn, schema, "SELECT progress FROM __SCHEMA__.attempt_state WHERE job_id = %s",
                         (b.job_id,))) == {"pct": 50}
    assert n_rows(conn, schema, "attempt_state") == 2
    assert n_rows(conn, schema, "leases") == 0
    # completion drops the state of the attempts that had some; c never had any
    assert complete(storage, conn, [a, b, c], whole=True, with_state=[a, b]) == []
    assert n_rows(conn, schema, "attempt_state") == 0
    assert counts(storage, conn, Q) == {"completed": 3}


def test_callback_register_materializes_a_lease(schema, storage, conn):
    job = enqueue(schema, conn, Q, {"cb": 1})
    snap = claim_one(storage, conn)
    token = storage.attempt_register_callback(conn, snap, 600)
    assert isinstance(token, uuid.UUID)
    row = sqlx(conn, schema, "SELECT job_id, run_lease, attempt, queue, callback_token, "
                             "extract(epoch FROM callback_timeout_at - now())::float8 "
                             "FROM __SCHEMA__.leases").fetchall()
    assert len(row) == 1
    assert row[0][:5] == (job, 1, 1, Q, token) and 599 < row[0][5] <= 600
    assert scalar(conn, schema, "SELECT outcome FROM __SCHEMA__.lease_claim_closures WHERE job_id = %s",
                  (job,)) == 8
    assert counts(storage, conn, Q) == {"waiting": 1}
    got = load(storage, conn, job)
    assert got["state"] == "waiting_external" and got["args"] == {"cb": 1}
    # registering twice is stale: the receipt attempt is closed (materialized)
    assert storage.attempt_register_callback(conn, snap, 600) is None
    # heartbeat of a lease-backed attempt still works
    assert [r.status for r in storage.attempt_heartbeat(conn, [snap])] == ["ok"]


def _parked(schema, storage, conn, **kw):
    job = enqueue(schema, conn, Q, {"cb": True}, **kw)
    snap = claim_one(storage, conn)
    token = storage.attempt_register_callback(conn, snap, 600)
    assert token is not None
    return job, snap, token


def test_callback_resolve_complete(schema, storage, conn):
    job, snap, token = _parked(schema, storage, conn)
    assert storage.callback_resolve(conn, token, "complete") == "ok"
    assert n_rows(conn, schema, "leases") == 0
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"], done["attempt"]) == (1, 1, 1)
    assert counts(storage, conn, Q) == {"completed": 1}
    assert storage.callback_resolve(conn, token, "complete") == "unknown"
    assert storage.callback_resolve(conn, uuid.uuid4(), "complete") == "unknown"


def test_callback_resolve_fail(schema, storage, conn):
    job, snap, token = _parked(schema, storage, conn)
    assert storage.callback_resolve(conn, token, "fail", None, "remote said no") == "ok"
    [entry] = storage.dlq_list(conn, Q)
    assert (entry["job_id"], entry["reason"]) == (job, "remote said no")
    assert counts(storage, conn, Q) == {"dlq": 1}


def test_callback_resolve_fail_without_dlq(schema, storage, conn):
    storage.queue_configure(conn, Q, dlq_enabled=False)
    job, snap, token = _parked(schema, storage, conn)
    assert storage.callback_resolve(conn, token, "fail") == "ok"
    [done] = done_rows(conn, schema, job)
    assert done["state"] == 2
    assert counts(storage, conn, Q) == {"failed": 1}


def test_callback_resolve_retry(schema, storage, conn):
    job, snap, token = _parked(schema, storage, conn, max_attempts=3)
    assert storage.callback_resolve(conn, token, "retry", None, "try later") == "ok"
    d = deferred_row(conn, schema, job)
    assert d is not None and (d["state"], d["attempt"], d["lease_base"]) == (2, 1, 1)
    assert jloads(d["errors"]) == [{"attempt": 1, "error": "try later"}]
    assert counts(storage, conn, Q) == {"retryable": 1}


def test_callback_resolve_resume_runs_again_with_result(schema, storage, conn):
    job, snap, token = _parked(schema, storage, conn, max_attempts=1)
    assert storage.callback_resolve(conn, token, "resume", raw({"answer": 42})) == "ok"
    assert n_rows(conn, schema, "leases") == 0
    assert counts(storage, conn, Q) == {"available": 1}
    again = claim_one(storage, conn)
    assert (again.job_id, again.run_lease, again.attempt) == (job, 2, 1)  # attempt not consumed
    assert jloads(again.callback_result) == {"answer": 42}
    assert jloads(again.args) == {"cb": True}
    assert complete(storage, conn, [again]) == []
    [done] = done_rows(conn, schema, job)
    assert (done["state"], done["run_lease"], done["attempt"]) == (1, 2, 1)


def test_callback_resolve_unknown_action_is_refused(schema, storage, conn):
    import psycopg

    job, snap, token = _parked(schema, storage, conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        storage.callback_resolve(conn, token, "explode")
    assert counts(storage, conn, Q) == {"waiting": 1}


def test_callback_timeout_is_rescued(schema, storage, conn):
    job, snap, token = _parked(schema, storage, conn, max_attempts=3)
    assert storage.lease_rescue_expired(conn) == 0  # 600 s timeout: not expired
    job2 = enqueue(schema, conn, Q)
    snap2 = claim_one(storage, conn)
    assert snap2.job_id == job2
    assert storage.attempt_register_callback(conn, snap2, 0) is not None
    assert storage.lease_rescue_expired(conn) == 1
    d = deferred_row(conn, schema, job2)
    assert d is not None and (d["state"], d["attempt"]) == (2, 1)
    assert jloads(d["errors"]) == [{"attempt": 1, "error": "callback timed out"}]
    assert counts(storage, conn, Q) == {"waiting": 1, "retryable": 1}
    assert n_rows(conn, schema, "leases", "job_id = %s", (job2,)) == 0


# ---------------------------------------------------------------------------
# rescue and stale writers


def test_stale_writers_after_rescue_are_rejected(schema, storage, conn):
    storage.queue_configure(conn, Q, heartbeat_timeout=0)
    job = enqueue(schema, conn, Q, {"r": 1}, max_attempts=3)
    old = claim_one(storage, conn)
    assert (old.run_lease, old.attempt) == (1, 1)
    assert storage.receipt_rescue_stale(conn) == 1
    assert scalar(conn, schema, "SELECT outcome FROM __SCHEMA__.lease_claim_closures WHERE job_id = %s "
                                "AND run_lease = 1", (job,)) == 7
    assert counts(storage, conn, Q) == {"available": 1}

    # every write of the rescued attempt is stale and changes nothing
    assert complete(storage, conn, [old]) == [(job, 1)]
    assert storage.receipt_complete_rows(conn, [old]) == [(job, 1)]
    assert [r.status for r in storage.attempt_heartbeat(conn, [old])] == ["stale"]
    assert [r.status for r in storage.attempt_heartbeat(conn, [old], [raw({"pct": 99})])] == ["stale"]
    assert storage.attempt_register_callback(conn, old, 60) is None
    assert close(storage, conn, old, CLOSE_FAIL, None, "late") == "stale"
    assert close(storage, conn, old, CLOSE_RETRY, 1.0, "late") == "stale"
    assert n_rows(conn, schema, "attempt_state") == 0
    assert n_rows(conn, schema, "leases") == 0
    assert n_done(conn, schema) == 0
    assert n_rows(conn, schema, "dlq_entries") == 0
    assert n_rows(conn, schema, "deferred_jobs") == 0

    new = claim_one(storage, conn)
    assert (new.job_id, new.run_lease, new.attempt) == (job, 2, 2)
    assert jloads(new.errors) == [{"attempt": 1, "error": "rescued: heartbeat stale"}]
    assert complete(storage, conn, [new]) == []
    assert complete(storage, conn, [old]) == [(job, 1)]
    rows = done_rows(conn, schema, job)
    assert len(rows) == 1
    assert (rows[0]["state"], rows[0]["run_lease"], rows[0]["attempt"]) == (1, 2, 2)
    assert counts(storage, conn, Q) == {"completed": 1}


def test_rescue_after_heartbeat_and_exhausted_rescue(schema, storage, conn):
    storage.queue_configure(conn, Q, heartbeat_timeout=0, dlq_enabled=False)
    job = enqueue(schema, conn, Q, max_attempts=1)
    snap = claim_one(storage, conn)
    assert [r.status for r in storage.attempt_heartbeat(conn, [snap])] == ["ok"]
    assert storage.receipt_rescue_stale(conn) == 1
    assert n_rows(conn, schema, "attempt_state") == 0
    [done] = done_rows(conn, schema, job)
    assert done["state"] == 2 and "attempts exhausted" in done["error"]
    assert counts(storage, conn, Q) == {"failed": 1}


def test_deadline_rescue(schema, storage, conn):
    storage.queue_configure(conn, Q, deadline=1e-6)  # 0 means no deadline
    job = enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert storage.receipt_rescue_stale(conn) == 1
    again = claim_one(storage, conn)
    assert (again.job_id, again.run_lease) == (job, 2)
    assert jloads(again.errors)[0]["error"] == "rescued: deadline exceeded"
    assert complete(storage, conn, [snap]) == [(job, 1)]


def test_no_rescue_of_fresh_attempts(schema, storage, conn):
    enqueue(schema, conn, Q)
    snap = claim_one(storage, conn)
    assert storage.receipt_rescue_stale(conn) == 0  # default 30 s heartbeat timeout
    assert complete(storage, conn, [snap]) == []


# ---------------------------------------------------------------------------
# deferred promotion, priority, aging, pause


def test_promotion_of_due_deferred_jobs(schema, storage, conn):
    run_at = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    a = enqueue(schema, conn, Q, {"a": 1}, run_at=run_at)
    b = enqueue(schema, conn, Q, {"b": 1}, delay=600)
    c = enqueue(schema, conn, Q, {"c": 1}, delay=0)  # not deferred
    assert counts(storage, conn, Q) == {"scheduled": 2, "available": 1}
    assert load(storage, conn, a)["state"] == "scheduled"
    assert storage.deferred_promote(conn) == 0
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == [c]
    make_due(conn, schema)
    assert storage.deferred_promote(conn, 1) == 1
    assert storage.deferred_promote(conn) == 1
    assert storage.deferred_promote(conn) == 0
    snaps = claim(storage, conn, Q, 10)
    assert sorted(s.job_id for s in snaps) == sorted([a, b])
    assert all((s.run_lease, s.attempt) == (1, 1) for s in snaps)


def test_priority_one_is_claimed_before_two(schema, storage, conn):
    low = enqueue(schema, conn, Q, priority=4)
    mid = enqueue(schema, conn, Q, priority=2)
    high = enqueue(schema, conn, Q, priority=1)
    assert [s.job_id for s in claim(storage, conn, Q, 1)] == [high]
    assert [s.job_id for s in claim(storage, conn, Q, 1)] == [mid]
    snaps = claim(storage, conn, Q, 5)
    assert [(s.job_id, s.priority) for s in snaps] == [(low, 4)]


def _backdate_lane_head(conn, schema, job_id: int, seconds: float) -> None:
    n = sqlx(conn, schema, "UPDATE __SCHEMA__.ready_segments g "
                           "SET created_at = g.created_at - make_interval(secs => %s) "
                           "FROM __SCHEMA__.ready_entries e WHERE e.job_id = %s AND g.lane_id = e.lane_id "
                           "AND e.lane_seq BETWEEN g.first_seq AND g.last_seq", (seconds, job_id)).rowcount
    assert n == 1


@pytest.mark.parametrize("aging", [None, 0.01])
def test_claim_time_aging(schema, storage, conn, aging):
    if aging is not None:
        storage.queue_configure(conn, Q, aging_interval=aging)
    old_low = enqueue(schema, conn, Q, priority=2)
    new_high = enqueue(schema, conn, Q, priority=1)
    _backdate_lane_head(conn, schema, old_low, 1.0)
    first = claim(storage, conn, Q, 1)
    if aging is None:  # 60 s default: one second of waiting does not outrank priority 1
        assert [s.job_id for s in first] == [new_high]
    else:  # 100 aging intervals waited: the older priority-2 head wins
        assert [s.job_id for s in first] == [old_low]


def test_claim_time_aging_ignores_history_already_claimed(schema, storage, conn):
    old = enqueue(schema, conn, Q, {"old": 1}, priority=2)  # enqueued (back-dated) an hour ago ...
    assert complete(storage, conn, claim(storage, conn, Q, 10)) == []  # ... claimed and completed long ago
    _backdate_lane_head(conn, schema, old, 3600)
    fresh_low = enqueue(schema, conn, Q, {"fresh": 2}, priority=2)
    fresh_high = enqueue(schema, conn, Q, {"fresh": 1}, priority=1)
    # both fresh jobs waited ~0 s (default aging 60 s): priority 1 must win
    assert [s.job_id for s in claim(storage, conn, Q, 1)] == [fresh_high]
    assert [s.job_id for s in claim(storage, conn, Q, 1)] == [fresh_low]


def test_paused_queue_claims_nothing(schema, storage, conn):
    job = enqueue(schema, conn, Q)
    assert storage.queue_pause(conn, Q, True) is True
    assert claim(storage, conn, Q, 10) == []
    assert counts(storage, conn, Q) == {"available": 1}
    assert storage.queue_pause(conn, Q, False) is True
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == [job]
    assert storage.queue_pause(conn, "nope", True) is False
    assert claim(storage, conn, "nope", 10) == []


# ---------------------------------------------------------------------------
# reads in every state


def test_load_job_and_exact_counts_in_every_state(schema, storage, conn):
    storage.queue_configure(conn, "nodlq", dlq_enabled=False)
    jobs: dict[str, int] = {}
    jobs["completed"] = enqueue(schema, conn, Q, {"s": "completed"})
    jobs["cancelled"] = enqueue(schema, conn, Q, {"s": "cancelled"})
    jobs["dlq"] = enqueue(schema, conn, Q, {"s": "dlq"})
    jobs["retryable"] = enqueue(schema, conn, Q, {"s": "retryable"})
    jobs["snoozed"] = enqueue(schema, conn, Q, {"s": "snoozed"})
    jobs["waiting_external"] = enqueue(schema, conn, Q, {"s": "waiting"})
    jobs["running"] = enqueue(schema, conn, Q, {"s": "running"})
    failed = enqueue(schema, conn, "nodlq", {"s": "failed"})
    snaps = {jloads(s.args)["s"]: s for s in claim(storage, conn, Q, 100)}
    assert len(snaps) == 7
    [fsnap] = claim(storage, conn, "nodlq", 10)
    assert storage.job_cancel(conn, jobs["cancelled"]) == "cancel_requested"
    assert close(storage, conn, snaps["cancelled"], CLOSE_RETRY, 5.0, "x") == "ok"
    assert complete(storage, conn, [snaps["completed"]]) == []
    assert close(storage, conn, snaps["dlq"], CLOSE_FAIL, None, "boom") == "ok"
    assert close(storage, conn, snaps["retryable"], CLOSE_RETRY, 600.0, "again") == "ok"
    assert close(storage, conn, snaps["snoozed"], CLOSE_SNOOZE, 600.0) == "ok"
    assert storage.attempt_register_callback(conn, snaps["waiting"], 600) is not None
    assert close(storage, conn, fsnap, CLOSE_FAIL, None, "no dlq") == "ok"
    jobs["available"] = enqueue(schema, conn, Q, {"s": "available"})
    jobs["scheduled"] = enqueue(schema, conn, Q, {"s": "scheduled"}, delay=600)
    jobs["cancelled_unclaimed"] = enqueue(schema, conn, Q, {"s": "cancelled_unclaimed"})
    assert storage.job_cancel(conn, jobs["cancelled_unclaimed"]) == "cancelled"

    assert storage.queue_counts_exact(conn) == {
        Q: {"available": 1, "running": 1, "waiting": 1, "scheduled": 1, "retryable": 1, "snoozed": 1,
            "completed": 1, "cancelled": 2, "dlq": 1},
        "nodlq": {"failed": 1},
    }
    for state, job in jobs.items():
        got = load(storage, conn, job)
        assert got is not None, state
        assert got["state"] == state.replace("cancelled_unclaimed", "cancelled"), (state, got)
        assert got["job_id"] == job and got["queue"] == Q
        assert got["args"] == {"s": state.replace("waiting_external", "waiting")}, (state, got)
    got = load(storage, conn, failed)
    assert got["state"] == "failed" and got["queue"] == "nodlq" and got["args"] == {"s": "failed"}
    assert load(storage, conn, 987654321) is None
    assert storage.queue_depth_fast(conn)[Q] >= 1
