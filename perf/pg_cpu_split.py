"""Where PostgreSQL's CPU goes during a drain: per server process, and per statement.

Runs the bench's own ``drain`` scenario (``awa-fast bench drain``: the same
enqueue, supervisor and timing window) with a meter that also splits the
server's CPU over that window by process, named from ``pg_stat_activity``
(``application_name`` for client backends, ``backend_type`` for the server's
own processes). Short-lived children (autovacuum workers that come and go
inside the window) are read from ``/proc`` every 50 ms, and what no sample
saw is recovered from the postmaster's ``cutime + cstime`` (the CPU of its
reaped children). Nothing is asked of the server during the window except
the one ``pg_stat_activity`` read at each end.

With ``--statements`` it also reads ``pg_stat_statements`` over the window
(reset at its start): calls, exec and plan time, rows, shared blocks and WAL
per statement, and per drained job. The embedded server under ``--home``
then needs the module preloaded; ``--preload`` sets
``shared_preload_libraries`` with ALTER SYSTEM and restarts it first.

    python perf/pg_cpu_split.py --home /tmp/NAME-pg --schema bench_NAME [--jobs 200000]
        [--stripes 2] [--concurrency 64] [--batch 0] [--statements] [--preload] [--perf FILE] [--json]

Categories: ``claimer`` (awa_fast:claimer:*, the claim connections),
``batcher`` (awa_fast:batcher*, completions), ``heartbeat``, ``listen``,
``maintenance`` (the leader), ``supervisor``, ``bench`` (the bench's own
connection), ``autovacuum worker``, ``autovacuum launcher``, ``walwriter``,
``checkpointer``, ``background writer``, ``io worker``, ... (backend_type),
``reaped children`` (children that exited unseen), ``postmaster``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg

import awa_fast.bench.drain as drain
from awa_fast.bench import run as bench_run
from awa_fast.bench.meters import CpuMeter, proc_table
from awa_fast.embedded.servers import ensure_embedded, stop_embedded

_CLK = os.sysconf("SC_CLK_TCK")
_APP = "awa_fast:bench:pgsplit"


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own cpu s, reaped children's cpu s) of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK, (int(rest[13]) + int(rest[14])) / _CLK


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def category(app: str, backend_type: str, cmd: str) -> str:
    """The bucket a server process's CPU is counted in."""
    if backend_type == "client backend" or app:
        for prefix, name in (("awa_fast:claimer", "claimer"), ("awa_fast:batcher", "batcher"),
                             ("awa_fast:heartbeat", "heartbeat"), ("awa_fast:listen", "listen"),
                             ("awa_fast:maintenance", "maintenance"), ("awa_fast:supervisor", "supervisor"),
                             (_APP, "pgsplit meter"), ("awa_fast:bench", "bench")):
            if app.startswith(prefix):
                return name
        return f"client:{app or '?'}"
    if backend_type:
        return backend_type
    # not in pg_stat_activity at either end: name it from its process title
    title = cmd.removeprefix("postgres: ")
    for t in ("autovacuum worker", "autovacuum launcher", "walwriter", "checkpointer", "background writer",
              "io worker", "logical replication launcher", "walsummarizer"):
        if t in title:
            return t
    return "unnamed:" + title[:40]


