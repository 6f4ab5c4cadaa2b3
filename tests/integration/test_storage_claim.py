"""Claim path: exactly-once claims under concurrency, cursor recovery, no skipped work.

Invariants guarded (DESIGN.md section 2):
- every committed job is claimed exactly once by concurrent claimers;
- the claim cursor moves only after the claim commits, or across committed
  spent evidence: a lost advance is recovered by the next claim, never by
  double-issuing, and a rolled-back claim never makes it skip work.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from awa_fast.client import PRIORITY_DEFAULT, Client
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage import Storage
from tests.fixtures.database import connect, repeatable_read_dsn, sqlx
from tests.integration.storage_helpers import (
    DONE_ALL,
    claim,
    claim_seq_value,
    complete,
    counts,
    enqueue,
    ring_current,
    warm_lanes,
)

Q = "q"


def test_eight_concurrent_claimers_claim_every_job_exactly_once(pg_dsn, schema, storage, conn):
    total = 50_000
    cli = Client(None, schema)
    # five producer transactions (COPY), so the jobs spread over a few lanes
    for p in range(5):
        with connect(pg_dsn, schema, tag=f"producer{p}") as pc:
            assert cli.enqueue_many("bulk.job", ({"n": p * 10_000 + i} for i in range(10_000)), queue=Q,
                                    conn=pc) == 10_000
    assert counts(storage, conn, Q) == {"available": total}

    claimed: list[list[ClaimSnapshot]] = [[] for _ in range(8)]
    stale: list[list[tuple[int, int]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    done = threading.Event()
    lock = threading.Lock()
    progress = [0]
    deadline = time.monotonic() + 120

    def claimer(k: int) -> None:
        try:
            with connect(pg_dsn, schema, tag=f"claimer{k}") as c:
                st = Storage(schema)
                n = 0
                while not done.is_set() and time.monotonic() < deadline:
                    snaps = st.lane_claim(c, Q, 250, k, 8)  # autocommit: the claim commits at once
                    if not snaps:
                        with lock:
                            if progress[0] >= total:
                                done.set()
                        continue
                    claimed[k].extend(snaps)
                    n += 1
                    # complete in a transaction: every other batch as whole receipts (compact closure)
                    with c.transaction():
                        whole = {(s.claim_slot, s.claim_id) for s in snaps} if n % 2 else ()
                        stale[k].extend(st.receipt_complete(c, snaps, whole))
                    with lock:
                        progress[0] += len(snaps)
                        if progress[0] >= total:
                            done.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(s == [] for s in stale)
    ids = [s.job_id for per in claimed for s in per]
    assert len(ids) == total, f"claimed {len(ids)} attempts"
    assert len(set(ids)) == total, "a job was claimed twice"
    assert all(s.run_lease == 1 and s.attempt == 1 for per in claimed for s in per)
    assert sum(1 for per in claimed if per) >= 2, "claims were not spread over claimers"
    # each claimer saw its lanes in lane order
    for per in claimed:
        by_lane: dict[int, list[int]] = {}
        for s in per:
            by_lane.setdefault(s.lane_id, []).append(s.lane_seq)
        assert all(seqs == sorted(seqs) for seqs in by_lane.values())
    assert storage.queue_counts_exact(conn) == {Q: {"completed": total}}
    row = sqlx(conn, schema, f"SELECT count(*), count(DISTINCT job_id) FROM {DONE_ALL}").fetchone()
    assert row == (total, total)
    assert claim(storage, conn, Q, 100) == []


def test_lost_cursor_advance_is_recovered_without_double_claim(pg_dsn, schema, storage, conn):
    Client(None, schema).enqueue_many("k", [{"i": i} for i in range(12)], queue=Q, conn=conn)
    first = claim(storage, conn, Q, 4)
    second = claim(storage, conn, Q, 3)
    assert [s.lane_seq for s in first + second] == list(range(1, 8))
    lane = first[0].lane_id
    # the second claim moved the cursor across the first (committed) receipt
    assert claim_seq_value(conn, schema, lane) == 4
    # a lost advance: the cursor falls back to before both receipts
    sqlx(conn, schema, "SELECT setval(claim_seq, 0, true) FROM __SCHEMA__.queue_claim_heads WHERE lane_id = %s",
         (lane,))
    assert claim_seq_value(conn, schema, lane) == 0
    # cancel recovers the cursor too: a claimed job is flagged, not tombstoned as if unclaimed
    assert storage.job_cancel(conn, first[0].job_id) == "cancel_requested"
    assert claim_seq_value(conn, schema, lane) == 7
    sqlx(conn, schema, "SELECT setval(claim_seq, 0, true) FROM __SCHEMA__.queue_claim_heads WHERE lane_id = %s",
         (lane,))
    third = claim(storage, conn, Q, 3)
    assert [s.lane_seq for s in third] == [8, 9, 10]
    assert claim_seq_value(conn, schema, lane) == 7  # recovered from the committed receipts

    # again, with the receipts in a sealed (rotated, not pruned) claim slot
    assert storage.ring_rotate(conn, "claim") == 1
    sqlx(conn, schema, "SELECT setval(claim_seq, 2, true) FROM __SCHEMA__.queue_claim_heads WHERE lane_id = %s",
         (lane,))
    rest = claim(storage, conn, Q, 100)
    assert [s.lane_seq for s in rest] == [11, 12]
    assert rest[0].claim_slot == 1
    seen = [s.job_id for s in first + second + third + rest]
    assert len(seen) == len(set(seen)) == 12
    assert counts(storage, conn, Q) == {"running": 12}
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_tombstones").fetchone() == (0,)
    assert complete(storage, conn, first + second + third + rest) == []
    assert counts(storage, conn, Q) == {"completed": 12}
    assert claim(storage, conn, Q, 100) == []


def test_rolled_back_claim_skips_nothing(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(5)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        got = storage.lane_claim(c, Q, 3)
        assert [s.job_id for s in got] == jobs[:3]
        c.rollback()
    assert counts(storage, conn, Q) == {"available": 5}
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == jobs
    assert all(s.run_lease == 1 for s in snaps)


def test_claim_skips_a_lane_held_by_another_claimer(pg_dsn, schema, storage, conn):
    enqueue(schema, conn, Q, {"i": 0})
    with connect(pg_dsn, schema, autocommit=False, tag="holder") as holder:
        [held] = storage.lane_claim(holder, Q, 1)
        enqueue(schema, conn, Q, {"i": 1})  # same or another lane; the held one is skipped, not waited on
        t0 = time.monotonic()
        other = claim(storage, conn, Q, 10)
        assert time.monotonic() - t0 < 2.0
        assert held.job_id not in [s.job_id for s in other]
        holder.commit()
    rest = claim(storage, conn, Q, 10)
    ids = [s.job_id for s in other + rest] + [held.job_id]
    assert len(ids) == len(set(ids)) == 2


def test_two_claims_in_one_rolled_back_transaction_lose_nothing(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        a = storage.lane_claim(c, Q, 1)
        b = storage.lane_claim(c, Q, 1)
        assert [s.job_id for s in a + b] == jobs[:2]
        c.rollback()
    # nothing was claimed: every job must still be claimable, in order
    assert counts(storage, conn, Q) == {"available": 4}
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == jobs


@pytest.mark.parametrize("first", ["released", "open", "nested"])
def test_claims_in_savepoints_of_a_rolled_back_transaction_lose_nothing(pg_dsn, schema, storage, conn, first):
    """A receipt written inside a savepoint belongs to a subtransaction (its own xmin): still this
    transaction's, never committed evidence that may move the cursor past it (migration 0028)."""
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        c.execute("SAVEPOINT first_claim")
        a = storage.lane_claim(c, Q, 1)
        if first == "released":
            c.execute("RELEASE SAVEPOINT first_claim")
        elif first == "nested":
            c.execute("SAVEPOINT second_claim")  # the first receipt's savepoint is open, a deeper one active
        b = storage.lane_claim(c, Q, 1)
        assert [s.job_id for s in a + b] == jobs[:2]
        c.rollback()
    assert counts(storage, conn, Q) == {"available": 4}
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == jobs


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_claim_or_cancel_at_another_isolation_level_is_refused(pg_dsn, schema, storage, conn, level):
    """At these levels a claim reads the receipts of a snapshot older than its lock on the lane: a receipt
    committed in between is invisible, and the claim issued its jobs again (migration 0028 refuses it)."""
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        c.execute("SELECT 1")  # the snapshot is taken here
        first = claim(storage, conn, Q, 1)  # another claimer commits a receipt afterwards
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="need READ COMMITTED isolation") as e:
            storage.lane_claim(c, Q, 1)
        assert e.value.diag.message_hint is not None and "read committed" in e.value.diag.message_hint
        c.rollback()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            storage.job_cancel(c, jobs[1])
        c.rollback()
    assert [s.job_id for s in first + claim(storage, conn, Q, 10)] == jobs  # each job issued once


