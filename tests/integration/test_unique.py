"""Unique jobs (issue 13): keys, conflicts, lazy takeover, sweep, races, period buckets.

Every test runs against the session's real PostgreSQL; the state machine
drives enqueue, cancel, complete, retry and rescue on a few keys across two
connections and checks after every step that no two jobs in holding states
share a key and that a released key can be taken again.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from awa_fast import Unique, UniqueConflict
from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.storage import CLOSE_RETRY, Storage, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate
from awa_fast.storage.schema import render
from awa_fast.unique import UniqueManyResult

pytestmark = pytest.mark.integration

Q = "q"
HOLDING = {"scheduled", "available", "running", "retryable", "waiting_external", "snoozed"}


def _client(pg_dsn: str, schema: str) -> Client:
    return Client(pg_dsn, schema, default_queue=Q)


def state(storage: Storage, conn: psycopg.Connection, job_id: int) -> str | None:
    job = storage.job_load(conn, job_id)
    return None if job is None else job["state"]


def sql(conn: psycopg.Connection, schema: str, text: str, params: object = None) -> list[tuple]:
    return conn.execute(render(text, schema), params).fetchall()  # type: ignore[arg-type]


def claim_all(storage: Storage, conn: psycopg.Connection, n: int = 100):  # noqa: ANN201
    return storage.lane_claim(conn, Q, n)


def complete(storage: Storage, conn: psycopg.Connection, snaps) -> None:  # noqa: ANN001
    with conn.transaction():
        assert storage.receipt_complete(conn, snaps) == []


# -- the basics --------------------------------------------------------------------------------


def test_duplicate_raises_with_the_holder_and_keeps_the_transaction_usable(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    first = c.enqueue("sync.user", {"user": 42, "full": True}, unique=Unique())
    with psycopg.connect(pg_dsn) as tx:  # a caller's own transaction (not autocommit)
        with pytest.raises(UniqueConflict) as err:
            c.enqueue("sync.user", {"full": True, "user": 42}, unique=Unique(), conn=tx)  # same args, other order
        assert err.value.existing_job_id == first
        other = c.enqueue("sync.user", {"user": 43}, unique=Unique(), conn=tx)  # the transaction still works
        tx.execute("SELECT 1")
        tx.commit()
    assert state(storage, conn, other) == "available"
    # not unique: no key, no conflict
    plain = c.enqueue("sync.user", {"user": 42, "full": True})
    assert plain != first
    # a different kind, queue-scoped keys, or a custom key
    c.enqueue("sync.team", {"user": 42, "full": True}, unique=Unique())
    c.enqueue("sync.user", {"user": 42, "full": True}, unique=Unique(by_queue=True), queue="other")
    custom = c.enqueue("anything.else", {"x": 1}, unique=Unique(key="k1"))
    with pytest.raises(UniqueConflict) as err:  # a custom key spans kinds and args
        c.enqueue("sync.user", {"y": 2}, unique=Unique(key="k1"))
    assert err.value.existing_job_id == custom
    # by_args=False: one per kind
    c.enqueue("nightly", {"a": 1}, unique=Unique(by_args=False))
    with pytest.raises(UniqueConflict):
        c.enqueue("nightly", {"a": 2}, unique=Unique(by_args=False))
    c.close()


def test_completion_and_cancel_release_the_key_lazily(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique()
    job = c.enqueue("k", {"n": 1}, unique=u)
    snaps = claim_all(storage, conn)
    assert [s.job_id for s in snaps] == [job]
    with pytest.raises(UniqueConflict):  # running holds
        c.enqueue("k", {"n": 1}, unique=u)
    complete(storage, conn, snaps)
    keys_before = sql(conn, schema, "SELECT job_id FROM __SCHEMA__.unique_keys")
    assert keys_before == [(job,)], "completion leaves the key row alone (no per-job delete)"
    second = c.enqueue("k", {"n": 1}, unique=u)  # taken over: the holder completed
    assert second != job
    assert sql(conn, schema, "SELECT job_id FROM __SCHEMA__.unique_keys") == [(second,)]
    assert storage.job_cancel(conn, second) == "cancelled"
    third = c.enqueue("k", {"n": 1}, unique=u)
    assert third not in (job, second)
    # scheduled holds; a custom states set that names completed keeps the key after completion
    later = c.enqueue("k2", {}, unique=u, delay=3600)
    assert state(storage, conn, later) == "scheduled"
    with pytest.raises(UniqueConflict):
        c.enqueue("k2", {}, unique=u)
    c.close()


def test_terminal_states_can_hold_when_asked(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique(states=("available", "running", "completed"))
    job = c.enqueue("once", {}, unique=u)
    complete(storage, conn, claim_all(storage, conn))
    assert state(storage, conn, job) == "completed"
    with pytest.raises(UniqueConflict) as err:
        c.enqueue("once", {}, unique=u)
    assert err.value.existing_job_id == job
    c.close()


def test_a_rolled_back_holder_releases_the_key(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    with psycopg.connect(pg_dsn) as tx:
        c.enqueue("k", {"n": 1}, unique=Unique(), conn=tx)
        tx.rollback()
    job = c.enqueue("k", {"n": 1}, unique=Unique())
    assert state(storage, conn, job) == "available"
    c.close()


def test_two_racing_transactions_commit_exactly_one_job_whichever_commits(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique()
    for winner_rolls_back in (False, True):
        args = {"race": winner_rolls_back}
        a = psycopg.connect(pg_dsn)
        b = psycopg.connect(pg_dsn)
        try:
            ja = c.enqueue("race", args, unique=u, conn=a)  # a holds the uncommitted key row
            result: dict[str, object] = {}

            def second() -> None:
                try:
                    result["job"] = c.enqueue("race", args, unique=u, conn=b)
                except UniqueConflict as exc:
                    result["conflict"] = exc.existing_job_id

            t = threading.Thread(target=second)
            t.start()
            # b waits on a's uncommitted key row (a lock wait, visible in pg_locks), then sees it or not
            deadline = time.monotonic() + 10
            while not sql(conn, schema, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                          "AND pid = %s", (b.info.backend_pid,)):
                assert time.monotonic() < deadline, "the second enqueue never waited for the first"
                time.sleep(0.01)
            if winner_rolls_back:
                a.rollback()
            else:
                a.commit()
            t.join(10)
            b.commit()
            if winner_rolls_back:
                assert "job" in result, result
                assert state(storage, conn, result["job"]) == "available"  # type: ignore[arg-type]
                assert state(storage, conn, ja) is None
            else:
                assert result == {"conflict": ja}
        finally:
            a.close()
            b.close()
    c.close()


def test_period_buckets_across_a_boundary(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique(period=2, states=("available", "running", "completed"))

    def db_phase() -> float:
        return float(conn.execute("SELECT (extract(epoch FROM clock_timestamp()) % 2)::float8").fetchone()[0])

    # start early in a bucket (on the database clock) so two enqueues land in it
    while db_phase() > 0.5:
        time.sleep(0.05)
    first = c.enqueue("hourly.report", {}, unique=u)
    with pytest.raises(UniqueConflict):
        c.enqueue("hourly.report", {}, unique=u)
    complete(storage, conn, claim_all(storage, conn))  # completed still holds within the period
    with pytest.raises(UniqueConflict):
        c.enqueue("hourly.report", {}, unique=u)
    rows = sql(conn, schema, "SELECT bucket, expires_at > now() FROM __SCHEMA__.unique_keys")
    assert len(rows) == 1 and rows[0][1]
    bucket = rows[0][0]
    while sql(conn, schema, "SELECT floor(extract(epoch FROM now()) / 2)::bigint")[0][0] == bucket:
        time.sleep(0.05)  # the next bucket begins on the database clock
    second = c.enqueue("hourly.report", {}, unique=u)
    assert second != first
    # the sweep drops the expired bucket's key, keeps the live one
    swept, _, _ = storage.unique_sweep(conn, None, 100)
    assert swept == 1
    assert [r[0] for r in sql(conn, schema, "SELECT job_id FROM __SCHEMA__.unique_keys")] == [second]
    c.close()


def test_enqueue_many_skips_duplicates_within_and_across_batches(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique()
    r = c.enqueue_many("m", [{"n": 1}, {"n": 2}, {"n": 1}, {"n": 3}, {"n": 2}], unique=u)
    assert isinstance(r, UniqueManyResult)
    assert (r.inserted, r.skipped, int(r)) == (3, 2, 3)
    r2 = c.enqueue_many("m", [{"n": 3}, {"n": 4}, {"n": 4}, {"n": 1}], unique=u, chunk=2)
    assert (r2.inserted, r2.skipped) == (1, 3)
    assert len(set(r.job_ids) | set(r2.job_ids)) == 4
    assert storage.queue_counts_exact(conn)[Q]["available"] == 4
    # non-unique enqueue_many is unchanged: an int count, every row inserted
    plain = c.enqueue_many("m", [{"n": 1}, {"n": 1}])
    assert plain == 2 and not isinstance(plain, UniqueManyResult)
    # inside the caller's transaction: a rollback takes every key back
    with psycopg.connect(pg_dsn) as tx:
        r3 = c.enqueue_many("m", [{"n": 9}, {"n": 10}], unique=u, conn=tx)
        assert r3.inserted == 2
        tx.rollback()
    assert c.enqueue_many("m", [{"n": 9}, {"n": 10}], unique=u).inserted == 2
    c.close()


def test_app_job_default_unique_and_opt_out(pg_dsn, schema, storage, conn):
    app = App(pg_dsn, schema, default_queue=Q)

    @app.job("dedup.me", unique=Unique())
    def handler(job):  # noqa: ANN001, ANN202
        return None

    first = app.enqueue("dedup.me", {"a": 1})
    with pytest.raises(UniqueConflict):
        app.enqueue("dedup.me", {"a": 1})
    assert app.enqueue("dedup.me", {"a": 1}, unique=False) != first  # this call opts out
    assert app.enqueue_many("dedup.me", [{"a": 1}, {"a": 2}]).skipped == 1
    app.close()


def test_async_twins(pg_dsn, schema, storage, conn):
    import asyncio

    app = App(pg_dsn, schema, default_queue=Q)

    async def scenario() -> tuple[int, int, object]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            first = await app.enqueue_async("a", {"n": 1}, conn=aconn, unique=Unique())
            try:
                await app.enqueue_async("a", {"n": 1}, conn=aconn, unique=Unique())
            except UniqueConflict as exc:
                holder = exc.existing_job_id
            many = await app.enqueue_many_async("a", [{"n": 1}, {"n": 2}, {"n": 2}], conn=aconn, unique=Unique())
            await aconn.commit()
            return first, holder, many

    first, holder, many = asyncio.run(scenario())
    assert holder == first
    assert (many.inserted, many.skipped) == (1, 2)  # type: ignore[attr-defined]
    assert storage.queue_counts_exact(conn)[Q]["available"] == 2
    app.close()


def test_plain_jobs_never_touch_the_feature_tables(pg_dsn, schema, storage, conn):
    """A feature nobody uses costs nothing: no scan, no write of the 0005 tables on enqueue, claim, complete."""
    def stats() -> list[tuple]:
        conn.execute("SELECT pg_stat_force_next_flush()")
        return sql(conn, schema, """SELECT relname, COALESCE(seq_scan, 0) + COALESCE(idx_scan, 0),
                                           n_tup_ins + n_tup_upd + n_tup_del
                                    FROM pg_stat_user_tables WHERE schemaname = %s
                                      AND relname IN ('unique_keys', 'schedules', 'schedule_fires')
                                    ORDER BY relname""", (schema,))

    before = stats()  # (the migration's own DDL scans count here)
    assert len(before) == 3
    c = _client(pg_dsn, schema)
    c.enqueue("plain", {"n": 1})
    c.enqueue("plain", {"n": 2}, delay=0.0)
    c.enqueue_many("plain", [{"n": i} for i in range(50)])
    c._own_conn().execute("SELECT pg_stat_force_next_flush()")
    complete(storage, conn, claim_all(storage, conn))
    c.close()
    assert stats() == before


def test_sweep_deletes_only_stale_keys_in_batches(pg_dsn, schema, storage, conn):
    c = _client(pg_dsn, schema)
    u = Unique()
    c.enqueue_many("s", [{"n": i} for i in range(30)], unique=u)
    snaps = claim_all(storage, conn, 20)
    complete(storage, conn, snaps)  # 20 released (completed), 10 still available
    total = 0
    pos = None
    batches = 0
    while True:
        swept, scanned, pos = storage.unique_sweep(conn, pos, 7)
        total += swept
        batches += 1
        assert scanned <= 7
        if pos is None:
            break
    assert total == 20 and batches >= 5
    assert sql(conn, schema, "SELECT count(*) FROM __SCHEMA__.unique_keys")[0][0] == 10
    c.close()


# -- the state machine ------------------------------------------------------------------------

KEYS = ("a", "b", "c")


class UniqueMachine(RuleBasedStateMachine):
    """Enqueue, cancel, complete, retry and rescue on three keys over two connections."""

    dsn: str = ""

    @initialize()
    def setup(self) -> None:
        self.schema = "h_" + format(abs(hash((id(self), time.monotonic_ns()))), "x")[:12]
        migrate(self.dsn, self.schema, RingSizes(4, 4, 4))
        self.storage = Storage(self.schema)
        self.conns = [psycopg.connect(self.dsn, autocommit=True) for _ in range(2)]
        for c in self.conns:
            use_raw_jsonb(c)
        self.obs = self.conns[0]
        self.client = Client(None, self.schema, default_queue=Q)
        self.storage.queue_ensure(self.obs, Q)
        # heartbeat timeout 0: every open attempt is due for rescue at once
        self.obs.execute(render("UPDATE __SCHEMA__.queue_meta SET heartbeat_timeout = interval '0'", self.schema))
        self.jobs: dict[str, list[int]] = {k: [] for k in KEYS}
        self.running: dict[int, object] = {}

    def teardown(self) -> None:
        if not hasattr(self, "conns"):
            return
        self.obs.execute(f'DROP SCHEMA "{self.schema}" CASCADE')
        for c in self.conns:
            c.close()

    def _holding(self, key: str) -> list[int]:
        return [j for j in self.jobs[key] if state(self.storage, self.obs, j) in HOLDING]

    @rule(key=st.sampled_from(KEYS), which=st.integers(0, 1), delayed=st.booleans())
    def enqueue(self, key: str, which: int, delayed: bool) -> None:
        held = self._holding(key)
        try:
            job = self.client.enqueue("sm", {"key": key}, unique=Unique(), conn=self.conns[which],
                                      delay=60.0 if delayed else None)
        except UniqueConflict as exc:
            assert held == [exc.existing_job_id], (held, exc.existing_job_id)
            return
        assert held == [], f"key {key} was held by {held} yet job {job} was enqueued"
        self.jobs[key].append(job)

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        for snap in self.storage.lane_claim(self.conns[data.draw(st.integers(0, 1))], Q, 10):
            self.running[snap.job_id] = snap

    @precondition(lambda self: self.running)
    @rule(data=st.data(), outcome=st.sampled_from(["complete", "retry"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        job = data.draw(st.sampled_from(sorted(self.running)))
        snap = self.running.pop(job)
        conn = self.conns[data.draw(st.integers(0, 1))]
        if outcome == "complete":
            with conn.transaction():
                self.storage.receipt_complete(conn, [snap])  # type: ignore[list-item]
        else:
            self.storage.attempt_close(conn, [(snap, CLOSE_RETRY, 0.0, "again")])  # type: ignore[list-item]
            self.storage.deferred_promote(conn)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(KEYS))
        if self.jobs[key]:
            job = data.draw(st.sampled_from(self.jobs[key]))
            self.storage.job_cancel(self.conns[data.draw(st.integers(0, 1))], job)

    @precondition(lambda self: self.running)
    @rule()
    def rescue(self) -> None:
        self.storage.receipt_rescue_stale(self.obs)
        self.running.clear()  # rescued attempts are stale; they come back as available

    @rule()
    def sweep(self) -> None:
        self.storage.unique_sweep(self.obs, None, 2)

    @invariant()
    def at_most_one_holder_per_key(self) -> None:
        if not hasattr(self, "jobs"):
            return
        for key in KEYS:
            assert len(self._holding(key)) <= 1, (key, self._holding(key))

    @invariant()
    def a_released_key_is_reusable(self) -> None:
        if not hasattr(self, "jobs"):
            return
        for key in KEYS:
            if self._holding(key):
                continue
            try:
                with self.obs.transaction():  # a probe, rolled back: it must not change the model
                    try:
                        self.client.enqueue("sm", {"key": key}, unique=Unique(), conn=self.obs)
                    except UniqueConflict as exc:  # pragma: no cover - the failure being tested for
                        raise AssertionError(f"released key {key} still conflicts with {exc.existing_job_id}") from exc
                    raise _Rollback
            except _Rollback:
                pass


class _Rollback(Exception):
    pass


def test_unique_state_machine(pg_dsn):
    UniqueMachine.dsn = pg_dsn
    UniqueMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    UniqueMachine.TestCase().runTest()


def test_the_runtime_runs_unique_jobs_and_its_leader_sweeps_their_keys(pg_dsn, schema, storage, conn, tmp_path):
    from tests.fixtures.supervisor import SupervisorProc
    from tests.fixtures.waiting import wait_for

    c = _client(pg_dsn, schema)
    r = c.enqueue_many("rt.sync", [{"n": i % 300} for i in range(400)], unique=Unique())
    assert (r.inserted, r.skipped) == (300, 100)
    c.close()
    keys = "SELECT count(*) FROM __SCHEMA__.unique_keys"
    assert sql(conn, schema, keys)[0][0] == 300
    with SupervisorProc(pg_dsn, schema, tmp_path) as sup:
        wait_for(lambda: storage.queue_terminal_counts(conn).get(Q, {}).get("completed") == 300, 60,
                 "the unique jobs to complete", on_timeout=sup.tail)
        wait_for(lambda: sql(conn, schema, keys)[0][0] == 0, 30, "the leader to sweep the stale keys",
                 on_timeout=sup.tail)
        # the leader logs the pass once it ends (after its last delete committed)
        wait_for(lambda: "swept" in sup.output(), 15, "the leader's sweep log line", on_timeout=sup.tail)
        # a released key is taken again at once, and the new job runs
        again = _client(pg_dsn, schema)
        job = again.enqueue("rt.sync", {"n": 1}, unique=Unique())
        again.close()
        wait_for(lambda: state(storage, conn, job) == "completed", 30, "the re-enqueued job to run")
        assert sup.stop() == 0
