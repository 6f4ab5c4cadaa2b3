"""A job being claimed is never reported unknown by ``job_load``.

The lookup decides claimed-or-not partly from the lane's claim cursor, a
sequence, which a statement's snapshot does not cover. Here a lookup's
snapshot is taken, then (while the lookup waits for a lock) a claim commits
the job's receipt and the next claim moves the cursor past it: within that
old snapshot the job looks claimed, closed and recordless, so unknown (a
``None`` that a CI poll of a job in flight once met). ``job_load`` and
``job_load_many`` ask an unknown answer once more, in a new statement.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from awa_fast.client import Client
from tests.fixtures.database import sqlx, sqlx_all
from tests.fixtures.waiting import wait_for
from tests.integration.storage_helpers import claim

pytestmark = pytest.mark.integration

Q = "midclaim"


@pytest.mark.parametrize("many", [False, True])
def test_a_job_read_while_its_claim_commits_is_not_unknown(pg_dsn, schema, storage, conn, many):  # noqa: ANN001
    client = Client(pg_dsn, schema)
    try:
        first, second = client.enqueue_many("mc.work", [{"i": 0}, {"i": 1}], queue=Q, return_ids=True)
    finally:
        client.close()
    reader = psycopg.connect(pg_dsn, autocommit=True)
    blocker = psycopg.connect(pg_dsn)
    got: list[object] = []
    try:
        # the lookup's first table, locked: the lookup takes its snapshot, then waits here
        sqlx(blocker, schema, "LOCK TABLE __SCHEMA__.key_waiting IN ACCESS EXCLUSIVE MODE")
        pid = reader.info.backend_pid

        def look() -> None:
            got.append(storage.job_load_many(reader, [first])[0] if many else storage.job_load(reader, first))

        t = threading.Thread(target=look, daemon=True)
        t.start()
        wait_for(lambda: sqlx_all(conn, schema, "SELECT 1 FROM pg_stat_activity WHERE pid = %s "
                                                "AND wait_event_type = 'Lock'", (pid,)), 20,
                 "the lookup waiting for the lock")
        # meanwhile: the first job's claim commits its receipt, the next claim moves the cursor past it
        assert [s.job_id for s in claim(storage, conn, Q, limit=1)] == [first]
        assert [s.job_id for s in claim(storage, conn, Q, limit=1)] == [second]
        blocker.commit()
        t.join(20)
    finally:
        blocker.close()
        reader.close()
    assert len(got) == 1
    job = got[0]
    assert job is not None, "a job being claimed was reported unknown"
    assert isinstance(job, dict) and job["state"] == "running" and job["job_id"] == first
