"""Enqueue wakes claimers only when the lane had nothing left to claim."""

from __future__ import annotations

import psycopg

from awa_fast.client import Client


def _drain_notifies(listener: psycopg.Connection) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=0.2, stop_after=None)]


def test_notify_unless_the_lane_has_a_real_backlog(pg_dsn, schema, storage, conn) -> None:
    storage.queue_configure(conn, "nq", enqueue_shards=1)
    client = Client(pg_dsn, schema)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{storage.channel}"')
        client.enqueue("k", {"n": 1}, queue="nq")          # empty lane: wake claimers
        assert _drain_notifies(listener) == ["nq"]
        client.enqueue("k", {"n": 2}, queue="nq")          # small backlog (maybe a claim in flight): wake
        assert _drain_notifies(listener) == ["nq"]
        client.enqueue_many("k", [{"n": i} for i in range(100)], queue="nq")
        _drain_notifies(listener)
        client.enqueue("k", {"n": 3}, queue="nq")          # real backlog: claimers are coming anyway
        client.enqueue("k", {"n": 4}, queue="nq")
        assert _drain_notifies(listener) == []
        snaps = storage.lane_claim(conn, "nq", 1000)        # everything claimed (the cursor lags: receipts count)
        assert len(snaps) == 104
        client.enqueue("k", {"n": 5}, queue="nq")
        assert _drain_notifies(listener) == ["nq"]
        # A receipt covers part of a backlog: what it does not cover still counts.
        client.enqueue_many("k", [{"n": i} for i in range(200)], queue="nq")
        assert len(storage.lane_claim(conn, "nq", 100)) == 100  # the one left above, and 99 more
        _drain_notifies(listener)
        client.enqueue("k", {"n": 6}, queue="nq")          # 101 unclaimed past the receipt: no wake
        assert _drain_notifies(listener) == []
        assert len(storage.lane_claim(conn, "nq", 1000)) == 102
        client.enqueue("k", {"n": 7}, queue="nq")          # all covered again (the cursor lags): wake
        assert _drain_notifies(listener) == ["nq"]
    client.close()
