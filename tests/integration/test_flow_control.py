"""Flow control (issue 14, docs/flow-control.md): limits enforced in the claim, fleet-wide.

- max_running=5 over three supervisors (separate process groups, real
  ``awa-fast supervise``): from the handlers' own start/end rows (database
  clock) at no instant more than 5 ran, and every job completed once.
- max_rate 50/s (burst 10) over ~20 s with two supervisors: the observed rate
  is within 10% of 50/s and no 1 s window holds more than burst + 50 starts.
- The claim's bookkeeping: a receipt claimed through the plain function (a
  claimer that has not re-read the settings) counts; a rescued attempt frees
  its slot when its receipt closes; a callback wait keeps its slot; a full
  limit returns the backlog marker, claims nothing and writes nothing.
- With no limit configured a claimer calls the plain claim function
  (``Storage.lane_claim_result``) and never the wrapper.
"""

from __future__ import annotations

import threading
import time

import pytest

from awa_fast.client import Client
from awa_fast.jobs import JobSpec
from awa_fast.limits import KEEP, LimitWatch, Rate, parse_rate
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.storage import Storage
from tests.fixtures.database import sqlx_all
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import counts, done_rows_by_job

pytestmark = pytest.mark.integration

Q = "flow"
APP = "tests.integration.flow_apps:app"


@pytest.fixture
def runs(pg_dsn, schema, conn, monkeypatch):  # noqa: ANN001, ANN201
    """The handlers' run table, and the environment that points flow_apps at it."""
    sqlx_all(conn, schema, "CREATE TABLE __SCHEMA__.flow_runs (id bigserial PRIMARY KEY, job_id bigint NOT NULL, "
                           "run_lease int NOT NULL, pid int NOT NULL, started_at timestamptz NOT NULL, "
                           "ended_at timestamptz)")
    monkeypatch.setenv("AWA_TEST_FLOW_DSN", pg_dsn)
    monkeypatch.setenv("AWA_TEST_FLOW_SCHEMA", schema)
    monkeypatch.setenv("AWA_TEST_FLOW_TABLE", f"{schema}.flow_runs")
    return f"{schema}.flow_runs"


def enqueue_work(pg_dsn: str, schema: str, n: int, ms: float) -> None:
    client = Client(pg_dsn, schema)
    try:
        for i in range(0, n, 500):
            client.enqueue_many("flow.work", [{"ms": ms, "i": j} for j in range(i, min(n, i + 500))], queue=Q)
    finally:
        client.close()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # an end sorts first
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _supervisors(pg_dsn, schema, tmp_path, n, spec):  # noqa: ANN001, ANN202
    return [SupervisorProc(pg_dsn, schema, tmp_path, app=APP, queues=[spec], name=f"sup{i}",
                           poll_interval=0.5) for i in range(n)]


def test_max_running_holds_across_three_supervisors(pg_dsn, schema, storage, conn, tmp_path, runs):
    storage.queue_limits_set(conn, Q, max_running=5)
    n = 400
    sups = _supervisors(pg_dsn, schema, tmp_path, 3, f"{Q}:stripes=2,concurrency=8")
    try:
        for s in sups:
            s.wait_running(2)
        enqueue_work(pg_dsn, schema, n, 25)
        wait_for(lambda: counts(storage, conn, Q).get("completed", 0) == n, 40, "every job completed",
                 on_timeout=lambda: f"{counts(storage, conn, Q)}\n{sups[0].tail()}")
        status = storage.queue_limit_status(conn)[Q]
        for s in sups:
            assert s.stop(30) == 0, s.tail()
    finally:
        for s in sups:
            s.close()
    rows = sqlx_all(conn, schema, "SELECT job_id, pid, extract(epoch FROM started_at)::float8, "
                                  "extract(epoch FROM ended_at)::float8 FROM __SCHEMA__.flow_runs")
    assert len(rows) == n and all(r[3] is not None for r in rows)
    assert len({r[0] for r in rows}) == n, "a job ran twice"
    overlap = max_overlap([(r[2], r[3]) for r in rows])
    assert overlap <= 5, f"{overlap} jobs ran at once under max_running=5"
    assert overlap >= 4, f"only {overlap} ran at once: the limit was not used"
    assert len({r[1] for r in rows}) >= 3, "the work did not spread over the supervisors' claimers"
    assert counts(storage, conn, Q) == {"completed": n}
    done = done_rows_by_job(conn, schema)
    assert all(len(v) == 1 for v in done.values()) and len(done) == n
    assert status["running"] == 0 and status["max_running"] == 5


