"""The partial ``ready_entries_job`` index (migration 0019) and every reader that finds a ready row by job id.

A lane-born job's id is its birth position (``lane_id << 40 | lane_seq``), so
its ready row is found by the primary key; only a row that re-entered ready
under an older id (a retry or a deferred job promoted, a rescue, a keyed
admission) is in the partial index. ``ready_rows_of`` reads both, and get,
cancel, the job list and its paging, unique-key holding and release and the
per-key admission gate must see a job of each kind exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from awa_fast import Unique, UniqueConflict
from awa_fast.client import Client
from awa_fast.outcomes import CloseCode
from awa_fast.storage import Storage
from awa_fast.storage.schema import named_queries
from tests.fixtures.database import sqlx, sqlx_all
from tests.integration.storage_helpers import claim, complete, enqueue, make_due

pytestmark = pytest.mark.integration

KINDS = ("lane_born", "retried", "promoted", "rescued")
BORN = "job_id = ((lane_id::bigint << 40) | lane_seq)"


def queue_of(kind: str) -> str:
    return f"q_{kind}"


def make(kind: str, schema: str, storage: Storage, conn: psycopg.Connection) -> int:
    """An available job whose newest ready row got there the way ``kind`` says, alone in its queue."""
    q = queue_of(kind)
    if kind == "lane_born":
        return enqueue(schema, conn, q, {"k": kind})
    if kind == "promoted":  # deferred-born (job_id_seq), then promoted into a lane
        job = enqueue(schema, conn, q, {"k": kind}, delay=3600)
        assert make_due(conn, schema) == 1
        assert storage.deferred_promote(conn) == 1
        return job
    if kind == "rescued":
        storage.queue_configure(conn, q, heartbeat_timeout=0)
    job = enqueue(schema, conn, q, {"k": kind}, max_attempts=5)
    [snap] = claim(storage, conn, q, 10)
    if kind == "retried":
        storage.attempt_close(conn, [(snap, CloseCode.RETRY, 0.0, "again")])
        assert storage.deferred_promote(conn) == 1
    else:
        assert storage.receipt_rescue_stale(conn) == 1
    return job


def rows_of(conn: psycopg.Connection, schema: str, job: int) -> list[tuple[int, bool]]:
    """(lease_base, born at its position) of every ready row of ``job``, oldest first (read by a scan)."""
    return [(int(b), bool(x)) for b, x in sqlx_all(
        conn, schema, f"SELECT lease_base, {BORN} FROM __SCHEMA__.ready_entries WHERE job_id + 0 = %s "
                      "ORDER BY lease_base", (job,))]


@pytest.fixture
def jobs(schema: str, storage: Storage, conn: psycopg.Connection) -> dict[str, int]:
    return {kind: make(kind, schema, storage, conn) for kind in KINDS}


def test_each_kind_has_the_ready_rows_its_path_gives(schema, conn, jobs):
    assert rows_of(conn, schema, jobs["lane_born"]) == [(0, True)]
    assert rows_of(conn, schema, jobs["promoted"]) == [(0, False)]
    assert jobs["promoted"] < 2 ** 40
    # the first attempt's row stays at the birth position; the attempt came back in a new one
    assert rows_of(conn, schema, jobs["retried"]) == [(0, True), (1, False)]
    assert rows_of(conn, schema, jobs["rescued"]) == [(0, True), (1, False)]
    # only the re-entered rows are indexed by job id
    [(pred,)] = sqlx_all(conn, schema, "SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
                                       "WHERE i.indexrelid = '__SCHEMA__.ready_entries_job'::regclass")
    assert pred == "(job_id <> (((lane_id)::bigint << 40) | lane_seq))"
    found = {int(j) for (j,) in sqlx_all(
        conn, schema, "SELECT DISTINCT job_id FROM __SCHEMA__.ready_rows_of(%s)", (jobs["retried"],))}
    assert found == {jobs["retried"]}


def test_get_job_sees_each_kind_available_then_running_then_completed(schema, storage, conn, jobs):
    attempts = {"lane_born": 0, "promoted": 0, "retried": 1, "rescued": 1}
    for kind, job in jobs.items():
        got = storage.job_load(conn, job)
        assert got is not None and (got["state"], got["job_id"], got["attempt"]) == ("available", job,
                                                                                     attempts[kind]), kind
        assert got["args"] == {"k": kind}
    for kind, job in jobs.items():
        [snap] = claim(storage, conn, queue_of(kind), 10)
        assert (snap.job_id, snap.attempt) == (job, attempts[kind] + 1)
        got = storage.job_load(conn, job)
        assert got is not None and (got["state"], got["run_lease"]) == ("running", snap.run_lease), kind
        assert complete(storage, conn, [snap], whole=True) == []  # a compact done row (0015)
        got = storage.job_load(conn, job)
        assert got is not None and (got["state"], got["attempt"]) == ("completed", attempts[kind] + 1), kind
        assert storage.job_cancel(conn, job) == "terminal"


def test_cancel_finds_each_kind_waiting_and_running(schema, storage, conn, jobs):
    for kind in ("lane_born", "promoted"):
        assert storage.job_cancel(conn, jobs[kind]) == "cancelled", kind
        got = storage.job_load(conn, jobs[kind])
        assert got is not None and got["state"] == "cancelled"
        assert claim(storage, conn, queue_of(kind), 10) == []
    for kind in ("retried", "rescued"):
        [snap] = claim(storage, conn, queue_of(kind), 10)
        assert storage.job_cancel(conn, jobs[kind]) == "cancel_requested", kind
        assert sqlx_all(conn, schema, "SELECT run_lease, cancel_requested FROM __SCHEMA__.attempt_state "
                                      "WHERE job_id = %s", (jobs[kind],)) == [(snap.run_lease, True)]


def walk(storage: Storage, conn: psycopg.Connection, **kw: Any) -> Iterator[int]:
    """Every id of the job list, one page of one job at a time (before_id = the last id seen)."""
    before = None
    while True:
        page = storage.job_list(conn, limit=1, before_id=before, **kw)
        if not page:
            return
        before = int(page[0]["job_id"])
        yield before


def test_job_list_pages_through_every_kind_in_id_order(schema, storage, conn, jobs):
    # more lane-born jobs around them, in two lanes of one queue and a ready rotation apart
    more = [enqueue(schema, conn, "q_lane_born", {"i": i}, priority=p) for i in range(3) for p in (1, 3)]
    assert storage.ring_rotate(conn, "ready") is not None
    more += [enqueue(schema, conn, "q_lane_born", {"i": i}) for i in range(3, 6)]
    everyone = sorted([*jobs.values(), *more], reverse=True)
    assert [int(j["job_id"]) for j in storage.job_list(conn, limit=100)] == everyone
    assert list(walk(storage, conn)) == everyone
    assert list(walk(storage, conn, state="available")) == everyone
    assert list(walk(storage, conn, queue="q_lane_born")) == sorted([jobs["lane_born"], *more], reverse=True)
    for kind in ("retried", "promoted", "rescued"):
        assert list(walk(storage, conn, queue=queue_of(kind))) == [jobs[kind]]
    assert list(walk(storage, conn, kind="nope")) == []
    # a page boundary inside the re-entered rows and inside a lane's lane-born rows
    below = sorted(everyone)[len(everyone) // 2]
    assert [int(j["job_id"]) for j in storage.job_list(conn, limit=100, before_id=below)] == \
        [j for j in everyone if j < below]


def test_unique_key_held_by_its_holder_before_and_after_a_retry_until_it_completes(pg_dsn, schema, storage, conn):
    c = Client(pg_dsn, schema, default_queue="q_unique")
    u = Unique()
    job = c.enqueue("u", {"n": 1}, unique=u)
    # a unique job's id comes from job_id_seq (the key row names it before the lane lock): its ready
    # rows are all in the partial index
    assert rows_of(conn, schema, job) == [(0, False)] and job < 2 ** 40
    assert storage.unique_sweep(conn, None, 100)[0] == 0, "an available holder keeps its key"
    with pytest.raises(UniqueConflict):
        c.enqueue("u", {"n": 1}, unique=u)
    [snap] = claim(storage, conn, "q_unique", 10)
    storage.attempt_close(conn, [(snap, CloseCode.RETRY, 0.0, "again")])
    assert storage.deferred_promote(conn) == 1
    assert rows_of(conn, schema, job) == [(0, False), (1, False)]
    assert storage.unique_sweep(conn, None, 100)[0] == 0, "the holder is back in ready: the key stays"
    with pytest.raises(UniqueConflict):
        c.enqueue("u", {"n": 1}, unique=u)
    [snap] = claim(storage, conn, "q_unique", 10)
    assert complete(storage, conn, [snap], whole=True) == []
    second = c.enqueue("u", {"n": 1}, unique=u)  # the re-entered holder completed: the key is free
    assert second != job
    c.close()


def test_an_old_admission_whose_job_is_back_in_ready_keeps_its_keys_room(pg_dsn, schema, storage, conn):
    q = "q_keyed"
    storage.queue_key_limit_set(conn, q, 1)
    c = Client(pg_dsn, schema)
    first, second = (c.enqueue("k", {"i": i}, queue=q, concurrency_key="A") for i in range(2))
    c.close()
    got, _ = storage.lane_claim_keyed_result(conn, q, 10, 0, 1)
    assert [s.job_id for s in got] == [first]
    storage.attempt_close(conn, [(got[0], CloseCode.RETRY, 0.0, "again")])
    assert storage.deferred_promote(conn) == 1
    assert rows_of(conn, schema, first) == [(0, False), (1, False)]  # admitted rows: ids from job_id_seq
    # An admission older than 5 minutes is retired only when its job is nowhere live; this one is
    # in ready again (found through the partial index), so the key stays full.
    sqlx(conn, schema, "UPDATE __SCHEMA__.key_admits SET admitted_at = now() - interval '10 minutes'")
    got, _ = storage.lane_claim_keyed_result(conn, q, 10, 0, 1)
    assert [s.job_id for s in got] == [first]
    assert complete(storage, conn, got, whole=True) == []
    for _ in range(50):  # the done probe of a moved job covers an eighth of the admissions per call
        got, _ = storage.lane_claim_keyed_result(conn, q, 10, 0, 1)
        if got:
            break
    assert [s.job_id for s in got] == [second]


# -- plans -------------------------------------------------------------------------------------


def scans(plan: dict[str, Any], under_sort: bool = False) -> Iterator[tuple[str, str, bool]]:
    """(node type, relation, below a Sort by lane position) of every scan node of a JSON plan."""
    if "Relation Name" in plan:
        yield plan["Node Type"], plan["Relation Name"], under_sort
    by_lane = plan["Node Type"] == "Sort" and any("lane_" in k for k in plan.get("Sort Key", ()))
    for sub in plan.get("Plans", ()):
        yield from scans(sub, under_sort or by_lane)


def test_lookups_by_job_id_stay_index_scans_on_a_filled_ring(pg_dsn, schema, storage, conn):
    c = Client(pg_dsn, schema)
    for _ in range(2):
        c.enqueue_many("bulk", ({"n": n} for n in range(20000)), queue="q_bulk")
        snaps = claim(storage, conn, "q_bulk", 50)
        storage.attempt_close(conn, [(s, CloseCode.RETRY, 0.0, "again") for s in snaps])
        assert storage.deferred_promote(conn) == 50
        assert storage.ring_rotate(conn, "ready") is not None
    c.close()
    sqlx(conn, schema, "ANALYZE __SCHEMA__.ready_entries")
    filled = {f"ready_entries_{s}" for (s,) in sqlx_all(conn, schema, "SELECT DISTINCT ready_slot "
                                                                       "FROM __SCHEMA__.ready_entries")}
    assert len(filled) == 2
    [(born, moved)] = sqlx_all(conn, schema, f"SELECT min(job_id) FILTER (WHERE {BORN} AND lane_seq > 30000), "
                                             f"min(job_id) FILTER (WHERE NOT {BORN}) FROM __SCHEMA__.ready_entries")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    sqlx(conn, schema, "PREPARE rows_of(bigint) AS SELECT * FROM __SCHEMA__.ready_rows_of($1)")
    for job in (born, moved):
        [(plan,)] = conn.execute(f"EXPLAIN (FORMAT JSON, ANALYZE) EXECUTE rows_of({int(job)})").fetchall()
        nodes = [n for n in scans(plan[0]["Plan"]) if n[1] in filled]
        assert len(nodes) == 4 and all(t in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan")
                                       for t, _, _ in nodes), nodes
        assert plan[0]["Plan"]["Actual Rows"] >= 1
    conn.execute("RESET plan_cache_mode")
    text = named_queries(schema)["job_list_ids"]
    for before in (None, born, moved):
        params = dict(ready=True, done=True, deferred=True, dlq=True, leases=True, waiting=True, queue=None,
                      kind=None, limit=100, before=before)
        [(plan,)] = conn.execute("EXPLAIN (FORMAT JSON) " + text, params).fetchall()
        nodes = [n for n in scans(plan[0]["Plan"]) if n[1] in filled]
        assert nodes and all(t in ("Index Scan", "Index Only Scan") and not sorted_ for t, _, sorted_ in nodes), \
            json.dumps(nodes)
