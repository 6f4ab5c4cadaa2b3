"""A limited queue's claim reads a bounded part of the lease ring, however many callbacks wait (migration 0035).

``lane_claim_limited`` counts a queue's attempts parked for a callback (its ``leases`` rows) as
running. Before 0035 it counted them with ``count(*)`` over every lease of every queue: each claim
of a queue with ``max_running`` read the whole lease ring. These tests park many callbacks and count
the buffers one limited claim fetches from the lease ring's children and their indexes.
"""

from __future__ import annotations

import psycopg
import pytest

from awa_fast.client import Client
from tests.fixtures.database import sqlx
from tests.integration.storage_helpers import counted, ring_child_blocks

pytestmark = pytest.mark.integration

Q = "limited"
OTHER = "callbacks"
PARKED_ELSEWHERE = 6_000  # ~130 heap pages of leases: a whole read is far above BOUND
BOUND = 24  # per claim: an index probe per lease slot (4) and a few rows of the queue's own


def _park(storage, conn: psycopg.Connection, queue: str, n: int) -> list:  # noqa: ANN001
    """Claim n jobs of ``queue`` and park each for a callback (one transaction); their tokens."""
    tokens = []
    with conn.transaction():
        while len(tokens) < n:
            snaps, _ = storage.lane_claim_result(conn, queue, min(1024, n - len(tokens)))
            assert snaps, f"{queue} ran out of jobs"
            for snap in snaps:
                token = storage.attempt_register_callback(conn, snap, 3600.0)
                assert token is not None
                tokens.append(token)
    return tokens


def _limited_claim(storage, conn, schema, n):  # noqa: ANN001, ANN202
    (got, more), fetched = counted(conn, lambda c: ring_child_blocks(c, schema, '^leases_[0-9]+$'),
                                   lambda: storage.lane_claim_limited_result(conn, Q, n, 0, 1))
    return got, more, sum(fetched.values())


@pytest.fixture
def parked(pg_dsn, schema, storage, conn) -> None:  # noqa: ANN001
    """PARKED_ELSEWHERE callbacks waiting on another queue, analyzed as autovacuum would."""
    client = Client(pg_dsn, schema)
    client.enqueue_many("k", ({"i": i} for i in range(PARKED_ELSEWHERE)), queue=OTHER)
    client.enqueue_many("k", ({"i": i} for i in range(200)), queue=Q)
    client.close()
    _park(storage, conn, OTHER, PARKED_ELSEWHERE)
    sqlx(conn, schema, "ANALYZE __SCHEMA__.leases")


def test_a_limited_claim_does_not_read_other_queues_callbacks(schema, storage, conn, parked):
    storage.queue_limits_set(conn, Q, max_running=50)
    fetched = []
    for _ in range(6):  # the custom plans, then the session's generic plan
        got, _, n = _limited_claim(storage, conn, schema, 4)
        assert len(got) == 4
        storage.receipt_complete_rows(conn, got)
        fetched.append(n)
    assert max(fetched) <= BOUND, fetched


def test_own_parked_callbacks_fill_the_room_and_are_read_only_up_to_it(schema, storage, conn, parked):
    # More parked than the limit allows: parked while the queue had no limit, then the limit came.
    tokens = _park(storage, conn, Q, 40)
    storage.queue_limits_set(conn, Q, max_running=3)
    fetched = []
    for _ in range(4):
        got, more, n = _limited_claim(storage, conn, schema, 10)
        assert (got, more) == ([], True), "parked callbacks take the queue's room"
        fetched.append(n)
    assert max(fetched) <= BOUND, fetched
    assert storage.queue_limit_status(conn)[Q]["running"] == 40, "status counts every parked callback"
    # Resolving all but one frees two slots: the count is still exact where it decides.
    for token in tokens[1:]:
        assert storage.callback_resolve(conn, token, "complete") == "ok"
    got, _, _ = _limited_claim(storage, conn, schema, 10)
    assert len(got) == 2
    assert storage.queue_limit_status(conn)[Q]["running"] == 3
