"""Transactional enqueue: rollback leaves nothing, lane ranges never become
visible out of order, and concurrent producers do not serialize on one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from awa_fast.client import Client
from tests.fixtures.database import connect
from tests.integration.storage_helpers import (
    claim,
    counts,
    enqueue,
    lock_waiters,
    nonzero,
    raw,
    row_counts,
    wait_blocked,
    warm_lanes,
)

Q = "q"


# ---------------------------------------------------------------------------
# rollback


def _rolled_back(pg_dsn, schema, storage, conn, action: Callable[[psycopg.Connection], object]) -> None:
    before = row_counts(conn, schema)
    listener = connect(pg_dsn, schema, tag="listener")
    try:
        listener.execute(f'LISTEN "{storage.channel}"')
        with connect(pg_dsn, schema, autocommit=False, tag="producer") as p:
            action(p)
            # inside the transaction the job is there ...
            assert nonzero(row_counts(p, schema)) != nonzero(before)
            p.rollback()
        # ... after the rollback nothing is left in any table or partition
        assert row_counts(conn, schema) == before
        assert storage.queue_counts_exact(conn).get(Q, {}) == {}
        assert claim(storage, conn, Q, 100) == []
        # and no wakeup was sent
        assert list(listener.notifies(timeout=0.05, stop_after=1)) == []
    finally:
        listener.close()


def test_rolled_back_single_enqueue_leaves_nothing(pg_dsn, schema, storage, conn):
    _rolled_back(pg_dsn, schema, storage, conn, lambda p: enqueue(schema, p, Q, {"a": 1}, metadata={"m": 1}))


def test_rolled_back_single_enqueue_on_a_known_queue_leaves_nothing(pg_dsn, schema, storage, conn):
    enqueue(schema, conn, Q, {"warm": 1})  # queue, lane and heads exist and are committed
    [snap] = claim(storage, conn, Q, 10)
    storage.receipt_complete(conn, [snap])
    before_counts = storage.queue_counts_exact(conn)
    before = row_counts(conn, schema)
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as p:
        for i in range(3):
            enqueue(schema, p, Q, {"i": i})
        p.rollback()
    assert row_counts(conn, schema) == before
    assert storage.queue_counts_exact(conn) == before_counts
    # the lane keeps working after the gap the rollback left in its sequence
    job = enqueue(schema, conn, Q, {"after": 1})
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == [job]


def test_rolled_back_enqueue_many_leaves_nothing(pg_dsn, schema, storage, conn):
    _rolled_back(pg_dsn, schema, storage, conn,
                 lambda p: storage.job_enqueue_many(p, Q, 2, "k", [raw({"i": i}) for i in range(50)], None, 5))


def test_rolled_back_copy_enqueue_after_other_work_leaves_nothing(pg_dsn, schema, storage, conn):
    cli = Client(None, schema)

    def action(p: psycopg.Connection) -> None:
        p.execute("SELECT 1")  # the caller's transaction is already open (its own writes would go here)
        cli.enqueue_many("k", [{"i": i} for i in range(1000)], queue=Q, conn=p, chunk=300)

    _rolled_back(pg_dsn, schema, storage, conn, action)


def test_rolled_back_copy_enqueue_as_first_statement_leaves_nothing(pg_dsn, schema, storage, conn):
    cli = Client(None, schema)
    _rolled_back(pg_dsn, schema, storage, conn,
                 lambda p: cli.enqueue_many("k", [{"i": i} for i in range(1000)], queue=Q, conn=p, chunk=300))


def test_rolled_back_copy_enqueue_inside_caller_transaction_block_leaves_nothing(pg_dsn, schema, storage, conn):
    cli = Client(None, schema)
    before = row_counts(conn, schema)
    with connect(pg_dsn, schema, tag="producer") as p:  # autocommit connection, explicit transaction block
        with pytest.raises(RuntimeError):
            with p.transaction():
                cli.enqueue_many("k", [{"i": i} for i in range(500)], queue=Q, conn=p)
                raise RuntimeError("the caller's own work failed")
    assert row_counts(conn, schema) == before
    assert claim(storage, conn, Q, 10) == []


def test_rolled_back_delayed_enqueue_leaves_nothing(pg_dsn, schema, storage, conn):
    _rolled_back(pg_dsn, schema, storage, conn, lambda p: enqueue(schema, p, Q, {"d": 1}, delay=60))


def test_committed_enqueue_kinds_are_all_visible(pg_dsn, schema, storage, conn):
    """Control for the rollback tests: the same actions, committed, are all there."""
    cli = Client(None, schema)
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as p:
        enqueue(schema, p, Q, {"a": 1})
        storage.job_enqueue_many(p, Q, 2, "k", [raw({"i": i}) for i in range(5)], None, 5)
        cli.enqueue_many("k", [{"i": i} for i in range(7)], queue=Q, conn=p)
        enqueue(schema, p, Q, {"d": 1}, delay=60)
        p.commit()
    assert counts(storage, conn, Q) == {"available": 13, "scheduled": 1}


# ---------------------------------------------------------------------------
# an uncommitted earlier enqueue is never skipped


def _start(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_one_shard_jobs_are_claimed_in_commit_order(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    warm_lanes(conn, schema, Q, 2, 1)
    with connect(pg_dsn, schema, autocommit=False, tag="p1") as p1, \
            connect(pg_dsn, schema, autocommit=False, tag="p2") as p2:
        a = enqueue(schema, p1, Q, {"who": "first"})
        t, out = _start(lambda: enqueue(schema, p2, Q, {"who": "second"}))
        wait_blocked(conn, p2.info.backend_pid, "advisory")
        assert claim(storage, conn, Q, 10) == []
        p1.commit()
        t.join(10)
        assert not t.is_alive()
        [b] = out
        assert isinstance(b, int), b
        p2.commit()
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == [a, b]
    assert snaps[0].lane_seq < snaps[1].lane_seq


def same_hint_pair(pg_dsn: str, schema: str, shards: int) -> list[psycopg.Connection]:
    """Two producer connections whose shard hint (backend pid % shards) is the same."""
    pool = [connect(pg_dsn, schema, autocommit=False, tag=f"p{i}") for i in range(shards + 1)]
    by_hint: dict[int, list[psycopg.Connection]] = {}
    for c in pool:
        by_hint.setdefault(c.info.backend_pid % shards, []).append(c)
    pair = next(v[:2] for v in by_hint.values() if len(v) >= 2)
    for c in pool:
        if c not in pair:
            c.close()
    return pair


def test_two_shards_second_producer_does_not_wait_and_first_is_not_skipped(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=2)
    warm_lanes(conn, schema, Q, 2, 2)
    # both producers start at the same shard: the second must move on to the other one
    p1, p2 = same_hint_pair(pg_dsn, schema, 2)
    with p1, p2:
        a = enqueue(schema, p1, Q, {"who": "first"})
        t, out = _start(lambda: enqueue(schema, p2, Q, {"who": "second"}))
        t.join(10)
        alive = t.is_alive()
        if alive:
            p1.rollback()
            t.join(10)
        assert not alive, "the second producer waited for the first"
        [b] = out
        assert isinstance(b, int), b
        p2.commit()
        snaps = claim(storage, conn, Q, 10)
        assert [s.job_id for s in snaps] == [b]  # claimed first
        p1.commit()
    snaps2 = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps2] == [a]  # the earlier one is still claimed after it commits
    assert snaps[0].lane_id != snaps2[0].lane_id
    assert storage.receipt_complete(conn, snaps + snaps2) == []
    assert counts(storage, conn, Q) == {"completed": 2}


# ---------------------------------------------------------------------------
# ten open producer transactions on one queue do not serialize


def serialized(observer: psycopg.Connection, pid: int) -> bool:
    """``pid`` waits for another transaction to end: a lane (advisory) lock or a row/unique (xid) lock.

    Short waits on relation-extension or buffer locks between concurrent inserters do not count.
    """
    return any(lt in ("advisory", "transactionid") for lt, _ in lock_waiters(observer, pid))


def _ten_producers(pg_dsn, schema, storage, conn, producers: list[psycopg.Connection]) -> None:
    threads = []
    outs = []
    try:
        for p in producers:
            t, out = _start(lambda p=p: enqueue(schema, p, Q, {"pid": p.info.backend_pid}))
            threads.append(t)
            outs.append(out)
        # done when all ten returned; fail fast as soon as one of them waits on a lock
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            if any(t.is_alive() and serialized(conn, p.info.backend_pid) for p, t in zip(producers, threads)):
                break
            time.sleep(0.005)
        stuck = [p.info.backend_pid for p, t in zip(producers, threads) if t.is_alive()]
        waits = {pid: lock_waiters(conn, pid) for pid in stuck}
        assert stuck == [], f"producers blocked while the others held open transactions: {waits}"
        assert all(len(o) == 1 and isinstance(o[0], int) for o in outs), outs
        # every one of them is still inside its open transaction
        for p in producers:
            assert p.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert claim(storage, conn, Q, 100) == []
        for p in producers:
            p.commit()
        snaps = claim(storage, conn, Q, 100)
        assert sorted(s.job_id for s in snaps) == sorted(o[0] for o in outs)  # type: ignore[type-var]
        assert len({s.lane_id for s in snaps}) == 10
    finally:
        # release blocked chains: roll back every producer whose call returned, until all returned
        released: set[int] = set()
        deadline = time.monotonic() + 20
        while len(released) < len(threads) and time.monotonic() < deadline:
            for i, (p, t) in enumerate(zip(producers, threads)):
                if i not in released and not t.is_alive():
                    p.rollback()
                    released.add(i)
            time.sleep(0.005)
        for p in producers:
            p.rollback()
            p.close()


def colliding_producers(pg_dsn: str, schema: str) -> list[psycopg.Connection]:
    """Ten producer connections with only five distinct shard hints (backend pid % 10), in pairs."""
    pool = [connect(pg_dsn, schema, autocommit=False, tag=f"p{i}") for i in range(30)]
    by_hint: dict[int, list[psycopg.Connection]] = {}
    for c in pool:
        by_hint.setdefault(c.info.backend_pid % 10, []).append(c)
    pairs = [v[:2] for v in by_hint.values() if len(v) >= 2][:5]
    producers = [c for pair in pairs for c in pair]
    assert len(producers) == 10
    for c in pool:
        if c not in producers:
            c.close()
    return producers


def test_ten_open_producers_do_not_serialize(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=10)
    warm_lanes(conn, schema, Q, 2, 10)
    # pairs of producers share a starting shard: each must find a free lane instead of waiting
    _ten_producers(pg_dsn, schema, storage, conn, colliding_producers(pg_dsn, schema))


def test_ten_open_producers_do_not_serialize_on_new_lanes(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=10)  # queue known, lanes not created yet
    _ten_producers(pg_dsn, schema, storage, conn, colliding_producers(pg_dsn, schema))


def _finishes_without_waiting(conn: psycopg.Connection, p: psycopg.Connection, t: threading.Thread) -> bool:
    """Wait until ``t`` returns (True) or its backend waits on a lock (False)."""
    deadline = time.monotonic() + 10
    while t.is_alive() and time.monotonic() < deadline:
        if serialized(conn, p.info.backend_pid):
            return False
        time.sleep(0.005)
    return not t.is_alive()


def test_two_open_producers_of_a_new_queue_do_not_serialize(schema, storage, conn, db_connect):
    p1 = db_connect("p1", autocommit=False)  # closed (rolled back) by the fixture
    p2 = db_connect("p2", autocommit=False)
    enqueue(schema, p1, "fresh", {"who": 1})
    t, out = _start(lambda: enqueue(schema, p2, "fresh", {"who": 2}))
    ok = _finishes_without_waiting(conn, p2, t)
    p1.rollback()
    t.join(10)
    assert ok, f"second producer waited: {out}"
