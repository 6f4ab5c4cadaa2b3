"""The claim's rows as one binary COPY (awa_fast/storage/claim_read.py) against the row path, on a real server.

The COPY path must give field for field the snapshots the row path gives
(binary cursor, raw-jsonb loader, ``decode_snapshots``) under both codecs,
commit the claim as the row path does, raise the server's own psycopg error
and leave the connection usable, and end a socket shut down by the watchdog
with an error instead of a hang. All three claim calls (plain, limited,
keyed) take it for claims of ``CLAIM_COPY_MIN_ROWS`` rows or more.
"""

from __future__ import annotations

import importlib
import threading

import msgspec
import psycopg
import pytest

from awa_fast.jobs import ClaimSnapshot
from awa_fast.runtime.watchdog import shutdown_socket
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.claim_read import CLAIM_COPY_MIN_ROWS, claim_copy, claim_rows, claim_statement, copy_out
from awa_fast.storage.types import CLOSE_RETRY
from tests.fixtures.database import connect, sqlx
from tests.fixtures.waiting import wait_for
from tests.integration.storage_helpers import claim, client, enqueue, make_due, raw

Q = "q"
BIG = CLAIM_COPY_MIN_ROWS  # a claim this size takes the COPY


def _codecs() -> list[object]:
    mods = [importlib.import_module("awa_fast._pycodec")]
    try:
        mods.append(importlib.import_module("awa_fast._codec"))
    except ImportError:  # the tools/dev.py setup always builds it; the unit tests fail without it
        pass
    return mods


def _same(snaps: list[ClaimSnapshot]) -> list[ClaimSnapshot]:
    """Snapshots with claim_id zeroed: a rolled-back claim still used its claim_id from the sequence."""
    return [msgspec.structs.replace(s, claim_id=0) for s in snaps]


def _last_statement(pg_dsn: str, conn: psycopg.Connection) -> str:
    """The statement ``conn``'s backend ran last, as another session sees it (pg_stat_activity)."""
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        row = other.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (conn.info.backend_pid,)).fetchone()
    assert row is not None
    return str(row[0])


def _varied_jobs(schema: str, storage: Storage, conn: psycopg.Connection) -> list[int]:
    """Ready jobs whose rows hold every kind of value a snapshot carries."""
    cli = client(schema)
    jobs = []
    # errors (a retried attempt), progress (flushed before the retry), callback_result (a resumed callback)
    jobs.append(cli.enqueue("k.retry", {"r": 1}, queue=Q, conn=conn, max_attempts=5))
    jobs.append(cli.enqueue("k.progress", {"p": 1}, queue=Q, conn=conn, max_attempts=5))
    jobs.append(cli.enqueue("k.callback", {"cb": 1}, queue=Q, conn=conn))
    snaps = {s.kind: s for s in claim(storage, conn, Q, 10)}
    [res] = storage.attempt_close(conn, [(snaps["k.retry"], CLOSE_RETRY, None, "boom: ünïcødé ✓ \U0001f600")])
    assert res.status == "ok"
    assert [r.status for r in storage.attempt_heartbeat(conn, [snaps["k.progress"]],
                                                        [raw({"step": 2, "note": "ß" * 50})])] == ["ok"]
    [res] = storage.attempt_close(conn, [(snaps["k.progress"], CLOSE_RETRY, None, "again")])
    assert res.status == "ok"
    token = storage.attempt_register_callback(conn, snaps["k.callback"], 600)
    assert token is not None
    assert storage.callback_resolve(conn, token, "resume", raw({"answer": [1, "два", None]})) == "ok"
    make_due(conn, schema)
    assert storage.deferred_promote(conn) == 2
    # payloads: unicode, empty, big, nested; metadata; other priorities and kinds
    jobs.append(cli.enqueue("k.text", {"s": "héllo wörld ✓ \U0001f680 \u4e2d\u6587"}, queue=Q, conn=conn))
    jobs.append(cli.enqueue("k.empty", {}, queue=Q, conn=conn, metadata={"trace": "abc", "n": 1}))
    jobs.append(cli.enqueue("k.big", {"blob": "x" * 300_000, "list": list(range(2000))}, queue=Q, conn=conn,
                            priority=1))
    jobs.append(cli.enqueue("k.list", [1, 2.5, None, True, {"a": {"b": []}}], queue=Q, conn=conn, priority=4))
    cli.enqueue_many("k.many", ({"i": i} for i in range(40)), queue=Q, conn=conn)
    return jobs


