"""awa-pg (Awa's Rust engine, ADR-019 queue storage) driver (runs in perf/peers/.venvs/awa-pg).

Fastest documented path: ``AsyncClient.enqueue_many_copy`` (COPY straight into
queue storage) for bulk, ``AsyncClient.insert`` for single jobs,
``AsyncClient.start([{"name": q, "max_workers": W}])`` for workers (a fresh
install is switched to queue storage). The drain ends when ``shutdown()``
(which flushes pending completions) returns after the N-th handler ran
(``queue_stats()`` hung here, so it is not polled); the latency end-to-end
comes from each job's ``finalized_at``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import awa  # noqa: E402
import common  # noqa: E402

QUEUE = "bench"
RECORDS: list = []


@dataclass
class BenchNoop:
    i: int


def make_client(dsn: str, handler: bool = False) -> awa.AsyncClient:
    client = awa.AsyncClient(dsn, max_connections=20)
    if handler:
        @client.task(BenchNoop, queue=QUEUE)
        async def bench_noop(job) -> None:  # noqa: ANN001
            RECORDS.append((job.id, time.time()))
    return client


async def fresh(dsn: str) -> None:
    client = make_client(dsn)
    await client.migrate()
    try:
        await client.enqueue_many_copy([], queue=QUEUE)
    except Exception:  # noqa: BLE001 - "requires an active queue_storage backend": select it
        await client.install_queue_storage()
    await client.close()


async def bulk(dsn: str, n: int, chunk: int = 50_000) -> float:
    client = make_client(dsn)
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        await client.enqueue_many_copy([BenchNoop(i) for i in range(start, min(n, start + chunk))], queue=QUEUE)
    s = time.perf_counter() - t0
    await client.close()
    return s


async def worker(args) -> None:  # noqa: ANN001
    client = make_client(args.dsn, handler=True)
    await client.start([{"name": QUEUE, "max_workers": args.concurrency or 100}])
    while not common.stop_requested(args.stop_file):
        if args.mode == "drain" and len(RECORDS) >= args.expect:
            break
        await asyncio.sleep(0.005)
    await client.shutdown(timeout_ms=10_000)  # flushes pending completions
    end = time.time()
    await client.close()
    common.write_records(args.out, RECORDS + [(common.END, end)])


def producer(dsn: str, window, ready) -> tuple[int, list[float]]:  # noqa: ANN001
    async def run() -> tuple[int, list[float]]:
        client = make_client(dsn)
        await client.insert(BenchNoop(0), queue=QUEUE)
        n, lat = await common.insert_until(window, ready, lambda i: client.insert(BenchNoop(i), queue=QUEUE))
        await client.close()
        return n, lat

    return asyncio.run(run())


def main() -> int:
    args = common.parser("awa_pg").parse_args()
    if args.scenario == "worker":
        asyncio.run(worker(args))
        return 0
    asyncio.run(fresh(args.dsn))
    settings = {"max_workers": args.concurrency or 100, "procs": 1, "storage": "queue storage (fresh install)"}
    if args.scenario == "bulk-enqueue":
        res = common.rate_result(args.jobs, asyncio.run(bulk(args.dsn, args.jobs)),
                                 "enqueue_many_copy, 50k per call")
    elif args.scenario == "concurrent-insert":
        res = common.concurrent_insert(producer, args.dsn, args.producers, args.seconds)
        res["method"] = "AsyncClient.insert (one job, one transaction) per process"
    elif args.scenario == "drain":
        es = asyncio.run(bulk(args.dsn, args.jobs))
        starts, end = common.drain_workers(__file__, args, 1, timeout=1800, expect=args.jobs)
        res = common.drain_result(starts, end, args.jobs, es,
                                  "first handler start -> return of client.shutdown() (flushes completions) "
                                  "called once the N-th handler ran (polled every 5 ms): an upper bound")
    else:
        w = common.ServeWorker(__file__, args)
        time.sleep(3.0)

        async def produce() -> tuple[dict, float, dict]:
            client = make_client(args.dsn)

            async def one(i: int) -> int:
                return int((await client.insert(BenchNoop(i), queue=QUEUE)).id)

            sent, elapsed = await common.steady(args.rate, args.seconds, one)
            await asyncio.sleep(2.0)
            done, how = common.done_times(args.dsn, "awa.done_entries", "job_id", "finalized_at")
            for jid in sent:
                if jid not in done:  # not in done_entries (yet): the job's own finalized_at
                    try:
                        job = await client.get_job(jid)
                    except Exception:  # noqa: BLE001 - "job not found"
                        continue
                    if job.finalized_at:
                        done[jid] = dt.datetime.fromisoformat(str(job.finalized_at).replace("Z", "+00:00")).timestamp()
            await client.close()
            return sent, elapsed, (done, how)

        sent, elapsed, (done, how) = asyncio.run(produce())
        starts = w.stop()
        res = common.latency_summary(sent, starts, done, elapsed)
        res["method"] = f"pickup: handler start - enqueue ack; e2e: awa.done_entries row, {how} - enqueue ack"
    res.update({"peer": "awa-pg", "awa_pg_version": "0.6.9", "scenario": args.scenario, "settings": settings})
    common.emit(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
