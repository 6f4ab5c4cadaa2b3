"""Shared machinery of the chaos scenarios (tests/chaos/test_*.py).

- :func:`start_cluster`: a dedicated PostgreSQL per test module (TCP on
  127.0.0.1, a free port), copied from one initdb'd template per session, so
  server-level chaos never touches the shared session server. TCP needs the
  cluster's generated password (SCRAM, never trust): :attr:`ChaosCluster.dsn`
  refers to its 0600 password file with ``passfile=``.
- :func:`new_schema`: a migrated schema (rings of 4 slots) plus an **audit**
  schema: row triggers record every enqueue, claim, closure and terminal
  record as it is written. Ring prune TRUNCATEs history (row triggers do not
  fire on TRUNCATE), so the audit keeps exact per-job evidence for the
  invariant checker however much was pruned.
- :class:`Supervise`: ``python -m awa_fast.cli supervise`` as a real process
  group, with its log and the execution log of ``tests.chaos.chaos_app``.
- :func:`check_invariants`: RELIABILITY.md "Invariants checked after every
  chaos run", with exact counts; returns the figures it measured.

No sleeping where an event can be awaited: ``wait_for``
(tests/fixtures/waiting.py) polls the database (or a log) with a deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from awa_fast.bench.procs import SupervisorProcess
from awa_fast.client import Client
from awa_fast.embedded import PostgresCluster, embedded_bindir, system_bindir
from awa_fast.storage import Storage
from awa_fast.storage.migrate import RingSizes, migrate
from tests.fixtures.supervisor import group_gone
from tests.fixtures.waiting import wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
APP_REF = "tests.chaos.chaos_app:app"
QUEUE = "q"
KIND = "chaos.work"

# -- a dedicated cluster per test module ------------------------------------------------

_TEMPLATE_LOCK = threading.Lock()
_TEMPLATE: pathlib.Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindir() -> pathlib.Path:
    return system_bindir() or embedded_bindir()


def _template() -> pathlib.Path:
    """One initdb'd (never started) data directory per test process; clusters copy it."""
    global _TEMPLATE
    with _TEMPLATE_LOCK:
        if _TEMPLATE is None or not (_TEMPLATE / "PG_VERSION").exists():
            root = pathlib.Path(tempfile.mkdtemp(prefix="awa-chaos-template-"))
            atexit.register(shutil.rmtree, root, True)
            PostgresCluster(root / "data", _bindir(), settings={"port": "5432"}).init()
            _TEMPLATE = root / "data"
        return _TEMPLATE


def copy_template(datadir: pathlib.Path) -> None:
    """Copy the session template to ``datadir``, with its password file (kept 0600)."""
    template = _template()
    shutil.copytree(template, datadir, symlinks=True)
    os.chmod(datadir, 0o700)
    # the template's password goes with its pg_authid (TCP needs it: SCRAM, never trust)
    src = PostgresCluster(template, _bindir()).password_file
    dst = PostgresCluster(datadir, _bindir()).password_file
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(src.read_bytes())


CLUSTER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "on",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "autovacuum_naptime": "1s",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] %a ",
}


@dataclass
class ChaosCluster:
    """A private PostgreSQL reachable over TCP on 127.0.0.1 (so a proxy can sit in front).

    TCP authenticates with SCRAM and the cluster's generated password; every
    DSN here names the password file (``passfile=``), never the password.
    """

    cluster: PostgresCluster
    port: int

    @property
    def dsn(self) -> str:
        return f"{self.cluster.tcp_dsn()} sslmode=disable"

    @property
    def passfile(self) -> str:
        """The cluster's password file (libpq passfile format, mode 0600)."""
        return str(self.cluster.password_file)

    @property
    def password(self) -> str:
        """The real password: tests put it in a DSN to prove it is never logged."""
        pw = self.cluster.password()
        assert pw, f"no password in {self.cluster.password_file}"
        return pw

    def connect(self, app: str = "chaos:observer", autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=autocommit, application_name=app)

    def crash(self) -> None:
        self.cluster.crash()

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        # fast, not immediate: an immediate stop leaves the server's /dev/shm segments behind
        self.cluster.stop("fast")


def start_cluster(root: pathlib.Path, **settings: str) -> ChaosCluster:
    """Start a dedicated PostgreSQL in ``root/data`` (a copy of the session template)."""
    port = free_port()
    datadir = root / "data"
    if not datadir.exists():
        copy_template(datadir)
    merged = {**CLUSTER_SETTINGS, "port": str(port), **settings}
    cluster = PostgresCluster(datadir, _bindir(), settings=merged)
    cluster.start()
    cc = ChaosCluster(cluster, port)
    with cc.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    return cc


