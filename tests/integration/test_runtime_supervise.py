"""``awa-fast supervise`` end to end: real processes, real PostgreSQL.

Load through two claimer stripes (sync and async handlers), a graceful
drain on SIGTERM, and what a short completed job leaves behind.
"""

from __future__ import annotations

import collections
import signal
import time

import psycopg
import pytest

from tests.fixtures.database import sqlx_all
from tests.fixtures.supervisor import SupervisorProc, group_gone
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import (
    QUEUE,
    RunLog,
    counts,
    done_rows_by_job,
    enqueue_bulk,
    enqueue_one,
    rollups,
)

pytestmark = pytest.mark.integration


def test_20k_jobs_two_stripes_each_completed_exactly_once(pg_dsn, schema, storage, conn, tmp_path):
    n_half = 10_000
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=2,concurrency=16"]) as sup:
        sup.wait_running(2)
        sync_ids = enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(n_half)))
        async_ids = enqueue_bulk(pg_dsn, schema, "rt.async", ({"i": i} for i in range(n_half)))
        assert len(sync_ids) == len(async_ids) == n_half
        all_ids = set(sync_ids) | set(async_ids)

        wait_for(lambda: counts(storage, conn).get("completed", 0) >= 2 * n_half, 150,
                 "20,000 completions", interval=0.2,
                 on_timeout=lambda: f"{counts(storage, conn)}\n{sup.tail()}")
        local = sup.local_status()
        assert sup.stop(60) == 0, sup.tail()

    final = counts(storage, conn)
    assert final == {"completed": 2 * n_half}, final

    # Durable side: exactly one done row per job, completed on its first attempt.
    # (A ready slot sealed and pruned under the test folds its done rows into
    # the rollups; then the rows left plus the rollups must still add up.)
    done = done_rows_by_job(conn, schema)
    dups = {j: rows for j, rows in done.items() if len(rows) > 1}
    assert not dups, f"jobs with more than one done row: {list(dups.items())[:5]}"
    pruned = rollups(conn, schema)
    assert set(pruned) <= {(QUEUE, 1)}, pruned
    assert len(done) + sum(pruned.values()) == 2 * n_half
    assert set(done) <= all_ids
    if not pruned:
        assert set(done) == all_ids
    assert {rows[0] for rows in done.values()} == {(1, 1, 1)}  # (completed, attempt 1, run_lease 1)

    # Handler side: every job ran exactly once, in the right kind of handler.
    runs = runlog.entries("run")
    per_job = collections.Counter(e["job"] for e in runs)
    assert set(per_job) == all_ids
    assert max(per_job.values()) == 1, [j for j, c in per_job.items() if c > 1][:5]
    kinds = {e["job"]: e["kind"] for e in runs}
    assert all(kinds[j] == "rt.sync" for j in sync_ids)
    assert all(kinds[j] == "rt.async" for j in async_ids)

    # Both stripes took part (claimer counters from shared memory).
    assert local is not None
    claimed = {c["stripe"]: c["claimed"] for c in local["claimers"]}
    assert set(claimed) == {0, 1} and all(v > 0 for v in claimed.values()), claimed
    assert len({e["pid"] for e in runs}) == 2


def test_completed_short_job_leaves_no_attempt_state_or_lease(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, heartbeat_interval=0.3) as sup:
        sup.wait_running(2)
        short = enqueue_one(pg_dsn, schema, "rt.sync", {"n": 1})
        # A longer job heartbeats (creating attempt_state); it must go when the attempt ends.
        long = enqueue_one(pg_dsn, schema, "rt.sleep", {"ms": 1500})
        wait_for(lambda: sqlx_all(conn, schema, "SELECT 1 FROM __SCHEMA__.attempt_state WHERE job_id = %s", (long,)),
                 10, "the long job's first heartbeat (attempt_state row)", on_timeout=sup.tail)
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 2, 20, "both jobs completed",
                 on_timeout=sup.tail)
        for job_id in (short, long):
            job = storage.job_load(conn, job_id)
            assert job is None or job["state"] == "completed", job  # None: history already pruned
        assert sqlx_all(conn, schema, "SELECT job_id FROM __SCHEMA__.attempt_state") == []
        assert sqlx_all(conn, schema, "SELECT job_id FROM __SCHEMA__.leases") == []
        assert sup.stop() == 0, sup.tail()


