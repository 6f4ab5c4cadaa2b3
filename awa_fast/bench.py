"""``awa-fast bench SCENARIO``: the standard scenarios of docs/benchmarks.md.

Scenarios (see ``docs/performance.md`` for the exact commands and results):

* ``drain``            COPY-enqueue ``--jobs`` no-op jobs, start a real ``awa-fast
                       supervise`` process, time first pickup -> last durable completion.
* ``bulk-enqueue``     jobs/s through ``App.enqueue_many`` (payload checks + binary COPY).
* ``concurrent-insert`` ``--producers`` processes, each ``App.enqueue`` on its own
                       autocommit connection (one durable commit per job) for ``--seconds``.
* ``latency``          one producer at ``--rate`` jobs/s for ``--seconds``, one
                       transaction per job, supervisor idle-waiting; pickup and
                       end-to-end percentiles per job.
* ``pinned-reader``    ``latency`` while a ``REPEATABLE READ`` transaction that read
                       ``ready_entries`` stays open; dead tuples over time, then the
                       reclaim after the reader ends.

``--payload-bytes N`` (drain, bulk-enqueue) pads every job's args with a
``"pad"`` string of random hex (TOAST compression cannot shrink it) to about N
bytes of compact JSON. ``--rss-every S`` (latency, pinned-reader) samples the
VmRSS of every claimer process every S seconds while the producer runs and
reports ``claimer_rss_kb``; growth is counted from the sample at a quarter of
the run, so warm-up is not growth.

Every run drops and re-migrates its own schema (``bench_<scenario>``, or
``--schema`` when it starts with ``bench``), so it never touches an
application's schema.

How latency is measured (the honest way, per job, one clock):
the producer records ``time.time()`` right after its enqueue statement
returns, i.e. after the enqueue transaction's commit was acknowledged (the
row's ``created_at`` is the *start* of that transaction, earlier than its
commit, so measuring from it would overstate latency by the enqueue's own
duration). Inside the supervisor, the bench app registers an ``App.on_flush``
listener (only when ``AWA_FAST_BENCH_TRACE`` names a file) that
appends ``(job_id, started_at, committed_at)`` per job: ``started_at`` is
taken by the claimer right before the handler is called, ``committed_at``
right after the completion transaction's ``COMMIT`` returned. pickup =
``started_at - enqueue ack``, end-to-end = ``committed_at - enqueue ack``.
The runtime's own shared-memory histograms (``created_at``-based, ~1.45x
buckets) are reported beside them as ``shm_pickup_ms`` / ``shm_e2e_ms``.

Drain is timed from ``min(lease_claims.claimed_at)`` (the first claim
statement's start, read while that receipt still exists) to the moment the
bench sees the shared-memory ``completed`` counters reach N (they are
published after each completion ``COMMIT``; polled every 5 ms). The
database-only span ``max(done_entries.finished_at) - min(claimed_at)`` is
reported as ``db_span_s`` (a lower bound: ``finished_at`` is the start of the
last completion transaction, not its commit).

Dead tuples are read after every bench connection is gone (backends flush
their statistics when they exit), without any manual vacuum.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import multiprocessing
import os
import pathlib
import platform
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg

import awa_fast
from awa_fast.app import App
from awa_fast.client import MAX_PAYLOAD_BYTES
from awa_fast.errors import ConfigError
from awa_fast.jobs import AttemptClosed
from awa_fast.storage.schema import render

KIND = "bench.noop"
QUEUE = "bench"
TRACE_ENV = "AWA_FAST_BENCH_TRACE"
_TRACE_REC = struct.Struct("<qdd")  # job_id, started_at, committed_at (time.time())

app = App(schema=os.environ.get("AWA_FAST_BENCH_SCHEMA", "bench_drain"))


@app.job(KIND, queue=QUEUE)
def noop(job) -> None:  # noqa: ANN001 - awa_fast.Job
    """The bench handler does nothing: the benchmarks measure the queue."""


# -- the trace hook (active only inside a supervisor started by the bench) ------------


def _trace_writer(path: str):  # noqa: ANN202 - an App.on_flush listener
    """An :meth:`App.on_flush` listener appending (job_id, started_at, committed_at) per completed job.

    One ``os.write`` per flush (an ``O_APPEND`` file per claimer process),
    after the flush's COMMIT was timed.
    """
    fds: dict[int, int] = {}
    pack = _TRACE_REC.pack

    def write(closed: list[AttemptClosed]) -> None:
        data = b"".join(pack(c.job_id, c.started_at, c.committed_at) for c in closed if c.outcome == "completed")
        if data:
            pid = os.getpid()
            fd = fds.get(pid)
            if fd is None:
                fd = fds[pid] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, data)

    return write


if os.environ.get(TRACE_ENV):
    app.on_flush(_trace_writer(os.environ[TRACE_ENV]))


def read_trace(path: str | os.PathLike[str]) -> dict[int, tuple[float, float]]:
    """job_id -> (started_at, committed_at) from a trace file (first completion wins)."""
    out: dict[int, tuple[float, float]] = {}
    try:
        data = pathlib.Path(path).read_bytes()
    except FileNotFoundError:
        return out
    usable = len(data) - len(data) % _TRACE_REC.size
    for job_id, started, committed in _TRACE_REC.iter_unpack(data[:usable]):
        out.setdefault(job_id, (started, committed))
    return out


# -- small helpers -------------------------------------------------------------------


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 95, 99)) -> dict[str, float] | None:
    """Linear-interpolated percentiles in the input's unit; None for no values."""
    if not values:
        return None
    s = sorted(values)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100.0
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{p:g}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def _ms(pct: dict[str, float] | None, digits: int = 3) -> dict[str, float] | None:
    return None if pct is None else {k: round(v * 1000.0, digits) for k, v in pct.items()}


