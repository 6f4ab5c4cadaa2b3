"""The 10-producer scenario's floor, and where each producer's time goes, arm by arm on one server.

Each arm runs ``--processes`` processes (spawned, not threads), each with its own
autocommit connection, one durable transaction per call, all inside one shared
time window (no workers run, as in ``awa-fast bench concurrent-insert``):

* ``plain``: a prepared one-row ``INSERT`` into a plain table (``<schema>_floor.commits``);
  the floor: what a durable commit per call costs here, client and server;
* ``v3``: ``SELECT job_enqueue_v3(...)`` prepared through psycopg, the statement
  ``Storage.job_enqueue`` sends, with the arguments ``App.enqueue`` builds, no App layer;
* ``v2``: the same statement calling ``job_enqueue_v2`` (migration 0014, the previous
  runtime's single enqueue: its NOTIFY decision probes the claim ring's receipts);
* ``fn:NAME``: the same statement calling the schema's function NAME instead (an experiment
  created by hand with ``job_enqueue_v3``'s signature);
* ``app``: ``App.enqueue`` exactly as the bench's producers call it (pool, checks,
  encoding, ``Storage.job_enqueue``).

Beside jobs/s, each arm reports counts that do not depend on the load: the
producers' CPU per call (``time.process_time`` in each producer), their backends'
CPU per call (``/proc/<pid>/stat`` utime and stime, read by this process),
voluntary and involuntary context switches per call of both (``/proc/<pid>/status``),
the server's statement count and mean execution time (``pg_stat_statements``, when
it is loaded), the backends' state sampled every 10 ms (``pg_stat_activity``:
idle waiting for the client, on CPU, or the wait event), and the box's busy CPU.

    python perf/producers_floor.py --home /tmp/NAME-pg --schema bench_NAME [--arms plain,v2,v3,app]
        [--processes 10] [--seconds 10] [--rounds 1] [--json] [--save]

``--home`` is an embedded server (started if needed; with ``--stat-statements`` it
gets ``pg_stat_statements`` preloaded, which costs one restart); ``--dsn`` any
server (local, so its backends' ``/proc`` entries are readable). The schema is
dropped and migrated anew (its name must start with ``bench``). Rounds alternate
the order of the arms (ABC, CBA, ...).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

import psycopg

KIND = "bench.noop"
QUEUE = "bench"
ARMS = ("plain", "v2", "v3", "app")
WARM_CALLS = 50
_CLK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return int(rest[11]) / _CLK, int(rest[12]) / _CLK


def _proc_ctxt(pid: int | str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of one process, from /proc/<pid>/status."""
    vol = invol = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol = int(line.split()[1])
    return vol, invol


def _box_busy() -> tuple[float, float]:
    with open("/proc/stat", encoding="ascii") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    total = sum(parts[:8])
    return (total - parts[3] - parts[4]) / _CLK, total / _CLK


# -- the producers (run in spawned processes) -----------------------------------------------


def _caller(arm: str, dsn: str, schema: str) -> tuple[Any, Any, Any]:
    """(call, backend pid, close) for one arm: ``call()`` is one durable transaction."""
    if arm == "app":
        from awa_fast.app import App

        app = App(dsn=dsn, schema=schema)
        with app._pool().connection() as c:  # the one connection a single-threaded producer uses
            pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        enqueue = app.enqueue
        args = {"n": 0}

        def call_app() -> None:
            enqueue(KIND, args, queue=QUEUE)

        return call_app, pid, app.close
    conn = psycopg.connect(dsn, autocommit=True, application_name=f"awa_fast:producers_floor:{arm}")
    pid = conn.pgconn.backend_pid
    if arm == "plain":
        stmt = f'INSERT INTO "{schema}_floor".commits (id) VALUES (%s)'
        n = [0]

        def call_plain() -> None:
            n[0] += 1
            conn.execute(stmt, (n[0],), prepare=True)

        return call_plain, pid, conn.close
    from awa_fast.client import PRIORITY_DEFAULT
    from awa_fast.storage import Storage
    from awa_fast.storage.types import RawJson

    q = Storage(schema).q["job_enqueue"]
    function = {"v2": "job_enqueue_v2", "v3": "job_enqueue_v3"}.get(arm) or arm.removeprefix("fn:")
    assert ".job_enqueue_v3(" in q, "Storage's single enqueue is no longer job_enqueue_v3: update the arms"
    q = q.replace(".job_enqueue_v3(", "." + function + "(")  # v2, or an experiment of the same signature
    params = (QUEUE, PRIORITY_DEFAULT, KIND, RawJson(b'{"n":0}'), None, 25, None)

    def call_function() -> None:
        conn.execute(q, params, prepare=True).fetchone()

    return call_function, pid, conn.close


