"""Job results and progress that survives retry (issue 11, items 1 and 2).

Storage level: ``receipt_complete_results`` stores a result beside the
binary-COPY completions and guards like them; progress flushed into
``attempt_state`` is carried through retry, snooze and rescue into
``deferred_jobs``, through promotion into ``ready_entries``, comes back in
the next claim's snapshot, and is dropped at the terminal transition;
``job_load`` shows both.

Runtime level, through a real ``awa-fast supervise`` of the app below: a
handler's returned dict, Struct, list or scalar completes the job and is
its result; ``None`` stores nothing; a value that cannot be stored retries
with an error naming its type; the next attempt's ``job.progress`` starts
from the last flushed value.
"""

from __future__ import annotations

import datetime as _dt
import os
import pathlib
import time
from typing import Any

import msgspec
import pytest

import awa_fast
from awa_fast.app import App
from awa_fast.jobs import ClaimSnapshot, Job
from awa_fast.storage import CLOSE_RETRY, CLOSE_SNOOZE
from tests.fixtures.database import sqlx
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration import storage_helpers as sh
from tests.integration.runtime_apps import record
from tests.integration.runtime_helpers import (
    QUEUE,
    RunLog,
    counts,
    enqueue_bulk,
    enqueue_one,
)

pytestmark = pytest.mark.integration

APP_REF = "tests.integration.test_results_progress:app"


# -- the app the runtime tests supervise ---------------------------------------------------

app = App(schema="awa_fast_rp_placeholder", default_queue=QUEUE)


class Receipt(msgspec.Struct):
    order: int
    at: _dt.datetime


class NotJson:
    pass


@app.job("rp.dict", queue=QUEUE)
def returns_dict(job: Any) -> Any:
    return {"n": job.args["n"], "squared": job.args["n"] ** 2}


@app.job("rp.none", queue=QUEUE)
def returns_none(job: Any) -> None:
    return None


@app.job("rp.struct", queue=QUEUE)
def returns_struct(job: Any) -> Any:
    return Receipt(order=7, at=_dt.datetime(2026, 12, 1, 9, 30, tzinfo=_dt.UTC))


@app.job("rp.list", queue=QUEUE)
def returns_list(job: Any) -> Any:
    return [1, "two", {"three": [3]}]


@app.job("rp.scalar", queue=QUEUE)
def returns_scalar(job: Any) -> Any:
    return 42


@app.job("rp.unencodable", queue=QUEUE)
def returns_unencodable(job: Any) -> Any:
    record(job)
    return NotJson()


@app.job("rp.huge", queue=QUEUE)
def returns_huge(job: Any) -> Any:
    return "x" * ((1 << 20) + 10)


def _released(job: Any) -> bool:
    return pathlib.Path(os.environ["AWA_TEST_RUNLOG"], f"release-{job.id}-{job.run_lease}").exists()


@app.job("rp.progress", queue=QUEUE)
def progress_then_retry(job: Any) -> Any:
    """Attempt 1 sets progress and retries once the test saw it flushed; 2 retries without
    setting any; 3 returns what it saw as its result."""
    record(job, "seen", progress=job.progress)
    if job.attempt == 1:
        job.set_progress({"step": 1, "of": 3})
        deadline = time.monotonic() + 30
        while not _released(job) and time.monotonic() < deadline:
            time.sleep(0.01)  # the test releases the attempt once the flush is visible
        return awa_fast.RetryAfter(0.01, "retry after progress")
    if job.attempt == 2:
        return awa_fast.RetryAfter(0.01, "retry without new progress")
    return {"progress_seen": job.progress}


# -- the snapshot's trailing field ------------------------------------------------------------


@pytest.mark.parametrize("impl", ["c", "python"])
def test_snapshot_decoders_fill_the_trailing_progress_field(impl):
    import importlib

    codec = importlib.import_module("awa_fast._codec" if impl == "c" else "awa_fast._pycodec")
    now = _dt.datetime.now(_dt.UTC)
    base = (1, 1, 1, 3, "q", "k", 2, b"{}", None, 0, 1, 1, 0, 9, now, None, None)
    old_row, new_row = codec.decode_snapshots([base, (*base, b'{"pct":5}')])
    assert old_row.progress is None and new_row.progress == b'{"pct":5}'
    assert old_row == ClaimSnapshot(*base)
    assert Job(new_row).progress == {"pct": 5} and Job(old_row).progress is None