def _json_len(obj: Any) -> int:
    """Bytes of ``obj`` as compact JSON (what the client's encoder writes for these plain dicts)."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


def payload_pad(args: argparse.Namespace, widest: dict[str, Any]) -> str | None:
    """The ``"pad"`` value that brings ``widest`` to about ``--payload-bytes`` of JSON; None when not set.

    Random hex, so TOAST compression cannot shrink the stored args; one string
    shared by every job (jobs with a shorter ``n`` come out a few bytes smaller).
    """
    target = getattr(args, "payload_bytes", None)
    if target is None:
        return None
    k = max(0, int(target) - _json_len({**widest, "pad": ""}))
    return secrets.token_hex((k + 1) // 2)[:k]


def copy_chunk(args: argparse.Namespace) -> int:
    """Rows per COPY chunk: 50k, fewer for big payloads (about 64 MiB of args per chunk)."""
    target = getattr(args, "payload_bytes", None)
    return 50_000 if target is None else max(100, min(50_000, (64 << 20) // max(1, int(target))))


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: float, unit: str = "") -> None:
        self.label, self.total, self.unit = label, total, unit
        self.enabled = sys.stderr.isatty()
        self.started = time.perf_counter()
        self._last = 0.0

    def update(self, done: float, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        width = 30
        frac = min(1.0, done / self.total) if self.total else 1.0
        bar = "#" * int(width * frac) + "." * (width - int(width * frac))
        sys.stderr.write(f"\r  {self.label} [{bar}] {done:,.0f}/{self.total:,.0f}{self.unit} {extra}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# -- CPU accounting from /proc (no dependency) -------------------------------------


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, cpu seconds user+system) of every visible process."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2:].split()
        try:
            out[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK)
        except (IndexError, ValueError):
            continue
    return out


def _descendants(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        p = stack.pop()
        if p in found:
            continue
        found.add(p)
        stack.extend(kids.get(p, ()))
    return found


def _box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    total = sum(parts[:8])
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (total - idle) / _CLK, total / _CLK


class CpuMeter:
    """CPU seconds used by the supervisor tree, the PostgreSQL server, this process and the box."""

    def __init__(self, postmaster: int | None) -> None:
        self.postmaster = postmaster
        self.supervisor: int | None = None
        self._start: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None

    def _sample(self) -> dict[str, Any]:
        table = _proc_table()
        groups: dict[str, dict[int, float]] = {}
        for name, root in (("supervisor", self.supervisor), ("postgres", self.postmaster)):
            if root is not None and root in table:
                groups[name] = {p: table[p][1] for p in _descendants(table, root) if p in table}
        me = os.getpid()
        groups["bench"] = {p: table[p][1] for p in _descendants(table, me) if p in table
                           and p not in groups.get("supervisor", {})}
        busy, total = _box_cpu()
        return {"t": time.perf_counter(), "groups": groups, "busy": busy, "total": total}

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> dict[str, Any] | None:
        if self._start is None:
            return None
        end = self._sample()
        start = self._start
        wall = end["t"] - start["t"]
        out: dict[str, Any] = {"window_s": round(wall, 3)}
        for name in ("supervisor", "postgres", "bench"):
            now, then = end["groups"].get(name), start["groups"].get(name, {})
            if now is None:
                out[f"{name}_cpu_s"] = None
                continue
            out[f"{name}_cpu_s"] = round(sum(v - then.get(p, 0.0) for p, v in now.items()), 3)
        ncpu = os.cpu_count() or 1
        box_busy = end["busy"] - start["busy"]
        out["box_busy_cpu_s"] = round(box_busy, 3)
        out["box_capacity_cpu_s"] = round(wall * ncpu, 3)
        known = sum(v for k, v in out.items() if k.endswith("_cpu_s") and k != "box_busy_cpu_s"
                    and k != "box_capacity_cpu_s" and v is not None)
        out["other_cpu_s"] = round(max(0.0, box_busy - known), 3)
        self.result = out
        return out


# -- database helpers ------------------------------------------------------------------


def _conn(dsn: str, name: str = "awa_fast:bench") -> psycopg.Connection:
    from awa_fast.storage import connect

    return connect(dsn, application_name=name)


def fresh_schema(dsn: str, schema: str) -> None:
    """Drop the bench schema (its sessions first) and migrate it anew."""
    from awa_fast.storage.migrate import migrate

    with _conn(dsn) as c:
        c.execute(render("DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE", schema))
    migrate(dsn, schema)


def server_info(dsn: str) -> dict[str, Any]:
    """Server version, the settings that matter for these numbers, and the postmaster pid."""
    names = ("fsync", "synchronous_commit", "wal_level", "shared_buffers", "max_connections",
             "autovacuum", "autovacuum_naptime", "commit_delay", "full_page_writes", "wal_sync_method")
    postmaster = None
    with _conn(dsn) as c:
        version = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        rows = c.execute("SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
                         (list(names),))
        settings = {n: v for n, v in rows}
        backend = int(c.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        # while our backend lives: its parent is the postmaster (when the server is local)
        try:
            ppid = _proc_table().get(backend, (None, 0.0))[0]
            if ppid and pathlib.Path(f"/proc/{ppid}/comm").read_text().strip().startswith("postgres"):
                postmaster = int(ppid)
        except OSError:
            pass
    return {"version": version, "settings": settings, "postmaster_pid": postmaster}


def settled_dead_tuples(dsn: str, schema: str, since: float, timeout: float = 15.0) -> dict[str, Any]:
    """n_dead_tup summed over the schema once every bench backend has exited (stats flushed).

    A backend flushes pending statistics when it exits; a live, idle one may
    hold them for up to 10 s. So wait (up to ``timeout``) until no backend
    started by the bench (``backend_start >= since``, application awa_fast*)
    remains, then read with a fresh statistics snapshot. No vacuum is run.
    """
    waited_for = 0
    t0 = time.monotonic()
    with _conn(dsn, "awa_fast:bench:stats") as c:
        since_ts = _dt.datetime.fromtimestamp(since, _dt.timezone.utc)
        while True:
            left = c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_start >= %s "
                "AND application_name LIKE 'awa_fast%%' AND application_name <> 'awa_fast:bench:stats'",
                (since_ts,)).fetchone()[0]  # type: ignore[index]
            waited_for = int(left)
            if not left or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.1)
        with contextlib.suppress(psycopg.Error):
            c.execute("SELECT pg_stat_force_next_flush()")  # PostgreSQL 15+
        c.execute("SELECT pg_stat_clear_snapshot()")
        dead = _dead_tuples(c, schema)
        per_table = {r[0]: int(r[1]) for r in c.execute(
            "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s AND n_dead_tup > 0 "
            "ORDER BY n_dead_tup DESC LIMIT 8", (schema,))}
    return {"dead_tuples": dead, "top_tables": per_table, "backends_still_open": waited_for,
            "settle_s": round(time.monotonic() - t0, 2)}


def _dead_tuples(c: psycopg.Connection, schema: str) -> int:
    row = c.execute("SELECT COALESCE(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables WHERE schemaname = %s",
                    (schema,)).fetchone()
    return int(row[0]) if row else 0


# -- the supervisor subprocess -----------------------------------------------------------


class SupervisorProc:
    """A real ``awa-fast supervise awa_fast.bench:app`` subprocess and its shared-memory ring."""

    def __init__(self, dsn: str, schema: str, stripes: int, concurrency: int, batch: int,
                 trace: str | None = None, metrics: str | None = None) -> None:
        self.dsn, self.schema = dsn, schema
        self.metrics = metrics  # HOST:PORT: the supervisor serves /metrics there (supervise --metrics)
        self.spec = f"{QUEUE}:stripes={stripes},concurrency={concurrency},batch={batch}"
        self.trace = trace
        self.home = tempfile.mkdtemp(prefix="awa-fast-bench-home-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ring: Any = None
        self.exit_code: int | None = None

    def start(self) -> None:
        env = dict(os.environ, AWA_FAST_DSN=self.dsn, AWA_FAST_BENCH_SCHEMA=self.schema)
        env.pop("DATABASE_URL", None)
        if self.trace:
            env[TRACE_ENV] = self.trace
        else:
            env.pop(TRACE_ENV, None)
        # -P: the working directory (a source checkout, say) must not shadow the installed awa_fast
        cmd = [sys.executable, "-P", "-m", "awa_fast.cli", "--log-level", "WARNING", "supervise", "awa_fast.bench:app",
               "--schema", self.schema, "--home", self.home, "--queue", self.spec]
        if self.metrics:
            cmd += ["--metrics", self.metrics]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def attach(self, timeout: float = 60.0) -> None:
        """Wait for the supervisor's shared-memory ring and attach to it."""
        from awa_fast.runtime.shm import ShmRing, read_locator

        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            loc = read_locator(self.home, self.schema)
            if loc is not None:
                self.ring = ShmRing.attach(loc[0])
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the supervisor did not publish its shared-memory ring in time")
            time.sleep(0.005)

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the bench supervisor exited early with code {self.proc.returncode}")

    def counters(self) -> dict[str, Any]:
        """Summed claimer counters, states and histograms from shared memory."""
        recs = [self.ring.claimer(i).read() for i in range(self.ring.claimers)]
        out: dict[str, Any] = {"claimed": sum(r["claimed"] for r in recs),
                               "completed": sum(r["completed"] for r in recs),
                               "states": [r["state"] for r in recs], "records": recs}
        return out

    def wait_running(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            if all(s == "running" for s in self.counters()["states"]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the bench claimers did not reach 'running' in time")
            time.sleep(0.01)

    def histograms(self) -> dict[str, Any]:
        """Pickup and e2e histograms merged over claimers (runtime's own view, created_at based)."""
        from awa_fast.runtime.shm import histogram_percentiles

        out = {}
        recs = self.counters()["records"]
        for which in ("pickup", "e2e"):
            buckets = [sum(r[which]["buckets"][i] for r in recs) for i in range(len(recs[0][which]["buckets"]))]
            pct = histogram_percentiles(buckets)
            out[which] = ({k: (round(v * 1000, 3) if v is not None else None) for k, v in pct.items()}
                          if sum(buckets) else None)
        return out

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.ring is not None:
            with contextlib.suppress(Exception):
                self.ring.close()
            self.ring = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.exit_code = self.proc.wait()
        elif self.proc is not None:
            self.exit_code = self.proc.returncode
        shutil.rmtree(self.home, ignore_errors=True)
        return self.exit_code


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in kB (``/proc/<pid>/status``); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples the VmRSS of every claimer process of a bench supervisor, every ``every`` seconds.

    Claimer pids come from the supervisor's shared-memory records, read at
    each sample (a restarted claimer shows up as a new pid). A thread samples
    at ``start``, then on a fixed schedule, and once more at ``stop``.
    """

    def __init__(self, sup: SupervisorProc, every: float) -> None:
        self.sup, self.every = sup, float(every)
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.claimers: dict[str, str] = {}  # pid -> "queue#stripe"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        now = time.monotonic() - self._t0
        rss: dict[str, int] = {}
        for rec in self.sup.counters()["records"]:
            pid = int(rec["pid"])
            kb = rss_kb(pid) if pid > 0 else None
            if kb is not None:
                rss[str(pid)] = kb
                self.claimers.setdefault(str(pid), f"{rec['queue']}#{rec['stripe']}")
        self.samples.append((now, rss))

    def _run(self) -> None:
        k = 1
        while not self._stop.wait(max(0.0, self._t0 + k * self.every - time.monotonic())):
            self._sample()
            k += 1

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop(self, final: bool = True) -> None:
        """Stop the thread (before the supervisor's ring is closed); one last sample unless ``final`` is False."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(10)
        self._thread = None
        if final:
            self._sample()

    def summary(self) -> dict[str, Any]:
        """``claimer_rss_kb``: the samples, and per claimer first/last/min/max and growth since 1/4 of the run."""
        end_t = self.samples[-1][0] if self.samples else 0.0
        per: dict[str, Any] = {}
        for pid, label in self.claimers.items():
            series = [(t, m[pid]) for t, m in self.samples if pid in m]
            values = [v for _, v in series]
            q_t, q_v = next(((t, v) for t, v in series if t >= end_t / 4), series[-1])
            tail = [(t, v) for t, v in series if t >= q_t]
            per[pid] = {"claimer": label, "samples": len(series), "first": values[0], "last": values[-1],
                        "min": min(values), "max": max(values), "quarter_t": round(q_t, 2), "quarter": q_v,
                        "growth": values[-1] - q_v,
                        "growth_pct": round(100.0 * (values[-1] - q_v) / q_v, 2) if q_v else None,
                        "slope_kb_per_min": _slope_per_min(tail)}
        growths = [c["growth"] for c in per.values()]
        return {"every_s": self.every, "seconds": round(end_t, 2),
                "samples": [[round(t, 2), m] for t, m in self.samples], "per_claimer": per,
                "max_growth": max(growths) if growths else None,
                "method": "VmRSS (kB) of each claimer pid published in the supervisor's shared memory, "
                          "sampled while the producer runs; growth = last sample - first sample at or after "
                          "1/4 of the run (warm-up excluded); slope = least squares over that tail"}


def _slope_per_min(series: Sequence[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, kB) points in kB per minute; None for fewer than 2 distinct times."""
    if len(series) < 2:
        return None
    mt = sum(t for t, _ in series) / len(series)
    mv = sum(v for _, v in series) / len(series)
    var = sum((t - mt) ** 2 for t, _ in series)
    if var <= 0:
        return None
    return round(60.0 * sum((t - mt) * (v - mv) for t, v in series) / var, 2)


# -- producers ---------------------------------------------------------------------------


def _insert_worker(dsn: str, schema: str, window: Any, out: Any, ready: Any) -> None:
    """One concurrent-insert producer: App.enqueue, own autocommit connection, inside the window."""
    client = App(dsn=dsn, schema=schema)
    client.enqueue(KIND, {"warm": 1}, queue="bench-warmup")  # connect and warm outside the window
    ready.put(os.getpid())
    while window[0] == 0.0:
        time.sleep(0.002)
    start_at, stop_at = window[0], window[1]
    while time.time() < start_at:
        time.sleep(0.001)
    n = 0
    lat: list[float] = []
    enqueue = client.enqueue
    args = {"n": 0}
    while True:
        t0 = time.time()
        if t0 >= stop_at:
            break
        enqueue(KIND, args, queue=QUEUE)
        t1 = time.time()
        if t1 <= stop_at:
            n += 1
            lat.append(t1 - t0)
    client.close()
    out.put((n, lat))


def steady_producer(client: App, rate: float, seconds: float, sent: list[tuple[int, float]],
                    stop: threading.Event | None = None, progress: Progress | None = None,
                    offset: float = 0.0) -> float:
    """Enqueue one job per transaction at ``rate``/s for ``seconds``; appends (job_id, ack time)."""
    interval = 1.0 / rate
    start = time.time()
    i = 0
    enqueue = client.enqueue
    while True:
        due = start + i * interval
        if due - start >= seconds or (stop is not None and stop.is_set()):
            break
        now = time.time()
        if due > now:
            time.sleep(due - now)
        jid = enqueue(KIND, {"i": i}, queue=QUEUE)
        sent.append((jid, time.time()))
        i += 1
        if progress is not None:
            progress.update(offset + time.time() - start, "s")
    return time.time() - start


# -- scenarios ---------------------------------------------------------------------------


def _wait_done(sup: SupervisorProc, target: int, timeout: float, progress: Progress | None = None,
               poll: float = 0.005, stall: float = 30.0) -> int:
    """Poll the shared-memory ``completed`` counters until ``target``; fail on a stall or timeout."""
    deadline = time.monotonic() + timeout
    done = last = 0
    last_change = time.monotonic()
    while done < target:
        sup._check_alive()
        done = sup.counters()["completed"]
        now = time.monotonic()
        if done != last:
            last, last_change = done, now
        if progress is not None:
            progress.update(done)
        if done >= target:
            break
        if now > deadline or now - last_change > stall:
            raise RuntimeError(f"only {done} of {target} jobs completed (no progress for "
                               f"{now - last_change:.0f}s); see the supervisor's log above")
        time.sleep(poll)
    return done


def bench_drain(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    n = int(args.jobs)
    pad = payload_pad(args, {"n": n - 1})
    client = App(dsn=dsn, schema=schema)
    bar = Progress("enqueue", n)
    t0 = time.perf_counter()
    jobs = ({"n": i} for i in range(n)) if pad is None else ({"n": i, "pad": pad} for i in range(n))
    client.enqueue_many(KIND, jobs, queue=QUEUE, progress=bar.update, chunk=copy_chunk(args))
    enqueue_s = time.perf_counter() - t0
    bar.close()
    client.close()
    sup = SupervisorProc(dsn, schema, args.stripes, args.concurrency, args.batch,
                         metrics=getattr(args, "metrics", None))
    cpu = CpuMeter(srv["postmaster_pid"])
    first_claim: float | None = None
    try:
        sup.start()
        sup.attach()
        cpu.supervisor = sup.pid
        bar = Progress("drain", n)
        with _conn(dsn) as c:
            # first pickup: read min(claimed_at) as soon as the first receipt is committed
            give_up = time.monotonic() + 60.0
            while True:
                if time.monotonic() > give_up:
                    raise RuntimeError("no job was claimed within 60 s of the supervisor start")
                sup._check_alive()
                if sup.counters()["claimed"] > 0:
                    cpu.start()
                    row = c.execute(render("SELECT extract(epoch FROM min(claimed_at))::float8 "
                                           "FROM __SCHEMA__.lease_claims", schema)).fetchone()
                    first_claim = float(row[0]) if row and row[0] is not None else time.time()
                    break
                time.sleep(0.001)
            _wait_done(sup, n, timeout=max(120.0, n / 500.0), progress=bar)
            observed_end = time.time()
            cpu_res = cpu.stop()
            bar.close()
            last_done = c.execute(render("SELECT extract(epoch FROM max(finished_at))::float8 "
                                         "FROM __SCHEMA__.done_entries", schema)).fetchone()
            shm_hist = sup.histograms()
        code = sup.stop()
        with _conn(dsn) as c:
            from awa_fast.storage import Storage

            counts = Storage(schema).queue_counts_exact(c).get(QUEUE, {})
    finally:
        sup.stop()
    seconds = observed_end - first_claim
    db_span = (float(last_done[0]) - first_claim) if last_done and last_done[0] is not None else None
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(seconds, 4), "jobs_per_s": round(n / seconds, 1),
        "db_span_s": round(db_span, 4) if db_span else None,
        "db_span_jobs_per_s": round(n / db_span, 1) if db_span else None,
        "enqueue_seconds": round(enqueue_s, 4), "enqueue_jobs_per_s": round(n / enqueue_s, 1),
        "pickup_ms": None, "e2e_ms": None,
        "shm_pickup_ms": shm_hist["pickup"], "shm_e2e_ms": shm_hist["e2e"],
        "completed": counts.get("completed"), "supervisor_exit": code, "cpu": cpu_res,
        "notes": "pickup/e2e not measured for a bulk backlog (they would measure queueing); "
                 "shm_* are the runtime's created_at-based histograms",
    }
    if pad is not None:
        out["args_bytes"] = _json_len({"n": n - 1, "pad": pad})
    return out


def bench_bulk_enqueue(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    n = int(args.jobs)
    client = App(dsn=dsn, schema=schema)
    client.enqueue_many(KIND, [{"warm": 1}], queue="bench-warmup")  # connect, warm caches
    pad = payload_pad(args, {"n": n - 1, "to": f"user{n - 1}@example.com"})
    payloads = [{"n": i, "to": f"user{i}@example.com"} for i in range(n)]
    if pad is not None:
        for p in payloads:
            p["pad"] = pad
    cpu = CpuMeter(srv["postmaster_pid"])
    bar = Progress("enqueue", n)
    cpu.start()
    t0 = time.perf_counter()
    client.enqueue_many(KIND, payloads, queue=QUEUE, progress=bar.update, chunk=copy_chunk(args))
    seconds = time.perf_counter() - t0
    cpu_res = cpu.stop()
    bar.close()
    client.close()
    rate = n / seconds
    shape = ("50k rows per COPY chunk; payload {n, to}" if pad is None
             else f"{copy_chunk(args):,} rows per COPY chunk; payload {{n, to, pad}}")
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(seconds, 4), "jobs_per_s": round(rate, 1),
        "enqueue_jobs_per_s": round(rate, 1), "pickup_ms": None, "e2e_ms": None, "cpu": cpu_res,
        "notes": f"one App.enqueue_many call (payload checks + JSON encode + binary COPY), one transaction, {shape}"}
    if pad is not None:
        out["args_bytes"] = _json_len(payloads[-1])
    return out


def bench_concurrent_insert(args: argparse.Namespace, dsn: str, schema: str,
                            srv: dict[str, Any]) -> dict[str, Any]:
    p = int(args.producers)
    seconds = float(args.seconds)
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    window = ctx.Array("d", [0.0, 0.0])  # (start, stop), set once every producer is connected
    procs = [ctx.Process(target=_insert_worker, args=(dsn, schema, window, out, ready), daemon=True)
             for _ in range(p)]
    for pr in procs:
        pr.start()
    pids = [ready.get(timeout=300) for _ in procs]
    cpu = CpuMeter(srv["postmaster_pid"])
    start_at = time.time() + 0.2
    stop_at = start_at + seconds
    window[1] = stop_at
    window[0] = start_at
    while time.time() < start_at:
        time.sleep(0.001)
    cpu.start()
    bar = Progress("insert", seconds, "s")
    while time.time() < stop_at:
        bar.update(time.time() - start_at)
        time.sleep(min(0.05, max(0.0, stop_at - time.time())))
    cpu_res = cpu.stop()  # now, while the producers' backends still exist
    results = [out.get(timeout=60) for _ in procs]
    bar.close()
    for pr in procs:
        pr.join(10)
    total = sum(n for n, _ in results)
    lat = [x for _, ls in results for x in ls]
    return {"jobs": total, "seconds": seconds, "jobs_per_s": round(total / seconds, 1),
            "enqueue_jobs_per_s": round(total / seconds, 1), "pickup_ms": None, "e2e_ms": None,
            "enqueue_ms": _ms(percentiles(lat)), "per_producer": [n for n, _ in results],
            "producer_pids": pids, "cpu": cpu_res,
            "notes": "each producer: its own process and autocommit connection, App.enqueue one job per "
                     "transaction (durable commit each); no workers running"}


def _latency_run(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any],
                 pinned: bool) -> dict[str, Any]:
    rate = float(args.rate)
    seconds = float(args.seconds)
    reclaim_s = float(getattr(args, "reclaim_seconds", None) or max(2.0, min(30.0, seconds / 2))) if pinned else 0.0
    trace_dir = tempfile.mkdtemp(prefix="awa-fast-bench-trace-")
    trace = os.path.join(trace_dir, "trace.bin")
    sup = SupervisorProc(dsn, schema, args.stripes, args.concurrency, args.batch, trace=trace)
    client = App(dsn=dsn, schema=schema)
    sent: list[tuple[int, float]] = []
    cpu = CpuMeter(srv["postmaster_pid"])
    samples: list[dict[str, Any]] = []
    phase = {"name": "pinned" if pinned else "run"}
    stop_sampler = threading.Event()
    reader: psycopg.Connection | None = None
    pin_window: tuple[float, float] | None = None
    rss_every = float(getattr(args, "rss_every", 0.0) or 0.0)
    rss: RssSampler | None = None
    try:
        client.enqueue(KIND, {"warm": 1}, queue="bench-warmup")  # connect outside the window
        sup.start()
        sup.attach()
        sup.wait_running()
        time.sleep(0.5)  # let LISTEN connections settle: idle-waiting workers
        cpu.supervisor = sup.pid
        sampler = None
        if pinned:
            reader = psycopg.connect(dsn, application_name="awa_fast:bench:pinned-reader")
            reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            reader.execute(render("SELECT count(*) FROM __SCHEMA__.ready_entries", schema)).fetchone()
            reader_xmin = reader.execute("SELECT backend_xmin::text FROM pg_stat_activity "
                                         "WHERE pid = pg_backend_pid()").fetchone()

            def _sample() -> None:
                t_start = time.time()
                with _conn(dsn, "awa_fast:bench:sampler") as sc:
                    while not stop_sampler.is_set():
                        sc.execute("SELECT pg_stat_clear_snapshot()")
                        samples.append({"t": round(time.time() - t_start, 2), "phase": phase["name"],
                                        "dead_tuples": _dead_tuples(sc, schema),
                                        "completed": sup.counters()["completed"]})
                        stop_sampler.wait(1.0)

            sampler = threading.Thread(target=_sample, name="dead-tuple-sampler", daemon=True)
            sampler.start()
        cpu.start()
        if rss_every > 0:
            rss = RssSampler(sup, rss_every)
            rss.start()
        total_s = seconds + reclaim_s
        bar = Progress("latency", total_s, "s")
        t_run0 = time.time()
        steady_producer(client, rate, seconds, sent, progress=bar)
        if pinned:
            pin_window = (t_run0, time.time())
            assert reader is not None
            reader.rollback()
            reader.close()
            reader = None
            phase["name"] = "reclaim"
            steady_producer(client, rate, reclaim_s, sent, progress=bar, offset=seconds)
        produced_s = time.time() - t_run0
        if rss is not None:
            rss.stop()
        bar.close()
        _wait_done(sup, len(sent), timeout=60.0)
        cpu_res = cpu.stop()
        shm_hist = sup.histograms()
        if pinned:
            time.sleep(1.0)  # one more sample after the last completion
            stop_sampler.set()
            if sampler is not None:
                sampler.join(5)
        code = sup.stop()
    finally:
        stop_sampler.set()
        if rss is not None:
            rss.stop(final=False)  # before sup.stop() closes the ring it reads
        if reader is not None:
            reader.close()
        client.close()
        sup.stop()
    tr = read_trace(trace)
    shutil.rmtree(trace_dir, ignore_errors=True)
    # The peers' way, for a like-for-like comparison: the completion row's own
    # timestamp (now() = start of the completing transaction) - enqueue ack.
    # With track_commit_timestamp on, the completion row's commit time is exact; else finished_at.
    with _conn(dsn) as c:
        commit_ts = c.execute("SHOW track_commit_timestamp").fetchone()[0] == "on"  # type: ignore[index]
        ts = "pg_xact_commit_timestamp(xmin)" if commit_ts else "finished_at"
        finished = dict(c.execute(render(f"SELECT job_id, extract(epoch FROM {ts})::float8 "
                                         "FROM __SCHEMA__.done_entries WHERE job_id = ANY(%s)", schema),
                                  ([j for j, _ in sent],)).fetchall())
    e2e_db = [finished[j] - ack for j, ack in sent if finished.get(j) is not None]
    pickup, e2e, missing = [], [], 0
    by_phase: dict[str, list[tuple[float, float, float]]] = {}
    for jid, ack in sent:
        rec = tr.get(jid)
        if rec is None:
            missing += 1
            continue
        started, committed = rec
        pickup.append(started - ack)
        e2e.append(committed - ack)
        if pin_window is not None:
            name = "pinned" if ack <= pin_window[1] else "reclaim"
            by_phase.setdefault(name, []).append((started - ack, committed - ack, committed))
    n = len(sent)
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(produced_s, 3), "jobs_per_s": round(len(e2e) / produced_s, 1),
        "enqueue_jobs_per_s": round(n / produced_s, 1), "target_rate": rate,
        "pickup_ms": _ms(percentiles(pickup)), "e2e_ms": _ms(percentiles(e2e)),
        "pickup_max_ms": round(max(pickup) * 1000, 3) if pickup else None,
        "e2e_max_ms": round(max(e2e) * 1000, 3) if e2e else None,
        "e2e_db_ms": _ms(percentiles(e2e_db)),
        "e2e_db_method": "completion row commit timestamp" if commit_ts else "done_entries.finished_at",
        "traced": len(e2e), "untraced": missing,
        "shm_pickup_ms": shm_hist["pickup"], "shm_e2e_ms": shm_hist["e2e"],
        "supervisor_exit": code, "cpu": cpu_res,
        "method": "per job: pickup = claimer's handler-start time - producer's enqueue commit ack; "
                  "e2e = completion COMMIT return time in the batcher - enqueue commit ack (trace hook); "
                  "e2e_db = done_entries.finished_at (start of the completing transaction) - enqueue ack",
    }
    if rss is not None:
        out["claimer_rss_kb"] = rss.summary()
    if pinned:
        phases = {}
        for name, rows in by_phase.items():
            commits = [c for _, _, c in rows]
            span = (max(commits) - min(commits)) if len(commits) > 1 else 0.0
            phases[name] = {"jobs": len(rows), "jobs_per_s": round(len(rows) / span, 1) if span else None,
                            "pickup_ms": _ms(percentiles([p for p, _, _ in rows])),
                            "e2e_ms": _ms(percentiles([e for _, e, _ in rows]))}
        pinned_dead = [s["dead_tuples"] for s in samples if s["phase"] == "pinned"]
        out.update({
            "pinned_seconds": seconds, "reclaim_seconds": reclaim_s, "phases": phases,
            "reader_xmin": reader_xmin[0] if reader_xmin else None,
            "dead_tuples_series": samples,
            "dead_tuples_max_pinned": max(pinned_dead) if pinned_dead else None,
            "dead_tuples_end_of_pin": pinned_dead[-1] if pinned_dead else None,
            "dead_tuples_end_of_reclaim": samples[-1]["dead_tuples"] if samples else None,
        })
    return out


def bench_latency(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    return _latency_run(args, dsn, schema, srv, pinned=False)


def bench_pinned_reader(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    return _latency_run(args, dsn, schema, srv, pinned=True)


SCENARIOS = {
    "drain": bench_drain,
    "bulk-enqueue": bench_bulk_enqueue,
    "concurrent-insert": bench_concurrent_insert,
    "latency": bench_latency,
    "pinned-reader": bench_pinned_reader,
}


# -- entry point ------------------------------------------------------------------------------


def _schema_for(args: argparse.Namespace) -> str:
    from awa_fast.storage.schema import validate_schema

    default = "bench_" + args.scenario.replace("-", "_")
    if getattr(args, "schema_given", False) and args.schema:
        name = validate_schema(args.schema)
        if not name.startswith("bench"):
            raise ConfigError(f"bench drops and re-creates its schema; {name!r} does not start with 'bench', "
                              "so it is refused (use e.g. --schema bench_mine)")
        return name
    return default


def results_dir() -> pathlib.Path:
    """``perf/results`` of the source tree (or of the current directory)."""
    here = pathlib.Path(__file__).resolve().parent.parent / "perf"
    base = here if here.is_dir() else pathlib.Path.cwd() / "perf"
    return base / "results"


def format_table(res: dict[str, Any]) -> str:
    def pct(v: Any) -> str:
        return "-" if not v else " / ".join(f"{v[k]:.2f}" for k in ("p50", "p95", "p99") if k in v)

    rows = [
        ("scenario", res["scenario"]),
        ("implementation", f"{res['impl']} (psycopg {res.get('psycopg_impl')})"),
        ("postgres", res["postgres_version"]),
        ("jobs", f"{res['jobs']:,}"),
        ("seconds", f"{res['seconds']:.3f}"),
        ("jobs/s", f"{res['jobs_per_s']:,.0f}" if res.get("jobs_per_s") else "-"),
        ("enqueue jobs/s", f"{res['enqueue_jobs_per_s']:,.0f}" if res.get("enqueue_jobs_per_s") else "-"),
        ("pickup ms p50/p95/p99", pct(res.get("pickup_ms"))),
        ("end-to-end ms p50/p95/p99", pct(res.get("e2e_ms"))),
    ]
    if res.get("enqueue_ms"):
        rows.append(("enqueue ms p50/p95/p99", pct(res["enqueue_ms"])))
    if res.get("db_span_s"):
        rows.append(("db span s (lower bound)", f"{res['db_span_s']:.3f} ({res['db_span_jobs_per_s']:,.0f}/s)"))
    rows.append(("dead tuples", f"{res['dead_tuples']:,}" + (f" ({res['dead_tuples'] / res['jobs']:.3f}/job)"
                                                             if res.get("jobs") else "")))
    if "dead_tuples_max_pinned" in res:
        rows.append(("dead tuples max pinned / end reclaim",
                     f"{res['dead_tuples_max_pinned']} / {res['dead_tuples_end_of_reclaim']}"))
        for name, ph in res.get("phases", {}).items():
            rows.append((f"  {name}: jobs/s, e2e p99 ms",
                         f"{ph['jobs_per_s']}, {ph['e2e_ms']['p99'] if ph['e2e_ms'] else '-'}"))
    rss = res.get("claimer_rss_kb")
    if rss:
        for pid, c in rss["per_claimer"].items():
            rows.append((f"rss kB {c['claimer']} pid {pid}",
                         f"first {c['first']:,}, 1/4 {c['quarter']:,}, last {c['last']:,}, max {c['max']:,}; "
                         f"growth {c['growth']:+,} ({c['slope_kb_per_min']} kB/min) over {c['samples']} samples"))
    cpu = res.get("cpu") or {}
    if cpu:
        rows.append(("cpu s: workers / postgres / bench / other",
                     f"{cpu.get('supervisor_cpu_s')} / {cpu.get('postgres_cpu_s')} / {cpu.get('bench_cpu_s')} / "
                     f"{cpu.get('other_cpu_s')} of {cpu.get('box_capacity_cpu_s')} in {cpu.get('window_s')}s"))
    rows.append(("loadavg (start -> end)", f"{res['loadavg_start']} -> {res['loadavg']}"))
    s = res["settings"]
    rows.append(("settings", ", ".join(f"{k}={v}" for k, v in s.items() if k != "server")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_bench(args: argparse.Namespace, dsn: str) -> int:
    """Run one scenario against ``dsn``; print a table (or JSON with --json). Returns the exit code."""
    import psycopg.pq

    scenario = args.scenario
    fn = SCENARIOS.get(scenario)
    if fn is None:
        raise ConfigError(f"unknown scenario {scenario!r}; use one of {', '.join(SCENARIOS)}")
    for name in ("jobs", "producers", "stripes", "concurrency", "batch"):
        if int(getattr(args, name)) < 1:
            raise ConfigError(f"--{name} must be at least 1")
    if float(args.rate) <= 0 or float(args.seconds) <= 0:
        raise ConfigError("--rate and --seconds must be positive")
    payload_bytes = getattr(args, "payload_bytes", None)
    if payload_bytes is not None:
        if scenario not in ("drain", "bulk-enqueue"):
            raise ConfigError("--payload-bytes applies to the drain and bulk-enqueue scenarios only")
        if not 1 <= int(payload_bytes) <= MAX_PAYLOAD_BYTES:
            raise ConfigError(f"--payload-bytes must be between 1 and {MAX_PAYLOAD_BYTES}")
    rss_every = float(getattr(args, "rss_every", 0.0) or 0.0)
    if rss_every < 0 or not math.isfinite(rss_every):
        raise ConfigError("--rss-every must be 0 (off) or a positive number of seconds")
    if rss_every and scenario not in ("latency", "pinned-reader"):
        raise ConfigError("--rss-every applies to the latency and pinned-reader scenarios only")
    schema = _schema_for(args)
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    srv = server_info(dsn)
    fresh_schema(dsn, schema)
    result = fn(args, dsn, schema, srv)
    dead = settled_dead_tuples(dsn, schema, started)
    res: dict[str, Any] = {
        "scenario": scenario,
        **result,
        "dead_tuples": dead["dead_tuples"],
        "dead_tuples_per_job": round(dead["dead_tuples"] / result["jobs"], 4) if result.get("jobs") else None,
        "dead_tuples_top": dead["top_tables"],
        "stats_backends_still_open": dead["backends_still_open"],
        "impl": awa_fast.__impl__,
        "psycopg_impl": psycopg.pq.__impl__,
        "awa_fast_version": awa_fast.__version__,
        "postgres_version": srv["version"],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "loadavg_start": load_start,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "schema": schema,
        "settings": {"jobs": args.jobs, "rate": args.rate, "seconds": args.seconds,
                     "concurrency": args.concurrency, "stripes": args.stripes, "batch": args.batch,
                     "producers": args.producers, "payload_bytes": payload_bytes, "rss_every": rss_every,
                     "server": srv["settings"]},
    }
    text = json.dumps(res, sort_keys=True, default=str)
    if getattr(args, "save", False):
        out_dir = results_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        path = out_dir / f"{scenario}-{stamp}.json"
        path.write_text(json.dumps(res, sort_keys=True, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"saved {path}", file=sys.stderr)
    if getattr(args, "json", False):
        print(text)
    else:
        print(format_table(res))
    ok = result.get("supervisor_exit") in (None, 0)
    if not ok:
        print(f"awa-fast bench: the supervisor exited with code {result.get('supervisor_exit')}", file=sys.stderr)
    return 0 if ok else 1

