"""Session queries of the storage layer (clock, ping, LISTEN channel, leader lock, schema teardown),
and the stored stripe count supervise reads."""

from __future__ import annotations

import datetime
import time
import uuid

import psycopg

from awa_fast.client import Client
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate
from tests.fixtures.waiting import wait_for


def test_the_listen_channel_is_the_one_the_enqueue_functions_notify(pg_dsn, schema, storage, conn):
    assert storage.channel_name(conn) == storage.channel  # Python's name and the SQL's notify_channel() agree
    storage.queue_configure(conn, "sq", enqueue_shards=1)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        storage.channel_listen(listener)
        client = Client(pg_dsn, schema)
        try:
            client.enqueue("k", {}, queue="sq")  # an empty lane: the producer notifies
        finally:
            client.close()
        assert [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)] == ["sq"]


def test_the_session_clock_and_ping(storage, conn):
    t0 = time.time()
    db = storage.session_clock(conn)
    assert t0 - 60 < db < time.time() + 60  # the same machine: the clocks agree closely
    storage.session_ping(conn)
    conn.close()
    try:
        storage.session_ping(conn)
    except psycopg.Error:
        pass
    else:
        raise AssertionError("a ping on a closed connection must raise")


def test_session_utc_loads_claimed_created_at_in_utc_at_the_same_instant(pg_dsn, storage, conn):
    # the claim connection's created_at: built in UTC (psycopg's cheap path), never another instant
    use_raw_jsonb(conn)
    conn.execute("SET TimeZone TO 'America/St_Johns'")  # a named zone with a half-hour offset
    client = Client(pg_dsn, storage.schema)
    try:
        client.enqueue("k", {}, queue="tzq")
    finally:
        client.close()
    probe = "SELECT created_at FROM {}.ready_entries ORDER BY job_id DESC LIMIT 1"
    before = conn.cursor(binary=True).execute(probe.format(storage.schema)).fetchone()[0]
    assert before.utcoffset() != datetime.timedelta(0)
    storage.session_utc(conn)
    (snap,) = storage.lane_claim(conn, "tzq", 10)
    assert snap.created_at.tzinfo is datetime.UTC
    assert snap.created_at == before


def test_the_leader_lock_is_held_by_one_session_at_a_time(pg_dsn, storage):
    with psycopg.connect(pg_dsn, autocommit=True) as a, psycopg.connect(pg_dsn, autocommit=True) as b:
        assert storage.leader_lock_try(a) is True
        assert storage.leader_lock_try(b) is False
        a.close()  # the session lock goes with its session (once its backend has ended: not at once)
        wait_for(lambda: storage.leader_lock_try(b), 10, "the lock to be free after its session closed")


def test_schema_teardown_ends_its_sessions_and_drops_it(pg_dsn):
    name = "t_" + uuid.uuid4().hex[:12]
    migrate(pg_dsn, name, RingSizes(ready=4, claim=4, lease=4))
    doomed = Storage(name)
    other = psycopg.connect(pg_dsn, autocommit=True, application_name=f"awa_fast:test:{name}")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert doomed.schema_backends_terminate(c) == 1
        doomed.schema_drop(c)
        assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (name,)).fetchone() == (0,)
        doomed.schema_drop(c)  # gone already: nothing to do
    try:
        other.execute("SELECT 1")
    except psycopg.OperationalError:
        pass
    else:
        raise AssertionError("the schema's other session should have been ended")
    finally:
        other.close()


def test_a_queue_without_stripes_on_the_command_line_uses_its_stored_setting(storage, conn):
    from awa_fast.runtime.supervisor import parse_queue_spec, resolve_stripes

    for name in ("three", "given", "fresh"):
        storage.queue_ensure(conn, name)
    storage.queue_configure(conn, "three", stripes=3)
    storage.queue_configure(conn, "given", stripes=3)
    specs = (parse_queue_spec("three"), parse_queue_spec("given:stripes=2"), parse_queue_spec("fresh:concurrency=8"))
    assert [q.stripes for q in specs] == [0, 2, 0]  # 0: not given
    resolved = resolve_stripes(storage, conn, specs)
    assert [(q.name, q.stripes, q.concurrency) for q in resolved] == [("three", 3, 64), ("given", 2, 64),
                                                                       ("fresh", 1, 8)]
    assert resolve_stripes(storage, conn, resolved) is resolved  # all set: no query


def test_the_in_process_worker_starts_the_stored_number_of_stripes(pg_dsn, schema, storage, conn):
    from awa_fast.worker import Worker, WorkerConfig, queue_specs
    from tests.integration.worker_apps import build

    storage.queue_ensure(conn, "w")
    storage.queue_configure(conn, "w", stripes=3)
    app = build(pg_dsn, schema)
    app.enqueue_many("mixed", ({"i": i} for i in range(1, 100)))  # none of them is retried
    worker = Worker(app, WorkerConfig(pg_dsn, schema, queue_specs(app, {"w": {"concurrency": 4}}),
                                      maintenance=False, until_empty=True))
    try:
        worker.start()
        assert sorted(c.config.stripe for c in worker.claimers) == [0, 1, 2]
        assert {c.config.stripes for c in worker.claimers} == {3}
        summary = worker.wait()
    finally:
        app.close()
    assert summary.empty and summary.claimed == 99
