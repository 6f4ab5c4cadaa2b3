"""awa_fast.testing: drain, work_one and the enqueue assertions, against the real tables.

The plugin's fixtures (awa_dsn, awa_fast_app, awa_app) are exercised by the
sample project examples/testing, run by tests/integration/test_examples.py.
"""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest

import awa_fast
from awa_fast.app import App
from awa_fast.testing import assert_enqueued, assert_not_enqueued, drain, drain_async, work_one
from tests.fixtures.database import repeatable_read_dsn
from tests.integration.runtime_helpers import counts


def _app(pg_dsn: str, schema: str) -> App:
    app = App(pg_dsn, schema)
    app.seen = []  # type: ignore[attr-defined]

    @app.job("ok", queue="t")
    def ok(job):  # noqa: ANN001, ANN202
        app.seen.append(("ok", threading.get_ident(), job.args))  # type: ignore[attr-defined]
        if job.args.get("then"):
            app.enqueue("ok", {"from": job.id})

    @app.job("aok", queue="t")
    async def aok(job):  # noqa: ANN001, ANN202
        await asyncio.sleep(0)
        app.seen.append(("aok", threading.get_ident(), job.args))  # type: ignore[attr-defined]

    @app.job("boom", queue="t", max_attempts=3)
    def boom(job):  # noqa: ANN001, ANN202
        raise ValueError("no luck")

    @app.job("fatal", queue="t")
    def fatal(job):  # noqa: ANN001, ANN202
        raise awa_fast.TerminalError("bad input")

    @app.job("skip", queue="t")
    def skip(job):  # noqa: ANN001, ANN202
        return awa_fast.Cancel("not needed")

    @app.job("later", queue="t")
    def later(job):  # noqa: ANN001, ANN202
        if ("later", job.id) in app.seen:  # type: ignore[attr-defined]
            return None
        app.seen.append(("later", job.id))  # type: ignore[attr-defined]
        return awa_fast.Snooze(0)  # due at once: the same drain runs it again

    @app.job("park", queue="t")
    def park(job):  # noqa: ANN001, ANN202
        if job.callback_result is not None:
            return None
        job.register_callback(60)
        return awa_fast.WaitForCallback(60)

    @app.job("forever", queue="t")
    def forever(job):  # noqa: ANN001, ANN202
        return awa_fast.Snooze(0)

    return app


def test_drain_runs_sync_and_async_handlers_inline_through_the_real_tables(pg_dsn, schema, storage, conn):
    app = _app(pg_dsn, schema)
    ids = [app.enqueue("ok", {"i": 1, "then": True}), app.enqueue("aok", {"i": 2})]
    result = drain(app)
    me = threading.get_ident()
    assert {(k, t) for k, t, _ in app.seen} == {("ok", me), ("aok", me)}  # type: ignore[attr-defined]
    assert len(result) == 3 and result.completed == 3  # the job "ok" enqueued ran in the same drain
    assert [r.outcome for r in result] == ["completed"] * 3 and all(r.state == "completed" for r in result)
    assert all(storage.job_load(conn, i)["state"] == "completed" for i in ids)
    assert counts(storage, conn, "t").get("running", 0) == 0  # every receipt closed
    assert len(drain(app)) == 0
    app.close()


def test_drain_reports_each_outcome_and_keeps_the_exception(pg_dsn, schema, storage, conn):
    app = _app(pg_dsn, schema)
    for kind in ("boom", "fatal", "skip", "later", "park"):
        app.enqueue(kind, {"k": kind})
    app.enqueue("nobody_handles_this", {}, queue="t")
    result = drain(app)
    by = {(r.kind, r.outcome) for r in result}
    assert by == {("boom", "retried"), ("fatal", "failed"), ("skip", "cancelled"), ("later", "snoozed"),
                  ("later", "completed"), ("park", "waiting"), ("nobody_handles_this", "failed")}
    boom = next(r for r in result if r.kind == "boom")
    assert isinstance(boom.exception, ValueError) and "no luck" in boom.error and boom.state == "retryable"
    assert result.errors and {r.kind for r in result.errors} == {"boom", "fatal"}
    assert next(r for r in result if r.kind == "fatal").state in ("dlq", "failed")
    parked = next(r for r in result if r.kind == "park")
    assert parked.state == "waiting_external" and parked.callback_token
    assert app.resume_callback(parked.callback_token, {"ok": 1})
    again = drain(app)
    assert [(r.kind, r.outcome) for r in again] == [("park", "completed")]
    app.close()


