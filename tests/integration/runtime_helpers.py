"""Helpers for the runtime tests (tests/integration/test_runtime_*.py, test_cli.py).

They run ``awa-fast supervise`` and the CLI as real processes against the
session's PostgreSQL, find child processes through ``/proc`` and the
supervisor's shared-memory status, and wait for observable events (rows,
files, pids) with a deadline instead of sleeping.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson
import psycopg

from awa_fast.client import Client
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.schema import render

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
APP = "tests.integration.runtime_apps:app"
QUEUE = "q"


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
             interval: float = 0.02, on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def connect(dsn: str, schema: str, tag: str = "rt") -> psycopg.Connection:
    """An autocommit connection tagged with the schema (the schema fixture terminates it)."""
    c = psycopg.connect(dsn, autocommit=True, application_name=f"awa_fast:test:{schema}:{tag}")
    use_raw_jsonb(c)
    return c


def sqlx(conn: psycopg.Connection, schema: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    return conn.execute(render(text, schema), params).fetchall()  # type: ignore[arg-type]


def counts(storage: Storage, conn: psycopg.Connection, queue: str = QUEUE) -> dict[str, int]:
    return storage.queue_counts_exact(conn).get(queue, {})


def enqueue_bulk(dsn: str, schema: str, kind: str, args: Iterable[Any], **kw: Any) -> list[int]:
    """Bulk-enqueue by COPY (the production bulk path); returns the new job ids."""
    client = Client(dsn, schema)
    try:
        conn = client._own_conn()  # noqa: SLF001 - reuse its connection to read the ids back
        before = {r[0] for r in sqlx(conn, schema, "SELECT DISTINCT job_id FROM __SCHEMA__.ready_entries "
                                                   "WHERE kind = %s", (kind,))}
        client.enqueue_many(kind, args, queue=kw.pop("queue", QUEUE), **kw)
        after = {r[0] for r in sqlx(conn, schema, "SELECT DISTINCT job_id FROM __SCHEMA__.ready_entries "
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
    """job_id -> [(state, attempt, run_lease), ...] over done_entries."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for job_id, state, attempt, lease in sqlx(conn, schema,
                                              "SELECT job_id, state, attempt, run_lease FROM __SCHEMA__.done_entries"):
        out.setdefault(int(job_id), []).append((int(state), int(attempt), int(lease)))
    return out


def rollups(conn: psycopg.Connection, schema: str) -> dict[tuple[str, int], int]:
    return {(q, int(s)): int(n) for q, s, n in
            sqlx(conn, schema, "SELECT queue, state, count FROM __SCHEMA__.queue_terminal_rollups")}


# -- the run log written by runtime_apps handlers ----------------------------------------


