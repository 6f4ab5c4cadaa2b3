"""The plain claim on a claimer's own connection runs through libpq itself (``Storage.lane_claim_result``).

On a ``PoolConnection`` in autocommit with no transaction open (the claimer's
claim connection) the claim is one statement prepared once per session, its
parameters encoded in binary, its binary rows loaded by a Transformer the
connection keeps: no psycopg cursor per claim (~55 µs less client CPU per
one-job claim, ``perf/quiet_calls.py``). These tests hold it to the cursor
path's contract: the same snapshots, the same backlog marker, a session that
lost its statement prepares it again, and a connection inside a transaction
keeps the cursor path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import psycopg
import pytest

from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.connection import PoolConnection
from tests.fixtures.database import sqlx
from tests.integration import storage_helpers as sh

pytestmark = pytest.mark.integration

# what differs between two jobs enqueued alike: where and when they live
IDENTITY = {"job_id", "queue", "ready_slot", "lane_id", "lane_seq", "claim_slot", "claim_id", "created_at"}


def _claim_session(dsn: str, storage: Storage, cls: type[psycopg.Connection[Any]]) -> psycopg.Connection[Any]:
    """A claim connection set up as the claimer sets up its own."""
    c = cls.connect(dsn, autocommit=True)
    use_raw_jsonb(c)
    storage.session_utc(c)
    storage.session_read_committed(c)
    return c


@pytest.fixture
def direct(pg_dsn: str, storage: Storage) -> Iterator[psycopg.Connection[Any]]:
    with _claim_session(pg_dsn, storage, PoolConnection) as c:
        yield c


@pytest.fixture
def plain(pg_dsn: str, storage: Storage) -> Iterator[psycopg.Connection[Any]]:
    with _claim_session(pg_dsn, storage, psycopg.Connection) as c:
        yield c


def _prepared(conn: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'awa_fast_%'")]


def _enqueue_alike(schema: str, conn: psycopg.Connection[Any], queue: str) -> list[int]:
    return [sh.enqueue(schema, conn, queue, {"n": n, "s": "é\u2603", "nested": [1, {"x": None}]},
                       priority=p, max_attempts=m, metadata={"m": n})
            for n, p, m in ((1, 2, 25), (2, 2, 3), (3, 1, 7))]


def test_the_direct_claim_returns_what_the_cursor_path_returns(schema, storage, conn, direct, plain):
    by_cursor = _enqueue_alike(schema, conn, "via-cursor")
    by_direct = _enqueue_alike(schema, conn, "via-direct")
    want, busy_c = storage.lane_claim_result(plain, "via-cursor", 10)
    got, busy_d = storage.lane_claim_result(direct, "via-direct", 10)
    assert _prepared(direct) and not _prepared(plain)  # the direct path ran, and only there
    assert busy_c is busy_d is False
    assert sorted(s.job_id for s in want) == sorted(by_cursor)
    assert sorted(s.job_id for s in got) == sorted(by_direct)
    assert {s.queue for s in got} == {"via-direct"}
    for w, g in zip(want, got, strict=True):
        dw, dg = msgspec.structs.asdict(w), msgspec.structs.asdict(g)
        assert {k: v for k, v in dg.items() if k not in IDENTITY} == \
               {k: v for k, v in dw.items() if k not in IDENTITY}
        assert g.created_at.utcoffset() is not None and type(g.created_at) is type(w.created_at)
        assert isinstance(g.args, type(w.args))  # raw JSON, cut by the codec, as on the cursor path
    # the per-receipt columns are carried to every snapshot of a receipt (one per lane: two priorities)
    assert len({(s.claim_slot, s.claim_id, s.ready_slot, s.lane_id) for s in got}) == 2
    assert all(None not in (s.claim_slot, s.claim_id, s.ready_slot, s.lane_id, s.priority) for s in got)
    assert sh.complete(storage, conn, got) == []


def test_the_backlog_marker_comes_back_as_on_the_cursor_path(pg_dsn, schema, storage, conn, direct, plain):
    with psycopg.connect(pg_dsn, autocommit=True) as producer:
        sh.enqueue(schema, producer, "busy")  # committed: the producer's lane exists
        with producer.transaction():  # a number reserved in that lane, not committed: no claim can see it
            sh.enqueue(schema, producer, "busy")
            snaps, busy = storage.lane_claim_result(direct, "busy", 10)
            assert len(snaps) == 1 and busy is True
            assert storage.lane_claim_result(plain, "busy", 10) == ([], True)
    snaps2, busy2 = storage.lane_claim_result(direct, "busy", 10)
    assert len(snaps2) == 1 and busy2 is False


@pytest.mark.parametrize("forget", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_a_session_that_lost_the_claim_statement_prepares_it_again(schema, storage, conn, direct, forget):
    sh.enqueue(schema, conn, "again")
    assert len(storage.lane_claim(direct, "again", 1)) == 1
    direct.execute(forget)
    if forget == "DISCARD ALL":  # it also resets the session's settings: the claimer's again
        storage.session_utc(direct)
        storage.session_read_committed(direct)
    assert _prepared(direct) == []
    sh.enqueue(schema, conn, "again")
    assert len(storage.lane_claim(direct, "again", 1)) == 1
    assert len(_prepared(direct)) == 1


def test_a_connection_inside_a_transaction_keeps_the_cursor_path(pg_dsn, schema, storage, conn):
    sh.enqueue(schema, conn, "tx")
    with _claim_session(pg_dsn, storage, PoolConnection) as c:
        c.autocommit = False
        snaps = storage.lane_claim(c, "tx", 5)
        assert len(snaps) == 1 and _prepared(c) == []
        c.rollback()  # the claim is undone with its transaction
        c.autocommit = True
        assert [s.job_id for s in storage.lane_claim(c, "tx", 5)] == [snaps[0].job_id]


def test_a_server_error_raises_the_psycopg_class_and_the_connection_stays_usable(schema, storage, conn, direct):
    fn = "__SCHEMA__.claim_batch_v4(text, int, int, int)"
    original = sqlx(conn, schema, f"SELECT pg_get_functiondef('{fn}'::regprocedure)").fetchone()[0]
    sh.enqueue(schema, conn, "ok")
    # the same function, refusing every call before it writes anything
    conn.execute(original.replace("\nBEGIN\n", "\nBEGIN\n    RAISE EXCEPTION 'refused for the test' "
                                                "USING ERRCODE = '40001';\n", 1))
    try:
        with pytest.raises(psycopg.errors.SerializationFailure, match="refused for the test"):
            storage.lane_claim(direct, "ok", 1)
    finally:
        conn.execute(original)
    assert direct.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert len(storage.lane_claim(direct, "ok", 1)) == 1  # the same session, still usable


def test_the_limited_and_keyed_claims_take_the_same_path(pg_dsn, schema, storage, conn, direct, plain):
    # a limited queue: at most 2 running, so 2 of 3 jobs come back on either path, with the marker
    storage.queue_limits_set(conn, "lim-c", max_running=2)
    storage.queue_limits_set(conn, "lim-d", max_running=2)
    _enqueue_alike(schema, conn, "lim-c")
    _enqueue_alike(schema, conn, "lim-d")
    want, more_c = storage.lane_claim_limited_result(plain, "lim-c", 10)
    got, more_d = storage.lane_claim_limited_result(direct, "lim-d", 10)
    assert len(want) == len(got) == 2 and more_c is more_d is True
    assert [{k: v for k, v in msgspec.structs.asdict(s).items() if k not in IDENTITY} for s in got] == \
           [{k: v for k, v in msgspec.structs.asdict(s).items() if k not in IDENTITY} for s in want]
    # a keyed queue: at most one job of a key at once
    client = sh.client(schema)
    for q in ("key-c", "key-d"):
        storage.queue_key_limit_set(conn, q, 1)
        for i in range(3):
            client.enqueue(sh.KIND, {"i": i}, queue=q, concurrency_key="A", conn=conn)
    want_k, _ = storage.lane_claim_keyed_result(plain, "key-c", 10)
    got_k, _ = storage.lane_claim_keyed_result(direct, "key-d", 10)
    assert len(want_k) == len(got_k) == 1 and got_k[0].args == want_k[0].args
    assert len(_prepared(direct)) == 2 and _prepared(plain) == []  # one statement per claim kind