# -- schema + audit ----------------------------------------------------------------------

_AUDIT_SQL = """
CREATE SCHEMA {a};
CREATE TABLE {a}.enqueued (job_id bigint NOT NULL, via text NOT NULL, tok text,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {a}.claims (job_id bigint NOT NULL, run_lease int NOT NULL, claim_slot int NOT NULL,
    claim_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {a}.closures (job_id bigint NOT NULL, run_lease int NOT NULL, claim_slot int NOT NULL,
    claim_id bigint NOT NULL, outcome int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid bigint NOT NULL DEFAULT txid_current());
CREATE TABLE {a}.batch_closures (claim_slot int NOT NULL, claim_id bigint NOT NULL, outcome int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {a}.terminal (job_id bigint NOT NULL, run_lease int NOT NULL, attempt int NOT NULL,
    state text NOT NULL, error_len int, at timestamptz NOT NULL DEFAULT clock_timestamp(),
    txid bigint NOT NULL DEFAULT txid_current());

CREATE FUNCTION {a}.on_ready() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.lease_base = 0 THEN
        INSERT INTO {a}.enqueued (job_id, via, tok) VALUES (NEW.job_id, 'ready', NEW.args->>'tok');
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_deferred() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.lease_base = 0 AND NEW.state = 1 THEN
        INSERT INTO {a}.enqueued (job_id, via, tok) VALUES (NEW.job_id, 'deferred', NEW.args->>'tok');
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.claims (job_id, run_lease, claim_slot, claim_id)
    SELECT u.j, u.l, NEW.claim_slot, NEW.claim_id FROM unnest(NEW.job_ids, NEW.run_leases) AS u(j, l);
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_closure() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.closures VALUES (NEW.job_id, NEW.run_lease, NEW.claim_slot, NEW.claim_id, NEW.outcome);
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_batch_closure() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.batch_closures VALUES (NEW.claim_slot, NEW.claim_id, NEW.outcome);
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_done() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.terminal (job_id, run_lease, attempt, state, error_len)
    VALUES (NEW.job_id, NEW.run_lease, NEW.attempt,
            CASE NEW.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
            octet_length(NEW.error));
    RETURN NULL;
END $$;
-- A compact done row (migration 0015) completes every attempt it names: one terminal record each, its
-- attempt read from the ready row it completed (same slot and lane, run_lease = lease_base + 1).
CREATE FUNCTION {a}.on_done_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.terminal (job_id, run_lease, attempt, state, error_len)
    SELECT u.j, u.l, COALESCE((SELECT e.attempt + 1 FROM {s}.ready_entries e
                               WHERE e.ready_slot = NEW.ready_slot AND e.lane_id = NEW.lane_id AND e.job_id = u.j
                                 AND e.lease_base + 1 = u.l AND e.lane_seq BETWEEN NEW.first_seq AND NEW.last_seq),
                              -1),
           'completed', NULL
    FROM unnest(NEW.job_ids, NEW.run_leases) AS u(j, l);
    RETURN NULL;
END $$;
CREATE FUNCTION {a}.on_dlq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {a}.terminal (job_id, run_lease, attempt, state, error_len)
    VALUES (NEW.job_id, NEW.lease_base, NEW.attempt, 'dlq', octet_length(NEW.reason));
    RETURN NULL;
END $$;

CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.ready_entries FOR EACH ROW EXECUTE FUNCTION {a}.on_ready();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.deferred_jobs FOR EACH ROW EXECUTE FUNCTION {a}.on_deferred();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.lease_claims FOR EACH ROW EXECUTE FUNCTION {a}.on_claim();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.lease_claim_closures FOR EACH ROW EXECUTE FUNCTION {a}.on_closure();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.lease_claim_closure_batches
    FOR EACH ROW EXECUTE FUNCTION {a}.on_batch_closure();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.done_entries FOR EACH ROW EXECUTE FUNCTION {a}.on_done();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.done_receipts FOR EACH ROW EXECUTE FUNCTION {a}.on_done_receipt();
CREATE TRIGGER chaos_audit AFTER INSERT ON {s}.dlq_entries FOR EACH ROW EXECUTE FUNCTION {a}.on_dlq();
"""

_schema_counter = 0