class RunLog:
    """The JSON lines the handlers of runtime_apps append under one directory."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def entries(self, event: str | None = None) -> list[dict[str, Any]]:
        """Every complete line so far. Read while workers still append, a file may end in a
        line whose write is not finished (a reader can see a write half done): that tail waits
        for the next read."""
        out = []
        for path in sorted(self.dir.glob("*.log")):
            data = path.read_bytes()
            for line in data[:data.rfind(b"\n") + 1].splitlines():
                if line.strip():
                    rec = orjson.loads(line)
                    if event is None or rec["ev"] == event:
                        out.append(rec)
        out.sort(key=lambda rec: rec["t"])  # one clock: every process runs on this host
        return out

    def for_job(self, job_id: int, event: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries(event) if e["job"] == job_id]


# -- processes ---------------------------------------------------------------------------


def proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.extend(int(x) for x in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return sorted(set(out))


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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


class SupervisorProc:
    """``awa-fast supervise`` as a real process in its own session (kill the whole group at will)."""

    def __init__(self, dsn: str, schema: str, workdir: pathlib.Path, *, app: str = APP,
                 queues: Sequence[str] = (f"{QUEUE}:stripes=2,concurrency=16",), runlog: RunLog | None = None,
                 home: pathlib.Path | None = None, heartbeat_interval: float = 0.5,
                 election_interval: float = 0.5, rescue_interval: float = 0.5, poll_interval: float = 0.5,
                 drain_timeout: float = 20.0, extra: Sequence[str] = (), name: str = "supervisor") -> None:
        self.dsn = dsn
        self.schema = schema
        self.home = home if home is not None else workdir / f"{name}-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "awa_fast.cli", "--log-level", "INFO", "supervise", app,
               "--schema", schema, "--dsn", dsn, "--home", str(self.home),
               "--heartbeat-interval", str(heartbeat_interval), "--election-interval", str(election_interval),
               "--rescue-interval", str(rescue_interval), "--poll-interval", str(poll_interval),
               "--drain-timeout", str(drain_timeout), *extra]
        for q in queues:
            cmd += ["--queue", q]
        env = {k: v for k, v in os.environ.items()
               if k not in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA", "AWA_FAST_HOME")}
        if runlog is not None:
            env["AWA_TEST_RUNLOG"] = str(runlog.dir)
        self._out = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()/close()
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid

    # -- observation ------------------------------------------------------------------

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 40) -> str:
        return "supervisor output (tail):\n" + "\n".join(self.output().splitlines()[-n:])

    def children(self) -> list[int]:
        """Live forked children (claimers, maintenance); not multiprocessing's resource tracker."""
        out = []
        for p in proc_children(self.pid):
            try:
                cmdline = pathlib.Path(f"/proc/{p}/cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if b"resource_tracker" not in cmdline and pid_alive(p):
                out.append(p)
        return out

    def local_status(self) -> dict[str, Any] | None:
        """The shared-memory snapshot (what ``awa-fast status --json`` shows as ``local``)."""
        from awa_fast.runtime.status import _local_snapshot

        try:
            return _local_snapshot(self.home, self.schema, self.pid)
        except Exception:  # noqa: BLE001 - torn down while reading
            return None

    def claimer_pids(self) -> dict[tuple[str, int], int]:
        """(queue, stripe) -> pid of running claimers (shared memory, confirmed by /proc)."""
        snap = self.local_status()
        if not snap:
            return {}
        kids = set(self.children())
        return {(c["queue"], c["stripe"]): c["pid"] for c in snap["claimers"]
                if c["pid"] in kids and c["state"] == "running"}

    def maintenance_pid(self) -> int | None:
        """The one child that is not a running claimer (None while that is ambiguous)."""
        snap = self.local_status()
        if not snap:
            return None
        kids = self.children()
        claimers = {c["pid"] for c in snap["claimers"] if c["state"] == "running"}
        if not claimers <= set(kids) or len(claimers) != len(snap["claimers"]):
            return None
        rest = [p for p in kids if p not in claimers]
        return rest[0] if len(rest) == 1 else None

    def wait_running(self, stripes: int = 2, timeout: float = 30.0) -> dict[tuple[str, int], int]:
        """Wait until ``stripes`` claimers run (state running, pid alive)."""
        def ready() -> Any:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited early with {self.proc.returncode}\n{self.tail()}")
            pids = self.claimer_pids()
            return pids if len(pids) >= stripes else None
        return wait_for(ready, timeout, "claimers running", on_timeout=self.tail)

    # -- control ----------------------------------------------------------------------

    def send(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.returncode is not None:
                self._out.close()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor and wait for its exit code."""
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
        return self.wait(timeout)

    def close(self) -> None:
        """Whatever happened: nothing of this supervisor's group is left running."""
        if self.proc.poll() is None:
            self.kill_group(signal.SIGKILL)
            self.proc.wait(30)
        else:
            self.kill_group(signal.SIGKILL)  # orphaned children, if any
        self._out.close()

    def __enter__(self) -> SupervisorProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def group_gone(pgid: int) -> bool:
    """True when no live process of process group ``pgid`` is left."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return False
    return True

