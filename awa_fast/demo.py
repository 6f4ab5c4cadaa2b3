"""The demo: migrate, bulk-enqueue by COPY, supervise until drained, report.

``python -m awa_fast.demo [--jobs N] [--dsn DSN]`` (``python3 tools/dev.py
demo`` runs it on the embedded server). It starts a real ``awa-fast
supervise`` process with two claimer stripes, waits until every job is
durably completed, prints throughput, latency percentiles and dead tuples,
then stops the supervisor with SIGTERM and checks it drained cleanly.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psycopg

from awa_fast.app import App
from awa_fast.jobs import Job
from awa_fast.progress import ProgressBar

app = App(schema="awa_fast_demo")


@app.job("demo.noop", queue="demo")
def noop(job: Job[Any]) -> None:
    """A handler that does nothing: the demo measures the queue, not the work."""


@app.job("demo.async_noop", queue="demo")
async def async_noop(job: Job[Any]) -> None:
    """The async twin, to show both kinds of handlers in one supervisor."""


def _latency(home: str, schema: str) -> dict[str, dict[str, float | None]]:
    from awa_fast.runtime.shm import ShmRing, read_locator
    from awa_fast.runtime.status import latency_summary

    found = read_locator(home, schema)
    if found is None:
        return {}
    ring = ShmRing.attach(found[0])
    try:
        return latency_summary(ring.snapshot())
    finally:
        ring.close()


def run_demo(dsn: str, jobs: int, stripes: int = 2) -> int:
    """Run the whole demo against ``dsn``; returns an exit code."""
    schema = app.storage.schema
    app.dsn = dsn
    with psycopg.connect(dsn, autocommit=True) as c:
        app.storage.schema_drop(c)
    app.migrate()
    print(f"awa-fast demo: schema {schema} migrated; enqueueing {jobs:,} jobs by COPY")
    started = time.perf_counter()
    half = jobs // 2
    bar = ProgressBar(jobs, "  enqueue")
    app.enqueue_many("demo.noop", ({"n": i} for i in range(half)), progress=bar, chunk=10_000)
    app.enqueue_many("demo.async_noop", ({"n": i} for i in range(jobs - half)),
                     progress=lambda n: bar(half + n), chunk=10_000)
    enqueue_s = time.perf_counter() - started
    print(f"  enqueued {jobs:,} in {enqueue_s:.2f}s ({jobs / enqueue_s:,.0f} jobs/s)")
    env = dict(os.environ, AWA_FAST_DSN=dsn)
    home = tempfile.mkdtemp(prefix="awa-fast-demo-")
    # -P: the working directory (a source checkout, say) must not shadow the installed awa_fast
    cmd = [sys.executable, "-P", "-m", "awa_fast.cli", "--log-level", "WARNING", "supervise", "awa_fast.demo:app",
           "--schema", schema, "--home", home, "--queue", f"demo:stripes={stripes},concurrency=64,batch=1024"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    conn = psycopg.connect(dsn, autocommit=True)
    bar = ProgressBar(jobs, "  drain  ")
    try:
        done = 0
        while done < jobs:
            if proc.poll() is not None:
                print(f"supervisor exited early with code {proc.returncode}", file=sys.stderr)
                return 1
            done = app.storage.queue_terminal_counts(conn).get("demo", {}).get("completed", 0)
            bar(done)
            if done < jobs:
                time.sleep(0.1)
        drain_s = time.perf_counter() - t0
        stats = _latency(home, schema)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        counts = app.storage.queue_counts_exact(conn)
        dead = app.storage.dead_tuples(conn)
    finally:
        if proc.poll() is None:
            proc.kill()
        conn.close()
        shutil.rmtree(home, ignore_errors=True)
    print(f"  drained {jobs:,} jobs in {drain_s:.2f}s including process start-up "
          f"({jobs / drain_s:,.0f} jobs/s), {stripes} claimer stripes")
    print("  latency from enqueue, ms (bulk enqueue: mostly time spent queued): "
          + "; ".join(f"{k} " + ", ".join(f"{q}={v}" for q, v in sorted(p.items())) for k, p in stats.items()))
    print(f"  final counts: {counts.get('demo', {})}; dead tuples in the schema: {dead}")
    print(f"  supervisor stopped with SIGTERM: exit code {code} ({'clean drain' if code == 0 else 'NOT clean'})")
    ok = code == 0 and counts.get("demo", {}).get("completed") == jobs
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m awa_fast.demo")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--stripes", type=int, default=2)
    p.add_argument("--dsn", default=os.environ.get("AWA_FAST_DSN"))
    args = p.parse_args(argv)
    dsn = args.dsn
    if not dsn:
        from awa_fast.embedded import ensure_embedded

        dsn = ensure_embedded()
        print(f"awa-fast demo: embedded PostgreSQL running ({dsn})")
    code = run_demo(dsn, args.jobs, args.stripes)
    if not args.dsn:
        print("awa-fast demo: the embedded PostgreSQL keeps running for the next command; "
              "stop it with `.venv/bin/awa-fast db stop`")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
