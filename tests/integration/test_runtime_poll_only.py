"""Poll-only claimers (--no-listen): no LISTEN connection, work still picked up by polling."""

from __future__ import annotations

import psycopg

from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE, counts, enqueue_one


def test_poll_only_supervisor_opens_no_listen_connection_and_still_runs_jobs(pg_dsn, schema, storage, conn,
                                                                            supervisor_proc) -> None:
    sup = supervisor_proc(pg_dsn, schema, queues=[f"{QUEUE}:stripes=1,concurrency=4"], poll_interval=0.3,
                          extra=["--no-listen"])
    sup.wait_running(1)
    job = enqueue_one(pg_dsn, schema, "rt.sync", {"n": 1})
    wait_for(lambda: counts(storage, conn).get("completed") == 1, 20, "job completed by polling",
             on_timeout=sup.tail)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        listeners = c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                              ("awa_fast:listen:%",)).fetchone()
    assert listeners == (0,)
    assert storage.job_load(conn, job)["state"] == "completed"
