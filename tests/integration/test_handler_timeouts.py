"""Per-kind handler timeouts and visible failures (issue 11, "Semantics" items 3 and 7).

Real ``awa-fast supervise`` processes against the session's PostgreSQL, with
the handlers of ``runtime_apps_timeouts``:

- a sync and an async handler that outlive their kind's ``timeout=`` close
  their attempt as a retry ("timed out after 1 s", counted against
  max_attempts); ``job.is_cancelled()`` turns True, the async task is
  cancelled, the sync handler's late return is discarded (counted stale and
  abandoned while it runs, no second closure); the next attempt runs; jobs
  without a timeout beside them are untouched;
- a handler's exception is logged (one WARNING line) and its traceback is
  stored with the attempt's error (``App.get_job(id).errors``);
- job args that do not decode into the kind's ``args_type`` go to the DLQ at
  attempt 1 with the validation message, not through 25 retries.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.errors import OutOfRange
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE, RunLog, done_rows_by_job

pytestmark = pytest.mark.integration

APP = "tests.integration.runtime_apps_timeouts:app"


def _state(storage, conn, job_id, want, sup, timeout=20.0):  # noqa: ANN001, ANN202
    def check():  # noqa: ANN202
        job = storage.job_load(conn, job_id)
        return job if job is not None and job["state"] == want else None
    return wait_for(check, timeout, f"job {job_id} to be {want}",
                    on_timeout=lambda: f"now: {storage.job_load(conn, job_id)}\n{sup.tail(60)}")


def _claimer(sup: SupervisorProc) -> dict[str, Any]:
    snap = sup.local_status()
    assert snap is not None, sup.tail()
    return next(c for c in snap["claimers"] if c["queue"] == QUEUE)


def _enqueue_together(dsn: str, schema: str, jobs: list[tuple[str, dict[str, Any]]]) -> list[int]:
    client = Client(schema=schema)
    with psycopg.connect(dsn) as c:
        return [client.enqueue(kind, args, queue=QUEUE, conn=c) for kind, args in jobs]


def test_timeout_is_validated() -> None:
    app = App(schema="awa_fast_unused")
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True, 11 * 365 * 86400):
        with pytest.raises(OutOfRange):
            app.job(f"k{len(app.registry)}", timeout=bad)  # type: ignore[arg-type]
    app.job("fine", timeout=2)(lambda job: None)
    app.job("none")(lambda job: None)
    assert app.registry["fine"].timeout == 2.0 and app.registry["none"].timeout is None


def test_a_timed_out_sync_and_async_handler_close_as_retry_and_run_again(pg_dsn, schema, storage, conn,
                                                                         tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog, heartbeat_interval=0.5,
                        queues=[f"{QUEUE}:stripes=1,concurrency=4"]) as sup:
        sup.wait_running(1)
        # Jobs without a timeout share the claim (and the workers) with the slow ones; they
        # run longer than the timeout and must not be touched by it.
        sync_job, async_job, *others = _enqueue_together(pg_dsn, schema, [
            ("to.sync", {"sleep": 4.0}), ("to.async", {}),
            ("to.ok", {"ms": 2500}), ("to.aok", {"ms": 2500}), ("to.ok", {}), ("to.aok", {})])

        for job_id in (sync_job, async_job):
            job = _state(storage, conn, job_id, "retryable", sup, timeout=15)
            assert job["attempt"] == 1 and job["run_lease"] == 1, job
            assert job["errors"][-1]["error"] == "timed out after 1 s", job
        # Closed while the sync handler still runs: it is counted as abandoned.
        assert not runlog.for_job(sync_job, "returned"), runlog.for_job(sync_job)
        wait_for(lambda: _claimer(sup)["abandoned"] == 1, 5, "abandoned = 1", on_timeout=sup.tail)
        [cancelled] = runlog.for_job(async_job, "cancelled")
        assert cancelled["cancelled"] is True and cancelled["lease"] == 1
        # The sync handler returns late: told, its outcome discarded (stale), nothing written.
        [late] = wait_for(lambda: runlog.for_job(sync_job, "returned"), 10, "the late return")
        assert late["lease"] == 1 and late["cancelled"] is True and late["abandoned"] is True, late
        wait_for(lambda: _claimer(sup)["abandoned"] == 0, 5, "abandoned back to 0", on_timeout=sup.tail)
        wait_for(lambda: _claimer(sup)["stale"] >= 1, 5, "the late outcome counted stale", on_timeout=sup.tail)
        job = storage.job_load(conn, sync_job)
        assert job["state"] == "retryable" and job["run_lease"] == 1 and len(job["errors"]) == 1, job

        # The next attempt runs (made due now) and completes.
        for job_id in (sync_job, async_job):
            assert storage.deferred_run_now(conn, job_id)
        for job_id in (sync_job, async_job):
            job = _state(storage, conn, job_id, "completed", sup)
            assert job["attempt"] == 2 and job["run_lease"] == 2, job
        for job_id in others:
            job = _state(storage, conn, job_id, "completed", sup)
            assert job["attempt"] == 1 and job["run_lease"] == 1 and not job["errors"], job
        stale = _claimer(sup)["stale"]
        assert sup.stop() == 0, sup.tail()

    out = sup.output()
    assert f"job {sync_job} (kind 'to.sync', attempt 1) timed out after 1 s" in out, sup.tail()
    assert f"job {async_job} (kind 'to.async', attempt 1) timed out after 1 s" in out, sup.tail()
    assert stale == 2, stale  # the late sync return and the cancelled async task, nothing else
    # One closure per attempt: the timeout's retry, then the completion; no second closure of lease 1.
    flushed = lambda j: [(e["lease"], e["outcome"]) for e in runlog.for_job(j, "flush")]  # noqa: E731
    assert flushed(sync_job) == [(1, "retried"), (2, "completed")], flushed(sync_job)
    assert flushed(async_job) == [(1, "retried"), (2, "completed")], flushed(async_job)
    done = done_rows_by_job(conn, schema)
    for job_id in others:
        assert done[job_id] == [(1, 1, 1)], (job_id, done.get(job_id))
        assert flushed(job_id) == [(1, "completed")]
    assert [e["lease"] for e in runlog.for_job(sync_job, "start")] == [1, 2]
    assert [e["lease"] for e in runlog.for_job(async_job, "start")] == [1, 2]


def test_a_failure_is_logged_and_its_traceback_stored(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        failing = Client(schema=schema)
        with psycopg.connect(pg_dsn) as c:
            job_id = failing.enqueue("to.fail", {}, queue=QUEUE, conn=c)
        _state(storage, conn, job_id, "retryable", sup)
        with App(dsn=pg_dsn, schema=schema) as app:
            info = app.get_job(job_id)
        assert info is not None
        [err] = info.errors
        text = err["error"]
        assert text.split("\n")[0] == "ValueError: broken deep inside", text
        assert "Traceback (most recent call last)" in text and "_deep_helper_that_fails" in text, text
        assert "sync_fail" in text and len(text) <= 8192, text
        assert sup.stop() == 0, sup.tail()
    lines = [ln for ln in sup.output().splitlines() if f"job {job_id} (kind 'to.fail', attempt 1) failed" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0] and "ValueError: broken deep inside" in lines[0], lines


def test_args_that_do_not_match_args_type_go_to_the_dlq_at_once(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        bad, good, own = _enqueue_together(pg_dsn, schema, [
            ("to.typed", {"order_id": "not a number", "amount": 1.5}),
            ("to.typed", {"order_id": 7, "amount": 1.5}),
            ("to.own_validation", {"order_id": 8, "amount": 2.0})])
        job = _state(storage, conn, bad, "dlq", sup)
        assert job["attempt"] == 1, job
        assert "job args do not match args_type Order" in job["error"], job
        assert "Expected `int`, got `str` - at `$.order_id`" in job["error"], job
        job = _state(storage, conn, good, "completed", sup)
        # A ValidationError the handler raises about another payload is an ordinary failure: retried.
        job = _state(storage, conn, own, "retryable", sup)
        assert job["attempt"] == 1 and "ValidationError" in job["errors"][-1]["error"], job
        assert sup.stop() == 0, sup.tail()
    assert [e["order_id"] for e in runlog.for_job(good, "decoded")] == [7]
