"""Server time of one single-job enqueue: job_enqueue (0002..0004) against job_enqueue_v2 (0014).

One connection calls the two SQL functions in interleaved blocks (the order flips every block, so
load drifts hit both alike) on a freshly migrated schema, and reads each block's server execution
time per call from pg_stat_statements (track = top), plus the client round trip per call.

    python perf/enqueue_ab.py --home /tmp/some-home [--blocks 6] [--per-block 1000] [--durable]

The embedded server under ``--home`` must have pg_stat_statements in shared_preload_libraries
(``ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'`` and a restart); the schema
``enqueue_ab`` is dropped and created again. Without ``--durable`` the session runs with
synchronous_commit off, so the figure is CPU, not the WAL flush.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import psycopg

from awa_fast.embedded.servers import ensure_embedded
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render

SCHEMA = "enqueue_ab"
FUNCS = {"v1": "job_enqueue", "v2": "job_enqueue_v2"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=pathlib.Path, required=True, help="embedded server home")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=1000)
    ap.add_argument("--durable", action="store_true", help="synchronous_commit on (default off)")
    a = ap.parse_args()
    dsn = ensure_embedded(a.home)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        if not c.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone():
            c.execute("CREATE EXTENSION pg_stat_statements")
    migrate(dsn, SCHEMA)
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET synchronous_commit = " + ("on" if a.durable else "off"))
    conn.execute("SET pg_stat_statements.track = top")
    sql = {v: render(f"SELECT __SCHEMA__.{f}(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, "
                     "%s::timestamptz)", SCHEMA) for v, f in FUNCS.items()}
    args = ("q", 2, "k", '{"n": 0}', None, 25, None)
    for v in sql:  # lanes and cached plans before the first block
        for _ in range(200):
            conn.execute(sql[v], args)
    server: dict[str, list[float]] = {v: [] for v in sql}
    lat: dict[str, list[float]] = {v: [] for v in sql}
    for b in range(a.blocks):
        for v in (("v1", "v2") if b % 2 == 0 else ("v2", "v1")):
            conn.execute("SELECT pg_stat_statements_reset()")
            for _ in range(a.per_block):
                t0 = time.perf_counter()
                conn.execute(sql[v], args)
                lat[v].append(time.perf_counter() - t0)
            row = conn.execute("SELECT sum(total_exec_time) * 1000 / sum(calls) FROM pg_stat_statements "
                               "WHERE query LIKE %s", (f"%.{FUNCS[v]}(%",)).fetchone()
            server[v].append(float(row[0]) if row and row[0] is not None else float("nan"))
    conn.close()
    for v in sql:
        xs = sorted(lat[v])
        print(f"{FUNCS[v]:15s} server us/call median {statistics.median(server[v]):6.1f} "
              f"blocks {[round(x) for x in server[v]]} | round trip p50 {xs[len(xs) // 2] * 1e3:.3f} ms "
              f"p95 {xs[int(len(xs) * 0.95)] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
