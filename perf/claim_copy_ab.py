"""The claim's rows by COPY against by rows: client CPU, round trip and server time per claim, alternated.

    .venv/bin/python perf/claim_copy_ab.py --home /tmp/some-home [--rounds 12] [--batch 1024]

One connection on a private embedded server (``--home``; the script loads
pg_stat_statements there with a restart if it is not loaded), schema
``bench_claim_copy`` dropped and migrated. Two measurements, each alternating
the row path (``claim_rows``: binary cursor, fetchall, decode_snapshots) and
the COPY path (``claim_copy``) block by block, the order flipped every round:

* ``drain``: claims of ``--batch`` rows out of a deep backlog (committed,
  autocommit, as the claimer runs them); per job: the claiming thread's CPU
  (``time.thread_time``: Python, psycopg, libpq and the kernel's socket reads)
  and the wall time of the call; the server's execution time (pg_stat_statements) and its backend's
  CPU (``/proc/PID/schedstat``, the server is local) per job.
* ``idle``: one job enqueued, then one claim asking for ``--idle-limit`` rows
  (the claimer's floor size) that returns it; per call: wall time, client CPU,
  the server's execution time from pg_stat_statements (track = top) and the
  claiming backend's CPU (the enqueues run on the client's own connection).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

import psycopg

from awa_fast.client import Client
from awa_fast.embedded.servers import ensure_embedded, stop_embedded
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.claim_read import claim_copy, claim_rows
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render

SCHEMA = "bench_claim_copy"
QUEUE = "q"


def server(home: pathlib.Path) -> str:
    dsn = ensure_embedded(home)
    with psycopg.connect(dsn, autocommit=True) as c:
        loaded = c.execute("SHOW shared_preload_libraries").fetchone()
        if not loaded or "pg_stat_statements" not in str(loaded[0]):
            c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            reload = True
        else:
            reload = False
    if reload:
        stop_embedded(home)
        dsn = ensure_embedded(home)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return dsn


def backend_cpu_s(pid: int) -> float:
    """CPU time of a local server backend so far (/proc/PID/schedstat: ns on CPU), or NaN if unreadable."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=pathlib.Path, required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--per-block", type=int, default=4, help="drain claims per arm and round")
    ap.add_argument("--idle-limit", type=int, default=64)
    ap.add_argument("--idle-calls", type=int, default=200, help="idle claims per arm and round")
    a = ap.parse_args()
    dsn = server(a.home)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(render("DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE", SCHEMA))
    migrate(dsn, SCHEMA)
    st = Storage(SCHEMA)
    client = Client(dsn, SCHEMA)
    conn = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:claim_copy_ab")
    use_raw_jsonb(conn)
    st.session_utc(conn)
    arms = {"rows": lambda n: claim_rows(conn, st.q["lane_claim"], QUEUE, n, 0, 1),
            "copy": lambda n: claim_copy(conn, st.q["lane_claim_copy"], QUEUE, n, 0, 1)}
    print(f"pid {os.getpid()} load {os.getloadavg()}")

    need = a.rounds * 2 * a.per_block * a.batch
    client.enqueue_many("k", ({"n": i, "pad": "x" * 40} for i in range(need + 2 * a.batch)), queue=QUEUE,
                        chunk=50_000)
    for name in arms:  # plans cached, connection warm
        arms[name](a.batch)
    conn.execute("SET pg_stat_statements.track = top")
    pattern = {"rows": "%claim_batch_v3(%", "copy": "COPY (SELECT%claim_batch_v3(%"}
    server_q = ("SELECT sum(total_exec_time) * 1000 / sum(calls), sum(calls) FROM pg_stat_statements"
                " WHERE query LIKE %s AND (query LIKE 'COPY%%') = %s")
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    wall: dict[str, list[float]] = {k: [] for k in arms}
    dsrv: dict[str, list[float]] = {k: [] for k in arms}
    bcpu: dict[str, list[float]] = {k: [] for k in arms}
    backend = conn.info.backend_pid
    for r in range(a.rounds):
        for name in (("rows", "copy") if r % 2 == 0 else ("copy", "rows")):
            conn.execute("SELECT pg_stat_statements_reset()")
            b0 = backend_cpu_s(backend)
            for _ in range(a.per_block):
                c0, w0 = time.thread_time(), time.perf_counter()
                snaps, _ = arms[name](a.batch)
                c1, w1 = time.thread_time(), time.perf_counter()
                assert len(snaps) == a.batch, len(snaps)
                cpu[name].append((c1 - c0) / a.batch * 1e6)
                wall[name].append((w1 - w0) / a.batch * 1e6)
            bcpu[name].append((backend_cpu_s(backend) - b0) / (a.per_block * a.batch) * 1e6)
            row = conn.execute(server_q, (pattern[name], name == "copy")).fetchone()
            dsrv[name].append(float(row[0]) / a.batch if row and row[0] is not None else float("nan"))
    print(f"drain, claims of {a.batch} (load {os.getloadavg()[0]:.2f}): per job, median of "
          f"{a.rounds * a.per_block} claims")
    for name in arms:
        print(f"  {name}: client CPU {statistics.median(cpu[name]):.3f} us  wall {statistics.median(wall[name]):.3f} us"
              f"  server exec {statistics.median(dsrv[name]):.3f} us  backend CPU {statistics.median(bcpu[name]):.3f} us"
              f"  (CPU quartiles {[round(x, 3) for x in statistics.quantiles(cpu[name], n=4)]})")

    # idle: drain what is left, then one job per claim
    while arms["copy"](a.batch)[0]:
        pass
    srv: dict[str, list[float]] = {k: [] for k in arms}
    rtt: dict[str, list[float]] = {k: [] for k in arms}
    icpu: dict[str, list[float]] = {k: [] for k in arms}
    ibcpu: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (("rows", "copy") if r % 2 == 0 else ("copy", "rows")):
            conn.execute("SELECT pg_stat_statements_reset()")
            ib0 = backend_cpu_s(backend)
            for _ in range(a.idle_calls):
                client.enqueue("k", {"n": 0}, queue=QUEUE)
                c0, w0 = time.thread_time(), time.perf_counter()
                snaps, _ = arms[name](a.idle_limit)
                c1, w1 = time.thread_time(), time.perf_counter()
                assert len(snaps) == 1, len(snaps)
                rtt[name].append((w1 - w0) * 1e3)
                icpu[name].append((c1 - c0) * 1e6)
            ibcpu[name].append((backend_cpu_s(backend) - ib0) / a.idle_calls * 1e6)
            row = conn.execute(server_q, (pattern[name], name == "copy")).fetchone()
            srv[name].append(float(row[0]) if row and row[0] is not None else float("nan"))
    print(f"idle, one job claimed by a claim of up to {a.idle_limit} (load {os.getloadavg()[0]:.2f}): "
          f"{a.rounds} blocks of {a.idle_calls}")
    for name in arms:
        xs = sorted(rtt[name])
        print(f"  {name}: server {statistics.median(srv[name]):.1f} us/call (blocks {[round(x) for x in srv[name]]}),"
              f" round trip p50 {xs[len(xs) // 2]:.3f} ms p95 {xs[int(len(xs) * 0.95)]:.3f} ms,"
              f" client CPU p50 {statistics.median(icpu[name]):.1f} us, backend CPU {statistics.median(ibcpu[name]):.1f} us/call")
    conn.close()
    client.close()


if __name__ == "__main__":
    main()
