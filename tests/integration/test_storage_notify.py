"""Enqueue wakes claimers only when the lane had nothing left to claim."""

from __future__ import annotations

import psycopg

from awa_fast.client import Client


def _drain_notifies(listener: psycopg.Connection) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=0.2, stop_after=None)]


def test_notify_only_when_the_lane_was_empty(pg_dsn, schema, storage, conn) -> None:
    storage.queue_configure(conn, "nq", enqueue_shards=1)
    client = Client(pg_dsn, schema)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{storage.channel}"')
        client.enqueue("k", {"n": 1}, queue="nq")          # empty lane: wake claimers
        assert _drain_notifies(listener) == ["nq"]
        client.enqueue("k", {"n": 2}, queue="nq")          # backlog: claimers are coming anyway
        client.enqueue_many("k", [{"n": 3}, {"n": 4}], queue="nq")
        assert _drain_notifies(listener) == []
        snaps = storage.lane_claim(conn, "nq", 10)          # everything claimed (the cursor lags: receipts count)
        assert len(snaps) == 4
        client.enqueue("k", {"n": 5}, queue="nq")
        assert _drain_notifies(listener) == ["nq"]
    client.close()
