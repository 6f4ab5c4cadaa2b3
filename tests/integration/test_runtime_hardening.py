"""No handler, progress value or unknown kind can wedge or poison a claimer (issue 9, items 1-4 and 12).

Real ``awa-fast supervise`` processes against the session's PostgreSQL,
with the handlers of ``runtime_apps_hardening``:

1. Every ``BaseException`` a handler raises (sync and async) closes its
   attempt as a retry naming the exception, counted against max_attempts;
   no other job of that claimer is held or rescued, and it goes on claiming.
   A worker or loop thread that dies anyway makes the claimer exit 1; the
   supervisor restarts it and the attempt is rescued.
2. A bad ``set_progress`` value raises PayloadError in the handler and never
   reaches the heartbeat; the heartbeat itself survives a bad entry.
3. A rescued or cancelled attempt is told (``job.is_cancelled()``), an async
   handler's task is cancelled without writing anything; a sync one is
   counted as abandoned while it still runs.
4. A queue has a one-hour deadline unless told otherwise.
12. An unknown kind is retried with backoff, not dead-lettered at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest

from awa_fast.client import Client
from awa_fast.errors import OutOfRange, PayloadError
from awa_fast.jobs import Job
from awa_fast.runtime.attempts import AttemptTable
from awa_fast.runtime.heartbeat import Heartbeat, HeartbeatConfig
from awa_fast.storage import RawJson
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import migrations, render
from tests.fixtures.database import migrate_before, sqlx_all
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_apps_hardening import CANCEL_QUEUE
from tests.integration.runtime_helpers import (
    QUEUE,
    RunLog,
    done_rows_by_job,
    enqueue_one,
)

pytestmark = pytest.mark.integration

APP = "tests.integration.runtime_apps_hardening:app"


def _state(storage, conn, job_id, want, sup, timeout=20.0):  # noqa: ANN001, ANN202
    """Wait until job_load says ``want``; return the job."""
    def check():  # noqa: ANN202
        job = storage.job_load(conn, job_id)
        return job if job is not None and job["state"] == want else None
    return wait_for(check, timeout, f"job {job_id} to be {want}",
                    on_timeout=lambda: f"now: {storage.job_load(conn, job_id)}\n{sup.tail(60)}")


def _claimer(sup: SupervisorProc, queue: str = QUEUE) -> dict[str, Any]:
    snap = sup.local_status()
    assert snap is not None, sup.tail()
    return next(c for c in snap["claimers"] if c["queue"] == queue)


def _enqueue_together(dsn: str, schema: str, jobs: list[tuple[str, dict[str, Any], int]]) -> list[int]:
    """Enqueue ``(kind, args, max_attempts)`` jobs in one transaction: one claim takes them all."""
    client = Client(schema=schema)
    with psycopg.connect(dsn) as c:
        ids = [client.enqueue(kind, args, queue=QUEUE, max_attempts=attempts, conn=c)
               for kind, args, attempts in jobs]
    return ids


# ---------------------------------------------------------------------------------------
# 1. BaseException from a handler


SYNC_CASES = {"exit0": "SystemExit: 0", "exit3": "SystemExit: 3", "kbd": "KeyboardInterrupt",
              "custom": "HandlerBaseError: custom base", "cancelled": "CancelledError", "genexit": "GeneratorExit"}
ASYNC_CASES = {**SYNC_CASES, "selfcancel": "CancelledError"}


def test_every_base_exception_closes_its_attempt_and_the_claimer_goes_on(pg_dsn, schema, storage, conn,
                                                                         tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    # Two sync workers and two async slots: each raising job shares its chunk (sync) or its
    # loop (async) with innocent jobs claimed in the same batch.
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        plan: list[tuple[str, dict[str, Any], int]] = []
        for exc in SYNC_CASES:
            plan += [("hx.raise", {"exc": exc}, 2), ("hx.ok", {}, 25), ("hx.aok", {}, 25)]
        for exc in ASYNC_CASES:
            plan += [("hx.araise", {"exc": exc}, 2), ("hx.aok", {}, 25), ("hx.ok", {}, 25)]
        ids = _enqueue_together(pg_dsn, schema, plan)
        raising = {i: (kind, args["exc"]) for i, (kind, args, _) in zip(ids, plan) if "raise" in kind}
        innocent = [i for i, (kind, _, _) in zip(ids, plan) if "raise" not in kind]

        # Attempt 1 of each raising job closes as a retry that names the exception.
        for job_id, (kind, exc) in raising.items():
            job = _state(storage, conn, job_id, "retryable", sup)
            want = (SYNC_CASES if kind == "hx.raise" else ASYNC_CASES)[exc]
            # the first line names the exception; the traceback's tail follows it
            assert job["attempt"] == 1 and job["errors"][-1]["error"].split("\n")[0] == want, (kind, exc, job)
        for job_id in innocent:
            _state(storage, conn, job_id, "completed", sup)

        # Attempt 2 (made due now): counted against max_attempts=2, so the DLQ.
        for job_id in raising:
            assert storage.deferred_run_now(conn, job_id)
        for job_id, (kind, exc) in raising.items():
            job = _state(storage, conn, job_id, "dlq", sup)
            want = (SYNC_CASES if kind == "hx.raise" else ASYNC_CASES)[exc]
            assert job["attempt"] == 2 and want in job["error"] and "attempts exhausted" in job["error"], job

        # The claimer goes on claiming: later jobs of both kinds complete.
        later = [enqueue_one(pg_dsn, schema, "hx.ok"), enqueue_one(pg_dsn, schema, "hx.aok")]
        for job_id in later:
            _state(storage, conn, job_id, "completed", sup)
        claimer = _claimer(sup)
        assert sup.stop() == 0, sup.tail()

    # One claimer process all along, nothing rescued: every innocent job ran once, run_lease 1.
    assert claimer["starts"] == 1 and claimer["stale"] == 0, claimer
    assert "restarting in" not in sup.output() and " died (" not in sup.output(), sup.tail()
    done = done_rows_by_job(conn, schema)
    for job_id in innocent + later:
        assert done[job_id] == [(1, 1, 1)], (job_id, done.get(job_id))
        assert [e["lease"] for e in runlog.for_job(job_id, "run")] == [1]
    assert [(e["lease"]) for j in raising for e in runlog.for_job(j, "raise")] == [1, 2] * len(raising)


def test_a_worker_thread_that_dies_anyway_stops_its_claimer_and_the_attempt_is_rescued(
        pg_dsn, schema, storage, conn, tmp_path):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=2)
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2"], drain_timeout=5) as sup:
        first = sup.wait_running(1)[(QUEUE, 0)]
        killer = enqueue_one(pg_dsn, schema, "hx.kill_worker")
        job = _state(storage, conn, killer, "completed", sup, timeout=30)
        assert job["attempt"] == 2 and job["run_lease"] == 2, job
        assert "rescued: heartbeat stale" in job["errors"][-1]["error"], job
        out = sup.output()
        assert "worker thread awa-worker-" in out and "died (SystemExit: error_text broke (test))" in out, out
        assert "claimer q#0 exited with code 1" in out, sup.tail()
        second = wait_for(lambda: (p := sup.claimer_pids().get((QUEUE, 0))) and p != first and p, 20,
                          "a restarted claimer", on_timeout=sup.tail)
        later = enqueue_one(pg_dsn, schema, "hx.ok")
        _state(storage, conn, later, "completed", sup)
        assert second != first
        assert sup.stop() == 0, sup.tail()


def test_an_event_loop_that_stops_under_the_claimer_stops_it_and_the_attempt_is_rescued(
        pg_dsn, schema, storage, conn, tmp_path):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=2)
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2"], drain_timeout=5) as sup:
        sup.wait_running(1)
        stopper = enqueue_one(pg_dsn, schema, "hx.stop_loop")
        job = _state(storage, conn, stopper, "completed", sup, timeout=30)
        assert job["attempt"] == 2 and job["run_lease"] == 2, job
        out = sup.output()
        assert "the event loop thread died" in out and "claimer q#0 exited with code 1" in out, sup.tail()
        later = enqueue_one(pg_dsn, schema, "hx.aok")
        _state(storage, conn, later, "completed", sup)
        assert sup.stop() == 0, sup.tail()


# ---------------------------------------------------------------------------------------
# 2. progress


# A set was the example of a non-JSON value; enqueue and set_progress now encode sets as lists
# (msgspec.to_builtins), so a complex number stands for "cannot be JSON".
@pytest.mark.parametrize("bad", ["nul", "complex", "big"])
def test_a_bad_progress_value_is_refused_in_its_handler_and_spares_the_others(pg_dsn, schema, storage, conn,
                                                                              tmp_path, bad):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=3)
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog, heartbeat_interval=0.5,
                        rescue_interval=0.5, queues=[f"{QUEUE}:stripes=1,concurrency=4"]) as sup:
        sup.wait_running(1)
        innocent, culprit = _enqueue_together(pg_dsn, schema, [("hx.innocent", {"ms": 5000}, 25),
                                                              ("hx.bad_progress", {"bad": bad}, 25)])
        job = _state(storage, conn, innocent, "completed", sup, timeout=30)
        assert job["attempt"] == 1 and job["run_lease"] == 1 and not job["errors"], job
        job = _state(storage, conn, culprit, "completed", sup)
        assert job["run_lease"] == 1, job
        assert sup.stop() == 0, sup.tail()

    [verdict] = [e for e in runlog.for_job(culprit) if e["ev"].startswith("progress_")]
    assert verdict["ev"] == "progress_rejected", verdict
    assert "progress" in verdict["error"] and "not recorded" in verdict["error"], verdict
    # The innocent job ran once, from start to end, and nothing was rescued.
    assert [(e["ev"], e["lease"]) for e in runlog.for_job(innocent) if e["ev"] in ("start", "run")] == \
        [("start", 1), ("run", 1)]
    assert "rescued" not in sup.output(), sup.tail(80)
    assert done_rows_by_job(conn, schema)[innocent] == [(1, 1, 1)]


def test_set_progress_checks_like_enqueue_and_has_a_size_limit() -> None:
    import datetime as dt

    from awa_fast.jobs import ClaimSnapshot

    snap = ClaimSnapshot(1, 1, 1, 1, "q", "k", 2, b"{}", None, 0, 1, 1, 0, 1, dt.datetime.now(dt.UTC))
    job = Job(snap)
    job.set_progress({"ok": [1, 2.5, "x"]})
    assert bytes(job._progress) == b'{"ok":[1,2.5,"x"]}'  # noqa: SLF001 - encoded once, at the call
    for value in ({"text": "a\x00b"}, {"z": 1j}, {"x": float("nan")}, {1: "non-string key"}, "\ud800",
                  "x" * (64 * 1024)):
        with pytest.raises(PayloadError, match="not recorded"):
            job.set_progress(value)
    assert bytes(job._progress) == b'{"ok":[1,2.5,"x"]}'  # noqa: SLF001 - the last good value stays
    job.set_progress("x" * (64 * 1024 - 10))  # just under 64 KiB encoded: fine


def _close(hb: Heartbeat) -> None:
    """Close the connection of a heartbeat driven by run_once alone (its thread never started)."""
    if hb._conn is not None:  # noqa: SLF001
        hb._conn.close()  # noqa: SLF001


def _claimed_jobs(storage, conn, n):  # noqa: ANN001, ANN202
    c = Client(schema=storage.schema)
    for i in range(n):
        c.enqueue("hb.k", {"i": i}, queue=QUEUE, conn=conn)
    snaps = storage.lane_claim(conn, QUEUE, n)
    assert len(snaps) == n
    return [Job(s) for s in snaps]


def test_the_heartbeat_survives_bad_entries_and_drops_only_them(pg_dsn, schema, storage, conn, caplog):
    """A value the database refuses (NUL escape) or that cannot be encoded (a set), set behind
    set_progress's back: the batch is still heartbeated, the good progress stored, each bad one
    dropped and logged once."""
    jobs = _claimed_jobs(storage, conn, 3)
    nul, good, unencodable = jobs
    nul._progress = RawJson(b'{"t": "\\u0000"}')  # noqa: SLF001 - valid JSON, refused by jsonb
    good._progress = RawJson(b'{"step": 7}')  # noqa: SLF001
    unencodable._progress = {1, 2}  # noqa: SLF001 - not JSON at all
    attempts = AttemptTable()
    attempts.claimed(jobs, 0.0)  # claimed long ago: every one is due
    hb = Heartbeat(HeartbeatConfig(pg_dsn, schema, interval=0.5), attempts)
    try:
        with caplog.at_level(logging.ERROR, logger="awa_fast.heartbeat"):
            assert hb.run_once() == 3
            assert hb.run_once() == 3
        rows = {j: (hb_at is not None, p) for j, hb_at, p in sqlx_all(
            conn, schema, "SELECT job_id, heartbeat_at, progress FROM __SCHEMA__.attempt_state")}
        assert rows == {nul.id: (True, None), good.id: (True, b'{"step": 7}'),
                        unencodable.id: (True, None)}, rows
        dropped = [r for r in caplog.records if getattr(r, "action", None) == "progress_dropped"]
        assert sorted(r.args[0] for r in dropped) == sorted([nul.id, unencodable.id]), caplog.text
        assert hb.dropped_progress == 2
    finally:
        _close(hb)


def test_an_attempt_that_ended_leaves_the_heartbeat_dirty_set(pg_dsn, schema, storage, conn):
    [job] = _claimed_jobs(storage, conn, 1)
    key = (job.id, job.run_lease)
    attempts = AttemptTable()
    attempts.claimed([job], time.monotonic())
    hb = Heartbeat(HeartbeatConfig(pg_dsn, schema, interval=60), attempts)
    try:
        hb.progress_changed(job)
        attempts.closed([key])  # completed and flushed
        assert hb.run_once() == 0
        assert hb.run_once() == 0
        assert sqlx_all(conn, schema, "SELECT count(*) FROM __SCHEMA__.attempt_state") == [(0,)]
    finally:
        _close(hb)


# ---------------------------------------------------------------------------------------
# 3. telling a rescued or cancelled handler


def test_a_rescued_or_cancelled_handler_is_told_and_async_tasks_are_cancelled(pg_dsn, schema, storage, conn,
                                                                              tmp_path):
    deadline = 2.0
    storage.queue_configure(conn, QUEUE, deadline=deadline)
    storage.queue_configure(conn, CANCEL_QUEUE, deadline=0)
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog, heartbeat_interval=0.5,
                        rescue_interval=0.5, queues=[f"{QUEUE}:stripes=1,concurrency=4",
                                                     f"{CANCEL_QUEUE}:stripes=1,concurrency=4"]) as sup:
        sup.wait_running(2)
        sync_job = enqueue_one(pg_dsn, schema, "hx.sync_told", {"linger_ms": 4000}, max_attempts=3)
        async_job = enqueue_one(pg_dsn, schema, "hx.async_told", max_attempts=3)
        sync_cancel = enqueue_one(pg_dsn, schema, "hx.sync_cancel", {"cancel": True}, queue=CANCEL_QUEUE)
        async_cancel = enqueue_one(pg_dsn, schema, "hx.async_cancel", queue=CANCEL_QUEUE)

        # Past its deadline each attempt is rescued and retried at once; the first attempt is told.
        told = wait_for(lambda: runlog.for_job(sync_job, "told"), 15, "the sync handler to be told",
                        on_timeout=sup.tail)
        [start] = runlog.for_job(sync_job, "start")
        assert told[0]["lease"] == 1 and told[0]["abandoned"] is True
        # rescue within deadline + rescue interval, told within one more heartbeat interval (+ slack)
        assert told[0]["t"] - start["t"] < deadline + 0.5 + 0.5 + 2.0, (start, told)
        # While it lingers it is counted as abandoned, still running.
        wait_for(lambda: _claimer(sup)["abandoned"] == 1, 5, "abandoned = 1", on_timeout=sup.tail)
        job = _state(storage, conn, sync_job, "completed", sup)
        assert job["run_lease"] == 2 and job["errors"][-1]["error"] == "rescued: deadline exceeded", job
        wait_for(lambda: runlog.for_job(sync_job, "returned"), 10, "the abandoned handler to return")
        wait_for(lambda: _claimer(sup)["abandoned"] == 0, 5, "abandoned back to 0", on_timeout=sup.tail)

        cancelled = wait_for(lambda: runlog.for_job(async_job, "task_cancelled"), 15,
                             "the async handler's task to be cancelled", on_timeout=sup.tail)
        assert cancelled[0]["lease"] == 1 and cancelled[0]["cancelled"] is True
        job = _state(storage, conn, async_job, "completed", sup)
        assert job["run_lease"] == 2, job

        # Cancel requests: the sync handler sees is_cancelled() and returns Cancel; the async
        # handler's task is cancelled and the job ends cancelled.
        wait_for(lambda: runlog.for_job(sync_cancel, "start") and runlog.for_job(async_cancel, "start"), 10,
                 "both cancel-queue handlers to start")
        assert storage.job_cancel(conn, sync_cancel) == "cancel_requested"
        assert storage.job_cancel(conn, async_cancel) == "cancel_requested"
        for job_id in (sync_cancel, async_cancel):
            job = _state(storage, conn, job_id, "cancelled", sup, timeout=10)
            assert job["run_lease"] == 1, job
        assert runlog.for_job(sync_cancel, "told")[0]["abandoned"] is False
        assert runlog.for_job(async_cancel, "task_cancelled")
        out = sup.output()
        assert sup.stop() == 0, sup.tail()

    # The lost attempts wrote nothing: their outcomes came back stale, without a write.
    def flushed(job_id: int) -> list[tuple[int, str]]:
        return [(e["lease"], e["outcome"]) for e in runlog.for_job(job_id, "flush")]
    assert flushed(sync_job) == [(2, "completed"), (1, "stale")]
    assert sorted(flushed(async_job)) == [(1, "stale"), (2, "completed")]
    assert flushed(async_cancel) == [(1, "cancelled")]
    assert f"attempt of job {sync_job} (run_lease 1) was rescued or closed elsewhere" in out
    assert f"attempt of job {async_job} (run_lease 1) was rescued or closed elsewhere" in out
    assert not runlog.entries("never_told")


# ---------------------------------------------------------------------------------------
# 4. a default deadline


def test_queues_have_a_one_hour_deadline_by_default(schema, storage, conn):
    storage.queue_ensure(conn, "fresh")
    by_name = lambda: {q["queue"]: q for q in storage.queue_list(conn)}  # noqa: E731
    assert by_name()["fresh"]["deadline_s"] == 3600.0
    storage.queue_configure(conn, "fresh", deadline=90)
    assert by_name()["fresh"]["deadline_s"] == 90.0
    storage.queue_configure(conn, "fresh", stripes=2)  # other settings keep the deadline
    assert by_name()["fresh"]["deadline_s"] == 90.0
    for none in (0, 0.0, None):
        storage.queue_configure(conn, "fresh", deadline=90)
        storage.queue_configure(conn, "fresh", deadline=none)
        assert by_name()["fresh"]["deadline_s"] is None, none
    for bad in (-1, float("nan"), float("inf"), True, "1h"):
        with pytest.raises(OutOfRange):
            storage.queue_configure(conn, "fresh", deadline=bad)

    # A claim on a queue nobody configured gets a deadline one hour after its claim.
    Client(schema=schema).enqueue("k", {}, queue="auto", conn=conn)
    assert len(storage.lane_claim(conn, "auto", 1)) == 1
    [(gap,)] = sqlx_all(conn, schema, "SELECT extract(epoch FROM deadline_at - claimed_at)::float8 "
                                      "FROM __SCHEMA__.lease_claims")
    assert gap == 3600.0


def test_the_deadline_migration_gives_existing_queues_without_a_deadline_the_default(pg_dsn):
    """A schema just before migration runtime_hardening, with a queue of no deadline (the old
    default) and one of 5 minutes."""
    import uuid

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        try:
            ours = migrate_before(c, name, "runtime_hardening")
            with c.transaction():
                c.execute(render("INSERT INTO __SCHEMA__.queue_meta (queue) VALUES ('old')", name))
                c.execute(render("INSERT INTO __SCHEMA__.queue_meta (queue, deadline) "
                                 "VALUES ('tuned', interval '5 minutes')", name))
            assert c.execute(render("SELECT deadline FROM __SCHEMA__.queue_meta WHERE queue = 'old'",
                                    name)).fetchone() == (None,)
            result = migrate(pg_dsn, name)
            assert (result.from_version, result.to_version) == (ours - 1, len(migrations()))
            rows = dict(c.execute(render("SELECT queue, extract(epoch FROM deadline)::float8 "
                                         "FROM __SCHEMA__.queue_meta", name)).fetchall())
            assert rows == {"old": 3600.0, "tuned": 300.0}
        finally:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# ---------------------------------------------------------------------------------------
# 12. an unknown kind during a rolling deploy


def test_an_unknown_kind_is_retried_with_backoff_until_a_worker_knows_it(pg_dsn, schema, storage, conn,
                                                                         tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app="tests.integration.runtime_apps_hardening:old_app",
                        runlog=runlog, queues=[f"{QUEUE}:stripes=1,concurrency=2"], name="old") as old:
        old.wait_running(1)
        first = enqueue_one(pg_dsn, schema, "hx.new_kind", {"n": 1})
        job = _state(storage, conn, first, "retryable", old)
        second = enqueue_one(pg_dsn, schema, "hx.new_kind", {"n": 2})  # a second claim of the same kind
        last_try = enqueue_one(pg_dsn, schema, "hx.new_kind", {"n": 3}, max_attempts=1)
        for job_id in (first, second):
            job = _state(storage, conn, job_id, "retryable", old)
            assert job["attempt"] == 1, job
            assert job["errors"][-1]["error"] == "no handler registered for kind 'hx.new_kind' in this worker"
        # backoff: attempt^4 + 15 s and more, measured by the database clock
        [(wait_s,)] = sqlx_all(conn, schema, "SELECT min(extract(epoch FROM run_at - now()))::float8 "
                                             "FROM __SCHEMA__.deferred_jobs")
        assert wait_s > 5.0, wait_s
        # No attempts left: only then the DLQ.
        job = _state(storage, conn, last_try, "dlq", old)
        assert "no handler registered for kind 'hx.new_kind'" in job["error"] and "exhausted" in job["error"]
        assert old.stop() == 0, old.tail()
    assert old.output().count("no handler for kind 'hx.new_kind' in this worker") == 1, old.tail()

    # The new workers know the kind: the retries complete there (attempt 2).
    with SupervisorProc(pg_dsn, schema, tmp_path, app="tests.integration.runtime_apps_hardening:new_app",
                        runlog=runlog, queues=[f"{QUEUE}:stripes=1,concurrency=2"], name="new") as new:
        new.wait_running(1)
        for job_id in (first, second):
            assert storage.deferred_run_now(conn, job_id)
        for job_id in (first, second):
            job = _state(storage, conn, job_id, "completed", new)
            assert job["attempt"] == 2, job
        assert new.stop() == 0, new.tail()
