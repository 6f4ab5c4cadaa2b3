"""The ``concurrent-insert`` scenario: ``--producers`` processes enqueueing one job per transaction.

Each producer is its own (spawned) process with its own autocommit
connection; all start and stop on one shared time window, set once every
producer has connected and warmed up. No workers run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from typing import Any

from awa_fast.bench.meters import CpuMeter
from awa_fast.bench.report import ms, percentiles
from awa_fast.bench.worker import KIND, QUEUE, client_app
from awa_fast.progress import ProgressBar


def insert_worker(dsn: str, schema: str, window: Any, out: Any, ready: Any) -> None:
    """One concurrent-insert producer: App.enqueue, own autocommit connection, inside the window."""
    client = client_app(dsn, schema)
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


def bench_concurrent_insert(args: argparse.Namespace, dsn: str, schema: str,
                            srv: dict[str, Any]) -> dict[str, Any]:
    """``concurrent-insert``: ``--producers`` processes, one durable commit per ``App.enqueue``."""
    p = int(args.producers)
    seconds = float(args.seconds)
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    window = ctx.Array("d", [0.0, 0.0])  # (start, stop), set once every producer is connected
    procs = [ctx.Process(target=insert_worker, args=(dsn, schema, window, out, ready), daemon=True)
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
    bar = ProgressBar(seconds, "  insert", "s")
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
            "enqueue_ms": ms(percentiles(lat)), "per_producer": [n for n, _ in results],
            "producer_pids": pids, "cpu": cpu_res,
            "notes": "each producer: its own process and autocommit connection, App.enqueue one job per "
                     "transaction (durable commit each); no workers running"}