def test_sigterm_mid_load_drains_cleanly_and_a_second_supervisor_finishes(pg_dsn, schema, storage, conn,
                                                                           tmp_path):
    total = 5_000
    runlog = RunLog(tmp_path / "runlog")
    ids = set(enqueue_bulk(pg_dsn, schema, "rt.sleep", ({"ms": 5} for _ in range(total))))
    assert len(ids) == total
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, name="first",
                        queues=[f"{QUEUE}:stripes=2,concurrency=4"]) as sup:
        sup.wait_running(2)
        wait_for(lambda: counts(storage, conn).get("completed", 0) >= 500, 60, "500 completions",
                 on_timeout=sup.tail)
        sup.send(signal.SIGTERM)
        code = sup.wait(60)
        assert code == 0, sup.tail()
        assert "drained (clean)" in sup.output(), sup.tail()
        wait_for(lambda: group_gone(sup.pid), 10, "no process of the drained supervisor left")

    mid = counts(storage, conn)
    assert "running" not in mid, f"open claims left after a clean drain: {mid}"
    assert "waiting" not in mid and "failed" not in mid and "dlq" not in mid, mid
    assert 500 <= mid["completed"] < total, f"SIGTERM did not land mid-load: {mid}"
    # Hand-back gives the attempt back: nothing left over was charged an attempt.
    started = {e["job"] for e in runlog.entries("start")}
    finished = {e["job"] for e in runlog.entries("run")}
    assert started == finished, f"handlers cut off mid-run: {sorted(started - finished)[:5]}"

    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, name="second",
                        queues=[f"{QUEUE}:stripes=2,concurrency=16"]) as sup2:
        wait_for(lambda: counts(storage, conn).get("completed", 0) >= total, 40, "all 5,000 completed",
                 interval=0.1, on_timeout=lambda: f"{counts(storage, conn)}\n{sup2.tail()}")
        assert sup2.stop() == 0, sup2.tail()

    assert counts(storage, conn) == {"completed": total}
    done = done_rows_by_job(conn, schema)
    pruned = sum(rollups(conn, schema).values())
    assert all(len(rows) == 1 for rows in done.values()), "a job has two done rows"
    assert len(done) + pruned == total
    assert set(done) <= ids
    # Exactly once on the handler side too, and no attempt consumed by the drain
    # (done rows of sealed ready slots are pruned by now: the run log has the attempts).
    runs = runlog.entries("run")
    per_job = collections.Counter(e["job"] for e in runs)
    assert set(per_job) == ids
    assert max(per_job.values()) == 1
    assert {e["attempt"] for e in runs} == {1}, "a handed-back job was charged an attempt"
    assert {rows[0][1] for rows in done.values()} <= {1}


def test_drain_hands_back_claimed_jobs_that_have_not_started(pg_dsn, schema, storage, conn, tmp_path):
    """SIGTERM: running handlers finish, claimed-but-unstarted jobs are handed back, nothing new starts.

    A claim of 32 with concurrency 2 leaves 30 jobs waiting locally; running
    them all (300 ms each) would take ~4.5 s, longer than the 3 s drain timeout.
    """
    runlog = RunLog(tmp_path / "runlog")
    ids = set(enqueue_bulk(pg_dsn, schema, "rt.sleep", ({"ms": 300} for _ in range(40))))
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, drain_timeout=3,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2,batch=32"]) as sup:
        sup.wait_running(1)
        wait_for(lambda: len(runlog.entries("start")) >= 2, 20, "two handlers started", on_timeout=sup.tail)
        sigterm_at = time.time()
        sup.send(signal.SIGTERM)
        code = sup.wait(30)
        drain_s = time.time() - sigterm_at
    late = [e for e in runlog.entries("start") if e["t"] > sigterm_at + 0.05]
    mid = counts(storage, conn)
    assert (code, len(late), mid.get("running", 0)) == (0, 0, 0), (
        f"exit code {code} after {drain_s:.1f}s; {len(late)} handlers started after SIGTERM; counts {mid}\n"
        f"{sup.tail()}")
    # The handed-back jobs wait (snoozed, attempt not consumed) for the next supervisor.
    assert mid.get("completed", 0) + mid.get("snoozed", 0) + mid.get("available", 0) == len(ids), mid