def new_schema(dsn: str, prefix: str = "chaos", *, heartbeat_timeout: float = 2.0,
               deadline: float | None = None, rings: RingSizes | None = None, audit: bool = True) -> str:
    """Migrate a fresh schema (rings of 4 slots), add the audit triggers, configure queue ``q``."""
    global _schema_counter
    _schema_counter += 1
    schema = f"{prefix}_{os.getpid() % 10000}_{_schema_counter}"
    migrate(dsn, schema, rings or RingSizes(ready=4, claim=4, lease=4))
    with psycopg.connect(dsn, autocommit=True, application_name="chaos:setup") as c:
        if audit:
            with c.transaction():
                c.execute(_AUDIT_SQL.format(s=f'"{schema}"', a=f'"{schema}_audit"'))  # type: ignore[arg-type]
        st = Storage(schema)
        st.queue_configure(c, QUEUE, heartbeat_timeout=heartbeat_timeout,
                           deadline=deadline if deadline is not None else False)
    return schema


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="chaos:teardown") as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE pid <> pg_backend_pid() AND application_name LIKE 'awa_fast%'")
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}_audit" CASCADE')


# -- enqueue ---------------------------------------------------------------------------------


def enqueue_many(dsn: str, schema: str, n: int, args: dict[str, Any] | None = None, *, kind: str = KIND,
                 max_attempts: int = 25, chunk: int = 2000) -> int:
    """Bulk-enqueue ``n`` jobs by COPY, committed (in chunks); returns ``n``."""
    client = Client(None, schema, default_queue=QUEUE)
    with psycopg.connect(dsn, autocommit=True, application_name="chaos:producer") as c:
        done = 0
        while done < n:
            k = min(chunk, n - done)
            client.enqueue_many(kind, [dict(args or {}, i=done + i) for i in range(k)], queue=QUEUE,
                                max_attempts=max_attempts, conn=c)
            done += k
    return n


def enqueue_one(conn: psycopg.Connection, schema: str, args: dict[str, Any] | None = None, *,
                kind: str = KIND, max_attempts: int = 25, **kw: Any) -> int:
    return Client(None, schema, default_queue=QUEUE).enqueue(kind, args or {}, queue=QUEUE,
                                                             max_attempts=max_attempts, conn=conn, **kw)


def enqueue_rolled_back(dsn: str, schema: str, n: int = 5) -> list[int]:
    """Enqueue ``n`` single jobs and a COPY batch inside a transaction that rolls back; the single ids."""
    client = Client(None, schema, default_queue=QUEUE)
    ids: list[int] = []
    with psycopg.connect(dsn, autocommit=True, application_name="chaos:producer-rb") as c:
        with contextlib.suppress(_Rollback):
            with c.transaction():
                for i in range(n):
                    ids.append(client.enqueue(KIND, {"rolled_back": i}, queue=QUEUE, conn=c))
                client.enqueue_many(KIND, [{"rolled_back_copy": i} for i in range(n)], queue=QUEUE, conn=c)
                raise _Rollback
    return ids


class _Rollback(Exception):
    pass


class Producer(threading.Thread):
    """Enqueue single jobs at a fixed rate (one autocommit statement each) until stopped.

    Every job carries a unique ``tok``. ``acked`` holds the tokens whose
    commit was acknowledged; ``in_doubt`` those whose call failed (the commit
    may or may not have happened: a crash can lose the acknowledgement).
    :meth:`committed_tokens` resolves the doubt from the audit, the way an
    application would, and checks that no acknowledged commit was lost.
    """

    def __init__(self, dsn: str, schema: str, rate: float, args: dict[str, Any] | None = None,
                 prefix: str = "p") -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.dsn, self.schema, self.rate, self.args, self.prefix = dsn, schema, rate, args or {}, prefix
        self.acked: list[str] = []
        self.in_doubt: list[str] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()
        self.acked_at: list[float] = []

    @property
    def committed(self) -> int:
        return len(self.acked)

    def run(self) -> None:
        client = Client(None, self.schema, default_queue=QUEUE)
        period = 1.0 / self.rate
        conn = None
        next_at = time.monotonic()
        i = 0
        while not self.stop_event.is_set():
            tok = f"{self.prefix}{i}"
            i += 1
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, application_name="chaos:producer",
                                           connect_timeout=2)
                client.enqueue(KIND, dict(self.args, tok=tok), queue=QUEUE, conn=conn)
                self.acked.append(tok)
                self.acked_at.append(time.monotonic())
            except psycopg.Error as exc:
                if conn is not None:  # the statement was sent: its commit is in doubt
                    self.in_doubt.append(tok)
                self.errors.append(str(exc).splitlines()[0] if str(exc) else repr(exc))
                if conn is not None:
                    conn.close()
                conn = None
                self.stop_event.wait(0.1)
            next_at = max(next_at + period, time.monotonic() - 1.0)
            self.stop_event.wait(max(0.0, next_at - time.monotonic()))
        if conn is not None:
            conn.close()

    def stop(self) -> int:
        self.stop_event.set()
        self.join(10)
        return self.committed

    def committed_tokens(self, conn: psycopg.Connection) -> tuple[int, int]:
        """(acknowledged, in-doubt that did commit); asserts every acknowledged commit survived."""
        found = {r[0] for r in q(conn, f'SELECT tok FROM "{self.schema}_audit".enqueued WHERE tok LIKE %s',
                                 (self.prefix + "%",))}
        lost = [t for t in self.acked if t not in found]
        assert not lost, f"{len(lost)} acknowledged enqueues were lost: {lost[:5]}"
        return len(self.acked), sum(1 for t in self.in_doubt if t in found)