# -- storage level --------------------------------------------------------------------------


def _results(storage, conn, snaps, values, lease_backed=False):  # noqa: ANN001, ANN202
    return storage.receipt_complete_results(conn, [(s, lease_backed, sh.raw(v)) for s, v in zip(snaps, values)])


def test_result_completion_is_stored_and_guarded(schema, storage, conn):
    ids = [sh.enqueue(schema, conn, "rq", {"i": i}) for i in range(3)]
    snaps = sh.claim(storage, conn, "rq", 10)
    assert [s.job_id for s in snaps] == ids
    # one plain completion by COPY and two with results, in one receipt and one transaction
    with conn.transaction():
        storage.receipt_lock(conn, [s.claim_id for s in snaps])
        assert storage.receipt_complete(conn, snaps[:1]) == []
        assert _results(storage, conn, snaps[1:], [{"ok": 1}, [1, 2]]) == []
    plain, with_dict, with_list = (sh.load(storage, conn, i) for i in ids)
    assert plain["state"] == "completed" and plain["result"] is None, plain
    assert with_dict["state"] == "completed" and with_dict["result"] == {"ok": 1}, with_dict
    assert with_list["result"] == [1, 2] and with_list["progress"] is None, with_list
    # every attempt is closed: nothing left running, the claim slot's gate passes
    assert sh.counts(storage, conn, "rq") == {"completed": 3}
    # a second completion of the same attempts is stale and writes nothing
    assert _results(storage, conn, snaps[1:], [{"again": 1}, 0]) == sorted((s.job_id, s.run_lease)
                                                                             for s in snaps[1:])
    assert sh.load(storage, conn, ids[1])["result"] == {"ok": 1}
    assert len(sh.done_rows(conn, schema, ids[1])) == 1


def test_result_completion_function_guards_receipt_backed_attempts(schema, storage, conn):
    """The one-statement SQL path (the runtime uses it for lease-backed attempts) guards like the COPY."""
    job = sh.enqueue(schema, conn, "rq", {})
    [snap] = sh.claim(storage, conn, "rq")

    def call(value):  # noqa: ANN001, ANN202
        return conn.execute(storage.q["receipt_complete_results"], (
            [snap.claim_slot], [snap.claim_id], [snap.job_id], [snap.run_lease], [snap.ready_slot],
            [snap.lane_id], [snap.lane_seq], [snap.attempt], [snap.queue], [snap.kind], [False],
            [sh.raw(value)])).fetchall()
    assert call({"first": True}) == []
    assert call({"second": True}) == [(snap.job_id, snap.run_lease)]
    got = sh.load(storage, conn, job)
    assert got["state"] == "completed" and got["result"] == {"first": True}, got
    assert sh.counts(storage, conn, "rq") == {"completed": 1}


def test_result_completion_of_a_lease_backed_attempt(schema, storage, conn):
    job = sh.enqueue(schema, conn, "rq", {})
    [snap] = sh.claim(storage, conn, "rq")
    assert storage.attempt_register_callback(conn, snap, 60.0) is not None
    assert _results(storage, conn, [snap], [{"via": "lease"}], lease_backed=True) == []
    got = sh.load(storage, conn, job)
    assert got["state"] == "completed" and got["result"] == {"via": "lease"}, got
    assert sh.counts(storage, conn, "rq") == {"completed": 1}
    # the lease is gone: a repeat is stale
    assert _results(storage, conn, [snap], [1], lease_backed=True) == [(snap.job_id, snap.run_lease)]


