"""Every handler outcome through a real supervisor: the right state, the right attempt count.

RetryAfter consumes an attempt, Snooze does not, Cancel ends as cancelled,
WaitForCallback parks the attempt until ``App.complete_callback`` /
``fail_callback`` / ``retry_callback`` / ``resume_callback`` resolves it,
TerminalError and exhausted attempts go to the DLQ, and an unknown kind
is retried (with backoff) until its attempts run out, then goes to the DLQ
with a reason that names it (max_attempts=1 here: at once).
"""

from __future__ import annotations

import pytest

from awa_fast.app import App
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import (
    QUEUE,
    RunLog,
    counts,
    enqueue_bulk,
    enqueue_one,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def client_app(pg_dsn, schema):
    """The App a web process would use to resolve callbacks (its own connection)."""
    a = App(dsn=pg_dsn, schema=schema)
    yield a
    a.close()


def _state(storage, conn, job_id, want, sup, timeout=20.0):  # noqa: ANN001, ANN202
    """Wait until job_load says ``want``; return the job."""
    def check():  # noqa: ANN202
        job = storage.job_load(conn, job_id)
        return job if job is not None and job["state"] == want else None
    return wait_for(check, timeout, f"job {job_id} to be {want}",
                    on_timeout=lambda: f"now: {storage.job_load(conn, job_id)}\n{sup.tail()}")


def _token(runlog: RunLog, job_id: int, sup: SupervisorProc, lease: int = 1) -> str:
    def find():  # noqa: ANN202
        hits = [e for e in runlog.for_job(job_id, "parked") if e["lease"] == lease]
        return hits[-1]["token"] if hits else None
    return wait_for(find, 20, f"job {job_id} to park (run_lease {lease})", on_timeout=sup.tail)


def test_each_outcome_reaches_the_right_state_with_the_right_attempt(pg_dsn, schema, storage, conn, tmp_path,
                                                                     client_app):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog) as sup:
        sup.wait_running(2)
        e = lambda kind, args=None, **kw: enqueue_one(pg_dsn, schema, kind, args, **kw)  # noqa: E731
        retry = e("rt.retry3")
        snooze = e("rt.snooze")
        cancel = e("rt.cancel")
        terminal = e("rt.terminal")
        exhaust = e("rt.fail", max_attempts=2)
        unknown = e("rt.nobody_handles_this", max_attempts=1)
        cb_complete = e("rt.callback", {"tag": "complete"})
        cb_fail = e("rt.callback", {"tag": "fail"})
        cb_retry = e("rt.callback", {"tag": "retry"})
        cb_resume = e("rt.callback", {"tag": "resume"})
        cb_timeout = e("rt.callback", {"tag": "timeout", "timeout": 1})

        # RetryAfter: each retry consumes an attempt; completes on attempt 3.
        job = _state(storage, conn, retry, "completed", sup)
        assert job["attempt"] == 3 and job["run_lease"] == 3, job
        assert [(r["attempt"], r["lease"]) for r in runlog.for_job(retry, "run")] == [(1, 1), (2, 2), (3, 3)]
        assert [x["attempt"] for x in job["errors"]] == [1, 2], job["errors"]
        assert "not yet (attempt 1)" in job["errors"][0]["error"]

        # Snooze: claimed three times (run_lease 3) on the same, unconsumed attempt 1.
        job = _state(storage, conn, snooze, "completed", sup)
        assert job["attempt"] == 1 and job["run_lease"] == 3, job
        assert [(r["attempt"], r["lease"]) for r in runlog.for_job(snooze, "run")] == [(1, 1), (1, 2), (1, 3)]

        # Cancel from the handler.
        job = _state(storage, conn, cancel, "cancelled", sup)
        assert job["attempt"] == 1 and "handler says no" in (job["error"] or ""), job

        # TerminalError: straight to the DLQ, one attempt.
        job = _state(storage, conn, terminal, "dlq", sup)
        assert job["attempt"] == 1 and "bad input, never retry" in job["error"], job

        # Unknown kind, no attempt left: DLQ with a reason naming the kind.
        job = _state(storage, conn, unknown, "dlq", sup)
        assert job["attempt"] == 1, job
        assert "no handler registered" in job["error"] and "rt.nobody_handles_this" in job["error"], job
        assert runlog.for_job(unknown, "run") == []

        # Exhausted attempts: attempt 1 fails into backoff (retryable, attempt consumed);
        # make it due now (the admin "job retry"), attempt 2 fails into the DLQ.
        job = _state(storage, conn, exhaust, "retryable", sup)
        assert job["attempt"] == 1, job
        assert storage.deferred_run_now(conn, exhaust)
        job = _state(storage, conn, exhaust, "dlq", sup)
        assert job["attempt"] == 2 and job["max_attempts"] == 2, job
        assert "boom on attempt 2" in job["error"] and "exhausted" in job["error"], job
        assert [r["attempt"] for r in runlog.for_job(exhaust, "run")] == [1, 2]

        # WaitForCallback: parked jobs wait in the lease plane until resolved.
        tokens = {j: _token(runlog, j, sup) for j in (cb_complete, cb_fail, cb_retry, cb_resume)}
        for j in tokens:
            job = _state(storage, conn, j, "waiting_external", sup)
            assert job["attempt"] == 1 and job["run_lease"] == 1, job
        assert counts(storage, conn).get("waiting", 0) >= 4  # (+1 while cb_timeout still waits)

        assert client_app.complete_callback(tokens[cb_complete])
        assert not client_app.complete_callback(tokens[cb_complete]), "a token resolves once"
        job = _state(storage, conn, cb_complete, "completed", sup)
        assert job["attempt"] == 1, job

        assert client_app.fail_callback(tokens[cb_fail], "vendor said no")
        job = _state(storage, conn, cb_fail, "dlq", sup)
        assert job["attempt"] == 1 and "vendor said no" in job["error"], job

        assert client_app.retry_callback(tokens[cb_retry], "try again later")
        job = _state(storage, conn, cb_retry, "retryable", sup)
        assert job["attempt"] == 1, job  # consumed: the next run is attempt 2
        assert storage.deferred_run_now(conn, cb_retry)
        job = _state(storage, conn, cb_retry, "completed", sup)
        assert job["attempt"] == 2 and job["run_lease"] == 2, job
        assert [r["attempt"] for r in runlog.for_job(cb_retry, "done")] == [2]

        assert client_app.resume_callback(tokens[cb_resume], {"answer": 42})
        job = _state(storage, conn, cb_resume, "completed", sup)
        assert job["attempt"] == 1 and job["run_lease"] == 2, job  # resumed: no attempt consumed
        resumed = runlog.for_job(cb_resume, "resumed")
        assert [(r["result"], r["attempt"], r["lease"]) for r in resumed] == [({"answer": 42}, 1, 2)]

        # A callback nobody resolves times out: the leader retries the job (attempt consumed).
        _token(runlog, cb_timeout, sup)
        job = _state(storage, conn, cb_timeout, "retryable", sup)
        assert job["attempt"] == 1 and "callback timed out" in job["errors"][-1]["error"], job
        assert storage.deferred_run_now(conn, cb_timeout)
        job = _state(storage, conn, cb_timeout, "completed", sup)
        assert job["attempt"] == 2, job

        final = counts(storage, conn)
        assert final == {"completed": 6, "cancelled": 1, "dlq": 4}, final
        assert sup.stop() == 0, sup.tail()

    # App.on_flush listeners saw every attempt each flush wrote, with its outcome and times
    # (a second, raising listener changed nothing above and was logged).
    def flushed(job_id: int) -> list[tuple[int, str]]:
        return [(r["lease"], r["outcome"]) for r in runlog.for_job(job_id, "flush")]

    assert flushed(retry) == [(1, "retried"), (2, "retried"), (3, "completed")]
    assert flushed(snooze) == [(1, "snoozed"), (2, "snoozed"), (3, "completed")]
    assert flushed(cancel) == [(1, "cancelled")]
    assert flushed(terminal) == [(1, "failed")]
    assert flushed(unknown) == [(1, "retried")]  # a retry; the database made it the DLQ entry
    # what the worker wrote: a retry; the database turned the last one into the DLQ entry
    assert flushed(exhaust) == [(1, "retried"), (2, "retried")]
    for r in runlog.entries("flush"):
        if r["kind"] != "rt.nobody_handles_this":
            assert 0 < r["started_at"] <= r["committed_at"], r
    assert "this flush listener is broken on purpose" in sup.output()