def test_rate_limit_holds_across_two_supervisors(pg_dsn, schema, storage, conn, tmp_path, runs):
    rate, burst, seconds = 50.0, 10.0, 20.0
    storage.queue_limits_set(conn, Q, max_rate=Rate(rate, per=1.0, burst=burst))
    n = int(rate * seconds * 1.5)
    enqueue_work(pg_dsn, schema, n, 1)
    sups = _supervisors(pg_dsn, schema, tmp_path, 2, f"{Q}:stripes=2,concurrency=8")
    try:
        first = wait_for(lambda: sqlx_all(conn, schema, "SELECT min(extract(epoch FROM started_at))::float8 "
                                                        "FROM __SCHEMA__.flow_runs")[0][0], 30, "a first start",
                         on_timeout=sups[0].tail)
        wait_for(lambda: sqlx_all(conn, schema, "SELECT extract(epoch FROM clock_timestamp())::float8")[0][0]
                 > first + seconds + 0.5, seconds + 10, "the measuring window", interval=0.2)
        status = storage.queue_limit_status(conn)[Q]
    finally:
        for s in sups:
            s.close()
    starts = sorted(r[0] for r in sqlx_all(
        conn, schema, "SELECT extract(epoch FROM started_at)::float8 FROM __SCHEMA__.flow_runs"))
    inside = [t for t in starts if t < first + seconds]
    observed = len(inside) / seconds
    assert abs(observed - rate) <= 0.1 * rate, f"observed {observed:.1f}/s under a {rate}/s limit"
    # token bucket: any window of w seconds holds at most burst + rate*w claims. Handler starts
    # trail their claim (the start is recorded by the handler over its own connection); on a
    # loaded machine a claimer descheduled for a few hundred ms releases its claims' starts
    # together, so up to 0.5 s of trailing is allowed: burst + 1.5 * rate. Without the limit
    # (or with a bucket ten times too large) a second holds hundreds of starts.
    j = 0
    worst = 0
    for i, t in enumerate(starts):
        while starts[j] < t - 1.0:
            j += 1
        worst = max(worst, i - j + 1)
    assert worst <= burst + rate * 1.5, f"{worst} starts in one second (bucket allows {burst + rate})"
    assert len(starts) < n, "the backlog drained: the limit did not hold"
    assert status["tokens"] is not None and 0 <= status["tokens"] <= burst


def _claim(storage, conn, n, limited=True):  # noqa: ANN001, ANN202
    f = storage.lane_claim_limited_result if limited else storage.lane_claim_result
    return f(conn, Q, n, 0, 1)


