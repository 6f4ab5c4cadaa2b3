"""The public API on ``awa_fast.App``: every method, sync and async, against real PostgreSQL.

Each method that writes runs once with ``conn=`` inside a caller's
transaction that rolls back (nothing in the schema changes) and once in
one that commits (the change is there); reads run on the caller's
connection and on the app's own pool. Jobs are driven through their
states with the storage layer directly (claim, close, heartbeat,
callback), so no supervisor is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import importlib.metadata
import logging
import math
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg
import pytest

import awa_fast
from awa_fast import App, ConfigError, JobInfo, JobNotCompleted, OutOfRange, PayloadError, QueueSettings, UnknownJob
from awa_fast.storage import CLOSE_FAIL, Storage
from tests.fixtures.database import connect, sqlx
from tests.integration.storage_helpers import row_counts

pytestmark = pytest.mark.integration

Q = "apiq"


@pytest.fixture
def app(pg_dsn: str, schema: str) -> Iterator[App]:
    with App(pg_dsn, schema) as a:
        yield a


@pytest.fixture
def claimer(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection]:
    c = connect(pg_dsn, schema, tag="claimer")
    yield c
    c.close()


def fingerprint(conn: psycopg.Connection, schema: str) -> Any:
    """Everything an API write could change: row counts and the mutable rows' contents."""
    return (row_counts(conn, schema),
            sqlx(conn, schema, "SELECT queue, paused, enqueue_shards, dlq_enabled, deadline, heartbeat_timeout, "
                               "aging_interval, dlq_retention FROM __SCHEMA__.queue_meta ORDER BY 1").fetchall(),
            sqlx(conn, schema, "SELECT job_id, run_at FROM __SCHEMA__.deferred_jobs ORDER BY 1").fetchall(),
            sqlx(conn, schema, "SELECT job_id FROM __SCHEMA__.dlq_entries ORDER BY 1").fetchall(),
            sqlx(conn, schema, "SELECT job_id, run_lease, cancel_requested FROM __SCHEMA__.attempt_state "
                               "ORDER BY 1").fetchall())


def claim(storage: Storage, claimer: psycopg.Connection, job_id: int, queue: str = Q) -> Any:
    snaps = [s for s in storage.lane_claim(claimer, queue, 1000) if s.job_id == job_id]
    assert len(snaps) == 1, f"job {job_id} was not claimable"
    return snaps[0]


def to_dlq(app: App, storage: Storage, claimer: psycopg.Connection, reason: str = "broken",
           queue: str = Q) -> int:
    job_id = app.enqueue("api.kind", {"dlq": reason}, queue=queue)
    snap = claim(storage, claimer, job_id, queue)
    assert storage.attempt_close(claimer, [(snap, CLOSE_FAIL, None, reason)])[0].status == "ok"
    return job_id


def parked(app: App, storage: Storage, claimer: psycopg.Connection) -> tuple[int, uuid.UUID]:
    job_id = app.enqueue("api.kind", {"cb": 1}, queue=Q)
    snap = claim(storage, claimer, job_id)
    token = storage.attempt_register_callback(claimer, snap, 3600)
    assert token is not None
    return job_id, token


def complete(storage: Storage, claimer: psycopg.Connection, job_id: int) -> None:
    snap = claim(storage, claimer, job_id)
    assert storage.receipt_complete_rows(claimer, [snap]) == []


# -- exports and packaging -------------------------------------------------------------------


def test_everything_is_importable_from_awa_fast_itself():
    for name in ("App", "Job", "JobInfo", "QueueSettings", "DlqEntry", "RetryAfter", "Snooze", "Cancel",
                 "WaitForCallback", "AttemptClosed", "AwaFastError", "ConfigError", "PayloadError",
                 "UnknownJob", "JobNotCompleted", "SchemaNotMigrated", "TerminalError"):
        assert hasattr(awa_fast, name) and name in awa_fast.__all__, name
    assert awa_fast.__version__ == importlib.metadata.version("awa-fast")
    assert awa_fast.Job[dict] is not None  # generic: Job[T] for type checkers


# -- enqueue: typed args, refusal of unserved kinds, chunk, ids ---------------------------------


