"""pgqueuer driver for the standard scenarios (runs in perf/peers/.venvs/pgqueuer).

Fastest documented path: asyncpg driver; bulk enqueue = one ``Queries.enqueue``
call with lists (unnest insert); workers = ``QueueManager.run(batch_size=B)``,
``mode=drain`` for the drain (returns after its completion-log buffer has been
flushed, so that return is the last durable completion). Completion = the
job row deleted and a ``pgqueuer_log`` row written, buffered per worker
(flushed at ``batch_size`` items or on the buffer timeout).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import asyncpg  # noqa: E402
import common  # noqa: E402
from pgqueuer.db import AsyncpgDriver  # noqa: E402
from pgqueuer.qm import QueueManager  # noqa: E402
from pgqueuer.queries import Queries  # noqa: E402
from pgqueuer.types import QueueExecutionMode  # noqa: E402

ENTRY = "bench_noop"
PAYLOAD = b'{"n": 1}'


async def fresh(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    q = Queries(AsyncpgDriver(conn))
    try:
        await q.uninstall()
    except Exception:  # noqa: BLE001 - not installed yet
        pass
    await q.install()
    await conn.close()


async def bulk(dsn: str, n: int, chunk: int = 50_000) -> float:
    conn = await asyncpg.connect(dsn)
    q = Queries(AsyncpgDriver(conn))
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        await q.enqueue([ENTRY] * k, [PAYLOAD] * k, [0] * k)
    s = time.perf_counter() - t0
    await conn.close()
    return s


async def worker(args) -> None:  # noqa: ANN001
    conn = await asyncpg.connect(args.dsn)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    records: list = []

    @qm.entrypoint(ENTRY)
    async def handle(job) -> None:  # noqa: ANN001
        records.append((job.id, time.time()))

    async def watch() -> None:
        while not common.stop_requested(args.stop_file):
            await asyncio.sleep(0.05)
        qm.shutdown.set()

    mode = QueueExecutionMode.drain if args.mode == "drain" else QueueExecutionMode.continuous
    watcher = asyncio.create_task(watch())
    await qm.run(batch_size=args.batch or 50, mode=mode, dequeue_timeout=timedelta(seconds=30))
    end = time.time()
    watcher.cancel()
    common.write_records(args.out, records + [(common.END, end)])
    await conn.close()


def producer(dsn: str, window, ready) -> tuple[int, list[float]]:  # noqa: ANN001
    async def run() -> tuple[int, list[float]]:
        conn = await asyncpg.connect(dsn)
        q = Queries(AsyncpgDriver(conn))
        await q.enqueue(ENTRY, PAYLOAD, 0)
        # autocommit: one transaction per job
        n, lat = await common.insert_until(window, ready, lambda i: q.enqueue(ENTRY, PAYLOAD, 0))
        await conn.close()
        return n, lat

    return asyncio.run(run())


def main() -> int:
    args = common.parser("pgqueuer").parse_args()
    if args.scenario == "worker":
        asyncio.run(worker(args))
        return 0
    asyncio.run(fresh(args.dsn))
    settings = {"driver": "asyncpg", "batch_size": args.batch or 50, "procs": args.procs}
    if args.scenario == "bulk-enqueue":
        res = common.rate_result(args.jobs, asyncio.run(bulk(args.dsn, args.jobs)),
                                 "Queries.enqueue(lists), 50k per call")
    elif args.scenario == "concurrent-insert":
        res = common.concurrent_insert(producer, args.dsn, args.producers, args.seconds)
        res["method"] = "Queries.enqueue(one job) on its own asyncpg connection (autocommit) per process"
    elif args.scenario == "drain":
        es = asyncio.run(bulk(args.dsn, args.jobs))
        starts, end = common.drain_workers(__file__, args, args.procs, timeout=600)
        res = common.drain_result(starts, end, args.jobs, es,
                                  "first handler start -> last worker's run(mode=drain) return (log buffer flushed)")
    else:  # latency
        w = common.ServeWorker(__file__, args)
        time.sleep(3.0)  # worker connected and idle-waiting

        async def produce() -> tuple[dict, float]:
            conn = await asyncpg.connect(args.dsn)
            q = Queries(AsyncpgDriver(conn))

            async def one(i: int) -> int:
                return int((await q.enqueue(ENTRY, PAYLOAD, 0))[0])

            r = await common.steady(args.rate, args.seconds, one)
            await conn.close()
            return r

        sent, elapsed = asyncio.run(produce())
        time.sleep(2.0)  # let the completion-log buffer flush
        starts = w.stop()

        done, how = common.done_times(args.dsn, "pgqueuer_log", "job_id", "created", "status = 'successful'")
        res = common.latency_summary(sent, starts, done, elapsed)
        res["method"] = f"pickup: handler start - enqueue ack; e2e: pgqueuer_log 'successful' row, {how} - enqueue ack"
    res.update({"peer": "pgqueuer", "scenario": args.scenario, "settings": settings})
    common.emit(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