# -- the supervisor as a real process group -----------------------------------------------------


_LOG_CHILD = re.compile(r"started (claimer \S+|maintenance) \(pid (\d+)\)")
_LOG_LEADER = re.compile(r"\[(\d+)\]: maintenance leader elected")
_LOG_STALE = re.compile(r"(\d+) stale outcomes rejected")
_LOG_REPLAYED = re.compile(r"replayed flush: (\d+) completions were already committed")


class Supervise(SupervisorProcess):
    """``python -m awa_fast.cli supervise tests.chaos.chaos_app:app ...`` in its own session.

    The bench's supervisor handle (:class:`awa_fast.bench.procs.SupervisorProcess`),
    with the chaos intervals, the execution log of ``tests.chaos.chaos_app``
    and the supervisor's log read back for its children and events.
    """

    def __init__(self, dsn: str, schema: str, workdir: pathlib.Path, *, stripes: int = 2, concurrency: int = 16,
                 batch: int = 0, poll_interval: float = 1.0, maintenance: bool = True,
                 extra_env: dict[str, str] | None = None, launcher: list[str] | None = None,
                 extra_args: Iterable[str] = (), name: str = "sup") -> None:
        self.workdir, self.name = workdir, name
        workdir.mkdir(parents=True, exist_ok=True)
        self.exec_log = workdir / "exec.log"
        spec = f"{QUEUE}:stripes={stripes},concurrency={concurrency}" + (f",batch={batch}" if batch else "")
        options = ["--heartbeat-interval", "0.5", "--rescue-interval", "0.5", "--election-interval", "0.5",
                   "--poll-interval", str(poll_interval), "--drain-timeout", "10", *extra_args]
        if not maintenance:
            options.append("--no-maintenance")
        super().__init__(APP_REF, dsn, schema, queues=[spec], options=options, home=workdir / "home",
                         log_level="INFO", launcher=launcher or [sys.executable, "-m", "awa_fast.cli"],
                         env={"CHAOS_EXEC_LOG": str(self.exec_log), "PYTHONUNBUFFERED": "1", **(extra_env or {})},
                         log_path=workdir / f"{name}.log", cwd=ROOT, own_session=True, dsn_in_argv=True)

    def start(self, wait: bool = True) -> Supervise:
        super().start()
        if wait:
            self.wait_running()
        return self

    def log(self, since_start: bool = True) -> str:
        return self.output(since_start=since_start)

    def children(self) -> dict[str, int]:
        """The newest pid of each child (``claimer q#0``, ``maintenance``) from the log."""
        out: dict[str, int] = {}
        for m in _LOG_CHILD.finditer(self.log()):
            out[m.group(1)] = int(m.group(2))
        return out

    def claimer_pids(self) -> list[int]:
        return [pid for name, pid in sorted(self.children().items()) if name.startswith("claimer")]

    def leader_pids(self) -> list[int]:
        return [int(m.group(1)) for m in _LOG_LEADER.finditer(self.log())]

    def stale_rejected(self) -> int:
        return sum(int(m.group(1)) for m in _LOG_STALE.finditer(self.log(since_start=False)))

    def replayed_completions(self) -> int:
        """Completions a replayed flush found committed by its own lost-ack COMMIT (from the log)."""
        return sum(int(m.group(1)) for m in _LOG_REPLAYED.finditer(self.log(since_start=False)))

    def wait_running(self, timeout: float = 20.0) -> None:
        def running() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            pids = self.claimer_pids()
            text = self.log()
            return len(pids) > 0 and all(re.search(rf"\[{p}\]: claimer \S+ running", text) for p in pids)
        wait_for(running, timeout, "the claimers to run")

    def kill_group(self) -> None:  # type: ignore[override]
        """SIGKILL the whole process group (supervisor, claimers, maintenance)."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
        # children of a SIGKILLed supervisor are orphans in the same group: wait until gone
        wait_for(lambda: group_gone(self.pid), 10, "the killed process group to exit")
        self._close_log()

    def leaked_shm(self) -> list[str]:
        """Shared-memory segments this (dead) supervisor left in /dev/shm."""
        try:
            return [p for p in os.listdir("/dev/shm") if p.startswith(f"awa_fast_{self.pid}_")]
        except FileNotFoundError:
            return []

    def remove_leaked_shm(self) -> int:
        leaked = self.leaked_shm()
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        return len(leaked)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful drain (SIGTERM); SIGKILL the group if it outlives ``timeout``. Returns the exit code."""
        if self.proc is None:
            return None
        code = super().stop(timeout)
        # a claimer stuck outside the supervisor's reach must not outlive the test
        if not group_gone(self.pid):
            self.signal_group(signal.SIGKILL)
            wait_for(lambda: group_gone(self.pid), 10, "the process group to exit")
        return code