def test_job_load_of_a_running_job_shows_the_attempt_being_run(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, queues=[f"{QUEUE}:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        job_id = enqueue_one(pg_dsn, schema, "rt.sleep", {"ms": 3000})
        started = wait_for(lambda: runlog.for_job(job_id, "start"), 10, "the handler to start",
                           on_timeout=sup.tail)[0]
        job = storage.job_load(conn, job_id)
        assert job["state"] == "running"
        assert (job["attempt"], job["run_lease"]) == (started["attempt"], started["lease"]) == (1, 1), job


def test_one_job_at_a_time_costs_about_one_claim_each(pg_dsn, schema, storage, conn, tmp_path):
    """At a trickle, a claimer claims once per wakeup: no empty claim after each job or completion.

    The poll interval is far longer than the test, so every pickup comes from a
    NOTIFY; a claimer that re-claimed after each short claim and after each
    completion made about three claim calls per job.

    Counted against the work observed: every job is claimed by a claim of its
    own (claims that returned a job == jobs claimed), and the empty claims stay
    under half a job's worth each. Either old behaviour alone (an empty claim
    after each short claim, or after each completion) makes about one empty
    claim per job; a loaded machine adds a few spurious ones (the claimer's
    own start-up wakeups, a completion's wake that lands during the next
    claim), never one per job.
    """
    n = 20

    def claimer() -> dict:
        return (sup.local_status() or {}).get("claimers", [{}])[0]

    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=1,concurrency=4"],
                        poll_interval=60.0) as sup:
        sup.wait_running(1)
        wait_for(lambda: claimer().get("claim_calls", 0) >= 1, 10, "the claimer's first poll", on_timeout=sup.tail)
        before = claimer()  # one seqlock snapshot: claimed, claim_calls and empty_claims agree
        for i in range(n):
            enqueue_one(pg_dsn, schema, "rt.sync", {"i": i})
            wait_for(lambda: counts(storage, conn).get("completed", 0) == i + 1, 10, f"job {i} completed",
                     interval=0.005, on_timeout=sup.tail)
        # the counters are published after each claim; wait until the last claim's are in
        def caught_up() -> dict | None:
            c = claimer()
            return c if c.get("claimed", 0) - before["claimed"] == n else None

        after = wait_for(caught_up, 10, "the claimer's counters to show every claim", on_timeout=sup.tail)
        assert sup.stop() == 0, sup.tail()
    calls = after["claim_calls"] - before["claim_calls"]
    empty = after["empty_claims"] - before["empty_claims"]
    assert after["claimed"] - before["claimed"] == n, (before, after)
    assert calls - empty == n, f"{calls} claim calls, {empty} empty: {calls - empty} returned jobs, {n} jobs"
    assert empty <= n // 2, f"{empty} empty claims for {n} jobs ({calls} claim calls)"


def test_a_busy_lane_is_retried_every_few_ms_not_at_the_poll_interval(pg_dsn, schema, storage, conn, tmp_path):
    """While another session holds the lane head, the claimer keeps trying at a short cap.

    Two stripes draining one lane take turns on its head; a pause that
    doubled towards the poll interval left one stripe asleep while the other
    drained alone. Here the test holds every lane head of the queue for 1.5 s
    with jobs waiting: a claimer capped at 20 ms makes ~70 claim calls, one
    that doubled its pause towards 1 s makes ~10.
    """
    hold = 1.5
    storage.queue_configure(conn, QUEUE, enqueue_shards=1)  # one lane: the one the test holds
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=1,concurrency=4"],
                        poll_interval=1.0) as sup:
        sup.wait_running(1)
        enqueue_one(pg_dsn, schema, "rt.sync", {"i": -1})  # the lane exists and the claimer is warm
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 1, 10, "the first job", on_timeout=sup.tail)
        wait_for(lambda: (sup.local_status() or {}).get("claimers", [{}])[0].get("completed", 0) >= 1, 10,
                 "the claimer's counters", on_timeout=sup.tail)
        before = sup.local_status()["claimers"][0]["claim_calls"]
        with psycopg.connect(pg_dsn) as holder:  # a transaction: the row locks last until rollback
            sqlx_all(holder, schema, "SELECT 1 FROM __SCHEMA__.queue_claim_heads WHERE queue = %s FOR UPDATE", (QUEUE,))
            for i in range(5):
                enqueue_one(pg_dsn, schema, "rt.sync", {"i": i})
            time.sleep(hold)  # the fault's length, not a wait for an event
            holder.rollback()
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 6, 10, "the held jobs", on_timeout=sup.tail)
        wait_for(lambda: sup.local_status()["claimers"][0]["completed"] >= 6, 10, "the counters to catch up",
                 on_timeout=sup.tail)
        calls = sup.local_status()["claimers"][0]["claim_calls"] - before
        assert sup.stop() == 0, sup.tail()
    assert 30 <= calls <= hold / 0.002, calls
