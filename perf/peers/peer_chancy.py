"""chancy driver for the standard scenarios (runs in perf/peers/.venvs/chancy).

Fastest documented path for no-op jobs: an ``async`` job on the
``AsyncExecutor`` (no process pool), queue concurrency 100, LISTEN/NOTIFY
on; bulk enqueue = ``Chancy.push_many`` (batches of 1000 per transaction,
its default); single enqueue = ``Chancy.push``. Workers send job status
updates in batches (every ``send_outgoing_interval`` = 1 s), so a job is
durably complete when its row says ``succeeded``; the drain end is observed
by polling the count of unfinished rows every 50 ms (late by up to a poll).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import psycopg  # noqa: E402
from chancy import Chancy, Queue, Worker, job  # noqa: E402

logging.getLogger("chancy").setLevel(logging.ERROR)
QUEUE = "bench"
RECORDS: list = []


@job(queue=QUEUE)
async def bench_noop(*, i: int = 0) -> None:
    RECORDS.append((i, time.time()))


def make_app(dsn: str) -> Chancy:
    return Chancy(dsn, max_connection_pool_size=20, log=logging.getLogger("chancy"))


async def fresh(dsn: str, concurrency: int) -> None:
    async with make_app(dsn) as app:
        await app.migrate()
        await app.declare(Queue(QUEUE, concurrency=concurrency, executor=Chancy.Executor.Async,
                                polling_interval=1, eager_polling=True), upsert=True)


async def bulk(dsn: str, n: int) -> float:
    async with make_app(dsn) as app:
        jobs = [bench_noop.job.with_kwargs(i=i) for i in range(n)]
        t0 = time.perf_counter()
        async for _ in app.push_many(jobs):
            pass
        return time.perf_counter() - t0


async def worker(args) -> None:  # noqa: ANN001
    async with make_app(args.dsn) as app:
        w = Worker(app, register_signal_handlers=False)
        await w.start()
        while not common.stop_requested(args.stop_file):
            await asyncio.sleep(0.02)
        end = time.time()
        with contextlib.suppress(Exception):
            await w.stop(timeout=30)
    common.write_records(args.out, RECORDS + [(common.END, end)])


def producer(dsn: str, window, ready) -> tuple[int, list[float]]:  # noqa: ANN001
    async def run() -> tuple[int, list[float]]:
        async with make_app(dsn) as app:
            await app.push(bench_noop.job.with_kwargs(i=-1))
            return await common.insert_until(window, ready, lambda i: app.push(bench_noop.job.with_kwargs(i=i)))

    return asyncio.run(run())


def _unfinished(c: psycopg.Connection) -> int:
    return int(c.execute("SELECT count(*) FROM chancy_jobs WHERE state NOT IN ('succeeded', 'failed')")
               .fetchone()[0])


def main() -> int:
    args = common.parser("chancy").parse_args()
    if args.scenario == "worker":
        asyncio.run(worker(args))
        return 0
    conc = args.concurrency or 100
    asyncio.run(fresh(args.dsn, conc))
    settings = {"executor": "AsyncExecutor", "concurrency": conc, "procs": 1, "notifications": True,
                "eager_polling": True, "polling_interval": 1}
    if args.scenario == "bulk-enqueue":
        res = common.rate_result(args.jobs, asyncio.run(bulk(args.dsn, args.jobs)),
                                 "Chancy.push_many (1000 per transaction)")
    elif args.scenario == "concurrent-insert":
        res = common.concurrent_insert(producer, args.dsn, args.producers, args.seconds)
        res["method"] = "Chancy.push (one job, one transaction) per process"
    elif args.scenario == "drain":
        es = asyncio.run(bulk(args.dsn, args.jobs))
        w = common.ServeWorker(__file__, args)
        with psycopg.connect(args.dsn, autocommit=True) as c:
            deadline = time.time() + 1800
            while time.time() < deadline and _unfinished(c) > 0:
                time.sleep(0.05)
            end = time.time()
        starts = list(w.stop(timeout=120).values())
        res = common.drain_result(starts, end, args.jobs, es,
                                  "first handler start -> no unfinished chancy_jobs row (50 ms polls)")
    else:
        w = common.ServeWorker(__file__, args)
        time.sleep(3.0)

        async def produce() -> tuple[dict, float]:
            async with make_app(args.dsn) as app:
                async def one(i: int) -> int:
                    await app.push(bench_noop.job.with_kwargs(i=i))
                    return i

                return await common.steady(args.rate, args.seconds, one)

        sent, elapsed = asyncio.run(produce())
        time.sleep(3.0)  # status updates are flushed every second
        starts = w.stop()
        done, how = common.done_times(args.dsn, "chancy_jobs", "(kwargs->>'i')::int", "completed_at",
                                      "state = 'succeeded' AND (kwargs->>'i')::int >= 0")
        res = common.latency_summary(sent, starts, done, elapsed)
        res["method"] = (f"pickup: handler start - enqueue ack; e2e: chancy_jobs row in state succeeded, {how} "
                         "- enqueue ack (its completed_at is the worker's clock at job end, before the 1 s "
                         "status flush)")
    res.update({"peer": "chancy", "scenario": args.scenario, "settings": settings})
    common.emit(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
