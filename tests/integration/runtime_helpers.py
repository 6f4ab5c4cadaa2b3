"""Helpers for the runtime tests (tests/integration/test_runtime_*.py, test_cli.py).

They run the CLI as real processes against the session's PostgreSQL, enqueue,
and read what the runtime wrote. The supervisor handle (``SupervisorProc``),
``wait_for`` and ``connect``/``sqlx`` are the shared fixture plugins under
tests/fixtures/.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import orjson
import psycopg

from awa_fast.client import Client
from awa_fast.storage import Storage
from tests.fixtures.database import sqlx_all
from tests.fixtures.supervisor import QUEUE, REPO_ROOT
from tests.integration.storage_helpers import DONE_ALL


def counts(storage: Storage, conn: psycopg.Connection, queue: str = QUEUE) -> dict[str, int]:
    return storage.queue_counts_exact(conn).get(queue, {})


def enqueue_bulk(dsn: str, schema: str, kind: str, args: Iterable[Any], **kw: Any) -> list[int]:
    """Bulk-enqueue by COPY (the production bulk path); returns the new job ids."""
    client = Client(dsn, schema)
    try:
        conn = client._own_conn()  # noqa: SLF001 - reuse its connection to read the ids back
        before = {r[0] for r in sqlx_all(conn, schema, "SELECT DISTINCT job_id FROM __SCHEMA__.ready_entries "
                                                       "WHERE kind = %s", (kind,))}
        client.enqueue_many(kind, args, queue=kw.pop("queue", QUEUE), **kw)
        after = {r[0] for r in sqlx_all(conn, schema, "SELECT DISTINCT job_id FROM __SCHEMA__.ready_entries "
                                                      "WHERE kind = %s", (kind,))}
    finally:
        client.close()
    return sorted(after - before)


def enqueue_one(dsn: str, schema: str, kind: str, args: Any = None, **kw: Any) -> int:
    client = Client(dsn, schema)
    try:
        return client.enqueue(kind, args, queue=kw.pop("queue", QUEUE), **kw)
    finally:
        client.close()


def done_rows_by_job(conn: psycopg.Connection, schema: str) -> dict[int, list[tuple[int, int, int]]]:
    """job_id -> [(state, attempt, run_lease), ...] over the done rows of both shapes (DONE_ALL)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    rows = sqlx_all(conn, schema, f"SELECT job_id, state, attempt, run_lease FROM {DONE_ALL}")
    for job_id, state, attempt, lease in rows:
        out.setdefault(int(job_id), []).append((int(state), int(attempt), int(lease)))
    return out


def rollups(conn: psycopg.Connection, schema: str) -> dict[tuple[str, int], int]:
    return {(q, int(s)): int(n) for q, s, n in
            sqlx_all(conn, schema, "SELECT queue, state, count FROM __SCHEMA__.queue_terminal_rollups")}


# -- the run log written by runtime_apps handlers ----------------------------------------


class RunLog:
    """The JSON lines the handlers of runtime_apps append under one directory.

    Read incrementally: each call parses only what the files gained since the
    last one (tests poll this every 10 ms while thousands of lines pile up; a
    full re-read per poll kept a core of the test process busy).
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._read: dict[pathlib.Path, tuple[int, list[dict[str, Any]]]] = {}  # path -> (bytes parsed, records)

    def entries(self, event: str | None = None) -> list[dict[str, Any]]:
        """Every complete line so far, in time order. Read while workers still append, a file may
        end in a line whose write is not finished (a reader can see a write half done): that tail
        waits for the next read."""
        out: list[dict[str, Any]] = []
        for path in sorted(self.dir.glob("*.log")):
            done, records = self._read.get(path, (0, []))
            with path.open("rb") as f:
                if f.seek(0, 2) < done:  # the file was replaced: read it again from the start
                    done, records = 0, []
                f.seek(done)
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            records.extend(orjson.loads(line) for line in complete.splitlines() if line.strip())
            self._read[path] = (done + len(complete), records)
            out.extend(records if event is None else (r for r in records if r["ev"] == event))
        out.sort(key=lambda rec: rec["t"])  # one clock: every process runs on this host
        return out

    def for_job(self, job_id: int, event: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries(event) if e["job"] == job_id]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
        cwd: pathlib.Path | str = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``python -m awa_fast.cli ARGS`` and capture its output."""
    full_env = dict(os.environ)
    for key in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA", "AWA_FAST_HOME"):
        full_env.pop(key, None)
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "awa_fast.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(cwd), env=full_env, stdin=subprocess.DEVNULL)


def cli_json(*args: str, **kw: Any) -> Any:
    res = cli(*args, **kw)
    assert res.returncode == 0, f"awa-fast {' '.join(args)} exited {res.returncode}: {res.stderr[-2000:]}"
    return json.loads(res.stdout)