class Email(msgspec.Struct):
    to: str
    at: dt.datetime
    ref: uuid.UUID
    amount: decimal.Decimal


@dataclasses.dataclass
class Resize:
    image: str
    width: int
    when: dt.date
    ratio: float = 1.0


def test_typed_args_encode_as_json_and_keep_every_safety_check(app, conn):
    at = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    ref = uuid.UUID("12345678-1234-5678-1234-567812345678")
    one = app.enqueue("api.email", Email("a@b.c", at, ref, decimal.Decimal("1.50")), queue=Q)
    two = app.enqueue("api.resize", Resize("x.png", 64, dt.date(2026, 1, 2)), queue=Q)
    three = app.enqueue("api.nested", {"items": [Resize("y.png", 1, dt.date(2026, 1, 3))], "ref": ref}, queue=Q)
    assert app.get_job(one).args == {"to": "a@b.c", "at": "2026-01-02T03:04:05Z",
                                     "ref": "12345678-1234-5678-1234-567812345678", "amount": "1.50"}
    assert app.get_job(two).args == {"image": "x.png", "width": 64, "when": "2026-01-02", "ratio": 1.0}
    assert app.get_job(three).args == {"items": [{"image": "y.png", "width": 1, "when": "2026-01-03",
                                                  "ratio": 1.0}], "ref": str(ref)}
    assert msgspec.json.decode(msgspec.json.encode(app.get_job(one).args), type=Email).at == at  # round trip
    ids = app.enqueue_many("api.resize", [Resize(f"{i}.png", i, dt.date(2026, 1, 1)) for i in range(3)],
                           queue=Q, return_ids=True)
    assert [app.get_job(i).args["width"] for i in ids] == [0, 1, 2]

    before = row_counts(conn, app.storage.schema)
    bad = [Resize("x", 1, dt.date(2026, 1, 1), ratio=math.nan), Resize("x\x00", 1, dt.date(2026, 1, 1)),
           Resize("\ud800", 1, dt.date(2026, 1, 1)), {"blob": b"raw"}, {"n": [Resize("x", 2**64, dt.date(2026, 1, 1))]},
           {"when": dt.datetime(2026, 1, 1), "obj": object()}, Resize("x" * (1 << 20), 1, dt.date(2026, 1, 1))]
    for payload in bad:
        with pytest.raises(PayloadError):
            app.enqueue("api.resize", payload, queue=Q)
        with pytest.raises(PayloadError):
            app.enqueue_many("api.resize", [{"ok": 1}, payload], queue=Q)
    deep: Any = Resize("x", 1, dt.date(2026, 1, 1))
    for _ in range(32):
        deep = {"a": deep}
    with pytest.raises(PayloadError, match="max_depth"):
        app.enqueue("api.resize", deep, queue=Q)
    assert row_counts(conn, app.storage.schema) == before


def test_enqueue_of_a_kind_nobody_serves_is_refused_unless_a_queue_is_named(pg_dsn, schema, conn):
    with App(pg_dsn, schema) as app:
        @app.job("api.served", queue="served")
        def served(job: awa_fast.Job[dict]) -> None: ...

        before = row_counts(conn, schema)
        for call in (lambda: app.enqueue("api.nobody", {}), lambda: app.enqueue_many("api.nobody", [{}])):
            with pytest.raises(ConfigError, match="no handler is registered for kind 'api.nobody'"):
                call()
        with pytest.raises(ConfigError, match="no handler"):
            asyncio.run(app.enqueue_async("api.nobody", {}))
        assert row_counts(conn, schema) == before
        assert app.get_job(app.enqueue("api.served", {})).queue == "served"
        assert app.get_job(app.enqueue("api.nobody", {}, queue="explicit")).queue == "explicit"
    with App(pg_dsn, schema, default_queue="catchall") as opted_in:
        assert opted_in.get_job(opted_in.enqueue("api.nobody", {})).queue == "catchall"


@pytest.mark.parametrize("chunk", [0, -1, True, 1.5])
def test_enqueue_many_refuses_a_chunk_that_is_not_positive(app, conn, chunk):
    before = row_counts(conn, app.storage.schema)
    with pytest.raises(ConfigError, match="chunk"):
        app.enqueue_many("api.kind", [{"n": 1}], queue=Q, chunk=chunk)
    assert row_counts(conn, app.storage.schema) == before