def test_unknown_kind_goes_to_the_dlq_in_an_app_with_only_async_handlers(pg_dsn, schema, storage, conn,
                                                                         tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, app="tests.integration.runtime_apps:async_only_app",
                        queues=[f"{QUEUE}:stripes=1,concurrency=4"]) as sup:
        sup.wait_running(1)
        known = enqueue_one(pg_dsn, schema, "rt.async")
        unknown = enqueue_one(pg_dsn, schema, "rt.not_registered_here", max_attempts=1)
        _state(storage, conn, known, "completed", sup)
        job = _state(storage, conn, unknown, "dlq", sup, timeout=5)
        assert "no handler registered" in job["error"], job
        assert sup.stop() == 0, sup.tail()


def _max_overlap(starts_ends: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in starts_ends] + [(e, -1) for _, e in starts_ends])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.parametrize("kind", [
    "rt.sleep",
    pytest.param("rt.async_sleep"),
])
def test_handler_concurrency_is_bounded_by_the_queue_concurrency(pg_dsn, schema, storage, conn, tmp_path, kind):
    runlog = RunLog(tmp_path / "runlog")
    n = 24
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=1,concurrency=3,batch=24"]) as sup:
        sup.wait_running(1)
        ids = enqueue_bulk(pg_dsn, schema, kind, ({"ms": 150} for _ in range(n)))
        wait_for(lambda: counts(storage, conn).get("completed", 0) == n, 30, f"{n} completions",
                 on_timeout=sup.tail)
        assert sup.stop() == 0, sup.tail()
    start = {e["job"]: e["t"] for e in runlog.entries("start")}
    end = {e["job"]: e["t"] for e in runlog.entries("run")}
    assert set(start) == set(end) == set(ids)
    overlap = _max_overlap([(start[j], end[j]) for j in ids])
    assert overlap <= 3, f"{overlap} handlers ran at once with concurrency=3"