def process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


# -- execution log ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exec:
    what: str
    job_id: int
    run_lease: int
    attempt: int
    pid: int


def read_exec_log(path: pathlib.Path) -> list[Exec]:
    """Every complete line so far (a line whose write is still in progress waits for the next read)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data[:data.rfind(b"\n") + 1].decode().splitlines():
        parts = line.split()
        if len(parts) == 5:
            out.append(Exec(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])))
    return out


# -- reads --------------------------------------------------------------------------------------------


def q(conn: psycopg.Connection, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


def scalar(conn: psycopg.Connection, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
    return None if row is None else row[0]


def terminal_count(conn: psycopg.Connection, schema: str) -> int:
    """Terminal records written so far (audit; survives prune)."""
    return int(scalar(conn, f'SELECT count(*) FROM "{schema}_audit".terminal'))


def enqueued_count(conn: psycopg.Connection, schema: str) -> int:
    return int(scalar(conn, f'SELECT count(DISTINCT job_id) FROM "{schema}_audit".enqueued'))


def wait_terminal(conn: psycopg.Connection, schema: str, n: int, timeout: float, what: str = "") -> float:
    """Wait until ``n`` terminal records exist; returns the seconds it took."""
    t0 = time.monotonic()
    wait_for(lambda: terminal_count(conn, schema) >= n, timeout,
             what or f"{n} terminal records in {schema}", interval=0.05)
    return time.monotonic() - t0


def open_claims(conn: psycopg.Connection, schema: str, clock: str = "now()") -> list[tuple[int, int, float]]:
    """(job_id, run_lease, seconds since heartbeat or claim) of every open receipt-backed attempt.

    ``clock="clock_timestamp()"`` measures after the statement's snapshot: every
    visible heartbeat committed before it (the statement's own ``now()`` may not be).
    """
    assert clock in ("now()", "clock_timestamp()"), clock
    s = f'"{schema}"'
    return [(int(j), int(rl), float(age)) for j, rl, age in q(conn, f"""
        SELECT u.j, u.l, extract(epoch FROM {clock} - COALESCE(a.heartbeat_at, c.claimed_at))::float8
        FROM {s}.lease_claims c
        CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, l)
        LEFT JOIN {s}.attempt_state a ON a.job_id = u.j AND a.run_lease = u.l
        WHERE NOT EXISTS (SELECT 1 FROM {s}.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM {s}.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.job_id = u.j AND x.run_lease = u.l)""")]


def dead_tuples(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Exact dead tuples (pgstattuple) of every table and partition of the schema, non-zero ones."""
    out: dict[str, int] = {}
    for (t,) in q(conn, "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = %s AND c.relkind = 'r' ORDER BY 1", (schema,)):
        n = scalar(conn, "SELECT dead_tuple_count FROM pgstattuple(%s::regclass)", (f'"{schema}"."{t}"',))
        if n:
            out[t] = int(n)
    return out


def our_sessions(conn: psycopg.Connection) -> list[tuple[int, str, str, float]]:
    """(pid, application_name, state, seconds in state) of every awa_fast session."""
    return [(int(p), a, s or "", float(age or 0)) for p, a, s, age in q(conn, """
        SELECT pid, application_name, state, extract(epoch FROM now() - state_change)::float8
        FROM pg_stat_activity WHERE application_name LIKE 'awa_fast%' AND pid <> pg_backend_pid()""")]