def producer(arm: str, dsn: str, schema: str, window: Any, out: Any, ready: Any) -> None:
    """One producer: warm up, report its backend, then call in a loop inside the window."""
    call, backend, close = _caller(arm, dsn, schema)
    for _ in range(WARM_CALLS):
        call()
    ready.put((os.getpid(), backend))
    while window[0] == 0.0:
        time.sleep(0.002)
    start_at, stop_at = window[0], window[1]
    while time.time() < start_at:
        time.sleep(0.0005)
    cpu0, ctx0 = time.process_time(), _proc_ctxt("self")
    n = 0
    while time.time() < stop_at:
        call()
        n += 1
    cpu1, ctx1 = time.process_time(), _proc_ctxt("self")
    out.put((n, cpu1 - cpu0, ctx1[0] - ctx0[0], ctx1[1] - ctx0[1]))
    while window[2] == 0.0:  # the parent reads this backend's /proc counters first
        time.sleep(0.002)
    close()


# -- one arm ------------------------------------------------------------------------------


class _Sampler(threading.Thread):
    """pg_stat_activity of the producers' backends every 10 ms: one state label per backend and sample."""

    def __init__(self, dsn: str, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:producers_floor:sampler")
        self.pids = pids
        self.seen: Counter[str] = Counter()
        self.stop_at = 0.0
        self.start_at = 0.0

    def run(self) -> None:
        while time.time() < self.start_at:
            time.sleep(0.001)
        while time.time() < self.stop_at:
            for state, wtype, wevent in self.conn.execute(
                    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity WHERE pid = ANY(%s)",
                    (self.pids,), prepare=True):
                if state == "idle" and wtype == "Client":
                    self.seen["idle (waiting for the client)"] += 1
                elif wtype is None:
                    self.seen["on CPU"] += 1
                else:
                    self.seen[f"{wtype} {wevent}"] += 1
            time.sleep(0.01)
        self.conn.close()


def _statements(conn: psycopg.Connection) -> list[tuple[str, int, float]]:
    """The statements with the most execution time (nested ones too when pg_stat_statements.track = all)."""
    try:
        rows = conn.execute("SELECT query, calls, total_exec_time FROM pg_stat_statements "
                            "WHERE query !~* '(pg_stat_|pg_backend_pid)' "
                            "ORDER BY total_exec_time DESC LIMIT 12").fetchall()
    except psycopg.Error:
        return []
    return [(" ".join(q.split()), int(c), float(t)) for q, c, t in rows]


def _functions(conn: psycopg.Connection, schema: str) -> dict[str, tuple[int, float, float]]:
    """name -> (calls, total ms, self ms) of the schema's functions (needs track_functions = all)."""
    rows = conn.execute("SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
                        "WHERE schemaname = %s", (schema,)).fetchall()
    return {n: (int(c), float(t), float(st)) for n, c, t, st in rows}


def run_arm(arm: str, dsn: str, schema: str, processes: int, seconds: float, stats: bool) -> dict[str, Any]:
    """One arm: ``processes`` producers over one ``seconds`` window; the counts per call."""
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    window = ctx.Array("d", [0.0, 0.0, 0.0])  # start, stop, backends read (the producers may disconnect)
    procs = [ctx.Process(target=producer, args=(arm, dsn, schema, window, out, ready), daemon=True)
             for _ in range(processes)]
    for p in procs:
        p.start()
    ids = [ready.get(timeout=120) for _ in procs]
    backends = [b for _, b in ids]
    sampler = _Sampler(dsn, backends)
    admin = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:producers_floor")
    if stats:
        admin.execute("SELECT pg_stat_statements_reset()")
    admin.execute("SELECT pg_stat_clear_snapshot()")
    funcs0 = _functions(admin, schema)
    start_at = time.time() + 0.3
    stop_at = start_at + seconds
    sampler.start_at, sampler.stop_at = start_at, stop_at
    sampler.start()
    load0 = os.getloadavg()[0]
    while time.time() < start_at - 0.05:
        time.sleep(0.005)
    b_cpu0 = {b: _proc_cpu(b) for b in backends}
    b_ctx0 = {b: _proc_ctxt(b) for b in backends}
    box0 = _box_busy()
    window[1] = stop_at
    window[0] = start_at
    results = [out.get(timeout=seconds + 60) for _ in procs]  # each producer stops at stop_at
    box1 = _box_busy()
    b_cpu1 = {b: _proc_cpu(b) for b in backends}
    b_ctx1 = {b: _proc_ctxt(b) for b in backends}
    window[2] = 1.0
    sampler.join()
    for p in procs:
        p.join(10)
    stmts = _statements(admin) if stats else []
    time.sleep(0.6)  # backends report function counters at most every 500 ms (and when they exit)
    admin.execute("SELECT pg_stat_clear_snapshot()")
    funcs1 = _functions(admin, schema)
    admin.close()
    calls = sum(r[0] for r in results)
    per = 1e6 / max(calls, 1)
    b_user = sum(b_cpu1[b][0] - b_cpu0[b][0] for b in backends if b in b_cpu1)
    b_sys = sum(b_cpu1[b][1] - b_cpu0[b][1] for b in backends if b in b_cpu1)
    total_samples = sum(sampler.seen.values()) or 1
    return {
        "arm": arm, "processes": processes, "seconds": seconds, "calls": calls,
        "calls_per_s": round(calls / seconds, 1),
        "client_cpu_us_per_call": round(sum(r[1] for r in results) * per, 1),
        "backend_cpu_us_per_call": round((b_user + b_sys) * per, 1),
        "backend_user_us_per_call": round(b_user * per, 1),
        "backend_sys_us_per_call": round(b_sys * per, 1),
        "client_vol_ctxt_per_call": round(sum(r[2] for r in results) / max(calls, 1), 2),
        "client_invol_ctxt_per_call": round(sum(r[3] for r in results) / max(calls, 1), 2),
        "backend_vol_ctxt_per_call": round(sum(b_ctx1[b][0] - b_ctx0[b][0] for b in backends if b in b_ctx1)
                                           / max(calls, 1), 2),
        "backend_invol_ctxt_per_call": round(sum(b_ctx1[b][1] - b_ctx0[b][1] for b in backends if b in b_ctx1)
                                             / max(calls, 1), 2),
        "box_busy_cpu_s": round(box1[0] - box0[0], 2), "box_capacity_cpu_s": round(box1[1] - box0[1], 2),
        "backend_states": {k: round(v / total_samples, 3) for k, v in sampler.seen.most_common()},
        "statements": [{"query": q[:90], "calls": c, "mean_us": round(t * 1000 / max(c, 1), 1)}
                       for q, c, t in stmts],
        "functions": {n: {"calls_per_call": round((c - funcs0.get(n, (0, 0.0, 0.0))[0]) / max(calls, 1), 3),
                          "total_us_per_call": round((t - funcs0.get(n, (0, 0.0, 0.0))[1]) * 1000 / max(calls, 1), 1),
                          "self_us_per_call": round((st - funcs0.get(n, (0, 0.0, 0.0))[2]) * 1000 / max(calls, 1), 1)}
                      for n, (c, t, st) in funcs1.items() if c > funcs0.get(n, (0, 0.0, 0.0))[0]},
        "per_producer": [r[0] for r in results],
        "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
    }


def prepare(dsn: str, schema: str) -> None:
    """A fresh awa-fast schema and the floor's plain table."""
    from awa_fast.bench.run import fresh_schema

    fresh_schema(dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}_floor" CASCADE')
        c.execute(f'CREATE SCHEMA "{schema}_floor"')
        c.execute(f'CREATE TABLE "{schema}_floor".commits (id bigint, at timestamptz DEFAULT now())')


def plain_commits_per_s(dsn: str, schema: str, processes: int, seconds: float) -> float:
    """The plain arm alone (for perf/floor.py): durable one-row commits per second of ``processes`` processes."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}_floor"')
        c.execute(f'CREATE TABLE IF NOT EXISTS "{schema}_floor".commits (id bigint, at timestamptz DEFAULT now())')
    try:
        return float(run_arm("plain", dsn, schema, processes, seconds, False)["calls_per_s"])
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}_floor" CASCADE')


def _server(args: argparse.Namespace) -> str:
    if args.dsn:
        return str(args.dsn)
    from awa_fast.embedded.servers import ensure_embedded, stop_embedded

    home = pathlib.Path(args.home)
    dsn = ensure_embedded(home)
    if args.stat_statements:
        with psycopg.connect(dsn, autocommit=True) as c:
            loaded = c.execute("SHOW shared_preload_libraries").fetchone()[0]  # type: ignore[index]
            if "pg_stat_statements" not in loaded:
                c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        if "pg_stat_statements" not in loaded:
            stop_embedded(home)
            dsn = ensure_embedded(home)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            if args.detail:  # nested statements and per-function time (both cost a little per call)
                c.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
                c.execute("ALTER SYSTEM SET track_functions = 'all'")
            else:
                c.execute("ALTER SYSTEM RESET pg_stat_statements.track")
                c.execute("ALTER SYSTEM RESET track_functions")
            c.execute("SELECT pg_reload_conf()")
    return dsn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="perf/producers_floor.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn")
    ap.add_argument("--home", default="/tmp/producers-floor-pg")
    ap.add_argument("--schema", default="bench_producers_floor")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--processes", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--stat-statements", action="store_true", help="preload pg_stat_statements (embedded only)")
    ap.add_argument("--detail", action="store_true",
                    help="with --stat-statements: track nested statements and function times")
    ap.add_argument("--no-fresh", action="store_true", help="keep the schema (it must be migrated)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", action="store_true", help="write perf/results/producers-floor-<timestamp>.json")
    a = ap.parse_args(argv)
    if not a.schema.startswith("bench"):
        ap.error("--schema must start with 'bench'")
    arms = [x for x in a.arms.split(",") if x]
    if any(x not in ARMS and not x.startswith("fn:") for x in arms):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    dsn = _server(a)
    if not a.no_fresh:
        prepare(dsn, a.schema)
    with psycopg.connect(dsn, autocommit=True) as c:
        stats = a.stat_statements or bool(c.execute(
            "SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone())
        version = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            res = run_arm(arm, dsn, a.schema, a.processes, a.seconds, stats)
            res["round"] = r
            runs.append(res)
            if not a.json:
                print(_line(res), file=sys.stderr)
    summary = {arm: {k: statistics.median(x[k] for x in runs if x["arm"] == arm)
                     for k in ("calls_per_s", "client_cpu_us_per_call", "backend_cpu_us_per_call")}
               for arm in arms}
    doc = {"bench": "producers_floor", "postgres_version": version, "runs": runs, "median": summary,
           "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu_count": os.cpu_count()}
    if a.save:
        d = pathlib.Path(__file__).resolve().parent / "results"
        d.mkdir(exist_ok=True)
        path = d / f"producers-floor-{dt.datetime.now().strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        print(f"saved {path}", file=sys.stderr)
    if a.json:
        print(json.dumps(doc, sort_keys=True))
    else:
        for arm, s in summary.items():
            print(f"median {arm:5s}: {s['calls_per_s']:8,.0f} calls/s, client {s['client_cpu_us_per_call']:6.1f} "
                  f"us/call, backend {s['backend_cpu_us_per_call']:6.1f} us/call")
    return 0


def _line(r: dict[str, Any]) -> str:
    states = ", ".join(f"{k} {v:.0%}" for k, v in list(r["backend_states"].items())[:4])
    st = "; ".join(f"{s['query'][:40]!r} {s['calls']} x {s['mean_us']} us" for s in r["statements"][:2])
    return (f"{r['arm']:5s} r{r['round']}: {r['calls_per_s']:8,.0f}/s | client {r['client_cpu_us_per_call']:6.1f} us "
            f"ctx {r['client_vol_ctxt_per_call']}+{r['client_invol_ctxt_per_call']} | backend "
            f"{r['backend_user_us_per_call']:.0f}u+{r['backend_sys_us_per_call']:.0f}s us ctx "
            f"{r['backend_vol_ctxt_per_call']}+{r['backend_invol_ctxt_per_call']} | box "
            f"{r['box_busy_cpu_s']}/{r['box_capacity_cpu_s']} | load {r['loadavg_start']}->{r['loadavg_end']} | "
            f"{states} | {st}")


if __name__ == "__main__":
    raise SystemExit(main())
