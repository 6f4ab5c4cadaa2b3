"""Test app for the flow-control tests: ``awa-fast supervise tests.integration.flow_apps:app``.

Every handler records its run in the table ``$AWA_TEST_FLOW_TABLE`` (a
schema-qualified name the test created) on ``$AWA_TEST_FLOW_DSN``: one row
at start with the database clock (``clock_timestamp()``), its end written
by the same connection when the handler returns. Times come from the
database, so intervals of handlers in different supervisors compare on one
clock. One connection per worker thread.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from awa_fast.app import App

QUEUE = "flow"

_local = threading.local()


def _conn() -> tuple[psycopg.Connection, sql.Composable]:
    c = getattr(_local, "conn", None)
    if c is None or c.closed or getattr(_local, "pid", None) != os.getpid():
        c = psycopg.connect(os.environ["AWA_TEST_FLOW_DSN"], autocommit=True,
                            application_name=f"awa_fast:test:{os.environ.get('AWA_TEST_FLOW_SCHEMA', '')}:flow")
        _local.conn, _local.pid = c, os.getpid()
    schema, table = os.environ["AWA_TEST_FLOW_TABLE"].split(".")
    return c, sql.Identifier(schema, table)


def _run(job: Any, ms: float) -> None:
    c, table = _conn()
    row = c.execute(sql.SQL("INSERT INTO {} (job_id, run_lease, pid, started_at) "
                            "VALUES (%s, %s, %s, clock_timestamp()) RETURNING id").format(table),
                    (job.id, job.run_lease, os.getpid())).fetchone()
    assert row is not None
    time.sleep(ms / 1000.0)
    c.execute(sql.SQL("UPDATE {} SET ended_at = clock_timestamp() WHERE id = %s").format(table), (row[0],))


app = App(schema="awa_fast_flow_placeholder", default_queue=QUEUE)


@app.job("flow.work", queue=QUEUE)
def work(job: Any) -> None:
    """Runs ``args["ms"]`` milliseconds (default 20), recording start and end."""
    _run(job, float(job.args.get("ms", 20)))