def test_work_one_runs_exactly_the_job_it_enqueued(pg_dsn, schema, storage, conn):
    app = _app(pg_dsn, schema)
    r = work_one(app, "ok", {"i": 9})
    assert (r.kind, r.outcome, r.state, r.args, r.attempt) == ("ok", "completed", "completed", {"i": 9}, 1)
    r = work_one(app, "boom", {})
    assert r.outcome == "retried" and isinstance(r.exception, ValueError)
    app.enqueue("ok", {"i": 10})
    with pytest.raises(AssertionError, match="needs queue 't' empty"):
        work_one(app, "ok", {"i": 11})
    app.close()


def test_drain_claims_at_read_committed_on_a_server_whose_default_is_repeatable_read(pg_dsn, schema):
    """The claim refuses REPEATABLE READ (migration 0028): the inline claimer sets its session's level."""
    app = _app(repeatable_read_dsn(pg_dsn), schema)
    app.enqueue("ok", {"i": 1})
    assert [(r.kind, r.outcome) for r in drain(app, "t")] == [("ok", "completed")]
    app.close()


def test_enqueue_assertions_read_what_a_connection_sees(pg_dsn, schema):
    app = _app(pg_dsn, schema)
    app.enqueue("ok", {"to": "a@example.com", "n": 1})
    app.enqueue("ok", {"to": "b@example.com", "n": 2}, delay=3600)
    rows = assert_enqueued(app, "ok", count=2)
    assert {r["state"] for r in rows} == {"available", "scheduled"}
    assert_enqueued(app, "ok", {"to": "a@example.com"}, queue="t", count=1)  # a subset of the args matches
    with pytest.raises(AssertionError, match="expected 3 jobs 'ok'"):
        assert_enqueued(app, "ok", count=3)
    with pytest.raises(AssertionError, match=r"no job 'ok' with args \{'to': 'c@example.com'\}"):
        assert_enqueued(app, "ok", {"to": "c@example.com"})
    assert_not_enqueued(app, "aok")
    with pytest.raises(AssertionError, match="expected no job of 'ok'"):
        assert_not_enqueued(app, "ok", {"n": 2})

    with psycopg.connect(pg_dsn) as tx:  # the user's own transaction
        app.enqueue("aok", {"x": 1}, conn=tx)
        assert_enqueued(app, "aok", conn=tx)  # visible inside it
        assert_not_enqueued(app, "aok")       # not to anyone else yet
        tx.rollback()
        assert_not_enqueued(app, "aok", conn=tx)
    assert_not_enqueued(app, "aok")
    drain(app)
    assert_enqueued(app, "ok", count=1)  # the scheduled one is still waiting
    app.close()


def test_drain_ends_after_a_rolled_back_enqueue_and_stops_a_handler_that_never_ends(pg_dsn, schema):
    app = _app(pg_dsn, schema)
    with psycopg.connect(pg_dsn) as tx:  # one connection: one lane, with a rolled-back gap at its tail
        app.enqueue("ok", {"i": 1}, conn=tx)
        tx.commit()
        app.enqueue("ok", {"i": 2}, conn=tx)
        tx.rollback()
    assert drain(app).completed == 1
    app.enqueue("forever", {})
    with pytest.raises(RuntimeError, match="snooze or retry forever"):
        drain(app, max_jobs=20)
    app.close()


def test_drain_async_awaits_on_the_running_loop_and_drain_refuses_it(pg_dsn, schema):
    app = _app(pg_dsn, schema)
    app.enqueue("aok", {"i": 1})

    async def main() -> int:
        with pytest.raises(RuntimeError, match="await drain_async"):
            drain(app)
        return (await drain_async(app)).completed

    assert asyncio.run(main()) == 1
    app.close()