def test_progress_is_carried_through_retry_snooze_and_promotion(schema, storage, conn):
    job = sh.enqueue(schema, conn, "pq", {})
    [a1] = sh.claim(storage, conn, "pq")
    assert a1.progress is None
    assert [r.status for r in storage.attempt_heartbeat(conn, [a1], [sh.raw({"pct": 40})])] == ["ok"]
    running = sh.load(storage, conn, job)
    assert running["state"] == "running" and running["progress"] == {"pct": 40}, running
    assert sh.close(storage, conn, a1, CLOSE_RETRY, 0.0, "again") == "ok"
    retryable = sh.load(storage, conn, job)
    assert retryable["state"] == "retryable" and retryable["progress"] == {"pct": 40}, retryable
    assert sh.jloads(sh.deferred_row(conn, schema, job)["progress"]) == {"pct": 40}
    sh.make_due(conn, schema)
    assert storage.deferred_promote(conn) == 1
    available = sh.load(storage, conn, job)
    assert available["state"] == "available" and available["progress"] == {"pct": 40}, available
    [a2] = sh.claim(storage, conn, "pq")
    assert a2.run_lease == 2 and sh.jloads(a2.progress) == {"pct": 40}
    # an attempt that sets no progress passes the older value on (snooze this time)
    assert sh.close(storage, conn, a2, CLOSE_SNOOZE, 0.0) == "ok"
    sh.make_due(conn, schema)
    storage.deferred_promote(conn)
    [a3] = sh.claim(storage, conn, "pq")
    assert sh.jloads(a3.progress) == {"pct": 40}
    # a newer flush wins; the terminal transition drops it
    storage.attempt_heartbeat(conn, [a3], [sh.raw({"pct": 90})])
    assert sh.load(storage, conn, job)["progress"] == {"pct": 90}
    assert sh.complete(storage, conn, [a3]) == []
    done = sh.load(storage, conn, job)
    assert done["state"] == "completed" and done["progress"] is None, done


def test_progress_survives_rescue(schema, storage, conn):
    job = sh.enqueue(schema, conn, "pr", {})
    storage.queue_configure(conn, "pr", heartbeat_timeout=0.05)
    [a1] = sh.claim(storage, conn, "pr")
    storage.attempt_heartbeat(conn, [a1], [sh.raw({"rows": 1000})])
    wait_for(lambda: storage.receipt_rescue_stale(conn) == 1, 10, "the silent attempt to be rescued")
    [a2] = sh.claim(storage, conn, "pr")
    assert a2.job_id == job and a2.run_lease == 2 and sh.jloads(a2.progress) == {"rows": 1000}


def test_progress_survives_callback_resume_and_retry(schema, storage, conn):
    job = sh.enqueue(schema, conn, "pc", {})
    [a1] = sh.claim(storage, conn, "pc")
    token = storage.attempt_register_callback(conn, a1, 60.0)
    storage.attempt_heartbeat(conn, [a1], [sh.raw({"phase": "waiting"})])
    assert sh.load(storage, conn, job)["progress"] == {"phase": "waiting"}  # waiting_external
    assert storage.callback_resolve(conn, token, "resume", sh.raw({"answer": 1})) == "ok"
    [a2] = sh.claim(storage, conn, "pc")
    assert sh.jloads(a2.progress) == {"phase": "waiting"} and sh.jloads(a2.callback_result) == {"answer": 1}
    token = storage.attempt_register_callback(conn, a2, 60.0)
    assert storage.callback_resolve(conn, token, "retry", None, "later") == "ok"
    got = sh.load(storage, conn, job)
    assert got["state"] == "retryable" and got["progress"] == {"phase": "waiting"}, got


def test_a_job_that_never_sets_progress_carries_none(schema, storage, conn):
    job = sh.enqueue(schema, conn, "pn", {})
    [a1] = sh.claim(storage, conn, "pn")
    assert sh.close(storage, conn, a1, CLOSE_RETRY, 0.0, "x") == "ok"
    assert sh.deferred_row(conn, schema, job)["progress"] is None
    sh.make_due(conn, schema)
    storage.deferred_promote(conn)
    [a2] = sh.claim(storage, conn, "pn")
    assert a2.progress is None and sh.load(storage, conn, job)["progress"] is None


# -- runtime level --------------------------------------------------------------------------


def _terminal(storage, conn, job_id, sup, want="completed", timeout=30.0):  # noqa: ANN001, ANN202
    def check():  # noqa: ANN202
        job = storage.job_load(conn, job_id)
        return job if job is not None and job["state"] == want else None
    return wait_for(check, timeout, f"job {job_id} to be {want}",
                    on_timeout=lambda: f"now: {storage.job_load(conn, job_id)}\n{sup.tail()}")