def test_a_cancel_on_its_own_runs_read_committed_whatever_the_sessions_default(pg_dsn, schema, storage, conn):
    """Storage.job_cancel (App.cancel, the CLI, the dashboard) on an idle autocommit connection is its own
    READ COMMITTED transaction, so a session whose default is REPEATABLE READ can still cancel."""
    import asyncio

    rr_dsn = repeatable_read_dsn(pg_dsn)
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    with psycopg.connect(rr_dsn, autocommit=True) as c:
        assert storage.job_cancel(c, jobs[0]) == "cancelled"
        assert c.execute("SHOW transaction_isolation").fetchone() == ("repeatable read",)  # the session's own

    async def cancel_async() -> str:
        async with await psycopg.AsyncConnection.connect(rr_dsn, autocommit=True) as ac:
            return await storage.job_cancel_async(ac, jobs[1])

    assert asyncio.run(cancel_async()) == "cancelled"
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == jobs[2:]


def test_setting_read_committed_leaves_a_session_with_that_default_untouched(pg_dsn, schema, storage):
    """Where read committed is the default already nothing is set, so nothing stays on a server connection
    a transaction pooler hands to another client next (docs/security.md); elsewhere the session's own."""
    rr_dsn = repeatable_read_dsn(pg_dsn)
    source = "SELECT source FROM pg_settings WHERE name = 'default_transaction_isolation'"
    with psycopg.connect(pg_dsn, autocommit=True) as plain, psycopg.connect(rr_dsn, autocommit=True) as rr:
        for c in (plain, rr):
            storage.session_read_committed(c)
        assert plain.execute(source).fetchone() == ("default",)
        assert rr.execute(source).fetchone() == ("session",)
        assert rr.execute("SHOW transaction_isolation").fetchone() == ("read committed",)