def leader_backend(conn: psycopg.Connection, schema: str) -> int | None:
    info = Storage(schema).leader_info(conn)
    return None if info is None else int(info["pid"])


def advisory_locks(conn: psycopg.Connection) -> list[tuple[int, str]]:
    """(pid, application_name) of every session holding an advisory lock."""
    return [(int(p), a or "") for p, a in q(conn, """
        SELECT l.pid, a.application_name FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted""")]


def one_pickup(obs: psycopg.Connection, schema: str, phase: str, poll: float) -> float:
    """Enqueue one job into an idle claimer; its pickup latency (enqueue commit to claim, database clock).

    The previous job must be finished and the claimer idle first: a claimer
    whose handler just ended claims again at once, which would hide a dead
    LISTEN. 0.2 s after the last completion it is back to waiting.
    """
    wait_for(lambda: not open_claims(obs, schema), poll + 5, "the previous job to finish")
    time.sleep(0.2)  # let the claimer's post-completion claim pass (a duration, not an event)
    job = enqueue_one(obs, schema, {"phase": phase})
    wait_for(lambda: pickup_latency(obs, schema, job) is not None, poll + 5, f"pickup ({phase})")
    return pickup_latency(obs, schema, job)  # type: ignore[return-value]


def pickup_latency(obs: psycopg.Connection, schema: str, job: int) -> float | None:
    row = obs.execute(f"""SELECT extract(epoch FROM min(c.at) - min(e.at))::float8 FROM "{schema}_audit".claims c
                          JOIN "{schema}_audit".enqueued e ON e.job_id = c.job_id
                          WHERE c.job_id = %s HAVING count(*) > 0""", (job,)).fetchone()
    return None if row is None else float(row[0])


def check_live(conn: psycopg.Connection, schema: str, rescue_bound_s: float = 5.5) -> None:
    """Invariants that need the workers running: no session of ours idle in transaction (for more
    than a second), no claim open past the rescue bound, at most one maintenance leader."""
    problems = []
    idle = [x for x in our_sessions(conn) if x[2].startswith("idle in transaction") and x[3] > 1.0]
    if idle:
        problems.append(f"sessions idle in transaction: {idle}")
    late = [c for c in open_claims(conn, schema) if c[2] > rescue_bound_s]
    if late:
        problems.append(f"{len(late)} claims open past the rescue bound ({rescue_bound_s}s): {late[:5]}")
    leaders = q(conn, f"""SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.objid = 0
          AND l.classid::bigint = ("{schema}".lock_key('leader')::bigint & 4294967295)""")
    if len(leaders) > 1 or any(not a.startswith("awa_fast:maintenance") for (a,) in leaders):
        problems.append(f"leader lock holders: {leaders}")
    if problems:
        raise AssertionError("live invariants violated:\n- " + "\n- ".join(problems))


# -- the invariant checker ---------------------------------------------------------------------------


@dataclass
class Expect:
    """What a scenario committed and how every job must end (exact totals by terminal state)."""

    committed: int
    states: dict[str, int]
    rolled_back: list[int] = field(default_factory=list)
    killed_pids: set[int] = field(default_factory=set)  # attempts started here were cut short
    dead_tuple_bound: int = 5000
    rescue_bound_s: float = 2.0 + 0.5 + 3.0  # heartbeat_timeout + rescue interval + slack