def test_enqueue_many_return_ids_across_chunks(app):
    ids = app.enqueue_many("api.kind", [{"n": i} for i in range(25)], queue=Q, chunk=10, return_ids=True)
    assert len(set(ids)) == 25
    assert [app.get_job(i).args["n"] for i in ids] == list(range(25))
    assert app.enqueue_many("api.kind", [{"n": 1}], queue=Q) == 1


# -- jobs ---------------------------------------------------------------------------------


def test_get_job_and_list_jobs_through_the_states(app, storage, claimer, conn):
    dead = to_dlq(app, storage, claimer, "it broke")  # (claims run first: they take the whole queue)
    available = app.enqueue("api.a", {"n": 1}, queue=Q, metadata={"m": 1}, priority=1)
    later = app.enqueue("api.b", {"n": 2}, queue=Q, delay=3600)
    running = app.enqueue("api.a", {"n": 3}, queue="other")
    snap = claim(storage, claimer, running, "other")
    storage.attempt_heartbeat(claimer, [snap], [awa_fast.client.encode_payload({"done": 40})])

    info = app.get_job(available)
    assert isinstance(info, JobInfo) and info.id == available
    assert (info.state, info.queue, info.kind, info.args, info.metadata, info.attempt, info.priority) == \
        ("available", Q, "api.a", {"n": 1}, {"m": 1}, 0, 1)
    assert isinstance(info.created_at, dt.datetime) and not info.terminal and info.result is None
    assert app.get_job(later).state == "scheduled" and app.get_job(later).run_at > info.created_at
    d = app.get_job(dead)
    assert (d.state, d.error, d.terminal) == ("dlq", "it broke", True) and isinstance(d.finished_at, dt.datetime)
    r = app.get_job(running)
    assert (r.state, r.attempt, r.run_lease, r.progress) == ("running", 1, 1, {"done": 40})
    assert app.get_job(10**15) is None
    for bad in (-1, 0, 2**63, "1", True):
        with pytest.raises(OutOfRange):
            app.get_job(bad)

    assert [j.job_id for j in app.list_jobs()] == sorted([available, later, dead, running], reverse=True)
    assert {j.job_id for j in app.list_jobs(queue=Q)} == {available, later, dead}
    assert {j.job_id for j in app.list_jobs(kind="api.a")} == {available, running}
    assert [j.job_id for j in app.list_jobs(state="dlq")] == [dead]
    assert [j.job_id for j in app.list_jobs(state="running")] == [running]
    assert [j.job_id for j in app.list_jobs(state="scheduled", queue=Q)] == [later]
    assert app.list_jobs(state="completed") == []
    newest_first = [j.job_id for j in app.list_jobs()]
    page1 = app.list_jobs(limit=2)
    page2 = app.list_jobs(limit=2, before_id=page1[-1].job_id)
    assert [j.job_id for j in page1 + page2] == newest_first
    with pytest.raises(ConfigError, match="state='nope'"):
        app.list_jobs(state="nope")
    with pytest.raises(OutOfRange):
        app.list_jobs(limit=0)
    # on the caller's connection too
    with psycopg.connect(app.resolve_dsn()) as c:
        assert app.get_job(available, conn=c).state == "available"
        assert len(app.list_jobs(conn=c)) == 4


def test_list_jobs_pages_past_many_filtered_out_rows(app):
    keep = app.enqueue("api.rare", {}, queue=Q)
    app.enqueue_many("api.common", [{"n": i} for i in range(450)], queue=Q)  # newer ids than `keep`
    assert [j.job_id for j in app.list_jobs(kind="api.rare", limit=5)] == [keep]
    assert len(app.list_jobs(kind="api.common", limit=1000)) == 450
    assert len(app.list_jobs(state="available", limit=300)) == 300