def test_runtime_sessions_run_read_committed_whatever_the_servers_default(pg_dsn, schema, storage, conn):
    """A server or role whose default is REPEATABLE READ: the runtime's sessions set their own, so claims,
    completions and prune work there (the claim refuses other levels, migration 0028)."""
    from awa_fast.runtime.claimer import Claimer, ClaimerConfig
    from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig

    rr_dsn = repeatable_read_dsn(pg_dsn)
    with psycopg.connect(rr_dsn) as probe:
        assert probe.execute("SHOW transaction_isolation").fetchone() == ("repeatable read",)
    claimer = Claimer(ClaimerConfig(rr_dsn, schema, Q), {}, watch_parent=False)
    maintenance = Maintenance(MaintenanceConfig(rr_dsn, schema))
    try:
        assert claimer.heartbeat._send([], []) == []  # opens the heartbeat's connection
        assert maintenance.try_lead()
        sessions = {"claim": claimer._claim_connection(), "batcher": claimer.batcher._connection(),
                    "heartbeat": claimer.heartbeat._conn, "maintenance": maintenance._conn}
        assert {name: c.execute("SHOW transaction_isolation").fetchone() for name, c in sessions.items()} == {
            name: ("read committed",) for name in sessions}
        job = enqueue(schema, conn, Q)
        snaps, _ = storage.lane_claim_result(sessions["claim"], Q, 8)
        assert [s.job_id for s in snaps] == [job]
    finally:
        for c in (claimer._claim_conn, claimer.batcher._conn, claimer.heartbeat._conn, maintenance._conn):
            if c is not None:
                c.close()