def test_returned_values_complete_the_job_as_its_result(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP_REF, runlog=runlog) as sup:
        sup.wait_running(2)
        e = lambda kind, args=None, **kw: enqueue_one(pg_dsn, schema, kind, args, **kw)  # noqa: E731
        d = e("rp.dict", {"n": 3})
        none = e("rp.none")
        struct = e("rp.struct")
        lst = e("rp.list")
        scalar = e("rp.scalar")
        bad = e("rp.unencodable", max_attempts=2)
        huge = e("rp.huge", max_attempts=1)
        assert _terminal(storage, conn, d, sup)["result"] == {"n": 3, "squared": 9}
        assert _terminal(storage, conn, none, sup)["result"] is None
        assert _terminal(storage, conn, struct, sup)["result"] == {"order": 7, "at": "2026-12-01T09:30:00Z"}
        assert _terminal(storage, conn, lst, sup)["result"] == [1, "two", {"three": [3]}]
        job = _terminal(storage, conn, scalar, sup)
        assert job["result"] == 42 and job["attempt"] == 1, job
        # not storable: retried (attempt consumed) with the type named, then dead-lettered
        job = _terminal(storage, conn, bad, sup, "retryable")
        assert "type NotJson" in job["errors"][0]["error"], job["errors"]
        assert storage.deferred_run_now(conn, bad)  # skip the backoff
        job = _terminal(storage, conn, bad, sup, "dlq")
        assert [r["attempt"] for r in runlog.for_job(bad, "run")] == [1, 2]
        assert "type NotJson" in job["errors"][0]["error"], job["errors"]
        assert "type NotJson" in job["error"], job
        job = _terminal(storage, conn, huge, sup, "dlq")
        assert "type str" in job["error"] and "1048576-byte limit" in job["error"], job
        assert sup.stop() == 0, sup.tail()


def test_results_and_plain_completions_in_the_same_receipts(pg_dsn, schema, storage, conn, tmp_path):
    n = 400
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP_REF) as sup:
        sup.wait_running(2)
        with_result = enqueue_bulk(pg_dsn, schema, "rp.dict", [{"n": i} for i in range(n)])
        plain = enqueue_bulk(pg_dsn, schema, "rp.none", [{} for _ in range(n)])
        wait_for(lambda: counts(storage, conn).get("completed") == 2 * n, 60, f"{2 * n} completions",
                 on_timeout=lambda: f"{counts(storage, conn)}\n{sup.tail()}")
        assert counts(storage, conn).get("running", 0) == 0
        assert sup.stop() == 0, sup.tail()
    rows = dict(sqlx(conn, schema, "SELECT job_id, result FROM __SCHEMA__.done_entries").fetchall())
    assert {j: sh.jloads(rows[j]) for j in with_result} == {j: {"n": i, "squared": i * i}
                                                            for i, j in enumerate(with_result)}
    assert all(rows.get(j) is None for j in plain)  # no result: a per-job row without one, or a compact row


def test_progress_survives_retry_into_the_next_attempt(pg_dsn, schema, storage, conn, tmp_path):
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, app=APP_REF, runlog=runlog) as sup:
        sup.wait_running(2)
        job_id = enqueue_one(pg_dsn, schema, "rp.progress", {}, max_attempts=5)

        def flushed():  # noqa: ANN202
            job = storage.job_load(conn, job_id)
            return job if job and job["state"] == "running" and job["progress"] == {"step": 1, "of": 3} else None
        wait_for(flushed, 30, "attempt 1's progress to be flushed and readable",
                 on_timeout=lambda: f"now: {storage.job_load(conn, job_id)}\n{sup.tail()}")
        (runlog.dir / f"release-{job_id}-1").touch()
        job = _terminal(storage, conn, job_id, sup)
        assert sup.stop() == 0, sup.tail()
    seen = [(e["attempt"], e["progress"]) for e in runlog.for_job(job_id, "seen")]
    assert seen == [(1, None), (2, {"step": 1, "of": 3}), (3, {"step": 1, "of": 3})], seen
    assert job["result"] == {"progress_seen": {"step": 1, "of": 3}} and job["progress"] is None, job