def test_cancel_and_retry_join_the_callers_transaction(app, storage, claimer, conn, pg_dsn):
    schema = app.storage.schema
    dead = to_dlq(app, storage, claimer)
    job = app.enqueue("api.kind", {}, queue=Q)
    later = app.enqueue("api.kind", {}, queue=Q, delay=3600)
    before = fingerprint(conn, schema)
    with psycopg.connect(pg_dsn) as c:
        assert app.cancel(job, conn=c) is True
        assert app.retry(dead, conn=c) is True
        assert app.retry(later, conn=c) is True
        c.rollback()
    assert fingerprint(conn, schema) == before
    assert app.get_job(job).state == "available" and app.get_job(dead).state == "dlq"
    with psycopg.connect(pg_dsn) as c:
        assert app.cancel(job, conn=c) is True
        assert app.retry(dead, conn=c) is True
        assert app.retry(later, conn=c) is True
    assert app.get_job(job).state == "cancelled"
    assert app.get_job(dead).state == "available" and app.get_job(dead).attempt == 0
    assert sqlx(conn, schema, "SELECT run_at <= now() FROM __SCHEMA__.deferred_jobs WHERE job_id = %s",
                (later,)).fetchall() == [(True,)]
    assert app.cancel(job) is False          # terminal already
    assert app.cancel(10**15) is False       # unknown
    assert app.retry(job) is False           # cancelled jobs are not retried
    running = app.enqueue("api.kind", {}, queue="other")
    claim(storage, claimer, running, "other")
    assert app.cancel(running) is True       # asks the running handler to stop
    assert sqlx(conn, schema, "SELECT cancel_requested FROM __SCHEMA__.attempt_state WHERE job_id = %s",
                (running,)).fetchall() == [(True,)]


def test_wait_returns_the_terminal_job_and_result_reads_it(app, storage, claimer):
    job = app.enqueue("api.kind", {}, queue=Q)
    with pytest.raises(TimeoutError, match=f"job {job} is still available"):
        app.wait(job, timeout=0.05)
    with pytest.raises(JobNotCompleted, match="app.wait"):
        app.result(job)
    done = threading.Thread(target=complete, args=(storage, claimer, job))
    done.start()
    info = app.wait(job, timeout=30)
    done.join()
    assert info.state == "completed" and info.terminal
    assert app.result(job) is None           # results are not stored by this schema yet
    dead = to_dlq(app, storage, claimer, "gone wrong")
    assert app.wait(dead, timeout=5).state == "dlq"
    with pytest.raises(JobNotCompleted, match="dlq.*gone wrong"):
        app.result(dead)
    with pytest.raises(UnknownJob):
        app.wait(10**15, timeout=1)
    with pytest.raises(UnknownJob):
        app.result(10**15)
    with pytest.raises(OutOfRange):
        app.wait(job, timeout=-1)


# -- queues -------------------------------------------------------------------------------


def test_configure_queue_settings_pause_resume_counts(app, conn, pg_dsn):
    schema = app.storage.schema
    app.enqueue("api.kind", {}, queue=Q)
    before = fingerprint(conn, schema)
    with psycopg.connect(pg_dsn) as c:
        s = app.configure_queue(Q, deadline=300, heartbeat_timeout=45, dlq=False, dlq_retention=86400,
                                aging_interval=30, enqueue_shards=2, conn=c)
        assert (s.deadline, s.heartbeat_timeout, s.dlq, s.dlq_retention, s.aging_interval, s.enqueue_shards) \
            == (300.0, 45.0, False, 86400.0, 30.0, 2)
        assert app.configure_queue("brand-new", conn=c).queue == "brand-new"
        assert app.pause(Q, conn=c) is True
        assert app.queue_settings(Q, conn=c).paused is True
        c.rollback()
    assert fingerprint(conn, schema) == before
    with psycopg.connect(pg_dsn) as c:
        app.configure_queue(Q, deadline=300, heartbeat_timeout=45, dlq=False, conn=c)
        app.pause(Q, conn=c)
    s = app.queue_settings(Q)
    assert isinstance(s, QueueSettings)
    assert (s.queue, s.paused, s.deadline, s.heartbeat_timeout, s.dlq, s.history_retention) == \
        (Q, True, 300.0, 45.0, False, 3600.0)                                # retention: the default hour
    assert app.configure_queue(Q, heartbeat_timeout=50).deadline == 300.0   # left out: kept
    assert app.configure_queue(Q, deadline=None).deadline is None           # None: removed
    assert app.resume(Q) is True and app.queue_settings(Q).paused is False
    assert app.pause("nosuch") is False and app.resume("nosuch") is False
    with pytest.raises(ConfigError, match="no queue 'nosuch'"):
        app.queue_settings("nosuch")
    assert [q.queue for q in app.list_queues()] == [Q]
    for bad in ({"deadline": -1}, {"heartbeat_timeout": 0}, {"dlq": "yes"}, {"dlq_retention": math.inf},
                {"aging_interval": "60"}, {"enqueue_shards": 65}, {"history_retention": 0}):
        with pytest.raises(ConfigError):
            app.configure_queue(Q, **bad)
    assert app.configure_queue(Q, history_retention=7200).history_retention == 7200.0

    counts = app.counts()
    assert counts[Q]["available"] == 1 and counts[Q]["dlq"] == 0 and set(counts) == {Q}
    assert app.counts(Q) == {Q: counts[Q]}
    assert app.counts("nosuch") == {"nosuch": dict.fromkeys(counts[Q], 0)}
    with psycopg.connect(pg_dsn) as c:
        app.enqueue("api.kind", {}, queue=Q, conn=c)
        assert app.counts(Q, conn=c)[Q]["available"] == 2   # sees its own uncommitted enqueue
        c.rollback()
    assert app.counts(Q)[Q]["available"] == 1