@pytest.mark.parametrize("other", ["older", "newer"])
def test_a_writing_transaction_moves_the_cursor_across_other_transactions_receipts(pg_dsn, schema, storage, conn,
                                                                                    other):
    """A claim inside a transaction that already has an id still takes another transaction's committed
    receipt as evidence, whether that transaction's id is older or newer than its own (0028)."""
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        if other == "older":
            first = claim(storage, conn, Q, 1)  # committed, by a transaction older than c's
            c.execute("SELECT pg_current_xact_id()")  # c now has an id
        else:
            c.execute("SELECT pg_current_xact_id()")
            first = claim(storage, conn, Q, 1)  # committed, by a transaction newer than c's
        lane = first[0].lane_id
        assert claim_seq_value(conn, schema, lane) == 0  # the cursor lags its last receipt by one claim
        mine = storage.lane_claim(c, Q, 1)
        assert claim_seq_value(conn, schema, lane) == first[0].lane_seq  # moved across the committed receipt
        assert [s.job_id for s in first + mine] == jobs[:2]
        c.rollback()
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == jobs[1:]


def test_claim_in_a_transaction_counts_after_commit(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as c:
        got = storage.lane_claim(c, Q, 2)
        assert counts(storage, conn, Q) == {"available": 3}  # not committed yet
        c.commit()
    assert [s.job_id for s in got] == jobs[:2]
    assert counts(storage, conn, Q) == {"available": 1, "running": 2}
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == jobs[2:]


def test_claims_across_ready_slots_keep_lane_order(pg_dsn, schema, storage, conn):
    a = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    assert storage.ring_rotate(conn, "ready") == 1
    b = [enqueue(schema, conn, Q, {"i": i}) for i in range(3, 6)]
    assert ring_current(storage, conn, "ready") == 1
    snaps = claim(storage, conn, Q, 4)
    assert [s.job_id for s in snaps] == a + b[:1]
    assert [s.ready_slot for s in snaps] == [0, 0, 0, 1]
    snaps2 = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps2] == b[1:]
    assert complete(storage, conn, snaps + snaps2) == []
    assert counts(storage, conn, Q) == {"completed": 6}


def test_claims_cross_a_rolled_back_reservation_and_a_ready_rotation(pg_dsn, schema, storage, conn):
    """Lane order holds across a gap a rolled-back enqueue left and a ready rotation.

    Rows of the older slot come first; the current slot's first segment
    starts after a gap in the lane sequence, which the cursor crosses.
    """
    storage.queue_configure(conn, Q, enqueue_shards=1)
    a = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    with connect(pg_dsn, schema, autocommit=False, tag="rollback") as c:
        enqueue(schema, c, Q, {"i": "gone"})
        c.rollback()
    assert storage.ring_rotate(conn, "ready") == 1
    with connect(pg_dsn, schema, autocommit=False, tag="rollback") as c:
        enqueue(schema, c, Q, {"i": "gone too"})
        c.rollback()
    b = [enqueue(schema, conn, Q, {"i": i}) for i in range(3, 9)]
    assert [s.job_id for s in claim(storage, conn, Q, 2)] == a[:2]
    snaps = claim(storage, conn, Q, 3)
    assert [s.job_id for s in snaps] == a[2:] + b[:2]
    assert [s.ready_slot for s in snaps] == [0, 1, 1]
    assert [s.job_id for s in claim(storage, conn, Q, 2)] == b[2:4]   # mid-segment, current slot
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == b[4:]
    assert claim(storage, conn, Q, 10) == []


# -- the backlog marker of claim_batch_v2 (Storage.lane_claim_result) --------------------------


