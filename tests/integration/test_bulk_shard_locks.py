"""What the shard locks of one bulk call leave to other producers (review of lead-overlap).

A bulk call's chunks now start their shard search at pid + (k mod COPY_LANES),
so one call holds the lane lock of up to four shards until its transaction
ends. On a queue with four shards or fewer that is every shard, and
``lane_lock_for_enqueue`` waits when all are busy: two transactions that
bulk-enqueue to two such queues in opposite orders deadlock. Before the spread
one call held one shard and the other's search found a free one.
"""

from __future__ import annotations

import threading

import psycopg

from awa_fast.client import PRIORITY_DEFAULT, Client
from tests.fixtures.waiting import wait_for


def _waiting_on_lock(conn: psycopg.Connection, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def test_bulk_calls_to_two_queues_in_opposite_orders_do_not_deadlock(pg_dsn, schema, storage, conn):
    for q in ("sa", "sb"):
        storage.queue_configure(conn, q, enqueue_shards=4)
    cli = Client(pg_dsn, schema)
    rows = [{"i": i} for i in range(40)]  # four chunks of 10
    c1 = psycopg.connect(pg_dsn, application_name=f"awa_fast:test:{schema}")
    c2 = psycopg.connect(pg_dsn, application_name=f"awa_fast:test:{schema}")
    errors: list[BaseException] = []
    # every lane exists and is committed (no wait on another transaction's lane creation)
    for q in ("sa", "sb"):
        for shard in range(4):
            conn.execute(f'SELECT "{schema}".lane_ensure(%s, %s, %s)', (q, PRIORITY_DEFAULT, shard))
    for q in ("sa", "sb"):
        lanes = conn.execute(f'SELECT count(*) FROM "{schema}".queue_lanes WHERE queue = %s', (q,)).fetchone()
        assert lanes is not None and lanes[0] == 4

    def then_commit(c: psycopg.Connection, queue: str) -> None:
        """Enqueue ``rows`` to ``queue`` in ``c``'s open transaction and commit; an error is kept."""
        try:
            cli.enqueue_many("k", rows, queue=queue, conn=c, chunk=10)
            c.commit()
        except psycopg.Error as exc:
            errors.append(exc)
            c.rollback()

    try:
        cli.enqueue_many("k", rows, queue="sa", conn=c1, chunk=10)  # c1's transaction: shards of sa
        cli.enqueue_many("k", rows, queue="sb", conn=c2, chunk=10)  # c2's transaction: shards of sb
        t = threading.Thread(target=then_commit, args=(c1, "sb"), daemon=True)
        t.start()
        pid1 = c1.info.backend_pid
        # c1 either finished (a free shard of sb) or waits for one
        wait_for(lambda: not t.is_alive() or _waiting_on_lock(conn, pid1), 10, "c1 done or waiting")
        then_commit(c2, "sa")
        t.join(30)
    finally:
        c1.close()
        c2.close()
        cli.close()
    assert not errors, [type(e).__name__ + ": " + " ".join(str(e).split()) for e in errors]
    n = conn.execute(f'SELECT count(*) FROM "{schema}".ready_entries').fetchone()
    assert n is not None and n[0] == 160