# -- DLQ ----------------------------------------------------------------------------------


def test_dlq_list_retry_purge_with_both_filters(app, storage, claimer, conn, pg_dsn):
    schema = app.storage.schema
    a = to_dlq(app, storage, claimer, "a")
    b = to_dlq(app, storage, claimer, "b")
    other = to_dlq(app, storage, claimer, "o", queue="other")
    entries = app.dlq_list()
    assert {e.job_id for e in entries} == {a, b, other} and all(e.kind == "api.kind" for e in entries)
    assert {e.job_id for e in app.dlq_list(queue="other")} == {other}
    assert len(app.dlq_list(limit=1)) == 1
    with pytest.raises(ConfigError, match="job_ids=, queue="):
        app.dlq_purge()
    with pytest.raises(ConfigError):
        app.dlq_retry()

    before = fingerprint(conn, schema)
    with psycopg.connect(pg_dsn) as c:
        assert app.dlq_purge([a, other], queue=Q, conn=c) == [a]        # both filters hold
        assert app.dlq_retry(queue="other", conn=c) == [other]
        assert {e.job_id for e in app.dlq_list(conn=c)} == {b}
        c.rollback()
    assert fingerprint(conn, schema) == before
    with psycopg.connect(pg_dsn) as c:
        assert app.dlq_purge([a, other], queue=Q, conn=c) == [a]
        assert app.dlq_retry([b, other], queue="other", conn=c) == [other]
    assert [e.job_id for e in app.dlq_list()] == [b]
    assert app.get_job(a) is None and app.get_job(other).state == "available"
    assert app.dlq_retry([b]) == [b] and app.dlq_list() == []
    assert app.dlq_purge(queue=Q) == []


# -- callbacks ----------------------------------------------------------------------------


def test_callback_resolutions_join_the_callers_transaction(app, storage, claimer, conn, pg_dsn):
    schema = app.storage.schema
    jobs = {action: parked(app, storage, claimer) for action in ("complete", "fail", "retry", "resume")}
    calls = {"complete": lambda t, c: app.complete_callback(t, conn=c),
             "fail": lambda t, c: app.fail_callback(t, "nope", conn=c),
             "retry": lambda t, c: app.retry_callback(t, conn=c),
             "resume": lambda t, c: app.resume_callback(t, {"answer": 42}, conn=c)}
    before = fingerprint(conn, schema)
    with psycopg.connect(pg_dsn) as c:
        for action, (_, token) in jobs.items():
            assert calls[action](token, c) is True
        c.rollback()
    assert fingerprint(conn, schema) == before
    with psycopg.connect(pg_dsn) as c:
        for action, (_, token) in jobs.items():
            assert calls[action](str(token), c) is True
    states = {action: app.get_job(job_id).state for action, (job_id, _) in jobs.items()}
    assert states == {"complete": "completed", "fail": "dlq", "retry": "retryable", "resume": "available"}
    assert app.complete_callback(jobs["complete"][1]) is False      # resolved already