def test_drained_claim_has_no_backlog_marker(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    snaps, more = storage.lane_claim_result(conn, Q, 10)
    assert [s.job_id for s in snaps] == jobs
    assert more is False
    assert storage.lane_claim_result(conn, Q, 10) == ([], False)


def test_full_claim_has_no_backlog_marker(pg_dsn, schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    snaps, more = storage.lane_claim_result(conn, Q, 2)
    assert ([s.job_id for s in snaps], more) == (jobs[:2], False)


def test_short_claim_behind_a_busy_lane_says_more(pg_dsn, schema, storage, conn):
    job = enqueue(schema, conn, Q, {"i": 0})
    with connect(pg_dsn, schema, autocommit=False, tag="holder") as holder:
        # the holder's claim is short too, so it keeps the lane head locked with nothing taken
        enqueue(schema, conn, Q, {"i": 1})
        sqlx(holder, schema, "SELECT 1 FROM __SCHEMA__.queue_claim_heads WHERE queue = %s FOR UPDATE", (Q,))
        snaps, more = storage.lane_claim_result(conn, Q, 10)
        assert (snaps, more) == ([], True)
    snaps, more = storage.lane_claim_result(conn, Q, 10)
    assert job in [s.job_id for s in snaps] and more is False


def test_short_claim_past_a_producer_still_committing_says_more(pg_dsn, schema, storage, conn):
    """A producer reserved lane numbers the claim cannot see yet: the claimer must not go to sleep.

    (A producer that creates a new lane always notifies: its backlog is 0.)
    """
    warm_lanes(conn, schema, Q, PRIORITY_DEFAULT, 8)
    first = enqueue(schema, conn, Q, {"i": 0})
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as producer:
        late = enqueue(schema, producer, Q, {"i": 1})
        snaps, more = storage.lane_claim_result(conn, Q, 10)
        assert ([s.job_id for s in snaps], more) == ([first], True)
        producer.commit()
    snaps, more = storage.lane_claim_result(conn, Q, 10)
    assert ([s.job_id for s in snaps], more) == ([late], False)


def test_backlog_marker_never_reaches_lane_claim(pg_dsn, schema, storage, conn):
    warm_lanes(conn, schema, Q, PRIORITY_DEFAULT, 8)
    enqueue(schema, conn, Q, {"i": 0})
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as producer:
        enqueue(schema, producer, Q, {"i": 1})
        snaps = storage.lane_claim(conn, Q, 10)
        assert len(snaps) == 1 and all(isinstance(s, ClaimSnapshot) and s.job_id for s in snaps)
        producer.rollback()


def test_lanes_behind_their_own_receipts_raise_no_backlog_marker(pg_dsn, schema, storage, conn):
    """Two lanes whose claim cursors still lag their last receipts: drained, so no marker."""
    jobs = [enqueue(schema, conn, Q, {"i": 0}, priority=1), enqueue(schema, conn, Q, {"i": 1}, priority=3)]
    snaps, more = storage.lane_claim_result(conn, Q, 10)
    assert (sorted(s.job_id for s in snaps), more) == (sorted(jobs), False)
    # both lanes are still candidates by their sequences (the cursor lags one claim)
    assert storage.lane_claim_result(conn, Q, 10) == ([], False)
    late = enqueue(schema, conn, Q, {"i": 2}, priority=3)
    snaps, more = storage.lane_claim_result(conn, Q, 10)
    assert ([s.job_id for s in snaps], more) == ([late], False)


def test_receipt_arrays_are_stored_out_of_line_uncompressed(schema, conn):
    """Migration 0003: compressing ~20 kB of receipt arrays per 1024-job claim cost half the claim."""
    rows = sqlx(conn, schema, """
        SELECT c.relname, a.attname, a.attstorage FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname IN ('job_ids', 'run_leases', 'lane_seqs')
        WHERE i.inhparent = '__SCHEMA__.lease_claims'::regclass""").fetchall()
    assert len(rows) == 3 * len({r[0] for r in rows}) >= 3 * 2
    assert {r[2] for r in rows} == {"e"}, rows
