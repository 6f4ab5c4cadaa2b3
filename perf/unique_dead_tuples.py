"""Dead tuples left by unique jobs: N unique jobs through the real runtime, then count.

    python perf/unique_dead_tuples.py                  # 100,000 jobs on a private PostgreSQL
    python perf/unique_dead_tuples.py --jobs 20000 --dsn DSN

For each mode (``plain``: no unique; ``unique``: every job ``Unique()``;
``unique-no-autovacuum``: the same with autovacuum off on ``unique_keys``,
the pinned-reader worst case), it migrates a fresh schema, enqueues the
jobs (distinct args) with ``App.enqueue_many``, runs ``awa-fast supervise``
until every job completed and the leader's sweep emptied ``unique_keys``,
stops it, runs ``ANALYZE`` and reports ``n_dead_tup`` per table from
``pg_stat_user_tables`` (and ``pgstattuple`` of ``unique_keys`` when the
extension is available). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import psycopg

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from awa_fast import Unique  # noqa: E402
from awa_fast.app import App  # noqa: E402
from awa_fast.storage import Storage  # noqa: E402
from awa_fast.storage.migrate import migrate  # noqa: E402

KIND, QUEUE = "bench.noop", "bench"


def q1(conn: psycopg.Connection, text: str, params: Any = None) -> Any:
    row = conn.execute(text, params).fetchone()
    return None if row is None else row[0]


def run_mode(dsn: str, mode: str, n: int, workdir: pathlib.Path) -> dict[str, Any]:
    schema = f"bench_unique_{mode.replace('-', '_')}"
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    migrate(dsn, schema)
    app = App(dsn, schema, default_queue=QUEUE)
    with psycopg.connect(dsn, autocommit=True) as c:
        if mode == "unique-no-autovacuum":
            c.execute(f'ALTER TABLE "{schema}".unique_keys SET (autovacuum_enabled = false)')
    t0 = time.perf_counter()
    unique = Unique() if mode.startswith("unique") else None
    done = 0
    for start in range(0, n, 10_000):
        r = app.enqueue_many(KIND, [{"n": i} for i in range(start, min(n, start + 10_000))], queue=QUEUE,
                             unique=unique)
        done += int(r)
    enqueue_s = time.perf_counter() - t0
    app.close()
    assert done == n, done
    log = open(workdir / f"{mode}.log", "wb")  # noqa: SIM115
    sup = subprocess.Popen([sys.executable, "-m", "awa_fast.cli", "--log-level", "WARNING", "supervise",
                            "awa_fast.bench:app", "--schema", schema, "--dsn", dsn, "--queue",
                            f"{QUEUE}:stripes=2,concurrency=64", "--home", str(workdir / "home")],
                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    storage = Storage(schema)
    t1 = time.perf_counter()
    drain_s = None
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            while True:
                assert sup.poll() is None, (workdir / f"{mode}.log").read_text()[-2000:]
                completed = storage.queue_terminal_counts(c).get(QUEUE, {}).get("completed", 0)
                keys = q1(c, f'SELECT count(*) FROM "{schema}".unique_keys')
                if completed >= n and drain_s is None:
                    drain_s = time.perf_counter() - t1
                if completed >= n and keys == 0:
                    break
                if time.perf_counter() - t1 > 1800:
                    raise RuntimeError(f"{mode}: {completed} completed, {keys} keys left after 30 min")
                time.sleep(0.2)
        drained_s = time.perf_counter() - t1
    finally:
        sup.terminate()
        sup.wait(60)
        log.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'ANALYZE "{schema}".unique_keys')
        c.execute(f"ANALYZE")  # noqa: F541
        time.sleep(1.0)  # statistics reach pg_stat_user_tables asynchronously (at most ~0.5 s)
        rows = c.execute("SELECT relname, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_del, autovacuum_count "
                         "FROM pg_stat_user_tables WHERE schemaname = %s AND (n_dead_tup > 0 OR "
                         "relname = 'unique_keys') ORDER BY n_dead_tup DESC", (schema,)).fetchall()
        pgst = None
        try:
            c.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            pgst = c.execute(f"SELECT dead_tuple_count, tuple_count, table_len FROM "
                             f"pgstattuple('\"{schema}\".unique_keys')").fetchone()
        except psycopg.Error:
            pass
        after_autovacuum = None
        if mode == "unique":
            # how long until autovacuum reclaims them, as the server is configured
            t2 = time.perf_counter()
            while time.perf_counter() - t2 < 150:
                row = c.execute("SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables "
                                "WHERE schemaname = %s AND relname = 'unique_keys'", (schema,)).fetchone()
                if row and row[1] > 0:
                    after_autovacuum = {"n_dead_tup": row[0], "waited_s": round(time.perf_counter() - t2, 1)}
                    break
                time.sleep(1.0)
    tables = {r[0]: {"n_dead_tup": r[1], "ins": r[2], "upd": r[3], "del": r[4], "autovacuums": r[5]}
              for r in rows}
    return {"mode": mode, "jobs": n, "enqueue_s": round(enqueue_s, 2), "drain_s": round(drain_s or 0, 2),
            "drain_and_sweep_s": round(drained_s, 2),
            "dead_tuples_total": sum(t["n_dead_tup"] for t in tables.values()),
            "unique_keys": tables.get("unique_keys"),
            "pgstattuple_unique_keys": None if pgst is None else
            {"dead_tuple_count": pgst[0], "tuple_count": pgst[1], "table_len": pgst[2]},
            "tables_with_dead_tuples": {k: v["n_dead_tup"] for k, v in tables.items() if v["n_dead_tup"]},
            "unique_keys_after_autovacuum": after_autovacuum}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--modes", default="plain,unique,unique-no-autovacuum")
    args = p.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="awa-unique-dead-"))
    server = contextlib.ExitStack()  # a private server when no --dsn, stopped at the end
    dsn = args.dsn
    if not dsn:
        from awa_fast.embedded import private_server

        dsn = server.enter_context(private_server(workdir, settings={"max_connections": "200",
                                                                     "shared_buffers": "256MB"},
                                                  stop_mode="fast")).dsn
    try:
        out = {"jobs": args.jobs, "results": [run_mode(dsn, m, args.jobs, workdir) for m in args.modes.split(",")]}
        with psycopg.connect(dsn, autocommit=True) as c:
            out["autovacuum_naptime"] = q1(c, "SHOW autovacuum_naptime")
            out["server_version"] = q1(c, "SHOW server_version")
    finally:
        server.close()
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