@pytest.mark.parametrize("token", ["not-a-uuid", "", "12345", "x" * 100])
def test_a_non_uuid_token_is_false_and_leaves_the_transaction_usable(app, pg_dsn, token):
    with psycopg.connect(pg_dsn) as c:
        c.execute("SELECT 1")
        for call in (app.complete_callback, app.fail_callback, app.retry_callback, app.resume_callback):
            assert call(token, conn=c) is False
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert app.enqueue("api.kind", {}, queue=Q, conn=c) > 0           # still usable
    assert app.complete_callback(str(uuid.uuid4())) is False

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as ac:
            await ac.execute("SELECT 1")
            for call in (app.complete_callback_async, app.fail_callback_async, app.retry_callback_async,
                         app.resume_callback_async):
                assert await call(token, conn=ac) is False
            assert ac.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            await app.enqueue_async("api.kind", {}, queue=Q, conn=ac)

    asyncio.run(run())


# -- the async twins ----------------------------------------------------------------------


def test_every_async_twin_rolls_back_and_commits_with_the_caller(app, storage, claimer, conn, pg_dsn):
    schema = app.storage.schema
    dead = to_dlq(app, storage, claimer, "a")
    dead2 = to_dlq(app, storage, claimer, "b")
    cb = {action: parked(app, storage, claimer) for action in ("complete", "fail", "retry", "resume")}
    job = app.enqueue("api.kind", {"n": 1}, queue=Q)
    later = app.enqueue("api.kind", {}, queue=Q, delay=3600)

    async def writes(ac: psycopg.AsyncConnection) -> None:
        assert await app.enqueue_async("api.kind", {"n": 2}, queue=Q, conn=ac) > 0
        assert len(await app.enqueue_many_async("api.kind", [{}, {}], queue=Q, conn=ac, return_ids=True)) == 2
        assert await app.cancel_async(job, conn=ac) is True
        assert await app.retry_async(later, conn=ac) is True
        s = await app.configure_queue_async(Q, deadline=60, dlq_retention=3600, conn=ac)
        assert s.deadline == 60.0
        assert await app.pause_async(Q, conn=ac) is True
        assert (await app.queue_settings_async(Q, conn=ac)).paused is True
        assert await app.resume_async(Q, conn=ac) is True
        assert await app.pause_async(Q, conn=ac) is True
        assert await app.dlq_retry_async([dead], conn=ac) == [dead]
        assert await app.dlq_purge_async([dead2], queue=Q, conn=ac) == [dead2]
        assert await app.complete_callback_async(cb["complete"][1], conn=ac) is True
        assert await app.fail_callback_async(cb["fail"][1], conn=ac) is True
        assert await app.retry_callback_async(cb["retry"][1], conn=ac) is True
        assert await app.resume_callback_async(cb["resume"][1], {"r": 1}, conn=ac) is True

    async def scenario() -> None:
        before = fingerprint(conn, schema)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as ac:
            await writes(ac)
            await ac.rollback()
        assert fingerprint(conn, schema) == before
        async with await psycopg.AsyncConnection.connect(pg_dsn) as ac:
            await writes(ac)
            await ac.commit()
            # reads on the caller's connection and on the app's async pool
            for c in (ac, None):
                assert (await app.get_job_async(job, conn=c)).state == "cancelled"
                assert await app.get_job_async(10**15, conn=c) is None
                assert [j.job_id for j in await app.list_jobs_async(state="dlq", conn=c)] == [cb["fail"][0]]
                assert len(await app.list_jobs_async(queue=Q, state="available", conn=c)) == 5
                assert (await app.counts_async(Q, conn=c))[Q]["available"] == 5
                assert [e.job_id for e in await app.dlq_list_async(conn=c)] == [cb["fail"][0]]
                assert [q.queue for q in await app.list_queues_async(conn=c)] == [Q]
                assert (await app.wait_async(job, timeout=5, conn=c)).state == "cancelled"
                assert await app.result_async(cb["complete"][0], conn=c) is None
                with pytest.raises(JobNotCompleted):
                    await app.result_async(dead, conn=c)
        with pytest.raises(TimeoutError):
            await app.wait_async(dead, timeout=0.05)
        await app.aclose()

    asyncio.run(scenario())
    s = app.queue_settings(Q)
    assert (s.paused, s.deadline, s.dlq_retention) == (True, 60.0, 3600.0)
    assert app.get_job(later).state == "scheduled"
    assert sqlx(conn, schema, "SELECT run_at <= now() FROM __SCHEMA__.deferred_jobs WHERE job_id = %s",
                (later,)).fetchall() == [(True,)]
    assert {a: app.get_job(j).state for a, (j, _) in cb.items()} == \
        {"complete": "completed", "fail": "dlq", "retry": "retryable", "resume": "available"}