def check_invariants(conn: psycopg.Connection, schema: str, expect: Expect,
                     exec_log: pathlib.Path | None = None, stale_logged: int | None = None,
                     supervisors_stopped: bool = False) -> dict[str, Any]:
    """Check RELIABILITY.md's invariants with exact counts; raise listing every violation.

    Returns the figures: executions, stale executions, re-executed jobs,
    rescues, dead tuples.
    """
    s, a = f'"{schema}"', f'"{schema}_audit"'
    problems: list[str] = []
    figures: dict[str, Any] = {}

    # 1. every committed enqueue reaches exactly one terminal state; totals by state exact
    enq = {int(r[0]) for r in q(conn, f"SELECT DISTINCT job_id FROM {a}.enqueued")}
    if len(enq) != expect.committed:
        problems.append(f"{len(enq)} jobs enqueued per audit, expected {expect.committed} committed")
    term_rows = q(conn, f"SELECT job_id, run_lease, attempt, state FROM {a}.terminal")
    per_job: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for j, rl, att, st in term_rows:
        per_job[int(j)].append((int(rl), int(att), st))
    dup = {j: v for j, v in per_job.items() if len(v) > 1}
    if dup:
        problems.append(f"{len(dup)} jobs have more than one terminal record, e.g. {list(dup.items())[:3]}")
    missing = enq - per_job.keys()
    if missing:
        problems.append(f"{len(missing)} committed jobs never reached a terminal state, e.g. {sorted(missing)[:5]}")
    unknown = per_job.keys() - enq
    if unknown:
        problems.append(f"{len(unknown)} terminal records for jobs never enqueued, e.g. {sorted(unknown)[:5]}")
    totals = Counter(st for v in per_job.values() for _, _, st in v)
    if dict(totals) != {k: v for k, v in expect.states.items() if v}:
        problems.append(f"terminal totals {dict(totals)} != expected {expect.states}")
    exact = Storage(schema).queue_counts_exact(conn).get(QUEUE, {})
    exact = {k: v for k, v in exact.items() if v}
    if exact != {k: v for k, v in expect.states.items() if v}:
        problems.append(f"queue_counts_exact {exact} != expected {expect.states}")
    live_dups = q(conn, f"""SELECT job_id, count(*) FROM (SELECT job_id FROM {s}.done_entries
                             UNION ALL SELECT unnest(job_ids) FROM {s}.done_receipts
                             UNION ALL SELECT job_id FROM {s}.dlq_entries) t GROUP BY 1 HAVING count(*) > 1""")
    if live_dups:
        problems.append(f"done_entries + done_receipts + dlq_entries hold duplicate job ids: {live_dups[:5]}")
    bad_attempts = q(conn, f"SELECT job_id, run_lease FROM {a}.terminal WHERE attempt < 0")
    if bad_attempts:
        problems.append(f"compact done rows name attempts without their ready row: {bad_attempts[:5]}")

    # 2. nothing from a rolled-back enqueue is visible or executed
    if expect.rolled_back:
        rb = list(expect.rolled_back)
        seen = q(conn, f"""SELECT 'enqueued', job_id FROM {a}.enqueued WHERE job_id = ANY(%s)
                           UNION ALL SELECT 'claimed', job_id FROM {a}.claims WHERE job_id = ANY(%s)
                           UNION ALL SELECT 'terminal', job_id FROM {a}.terminal WHERE job_id = ANY(%s)""",
                 (rb, rb, rb))
        if seen:
            problems.append(f"rolled-back jobs are visible: {seen[:5]}")
        for j in rb:
            if Storage(schema).job_load(conn, j) is not None:
                problems.append(f"rolled-back job {j} loads")

    # 3. no write from a stale (job_id, run_lease) landed; stale attempts counted. A rescue that
    #    exhausts the attempts writes the terminal record itself, in its own transaction: that one is
    #    not stale; any other terminal record of a rescued attempt is.
    rescued_tx = {(int(j), int(rl)): int(t) for j, rl, t in
                  q(conn, f"SELECT job_id, run_lease, txid FROM {a}.closures WHERE outcome = 7")}
    rescued = set(rescued_tx)
    figures["rescued_attempts"] = len(rescued)
    by_rescue = {(int(j), int(rl)) for j, rl, t in q(conn, f"SELECT job_id, run_lease, txid FROM {a}.terminal")
                 if rescued_tx.get((int(j), int(rl))) == int(t)}
    stale_writes = [(j, rl) for j, v in per_job.items() for rl, _, _ in v
                    if (j, rl) in rescued and (j, rl) not in by_rescue]
    if stale_writes:
        problems.append(f"terminal records written by rescued (stale) attempts: {stale_writes[:5]}")
    claimed = {(int(j), int(rl)) for j, rl in q(conn, f"SELECT job_id, run_lease FROM {a}.claims")}
    unclaimed_terminal = [(j, rl, st) for j, v in per_job.items() for rl, _, st in v
                          if (j, rl) not in claimed and st != "cancelled"]
    if unclaimed_terminal:
        problems.append(f"terminal records for attempts never claimed: {unclaimed_terminal[:5]}")
    execs = read_exec_log(exec_log) if exec_log is not None else []
    starts = [e for e in execs if e.what == "start"]
    figures["executions"] = len(starts)
    figures["executions_of_rescued_attempts"] = sum(1 for e in starts if (e.job_id, e.run_lease) in rescued)
    if stale_logged is not None:
        figures["stale_rejected_logged"] = stale_logged
    dup_attempts = [k for k, n in Counter((e.job_id, e.run_lease) for e in starts).items() if n > 1]
    if dup_attempts:
        problems.append(f"one attempt (job_id, run_lease) executed twice: {dup_attempts[:5]}")

    # 4. attempt counters show the re-execution a kill forced: every rescue consumed an attempt
    final = {j: max(v) for j, v in per_job.items()}  # (run_lease, attempt, state)
    rescues_per_job = Counter(j for j, _ in rescued)
    for j, n in rescues_per_job.items():
        if j not in final or final[j][2] == "cancelled":
            continue
        need = n if (j, final[j][0]) in by_rescue else n + 1
        if final[j][1] < need:
            problems.append(f"job {j} was rescued {n}x but ended at attempt {final[j][1]} (expected >= {need})")
    cut = {(e.job_id, e.run_lease) for e in starts if e.pid in expect.killed_pids}
    ended = {(j, rl) for j, v in per_job.items() for rl, _, _ in v}
    reexec = 0
    for j, rl in cut - ended:
        if j in final and final[j][0] <= rl:
            problems.append(f"job {j}: attempt run_lease {rl} was cut by a kill but the job ended at run_lease "
                            f"{final[j][0]} (no re-execution)")
        else:
            reexec += 1
    figures["reexecuted_after_kill"] = reexec

    # 5. no claim open past the rescue bound
    late = [c for c in open_claims(conn, schema) if c[2] > expect.rescue_bound_s]
    if late:
        problems.append(f"{len(late)} claims open past the rescue bound ({expect.rescue_bound_s}s): {late[:5]}")

    # 6. no session of ours idle in transaction; no advisory lock of ours outlives its process
    idle = [x for x in our_sessions(conn) if x[2].startswith("idle in transaction") and x[3] > 1.0]
    if idle:
        problems.append(f"sessions idle in transaction: {idle}")
    if supervisors_stopped:
        try:
            wait_for(lambda: not our_sessions(conn), 10, "every awa_fast session to end")
        except AssertionError:
            problems.append(f"awa_fast sessions outlive their processes: {our_sessions(conn)}")
        locks = [x for x in advisory_locks(conn) if x[1].startswith("awa_fast")]
        if locks:
            problems.append(f"advisory locks held after every process ended: {locks}")

    # 7. dead tuples within the stated bound
    dt = dead_tuples(conn, schema)
    figures["dead_tuples"] = sum(dt.values())
    figures["dead_tuples_top"] = sorted(dt.items(), key=lambda kv: -kv[1])[:4]
    if figures["dead_tuples"] > expect.dead_tuple_bound:
        problems.append(f"{figures['dead_tuples']} dead tuples > bound {expect.dead_tuple_bound}: {dt}")

    if problems:
        raise AssertionError("invariants violated:\n- " + "\n- ".join(problems))
    return figures


