"""procrastinate driver for the standard scenarios (runs in perf/peers/.venvs/procrastinate).

Fastest documented path: psycopg 3 async connector; bulk enqueue =
``Task.batch_defer_async`` (one multi-row insert per call); workers =
``App.run_worker_async(concurrency=C)`` with LISTEN/NOTIFY, ``wait=False``
for the drain (returns once it has caught up: every job finished, each one
completed in its own statement at once). Each job's completion updates its
row and appends a ``procrastinate_events`` row (trigger), timestamped ``now()``.
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
import procrastinate  # noqa: E402

logging.getLogger("procrastinate").setLevel(logging.ERROR)

RECORDS: list = []


def make_app(dsn: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_noop", queue="bench", pass_context=True)
    async def bench_noop(context, i: int = 0) -> None:  # noqa: ANN001
        RECORDS.append((context.job.id, time.time()))

    return app


async def fresh(dsn: str) -> None:
    app = make_app(dsn)
    async with app.open_async():
        with contextlib.suppress(Exception):
            await app.schema_manager.apply_schema_async()


async def bulk(dsn: str, n: int, chunk: int = 10_000) -> float:
    app = make_app(dsn)
    task = app.tasks["bench_noop"]
    async with app.open_async():
        t0 = time.perf_counter()
        for start in range(0, n, chunk):
            await task.batch_defer_async(*({"i": i} for i in range(start, min(n, start + chunk))))
        return time.perf_counter() - t0


async def worker(args) -> None:  # noqa: ANN001
    app = make_app(args.dsn)
    async with app.open_async():
        run = asyncio.create_task(app.run_worker_async(
            queues=["bench"], concurrency=args.concurrency or 16, wait=args.mode != "drain",
            install_signal_handlers=False, listen_notify=True, delete_jobs="never"))
        while not run.done():
            if common.stop_requested(args.stop_file):
                run.cancel()
                break
            await asyncio.sleep(0.02)
        with contextlib.suppress(asyncio.CancelledError):
            await run
        end = time.time()
    common.write_records(args.out, RECORDS + [(common.END, end)])


def producer(dsn: str, window, ready) -> tuple[int, list[float]]:  # noqa: ANN001
    async def run() -> tuple[int, list[float]]:
        app = make_app(dsn)
        task = app.tasks["bench_noop"]
        async with app.open_async():
            await task.defer_async(i=0)
            return await common.insert_until(window, ready, lambda i: task.defer_async(i=i))

    return asyncio.run(run())


def main() -> int:
    args = common.parser("procrastinate").parse_args()
    if args.scenario == "worker":
        asyncio.run(worker(args))
        return 0
    asyncio.run(fresh(args.dsn))
    settings = {"connector": "PsycopgConnector", "concurrency": args.concurrency or 16, "procs": args.procs,
                "listen_notify": True}
    if args.scenario == "bulk-enqueue":
        res = common.rate_result(args.jobs, asyncio.run(bulk(args.dsn, args.jobs)),
                                 "Task.batch_defer_async, 10k per call")
    elif args.scenario == "concurrent-insert":
        res = common.concurrent_insert(producer, args.dsn, args.producers, args.seconds)
        res["method"] = "Task.defer_async (one job, one transaction) per process"
    elif args.scenario == "drain":
        es = asyncio.run(bulk(args.dsn, args.jobs))
        starts, end = common.drain_workers(__file__, args, args.procs, timeout=1800)
        res = common.drain_result(starts, end, args.jobs, es,
                                  "first handler start -> last worker's run_worker_async(wait=False) return")
    else:
        w = common.ServeWorker(__file__, args)
        time.sleep(3.0)

        async def produce() -> tuple[dict, float]:
            app = make_app(args.dsn)
            task = app.tasks["bench_noop"]
            async with app.open_async():
                async def one(i: int) -> int:
                    return int(await task.defer_async(i=i))

                return await common.steady(args.rate, args.seconds, one)

        sent, elapsed = asyncio.run(produce())
        time.sleep(1.0)
        starts = w.stop()
        done, how = common.done_times(args.dsn, "procrastinate_events", "job_id", "at", "type = 'succeeded'")
        res = common.latency_summary(sent, starts, done, elapsed)
        res["method"] = ("pickup: handler start - enqueue ack; "
                         f"e2e: procrastinate_events 'succeeded', {how} - enqueue ack")
    res.update({"peer": "procrastinate", "scenario": args.scenario, "settings": settings})
    common.emit(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