def test_copy_gives_the_row_paths_snapshots_field_for_field(pg_dsn, schema, storage, conn):
    _varied_jobs(schema, storage, conn)
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as tx:
        use_raw_jsonb(tx)
        storage.session_utc(tx)
        tx.commit()
        rows, marker = claim_rows(tx, storage.q["lane_claim"], Q, 100, 0, 1)
        tx.rollback()
        stream = copy_out(tx, claim_statement(tx, storage.q["lane_claim_copy"], Q, 100, 0, 1))
        tx.rollback()
        copied, copy_marker = claim_copy(tx, storage.q["lane_claim_copy"], Q, 100, 0, 1)
        tx.rollback()
    assert len(rows) == 47 and marker is False
    assert {s.kind for s in rows} >= {"k.retry", "k.progress", "k.callback", "k.big", "k.list"}
    by_kind = {s.kind: s for s in rows}
    assert by_kind["k.retry"].errors and by_kind["k.progress"].progress and by_kind["k.callback"].callback_result
    assert by_kind["k.empty"].metadata is not None and by_kind["k.text"].metadata is None
    assert (copied, copy_marker) != ([], False)
    assert _same(copied) == _same(rows) and copy_marker == marker
    for codec in _codecs():
        decoded, seen = codec.decode_copy_snapshots(stream)  # type: ignore[attr-defined]
        assert _same(decoded) == _same(rows) and seen is False, codec
        for got, want in zip(decoded, rows, strict=True):
            for name in ClaimSnapshot.__struct_fields__:
                a, b = getattr(got, name), getattr(want, name)
                assert type(a) is type(b), (codec, name, a, b)
            assert got.created_at.utcoffset() is not None and got.created_at.utcoffset().total_seconds() == 0


def test_big_claims_take_the_copy_and_commit(pg_dsn, schema, storage, conn):
    cli = client(schema)
    cli.enqueue_many("k", ({"i": i} for i in range(BIG + 10)), queue=Q, conn=conn)
    with connect(pg_dsn, schema, tag="watcher") as watcher:
        snaps, more = storage.lane_claim_result(conn, Q, BIG)
        assert len(snaps) == BIG and more is False
        assert "COPY (SELECT" in _last_statement(pg_dsn, conn)
        # committed (autocommit: the COPY is its own transaction): another session sees the receipt
        (held,) = sqlx(watcher, schema, "SELECT count(*) FROM __SCHEMA__.lease_claims").fetchone()
        assert held == 1
    rest, more = storage.lane_claim_result(conn, Q, BIG - 1)  # below the threshold: the row path
    assert len(rest) == 10 and more is False
    last = _last_statement(pg_dsn, conn)
    assert "claim_batch_v3(" in last and "COPY" not in last
    assert not {s.job_id for s in snaps} & {s.job_id for s in rest}
    assert storage.lane_claim_result(conn, Q, BIG) == ([], False)


def test_copy_claim_sees_the_backlog_marker(pg_dsn, schema, storage, conn):
    """As test_short_claim_behind_a_busy_lane_says_more, through the COPY: the marker row is taken off."""
    job = enqueue(schema, conn, Q, {"i": 0})
    with connect(pg_dsn, schema, autocommit=False, tag="holder") as holder:
        enqueue(schema, conn, Q, {"i": 1})
        sqlx(holder, schema, "SELECT 1 FROM __SCHEMA__.queue_claim_heads WHERE queue = %s FOR UPDATE", (Q,))
        assert storage.lane_claim_result(conn, Q, BIG) == ([], True)
        stream = copy_out(conn, claim_statement(conn, storage.q["lane_claim_copy"], Q, BIG, 0, 1))
        for codec in _codecs():
            assert codec.decode_copy_snapshots(stream) == ([], True)  # type: ignore[attr-defined]
    snaps, more = storage.lane_claim_result(conn, Q, BIG)
    assert job in [s.job_id for s in snaps] and more is False


def test_limited_and_keyed_claims_take_the_copy(pg_dsn, schema, storage, conn):
    cli = client(schema)
    cli.enqueue_many("k", ({"i": i} for i in range(30)), queue=Q, conn=conn)
    storage.queue_limits_set(conn, Q, max_running=12)
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as tx:
        use_raw_jsonb(tx)
        rows = claim_rows(tx, storage.q["lane_claim_limited"], Q, BIG, 0, 1)
        tx.rollback()
        copied = storage.lane_claim_limited_result(tx, Q, BIG)
        assert "COPY (SELECT" in _last_statement(pg_dsn, tx)
        tx.rollback()
    assert len(rows[0]) == 12 and rows[1] is True  # the limit cut the claim short while work remains
    assert (_same(copied[0]), copied[1]) == (_same(rows[0]), rows[1])

    keyed = "qk"
    storage.queue_ensure(conn, keyed)
    storage.queue_key_limit_set(conn, keyed, 1)
    for i in range(6):
        cli.enqueue("k", {"i": i}, queue=keyed, conn=conn, concurrency_key=f"key{i % 3}")
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as tx:
        use_raw_jsonb(tx)
        rows = claim_rows(tx, storage.q["lane_claim_keyed"], keyed, BIG, 0, 1)
        tx.rollback()
        copied = storage.lane_claim_keyed_result(tx, keyed, BIG)
        assert "COPY (SELECT" in _last_statement(pg_dsn, tx)
        tx.rollback()
    assert len(rows[0]) == 3  # one per key
    # (the rolled-back admission's lane came from a sequence too: a new lane_id the second time)
    assert ([msgspec.structs.replace(s, lane_id=0) for s in _same(copied[0])], copied[1]) == (
        [msgspec.structs.replace(s, lane_id=0) for s in _same(rows[0])], rows[1])
    snaps, _ = storage.lane_claim_keyed_result(conn, keyed, BIG)  # committed this time
    assert sorted(jl for jl in (s.job_id for s in snaps)) == sorted(s.job_id for s in rows[0])


