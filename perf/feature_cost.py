"""What the features of this round touch in a drain that uses none of them (issue 16's "when unused" bar).

Runs the drain bench's own steps (a fresh schema, one ``enqueue_many`` of
``--jobs`` no-op jobs, the bench supervisor with the default command) on an
embedded server started with ``pg_stat_statements`` (track = all) and
``track_functions = all``, and reports what does not depend on the load:

- per table of the schema: scans, index scans, rows inserted, updated and
  deleted during the drain (``pg_stat_user_tables``, read before the
  supervisor starts and after it stopped): a feature table that is read or
  written shows up here;
- per statement: calls, total and mean execution time, and share of all
  statement time (``pg_stat_statements``, reset before the supervisor starts;
  nested statements of the SQL functions counted too);
- per SQL function: calls and self time (``pg_stat_user_functions``);
- the CPU split of the drain (the bench's ``CpuMeter``) and the claimers'
  claim and flush counts.

``--pyspy FILE`` also samples the supervisor tree with py-spy (raw format,
``--subprocesses``, ``--pyspy-rate`` per second, ``--pyspy-gil``: only the
thread holding the GIL) for the drain's duration.

    .venv/bin/python perf/feature_cost.py --home /tmp/feature-cost-pg --schema bench_fc --jobs 200000
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import time
from typing import Any

import psycopg

from awa_fast.bench.drain import wait_done
from awa_fast.bench.meters import CpuMeter
from awa_fast.bench.procs import bench_supervisor
from awa_fast.bench.run import fresh_schema, server_info
from awa_fast.bench.worker import KIND, QUEUE, client_app
from awa_fast.embedded.servers import ensure_embedded

SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
            "pg_stat_statements.max": "10000", "track_functions": "all"}


def table_stats(c: psycopg.Connection, schema: str) -> dict[str, tuple[int, ...]]:
    c.execute("SELECT pg_stat_clear_snapshot()")
    rows = c.execute(
        "SELECT relname, coalesce(seq_scan, 0), coalesce(idx_scan, 0), n_tup_ins, n_tup_upd, n_tup_del "
        "FROM pg_stat_user_tables WHERE schemaname = %s", (schema,)).fetchall()
    return {r[0]: tuple(int(x) for x in r[1:]) for r in rows}


def func_stats(c: psycopg.Connection, schema: str) -> dict[str, tuple[int, float]]:
    rows = c.execute("SELECT funcname, calls, self_time FROM pg_stat_user_functions WHERE schemaname = %s",
                     (schema,)).fetchall()
    return {r[0]: (int(r[1]), float(r[2])) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True)
    ap.add_argument("--schema", default="bench_fc")
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--stripes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--pyspy", default=None, help="write a py-spy raw profile of the supervisor tree here")
    ap.add_argument("--pyspy-bin", default="py-spy")
    ap.add_argument("--pyspy-rate", type=int, default=250)
    ap.add_argument("--pyspy-gil", action="store_true", help="sample only the thread holding the GIL")
    ap.add_argument("--json", default=None, help="write the whole result here")
    args = ap.parse_args()
    if not args.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench'")
    dsn = ensure_embedded(pathlib.Path(args.home), settings=SETTINGS)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    srv = server_info(dsn)
    fresh_schema(dsn, args.schema)
    client = client_app(dsn, args.schema)
    client.enqueue_many(KIND, ({"n": i} for i in range(args.jobs)), queue=QUEUE, chunk=50_000)
    client.close()
    out: dict[str, Any] = {"jobs": args.jobs, "uptime_before": pathlib.Path("/proc/loadavg").read_text().split()[:3]}
    stats = psycopg.connect(dsn, autocommit=True)
    time.sleep(1.0)  # let the enqueue's table counters reach the shared statistics
    t_before = table_stats(stats, args.schema)
    f_before = func_stats(stats, args.schema)
    stats.execute("SELECT pg_stat_statements_reset()")
    sup = bench_supervisor(dsn, args.schema, args.stripes, args.concurrency, 0)
    cpu = CpuMeter(srv["postmaster_pid"])
    spy = None
    try:
        sup.start()
        if args.pyspy:
            spy = subprocess.Popen([args.pyspy_bin, "record", "--subprocesses", "--rate", str(args.pyspy_rate),
                                    "--format", "raw", "--nonblocking", "-o", args.pyspy, "--pid", str(sup.pid)]
                                   + (["--gil"] if args.pyspy_gil else []),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sup.attach()
        cpu.supervisor = sup.pid
        while sup.counters()["claimed"] == 0:
            sup.check_alive()
            time.sleep(0.001)
        cpu.start()
        t0 = time.perf_counter()
        wait_done(sup, args.jobs, timeout=max(120.0, args.jobs / 500.0))
        seconds = time.perf_counter() - t0
        out["cpu"] = cpu.stop()
        recs = sup.counters()["records"]
        out["work"] = {k: sum(r[k] for r in recs) for k in ("claim_calls", "empty_claims", "batches_flushed")}
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        sup.stop()
    finally:
        sup.close()
        if spy is not None and spy.poll() is None:
            spy.kill()
    out["seconds"] = round(seconds, 3)
    out["jobs_per_s"] = round(args.jobs / seconds, 1)
    out["uptime_after"] = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    time.sleep(1.0)
    t_after = table_stats(stats, args.schema)
    f_after = func_stats(stats, args.schema)
    out["tables"] = {name: dict(zip(("seq_scan", "idx_scan", "ins", "upd", "del"),
                                    (a - b for a, b in zip(v, t_before.get(name, (0,) * 5), strict=True)),
                                    strict=True)) for name, v in sorted(t_after.items())}
    out["functions"] = {name: {"calls": v[0] - f_before.get(name, (0, 0.0))[0],
                               "self_ms": round(v[1] - f_before.get(name, (0, 0.0))[1], 3)}
                        for name, v in sorted(f_after.items()) if v[0] - f_before.get(name, (0, 0.0))[0]}
    rows = stats.execute(
        "SELECT toplevel, calls, total_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 150) "
        "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "ORDER BY total_exec_time DESC").fetchall()
    top_total = sum(float(r[2]) for r in rows if r[0])
    out["statements_top_ms"] = round(top_total, 3)
    out["statements"] = [{"top": bool(r[0]), "calls": int(r[1]), "total_ms": round(float(r[2]), 3),
                          "mean_us": round(float(r[2]) * 1000 / max(1, int(r[1])), 2),
                          "share_of_top": round(float(r[2]) / top_total, 5) if top_total else None,
                          "query": r[3]} for r in rows]
    stats.close()
    text = json.dumps(out, indent=1)
    if args.json:
        pathlib.Path(args.json).write_text(text)
    print(json.dumps({k: out[k] for k in ("jobs", "seconds", "jobs_per_s", "cpu", "work", "uptime_before",
                                         "uptime_after", "statements_top_ms")}, indent=1))
    print("tables touched:")
    for name, d in out["tables"].items():
        if any(d.values()):
            print(f"  {name:40s} {d}")
    print("top-level statements:")
    for s in out["statements"]:
        if s["top"]:
            print(f"  {s['calls']:7d} {s['total_ms']:10.1f} ms {s['mean_us']:9.1f} us {s['share_of_top']:.4f}  "
                  f"{s['query'][:110]}")


if __name__ == "__main__":
    main()