# -- figures for docs/reliability.md ---------------------------------------------------------------

FIGURES_PATH = ROOT / "tests" / "chaos" / ".last_run_figures.jsonl"


def record_figures(scenario: str, **figures: Any) -> None:
    """Append one scenario's figures to tests/chaos/.last_run_figures.jsonl (for the docs)."""
    import json

    with open(FIGURES_PATH, "a") as f:
        f.write(json.dumps({"scenario": scenario, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **figures},
                           default=str) + "\n")
    print(f"[chaos figures] {scenario}: {figures}")


@contextlib.contextmanager
def supervisors(*sups: Supervise) -> Iterator[tuple[Supervise, ...]]:
    """Stop the supervisors at the end: a drain normally, SIGKILL of the group when the test failed."""
    try:
        yield sups
    except BaseException:
        for s in sups:
            with contextlib.suppress(Exception):
                s.kill_group()
        raise
    finally:
        for s in sups:
            with contextlib.suppress(Exception):
                s.stop(timeout=15)
            with contextlib.suppress(Exception):
                if not s.alive():
                    s.remove_leaked_shm()


def launcher(**maintenance: Any) -> list[str]:
    """argv prefix of tests/chaos/chaos_supervise.py with extra maintenance settings.

    ``rotate={"ready": 2}``, ``prune_interval=0.5``.
    """
    argv = [sys.executable, "-m", "tests.chaos.chaos_supervise"]
    for ring, secs in (maintenance.pop("rotate", None) or {}).items():
        argv += ["--rotate", f"{ring}={secs}"]
    for key, value in maintenance.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return [*argv, "--"]