def test_claim_bookkeeping(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    client.enqueue_many("flow.work", [{"i": i} for i in range(40)], queue=Q)
    client.close()
    storage.queue_limits_set(conn, Q, max_running=5)
    plain, _ = _claim(storage, conn, 3, limited=False)  # a claimer that has not re-read the settings
    assert len(plain) == 3
    got, more = _claim(storage, conn, 100)
    assert len(got) == 2 and more, "the plain claim's 3 open attempts count"
    # full: nothing claimed, no receipt, the marker says "come back"; once the state has
    # seen the last claim's receipt (the first such call writes that), no write at all
    before = sqlx_all(conn, schema, "SELECT count(*) FROM __SCHEMA__.lease_claims")[0][0]
    assert _claim(storage, conn, 100) == ([], True)
    xmin = sqlx_all(conn, schema, "SELECT xmin::text FROM __SCHEMA__.queue_limit_state")[0][0]
    for _ in range(3):
        assert _claim(storage, conn, 100) == ([], True)
    assert sqlx_all(conn, schema, "SELECT count(*) FROM __SCHEMA__.lease_claims")[0][0] == before
    assert sqlx_all(conn, schema, "SELECT xmin::text FROM __SCHEMA__.queue_limit_state")[0][0] == xmin
    assert storage.queue_limit_status(conn)[Q]["running"] == 5
    # completion frees slots
    storage.receipt_complete_rows(conn, plain[:2])
    got2, _ = _claim(storage, conn, 100)
    assert len(got2) == 2
    # a callback wait keeps its slot; its resolution frees it
    token = storage.attempt_register_callback(conn, got[0], 60.0)
    assert token is not None
    assert _claim(storage, conn, 100) == ([], True)
    assert storage.callback_resolve(conn, token, "complete") == "ok"
    got3, _ = _claim(storage, conn, 100)
    assert len(got3) == 1
    # a rescued attempt frees its slot when its receipt closes
    storage.queue_configure(conn, Q, heartbeat_timeout=0.2)
    time.sleep(0.4)
    assert storage.receipt_rescue_stale(conn) == 5
    assert storage.queue_limit_status(conn)[Q]["running"] == 0
    got4, _ = _claim(storage, conn, 100)
    assert len(got4) == 5
    # max_running=0 stops claims; removing the limit goes back to the plain claim
    storage.queue_limits_set(conn, Q, max_running=0)
    assert _claim(storage, conn, 100) == ([], True)
    storage.queue_pause(conn, Q, True)  # paused: no "come back" either
    assert _claim(storage, conn, 100) == ([], False)
    storage.queue_pause(conn, Q, False)
    storage.queue_limits_set(conn, Q, max_running=None)
    assert storage.queue_limits_get(conn, Q).limited is False
    rest, _ = _claim(storage, conn, 1000)
    assert len(rest) > 5


def test_rate_bucket_charges_claimed_jobs_on_the_database_clock(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    client.enqueue_many("flow.work", [{"i": i} for i in range(100)], queue=Q)
    client.close()
    storage.queue_limits_set(conn, Q, max_rate=parse_rate("10/1s", burst=4))
    clock = "SELECT extract(epoch FROM clock_timestamp())::float8"
    t0 = sqlx_all(conn, schema, clock)[0][0]
    got, more = _claim(storage, conn, 100)
    assert len(got) == 4 and more  # the full bucket, then the marker
    soon = len(_claim(storage, conn, 100)[0])
    assert soon <= 1
    time.sleep(0.3)
    again = len(_claim(storage, conn, 100)[0])
    elapsed = sqlx_all(conn, schema, clock)[0][0] - t0
    assert again >= 2 and 4 + soon + again <= 4 + 10 * elapsed + 1e-6, (soon, again, elapsed)
    # max_running and rate together: the smaller allowance wins. Room for 2 more under max_running
    # (how many the bucket let through above depends on the machine's speed), 4 tokens after 1 s.
    opened = 4 + soon + again  # claimed above, none completed
    storage.queue_limits_set(conn, Q, max_running=opened + 2, max_rate=KEEP)
    time.sleep(1.0)
    assert storage.queue_limit_status(conn)[Q]["running"] == opened
    assert len(_claim(storage, conn, 100)[0]) == 2
    lim = storage.queue_limits_get(conn, Q)
    assert lim.max_running == opened + 2 and lim.max_rate == Rate(10.0, per=1.0, burst=4.0)


def test_without_a_limit_the_claimer_calls_the_plain_claim(pg_dsn, schema, storage, conn):
    watch = LimitWatch(storage, Q, refresh=0.0)
    assert watch.claim_call(conn) == storage.lane_claim_result
    storage.queue_limits_set(conn, Q, max_running=3)
    assert watch.claim_call(conn) == storage.lane_claim_limited_result
    storage.queue_limits_set(conn, Q, max_running=None)
    assert watch.claim_call(conn) == storage.lane_claim_result

    # a real claimer on a queue without limits: every claim is the plain function's
    done = threading.Event()
    seen: list[int] = []

    def handler(job):  # noqa: ANN001, ANN202
        seen.append(job.id)
        if len(seen) == 50:
            done.set()

    claimer = Claimer(ClaimerConfig(pg_dsn, schema, "plain", concurrency=4, claim_batch=16, poll_interval=0.2),
                      {"p.work": JobSpec("p.work", handler, "plain", 2, 3, False, None)})
    calls = {"plain": 0, "limited": 0}
    base = Storage(schema)

    class Spy(Storage):
        __slots__ = ()

        def lane_claim_result(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
            calls["plain"] += 1
            return base.lane_claim_result(*a, **k)

        def lane_claim_limited_result(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
            calls["limited"] += 1
            return base.lane_claim_limited_result(*a, **k)

    claimer.storage = Spy(schema)
    claimer.limits = LimitWatch(claimer.storage, "plain")
    t = threading.Thread(target=claimer.run, daemon=True)
    t.start()
    try:
        client = Client(pg_dsn, schema)
        client.enqueue_many("p.work", [{"i": i} for i in range(50)], queue="plain")
        client.close()
        assert done.wait(20), f"ran {len(seen)} of 50"
    finally:
        claimer.stop()
        t.join(30)
    assert calls["plain"] >= 1 and calls["limited"] == 0, calls


def test_async_twins_and_keep(pg_dsn, schema, storage, conn):
    import asyncio

    import psycopg

    async def go():  # noqa: ANN202
        async with await psycopg.AsyncConnection.connect(
                pg_dsn, autocommit=True, application_name=f"awa_fast:test:{schema}:async") as ac:
            lim = await storage.queue_limits_set_async(ac, "a", max_running=3)
            assert (lim.max_running, lim.max_rate) == (3, None)
            lim = await storage.queue_limits_set_async(ac, "a", max_rate=Rate(5, per=2.0))  # keeps max_running
            assert (lim.max_running, lim.max_rate) == (3, Rate(5.0, per=2.0, burst=5.0))
            assert (await storage.queue_limits_get_async(ac, "nope")) is None
            return await storage.queue_limit_status_async(ac)

    status = asyncio.run(go())
    assert status == {"a": {"max_running": 3, "rate": {"count": 5.0, "per": 2.0, "burst": 5.0}, "running": 0,
                            "tokens": 5.0}}
    assert storage.queue_limit_status(conn) == status


def test_key_max_running_holds_across_three_supervisors(pg_dsn, schema, storage, conn, tmp_path, runs):
    """200 keys, key_max_running=2, three supervisors: never more than 2 of a key at once, each job once."""
    storage.queue_key_limit_set(conn, Q, 2)
    n_keys, per_key = 200, 4
    # in blocks of 8 keys, a block's jobs round by round (k0 k1 .. k7, k0 k1 .. k7, ...): a key's
    # jobs sit 8 apart in the lane, so a claimer's batch hands them to different worker threads
    # (consecutive jobs share a thread) and the limit binds; lengths vary from 5 to 45 ms
    rows = [{"ms": 5 + (k * 7 + j * 13) % 41, "k": k, "j": j}
            for b in range(0, n_keys, 8) for j in range(per_key) for k in range(b, b + 8)]
    sups = _supervisors(pg_dsn, schema, tmp_path, 3, f"{Q}:stripes=2,concurrency=8")
    try:
        for s in sups:
            s.wait_running(2)
        client = Client(pg_dsn, schema)
        try:
            ids = client.enqueue_many("flow.work", rows, queue=Q, concurrency_key=[f"key:{r['k']}" for r in rows],
                                      return_ids=True)
        finally:
            client.close()
        key_of = {jid: r["k"] for jid, r in zip(ids, rows)}
        n = len(rows)
        wait_for(lambda: counts(storage, conn, Q).get("completed", 0) == n, 60, "every job completed",
                 on_timeout=lambda: f"{counts(storage, conn, Q)} {storage.queue_key_status(conn)}\n{sups[0].tail()}")
        for s in sups:
            assert s.stop(30) == 0, s.tail()
    finally:
        for s in sups:
            s.close()
    got = sqlx_all(conn, schema, "SELECT job_id, pid, extract(epoch FROM started_at)::float8, "
                                  "extract(epoch FROM ended_at)::float8 FROM __SCHEMA__.flow_runs")
    assert len(got) == n and all(r[3] is not None for r in got)
    assert {r[0] for r in got} == set(ids), "a job ran twice or not at all"
    per: dict[int, list[tuple[float, float]]] = {}
    for job_id, _pid, start, end in got:
        per.setdefault(key_of[job_id], []).append((start, end))
    worst = max(max_overlap(v) for v in per.values())
    assert worst <= 2, f"{worst} jobs of one key ran at once under key_max_running=2"
    assert worst == 2, "no key ever had 2 running: the limit was not used"
    assert max_overlap([(r[2], r[3]) for r in got]) > 2, "keys did not run side by side"
    assert len({r[1] for r in got}) >= 3, "the work did not spread over the supervisors' claimers"
    assert counts(storage, conn, Q) == {"completed": n}
    done = done_rows_by_job(conn, schema)
    assert all(len(v) == 1 for v in done.values()) and len(done) == n
    assert storage.queue_key_status(conn)[Q]["waiting"] == 0


def test_hot_key_backlog_does_not_delay_a_cold_key_under_supervisors(pg_dsn, schema, storage, conn, tmp_path,
                                                                      runs):
    """10,000 queued jobs of one key: another key's job starts within one claim round of its enqueue."""
    storage.queue_key_limit_set(conn, Q, 2)
    client = Client(pg_dsn, schema)
    try:
        client.enqueue_many("flow.work", [{"ms": 20, "i": i} for i in range(10_000)], queue=Q,
                            concurrency_key="hot")
        sups = _supervisors(pg_dsn, schema, tmp_path, 2, f"{Q}:stripes=1,concurrency=8")
        try:
            for s in sups:
                s.wait_running(1)
            wait_for(lambda: sqlx_all(conn, schema, "SELECT count(*) FROM __SCHEMA__.flow_runs")[0][0] >= 10, 30,
                     "the hot key running", on_timeout=sups[0].tail)
            with conn.transaction():
                cold = client.enqueue("flow.work", {"ms": 1}, queue=Q, concurrency_key="cold", conn=conn)
                enqueued_at = sqlx_all(conn, schema, "SELECT extract(epoch FROM clock_timestamp())::float8")[0][0]
            # the receipt first: the claim ring rotates fast and its pruning drops closed receipts
            claimed_at = wait_for(lambda: sqlx_all(conn, schema, "SELECT extract(epoch FROM claimed_at)::float8 "
                                                                  "FROM __SCHEMA__.lease_claims "
                                                                  "WHERE %s = ANY(job_ids)",
                                                    (cold,)), 30, "the cold job's claim", on_timeout=sups[0].tail)[0][0]
            started = wait_for(lambda: sqlx_all(conn, schema, "SELECT extract(epoch FROM started_at)::float8 "
                                                               "FROM __SCHEMA__.flow_runs WHERE job_id = %s",
                                                 (cold,)), 30, "the cold job's start", on_timeout=sups[0].tail)
            waiting = storage.queue_key_status(conn)[Q]["waiting"]
            for s in sups:
                assert s.stop(30) == 0, s.tail()
        finally:
            for s in sups:
                s.close()
    finally:
        client.close()
    latency = started[0][0] - enqueued_at
    claim_latency = claimed_at - enqueued_at
    # one claim round: the busy pause (at most 20 ms) plus one claim call; a loaded 2-core machine
    # stretches both (and the handler's start, which opens its recording connection), so the bounds
    # are generous next to the 10,000 x 20 ms / 2 = 100 s the backlog holds
    assert claim_latency < 0.5, f"the cold key's job was claimed {claim_latency:.3f}s after its enqueue"
    assert latency < 1.5, f"the cold key's job started {latency:.3f}s after its enqueue"
    assert waiting > 9_000, "the hot backlog drained: the test measured nothing"
    hot = sqlx_all(conn, schema, "SELECT extract(epoch FROM started_at)::float8, extract(epoch FROM ended_at)::float8 "
                                  "FROM __SCHEMA__.flow_runs WHERE job_id <> %s AND ended_at IS NOT NULL", (cold,))
    assert max_overlap([(a, b) for a, b in hot]) <= 2
