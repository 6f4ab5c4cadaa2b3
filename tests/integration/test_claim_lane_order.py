"""A claim orders a queue's lanes only when more than one has work past its receipts (0034).

A lane's claim cursor lags its last receipt by one claim, so the lanes a claim took from stay
candidates until the next claim passes them. When only one candidate has numbers past its
receipts, the claim takes the one-lane path: it starts the current ready slot's
``ready_segments`` child alone, not the oldest-head lookup over every child that orders
several lanes. These tests hold the lanes apart by priority (one lane per priority).
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from awa_fast.jobs import ClaimSnapshot
from awa_fast.limits import Rate
from awa_fast.storage import Storage
from tests.fixtures.database import connect, scalar, sqlx
from tests.integration.storage_helpers import enqueue, warm_lanes

pytestmark = pytest.mark.integration

Q = "lane_order"


def _candidates(conn: psycopg.Connection, schema: str) -> int:
    """Lanes of Q whose enqueue head is past their claim cursor: the claim's candidates."""
    return int(scalar(conn, schema, """
        SELECT count(*) FROM __SCHEMA__.queue_claim_heads h
        JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
        WHERE h.queue = %s AND pg_sequence_last_value(e.enqueue_seq) > pg_sequence_last_value(h.claim_seq)""",
        (Q,)))


def _segment_indexes_locked(conn: psycopg.Connection, schema: str) -> list[str]:
    """The ready_segments child indexes this session's open transaction holds a lock on."""
    return [str(r[0]) for r in sqlx(conn, schema, """
        SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
        WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND c.relkind = 'i'
          AND c.relnamespace = '__SCHEMA__'::regnamespace AND c.relname LIKE 'ready\\_segments\\_%%'
        ORDER BY 1""").fetchall()]


def _claims(storage: Storage, conn: psycopg.Connection,
            limited: bool) -> Callable[[int], tuple[list[ClaimSnapshot], bool]]:
    """Claims of Q on ``conn``, each returning (snapshots, more): the plain claim (claim_batch_v4),
    or a limited queue's (lane_claim_limited, which calls claim_batch_v3) under a rate far above
    what a test claims."""
    if not limited:
        return lambda limit: storage.lane_claim_result(conn, Q, limit)
    storage.queue_limits_set(conn, Q, max_rate=Rate(1000))
    return lambda limit: storage.lane_claim_limited_result(conn, Q, limit)


def _ids(result: tuple[list[ClaimSnapshot], bool]) -> list[int]:
    return [s.job_id for s in result[0]]


BOTH = pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])


@BOTH
def test_a_claim_with_one_lane_of_work_starts_one_segment_child(schema, storage, conn, limited):
    take = _claims(storage, conn, limited)
    lagging = [enqueue(schema, conn, Q, {"p": p}, priority=p) for p in (1, 2, 3)]
    assert sorted(_ids(take(10))) == sorted(lagging)
    # a round like the measured one, so the session has planned what it runs (planning a
    # generic plan opens every child's indexes; the measured claim must only run them)
    warm = enqueue(schema, conn, Q, {"warm": 1}, priority=2)
    assert _ids(take(1)) == [warm]
    job = enqueue(schema, conn, Q, {"measured": 1}, priority=3)
    assert _candidates(conn, schema) >= 2  # the several-lanes path's premise: lagging lanes beside the one with work
    conn.execute("BEGIN")
    try:
        got = take(1)  # inside the transaction, to read its locks before COMMIT
        locked = _segment_indexes_locked(conn, schema)
    finally:
        conn.execute("COMMIT")
    assert got == (got[0], False) and _ids(got) == [job]
    # before 0034: the ordering statement started every child's (lane_id, last_seq) index scan (4 here)
    assert len(locked) <= 1, locked


@BOTH
def test_the_one_lane_of_uncommitted_numbers_among_lagging_lanes_says_more(pg_dsn, schema, storage, conn,
                                                                          limited):
    """The one candidate with numbers past its receipts has none committed yet: the claim takes
    nothing and says more may come (the claimer claims again), and takes the rows once they commit.
    (Every shard's lane of priority 2 exists first: a producer creating a lane commits it with its
    rows, and always notifies.)"""
    take = _claims(storage, conn, limited)
    warm_lanes(conn, schema, Q, 2, 8)
    lagging = [enqueue(schema, conn, Q, {"p": p}, priority=p) for p in (1, 3)]
    assert sorted(_ids(take(10))) == sorted(lagging)
    enqueue(schema, conn, Q, {"p": 2}, priority=2)
    assert len(_ids(take(10))) == 1  # the priority-2 lane exists and lags too
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as producer:
        late = enqueue(schema, producer, Q, {"late": 1}, priority=2)
        assert _candidates(conn, schema) >= 3  # two or three lagging lanes, and the producer's
        assert take(10) == ([], True)
        producer.commit()
    got = take(10)
    assert (_ids(got), got[1]) == ([late], False)


@BOTH
def test_the_one_lane_of_work_held_by_another_claimer_says_more(pg_dsn, schema, storage, conn, limited):
    """Lagging lanes beside the one with work, whose claim head another claimer holds: nothing is
    taken, the claim says more, and the job is taken once the holder ends."""
    take = _claims(storage, conn, limited)
    lagging = [enqueue(schema, conn, Q, {"p": p}, priority=p) for p in (1, 2, 3)]
    assert sorted(_ids(take(10))) == sorted(lagging)
    job = enqueue(schema, conn, Q, {"held": 1}, priority=2)
    assert _candidates(conn, schema) >= 2
    with connect(pg_dsn, schema, autocommit=False, tag="holder") as holder:
        sqlx(holder, schema, "SELECT 1 FROM __SCHEMA__.queue_claim_heads WHERE queue = %s AND priority = 2 "
                             "FOR UPDATE", (Q,))
        assert take(10) == ([], True)
    got = take(10)
    assert (_ids(got), got[1]) == ([job], False)


@BOTH
def test_two_lanes_with_work_beside_lagging_ones_keep_priority_order(schema, storage, conn, limited):
    """The lanes are created lowest priority first, so lane order is not priority order."""
    take = _claims(storage, conn, limited)
    lagging = [enqueue(schema, conn, Q, {"p": p}, priority=p) for p in (3, 2, 1)]
    assert sorted(_ids(take(10))) == sorted(lagging)
    low = enqueue(schema, conn, Q, {"low": 1}, priority=3)
    high = enqueue(schema, conn, Q, {"high": 1}, priority=1)
    assert _ids(take(1)) == [high]
    assert _ids(take(1)) == [low]
    # every lane lags behind its receipts now: nothing to take, and no marker
    assert _candidates(conn, schema) >= 2
    assert take(10) == ([], False)
