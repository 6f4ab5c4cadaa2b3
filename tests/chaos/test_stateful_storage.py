"""A hypothesis state machine over the storage engine against real PostgreSQL.

Random sequences of enqueue (single, many, COPY, rolled back), claim,
complete, retry, snooze, fail, cancel (from the handler and from outside),
heartbeat, stale writes, rescue, promote, rotate and prune run through
``awa_fast.storage.Storage``; after every step the database must agree with
a model (job -> expected state) exactly: ``queue_counts_exact``, ``job_load``
of every job, nothing from a rolled-back enqueue, at most one terminal
record per job, every stale write rejected.

Each example gets a fresh schema (rings of 4 slots) on the session server.
``heartbeat_timeout`` is 1 hour except inside the rescue step, where it is 0
so every open attempt is rescuable at once; deferred jobs are made due by
``UPDATE deferred_jobs SET run_at = now()``.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from dataclasses import dataclass

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from awa_fast.client import Client
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage import (
    CLOSE_CANCEL,
    CLOSE_FAIL,
    CLOSE_RETRY,
    CLOSE_SNOOZE,
    RawJson,
    Storage,
    use_raw_jsonb,
)
from awa_fast.storage.migrate import RingSizes, migrate

Q = "q"
KIND = "chaos.model"
TERMINAL = {"completed", "failed", "cancelled", "dlq"}
DEFERRED = {"scheduled", "retryable", "snoozed"}
RINGS = ("claim", "ready", "lease")


@dataclass
class MJob:
    state: str
    max_attempts: int
    consumed: int = 0  # attempts consumed so far
    run_lease: int = 0  # last run_lease issued
    snap: ClaimSnapshot | None = None
    cancel_requested: bool = False


def _raw(i: int) -> RawJson:
    return RawJson(orjson.dumps({"i": i}))


class SchemaPool:
    """Fresh migrated schemas, prepared ahead on a thread (a migrate takes ~0.6 s; examples overlap it)."""

    def __init__(self, dsn: str, ahead: int = 2) -> None:
        self.dsn = dsn
        self._q: queue.Queue[str] = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="chaos-schema-pool", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            name = "hyp_" + uuid.uuid4().hex[:10]
            migrate(self.dsn, name, RingSizes(4, 4, 4))
            while not self._stop.is_set():
                try:
                    self._q.put(name, timeout=0.2)
                    break
                except queue.Full:
                    continue
            else:
                _drop(self.dsn, name)

    def get(self) -> str:
        return self._q.get(timeout=60)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        while not self._q.empty():
            _drop(self.dsn, self._q.get_nowait())


def _drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class StorageMachine(RuleBasedStateMachine):
    dsn: str = ""
    pool: SchemaPool | None = None

    def __init__(self) -> None:
        super().__init__()
        assert self.pool is not None
        self.schema = self.pool.get()
        self.st = Storage(self.schema)
        self.conn = psycopg.connect(self.dsn, autocommit=True, application_name=f"chaos:model:{self.schema}")
        use_raw_jsonb(self.conn)
        self.client = Client(None, self.schema, default_queue=Q)
        self.st.queue_configure(self.conn, Q, heartbeat_timeout=3600)
        self.jobs: dict[int, MJob] = {}
        self.rolled_back: set[int] = set()
        self.stale: list[ClaimSnapshot] = []
        self.claim_sizes: dict[int, int] = {}  # claim_id -> jobs in the receipt
        self.closed_in_claim: dict[int, int] = {}  # claim_id -> attempts of it closed so far
        self.n = 0

    def teardown(self) -> None:
        try:
            self.conn.close()
        finally:
            _drop(self.dsn, self.schema)

    # -- helpers ---------------------------------------------------------------------------

    def _ids(self, state: str) -> list[int]:
        return sorted(j for j, m in self.jobs.items() if m.state == state)

    def _add(self, ids: list[int], max_attempts: int, state: str = "available") -> None:
        for j in ids:
            assert j not in self.jobs and j not in self.rolled_back, f"job id {j} issued twice"
            self.jobs[j] = MJob(state, max_attempts)

    def _close_attempt(self, m: MJob) -> None:
        assert m.snap is not None
        self.stale.append(m.snap)
        self.closed_in_claim[m.snap.claim_id] = self.closed_in_claim.get(m.snap.claim_id, 0) + 1
        m.snap = None
        m.cancel_requested = False

    # -- enqueue ---------------------------------------------------------------------------

    @rule(max_attempts=st.integers(1, 3), delayed=st.booleans())
    def enqueue_single(self, max_attempts: int, delayed: bool) -> None:
        self.n += 1
        j = self.client.enqueue(KIND, {"i": self.n}, queue=Q, max_attempts=max_attempts, conn=self.conn,
                                delay=3600 if delayed else None)
        self._add([j], max_attempts, "scheduled" if delayed else "available")

    @rule(k=st.integers(1, 6), max_attempts=st.integers(1, 3))
    def enqueue_many(self, k: int, max_attempts: int) -> None:
        ids = self.st.job_enqueue_many(self.conn, Q, 2, KIND, [_raw(i) for i in range(k)], None, max_attempts)
        assert len(ids) == k
        self._add(ids, max_attempts)

    @rule(k=st.integers(1, 6), max_attempts=st.integers(1, 3), priority=st.integers(1, 4))
    def enqueue_copy(self, k: int, max_attempts: int, priority: int) -> None:
        with self.conn.transaction():
            rng = self.st.job_enqueue_copy(self.conn, Q, priority, KIND, [_raw(i) for i in range(k)], None,
                                           max_attempts)
        self._add([(rng.lane_id << 40) | (rng.first_seq + i) for i in range(k)], max_attempts)

    @rule(k=st.integers(1, 4), with_copy=st.booleans())
    def enqueue_rolled_back(self, k: int, with_copy: bool) -> None:
        ids: list[int] = []
        with psycopg.connect(self.dsn, autocommit=False, application_name="chaos:model:rb") as p:
            ids.append(self.client.enqueue(KIND, {"rb": 1}, queue=Q, conn=p))
            ids += self.st.job_enqueue_many(p, Q, 2, KIND, [_raw(i) for i in range(k)], None, 3)
            if with_copy:
                rng = self.st.job_enqueue_copy(p, Q, 3, KIND, [_raw(i) for i in range(k)], None, 3)
                ids += [(rng.lane_id << 40) | (rng.first_seq + i) for i in range(k)]
            p.rollback()
        self.rolled_back.update(ids)

    # -- claim and outcomes -------------------------------------------------------------------

    @rule(limit=st.integers(1, 8))
    def claim(self, limit: int) -> None:
        available = self._ids("available")
        snaps = self.st.lane_claim(self.conn, Q, limit)
        # never skips visible work, never claims beyond the limit
        assert len(snaps) == min(limit, len(available)), (len(snaps), limit, len(available))
        for s in snaps:
            assert s.job_id not in self.rolled_back, f"rolled-back job {s.job_id} claimed"
            m = self.jobs.get(s.job_id)
            assert m is not None and m.state == "available", (s.job_id, m)
            assert s.run_lease == m.run_lease + 1, (s, m)
            assert s.attempt == m.consumed + 1, (s, m)
            m.state, m.run_lease, m.snap = "running", s.run_lease, s
            self.claim_sizes[s.claim_id] = self.claim_sizes.get(s.claim_id, 0) + 1

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        running = self._ids("running")
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="complete")
        snaps = [self.jobs[j].snap for j in chosen]
        per_claim: dict[int, int] = {}
        for s in snaps:
            per_claim[s.claim_id] = per_claim.get(s.claim_id, 0) + 1  # type: ignore[union-attr]
        # a compact receipt closure only when the whole receipt is in this batch (as the batcher does)
        whole = {(s.claim_slot, s.claim_id) for s in snaps  # type: ignore[union-attr]
                 if per_claim[s.claim_id] == self.claim_sizes[s.claim_id]  # type: ignore[union-attr]
                 and not self.closed_in_claim.get(s.claim_id)}  # type: ignore[union-attr]
        with_state = [s for s, j in zip(snaps, chosen) if self.jobs[j].cancel_requested]
        with self.conn.transaction():
            stale = self.st.receipt_complete(self.conn, snaps, whole, with_state)  # type: ignore[arg-type]
        assert stale == [], stale
        for j in chosen:
            m = self.jobs[j]
            self._close_attempt(m)
            m.state = "completed"

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data(), outcome=st.sampled_from([CLOSE_RETRY, CLOSE_SNOOZE, CLOSE_FAIL, CLOSE_CANCEL]))
    def close(self, data: st.DataObject, outcome: int) -> None:
        j = data.draw(st.sampled_from(self._ids("running")), label="close")
        m = self.jobs[j]
        snap = m.snap
        assert snap is not None
        [r] = self.st.attempt_close(self.conn, [(snap, outcome, 0.0, "model says no")])
        assert r.status == "ok", r
        cancel = m.cancel_requested
        self._close_attempt(m)
        if outcome in (CLOSE_RETRY, CLOSE_SNOOZE) and cancel:
            m.state = "cancelled"
        elif outcome == CLOSE_RETRY:
            m.consumed = snap.attempt
            m.state = "dlq" if snap.attempt >= m.max_attempts else "retryable"
        elif outcome == CLOSE_SNOOZE:
            m.consumed = snap.attempt - 1
            m.state = "snoozed"
        elif outcome == CLOSE_FAIL:
            m.consumed = snap.attempt
            m.state = "dlq"
        else:
            m.state = "cancelled"

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        j = data.draw(st.sampled_from(sorted(self.jobs)), label="cancel")
        m = self.jobs[j]
        word = self.st.job_cancel(self.conn, j)
        if m.state in ("available", *DEFERRED):
            assert word == "cancelled", (j, m, word)
            m.state = "cancelled"
        elif m.state == "running":
            assert word == "cancel_requested", (j, m, word)
            m.cancel_requested = True
        else:
            # terminal; once its history is pruned the job may be unknown
            assert word in ("terminal", "unknown"), (j, m, word)
            if word == "unknown":
                assert m.state in ("completed", "cancelled", "failed"), (j, m)

    @precondition(lambda self: self._ids("running") or self.stale)
    @rule()
    def heartbeat(self) -> None:
        running = [self.jobs[j].snap for j in self._ids("running")]
        stale = self.stale[-3:]
        results = self.st.attempt_heartbeat(self.conn, [*running, *stale])  # type: ignore[list-item]
        # one result per attempt, matched by (job_id, run_lease): the order is the lock order, not ours
        got = {(r.job_id, r.run_lease): r.status for r in results}
        assert len(results) == len(running) + len(stale) == len(got), results
        for s in stale:
            assert got[(s.job_id, s.run_lease)] == "stale", (s, got)
        for s in running:
            m = self.jobs[s.job_id]  # type: ignore[union-attr]
            assert got[(s.job_id, s.run_lease)] == ("cancel" if m.cancel_requested else "ok"), (s, got)

    @precondition(lambda self: self.stale)
    @rule(data=st.data(), how=st.sampled_from(["complete", "retry", "fail"]))
    def stale_write(self, data: st.DataObject, how: str) -> None:
        snap = data.draw(st.sampled_from(self.stale), label="stale")
        if how == "complete":
            with self.conn.transaction():
                stale = self.st.receipt_complete(self.conn, [snap], [(snap.claim_slot, snap.claim_id)])
            assert stale == [(snap.job_id, snap.run_lease)], stale
        else:
            [r] = self.st.attempt_close(self.conn, [(snap, CLOSE_RETRY if how == "retry" else CLOSE_FAIL, 0.0, "x")])
            assert r.status == "stale", r

    # -- maintenance ------------------------------------------------------------------------------

    @rule()
    def rescue(self) -> None:
        running = self._ids("running")
        self.st.queue_configure(self.conn, Q, heartbeat_timeout=0)
        try:
            n = self.st.receipt_rescue_stale(self.conn, 1000)
        finally:
            self.st.queue_configure(self.conn, Q, heartbeat_timeout=3600)
        assert n == len(running), (n, running)
        for j in running:
            m = self.jobs[j]
            snap = m.snap
            assert snap is not None
            self._close_attempt(m)
            m.consumed = snap.attempt
            m.state = "dlq" if snap.attempt >= m.max_attempts else "available"

    @rule()
    def promote(self) -> None:
        deferred = [j for j, m in self.jobs.items() if m.state in DEFERRED]
        self.conn.execute(f'UPDATE "{self.schema}".deferred_jobs SET run_at = now()')
        n = self.st.deferred_promote(self.conn, 1000)
        assert n == len(deferred), (n, deferred)
        for j in deferred:
            self.jobs[j].state = "available"

    @rule(ring=st.sampled_from(RINGS), rotate=st.booleans())
    def rotate_and_prune(self, ring: str, rotate: bool) -> None:
        if rotate:
            self.st.ring_rotate(self.conn, ring)
        state = self.st.ring_state(self.conn)[ring]
        for i in range(1, int(state["slots"])):
            slot = (int(state["slot"]) + i) % int(state["slots"])
            word = self.st.ring_prune(self.conn, ring, slot, 50)
            assert word in ("pruned", "empty", "busy", "pending_ready", "open_claims", "cursor_behind",
                            "active_leases", "current"), word

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def counts_are_exact(self) -> None:
        expected: dict[str, int] = {}
        for m in self.jobs.values():
            expected[m.state] = expected.get(m.state, 0) + 1
        got = {k: v for k, v in self.st.queue_counts_exact(self.conn).get(Q, {}).items() if v}
        assert got == expected, (got, expected)

    @invariant()
    def every_job_is_where_the_model_says(self) -> None:
        for j, m in self.jobs.items():
            loaded = self.st.job_load(self.conn, j)
            if loaded is None:
                # only a finished job's history may be gone (pruned); never live work
                assert m.state in ("completed", "cancelled", "failed"), (j, m)
                continue
            assert loaded["state"] == m.state, (j, loaded["state"], m)
        for j in self.rolled_back:
            assert self.st.job_load(self.conn, j) is None, f"rolled-back job {j} is visible"

    @invariant()
    def at_most_one_terminal_record(self) -> None:
        s = f'"{self.schema}"'
        dups = self.conn.execute(f"""SELECT job_id FROM (SELECT job_id FROM {s}.done_entries
                                     UNION ALL SELECT unnest(job_ids) FROM {s}.done_receipts
                                     UNION ALL SELECT job_id FROM {s}.dlq_entries) t
                                     GROUP BY 1 HAVING count(*) > 1""").fetchall()
        assert not dups, dups


def test_storage_state_machine(pg_dsn):
    """25 random programs of up to 30 steps. Each example migrates a fresh schema (~0.6 s), so
    shrinking a failure takes minutes: it is off unless CHAOS_HYPOTHESIS_SHRINK=1 (a failure then
    prints the whole program; re-running replays it from the example database)."""
    StorageMachine.dsn = pg_dsn
    StorageMachine.pool = SchemaPool(pg_dsn)
    phases = list(Phase) if os.environ.get("CHAOS_HYPOTHESIS_SHRINK") else [Phase.explicit, Phase.reuse,
                                                                          Phase.generate]
    try:
        run_state_machine_as_test(StorageMachine, settings=settings(
            max_examples=25, stateful_step_count=30, deadline=None, phases=phases,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        StorageMachine.pool.close()
        StorageMachine.pool = None


# Regression test for a bug this state machine found (fixed in 49f8cf8): job_load matched an
# earlier attempt's receipt by job id alone and reported a re-queued job as 'running'.
@pytest.mark.parametrize("how", ["rescue", "retry_then_promote"])
def test_job_load_of_a_requeued_job_says_available(pg_dsn, how):
    schema = "hyp_" + uuid.uuid4().hex[:10]
    migrate(pg_dsn, schema, RingSizes(4, 4, 4))
    st_ = Storage(schema)
    try:
        with psycopg.connect(pg_dsn, autocommit=True, application_name="chaos:model") as c:
            use_raw_jsonb(c)
            job = Client(None, schema, default_queue=Q).enqueue(KIND, {}, queue=Q, conn=c)
            [snap] = st_.lane_claim(c, Q, 1)
            if how == "rescue":
                st_.queue_configure(c, Q, heartbeat_timeout=0)
                assert st_.receipt_rescue_stale(c, 10) == 1
            else:
                assert [r.status for r in st_.attempt_close(c, [(snap, CLOSE_RETRY, 0.0, "again")])] == ["ok"]
                c.execute(f'UPDATE "{schema}".deferred_jobs SET run_at = now()')
                assert st_.deferred_promote(c, 10) == 1
            assert st_.queue_counts_exact(c)[Q] == {"available": 1}
            assert st_.job_load(c, job)["state"] == "available"  # type: ignore[index]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
