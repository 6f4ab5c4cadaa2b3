"""Bulk enqueue, one buffer against streamed, alternated on one server: where the wall time goes.

The two arms write the same rows into one schema, on one autocommit
connection, in one transaction per call (``--jobs`` rows, ``--chunk`` rows
per COPY, payload ``{n, to}``):

* ``buffer``: every payload checked and encoded first (``encode_payloads``),
  then one ``Storage.job_enqueue_copy`` per chunk with the encoded payloads
  (one COPY buffer each): the path before the streamed enqueue;
* ``stream``: ``Client.enqueue_many``, which checks, encodes and sends each
  chunk a block of ``copy_rows.COPY_BLOCK`` rows at a time.

Per call it reports jobs/s, the client's CPU per job (this thread), and the
server backend's time split from ``/proc/<pid>/schedstat``: on CPU, waiting
for a CPU (run queue: other sessions' load), and asleep (waiting for the
client's data, for a lock or for its own WAL flush). The asleep time is what
streaming can remove, and unlike jobs/s it hardly moves with the machine's
load. The backend must run on this machine (a local embedded server).

    python perf/bulk_stream_ab.py --home /tmp/some-home [--schema bench_x] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from awa_fast.client import Client, encode_payloads
from awa_fast.embedded.servers import ensure_embedded
from awa_fast.storage.migrate import migrate

QUEUE, KIND = "bench", "bench.noop"


def _sched(pid: int) -> tuple[int, int]:
    """(ns on CPU, ns waiting in the run queue) of ``pid``."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
        on_cpu, run_queue = f.read().split()[:2]
    return int(on_cpu), int(run_queue)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", help="embedded server home (started if needed)")
    p.add_argument("--dsn", help="a local server instead of --home")
    p.add_argument("--schema", default="bench_bulk_stream_ab", help="dropped and migrated; must start with bench")
    p.add_argument("--jobs", type=int, default=200_000)
    p.add_argument("--chunk", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    if not a.schema.startswith("bench"):
        p.error("--schema must start with 'bench'")
    if (a.dsn is None) == (a.home is None):
        p.error("give --home or --dsn")
    dsn = a.dsn if a.dsn is not None else ensure_embedded(pathlib.Path(a.home))
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{a.schema}" CASCADE')
    migrate(dsn, a.schema)
    cli = Client(None, a.schema)
    conn = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:bulk_stream_ab")
    backend = conn.info.backend_pid
    n, chunk = a.jobs, a.chunk

    def buffer_arm(items: list[Any]) -> None:
        payloads = encode_payloads(items, "args", cli.max_payload_bytes)
        with conn.transaction():
            for s in range(0, n, chunk):
                cli.storage.job_enqueue_copy(conn, QUEUE, 2, KIND, payloads[s:s + chunk], None, 25)

    def stream_arm(items: list[Any]) -> None:
        cli.enqueue_many(KIND, items, queue=QUEUE, conn=conn, chunk=chunk)

    arms: dict[str, Callable[[list[Any]], None]] = {"buffer": buffer_arm, "stream": stream_arm}
    stream_arm([{"warm": i} for i in range(100)])
    results: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            items = [{"n": i, "to": f"user{i}@example.com"} for i in range(n)]
            load = os.getloadavg()[0]
            cpu0, rq0 = _sched(backend)
            c0, t0 = time.thread_time(), time.perf_counter()
            arms[name](items)
            wall, client = time.perf_counter() - t0, time.thread_time() - c0
            cpu1, rq1 = _sched(backend)
            on_cpu, run_queue = (cpu1 - cpu0) / 1e9, (rq1 - rq0) / 1e9
            results[name].append({"jobs_per_s": n / wall, "client_us": client / n * 1e6,
                                  "backend_us": on_cpu / n * 1e6, "run_queue_ms": run_queue * 1e3,
                                  "asleep_ms": (wall - on_cpu - run_queue) * 1e3, "load": load})
            conn.execute(f'TRUNCATE "{a.schema}".ready_entries, "{a.schema}".ready_segments')
            conn.execute("CHECKPOINT")
    print(f"{n:,} jobs, {chunk:,} per COPY, {a.rounds} alternating rounds; PostgreSQL "
          f"{conn.info.server_version}; load {os.getloadavg()[0]:.2f}")
    for name, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        rates = " ".join(f"{x['jobs_per_s']:8.0f}" for x in rows)
        asleep = " ".join(f"{x['asleep_ms']:.0f}" for x in rows)
        print(f"{name:7s} jobs/s {rates} (median {med['jobs_per_s']:,.0f})")
        print(f"        client {med['client_us']:.2f} us/job, backend on CPU {med['backend_us']:.2f} us/job, "
              f"run queue {med['run_queue_ms']:.0f} ms, asleep {asleep} ms (median {med['asleep_ms']:.0f}); "
              f"load {min(x['load'] for x in rows):.1f}-{max(x['load'] for x in rows):.1f}")
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