def test_a_server_error_in_the_copy_is_psycopgs_and_the_connection_lives(pg_dsn, schema, storage, conn):
    enqueue(schema, conn, Q, {"i": 0})
    conn.execute("SET statement_timeout = 1")
    with connect(pg_dsn, schema, autocommit=False, tag="locker") as locker:
        # the claim reads queue_meta first: an exclusive lock makes it wait past statement_timeout
        sqlx(locker, schema, "LOCK TABLE __SCHEMA__.queue_meta IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(psycopg.errors.QueryCanceled) as by_rows:
            claim_rows(conn, storage.q["lane_claim"], Q, BIG, 0, 1)
        with pytest.raises(psycopg.errors.QueryCanceled) as by_copy:
            storage.lane_claim_result(conn, Q, BIG)
        assert type(by_copy.value) is type(by_rows.value)
        assert by_copy.value.sqlstate == by_rows.value.sqlstate == "57014"
        locker.rollback()
    conn.execute("SET statement_timeout = 0")
    snaps, more = storage.lane_claim_result(conn, Q, BIG)  # the connection is usable, nothing was claimed
    assert len(snaps) == 1 and more is False


def test_copy_out_error_after_rows_and_empty_streams(pg_dsn, conn):
    """The reader's other ends: an error after rows were streamed, and a COPY of no rows."""
    failing = (b"COPY (SELECT i, repeat('x', 200) FROM generate_series(1, 5000) i "
               b"WHERE 1 / (5000 - i) >= 0) TO STDOUT (FORMAT binary)")
    with pytest.raises(psycopg.errors.DivisionByZero):
        copy_out(conn, failing)
    assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
    empty = copy_out(conn, b"COPY (SELECT 1 WHERE false) TO STDOUT (FORMAT binary)")
    assert empty == b"PGCOPY\n\xff\r\n\x00" + bytes(8) + b"\xff\xff"
    many = copy_out(conn, b"COPY (SELECT i FROM generate_series(1, 20000) i) TO STDOUT (FORMAT binary)")
    assert len(many) == 19 + 20000 * (2 + 4 + 4) + 2
    assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_shut_down_socket_ends_the_copy_with_an_error(pg_dsn):
    """The watchdog shuts the socket of a claim that gets no answer: the COPY's wait must end in an error."""
    with psycopg.connect(pg_dsn, autocommit=True) as victim:
        started = threading.Event()

        pid = victim.info.backend_pid

        def cut() -> None:
            started.wait(10)
            with psycopg.connect(pg_dsn, autocommit=True) as obs:  # the COPY is running on the server
                wait_for(lambda: obs.execute("SELECT state = 'active' AND query LIKE 'COPY%%' FROM pg_stat_activity"
                                             " WHERE pid = %s", (pid,)).fetchone() == (True,),
                         what="the COPY to run")
            shutdown_socket(victim)

        t = threading.Thread(target=cut)
        t.start()
        started.set()
        with pytest.raises(psycopg.OperationalError):
            copy_out(victim, b"COPY (SELECT pg_sleep(5)) TO STDOUT (FORMAT binary)")
        t.join(10)
        assert not t.is_alive()


def test_claim_statement_binds_the_queue_as_a_literal(pg_dsn, schema, storage, conn):
    hostile = "q'); DROP TABLE x; --\\ ü"
    stmt = claim_statement(conn, storage.q["lane_claim_copy"], hostile, 300, 1, 2)
    assert b"'q''); DROP TABLE x; --\\ \xc3\xbc'" in stmt or b"E'q''); DROP TABLE x; --\\\\ \xc3\xbc'" in stmt
    assert b"::text, 300::int, 1::int, 2::int)" in stmt
    assert storage.lane_claim_result(conn, hostile, BIG) == ([], False)  # an unknown queue: nothing
    with pytest.raises(TypeError):
        claim_statement(conn, storage.q["lane_claim_copy"], hostile, 2.5, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        claim_statement(conn, storage.q["lane_claim_copy"], 7, 300, 0, 1)  # type: ignore[arg-type]
