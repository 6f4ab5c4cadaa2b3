"""The single enqueue (job_enqueue_v2 of migration 0014, job_enqueue_v3 of 0025): one SQL function
frame on a warm lane, and the same lane protocol as job_enqueue and job_enqueue_v2, which previous
runtimes still call during a rolling upgrade."""

from __future__ import annotations

import threading

import psycopg
import pytest

from tests.fixtures.database import connect, sqlx
from tests.integration.storage_helpers import claim, enqueue, function_calls, wait_blocked, warm_lanes

Q = "q"


def _frames(p: psycopg.Connection, schema: str) -> dict[str, int]:
    """Calls per function of ``schema`` that ``p``'s backend has not yet flushed to the shared stats.

    With track_functions = all; the counts may span earlier transactions of the backend, so
    callers compare two readings (:func:`_calls_between`).
    """
    return function_calls(p, schema)


def _calls_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_warm_lane_enqueue_runs_one_function_frame(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as p:
        p.execute("SET track_functions = 'all'")
        before = _frames(p, schema)
        first = enqueue(schema, p, Q, {"n": 1})
        # a new lane: the shard search and lane creation of version 1 run once
        assert _calls_between(before, _frames(p, schema)).get("lane_lock_for_enqueue") == 1
        p.commit()
        before = _frames(p, schema)
        second = enqueue(schema, p, Q, {"n": 2})
        # the lane exists and is free: no nested function call at all
        assert _calls_between(before, _frames(p, schema)) == {"job_enqueue_v3": 1}
        p.commit()
    assert [s.job_id for s in claim(storage, conn, Q, 10)] == [first, second]


def _enqueue_previous(schema: str, p: psycopg.Connection, fn: str, n: int) -> int:
    """A previous runtime's single enqueue: the SQL function ``fn`` (job_enqueue, job_enqueue_v2), unchanged."""
    row = sqlx(p, schema, f"SELECT __SCHEMA__.{fn}(%s, 2, 'k', %s::jsonb, NULL, 5, NULL)",
               (Q, f'{{"n": {n}}}')).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("previous", ["job_enqueue", "job_enqueue_v2"])
@pytest.mark.parametrize("first_version", ["previous", "new"])
def test_previous_and_new_enqueue_exclude_each_other_and_keep_commit_order(pg_dsn, schema, storage, conn,
                                                                        first_version, previous):
    storage.queue_configure(conn, Q, enqueue_shards=1)
    warm_lanes(conn, schema, Q, 2, 1)
    def old(p, n):  # noqa: ANN001, ANN202
        return _enqueue_previous(schema, p, previous, n)

    def new(p, n):  # noqa: ANN001, ANN202
        return enqueue(schema, p, Q, {"n": n})

    one, two = (old, new) if first_version == "previous" else (new, old)
    with connect(pg_dsn, schema, autocommit=False, tag="p1") as p1, \
            connect(pg_dsn, schema, autocommit=False, tag="p2") as p2:
        a = one(p1, 1)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(two(p2, 2)), daemon=True)
        t.start()
        # the second producer waits for the lane the first holds, whichever function each calls
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
    assert snaps[0].lane_id == snaps[1].lane_id and snaps[0].lane_seq + 1 == snaps[1].lane_seq