class SplitMeter(CpuMeter):
    """The bench's CpuMeter, plus the server's CPU per process and pg_stat_statements over the window."""

    def __init__(self, postmaster: int | None, dsn: str, statements: bool, perf: str | None = None,
                 perf_of: tuple[str, ...] = ("claimer", "batcher")) -> None:
        super().__init__(postmaster)
        self.perf, self.perf_of = perf, perf_of
        self._perf_proc: subprocess.Popen[bytes] | None = None
        self.dsn, self.statements = dsn, statements
        self._conn = psycopg.connect(dsn, autocommit=True, application_name=_APP)
        self._seen: dict[int, tuple[float, str]] = {}  # pid -> (last cpu s, cmdline) while sampling
        self._first: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self.split: dict[str, Any] | None = None

    def _activity(self) -> None:
        for pid, app, btype in self._conn.execute(
                "SELECT pid, coalesce(application_name, ''), coalesce(backend_type, '') FROM pg_stat_activity"):
            self._names.setdefault(pid, category(app, btype, ""))

    def _perf_start(self) -> None:
        pids = [p for p, name in self._names.items() if name in self.perf_of]
        if self.perf and pids:
            self._perf_proc = subprocess.Popen(
                ["perf", "record", "-q", "--call-graph", "dwarf,16384", "-F", "997", "-o", self.perf,
                 "-p", ",".join(map(str, pids))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _perf_stop(self) -> None:
        if self._perf_proc is not None:
            self._perf_proc.send_signal(signal.SIGINT)
            self._perf_proc.wait(60)

    def _children(self) -> dict[int, float]:
        table = proc_table()
        return {p: cpu for p, (ppid, cpu) in table.items() if ppid == self.postmaster}

    def _sample_loop(self) -> None:
        while not self._stop_evt.wait(0.05):
            for pid, cpu in self._children().items():
                if pid not in self._seen:
                    self._first.setdefault(pid, 0.0)
                    self._seen[pid] = (cpu, _cmdline(pid))
                else:
                    self._seen[pid] = (cpu, self._seen[pid][1])

    def start(self) -> None:
        assert self.postmaster is not None
        self._activity()
        if self.statements:
            self._conn.execute("SELECT pg_stat_statements_reset()")
        st = _stat(self.postmaster)
        self._pm0 = st[1:] if st else (0.0, 0.0)
        for pid, cpu in self._children().items():
            self._first[pid] = cpu
            self._seen[pid] = (cpu, _cmdline(pid))
        self._perf_start()
        super().start()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any] | None:
        res = super().stop()
        self._perf_stop()
        self._stop_evt.set()
        if self._thread:
            self._thread.join()
        end = self._children()
        assert self.postmaster is not None
        st = _stat(self.postmaster)
        pm1 = st[1:] if st else (0.0, 0.0)
        stmts = self._pss() if self.statements else None
        self._activity()
        self._conn.close()
        buckets: dict[str, float] = {}
        pids: dict[str, list[int]] = {}
        sampled_gone = 0.0
        for pid, (last, cmd) in self._seen.items():
            cpu = end.get(pid, last)
            used = cpu - self._first.get(pid, 0.0)
            name = self._names.get(pid) or category("", "", cmd)
            buckets[name] = buckets.get(name, 0.0) + used
            pids.setdefault(name, []).append(pid)
            if pid not in end:
                sampled_gone += last - self._first.get(pid, 0.0)
        reaped = (pm1[1] - self._pm0[1]) - sampled_gone  # exited children's CPU no sample caught
        buckets["postmaster"] = pm1[0] - self._pm0[0]
        if reaped > 0.005:
            buckets["reaped children (unsampled)"] = reaped
        total = sum(buckets.values())
        self.split = {"server_cpu_s": round(total, 3),
                      "by_process": {k: round(v, 3) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
                      "statements": stmts, "pids": pids}
        return res

    def _pss(self) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT (CASE WHEN toplevel THEN '' ELSE '[nested] ' END) "
            "|| regexp_replace(left(query, 90), '\\s+', ' ', 'g'), calls, total_exec_time, total_plan_time, "
            "plans, rows, shared_blks_hit, shared_blks_read, shared_blks_dirtied, shared_blks_written, "
            "wal_records, wal_fpi, wal_bytes FROM pg_stat_statements WHERE calls > 0 "
            "ORDER BY total_exec_time + total_plan_time DESC LIMIT 25").fetchall()
        keys = ("query", "calls", "exec_ms", "plan_ms", "plans", "rows", "blks_hit", "blks_read",
                "blks_dirtied", "blks_written", "wal_records", "wal_fpi", "wal_bytes")
        return [dict(zip(keys, (r[0], *(float(x) for x in r[1:])), strict=True)) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=pathlib.Path, required=True)
    ap.add_argument("--schema", required=True)
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--stripes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--statements", action="store_true", help="read pg_stat_statements over the window")
    ap.add_argument("--nested", action="store_true", help="with --statements: also the statements inside functions")
    ap.add_argument("--preload", action="store_true",
                    help="preload pg_stat_statements in the server under --home (ALTER SYSTEM + restart)")
    ap.add_argument("--perf", metavar="FILE", help="perf record (dwarf call graphs) the claim and completion "
                    "backends over the window into FILE")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    dsn = ensure_embedded(a.home)
    if a.preload:
        with psycopg.connect(dsn, autocommit=True) as c:
            have = c.execute("SHOW shared_preload_libraries").fetchone()
            if not have or "pg_stat_statements" not in str(have[0]):
                c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
                restart = True
            else:
                restart = False
        if restart:
            stop_embedded(a.home)
            dsn = ensure_embedded(a.home)
    if a.statements:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            c.execute(f"ALTER SYSTEM SET pg_stat_statements.track = '{'all' if a.nested else 'top'}'")
            c.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
            c.execute("SELECT pg_reload_conf()")
    else:
        with psycopg.connect(dsn, autocommit=True) as c:
            have = c.execute("SHOW shared_preload_libraries").fetchone()
            if have and "pg_stat_statements" in str(have[0]):  # loaded: make it track nothing
                c.execute("ALTER SYSTEM SET pg_stat_statements.track = 'none'")
                c.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = off")
                c.execute("SELECT pg_reload_conf()")
    meters: list[SplitMeter] = []

    def factory(postmaster: int | None) -> SplitMeter:
        m = SplitMeter(postmaster, dsn, a.statements, a.perf)
        meters.append(m)
        return m

    drain.CpuMeter = factory  # type: ignore[assignment,misc]
    load0 = os.getloadavg()
    args = argparse.Namespace(scenario="drain", jobs=a.jobs, stripes=a.stripes, concurrency=a.concurrency,
                              batch=a.batch, producers=1, rate=1.0, seconds=1.0, schema=a.schema,
                              schema_given=True, json=True, save=None, metrics=None)
    schema = bench_run.schema_for(args)
    srv = bench_run.server_info(dsn)
    bench_run.fresh_schema(dsn, schema)
    started = time.time()
    res = drain.bench_drain(args, dsn, schema, srv)
    dead = bench_run.settled_dead_tuples(dsn, schema, started)
    m = meters[-1]
    assert m.split is not None
    n = res["jobs"]
    cpu = res["cpu"]
    out = {"jobs": n, "jobs_per_s": res["jobs_per_s"], "seconds": res["seconds"],
           "claim_calls": res["claim_calls"], "empty_claims": res["empty_claims"], "flushes": res["flushes"],
           "dead_tuples": dead["dead_tuples"], "load_start": [round(x, 2) for x in load0],
           "load_end": [round(x, 2) for x in os.getloadavg()], "cpu": cpu,
           "server_us_per_job": round(m.split["server_cpu_s"] * 1e6 / n, 3),
           "supervisor_us_per_job": round((cpu.get("supervisor_cpu_s") or 0) * 1e6 / n, 3),
           "by_process_us_per_job": {k: round(v * 1e6 / n, 3) for k, v in m.split["by_process"].items()},
           "by_process_cpu_s": m.split["by_process"], "pids": m.split["pids"]}
    if m.split["statements"] is not None:
        out["statements"] = [{**s, "us_per_job": round((s["exec_ms"] + s["plan_ms"]) * 1e3 / n, 3)}
                             for s in m.split["statements"]]
    if a.json:
        print(json.dumps(out, default=str))
        return
    print(f"{n} jobs {out['jobs_per_s']:.0f}/s load {out['load_start']} -> {out['load_end']} "
          f"claims {out['claim_calls']} (empty {out['empty_claims']}) flushes {out['flushes']} "
          f"dead {out['dead_tuples']}")
    print("pids " + " ".join(f"{k}={','.join(map(str, v))}" for k, v in out["pids"].items()
                             if k in ("claimer", "batcher", "maintenance")))
    print(f"server {out['server_us_per_job']:.2f} us/job, supervisor {out['supervisor_us_per_job']:.2f} us/job")
    for k, v in out["by_process_us_per_job"].items():
        print(f"  {k:32s} {v:7.3f} us/job  ({m.split['by_process'][k]:.3f} s)")
    for s in out.get("statements", []):
        print(f"  {s['us_per_job']:7.3f} us/job calls {s['calls']:7.0f} exec {s['exec_ms']:9.1f} ms "
              f"plan {s['plan_ms']:7.1f} ms plans {s['plans']:6.0f} rows {s['rows']:8.0f} "
              f"hit {s['blks_hit']:8.0f} dirt {s['blks_dirtied']:6.0f} wal {s['wal_bytes'] / n:6.1f} B/job "
              f"fpi {s['wal_fpi']:5.0f} | {s['query']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