def test_async_methods_use_the_apps_own_pool_without_conn(app, pg_dsn):
    async def scenario() -> list[JobInfo | None]:
        async with App(pg_dsn, app.storage.schema) as a:
            ids = [await a.enqueue_async("api.kind", {"i": i}, queue=Q) for i in range(3)]
            ids += await a.enqueue_many_async("api.kind", [{"i": 3}], queue=Q, return_ids=True)
            return list(await asyncio.gather(*(a.get_job_async(i) for i in ids)))

    infos = asyncio.run(scenario())
    assert [i.args["i"] for i in infos] == [0, 1, 2, 3]


# -- connections: DSN rule, pool, threads ---------------------------------------------------


def test_dsn_none_follows_the_cli_rule_and_logs_the_server_once(pg_dsn, schema, monkeypatch, caplog):
    monkeypatch.delenv("AWA_FAST_DSN", raising=False)
    monkeypatch.setenv("DATABASE_URL", pg_dsn)
    monkeypatch.setenv("AWA_FAST_SCHEMA", schema)
    caplog.set_level(logging.INFO, logger="awa_fast.app")
    with App() as app:
        assert app.storage.schema == schema
        app.enqueue("api.kind", {}, queue=Q)
        app.enqueue("api.kind", {}, queue=Q)
        assert app.resolve_dsn() == pg_dsn
    lines = [r.getMessage() for r in caplog.records if r.name == "awa_fast.app"]
    assert len(lines) == 1 and "from DATABASE_URL" in lines[0] and schema in lines[0], lines
    monkeypatch.setenv("AWA_FAST_DSN", "postgresql://nobody@127.0.0.1:1/x")
    assert App().resolve_dsn() == "postgresql://nobody@127.0.0.1:1/x"           # AWA_FAST_DSN first
    assert App(pg_dsn).resolve_dsn() == pg_dsn                                  # explicit wins
    assert App(schema="explicit_one").storage.schema == "explicit_one"
    monkeypatch.setenv("AWA_FAST_DSN", "not a dsn")
    with pytest.raises(ConfigError, match="invalid DSN"):
        App().resolve_dsn()


def test_an_unmigrated_schema_is_named_with_the_migrate_hint(pg_dsn):
    with App(pg_dsn, "never_migrated_here") as app:
        with pytest.raises(awa_fast.SchemaNotMigrated, match="awa-fast migrate --schema never_migrated_here"):
            app.get_job(1)


def test_one_app_shared_by_threads(app, conn):
    ids: list[int] = []
    lock = threading.Lock()

    def produce(n: int) -> None:
        for i in range(25):
            job_id = app.enqueue("api.kind", {"t": n, "i": i}, queue=Q)
            with lock:
                ids.append(job_id)
        assert len(app.list_jobs(queue=Q, limit=10)) == 10

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 200
    assert app.counts(Q)[Q]["available"] == 200


def test_the_context_manager_closes_the_pool(pg_dsn, schema, conn):
    with App(pg_dsn, schema) as app:
        app.enqueue("api.kind", {}, queue=Q)
        pool = app._pool()  # noqa: SLF001 - the pool it opened
        assert not pool.closed
    assert pool.closed
    with pytest.raises(ConfigError, match="before the app's first database call"):
        app2 = App(pg_dsn, schema)
        app2.enqueue("api.kind", {}, queue=Q)
        app2.dsn = "postgresql://elsewhere/db"
    app2.close()
